/* Inclusive prefix sum within each work-group (Hillis-Steele, double-buffered local memory). */
#ifndef WG
#define WG 128
#endif

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void scan_wg(__global const int *x, __global int *y)
{
    __local int buf[2][WG];
    size_t gid = get_global_id(0), lid = get_local_id(0);
    int src = 0;
    buf[src][lid] = x[gid];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint off = 1; off < WG; off <<= 1) {
        int v = buf[src][lid];
        if (lid >= off)
            v += buf[src][lid - off];
        buf[1 - src][lid] = v;
        src = 1 - src;
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    y[gid] = buf[src][lid];
}

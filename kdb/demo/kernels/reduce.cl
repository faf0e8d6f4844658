/* Reduction in local memory: each work-group of WG items writes one partial sum. */
#ifndef WG
#define WG 64
#endif

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void reduce_sum(__global const float *x, __global float *partial, const uint n)
{
    __local float buf[WG];
    size_t gid = get_global_id(0), lid = get_local_id(0);
    buf[lid] = gid < n ? x[gid] : 0.0f;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint s = WG / 2; s > 0; s >>= 1) {
        if (lid < s)
            buf[lid] += buf[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0)
        partial[get_group_id(0)] = buf[0];
}

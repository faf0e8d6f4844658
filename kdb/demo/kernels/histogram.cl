/* Histogram with local-memory atomics, merged into the global bins with global atomics. */
#ifndef BINS
#define BINS 64
#endif

__kernel void histogram(__global const uint *x, __global uint *bins, const uint n)
{
    __local uint local_bins[BINS];
    size_t lid = get_local_id(0), lsz = get_local_size(0);
    for (size_t b = lid; b < BINS; b += lsz)
        local_bins[b] = 0;
    barrier(CLK_LOCAL_MEM_FENCE);
    size_t gid = get_global_id(0);
    if (gid < n)
        atomic_inc(&local_bins[x[gid] % BINS]);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (size_t b = lid; b < BINS; b += lsz)
        atomic_add(&bins[b], local_bins[b]);
}

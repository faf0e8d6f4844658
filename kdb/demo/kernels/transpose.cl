/* Matrix transpose through a padded local-memory tile (rows, cols multiples of TILE). */
#ifndef TILE
#define TILE 16
#endif

__kernel __attribute__((reqd_work_group_size(TILE, TILE, 1)))
void transpose(__global const float *in, __global float *out, const uint rows, const uint cols)
{
    __local float tile[TILE][TILE + 1];
    uint x = get_global_id(0), y = get_global_id(1);
    uint lx = get_local_id(0), ly = get_local_id(1);
    tile[ly][lx] = in[y * cols + x];
    barrier(CLK_LOCAL_MEM_FENCE);
    uint ox = get_group_id(1) * TILE + lx;
    uint oy = get_group_id(0) * TILE + ly;
    out[oy * rows + ox] = tile[lx][ly];
}

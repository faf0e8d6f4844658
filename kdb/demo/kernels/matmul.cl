/* Tiled matrix multiply C = A B (row-major, sizes multiples of TILE). */
#ifndef TILE
#define TILE 8
#endif

__kernel __attribute__((reqd_work_group_size(TILE, TILE, 1)))
void matmul(__global const float *A, __global const float *B, __global float *C,
            const uint M, const uint N, const uint K)
{
    __local float As[TILE][TILE];
    __local float Bs[TILE][TILE];
    uint col = get_global_id(0), row = get_global_id(1);
    uint lc = get_local_id(0), lr = get_local_id(1);
    float acc = 0.0f;
    for (uint t = 0; t < K; t += TILE) {
        As[lr][lc] = A[row * K + t + lc];
        Bs[lr][lc] = B[(t + lr) * N + col];
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint k = 0; k < TILE; ++k)
            acc += As[lr][k] * Bs[k][lc];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    C[row * N + col] = acc;
}

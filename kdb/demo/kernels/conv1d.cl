/* 1D convolution (a stencil of 2*RADIUS+1 taps) with zero padding at the edges. */
#ifndef RADIUS
#define RADIUS 2
#endif

__kernel void conv1d(__global const float *x, __constant float *w, __global float *y,
                     const int n)
{
    int i = get_global_id(0);
    if (i >= n)
        return;
    float acc = 0.0f;
    for (int k = -RADIUS; k <= RADIUS; ++k) {
        int j = i + k;
        if (j >= 0 && j < n)
            acc += w[k + RADIUS] * x[j];
    }
    y[i] = acc;
}

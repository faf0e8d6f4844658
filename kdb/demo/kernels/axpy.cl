/* Elementwise: y = a*x + y. REAL is chosen with -DREAL=float or -DREAL=double. */
#ifndef REAL
#define REAL float
#endif
#if defined(cl_khr_fp64)
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif

__kernel void axpy(const REAL a, __global const REAL *x, __global REAL *y, const uint n)
{
    size_t i = get_global_id(0);
    if (i < n)
        y[i] = a * x[i] + y[i];
}

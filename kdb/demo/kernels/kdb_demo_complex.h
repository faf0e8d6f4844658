/* Complex arithmetic on 2-vectors (re, im). A header included by cmul.cl: kdb keys the
 * program on this file's content, so editing it makes the next build miss. */
#ifndef KDB_DEMO_COMPLEX_H
#define KDB_DEMO_COMPLEX_H

#ifdef CPLX_DOUBLE
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
typedef double2 cplx_t;
typedef double real_t;
#else
typedef float2 cplx_t;
typedef float real_t;
#endif

inline cplx_t cplx_mul(cplx_t a, cplx_t b)
{
    return (cplx_t)(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x);
}

inline cplx_t cplx_conj(cplx_t a)
{
    return (cplx_t)(a.x, -a.y);
}

#endif

/* Complex elementwise z = x * conj(y) + z; -DCPLX_DOUBLE picks complex128 over complex64. */
#include "kdb_demo_complex.h"

__kernel void cmul_acc(__global const cplx_t *x, __global const cplx_t *y, __global cplx_t *z,
                       const uint n)
{
    size_t i = get_global_id(0);
    if (i < n)
        z[i] = cplx_mul(x[i], cplx_conj(y[i])) + z[i];
}

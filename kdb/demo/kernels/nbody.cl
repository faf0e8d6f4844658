/* Gravitational accelerations of N bodies (O(N^2), float4 positions with mass in .w). */
#ifndef SOFTENING
#define SOFTENING 1e-3f
#endif

__kernel void nbody_accel(__global const float4 *pos, __global float4 *acc, const uint n)
{
    size_t i = get_global_id(0);
    if (i >= n)
        return;
    float3 pi = pos[i].xyz;
    float3 a = (float3)(0.0f);
    for (uint j = 0; j < n; ++j) {
        float3 d = pos[j].xyz - pi;
        float r2 = dot(d, d) + SOFTENING;
        float inv = rsqrt(r2);
        a += d * (pos[j].w * inv * inv * inv);
    }
    acc[i] = (float4)(a, 0.0f);
}

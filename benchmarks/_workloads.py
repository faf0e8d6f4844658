"""The inputs of the benchmarks, generated the same way in the parent and in every child.

Nothing here imports kdb, pyopencl or numpy at module level: a child imports this before it
starts its clocks.
"""

from __future__ import annotations

import random
from typing import Any

#: One expression per kernel family; ``C`` is a per-kernel constant, ``x`` the input element.
_EXPRS = (
    "x * s + C",
    "sqrt(fabs(x)) * C + s",
    "sin(x) * C - s",
    "x * x - C * s",
    "exp(-x * C) + s",
    "fmax(x, C) * s",
    "(x + C) / (1.0f + s * s)",
    "cos(x * C) + s * x",
)

#: Work items per launch in the first-launch phase.
GLOBAL_SIZE = 256


def kernels(n: int) -> list[dict[str, str]]:
    """``n`` distinct small OpenCL programs, one kernel each: ``{"name", "source"}``.

    Every kernel takes ``(__global float *out, __global const float *a, const float s)``,
    so one launch loop runs them all. Odd families loop, so the programs differ in shape
    as well as in constants.

    >>> ks = kernels(20)
    >>> len({k["source"] for k in ks}), ks[3]["name"]
    (20, 'k3')
    """
    out = []
    for i in range(n):
        expr = _EXPRS[i % len(_EXPRS)].replace("C", f"{i + 1}.25f")
        name = f"k{i}"
        if (i // len(_EXPRS)) % 2:
            body = (f"float acc = 0.0f;\n"
                    f"    for (int j = 0; j < {4 + i % 5}; ++j) {{ float x = a[g] + j; "
                    f"acc += {expr}; }}\n"
                    f"    out[g] = acc;")
        else:
            body = f"float x = a[g];\n    out[g] = {expr};"
        src = (f"__kernel void {name}(__global float *out, __global const float *a, "
               f"const float s)\n{{\n    int g = get_global_id(0);\n    {body}\n}}\n")
        out.append({"name": name, "source": src})
    return out


def compressible(size: int, seed: int) -> bytes:
    """``size`` random-looking bytes that zstd shrinks about 2x (4 bits of entropy a byte),
    close to what it does to PoCL program binaries (docs/design.md section 5)."""
    rnd = random.Random(seed)
    return bytes(b & 0x0F | 0x40 for b in rnd.randbytes(size))


#: Arch ids of the synthetic entries: safe ids no real device has.
HIT_ARCH = "bench-hit"
SCALE_ARCH = "bench-scale"


def hit_attrs(size: int) -> dict[str, Any]:
    """Keyword arguments of the HashAttributes of the hit-cost entry of ``size`` bytes."""
    return {"backend": "bench", "source": f"__kernel void hit_{size}() {{}}\n",
            "arch": HIT_ARCH, "build_options": ("-DSIZE=%d" % size,),
            "compiler": (("bench", "1"),), "name": f"hit_{size}"}


def scale_attrs(i: int) -> dict[str, Any]:
    """Keyword arguments of the HashAttributes of synthetic entry ``i`` of the scale test."""
    return {"backend": "bench", "source": f"__kernel void s{i}(__global float *a) {{ a[0] = {i}; }}\n",
            "arch": SCALE_ARCH, "build_options": ("-DN=64",), "compiler": (("bench", "1"),),
            "name": f"s{i}"}


CUDA_SOURCE = r"""
extern "C" __global__ void saxpy(int n, float a, const float *x, float *y)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""

"""kdb for CUDA: cubins built by nvcc or NVRTC for any ``sm_XX``, loaded with pycuda.

    import kdb.cuda
    cubin = kdb.cuda.compile(source, arch="sm_90", options=["-DN=64"])   # bytes, no GPU needed

or, in code written for pycuda::

    from kdb.cuda import SourceModule      # instead of pycuda.compiler.SourceModule
    mod = SourceModule(source)             # cubin from kdb, for the current context's device

Compiling needs nvcc (``KDB_NVCC``, else ``$CUDA_HOME/bin/nvcc``, else PATH) or NVRTC
(``pip install 'kdb[cuda]'``, no toolkit); with neither, stored builds are served
(:mod:`kdb.backends.fallback`). Loading needs pycuda (``pip install 'kdb[pycuda]'``) and a GPU.
"""

from __future__ import annotations

from .backends.cuda import (
    COMPILERS,
    ENV_VARS,
    OUTPUTS,
    Nvcc,
    NvccIdentity,
    Nvrtc,
    NvrtcIdentity,
    SourceModule,
    attributes_for,
    check_arch,
    compile,
    compiler_kind,
    compiler_rank,
    cubin_arch,
    find_compiler,
    find_nvcc,
    find_nvrtc,
    identity,
    kernel_names,
    target_arches,
)

__all__ = ["COMPILERS", "ENV_VARS", "OUTPUTS", "Nvcc", "NvccIdentity", "Nvrtc",
           "NvrtcIdentity", "SourceModule", "attributes_for", "check_arch", "compile",
           "compiler_kind", "compiler_rank", "cubin_arch", "find_compiler", "find_nvcc",
           "find_nvrtc", "identity", "kernel_names", "target_arches"]

"""kdb for CUDA: cubins built by nvcc for any ``sm_XX``, loaded with pycuda.

    import kdb.cuda
    cubin = kdb.cuda.compile(source, arch="sm_90", options=["-DN=64"])   # bytes, no GPU needed

or, in code written for pycuda::

    from kdb.cuda import SourceModule      # instead of pycuda.compiler.SourceModule
    mod = SourceModule(source)             # cubin from kdb, for the current context's device

Compiling needs nvcc (``KDB_NVCC``, else ``$CUDA_HOME/bin/nvcc``, else PATH); loading needs
pycuda (``pip install 'kdb[cuda]'``) and a GPU.
"""

from __future__ import annotations

from .backends.cuda import (
    ENV_VARS,
    OUTPUTS,
    Nvcc,
    NvccIdentity,
    SourceModule,
    attributes_for,
    check_arch,
    compile,
    cubin_arch,
    find_nvcc,
    identity,
    kernel_names,
    target_arches,
)

__all__ = ["ENV_VARS", "OUTPUTS", "Nvcc", "NvccIdentity", "SourceModule", "attributes_for",
           "check_arch", "compile", "cubin_arch", "find_nvcc", "identity", "kernel_names",
           "target_arches"]

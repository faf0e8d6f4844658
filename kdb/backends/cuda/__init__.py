"""CUDA through nvcc or NVRTC: cubins (or PTX, fatbins) for any ``sm_XX``, served from kdb.

``compile(source, arch="sm_90")`` returns a cubin from the system ``sm_90.kdb``, else the user
tier, else from the compiler (nvcc's ``-cubin -arch=sm_90`` in a temporary directory, or
NVRTC), stored in the background. :class:`SourceModule` is the loading half: the cubin for
the current context's device, loaded with ``pycuda.driver.module_from_buffer``.

The rooms: :mod:`.nvcc` finds nvcc and works out its identity (:mod:`.nvrtc` the same for
NVRTC), :mod:`.keys` checks a request's arguments and makes its key, :mod:`.builds`
compiles and serves, :mod:`.loading` loads with pycuda. This module names them all.
"""

from __future__ import annotations

from .builds import compile
from .keys import (
    BACKEND,
    COMPILERS,
    ENV_VARS,
    OUTPUTS,
    RESERVED_OPTIONS,
    attributes_for,
    check_arch,
    compiler_kind,
    compiler_rank,
    cubin_arch,
    environment,
    find_compiler,
    kernel_names,
    split_options,
)
from .loading import SourceModule
from .nvcc import Nvcc, NvccIdentity, find_nvcc, identity, target_arches
from .nvrtc import Nvrtc, NvrtcIdentity, find_nvrtc

__all__ = ["BACKEND", "COMPILERS", "ENV_VARS", "OUTPUTS", "RESERVED_OPTIONS", "Nvcc",
           "NvccIdentity", "Nvrtc", "NvrtcIdentity", "SourceModule", "attributes_for",
           "check_arch", "compile", "compiler_kind", "compiler_rank", "cubin_arch",
           "environment", "find_compiler", "find_nvcc", "find_nvrtc", "identity",
           "kernel_names", "split_options", "target_arches"]


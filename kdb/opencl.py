"""kdb for OpenCL programs built with pyopencl.

    import kdb.opencl
    prg = kdb.opencl.build(ctx, source, options=["-DN=64"])   # a built pyopencl.Program

or, for code that should not change::

    import kdb.opencl; kdb.opencl.install()

Needs pyopencl (``pip install 'pyopencl[pocl]'`` gives a CPU device everywhere).
"""

from __future__ import annotations

try:
    import pyopencl  # noqa: F401
except ImportError as _err:  # pragma: no cover - exercised in an environment without pyopencl
    from .errors import BackendUnavailableError

    raise BackendUnavailableError(
        "kdb.opencl needs pyopencl: pip install 'pyopencl[pocl]' (PoCL gives a CPU device)"
    ) from _err

from .backends.opencl import (
    arch_of,
    attributes_for,
    build,
    compiler_identity,
    install,
    installed,
    kernel_names,
    uninstall,
)

__all__ = ["arch_of", "attributes_for", "build", "compiler_identity", "install", "installed",
           "kernel_names", "uninstall"]

"""kdb for Triton: compiled Triton kernels from kdb instead of ``~/.triton/cache``.

    import kdb.triton
    kdb.triton.install()     # every Triton kernel of this process

or with no code changed, for a program and every process it starts that has kdb:
``KDB_AUTO=1``, ``kdb run -- CMD`` or ``pytest --kdb``. For an
explicit target, without a GPU (``kdb pack`` does this)::

    kdb.triton.compile(ASTSource(fn=kernel, signature=..., constexprs=...),
                       GPUTarget("cuda", 90, 32))

Needs Triton (``pip install 'kdb[triton]'``).
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError as _err:  # pragma: no cover - exercised where Triton is not installed
    from .errors import BackendUnavailableError

    raise BackendUnavailableError("kdb.triton needs Triton: pip install 'kdb[triton]'") from _err

from .backends.triton import (
    ENV_MANAGER,
    MANAGER,
    arch_of,
    compile,
    install,
    installed,
    target,
    target_arch,
    uninstall,
)
from .backends.triton.cache import CacheManager

__all__ = ["ENV_MANAGER", "MANAGER", "CacheManager", "arch_of", "compile", "install",
           "installed", "target", "target_arch", "uninstall"]

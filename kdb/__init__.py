"""kdb: a persistent database of compiled GPU kernel binaries.

Frameworks ask kdb for a kernel instead of compiling it at start-up: a read-only *system*
database for the device's architecture answers first, then the writable *user* database;
only a miss compiles, and the result is stored for the next start.

    >>> import kdb
    >>> attrs = kdb.HashAttributes(backend="mybackend", source="kernel text", arch="sm_90")
    >>> len(attrs.key)
    64

Submodules load on first use (``import kdb`` stays cheap): ``kdb.opencl`` for pyopencl,
``kdb.cuda`` for nvcc, ``kdb.cli`` for the command line.
"""

from __future__ import annotations

from ._version import __version__

TYPE_CHECKING = False  # `import kdb` alone loads no typing (a hit does: zstandard imports it)
from .errors import (
    BackendUnavailableError,
    CacheFaultError,
    CompileError,
    ConfigError,
    InvalidArgumentError,
    KdbError,
    UnsafeArchError,
    UnsupportedTypeError,
)
from .keys import HashAttributes


__all__ = [
    "BackendUnavailableError",
    "CacheFaultError",
    "CompileError",
    "ConfigError",
    "HashAttributes",
    "Hit",
    "InvalidArgumentError",
    "KdbError",
    "KernelDB",
    "UnsafeArchError",
    "UnsupportedTypeError",
    "default_db",
    "__version__",
]

if TYPE_CHECKING:
    from .db import Hit, KernelDB, default_db


def __getattr__(name: str) -> object:
    # KernelDB pulls in sqlite3 and zstandard; load them when first needed.
    if name in ("KernelDB", "Hit", "default_db"):
        from . import db

        return getattr(db, name)
    raise AttributeError(f"module 'kdb' has no attribute {name!r}")

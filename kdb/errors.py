"""The one exception hierarchy of kdb.

Callers' mistakes raise a :class:`KdbError` subclass at once; faults of the cache itself (a
corrupt file, a locked database, a full disk) are logged and survived, unless ``KDB_STRICT=1``
asks for them to raise :class:`CacheFaultError`.
"""

from __future__ import annotations


class KdbError(Exception):
    """Base of every error kdb raises on purpose."""


class InvalidArgumentError(KdbError, ValueError):
    """An argument has the wrong value; the message says which and what is accepted."""


class UnsupportedTypeError(KdbError, TypeError):
    """A hash attribute has a type kdb cannot encode stably (use str, int, float, bool, bytes)."""


class UnsafeArchError(InvalidArgumentError):
    """An arch id that is not a safe file name (``[a-z0-9][a-z0-9_.+-]*``)."""


class ConfigError(KdbError):
    """An environment variable or setting holds a value kdb cannot use."""


class CompileError(KdbError):
    """The back end's compiler rejected a kernel; ``log`` holds the compiler's output."""

    def __init__(self, message: str, log: str = "", options: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.log = log
        self.options = options

    def __str__(self) -> str:
        text = super().__str__()
        if self.log:
            text += "\n--- build log ---\n" + self.log.rstrip()
        return text


class CacheFaultError(KdbError):
    """A fault of the cache itself, raised only when ``KDB_STRICT=1``; otherwise logged."""


class BackendUnavailableError(KdbError):
    """A back end's runtime (pyopencl, a device, nvcc) is missing; the message says how to get it."""


class CommandError(KdbError):
    """``kdb run`` could not start its command; ``exit_status`` is a shell's (127: not found,
    126: not executable)."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class PackError(KdbError):
    """Building a system database failed; the message names the kernel or input at fault."""


class WheelBuildError(KdbError):
    """The packaging tools could not build a system-database wheel."""

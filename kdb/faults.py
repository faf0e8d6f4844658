"""Faults of the cache itself: warn once and go on, or raise under ``KDB_STRICT=1``.

The cache never breaks the program that uses it; a corrupt or locked file costs a
recompile. ``KDB_STRICT=1`` turns each fault into :class:`~kdb.errors.CacheFaultError`
for test suites and CI that want to see them. A warning that is no fault (strict mode lets it
pass) is :func:`kdb.logs.warn_once`.
"""

from __future__ import annotations

from . import config, logs
from .errors import CacheFaultError

__all__ = ["fault", "reset"]

log = logs.get("kdb")


def fault(message: str, once: str | None = None) -> None:
    """Report a cache fault: raise if strict, else log a warning (once per ``once`` key)."""
    if config.flag(config.ENV_STRICT):
        raise CacheFaultError(message)
    if once is not None and not logs.first_time(once):
        log.debug("kdb: %s", message)
        return
    log.warning("kdb: %s", message)


def full_disk(err: BaseException) -> bool:
    """Whether ``err`` says the disk is full (``ENOSPC``, or SQLite's 'database or disk is
    full'): one cause, one warning, whichever write met it first (the key of
    :func:`full_disk_key`)."""
    import errno

    return (isinstance(err, OSError) and err.errno == errno.ENOSPC) or \
        "disk is full" in str(err) or "No space left" in str(err)


def full_disk_key(user_dir) -> str:
    """The ``once`` key of every full-disk warning about the user tier ``user_dir``."""
    return f"disk-full:{user_dir}"


def reset() -> None:
    """Forget which warnings were given (tests, and a process that wants them again)."""
    logs.forget_once()

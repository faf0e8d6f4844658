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


def reset() -> None:
    """Forget which warnings were given (tests, and a process that wants them again)."""
    logs.forget_once()

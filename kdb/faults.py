"""Faults of the cache itself: warn once and go on, or raise under ``KDB_STRICT=1``.

The cache never breaks the program that uses it; a corrupt or locked file costs a
recompile. ``KDB_STRICT=1`` turns each fault into :class:`~kdb.errors.CacheFaultError`
for test suites and CI that want to see them.
"""

from __future__ import annotations

import threading

from . import config, logs
from .errors import CacheFaultError

log = logs.get("kdb")
_seen: set[str] = set()
_lock = threading.Lock()


def fault(message: str, once: str | None = None) -> None:
    """Report a cache fault: raise if strict, else log a warning (once per ``once`` key)."""
    if config.flag(config.ENV_STRICT):
        raise CacheFaultError(message)
    if once is not None:
        with _lock:
            if once in _seen:
                log.debug("kdb: %s", message)
                return
            _seen.add(once)
    log.warning("kdb: %s", message)


def warn_once(key: str, message: str, *args: object) -> bool:
    """Log ``message`` at warning level the first time ``key`` is seen in this process."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    log.warning(message, *args)
    return True


def reset() -> None:
    """Forget which warnings were given (tests, and a process that wants them again)."""
    with _lock:
        _seen.clear()

"""kdb's loggers (:mod:`logging`, under ``kdb``) and its once-per-process warnings."""

from __future__ import annotations

import logging
import threading


def get(name: str = "kdb") -> logging.Logger:
    """The logger called ``name`` (``kdb``, or ``kdb.trace`` for ``KDB_TRACE``)."""
    return logging.getLogger(name)


def enable_output(logger: logging.Logger, prefix: str) -> None:
    """Send ``logger``'s debug records to stderr as ``prefix: message`` (``KDB_TRACE``),
    unless the program configured logging itself."""
    logger.setLevel(logging.DEBUG)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
        logger.addHandler(handler)


# -- once per process -------------------------------------------------------------------------

_seen: set[str] = set()
_seen_lock = threading.Lock()


def first_time(key: str) -> bool:
    """True the first time ``key`` is seen in this process (until :func:`forget_once`)."""
    with _seen_lock:
        if key in _seen:
            return False
        _seen.add(key)
        return True


def warn_once(key: str, message: str, *args: object) -> bool:
    """Log ``message`` on the ``kdb`` logger at warning level the first time ``key`` is
    seen in this process; True if it was logged."""
    if not first_time(key):
        return False
    get("kdb").warning(message, *args, stacklevel=2)
    return True


def forget_once(prefix: str = "") -> None:
    """Forget which once-keys were seen (tests, and a process that wants them again); with
    ``prefix``, only the keys that begin with it."""
    with _seen_lock:
        if prefix:
            _seen.difference_update([k for k in _seen if k.startswith(prefix)])
        else:
            _seen.clear()

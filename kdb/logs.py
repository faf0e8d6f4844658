"""kdb's loggers, without importing :mod:`logging` until a record can be emitted.

``import logging`` pulls in traceback, linecache, tokenize and string, a real share of a
bare Python start, on the path of a process that only serves hits. While
nobody has imported :mod:`logging`, nobody can have configured it, and unconfigured logging
drops debug and info records and writes a warning's message and a newline to ``sys.stderr``
(its last-resort handler): so does this module then, without the import. Once
:mod:`logging` is imported (by the program, pytest, or a record with a traceback), every
record goes to ``logging.getLogger(name)`` as usual, with the caller's line.
"""

from __future__ import annotations

import sys
import threading

_WARNING = 30


class LazyLogger:
    """The part of :class:`logging.Logger` kdb uses on its hot path (debug, warning,
    isEnabledFor), resolved on first real use."""

    __slots__ = ("name", "_logger")

    def __init__(self, name: str) -> None:
        self.name = name
        self._logger = None

    def logger(self):
        """The real :class:`logging.Logger` (imports :mod:`logging`)."""
        got = self._logger
        if got is None:
            import logging

            got = self._logger = logging.getLogger(self.name)
        return got

    def _dormant(self) -> bool:
        return self._logger is None and "logging" not in sys.modules

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging's name
        if self._dormant():
            return level >= _WARNING
        return self.logger().isEnabledFor(level)

    def debug(self, msg: str, *args: object, **kwargs) -> None:
        if self._dormant():
            return
        logger = self.logger()
        if logger.isEnabledFor(10):  # a hit logs one; mostly nobody listens
            logger.debug(msg, *args, stacklevel=kwargs.pop("stacklevel", 1) + 1, **kwargs)

    def warning(self, msg: str, *args: object, **kwargs) -> None:
        if self._dormant() and not kwargs.get("exc_info"):
            _last_resort(msg, args)
        else:
            self.logger().warning(msg, *args, stacklevel=kwargs.pop("stacklevel", 1) + 1,
                                  **kwargs)


def _last_resort(msg: str, args: tuple) -> None:
    """What unconfigured :mod:`logging` does with a warning: its message on stderr."""
    stream = sys.stderr
    if stream is None:  # pythonw, or a daemon that closed it
        return
    try:
        stream.write((msg % args if args else msg) + "\n")
        stream.flush()
    except (OSError, ValueError):  # a closed or broken stderr: logging would not raise either
        pass


_loggers: dict[str, LazyLogger] = {}


def get(name: str = "kdb") -> LazyLogger:
    """The lazy logger called ``name`` (one per name, like :func:`logging.getLogger`)."""
    got = _loggers.get(name)
    if got is None:
        got = _loggers[name] = LazyLogger(name)
    return got


def enable_output(lazy: LazyLogger, prefix: str) -> None:
    """Send ``lazy``'s debug records to stderr as ``prefix: message`` (``KDB_TRACE``), unless
    the program configured logging itself."""
    import logging

    logger = lazy.logger()
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


def forget_once() -> None:
    """Forget which once-keys were seen (tests, and a process that wants them again)."""
    with _seen_lock:
        _seen.clear()

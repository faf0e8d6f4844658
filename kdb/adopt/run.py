"""``kdb run -- CMD``: a command, and every process it starts, with kdb switched on.

The command inherits stdin, stdout and stderr and an environment with ``KDB_AUTO=1`` (every
Python process in the tree adopts pyopencl and pycuda, see :mod:`kdb.adopt.auto`) and
``KDB_RUN_REPORT`` (a fresh directory where each of them leaves its counts at exit, see
:mod:`kdb.adopt.tally`). Its exit status is passed through; a command killed by signal N gives
128 + N, as shells report it.

Signals: SIGTERM, SIGHUP, SIGINT, SIGQUIT, SIGUSR1 and SIGUSR2 sent to ``kdb run`` are passed
to the command. A signal the terminal sent (Ctrl-C, a hang-up) has already reached the
command, which is in the same foreground process group; on Linux ``kdb run`` tells the two
apart (``sigwaitinfo``'s ``si_code``) and does not deliver it twice. Elsewhere it passes on
every signal but SIGINT and SIGQUIT while it is in the terminal's foreground group. A signal
ignored when ``kdb run`` starts (``nohup``'s SIGHUP; SIGINT and SIGQUIT of a shell's
background job) stays ignored, in ``kdb run`` and in the command, as ``exec`` would leave it.

File descriptors: the command inherits every one ``kdb run`` inherited (``<(...)``, ``3<file``,
make's jobserver pipe), as a shell's ``exec`` would pass them. kdb's own descriptors (its
files, SQLite's, subprocess's pipes) are close-on-exec (PEP 446), so none of them leak into it.
``kdb run`` cannot ``exec`` the command itself: it stays to print the summary once it ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from .. import config
from . import tally
from ..errors import CommandError, InvalidArgumentError

FORWARDED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT", "SIGQUIT",
                                                      "SIGUSR1", "SIGUSR2")
                  if hasattr(signal, name))  # Windows has only some of them
_SI_KERNEL = 0x80  # si_code of a signal the kernel sent (a terminal's ^C), Linux


def environment(report_dir: str, cache_dir: str | os.PathLike[str] | None) -> dict[str, str]:
    """The command's environment: ours as it was given to us, with kdb switched on (a
    relative cache directory made absolute here: a process that changes directory first
    would make another cache of it)."""
    env = dict(os.environ)
    for name in _coerced():
        env.pop(name, None)
    env[config.ENV_AUTO] = "1"
    env[config.ENV_RUN_REPORT] = report_dir
    if cache_dir is not None:
        env[config.ENV_CACHE_DIR] = os.path.abspath(os.fspath(cache_dir))
    return env


def _coerced() -> list[str]:
    """The locale variables this interpreter set itself (PEP 538: under the C locale it sets
    ``LC_CTYPE=C.UTF-8`` in its own environment), which the command must not inherit: ``wc
    -m`` counted 2 characters of a 3-byte file where it counts 3. Read from the environment
    the process was started with (Linux: ``/proc/self/environ``); none where unknown."""
    if "LC_CTYPE" not in os.environ:
        return []
    try:
        with open("/proc/self/environ", "rb") as f:
            given = f.read().split(b"\0")
    except OSError:
        return []
    return [] if any(v.startswith(b"LC_CTYPE=") for v in given) else ["LC_CTYPE"]


def run(command: Sequence[str], cache_dir: str | os.PathLike[str] | None = None
        ) -> tuple[int, dict[str, Any]]:
    """Run ``command`` with kdb on; its exit status (128 + N when signal N killed it) and
    :func:`kdb.adopt.tally.read_reports` of every process of it that used kdb, with
    ``pending_stores``: how many of their compiles are still queued for the store worker
    when the command ends (:func:`kdb.adopt.tally.pending_stores`)."""
    if not command:
        raise InvalidArgumentError("kdb run needs a command: kdb run -- python app.py")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kdb-run-") as report_dir:
        env = environment(report_dir, cache_dir)
        try:
            status = _run_forwarding(list(command), env)
        except FileNotFoundError as err:
            raise CommandError(f"kdb run: command not found: {command[0]} ({err.strerror})",
                               127) from None
        except PermissionError as err:
            raise CommandError(f"kdb run: cannot execute {command[0]} ({err.strerror})",
                               126) from None
        summary = tally.read_reports(report_dir)
    pids = summary.pop("pids")
    summary["pending_stores"] = (tally.pending_stores(config.user_dir(cache_dir), pids, started)
                                 if summary["compiled"] else 0)
    return status, summary


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's return code.

    >>> exit_status(3), exit_status(-15)
    (3, 143)
    """
    return 128 - returncode if returncode < 0 else returncode


def _run_forwarding(command: list[str], env: dict[str, str]) -> int:
    if hasattr(signal, "sigwaitinfo") and sys.platform.startswith("linux"):
        return _run_sigwait(command, env)
    return _run_handlers(command, env)


def _passed_on() -> tuple[int, ...]:
    """The signals to pass on: :data:`FORWARDED` but those ignored now, which no handler of
    ours may replace (``exec`` resets a caught signal to its default, keeps an ignored one)."""
    return tuple(s for s in FORWARDED if signal.getsignal(s) != signal.SIG_IGN)


def _popen(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """The command, with every file descriptor kdb run inherited (see the module's docstring)."""
    return subprocess.Popen(command, env=env, close_fds=False)


def _run_sigwait(command: list[str], env: dict[str, str]) -> int:
    """Linux: block the signals, start the command, and take each signal with its sender."""
    forwarded = _passed_on()
    waited = {*forwarded, signal.SIGCHLD}
    early: list[int] = []
    # Signals that arrive while the command starts are kept and passed on once it runs.
    old_handlers = {s: signal.signal(s, lambda n, _f: early.append(n)) for s in forwarded}
    try:
        proc = _popen(command, env)
    except BaseException:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        raise
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        for n in early:
            _send(proc, n)
        while proc.poll() is None:
            info = signal.sigwaitinfo(waited)
            if info.si_signo == signal.SIGCHLD:
                continue
            if info.si_code != _SI_KERNEL:  # sent by a process (kill), not by the terminal
                _send(proc, info.si_signo)
        return exit_status(proc.returncode)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _run_handlers(command: list[str], env: dict[str, str]) -> int:
    """Elsewhere: handlers that pass signals on, but not the terminal's own to its group."""
    proc: subprocess.Popen | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if signum in (signal.SIGINT, getattr(signal, "SIGQUIT", None)) and _foreground():
            return  # the terminal sent it to the command as well
        if proc is None:
            pending.append(signum)
        else:
            _send(proc, signum)

    old_handlers = {s: signal.signal(s, forward) for s in _passed_on()}
    try:
        proc = _popen(command, env)
        for n in pending:
            _send(proc, n)
        while True:
            try:
                return exit_status(proc.wait())
            except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for safety
                continue
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)


def _foreground() -> bool:
    for fd in (0, 1, 2):
        try:
            return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


def _send(proc: subprocess.Popen, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass

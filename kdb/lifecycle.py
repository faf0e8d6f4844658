"""The process's exit and fork, in one explicit order.

kdb keeps per-process state in several modules (pending bookkeeping, the background store
thread, claims, the latency log, shared-tier connections). Left to ``atexit`` one module at
a time, their hooks ran in reverse import order, which no module chose. Here modules
register a hook in a named phase, and the one ``atexit`` hook runs the phases in this
order:

1. ``BOOKKEEPING``: every KernelDB's batched hit counts, counters and log rows are written
   (or handed to the store worker);
2. ``STORES``: background stores are finished within ``KDB_STORE_TIMEOUT``, and claims whose
   stores are still queued are handed over (:mod:`kdb.shared.keeper`);
3. ``SUMMARY``: the start-up latency summary is logged (:mod:`kdb.bookkeeping`);
4. ``REPORT``: the rest: this process's run report (``KDB_RUN_REPORT``).

Within a phase, hooks run in the order they registered. After ``fork`` every ``on_fork``
hook runs in the child, so a child starts with no pending bookkeeping, stores, claims or
connections of its parent's, and never writes them a second time.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import TYPE_CHECKING

from . import logs

if TYPE_CHECKING:
    from typing import Callable

BOOKKEEPING = 1
STORES = 2
SUMMARY = 3
REPORT = 4
PHASES = (BOOKKEEPING, STORES, SUMMARY, REPORT)

_exit_hooks: list[tuple[int, Callable[[], None]]] = []
_fork_hooks: list[Callable[[], None]] = []


def alive(pid: int | str) -> bool:
    """Whether process ``pid`` (a number, or one read from a file name) exists; another
    user's process counts as alive."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except OSError:
        return True
    return True


def in_multiprocessing_child() -> bool:
    """Whether this process is a child of :mod:`multiprocessing`: it ends in ``os._exit``, or
    by its parent's SIGTERM (a pool leaving ``with``), never through ``atexit``, so what it
    leaves to its exit hooks is lost. Cheap: a child has imported :mod:`multiprocessing`."""
    mp = sys.modules.get("multiprocessing")
    return mp is not None and mp.parent_process() is not None


def on_exit(phase: int, hook: Callable[[], None]) -> None:
    """Run ``hook`` at exit, in ``phase`` (one of :data:`PHASES`)."""
    if phase not in PHASES:
        raise ValueError(f"unknown exit phase {phase!r}")
    _exit_hooks.append((phase, hook))


def on_fork(hook: Callable[[], None]) -> None:
    """Run ``hook`` in a forked child, before anything else runs there."""
    _fork_hooks.append(hook)


#: What a Ctrl-C in each phase loses (the phases after it still run).
_LOST = {BOOKKEEPING: "this run's counts and compile log are not written",
         STORES: "kernels not stored yet compile again next run"}


def run_exit_hooks() -> None:
    """Run every exit hook, phase by phase; a failing hook is logged, never raised. Ctrl-C
    ends the hook it lands in (the stores, waiting for the last ones), with one line; the
    hooks after it, quick ones, still run (counts, the summary, claim files)."""
    interrupted = False
    for phase in PHASES:
        for p, hook in list(_exit_hooks):
            if p != phase:
                continue
            try:
                hook()
            except KeyboardInterrupt:
                if not interrupted:
                    logs.get("kdb").warning("kdb: interrupted at exit: %s",
                                            _LOST.get(phase, "kdb's exit work was cut short"))
                interrupted = True
            except Exception as err:  # noqa: BLE001 - never fail an exiting program
                logs.get("kdb").warning("kdb: at exit: %s failed: %s",
                                        getattr(hook, "__qualname__", hook), err)


def _after_fork_in_child() -> None:
    for hook in list(_fork_hooks):
        hook()


atexit.register(run_exit_hooks)
os.register_at_fork(after_in_child=_after_fork_in_child)

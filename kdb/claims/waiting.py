"""How long a process waits for another that compiles the same key: while it makes progress.

The wall clock cannot tell a slow holder from a stuck one: on a loaded machine a compile
takes many times its usual time, and a waiter that gives up then compiles the same program
in the same crowd, so single flight gave way exactly when it mattered most. A waiter here
judges the holder by its progress (:mod:`kdb.claims.progress`: the CPU time it and its
compilers use), and by what it is doing (its lock file's state, :mod:`kdb.claims`).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import faults, logs
from . import (
    COMPILING,
    PENDING,
    PENDING_FACTOR,
    STORING,
    WAITING,
    holder,
    longest,
    nodes,
    progress,
    try_claim,
    want,
)

if TYPE_CHECKING:
    from typing import Any, Callable

    from . import Claim

log = logs.get("kdb")

#: Seconds a holder that makes no progress is waited for beyond what its compile takes.
STALL_S = 2.0
#: Another node's heartbeat is its word: a node is waited for at most this many times
#: ``KDB_WAIT_TIMEOUT`` of wall time, whatever it says, and in all (:mod:`kdb.claims.nodes`).
NODE_WALL = nodes.NODE_WALL


def pending_wait(compile_seconds: float) -> float:
    """How much of its CPU time a holder may spend on storing an entry a waiter wants before
    the waiter builds the program itself: the holder stores it from the program in hand
    (reading binaries costs about what the compile did), so a few times the compile, and at
    least 2 s. CPU time, not wall: on a loaded machine both stretch alike."""
    return max(PENDING_FACTOR * compile_seconds, 2.0)


# -- single flight: claim, or wait for the holder ----------------------------------------------

#: Pids of claim holders this process waited for in vain (stopped, or stuck in a driver).
_given_up: set[int] = set()


class Watch:
    """Whether to go on waiting for one holder: what the waiter has seen of it so far.

    A holder is waited for while it makes progress: its CPU time (with its compilers') grows,
    or it is running, or (``waiting``) it is alive and not stopped while another node compiles.
    A holder that made none for its compile time plus :data:`STALL_S` (stopped, dead-locked)
    is given up on, as is one that spent ``timeout`` seconds of CPU time on one step (it
    spins); one storing an entry, once that has cost more CPU than the compile would
    (:func:`pending_wait`). One that waits for the disk (its compiler's pages read in from a
    busy disk: no CPU time for seconds) is waited for, up to ``timeout`` seconds of wall time
    without CPU time (a hung network file system). A holder this process cannot see (another
    pid namespace, no ``/proc``, a node without a heartbeat) is judged by the wall clock:
    ``timeout`` for a compile, :func:`pending_wait` for a store.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.ident: tuple | None = None
        #: When the holder was last seen at all active (``moved``), and using the CPU
        #: (``worked``): waiting for the disk is the one difference.
        self.began = self.moved = self.worked = 0.0
        #: When this process began waiting for another node (whoever its heartbeat names).
        self.node_began: float | None = None
        self.cpu0 = self.cpu = 0.0

    def verdict(self, ident: tuple, state: str, seconds: float, since: float,
                seen: progress.Sample | None, budget: float | None = None
                ) -> tuple[str, bool] | None:
        """``(why, stuck)`` to stop waiting (``stuck``: do not wait for this holder again),
        or ``None`` to go on. ``ident`` names the holder and what it does (a new one starts
        afresh), ``seen`` is its :func:`progress.sample` (``None``: it cannot be seen).
        ``budget``: the CPU seconds a store may cost (default :func:`pending_wait`)."""
        limit = pending_wait(seconds) if budget is None else budget
        now = time.monotonic()
        if ident != self.ident:
            self.ident, self.began, self.moved, self.worked = ident, now, now, now
            self.cpu0 = self.cpu = seen.cpu if seen is not None else 0.0
        if seen is None:
            if state in (PENDING, STORING) and time.time() - since >= limit:
                return "its store did not come", False
            if now - self.began >= self.timeout:
                return f"waited {now - self.began:.0f} s (KDB_WAIT_TIMEOUT)", True
            return None
        alive = not seen.stopped and (seen.running or state == WAITING)
        if seen.cpu > self.cpu or alive:
            self.moved = self.worked = now
        elif seen.io and not seen.stopped:
            self.moved = now  # reading from the disk: slow, not stuck (bounded below)
        self.cpu = max(self.cpu, seen.cpu)
        stall = min(max(seconds, longest()) + STALL_S, self.timeout)
        if now - self.moved >= stall:
            what = "was stopped" if seen.stopped else "made no progress"
            return (f"it {what} for {now - self.moved:.1f} s (its compile time + "
                    f"{STALL_S:g} s, at most KDB_WAIT_TIMEOUT)"), True
        if now - self.worked >= self.timeout:
            return (f"it waited for the disk for {now - self.worked:.0f} s without using the "
                    "CPU (KDB_WAIT_TIMEOUT)"), True
        used = self.cpu - self.cpu0
        if state in (PENDING, STORING) and used >= limit:
            return f"storing it cost {used:.1f} s of CPU time, more than compiling it", False
        if used >= self.timeout:
            return f"it used {used:.0f} s of CPU time on it (KDB_WAIT_TIMEOUT)", True
        return None


def claim_or_wait(directory: Path, key: str, label: str, find: Callable[[], Any],
                  timeout: float, *, shared=None, idle: Callable[[], None] | None = None,
                  queued: Callable[[Claim], Any] | None = None):
    """After a miss: claim ``key`` for compiling, or wait while another process compiles it.

    Polls with bounded back-off: this node's claim first, then (with ``shared``, the shared
    tier's :class:`~kdb.claims.crossnode.CrossNode` side) the cross-node lock; ``find()``
    looks for the entry another process may have published meanwhile. Returns what
    ``find()`` found, a :class:`Claim` (this process compiles; with ``shared`` it also holds
    the cross-node lock), or ``None`` (compile without coordination: the directory is
    unusable, or the holder was given up on).

    How long a holder is waited for is :class:`Watch`'s: as long as it makes progress,
    however loaded the machine. A process that holds this node's claim while another node
    compiles the key waits for the shared entry (its claim says ``waiting``, so this node's
    other processes wait with it), and when that node is given up on compiles it with that
    claim. ``idle()`` runs once, on a thread of its own, when this process starts waiting
    for another (work the holder's store needs done, done by a process with nothing to do).

    ``queued(claim)``, asked once this process holds the claim and found nothing: the key's
    store, queued by a process that has exited, when waiting for it costs less than
    compiling (:mod:`kdb.storing.queued`), else None. The claim then says ``waiting`` while
    the store is watched like a holder: ``store.look()`` is None (go on), ``()`` (the store
    ended: the entry, or compile) or what :meth:`Watch.verdict` judges, within
    ``store.budget`` CPU seconds; ``store.close(gave_up, why)`` ends it.
    """
    try:
        return _wait(directory, key, label, find, timeout, shared=shared, idle=idle,
                     queued=queued)
    finally:
        if shared is not None:
            shared.unwant(key)


#: Seconds between two polls at most; between two looks at the holder (its progress, its
#: state); between two looks for the entry while another process of this node holds the
#: claim (a holder publishes before it lets go: a claim that comes free is the usual sign,
#: and polls that query the tiers take CPU time from the very holder they wait for).
POLL_S = 0.1
LOOK_S = 0.25
FIND_S = 1.0


def _wait(directory, key, label, find, timeout, *, shared, idle=None, queued=None):
    delay, claim, watch, store = 0.002, None, Watch(timeout), None
    found_at = looked_at = -1e9
    while True:
        try:
            claim = claim or try_claim(directory, key)
        except OSError as err:
            # Same once-key as the user file's write faults: a read-only cache warns once.
            user_dir = directory.parent
            faults.fault(f"cannot write to the kernel cache {user_dir} ({err}): kernels "
                         "are compiled but may not be stored, and processes may compile the "
                         "same kernel. Make it writable or set KDB_CACHE_DIR to a writable "
                         "directory.", once=str(user_dir))
            return None
        now = time.monotonic()
        if store is not None:  # the claim is ours; the key's store is queued: watch it
            got = _look_store(store, claim, label, find, watch, now - found_at >= FIND_S)
            if got is not None:
                return got[0]
            found_at = found_at if now - found_at < FIND_S else now
            time.sleep(delay)
            delay = min(delay * 2, POLL_S)
            continue
        every = FIND_S if claim is None else LOOK_S if claim.state == WAITING else 0.0
        if now - found_at >= every:
            found_at = now
            # Shared tier: with the local claim, take the cross-node lock too (None: no server).
            locked = shared.try_lock(key) if shared and claim else None
            # Even with the claim: the holder may have published just before releasing it.
            hit = find()
            if hit is not None:
                if locked:
                    shared.unlock(key)
                if claim is not None and claim.state == WAITING:
                    nodes.clear(directory)  # the other node was slow, not rogue
                if claim is not None and not claim.handed:
                    claim.release()
                return hit
            if claim is not None and locked is not False:
                claim = shared.adopt(claim) if locked else claim
                store, queued = queued(claim) if queued is not None else None, None
                if store is None:
                    if claim.state != COMPILING:
                        claim.mark(COMPILING)
                    return claim
                claim.mark(WAITING)  # this node's other processes wait with us
                store.began, delay = now, 0.002
                continue
        if now - looked_at >= LOOK_S:
            looked_at = now
            verdict = _look(directory, key, label, claim, shared, watch)
            if verdict is not None:
                return verdict[0]
            if idle is not None and claim is None:
                threading.Thread(target=_quietly, args=(idle,), name="kdb-idle",
                                 daemon=True).start()
                idle = None
        time.sleep(delay)
        delay = min(delay * 2, POLL_S)


def _look_store(store, claim, label, find, watch, find_now: bool):
    """Look at a queued store this process waits for: ``None`` to go on, or ``(what to
    return,)``: the entry once it is published, else the claim (compile) once the store
    ended without it, or costs more than compiling it."""
    view = store.look()
    hit = find() if find_now or view == () else None
    if hit is None:
        if view is None:
            return None
        if view:
            verdict = watch.verdict(*view, budget=store.budget)
            if verdict is None:
                return None
            why = verdict[0]
        else:
            why = "its store ended without it (store-worker.log says why)"
    store.close(gave_up=hit is None and bool(view), why=None if hit is not None else why)
    if hit is not None:
        if not claim.handed:
            claim.release()
        return (hit,)
    log.debug("kdb: waited %.1f s for the queued store of %s, and %s; compiling it here",
              time.monotonic() - store.began, label, why)
    claim.mark(COMPILING)
    return (claim,)


def _quietly(work: Callable[[], None]) -> None:
    try:
        work()
    except Exception as err:  # noqa: BLE001 - a head start only: the holder does it anyway
        log.debug("kdb: preparing while waiting failed: %s", err)


def _look(directory, key, label, claim, shared, watch):
    """Look at the holder: ``None`` to go on waiting, or ``(what to return,)`` once it is
    given up on (``None``, or this node's claim when another node was)."""
    if claim is None:
        held_by = holder(directory, key)
        if held_by.pid in _given_up:
            return (None,)  # it made no progress before: do not wait for it again
        want(directory, key)
        ident = (held_by.pid, held_by.start, held_by.state, held_by.since)
        seen = progress.sample(held_by.pid, held_by.start) if held_by.pid else None
        verdict = watch.verdict(ident, held_by.state, held_by.seconds, held_by.since, seen)
        who = f"another process (pid {held_by.pid or 'unknown'})"
    else:  # this node's claim is ours, another node compiles it: ask it to hurry
        if claim.state != WAITING:
            claim.mark(WAITING)  # this node's other processes wait with us
        shared.want(key)
        ident, seen = shared.holder_progress(key)
        verdict = _judge_node(directory, ident, seen, watch)
        who = "another node"
    if verdict is None:
        return None
    why, stuck = verdict
    if stuck and claim is None and held_by.pid:
        _given_up.add(held_by.pid)
    if claim is not None:  # the other node's wait was in vain: it counts against the budget
        nodes.add(directory, time.monotonic() - watch.node_began)
        if stuck:
            nodes.given_up.add(ident)
    began = watch.began if claim is None else watch.node_began  # a node: whoever beat
    (log.warning if stuck else log.debug)(
        "kdb: waited %.1f s for %s to compile %s, and %s; compiling it here%s",
        time.monotonic() - began, who, label, why,
        ", and not waiting for that process again" if stuck and claim is None else "")
    if claim is not None:
        claim.mark(COMPILING)
    return (claim,)  # ours if this node's claim is: its other processes wait for us


def _judge_node(directory, ident, seen, watch):
    """Whether to go on waiting for the node whose heartbeat says ``ident`` and ``seen``:
    ``None``, or ``(why, stuck)``. :meth:`Watch.verdict` judges its progress; on top of it
    the wall time is bounded per kernel and, over this node's waits in vain, in all
    (:mod:`kdb.claims.nodes`), whoever the heartbeat names from one look to the next."""
    now = time.monotonic()
    if watch.node_began is None:
        watch.node_began = now
    waited = now - watch.node_began
    if ident in nodes.given_up and seen is not None:
        return "it was given up on before, and holds this key too", True
    spent = nodes.spent(directory, watch.timeout)  # one read of the account a look
    if waited >= nodes.budget(watch.timeout) - spent:
        return (f"this node has waited {spent + waited:.0f} s in vain for other nodes lately "
                f"({NODE_WALL} x KDB_WAIT_TIMEOUT at most)"), True
    return watch.verdict(ident, COMPILING, 0.0, 0.0, seen)

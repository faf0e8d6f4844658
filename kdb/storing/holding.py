"""Claims kept until their store job is stored, and entries stored at once for a waiter.

A process that compiled a program hands its store to the store worker (:mod:`kdb.storing.spool`)
but keeps the claims on its keys (:mod:`kdb.claims`) until the job is stored: another process
that misses one of them then waits instead of compiling it again. When one does (its
``.want`` file, or another node's want lock), a watcher thread stores that job at once from
the program this process still holds (no rebuild, at this process's priority, not the
worker's) and lets the claims go. At exit, the entries other processes wait for are stored
first; with the shared tier, the remaining claims' cross-node locks go to a keeper.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import lifecycle, logs
from ..file.rows import PROVISIONAL
from .jobfiles import exists, remove, rename, take, taken_path, unmark

if TYPE_CHECKING:
    from typing import Callable

log = logs.get("kdb")

#: Claims kept until their job is stored (another process may still wait for the entry).
_claims: list[tuple[Path, object]] = []


def hold(path: Path, claims: list, seconds: float,
         store_now: Callable[[bool], str | None] | None) -> None:
    """Keep ``claims`` (marked pending: compiled in ``seconds``) until the job ``path`` is
    stored; ``store_now`` stores it in this process when another process wants it (what it
    returns is :data:`~kdb.file.rows.PROVISIONAL` when it stored stand-ins only: the job
    then stays queued)."""
    with _claims_lock:
        for claim in claims:
            claim.mark_pending(seconds)
            _claims.append((path, claim))
        if store_now is not None:
            _store_now[path] = store_now
    _watch()


#: Seconds an exiting process spends at most storing entries other processes want.
EXIT_STORE_S = 10.0
#: The most entries an exiting process stores for its followers before they ask.
EXIT_AHEAD = 4
#: When the newest job another process waited for was written (``time.time_ns()``; 0: none):
#: that process follows this one, and wants what this one compiled since next.
_followed = 0


def _at_exit() -> None:
    """Claims whose jobs are still queued end with this process. Entries another process
    waits for are stored first, from the programs in hand; then, when other processes have
    followed this one (ranks building the same kernels a step behind), the few compiled
    since they last asked, newest first: they want them next, and would compile them again
    once this process is gone. With the shared tier the remaining claims' cross-node locks
    go to a keeper (:mod:`kdb.shared.keeper`) so other nodes still wait for them."""
    deadline = time.monotonic() + EXIT_STORE_S
    if _store_lock.acquire(timeout=EXIT_STORE_S):  # a store the watcher has begun ends first
        try:
            held = [(p, c) for p, c in list(_claims) if exists(p)]
            wanted = [p for p, c in held if c.wanted]
            ahead = [p for p, _ in reversed(held) if _born(p) > _followed > 0][:EXIT_AHEAD]
            for path in dict.fromkeys(wanted + ahead):
                if time.monotonic() < deadline:
                    claims = [c for p, c in list(_claims) if p == path]
                    # A follower on another node is served by the published entry only.
                    _store_wanted(path, claims, remote=path in ahead and any(
                        c.cross_node is not None for c in claims) or None)
        finally:
            _store_lock.release()
    pending = [(p, c) for p, c in _claims if exists(p)]
    tiers: dict[int, tuple[object, list]] = {}
    for path, claim in pending:
        tier = claim.cross_node  # the shared tier whose lock this claim also holds
        if tier is not None:
            tiers.setdefault(id(tier), (tier, []))[1].append((claim.key, str(path)))
    if tiers:
        from ..shared import keeper

        for tier, items in tiers.values():
            keeper.hand_over(tier, items)


def _born(path: Path) -> int:
    """When the job ``path`` was written (``time.time_ns()``, its name's first part)."""
    try:
        return int(path.name.split("-", 1)[0])
    except ValueError:
        return 0


_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    _exit_registered = True
    lifecycle.on_exit(lifecycle.STORES, _at_exit)


_claims_lock = threading.Lock()
_store_lock = threading.Lock()  # held while a wanted entry is stored (exit waits for it)
_store_now: dict[Path, Callable[[bool], str | None]] = {}
_watcher: threading.Thread | None = None


def _watch() -> None:
    """Start the thread that releases the claims of stored jobs and stores wanted ones."""
    global _watcher
    if not _exit_registered:
        _register_exit()
    if _watcher is None or not _watcher.is_alive():
        _watcher = threading.Thread(target=_watch_claims, name="kdb-claims", daemon=True)
        _watcher.start()


def _watch_claims() -> None:
    global _followed
    while True:
        time.sleep(0.05)
        with _claims_lock:
            held = list(_claims)
        if not held:
            return
        for path, claim in held:
            if not exists(path):
                _drop_claim(path, claim)
            elif claim.wanted:
                _followed = max(_followed, _born(path))
                with _store_lock:
                    _store_wanted(path, [c for p, c in held if p == path])


def _store_wanted(path: Path, claims: list, remote: bool | None = None) -> None:
    """Another process waits for an entry of the job ``path``: store the job from the program
    this process still holds (no rebuild), then let its claims go. Also when a store
    worker's lane took the job first: the lane runs at the lowest priority, the waiter not."""
    with _claims_lock:
        store = _store_now.pop(path, None)
    if store is None:
        return  # no program in hand: the worker stores it (it takes wanted jobs first)
    for claim in claims:
        claim.mark_storing()
    start = time.perf_counter()
    fd = take(path)  # None: a lane has it; its copy of the entries is written again, no harm
    kept: list = []  # claims whose cross-node locks stay until the entry is published
    try:
        if remote is None:
            remote = _wanted_elsewhere(claims)
        if store(remote) == PROVISIONAL:  # stand-ins stored: the job stays
            log.debug("kdb: kept PoCL's files of %s for a waiting process in %.2f s",
                      ", ".join(c.key[:16] for c in claims), time.perf_counter() - start)
            if fd is not None:
                rename(taken_path(path), path)
            # They serve this node only: other nodes still wait for the published entry,
            # which this process stores when one asks (it let the lock go, and every node
            # that looked meanwhile compiled the kernel again).
            kept = [c for c in claims if c.cross_node is not None]
            if kept:
                with _claims_lock:
                    _store_now[path] = store
        else:
            log.debug("kdb: stored %s for a waiting process in %.2f s",
                      ", ".join(c.key[:16] for c in claims), time.perf_counter() - start)
            if fd is not None:
                remove(path)
            if claims:
                unmark(claims[0].directory, path, [c.key for c in claims])
    except Exception as err:  # noqa: BLE001 - the worker will store it instead
        log.debug("kdb: storing a wanted entry in this process failed: %s", err)
        if fd is not None:
            rename(taken_path(path), path)
    finally:
        if fd is not None:
            os.close(fd)
    for claim in claims:
        if claim in kept:
            claim.release_local()
        else:
            _drop_claim(path, claim)


def _wanted_elsewhere(claims: list) -> bool:
    """Whether a process on another node waits for one of ``claims`` (its want lock on the
    shared tier): what PoCL's cache holds here serves no other node, and the waiters there
    compiled every kernel of a holder that kept only that for them."""
    for claim in claims:
        tier = claim.cross_node
        try:
            if tier is not None and tier.wanted(claim.key):
                return True
        except Exception:  # noqa: BLE001 - the server gone: nobody there is served anyway
            continue
    return False


def _drop_claim(path: Path, claim) -> None:
    with _claims_lock:
        try:
            _claims.remove((path, claim))
        except ValueError:
            return
        if not any(p == path for p, _ in _claims):
            _store_now.pop(path, None)
    claim.release()


def _after_fork() -> None:
    global _watcher, _claims_lock, _store_lock, _followed
    _followed = 0
    _claims.clear()  # the parent's: it releases them
    _store_now.clear()
    _watcher = None
    _claims_lock = threading.Lock()
    _store_lock = threading.Lock()


lifecycle.on_fork(_after_fork)

"""Single flight across nodes: the shared tier's advisory locks.

The process that holds a key's local claim (:mod:`kdb.claims`) also takes
``pg_try_advisory_lock`` on a 64-bit hash of the key, on one connection per process that
lives while it compiles and publishes (a crashed holder's session ends and the server drops
its locks). A process of another node that finds the lock taken holds a shared lock on the
key's "want" id while it polls, and the holder, seeing that id taken, publishes at once
instead of waiting for its process to go quiet. :class:`CrossNodeLocks` is the part of
:class:`kdb.shared.tier.SharedTier` that does this (it uses the tier's engine and fault handling).

A waiting node tells a slow holder from a stuck one by the holder's heartbeat: while it holds
compile locks, a holder writes its CPU time (:mod:`kdb.progress`) into its lock session's
``application_name`` every :data:`BEAT_S`, which ``pg_stat_activity`` shows every session of
the database. It stops when the holder is stopped; its CPU time stops growing when the
holder is stuck (:class:`kdb.claims.waiting.Watch` judges both).
"""

from __future__ import annotations

import os
import time
from typing import Any

from sqlalchemy import text

from .. import claims
from ..claims import progress
from . import server as pgserver
from .server import lock_id

#: Seconds between two checks of whether another node waits for a key this process holds.
WANT_CHECK_S = 0.2
#: Seconds between two heartbeats of a holder, and between two reads of another's.
BEAT_S = 0.5
#: How a heartbeat's ``application_name`` starts: ``kdb-holder <pid> <start> <cpu seconds>``.
BEAT = "kdb-holder"

_HOLDER_SQL = (  # the session that holds an advisory lock (bigint: classid, objid, objsubid 1)
    "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.classid::bigint = :hi "
    "AND l.objid::bigint = :lo AND l.database = (SELECT oid FROM pg_database "
    "WHERE datname = current_database()) LIMIT 1")


def compile_id(key: str, namespace: str | None = None) -> int:
    """The compile lock's id of ``key`` (salted with the namespace: tenants never share one)."""
    return lock_id(key, namespace)


def want_id(key: str, namespace: str | None = None) -> int:
    """The id a waiter for ``key`` holds shared, telling the holder to publish at once."""
    return lock_id("want:" + key, namespace)


class CrossNodeLocks:
    """Advisory locks on a connection of their own: the :class:`kdb.claims.crossnode.CrossNode`
    side of single flight, mixed into :class:`kdb.shared.tier.SharedTier`, whose
    ``engine()``, ``failed()``, ``namespace`` and lock state (``_locker``, ``_held``,
    ``_wants``, ``_checked``, ``_beater``, ``_beats``) it uses."""

    def _on_locker(self, doing: str, sql: str, params: dict[str, Any]) -> Any:
        """One statement on this process's lock connection; ``None`` when unavailable."""
        with self._locker_lock, pgserver.watchdog.guard(pgserver.bound_s()):
            if self._locker is not None and (self._locker_dead or self._pid != os.getpid()):
                old, self._locker = self._locker, None
                if self._pid == os.getpid():
                    try:
                        old.invalidate()  # closed as is: no reset round trip to a dead server
                    except Exception:  # noqa: BLE001 - a dead connection
                        pass
            engine = self.engine()
            if engine is None:
                return None
            try:
                if self._locker is None:
                    self._locker = engine.connect().execution_options(
                        isolation_level="AUTOCOMMIT")
                    self._locker_dead = False
                with pgserver.watchdog.guard(pgserver.bound_s(), fds=[self._locker_fd()]):
                    return self._locker.execute(text(sql), params).scalar()
            except Exception as err:  # noqa: BLE001 - warn, go local
                self.failed(err, doing)
                return None

    def _locker_fd(self) -> int:
        try:
            return self._locker.connection.dbapi_connection.pgconn.socket
        except Exception:  # noqa: BLE001 - closed: nothing to cut
            return -1

    def try_lock(self, key: str) -> bool | None:
        """Take the cross-node compile lock of ``key``: True (ours), False (another
        process holds it), None (the tier is unavailable: compile without it)."""
        if key in self._held and self._pid == os.getpid():
            return True
        got = self._on_locker("taking a compile lock", "SELECT pg_try_advisory_lock(:k)",
                              {"k": compile_id(key, self.namespace)})
        if got:
            self._held.add(key)
            self._beat()
        return got

    def _beat(self) -> None:
        """Start the heartbeat thread unless it runs: it beats while this process holds locks."""
        import threading

        thread = self._beater
        if thread is not None and thread.is_alive() and self._pid == os.getpid():
            return
        self._beater = threading.Thread(target=self._beating, name="kdb-heartbeat", daemon=True)
        self._beater.start()

    def _beating(self) -> None:
        pid = os.getpid()
        while self._held and self._pid == pid:
            seen = progress.sample(pid, progress.start_time())
            cpu = seen.cpu if seen is not None else time.process_time()
            self._on_locker("beating", "SELECT set_config('application_name', :v, false)",
                            {"v": f"{BEAT} {pid} {progress.start_time()} {cpu:.2f}"})
            time.sleep(BEAT_S)

    def holder_progress(self, key: str) -> tuple[tuple, progress.Sample | None]:
        """Who holds the compile lock of ``key`` on another node, and its CPU time: ``(ident,
        sample)``; the sample is ``None`` when the holder sends no heartbeat (a keeper, an
        older kdb) or the server cannot say (read at most every :data:`BEAT_S`)."""
        now = time.monotonic()
        cache = self._beats
        last = cache.get(key)
        if last is not None and now - last[0] < BEAT_S:
            return last[1]
        k = compile_id(key, self.namespace) & 0xFFFFFFFFFFFFFFFF
        name = self._on_locker("reading a holder's heartbeat", _HOLDER_SQL,
                               {"hi": k >> 32, "lo": k & 0xFFFFFFFF})
        parts = str(name or "").split()
        try:
            if parts[0] != BEAT:
                raise ValueError(parts[0])
            got = (("node", int(parts[1]), int(parts[2])), progress.Sample(float(parts[3])))
        except (IndexError, ValueError):
            got = (("node", key), None)
        cache[key] = (now, got)
        if len(cache) > 256:
            cache.clear()
        return got

    def unlock(self, key: str) -> None:
        """Give the compile lock of ``key`` up (after publishing, or when compiling failed)."""
        if key not in self._held:
            return
        self._held.discard(key)
        self._checked.pop(key, None)
        self._on_locker("releasing a compile lock", "SELECT pg_advisory_unlock(:k)",
                        {"k": compile_id(key, self.namespace)})

    def want(self, key: str) -> None:
        """Tell the node that compiles ``key`` that this process waits for it."""
        if key in self._wants:
            return
        if self._on_locker("waiting for a kernel", "SELECT pg_try_advisory_lock_shared(:k)",
                           {"k": want_id(key, self.namespace)}):
            self._wants.add(key)

    def unwant(self, key: str) -> None:
        """Stop waiting for ``key``."""
        if key not in self._wants:
            return
        self._wants.discard(key)
        self._on_locker("waiting for a kernel", "SELECT pg_advisory_unlock_shared(:k)",
                        {"k": want_id(key, self.namespace)})

    def wanted(self, key: str) -> bool:
        """Whether a process of another node waits for ``key`` (checked at most every
        :data:`WANT_CHECK_S`): its shared lock on the want id keeps ours from being taken."""
        if key not in self._held:
            return False
        now = time.monotonic()
        last, answer = self._checked.get(key, (-1e9, False))
        if now - last < WANT_CHECK_S:
            return answer
        # In autocommit, the transaction-level lock is released as soon as it is taken.
        free = self._on_locker("checking for waiters", "SELECT pg_try_advisory_xact_lock(:k)",
                               {"k": want_id(key, self.namespace)})
        answer = free is False
        self._checked[key] = (now, answer)
        return answer

    def adopt(self, claim: claims.Claim) -> claims.Claim:
        """Make a local claim also hold (and, on release, give up) the cross-node lock."""
        claim.cross_node = self
        return claim



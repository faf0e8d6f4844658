"""The shared tier: one PostgreSQL database that the nodes of a cluster read and publish to.

SQLite on a network file system corrupts or crawls, so a cluster keeps node-local user files
and puts one database server behind them: ``KDB_SHARED_URL`` (a SQLAlchemy URL, e.g.
``postgresql+psycopg://kdb@db.example/kdb``; the driver comes with ``kdb[postgres]``).
Lookups go system -> user -> shared -> compile; a shared hit is copied into the user tier,
and a compile is published to both (:mod:`kdb.db` holds the hooks).

The server, its bounds and its schema are :mod:`kdb.shared.server`'s; reading the whole tier
for reports and packs is :mod:`kdb.shared.report`'s. With ``KDB_SHARED_NAMESPACE`` the tier is
a tenant's schema, kept apart from the others' by the server (:mod:`kdb.shared.tenants`).
Single flight across nodes is :mod:`kdb.shared.locks`' (advisory locks on the server).

The server down, slow or refusing costs no correctness: connects and statements are
bounded (``KDB_SHARED_CONNECT_TIMEOUT``, ``KDB_SHARED_STATEMENT_TIMEOUT``), a failure logs
one warning, and the tier is skipped for ``KDB_SHARED_RETRY`` seconds while the local tiers
go on. Credentials come only from the URL or libpq's environment and password file
(``PGPASSWORD``, ``~/.pgpass``); a URL is shown only through :func:`mask`.

This module is imported only when ``KDB_SHARED_URL`` is set, and only after a lookup missed
the local tiers; the driver loads on the first connection.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, TypeVar

from sqlalchemy import select
from sqlalchemy.engine import Connection, Engine

from ..file import migrate
from .. import config, faults, lifecycle
from . import server as pgserver
from .server import (
    MIGRATE_LOCK,
    MIGRATE_WAIT_S,
    create_engine,
    lock_id,
    mask,
    schema_revision,
    upgrade,
)
from ..file.schema import kernels
from . import usage, writes
from .locks import WANT_CHECK_S, CrossNodeLocks
from ..file.kernelfile import CompileRecord, Entry

__all__ = ["SharedTier", "SharedRow", "tier", "reset", "mask", "lock_id",
           "create_engine", "upgrade", "MIGRATE_LOCK", "WANT_CHECK_S"]

log = logging.getLogger("kdb")
T = TypeVar("T")

_FETCH_COLUMNS = (kernels.c.codec, kernels.c.blob, kernels.c.raw_size, kernels.c.checksum,
                  kernels.c.attributes_sha256, kernels.c.compile_seconds, kernels.c.details,
                  kernels.c.signer, kernels.c.signature, kernels.c.key)


class SharedRow(NamedTuple):
    """What a hit needs from a shared entry (as :class:`kdb.file.kernelfile.Row`, plus
    ``details`` and who signed it): the sha256 of the stored attributes, never their text."""

    codec: str
    blob: bytes
    raw_size: int
    checksum: str
    attributes_sha256: str
    compile_seconds: float
    details: str
    signer: str | None = None
    signature: bytes | None = None
    stored_key: str = ""  # its key column: the entry's key, or a signer's slot for it
    attributes: None = None


class SharedTier(CrossNodeLocks):
    """One shared database as this process sees it: engine, locks, and whether it is up.

    Thread-safe and fork-safe (a child forgets the parent's connections). Every method
    answers ``None``/``False``/``0`` while the tier is off or down, at once. ``namespace``:
    the tenant's (``KDB_SHARED_NAMESPACE``), its schema the only one this tier sees.
    """

    def __init__(self, url: str, namespace: str | None = None) -> None:
        self.url = url
        self.namespace = (namespace or "").strip() or None
        self.shown = mask(url)
        self._lock = threading.RLock()
        self._engine: Engine | None = None
        self._pid = 0
        self._ready = False
        self._off: str | None = None  # why the tier is off for good in this process
        self._last_error = ""
        self._down_until = 0.0
        self._locker_lock = threading.Lock()
        self._locker: Connection | None = None  # holds this process's advisory locks
        self._locker_dead = False
        self._held: set[str] = set()  # keys whose compile lock this process holds
        self._wants: set[str] = set()  # keys this process waits for (want id held shared)
        self._checked: dict[str, tuple[float, bool]] = {}
        self._beater = None  # the heartbeat thread (:mod:`kdb.shared.locks`)
        self._beats: dict[str, tuple] = {}  # other nodes' heartbeats, as last read
        self._touches = usage.Touches()  # hits to write in one batch

    #: The tier's name (:mod:`kdb.tiers`).
    name = "shared"
    #: Whether the last operation failed because the server refused what it was given (a
    #: row it cannot take), not because it was away, slow or locked.
    refused = False

    def __repr__(self) -> str:
        return f"SharedTier({self.describe()!r})"

    def describe(self) -> str:
        """The server, its password masked, and the namespace."""
        return self.shown + (f" (namespace {self.namespace})" if self.namespace else "")

    # -- connection state -------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the tier may be tried now (not off, not waiting out a failure)."""
        return self._off is None and time.monotonic() >= self._down_until

    @property
    def problem(self) -> str | None:
        """Why the tier is off for good in this process, if it is."""
        return self._off

    def engine(self) -> Engine | None:
        """The engine, the schema checked (and upgraded) once; ``None`` when unavailable."""
        if not self.available:
            return None
        if self._engine is not None and self._ready and self._pid == os.getpid():
            return self._engine
        with self._lock:
            if not self.available:  # another thread failed meanwhile
                return None
            if self._pid != os.getpid():
                self._forget_after_fork()
            try:
                if self._engine is None:
                    self._engine = create_engine(self.url, self.namespace)
                if not self._ready:
                    self._check_schema(self._engine)
            except Exception as err:  # noqa: BLE001 - any fault: warn, go local
                from ..errors import ConfigError

                if isinstance(err, (ConfigError, ImportError)):
                    self._turn_off(str(err) if isinstance(err, ConfigError) else
                                   f"its driver is not installed ({err}); install it with "
                                   "pip install 'kdb[postgres]'")
                else:
                    self.failed(err, "connecting")
                return None
            if self._off is not None:
                return None
            return self._engine

    def _forget_after_fork(self) -> None:
        if self._engine is not None:
            self._engine.dispose(close=False)  # the parent's connections stay the parent's
        self._engine = None
        self._locker = None
        self._locker_dead = False
        self._held.clear()
        self._wants.clear()
        self._checked.clear()
        self._beater = None
        self._beats.clear()
        self._ready = False
        self._pid = os.getpid()

    def _turn_off(self, why: str) -> None:
        self._off = why
        faults.fault(f"the shared tier {self.describe()} is off: {why}; kdb uses its local tiers",
                     once="shared-off:" + self.describe())

    def failed(self, err: BaseException, doing: str) -> None:
        """A fault talking to the server: warn once, skip the tier for a while, go local. A
        schema that is not what its revision says turns the tier off instead: retrying
        every 30 s as for an outage never heals it."""
        if pgserver.damaged(err):
            self._turn_off(pgserver.damaged_problem(err, self.namespace, self.url))
            return
        retry = config.read(config.ENV_SHARED_RETRY)
        with self._lock:
            self._down_until = time.monotonic() + retry
            self._last_error = self.reason(err)
            engine, self._engine = self._engine, None
            self._ready = False
            self._locker_dead = True  # closed by its next user; the server dropped its locks
            self._held.clear()
            self._wants.clear()
            self._checked.clear()
        if engine is not None:
            try:
                engine.dispose()
            except Exception:  # noqa: BLE001 - closing dead connections may fail too
                pass
        log.debug("kdb: shared tier %s failed while %s: %s", self.describe(), doing,
                  self._last_error)
        faults.fault(f"the shared tier {self.describe()} is unavailable ({self._last_error}) "
                     f"while {doing}; kdb goes on with its local tiers and tries the server again "
                     f"at most every {retry:g} s ({config.ENV_SHARED_RETRY})",
                     once="shared-down:" + self.describe())

    def reason(self, err: BaseException) -> str:
        """Why ``err`` happened, in one line, with no SQL, parameters, URL or password."""
        return pgserver.scrub(pgserver.reason(err), self.url)

    def _run(self, doing: str, fn: Callable[[Engine], T], default: T) -> T:
        with pgserver.watchdog.guard(pgserver.bound_s()):
            self.refused = False
            engine = self.engine()
            if engine is None:
                return default
            try:
                return fn(engine)
            except Exception as err:  # noqa: BLE001 - the cache never breaks the program
                self.refused = _refusal(err)
                self.failed(err, doing)
                return default

    # -- schema -----------------------------------------------------------------------------

    def _check_schema(self, engine: Engine) -> None:
        """As for a user file: head is used, older is upgraded, newer turns the tier off; a
        namespace whose schema this role cannot use turns it off too (an administrator's
        work, not a failure to retry)."""
        with engine.connect() as conn:
            rev = schema_revision(conn)
            problem = (pgserver.namespace_problem(conn, self.namespace,
                                                  creating=rev != migrate.HEAD)
                       if self.namespace else
                       pgserver.no_namespace_problem(conn) if rev is None else None)
            conn.commit()
            if problem:
                self._turn_off(problem)
                return
            if rev is not None and rev not in migrate.REVISIONS:
                self._turn_off(f"its schema revision {rev!r} is newer than this kdb knows "
                               f"({migrate.HEAD}); upgrade kdb (pip install -U kdb) on this "
                               "node, or point KDB_SHARED_URL at another database")
                return
            if rev != migrate.HEAD:
                with pgserver.watchdog.guard(MIGRATE_WAIT_S + pgserver.bound_s()):
                    upgrade(conn, namespace=self.namespace)
        self._ready = True

    # -- reads ------------------------------------------------------------------------------

    def fetch(self, key: str) -> SharedRow | None:
        """The entry for ``key``, or ``None`` (a miss, or the tier is unavailable). Under a
        trust policy, when the entry's row is not signed by a trusted key, the row a trusted
        signer published for it beside (:func:`kdb.shared.writes.slot_key`), if any."""
        from ..signing import policy as signing

        policy = signing.current()
        trusted = list(policy.trusted) if policy is not None and policy.verify else []
        keys = [key, *(writes.slot_key(key, t) for t in trusted)]

        def q(engine: Engine) -> SharedRow | None:
            with engine.connect() as conn:
                found = [_row(r) for r in conn.execute(
                    select(*_FETCH_COLUMNS).where(kernels.c.key.in_(keys))).all()]
            by_key = {r.stored_key: r for r in found if r is not None}
            main = by_key.get(key)
            if main is None or not trusted or (main.signer in trusted and main.signature):
                return main or next((by_key[k] for k in keys if k in by_key), None)
            return next((by_key[k] for k in keys[1:] if k in by_key), main)

        return self._run("looking up a kernel", q, None)

    def arches(self, backend: str, name: str) -> list[str]:
        """The arches the tier holds an entry of ``backend`` named ``name`` in (one read on
        the name's index; none when the tier is unavailable): for a lookup that cannot know
        its arch yet (a fresh node's first Triton host module)."""
        def q(engine: Engine) -> list[str]:
            with engine.connect() as conn:
                rows = conn.execute(select(kernels.c.arch).where(
                    kernels.c.backend == backend, kernels.c.name == name).distinct()).all()
            return sorted({r[0] for r in rows if isinstance(r[0], str)})

        return self._run("listing the arches of an entry", q, [])

    def signature(self, key: str, row: SharedRow) -> tuple[str | None, bytes | None]:
        """Who signed a fetched entry (:mod:`kdb.signing`)."""
        return row.signer, row.signature

    def touch(self, key: str) -> None:
        """Count a hit served from the shared tier (on the background thread): batched, one
        transaction per :data:`usage.TOUCH_BATCH` keys or :data:`usage.TOUCH_S` seconds."""
        if self._touches.add(key):
            self.write_touches()

    def write_touches(self) -> None:
        """Write the pending hits and last-use times (also at exit)."""
        pending = self._touches.take()
        if not pending:
            return

        def w(engine: Engine) -> None:
            with engine.begin() as conn:
                usage.Touches.write(conn, pending)

        self._run("counting hits", w, None)

    # -- writes -----------------------------------------------------------------------------

    def publish(self, entries: list[Entry], logs: list[CompileRecord] = ()) -> bool:
        """Insert entries and log rows (:func:`kdb.shared.writes.publish`); False when the
        server could not take them. Past ``KDB_SHARED_MAX_SIZE`` the publisher evicts."""
        new = writes.rows(entries)

        def w(engine: Engine) -> bool:
            with engine.begin() as conn:
                added = writes.publish(conn, new, logs)
            cap = config.shared_max_size()
            if added and cap:
                usage.keep_under(engine, cap, self.namespace)
            return True

        return self._run("publishing a kernel", w, False)

    def drop(self, keys: Iterable[str]) -> int:
        """Delete bad entries (checksum mismatch, key collision, a tampered signature), so
        they are published anew; how many went."""
        keys = list(keys)

        def w(engine: Engine) -> int:
            with engine.begin() as conn:
                return writes.drop(conn, keys)

        return self._run("dropping a bad entry", w, 0)

    # -- reports (kdb.shared.report) ----------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What ``kdb info`` and ``kdb stats`` show (:func:`kdb.shared.report.summary`)."""
        from . import report as sharedreport

        return sharedreport.summary(self)

    def export(self, arch: str, dest: Path) -> int:
        """Copy the ``arch`` entries into a new SQLite file (:func:`kdb.shared.report.export`)."""
        from . import report as sharedreport

        return sharedreport.export(self, arch, dest)


def _refusal(err: BaseException) -> bool:
    """Whether ``err`` is the server refusing the data (SQLAlchemy's ``DataError`` or
    ``IntegrityError``), not the server away, slow, frozen or locked."""
    from sqlalchemy import exc

    return isinstance(err, (exc.DataError, exc.IntegrityError))


#: The Python types a sound row's columns have (a writer with the table's role can change a
#: column's type: such a row is a miss, never an error on the hit path).
_TYPES = (str, bytes, int, str, str, (int, float), str, (str, type(None)), (bytes, type(None)),
          str)


def _row(values) -> SharedRow | None:
    values = [bytes(v) if isinstance(v, memoryview) else v for v in values]
    if not all(isinstance(v, t) for v, t in zip(values, _TYPES)):
        log.debug("kdb: shared tier: a row with a column of another type is a miss")
        return None
    values[5] = float(values[5])
    return SharedRow(*values)


_tiers: dict[tuple[str, str | None], SharedTier] = {}
_tiers_lock = threading.Lock()


def tier(url: str) -> SharedTier:
    """This process's :class:`SharedTier` for ``url`` and ``KDB_SHARED_NAMESPACE`` (one each)."""
    namespace = config.shared_namespace()
    with _tiers_lock:
        t = _tiers.get((url, namespace))
        if t is None:
            t = _tiers[url, namespace] = SharedTier(url, namespace)
    return t


def reset() -> None:
    """Forget every tier and its state (tests; a process that wants a fresh start)."""
    with _tiers_lock:
        old = list(_tiers.values())
        _tiers.clear()
    for t in old:
        with t._lock:
            engine, t._engine = t._engine, None
        if engine is not None and t._pid == os.getpid():
            engine.dispose()


def _after_fork() -> None:
    """A child starts with fresh locks (one held by a parent's thread would never be freed);
    each tier drops the parent's connections on its next use."""
    global _tiers_lock
    _tiers_lock = threading.Lock()
    for t in _tiers.values():
        t._lock = threading.RLock()
        t._locker_lock = threading.Lock()
        t._touches.forget()


def _write_touches_at_exit() -> None:
    """After the background stores (which add the last touches): the pending hits go."""
    for t in list(_tiers.values()):
        if t._pid == os.getpid():
            t.write_touches()


lifecycle.on_fork(_after_fork)
lifecycle.on_exit(lifecycle.REPORT, _write_touches_at_exit)

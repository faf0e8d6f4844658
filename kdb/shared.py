"""The shared tier: one PostgreSQL database that the nodes of a cluster read and publish to.

SQLite on a network file system corrupts or crawls, so a cluster keeps node-local user files
and puts one database server behind them: ``KDB_SHARED_URL`` (a SQLAlchemy URL, e.g.
``postgresql+psycopg://kdb@db.example/kdb``; the driver comes with ``kdb[postgres]``).
Lookups go system -> user -> shared -> compile; a shared hit is copied into the user tier,
and a compile is published to both (:mod:`kdb.db` holds the hooks).

The server holds the same schema as the SQLite files (:mod:`kdb.schema`), created and
upgraded by the same alembic migrations, one upgrader at a time under an advisory lock.
Single flight across nodes: the process that holds a key's local claim
(:mod:`kdb.claims`) also takes ``pg_try_advisory_lock`` on a 64-bit hash of the key, on one
connection per process that lives while it compiles and publishes (a crashed holder's
session ends and the server drops its locks). A process of another node that finds the
lock taken holds a shared lock on the key's "want" id while it polls, and the holder, seeing
that id taken, publishes at once instead of waiting for its process to go quiet.

The server down, slow or refusing costs no correctness: connects and statements are
bounded (``KDB_SHARED_CONNECT_TIMEOUT``, ``KDB_SHARED_STATEMENT_TIMEOUT``), a failure logs
one warning, and the tier is skipped for ``KDB_SHARED_RETRY`` seconds while the local tiers
go on. Credentials come only from the URL or libpq's environment and password file
(``PGPASSWORD``, ``~/.pgpass``); a URL is shown only through :func:`mask`.

This module is imported only when ``KDB_SHARED_URL`` is set, and only after a lookup missed
the local tiers; the driver loads on the first connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple, TypeVar

from sqlalchemy import event, func, select, text
from sqlalchemy.engine import Connection, Engine

from . import claims, codec, config, faults, lifecycle, migrate
from .schema import compile_log, counters, kernels, meta
from .keys import compiler_free_key
from .store import CompileRecord, Entry

log = logging.getLogger("kdb")
T = TypeVar("T")

#: Seconds between two checks of whether another node waits for a key this process holds.
WANT_CHECK_S = 0.2

_FETCH_COLUMNS = (kernels.c.codec, kernels.c.blob, kernels.c.raw_size, kernels.c.checksum,
                  kernels.c.attributes, kernels.c.compile_seconds, kernels.c.details)


class SharedRow(NamedTuple):
    """What a hit needs from a shared entry (as :class:`kdb.store.Row`, plus ``details``)."""

    codec: str
    blob: bytes
    raw_size: int
    checksum: str
    attributes: str
    compile_seconds: float
    details: str


def mask(url: str) -> str:
    """``url`` with its password hidden, for every place a URL is shown or logged.

    >>> mask("postgresql+psycopg://kdb:secret@db:5432/kdb")
    'postgresql+psycopg://kdb:***@db:5432/kdb'
    """
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - an unparsable URL may still hold a password
        return "<unparsable URL>"


def lock_id(text_: str) -> int:
    """A signed 64-bit advisory lock id for a string (PostgreSQL's ``bigint`` key space).

    >>> lock_id("kdb") == lock_id("kdb") and -2**63 <= lock_id("kdb") < 2**63
    True
    """
    return int.from_bytes(hashlib.sha256(text_.encode("utf-8")).digest()[:8], "big",
                          signed=True)


#: Held by the process that creates or upgrades the shared schema.
MIGRATE_LOCK = lock_id("kdb.shared.migrate")

#: Seconds a process waits for another that upgrades the shared schema (a migration's
#: statements get this bound too).
_MIGRATE_WAIT_S = 60.0


def _want_id(key: str) -> int:
    return lock_id("want:" + key)


def _reason(err: BaseException) -> str:
    """A short, credential-free reason: the driver's first line, never SQL or parameters."""
    inner = getattr(err, "orig", None) or err
    first = (str(inner).strip().splitlines() or [type(inner).__name__])[0]
    return f"{type(inner).__name__}: {first[:300]}"


# -- the client-side bound ------------------------------------------------------------------

class _Watchdog:
    """Cuts the connections of a thread whose shared-tier operation ran past its deadline.

    ``statement_timeout`` is enforced by the server: a server process that stops answering
    (frozen, stuck in I/O, its host gone without a reset) would leave the driver waiting
    for ever. Past the deadline the watchdog shuts the thread's sockets down, the driver
    raises, and the tier fails over like any other fault. One daemon thread per process,
    started on first use; sockets are recorded per thread at pool checkout.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadlines: dict[int, float] = {}
        self._fds: dict[int, set[int]] = {}
        self._thread: threading.Thread | None = None
        self._pid = 0

    def checkout(self, dbapi_conn: Any, record: Any, _proxy: Any = None) -> None:
        try:
            fd = dbapi_conn.pgconn.socket
        except Exception:  # noqa: BLE001 - a closed connection has none
            return
        tid = threading.get_ident()
        record.info["kdb_fd"] = (tid, fd)
        with self._lock:
            self._fds.setdefault(tid, set()).add(fd)

    def checkin(self, _dbapi_conn: Any, record: Any) -> None:
        tid, fd = record.info.pop("kdb_fd", (None, None))
        if tid is not None:
            with self._lock:
                self._fds.get(tid, set()).discard(fd)

    @contextlib.contextmanager
    def guard(self, seconds: float, fds: Iterable[int] = ()) -> Iterator[None]:
        """Bound what this thread does inside the block (``fds``: sockets it uses that it
        did not check out itself). Nested guards keep the outer deadline's later end."""
        tid = threading.get_ident()
        extra = set(fds)
        with self._lock:
            before = self._deadlines.get(tid)
            self._deadlines[tid] = max(time.monotonic() + seconds, before or 0.0)
            if extra:
                self._fds.setdefault(tid, set()).update(extra)
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._watch, name="kdb-shared-watchdog",
                                                daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                if before is None:
                    self._deadlines.pop(tid, None)
                else:
                    self._deadlines[tid] = before
                if extra:
                    self._fds.get(tid, set()).difference_update(extra)

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            now = time.monotonic()
            with self._lock:
                late = [tid for tid, end in self._deadlines.items() if now >= end]
                cut = [fd for tid in late for fd in self._fds.get(tid, ())]
                for tid in late:
                    self._deadlines.pop(tid)
            for fd in cut:
                log.debug("kdb: shared tier: cutting a connection that stopped answering")
                try:
                    with socket.socket(fileno=os.dup(fd)) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


_watchdog = _Watchdog()


def _bound_s(statements: int = 2) -> float:
    """Seconds one operation may take: its statements and a connect, plus a margin."""
    return (statements * config.seconds(config.ENV_SHARED_STATEMENT_TIMEOUT,
                                        config.SHARED_STATEMENT_TIMEOUT_S)
            + config.seconds(config.ENV_SHARED_CONNECT_TIMEOUT, config.SHARED_CONNECT_TIMEOUT_S)
            + 2.0)


def create_engine(url: str) -> Engine:
    """An engine for ``url`` with bounded connects and statements.

    A bare ``postgresql://`` URL gets the psycopg 3 driver (the ``postgres`` extra), not
    SQLAlchemy's default psycopg2. Raises :class:`~kdb.errors.ConfigError` for a URL that is
    not PostgreSQL, whose advisory locks single-flight needs.
    """
    from sqlalchemy import create_engine as _create
    from sqlalchemy.engine import make_url

    from .errors import ConfigError

    try:
        u = make_url(url)
    except Exception:  # noqa: BLE001 - the message may hold the URL: never repeat it
        raise ConfigError("the shared tier's URL is not a valid SQLAlchemy URL; write it as "
                          "postgresql+psycopg://user@host:port/database") from None
    if u.drivername == "postgresql":
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() != "postgresql":
        raise ConfigError(f"the shared tier needs a PostgreSQL URL "
                          f"(postgresql+psycopg://user@host/db), not {u.drivername}://")
    connect_s = config.seconds(config.ENV_SHARED_CONNECT_TIMEOUT,
                               config.SHARED_CONNECT_TIMEOUT_S)
    statement_ms = int(1000 * config.seconds(config.ENV_SHARED_STATEMENT_TIMEOUT,
                                             config.SHARED_STATEMENT_TIMEOUT_S))
    args: dict[str, Any] = {
        "connect_timeout": max(1, math.ceil(connect_s)),
        "application_name": "kdb",
        # A network partition: sent data that is never acknowledged fails the connection
        # instead of being retransmitted for many minutes; idle pooled connections are probed.
        "tcp_user_timeout": statement_ms + int(1000 * connect_s),
        "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 5, "keepalives_count": 3,
    }
    # Server-side bounds: a slow statement or a lock wait is cancelled, never waited out.
    args["options"] = (f"-c statement_timeout={statement_ms} -c lock_timeout={statement_ms} "
                       f"-c idle_in_transaction_session_timeout={max(statement_ms, 1000) * 4}")
    for name in [k for k in args if k in u.query]:  # what the URL sets itself is kept
        del args[name]
    engine = _create(u, connect_args=args, pool_size=2, max_overflow=6,
                     pool_timeout=max(connect_s, 1.0), pool_recycle=600)
    event.listen(engine, "checkout", _watchdog.checkout)
    event.listen(engine, "checkin", _watchdog.checkin)
    return engine


def _revision(conn: Connection) -> str | None:
    from sqlalchemy import inspect

    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


class SharedTier:
    """One shared database as this process sees it: engine, locks, and whether it is up.

    Thread-safe and fork-safe (a child forgets the parent's connections). Every method
    answers ``None``/``False``/``0`` while the tier is off or down, at once.
    """

    def __init__(self, url: str) -> None:
        self.url = url
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

    #: The tier's name (:mod:`kdb.tiers`).
    name = "shared"

    def __repr__(self) -> str:
        return f"SharedTier({self.shown!r})"

    def describe(self) -> str:
        """The server, its password masked."""
        return self.shown

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
                    self._engine = create_engine(self.url)
                if not self._ready:
                    self._check_schema(self._engine)
            except Exception as err:  # noqa: BLE001 - any fault: warn, go local
                from .errors import ConfigError

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
        self._ready = False
        self._pid = os.getpid()

    def _turn_off(self, why: str) -> None:
        self._off = why
        faults.fault(f"the shared tier {self.shown} is off: {why}; kdb uses its local tiers",
                     once="shared-off:" + self.shown)

    def failed(self, err: BaseException, doing: str) -> None:
        """A fault talking to the server: warn once, skip the tier for a while, go local."""
        retry = config.seconds(config.ENV_SHARED_RETRY, config.SHARED_RETRY_S)
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
        log.debug("kdb: shared tier %s failed while %s: %s", self.shown, doing,
                  self._last_error)
        faults.fault(f"the shared tier {self.shown} is unavailable ({self._last_error}) while "
                     f"{doing}; kdb goes on with its local tiers and tries the server again "
                     f"at most every {retry:g} s ({config.ENV_SHARED_RETRY})",
                     once="shared-down:" + self.shown)

    def reason(self, err: BaseException) -> str:
        """Why ``err`` happened, in one line, with no SQL, parameters, URL or password."""
        from sqlalchemy.engine import make_url

        message = _reason(err).replace(self.url, self.shown)
        try:
            password = make_url(self.url).password
        except Exception:  # noqa: BLE001 - unparsable: the URL itself was replaced above
            password = None
        return message.replace(str(password), "***") if password else message

    def _run(self, doing: str, fn: Callable[[Engine], T], default: T) -> T:
        with _watchdog.guard(_bound_s()):
            engine = self.engine()
            if engine is None:
                return default
            try:
                return fn(engine)
            except Exception as err:  # noqa: BLE001 - the cache never breaks the program
                self.failed(err, doing)
                return default

    # -- schema -----------------------------------------------------------------------------

    def _check_schema(self, engine: Engine) -> None:
        """As for a user file: head is used, older is upgraded, newer turns the tier off."""
        with engine.connect() as conn:
            rev = _revision(conn)
            conn.commit()
            if rev is not None and rev not in migrate.REVISIONS:
                self._turn_off(f"its schema revision {rev!r} is newer than this kdb knows "
                               f"({migrate.HEAD}); upgrade kdb (pip install -U kdb) on this "
                               "node, or point KDB_SHARED_URL at another database")
                return
            if rev != migrate.HEAD:
                with _watchdog.guard(_MIGRATE_WAIT_S + _bound_s()):
                    upgrade(conn)
        self._ready = True

    # -- reads ------------------------------------------------------------------------------

    def fetch(self, key: str) -> SharedRow | None:
        """The entry for ``key``, or ``None`` (a miss, or the tier is unavailable)."""
        def q(engine: Engine) -> SharedRow | None:
            with engine.connect() as conn:
                row = conn.execute(select(*_FETCH_COLUMNS).where(kernels.c.key == key)).first()
            return SharedRow(*row) if row else None

        return self._run("looking up a kernel", q, None)

    def touch(self, key: str) -> None:
        """Count a hit served from the shared tier (runs on the background thread)."""
        now = time.time()

        def w(engine: Engine) -> None:
            with engine.begin() as conn:
                conn.execute(kernels.update().where(kernels.c.key == key).values(
                    hits=kernels.c.hits + 1, last_access=func.greatest(kernels.c.last_access,
                                                                       now)))
                _bump_counters(conn, {"hits": 1})

        self._run("counting a hit", w, None)

    # -- writes -----------------------------------------------------------------------------

    def publish(self, entries: list[Entry], logs: list[CompileRecord] = ()) -> int:
        """Insert entries (an existing key is kept) and log rows; returns entries added."""
        from sqlalchemy.dialects.postgresql import insert

        now = time.time()
        rows = []
        for e in entries:
            kind, blob = codec.encode(e.raw)
            rows.append(dict(key=e.key, arch=e.arch, backend=e.backend, name=e.name,
                             attributes=e.attributes,
                             details=json.dumps(e.details or {}, sort_keys=True), codec=kind,
                             dict_id=None, blob=blob, raw_size=len(e.raw),
                             stored_size=len(blob), checksum=codec.checksum(e.raw),
                             compile_seconds=e.compile_seconds, created=now, last_access=now,
                             hits=0, compiler_free_key=compiler_free_key(e.attributes)))

        def w(engine: Engine) -> int:
            added = added_raw = added_stored = 0
            with engine.begin() as conn:
                for row in rows:
                    res = conn.execute(insert(kernels).values(**row)
                                       .on_conflict_do_nothing(index_elements=["key"]))
                    if res.rowcount:
                        added += 1
                        added_raw += row["raw_size"]
                        added_stored += row["stored_size"]
                if added:
                    _bump_meta(conn, {"entries": added, "raw_bytes": added_raw,
                                      "stored_bytes": added_stored})
                if logs:
                    conn.execute(compile_log.insert(), [dict(
                        at=r.at, key=r.key, name=r.name, arch=r.arch, backend=r.backend,
                        seconds=r.seconds, missed=r.missed + ",shared", reason=r.reason,
                        pid=r.pid) for r in logs])
                    _bump_counters(conn, {"compiles": len(logs),
                                          "compile_seconds": sum(r.seconds for r in logs)})
            return added

        return self._run("publishing a kernel", w, 0)

    def drop(self, keys: Iterable[str]) -> None:
        """Delete bad entries (checksum mismatch or key collision), so they are published
        anew."""
        keys = list(keys)

        def w(engine: Engine) -> None:
            with engine.begin() as conn:
                rows = conn.execute(kernels.delete().where(kernels.c.key.in_(keys)).returning(
                    kernels.c.raw_size, kernels.c.stored_size)).all()
                if rows:
                    _bump_meta(conn, {"entries": -len(rows),
                                      "raw_bytes": -sum(r[0] for r in rows),
                                      "stored_bytes": -sum(r[1] for r in rows)})

        self._run("dropping a bad entry", w, None)

    # -- single flight across nodes ---------------------------------------------------------

    def _on_locker(self, doing: str, sql: str, params: dict[str, Any]) -> Any:
        """One statement on this process's lock connection; ``None`` when unavailable."""
        with self._locker_lock, _watchdog.guard(_bound_s()):
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
                with _watchdog.guard(_bound_s(), fds=[self._locker_fd()]):
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
                              {"k": lock_id(key)})
        if got:
            self._held.add(key)
        return got

    def unlock(self, key: str) -> None:
        """Give the compile lock of ``key`` up (after publishing, or when compiling failed)."""
        if key not in self._held:
            return
        self._held.discard(key)
        self._checked.pop(key, None)
        self._on_locker("releasing a compile lock", "SELECT pg_advisory_unlock(:k)",
                        {"k": lock_id(key)})

    def want(self, key: str) -> None:
        """Tell the node that compiles ``key`` that this process waits for it."""
        if key in self._wants:
            return
        if self._on_locker("waiting for a kernel", "SELECT pg_try_advisory_lock_shared(:k)",
                           {"k": _want_id(key)}):
            self._wants.add(key)

    def unwant(self, key: str) -> None:
        """Stop waiting for ``key``."""
        if key not in self._wants:
            return
        self._wants.discard(key)
        self._on_locker("waiting for a kernel", "SELECT pg_advisory_unlock_shared(:k)",
                        {"k": _want_id(key)})

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
                               {"k": _want_id(key)})
        answer = free is False
        self._checked[key] = (now, answer)
        return answer

    def adopt(self, claim: claims.Claim) -> claims.Claim:
        """Make a local claim also hold (and, on release, give up) the cross-node lock."""
        claim.__class__ = SharedClaim  # same layout: the claim stays in kdb.claims' registry
        claim._tier = self  # type: ignore[attr-defined]
        return claim

    # -- reports ----------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """What ``kdb info`` and ``kdb stats`` show: reachability, revision, totals, counters.

        Reads only, on a connection of its own: a report never creates or upgrades the
        schema, and a server it cannot reach is a ``problem`` here, not a warning.
        """
        out: dict[str, Any] = {"url": self.shown, "reachable": False, "revision": None,
                               "problem": None, "entries": 0, "raw_bytes": 0,
                               "stored_bytes": 0, "hits": 0, "compiles": 0,
                               "compile_seconds": 0.0, "arches": {}}
        try:
            engine = create_engine(self.url)
        except Exception as err:  # noqa: BLE001 - a bad URL: say so
            out["problem"] = self.reason(err)
            return out
        try:
            with _watchdog.guard(_bound_s(4)), engine.connect() as conn:
                rev = out["revision"] = _revision(conn)
                out["reachable"] = True
                if rev is None:
                    out["problem"] = "no kdb schema yet (kdb creates it on first use)"
                elif rev not in migrate.REVISIONS:
                    out["problem"] = (f"schema revision {rev!r} is newer than this kdb knows "
                                      f"({migrate.HEAD}): the tier is off here")
                else:
                    _read_totals(conn, out)
        except Exception as err:  # noqa: BLE001 - unreachable, refusing, or slow
            out["problem"] = f"unreachable: {self.reason(err)}"
        finally:
            engine.dispose()
        return out

    def export(self, arch: str, dest: Path) -> int:
        """Copy the ``arch`` entries and log rows into a new SQLite user file at ``dest``
        (for ``kdb pack --from-db URL``); returns how many entries. Raises on a fault."""
        engine = self.engine()
        if engine is None:
            from .errors import KdbError

            raise KdbError(f"the shared tier is unavailable: {self._off or self._last_error}")
        migrate.upgrade_sqlite(dest)
        cols = [c.name for c in kernels.columns]
        log_cols = [c.name for c in compile_log.columns if c.name != "id"]
        out = sqlite3.connect(dest, isolation_level=None)
        n = 0
        try:
            out.execute("BEGIN")
            with engine.connect() as conn:
                rows = conn.execution_options(yield_per=256).execute(
                    select(*kernels.columns).where(kernels.c.arch == arch))
                for part in rows.partitions():
                    out.executemany(f"INSERT INTO kernels ({', '.join(cols)}) VALUES "
                                    f"({', '.join('?' * len(cols))})",
                                    [tuple(r) for r in part])
                    n += len(part)
                logged = conn.execute(select(*(compile_log.c[c] for c in log_cols)).where(
                    compile_log.c.arch == arch)).all()
            out.executemany(f"INSERT INTO compile_log ({', '.join(log_cols)}) VALUES "
                            f"({', '.join('?' * len(log_cols))})", [tuple(r) for r in logged])
            out.execute("COMMIT")
        finally:
            out.close()
        return n


class SharedClaim(claims.Claim):
    """A local claim that also holds its key's compile lock on the shared tier."""

    _tier: SharedTier

    @property
    def wanted(self) -> bool:
        """Whether a process of this node or of another waits for this key."""
        return super().wanted or self._tier.wanted(self.key)

    def release(self) -> None:
        try:
            self._tier.unlock(self.key)
        finally:
            super().release()


def upgrade(conn: Connection, revision: str = "head") -> None:
    """Create or upgrade the shared schema; one upgrader at a time (``pg_advisory_lock``).

    The others wait here, bounded by a longer statement timeout, then find it current.
    """
    from alembic import command

    wait_ms = int(1000 * max(_MIGRATE_WAIT_S, config.seconds(
        config.ENV_SHARED_STATEMENT_TIMEOUT, config.SHARED_STATEMENT_TIMEOUT_S)))
    conn.exec_driver_sql(f"SET statement_timeout = {wait_ms}")
    conn.exec_driver_sql(f"SET lock_timeout = {wait_ms}")
    conn.execute(select(func.pg_advisory_lock(MIGRATE_LOCK)))
    conn.commit()
    try:
        rev = _revision(conn)
        conn.commit()
        target = migrate.HEAD if revision == "head" else revision
        if rev is None or (rev in migrate.REVISIONS and migrate.REVISIONS.index(rev)
                           < migrate.REVISIONS.index(target)):
            with conn.begin():
                command.upgrade(migrate.alembic_config(connection=conn), revision)
            if rev is None:
                _describe(conn)
    finally:
        conn.rollback()
        conn.execute(select(func.pg_advisory_unlock(MIGRATE_LOCK)))
        conn.exec_driver_sql("RESET statement_timeout")
        conn.exec_driver_sql("RESET lock_timeout")
        conn.commit()


def _describe(conn: Connection) -> None:
    from sqlalchemy.dialects.postgresql import insert

    from .version import __version__

    with conn.begin():
        for name, value in (("tier", "shared"), ("format", str(config.FORMAT_MAJOR)),
                            ("kdb_version", __version__), ("created", str(time.time()))):
            conn.execute(insert(meta).values(name=name, value=value).on_conflict_do_nothing())


def _read_totals(conn: Connection, out: dict[str, Any]) -> None:
    totals = dict(conn.execute(select(meta.c.name, meta.c.value).where(
        meta.c.name.in_(("entries", "raw_bytes", "stored_bytes")))).all())
    for k in ("entries", "raw_bytes", "stored_bytes"):
        out[k] = int(totals.get(k, 0))
    ctr = dict(conn.execute(select(counters.c.name, counters.c.value)).all())
    out["hits"] = int(ctr.get("hits", 0))
    out["compiles"] = int(ctr.get("compiles", 0))
    out["compile_seconds"] = float(ctr.get("compile_seconds", 0.0))
    # Per arch: an aggregate (a scan), for the CLI only, never on a lookup.
    for arch, n, size in conn.execute(select(
            kernels.c.arch, func.count(), func.coalesce(func.sum(kernels.c.stored_size), 0))
            .group_by(kernels.c.arch).order_by(kernels.c.arch)):
        out["arches"][arch] = {"entries": int(n), "stored_bytes": int(size)}


def _bump_meta(conn: Connection, deltas: dict[str, int]) -> None:
    from sqlalchemy import BigInteger, Text, cast
    from sqlalchemy.dialects.postgresql import insert

    for name, delta in deltas.items():
        stmt = insert(meta).values(name=name, value=str(delta))
        conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={
            "value": cast(cast(meta.c.value, BigInteger) + delta, Text)}))


def _bump_counters(conn: Connection, deltas: dict[str, float]) -> None:
    from sqlalchemy.dialects.postgresql import insert

    for name, delta in deltas.items():
        stmt = insert(counters).values(name=name, value=delta)
        conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={
            "value": counters.c.value + stmt.excluded.value}))


_tiers: dict[str, SharedTier] = {}
_tiers_lock = threading.Lock()


def tier(url: str) -> SharedTier:
    """This process's :class:`SharedTier` for ``url`` (one per URL)."""
    with _tiers_lock:
        t = _tiers.get(url)
        if t is None:
            t = _tiers[url] = SharedTier(url)
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
    """A child starts with fresh locks (one held by a parent's thread would never be freed)
    and its own watchdog; each tier drops the parent's connections on its next use."""
    global _watchdog, _tiers_lock
    _watchdog = _Watchdog()
    _tiers_lock = threading.Lock()
    for t in _tiers.values():
        t._lock = threading.RLock()
        t._locker_lock = threading.Lock()


lifecycle.on_fork(_after_fork)

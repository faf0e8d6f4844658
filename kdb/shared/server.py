"""The shared tier's server: engines with bounded connects and statements, a watchdog for a
server that stops answering, and the schema's creation and upgrade.

Connects and statements are bounded (``KDB_SHARED_CONNECT_TIMEOUT``,
``KDB_SHARED_STATEMENT_TIMEOUT``) on the server's side and, through :class:`Watchdog`, on
this side too. The schema is the SQLite files' (:mod:`kdb.file.schema`), created and upgraded by
the same alembic migrations, one upgrader at a time under an advisory lock. A URL is shown
only through :func:`mask`. Used by :mod:`kdb.shared.tier` and the keeper (:mod:`kdb.shared.keeper`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import socket
import threading
import time
from typing import Any, Iterable, Iterator

from sqlalchemy import event, func, select, text
from sqlalchemy.engine import Connection, Engine

from .. import config, lifecycle
from ..file import migrate
from ..file.schema import meta

log = logging.getLogger("kdb")


#: Query parameters of a URL that hold a secret (libpq reads ``?password=`` as the password).
SECRET_PARAMETERS = ("password", "sslpassword")


def mask(url: str) -> str:
    """``url`` with its password hidden, for every place a URL is shown or logged.

    >>> mask("postgresql+psycopg://kdb:secret@db:5432/kdb")
    'postgresql+psycopg://kdb:***@db:5432/kdb'
    >>> mask("postgresql+psycopg://kdb@db/kdb?sslmode=require&password=secret")
    'postgresql+psycopg://kdb@db/kdb?password=***&sslmode=require'
    """
    import re

    from sqlalchemy.engine import make_url

    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - an unparsable URL may still hold a password
        return "<unparsable URL>"
    for name in SECRET_PARAMETERS:
        shown = re.sub(rf"([?&]{name}=)[^&]*", r"\g<1>***", shown)
    return shown


def secrets(url: str) -> list[str]:
    """The secrets ``url`` holds: its password and the query's (:data:`SECRET_PARAMETERS`)."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - unparsable: nothing of it is shown (mask)
        return []
    found = [parsed.password] + [parsed.query.get(name) for name in SECRET_PARAMETERS]
    return [str(v) for v in found if v and isinstance(v, str)]


def scrub(message: str, url: str) -> str:
    """``message`` (a driver's error) with ``url`` shown masked and its secrets hidden where
    a driver writes them (``:pw@``, ``password=pw``), and anywhere when long enough to mean
    nothing else: a short one replaced everywhere garbled the text ("Name or ***rvice not
    known" for the password "se") and hinted at what it was.

    >>> scrub("bad dsn: user=kdb password=se host=x: Name or service not known",
    ...       "postgresql+psycopg://kdb:se@x/kdb")
    'bad dsn: user=kdb password=*** host=x: Name or service not known'
    """
    message = message.replace(url, mask(url))
    for secret in secrets(url):
        for form in (f":{secret}@", f"={secret}", f"='{secret}'", f'="{secret}"'):
            message = message.replace(form, form.replace(secret, "***"))
        if len(secret) >= 8:
            message = message.replace(secret, "***")
    return message


def lock_id(text_: str, namespace: str | None = None) -> int:
    """A signed 64-bit advisory lock id for a string (PostgreSQL's ``bigint`` key space).

    Advisory locks are database-wide, not per schema: a tenant's ids are salted with its
    namespace, so two tenants never wait on each other; without one, the ids are as ever.

    >>> lock_id("kdb") == lock_id("kdb") and -2**63 <= lock_id("kdb") < 2**63
    True
    >>> lock_id("kdb", "a") != lock_id("kdb", "b") != lock_id("kdb")
    True
    """
    if namespace is not None:
        text_ = f"{schema_name(namespace)}\n{text_}"  # no namespace holds a newline
    return int.from_bytes(hashlib.sha256(text_.encode("utf-8")).digest()[:8], "big",
                          signed=True)


def schema_name(namespace: str) -> str:
    """The PostgreSQL schema (and default role) of a namespace: ``kdb_<namespace>``."""
    return f"kdb_{namespace}"


#: Held by the process that creates or upgrades the shared schema (salted per namespace).
MIGRATE = "kdb.shared.tier.migrate"
MIGRATE_LOCK = lock_id(MIGRATE)

#: Seconds a process waits for another that upgrades the shared schema (a migration's
#: statements get this bound too).
MIGRATE_WAIT_S = 60.0


def reason(err: BaseException) -> str:
    """A short, credential-free reason: the driver's first line, never SQL or parameters."""
    inner = getattr(err, "orig", None) or err
    first = (str(inner).strip().splitlines() or [type(inner).__name__])[0]
    return f"{type(inner).__name__}: {first[:300]}"


#: SQLSTATEs of a schema that is not what its revision says (a table or column dropped or
#: renamed, a table made again by hand): undefined table, column, function; duplicate table.
_DAMAGED = frozenset({"42P01", "42703", "42883", "42P07"})


def damaged(err: BaseException) -> bool:
    """Whether ``err`` says kdb's schema on the server is not what its revision says: an
    administrator's repair, not an outage to retry."""
    inner = getattr(err, "orig", None) or err
    return getattr(inner, "sqlstate", None) in _DAMAGED


def damaged_problem(err: BaseException, namespace: str | None, url: str = "") -> str:
    """What to tell a user whose shared tier's schema is damaged (:func:`damaged`)."""
    where = f"schema {namespace}" if namespace else "its database"
    return (f"kdb's tables in {where} are not what their revision says ({scrub(reason(err), url)}): "
            "they were changed by hand or by another program. An administrator restores them "
            f"from a backup, or drops them (DROP SCHEMA ... CASCADE, or the tables and "
            "alembic_version) for kdb to create them again, empty")


# -- the client-side bound ------------------------------------------------------------------

class Watchdog:
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


watchdog = Watchdog()


def bound_s(statements: int = 2) -> float:
    """Seconds one operation may take: its statements and a connect, plus a margin."""
    return (statements * config.read(config.ENV_SHARED_STATEMENT_TIMEOUT)
            + config.read(config.ENV_SHARED_CONNECT_TIMEOUT) + 2.0)


def create_engine(url: str, namespace: str | None = None) -> Engine:
    """An engine for ``url`` with bounded connects and statements.

    A bare ``postgresql://`` URL gets the psycopg 3 driver (the ``postgres`` extra), not
    SQLAlchemy's default psycopg2. Raises :class:`~kdb.errors.ConfigError` for a URL that is
    not PostgreSQL, whose advisory locks single-flight needs, or a bad ``namespace``. With a
    namespace, its schema is the connections' whole ``search_path``: the tables, alembic's
    version table and the migrations are the tenant's (:func:`namespace_problem`).
    """
    from sqlalchemy import create_engine as _create
    from sqlalchemy.engine import make_url

    from ..errors import ConfigError

    if namespace is not None:
        namespace = config.parse_namespace(namespace)
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
    connect_s = config.read(config.ENV_SHARED_CONNECT_TIMEOUT)
    statement_ms = int(1000 * config.read(config.ENV_SHARED_STATEMENT_TIMEOUT))
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
    own = u.query.get("options")
    for name in [k for k in args if k in u.query]:  # what the URL sets itself is kept
        del args[name]
    if namespace is not None:  # last: the URL's options may not move a tenant elsewhere
        own = " ".join(own) if isinstance(own, tuple) else own
        args["options"] = " ".join(filter(None, (args.get("options", own),
                                                 f"-c search_path={schema_name(namespace)}")))
    engine = _create(u, connect_args=args, pool_size=2, max_overflow=6,
                     pool_timeout=max(connect_s, 1.0), pool_recycle=600)
    event.listen(engine, "checkout", watchdog.checkout)
    event.listen(engine, "checkin", watchdog.checkin)
    return engine


def schema_revision(conn: Connection) -> str | None:
    from sqlalchemy import inspect

    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()

def namespace_problem(conn: Connection, namespace: str, creating: bool = False) -> str | None:
    """Why this connection cannot keep the tier in ``namespace``'s schema (missing, or the
    role may not use it, or, ``creating``, create tables in it), saying what the administrator
    runs; ``None`` when it can. Checked first: without the schema the search path names none,
    and kdb would find no tables and could create none."""
    schema = schema_name(namespace)
    current, user, usage, create, owner = conn.execute(text(
        "SELECT current_schema(), current_user, has_schema_privilege(n.oid, 'USAGE'), "
        "has_schema_privilege(n.oid, 'CREATE'), pg_get_userbyid(n.nspowner) "
        "FROM (SELECT 1) AS one LEFT JOIN pg_namespace AS n ON n.nspname = :s"),
        {"s": schema}).one()
    setup = (f"; an administrator sets the tenant up with the SQL `kdb shared init "
             f"--tenant {namespace}` prints")
    if usage is None:
        what = "does not exist in this database" + setup
    elif (not usage or current != schema) and owner != user:
        # Set up already, for another role: init again would grant this one nothing.
        what = (f"may not be used by the role {user}: it is the role {owner}'s. Connect as "
                f"that tenant's role in {config.ENV_SHARED_URL}, or set "
                f"{config.ENV_SHARED_NAMESPACE} to the tenant of the role {user}")
    elif not usage or current != schema:
        what = f"may not be used by the role {user}" + setup
    elif creating and not create:
        what = f"is not the role {user}'s to create tables in" + setup
    else:
        return None
    return f"{config.ENV_SHARED_NAMESPACE}={namespace}: its schema {schema} {what}"


def no_namespace_problem(conn: Connection) -> str | None:
    """Why a connection with no namespace cannot create kdb's tables where they would go
    (the first schema of its search path; ``public``, where ``kdb shared init`` revokes
    CREATE: a tenant's role whose nodes lacked ``KDB_SHARED_NAMESPACE`` was told "kdb
    creates it on first use" and retried for ever); ``None`` when it can."""
    current, user, create = conn.execute(text(
        "SELECT current_schema(), current_user, CASE WHEN current_schema() IS NULL THEN "
        "false ELSE has_schema_privilege(current_schema(), 'CREATE') END")).one()
    if create:
        return None
    where = f"the schema {current}" if current else "any schema of its search path"
    return (f"the role {user} may not create kdb's tables in {where}: on a server set up "
            f"for tenants, set {config.ENV_SHARED_NAMESPACE} to the role's tenant (the "
            f"namespace `kdb shared init --tenant NAME` was run for)")


def upgrade(conn: Connection, revision: str = "head", namespace: str | None = None) -> None:
    """Create or upgrade the shared schema; one upgrader at a time (``pg_advisory_lock``,
    one per namespace).

    The others wait here, bounded by a longer statement timeout, then find it current.
    """
    from alembic import command

    lock = lock_id(MIGRATE, namespace)
    wait_ms = int(1000 * max(MIGRATE_WAIT_S, config.read(config.ENV_SHARED_STATEMENT_TIMEOUT)))
    conn.exec_driver_sql(f"SET statement_timeout = {wait_ms}")
    conn.exec_driver_sql(f"SET lock_timeout = {wait_ms}")
    conn.execute(select(func.pg_advisory_lock(lock)))
    conn.commit()
    try:
        rev = schema_revision(conn)
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
        conn.execute(select(func.pg_advisory_unlock(lock)))
        conn.exec_driver_sql("RESET statement_timeout")
        conn.exec_driver_sql("RESET lock_timeout")
        conn.commit()


def _describe(conn: Connection) -> None:
    from sqlalchemy.dialects.postgresql import insert

    from .._version import __version__

    with conn.begin():
        for name, value in (("tier", "shared"), ("format", str(config.FORMAT_MAJOR)),
                            ("kdb_version", __version__), ("created", str(time.time()))):
            conn.execute(insert(meta).values(name=name, value=value).on_conflict_do_nothing())



def _after_fork() -> None:
    """A child starts its own watchdog (the parent's thread does not exist there)."""
    global watchdog
    watchdog = Watchdog()


lifecycle.on_fork(_after_fork)

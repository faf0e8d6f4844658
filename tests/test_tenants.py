"""Tenants on one shared server (KDB_SHARED_NAMESPACE), kept apart by the server itself.

Each tenant is set up with the SQL ``kdb shared init --tenant NAME`` prints, applied as the
superuser ``kdb`` of the throw-away server ``tests/test_shared.py`` starts; the tests then
connect as the tenants' own roles (scram over 127.0.0.1), through kdb and by hand-written SQL.
Roles belong to the whole server, so each test names its tenants apart (``a_<tag>``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from typing import NamedTuple

import pytest
from click.testing import CliRunner

from kdb import KernelDB
from kdb.storing.stores import make_entry
from kdb.cli import cli
from test_shared import BINARY, PASSWORD, attrs, pg, shared_url  # noqa: F401 - fixtures

TENANT_PASSWORD = "tenant-Pw-9k2"


class Tenant(NamedTuple):
    namespace: str
    role: str
    url: str
    db: str

    @property
    def schema(self) -> str:
        return "kdb_" + self.namespace


def init_tenant(pg, db: str, namespace: str, role: str | None = None) -> Tenant:
    """Apply what ``kdb shared init --tenant`` prints, as a superuser, and set a password."""
    res = CliRunner().invoke(cli, ["shared", "init", "--tenant", namespace]
                             + (["--role", role] if role else []))
    assert res.exit_code == 0, res.output
    pg.sql(res.output, db)  # as printed: psql would read the same text
    role = role or f"kdb_{namespace}"
    pg.sql(f"ALTER ROLE {role} PASSWORD '{TENANT_PASSWORD}'")
    return Tenant(namespace, role, f"postgresql+psycopg://{role}:{TENANT_PASSWORD}@127.0.0.1:"
                                   f"{pg.port}/{db}", db)


def fresh_database(pg, request) -> tuple[str, str]:
    """A new database for this test, and a tag to name its tenants apart."""
    tag = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]
    db = f"tn_{tag}"
    pg.sql(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    pg.sql(f'CREATE DATABASE "{db}"')
    return db, tag


@pytest.fixture
def two(pg, request, monkeypatch):
    """Tenants ``a_<tag>`` and ``b_<tag>`` on one fresh database; b's role is not named after
    its schema (PostgreSQL's default search path, ``"$user", public``, would find a's)."""
    import kdb.shared.tier
    from kdb.storing import background

    db, tag = fresh_database(pg, request)
    monkeypatch.delenv("KDB_SHARED_URL", raising=False)
    monkeypatch.delenv("KDB_SHARED_NAMESPACE", raising=False)
    kdb.shared.tier.reset()
    yield init_tenant(pg, db, f"a_{tag}"), init_tenant(pg, db, f"b_{tag}", f"team_b_{tag}")
    background.drain()
    kdb.shared.tier.reset()


def use(monkeypatch, tenant: Tenant) -> None:
    """This process is now one of ``tenant``'s nodes."""
    monkeypatch.setenv("KDB_SHARED_URL", tenant.url)
    monkeypatch.setenv("KDB_SHARED_NAMESPACE", tenant.namespace)


def connect(pg, tenant: Tenant):
    import psycopg

    return psycopg.connect(host="127.0.0.1", port=pg.port, user=tenant.role,
                           password=TENANT_PASSWORD, dbname=tenant.db, autocommit=True,
                           connect_timeout=10)


def rows(pg, tenant: Tenant, query: str) -> list[tuple]:
    """``query`` as the superuser, ``{s}`` standing for the tenant's schema."""
    return pg.sql(query.format(s=tenant.schema), tenant.db)


# -- 1. separate entries, counters, logs -----------------------------------------------------

def test_each_tenant_is_served_its_own_entries_only(two, pg, tmp_path, monkeypatch):
    a, b = two
    use(monkeypatch, a)
    node_a = KernelDB(cache_dir=tmp_path / "a1")
    assert node_a.get_or_compile(attrs(1), lambda: BINARY) == BINARY
    node_a.flush()
    assert KernelDB(cache_dir=tmp_path / "a2").lookup(attrs(1)).tier == "shared"  # a's node 2

    use(monkeypatch, b)
    node_b = KernelDB(cache_dir=tmp_path / "b1")
    assert node_b.lookup(attrs(1)) is None  # a's entry is not b's: a miss
    calls = []
    assert node_b.get_or_compile(attrs(1), lambda: calls.append(1) or b"b's own") == b"b's own"
    assert node_b.get_or_compile(attrs(2), lambda: calls.append(2) or BINARY) == BINARY
    node_b.flush()
    assert calls == [1, 2]  # b compiled both
    assert KernelDB(cache_dir=tmp_path / "b2").get(attrs(1)) == b"b's own"  # same key, b's row

    use(monkeypatch, a)
    assert KernelDB(cache_dir=tmp_path / "a3").lookup(attrs(2)) is None  # and vice versa
    assert KernelDB(cache_dir=tmp_path / "a4").get(attrs(1)) == BINARY

    assert {r[0] for r in rows(pg, a, "SELECT key FROM {s}.kernels")} == {attrs(1).key}
    assert {r[0] for r in rows(pg, b, "SELECT key FROM {s}.kernels")} == {attrs(1).key,
                                                                          attrs(2).key}
    compiles = "SELECT value FROM {s}.counters WHERE name = 'compiles'"
    assert rows(pg, a, compiles) == [(1.0,)] and rows(pg, b, compiles) == [(2.0,)]
    assert rows(pg, a, "SELECT name FROM {s}.compile_log") == [("k1",)]
    assert sorted(rows(pg, b, "SELECT name FROM {s}.compile_log")) == [("k1",), ("k2",)]
    entries = "SELECT value FROM {s}.meta WHERE name = 'entries'"
    assert rows(pg, a, entries) == [("1",)] and rows(pg, b, entries) == [("2",)]
    # Everything, the migrations' version table too, is in the tenants' schemas: none in public.
    from kdb.file import migrate

    assert rows(pg, a, "SELECT version_num FROM {s}.alembic_version") == [(migrate.HEAD,)]
    assert pg.sql("SELECT table_name FROM information_schema.tables WHERE table_schema = "
                  "'public'", a.db) == []


# -- 2. hand-written SQL cannot cross ------------------------------------------------------

def test_another_tenants_role_cannot_read_or_write_with_hand_written_sql(two, pg, tmp_path):
    from psycopg import errors

    from kdb.shared.tier import SharedTier

    a, b = two
    tier_a = SharedTier(a.url, a.namespace)
    tier_a.publish([make_entry(attrs(1), BINARY, 0.1, None)])
    assert rows(pg, a, "SELECT count(*) FROM {s}.kernels") == [(1,)]
    s = a.schema
    refused = []
    for table, column in (("kernels", "hits"), ("compile_log", "name"), ("counters", "value"),
                          ("meta", "value"), ("alembic_version", "version_num")):
        refused += [f"SELECT * FROM {s}.{table}", f"INSERT INTO {s}.{table} DEFAULT VALUES",
                    f"UPDATE {s}.{table} SET {column} = {column}", f"DELETE FROM {s}.{table}",
                    f"TRUNCATE {s}.{table}"]
    refused += [f"CREATE TABLE {s}.planted (x int)", "CREATE TABLE public.planted (x int)",
                f"GRANT USAGE ON SCHEMA {s} TO {b.role}", f"ALTER SCHEMA {s} OWNER TO {b.role}",
                f"SET ROLE {a.role}", f"SET SESSION AUTHORIZATION {a.role}",
                f"DROP SCHEMA {s} CASCADE"]
    with connect(pg, b) as conn:
        for statement in refused:
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement)
        conn.execute(f"SET search_path TO {s}")
        with pytest.raises(errors.UndefinedTable):  # a schema b may not use is not on its path
            conn.execute("SELECT * FROM kernels")
        assert conn.execute("SELECT current_schema()").fetchone() == (None,)
        conn.execute(f"SET search_path TO {b.schema}")
        conn.execute("CREATE TABLE mine (x int)")  # b's own schema is b's
    assert rows(pg, a, "SELECT count(*) FROM {s}.kernels") == [(1,)]  # untouched
    assert pg.sql("SELECT count(*) FROM information_schema.tables WHERE table_name = "
                  "'planted'", a.db) == [(0,)]


# -- 3. a namespace the administrator never set up ------------------------------------------

def test_a_namespace_without_its_schema_turns_the_tier_off_and_compiles_locally(
        pg, shared_url, cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("KDB_SHARED_NAMESPACE", "nobody")
    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        for i in range(3):
            assert db.get_or_compile(attrs(i), lambda: BINARY) == BINARY
        db.flush()
    warnings = [r.getMessage() for r in caplog.records if "shared tier" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "KDB_SHARED_NAMESPACE=nobody: its schema kdb_nobody does not exist" in warnings[0]
    assert "`kdb shared init --tenant nobody`" in warnings[0]
    assert PASSWORD not in caplog.text
    assert db.lookup(attrs(2)).tier == "user"  # nothing lost locally
    name = shared_url.rsplit("/", 1)[1]
    assert pg.sql("SELECT count(*) FROM information_schema.tables WHERE table_schema NOT IN "
                  "('pg_catalog', 'information_schema')", name) == [(0,)]  # created nowhere

    res = CliRunner().invoke(cli, ["info", "--json"])
    assert res.exit_code == 0, res.output
    shared = json.loads(res.stdout)["shared"]
    assert shared["namespace"] == "nobody"
    assert "kdb shared init --tenant nobody" in shared["problem"]


def test_a_role_using_another_tenants_namespace_turns_the_tier_off(two, pg, tmp_path,
                                                                   monkeypatch, caplog):
    a, b = two
    monkeypatch.setenv("KDB_SHARED_URL", b.url)
    monkeypatch.setenv("KDB_SHARED_NAMESPACE", a.namespace)  # b's credentials, a's namespace
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db = KernelDB(cache_dir=tmp_path / "b")
        assert db.get_or_compile(attrs(1), lambda: BINARY) == BINARY
        db.flush()
    assert f"may not be used by the role {b.role}" in caplog.text
    # Set up already: init again would grant b's role nothing; the URL's role is the fix.
    assert "Connect as that tenant's role in KDB_SHARED_URL" in caplog.text
    assert "kdb shared init" not in caplog.text
    assert TENANT_PASSWORD not in caplog.text
    assert db.lookup(attrs(1)).tier == "user"
    assert pg.sql("SELECT to_regclass(%s)", a.db, (f"{a.schema}.kernels",)) == [(None,)]


# -- 4. advisory locks -----------------------------------------------------------------------

def test_advisory_lock_ids_are_salted_per_namespace_and_unchanged_without_one():
    from kdb.shared import usage
    from kdb.shared.locks import compile_id, want_id
    from kdb.shared.server import MIGRATE_LOCK, lock_id

    def before(text: str) -> int:  # the ids kdb took before namespaces existed
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)

    key = attrs(1).key
    assert compile_id(key) == before(key) and want_id(key) == before("want:" + key)
    assert MIGRATE_LOCK == before("kdb.shared.tier.migrate")
    assert usage.EVICT_LOCK == before("kdb.shared.tier.evict")
    for text in (key, "want:" + key, "kdb.shared.tier.migrate", "kdb.shared.tier.evict"):
        ids = {lock_id(text), lock_id(text, "a"), lock_id(text, "b"), lock_id(text, "a_b")}
        assert len(ids) == 4 and all(-2**63 <= i < 2**63 for i in ids)
    assert compile_id(key, "a") == compile_id(key, "a") != want_id(key, "a")


def test_two_tenants_compiling_the_same_kernel_do_not_wait_on_each_other(two):
    from kdb.shared.tier import WANT_CHECK_S, SharedTier

    a, b = two
    key = attrs(7).key
    a1, a2 = SharedTier(a.url, a.namespace), SharedTier(a.url, a.namespace)
    b1 = SharedTier(b.url, b.namespace)
    assert a1.try_lock(key) is True
    assert b1.try_lock(key) is True  # another tenant: its own single flight
    assert a2.try_lock(key) is False  # the same tenant still waits for its own compile
    b1.want(key)
    time.sleep(WANT_CHECK_S)
    assert a1.wanted(key) is False  # b waiting is nothing to a
    a2.want(key)
    time.sleep(WANT_CHECK_S)
    assert a1.wanted(key) is True
    for t in (a1, b1):
        t.unlock(key)


def test_evictions_of_two_tenants_do_not_wait_on_each_other(two):
    from kdb.shared import usage
    from kdb.shared.server import create_engine

    a, b = two
    from kdb.shared.tier import SharedTier

    for t in (a, b):
        assert SharedTier(t.url, t.namespace).engine() is not None  # the tables exist
    engines = [create_engine(t.url, t.namespace) for t in (a, a, b)]
    try:
        with engines[0].begin() as holder:  # a's evictor, mid-eviction
            assert usage.evict(holder, 1 << 30, a.namespace) == 0
            with engines[1].begin() as other_a, engines[2].begin() as other_b:
                assert usage.evict(other_a, 1 << 30, a.namespace) is None  # a's turn is taken
                assert usage.evict(other_b, 1 << 30, b.namespace) == 0  # b's is not
    finally:
        for engine in engines:
            engine.dispose()


def test_a_keeper_holds_the_namespaces_lock_ids(two, tmp_path):
    """The keeper (claims of queued stores after their process exits) takes the salted ids."""
    from kdb.shared.locks import compile_id

    a, _ = two
    key = attrs(3).key
    job = tmp_path / "x.job"
    job.write_text("{}")
    keeper = subprocess.Popen([sys.executable, "-m", "kdb.shared.keeper"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    keeper.stdin.write(json.dumps({"url": a.url, "namespace": a.namespace,
                                   "items": [[key, str(job)]]}))
    keeper.stdin.close()
    backend = int(keeper.stdout.readline())
    from kdb.shared.tier import SharedTier

    probe = SharedTier(a.url, a.namespace)
    held = None
    for _ in range(100):  # a bigint lock shows as its high (classid) and low (objid) halves
        held = probe._on_locker("test", "SELECT (classid::bigint << 32) | objid::bigint FROM "
                                "pg_locks WHERE locktype = 'advisory' AND pid = :p AND granted",
                                {"p": backend})
        if held is not None:
            break
        time.sleep(0.05)
    assert held == compile_id(key, a.namespace) != compile_id(key)
    assert probe.try_lock(key) is False
    job.unlink()  # stored: the keeper lets go and exits
    assert keeper.wait(timeout=30) == 0
    assert probe.try_lock(key) is True
    probe.unlock(key)


def test_migrations_run_in_the_tenants_schema(two, pg):
    from kdb.file import migrate
    from kdb.shared.server import create_engine, upgrade
    from kdb.shared.tier import SharedTier

    a, b = two
    engine = create_engine(a.url, a.namespace)
    try:
        with engine.connect() as conn:
            upgrade(conn, "0002", namespace=a.namespace)
    finally:
        engine.dispose()
    assert rows(pg, a, "SELECT version_num FROM {s}.alembic_version") == [("0002",)]
    assert SharedTier(a.url, a.namespace).engine() is not None  # first use upgrades to head
    assert rows(pg, a, "SELECT version_num FROM {s}.alembic_version") == [(migrate.HEAD,)]
    assert pg.sql("SELECT to_regclass(%s)", a.db, (f"{b.schema}.alembic_version",)) == [(None,)]
    assert pg.sql("SELECT to_regclass('public.alembic_version')", a.db) == [(None,)]


# -- 5. a bad namespace ----------------------------------------------------------------------

@pytest.mark.parametrize("value", ["Team-A", "1abc", "a" * 41, "a b", "kdb.x", "é"])
def test_a_bad_namespace_is_refused_by_the_command_line(value, monkeypatch):
    from kdb import config

    monkeypatch.setenv("KDB_SHARED_NAMESPACE", value)
    res = CliRunner().invoke(cli, ["info"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "KDB_SHARED_NAMESPACE" in res.output and "lower-case letter" in res.output
    assert "fix or unset" in res.output
    assert config.problems({"KDB_SHARED_NAMESPACE": value})
    assert config.problems({"KDB_SHARED_NAMESPACE": "team_a9"}) == []
    assert config.problems({"KDB_SHARED_NAMESPACE": "  "}) == []  # blank: unset


def test_a_bad_namespace_turns_the_tier_off_in_a_program_never_falls_back(
        pg, shared_url, cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("KDB_SHARED_NAMESPACE", "Team-A")
    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get_or_compile(attrs(1), lambda: BINARY) == BINARY
        db.flush()
    assert "KDB_SHARED_NAMESPACE='Team-A' is not a namespace name" in caplog.text
    assert db.lookup(attrs(1)).tier == "user"
    name = shared_url.rsplit("/", 1)[1]  # nothing written to the namespace everybody shares
    assert pg.sql("SELECT to_regclass('public.kernels')", name) == [(None,)]


# -- 6. the cap ------------------------------------------------------------------------------

def test_the_cap_is_per_namespace(two, pg, tmp_path, monkeypatch):
    import kdb.shared.usage

    a, b = two
    monkeypatch.setattr(kdb.shared.usage, "KEEP_S", 0.0)
    use(monkeypatch, b)
    writer_b = KernelDB(cache_dir=tmp_path / "b")
    for i in range(100, 107):
        writer_b.put(attrs(i), os.urandom(16384))
    use(monkeypatch, a)
    writer_a = KernelDB(cache_dir=tmp_path / "a")
    for i in range(8):
        writer_a.put(attrs(i), os.urandom(16384))
    monkeypatch.setenv("KDB_SHARED_MAX_SIZE", str(7 * 16384))
    writer_a.put(attrs(8), os.urandom(16384))  # a is over its cap: a evicts, from a only
    (n_a, total_a), = rows(pg, a, "SELECT count(*), sum(stored_size) FROM {s}.kernels")
    assert n_a <= 4 and int(total_a) <= 7 * 16384
    assert rows(pg, a, "SELECT value FROM {s}.meta WHERE name = 'stored_bytes'") == [
        (str(total_a),)]
    assert rows(pg, b, "SELECT count(*) FROM {s}.kernels") == [(7,)]  # b at a's cap: kept
    assert rows(pg, b, "SELECT count(*) FROM {s}.counters WHERE name = 'evictions'") == [(0,)]
    use(monkeypatch, b)
    writer_b.put(attrs(107), os.urandom(16384))  # now b is over the cap too: b's own turn
    assert rows(pg, b, "SELECT count(*) FROM {s}.kernels")[0][0] <= 4


# -- reports inside the namespace ------------------------------------------------------------

def test_info_stats_and_pack_read_the_namespace(two, pg, tmp_path, monkeypatch):
    a, b = two
    use(monkeypatch, a)
    db = KernelDB(cache_dir=tmp_path / "a")
    for i in range(3):
        db.get_or_compile(attrs(i), lambda i=i: BINARY + bytes([i]))
    db.flush()
    use(monkeypatch, b)
    other = KernelDB(cache_dir=tmp_path / "b")
    other.get_or_compile(attrs(9), lambda: BINARY)
    other.flush()
    runner = CliRunner()
    for tenant, entries in ((a, 3), (b, 1)):
        use(monkeypatch, tenant)
        monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / f"reports-{tenant.namespace}"))
        stats = json.loads(runner.invoke(cli, ["stats", "--json"]).stdout)["shared"]
        assert stats["namespace"] == tenant.namespace and stats["entries"] == entries
        assert stats["compiles"] == entries and stats["problem"] is None
        text = runner.invoke(cli, ["info"]).output
        assert f"namespace {tenant.namespace} (KDB_SHARED_NAMESPACE)" in text
        assert TENANT_PASSWORD not in text
        res = runner.invoke(cli, ["pack", "--arch", "a1", "--from-db", tenant.url, "--out",
                                  str(tmp_path / f"out-{tenant.namespace}"), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)[0]["entries"] == entries
        assert TENANT_PASSWORD not in res.output


# -- 7. kdb shared init ----------------------------------------------------------------------

def test_shared_init_prints_the_sql_and_the_client_settings():
    res = CliRunner().invoke(cli, ["shared", "init", "--tenant", "vision"])
    assert res.exit_code == 0, res.output
    statements = [line for line in res.output.splitlines() if not line.startswith("--")]
    assert statements == ["CREATE ROLE kdb_vision LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;",
                          "CREATE SCHEMA kdb_vision AUTHORIZATION kdb_vision;",
                          "REVOKE ALL ON SCHEMA kdb_vision FROM PUBLIC;",
                          "REVOKE CREATE ON SCHEMA public FROM PUBLIC;"]
    assert "\\password kdb_vision" in res.output
    assert ("KDB_SHARED_URL=postgresql+psycopg://kdb_vision@HOST:5432/DATABASE "
            "KDB_SHARED_NAMESPACE=vision") in res.output
    res = CliRunner().invoke(cli, ["shared", "init", "--tenant", "vision", "--role", "team_v"])
    assert "CREATE SCHEMA kdb_vision AUTHORIZATION team_v;" in res.output
    for args in (["--tenant", "Vision"], ["--tenant", "v", "--role", "Bad-Role"], []):
        res = CliRunner().invoke(cli, ["shared", "init", *args])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output


def test_shared_init_apply_sets_a_tenant_up_and_keeps_what_exists(pg, request, tmp_path,
                                                                   monkeypatch):
    import kdb.shared.tier

    db, tag = fresh_database(pg, request)
    ns = f"c_{tag}"
    admin = pg.url(db)
    runner = CliRunner()
    res = runner.invoke(cli, ["shared", "init", "--tenant", ns, "--apply", admin])
    assert res.exit_code == 0, res.output
    assert PASSWORD not in res.output and "kdb:***@127.0.0.1" in res.output
    assert f"CREATE SCHEMA kdb_{ns} AUTHORIZATION kdb_{ns};" in res.output
    assert (f"KDB_SHARED_URL=postgresql+psycopg://kdb_{ns}@127.0.0.1:{pg.port}/{db} "
            f"KDB_SHARED_NAMESPACE={ns}") in res.output
    assert pg.sql("SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = %s", db,
                  (f"kdb_{ns}",)) == [(f"kdb_{ns}",)]
    res = runner.invoke(cli, ["shared", "init", "--tenant", ns, "--apply", admin])  # again
    assert res.exit_code == 0, res.output
    assert "kept what exists: CREATE ROLE" in res.output
    assert "kept what exists: CREATE SCHEMA" in res.output

    pg.sql(f"ALTER ROLE kdb_{ns} PASSWORD '{TENANT_PASSWORD}'")
    tenant = Tenant(ns, f"kdb_{ns}", f"postgresql+psycopg://kdb_{ns}:{TENANT_PASSWORD}@"
                                     f"127.0.0.1:{pg.port}/{db}", db)
    use(monkeypatch, tenant)
    kdb.shared.tier.reset()
    try:
        node = KernelDB(cache_dir=tmp_path / "n1")
        node.get_or_compile(attrs(1), lambda: BINARY)
        node.flush()
        assert KernelDB(cache_dir=tmp_path / "n2").lookup(attrs(1)).tier == "shared"
    finally:
        kdb.shared.tier.reset()

    # A role that may not create roles: refused, nothing changed, no password shown.
    res = runner.invoke(cli, ["shared", "init", "--tenant", f"d_{tag}", "--apply", tenant.url])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert TENANT_PASSWORD not in res.output and "nothing was changed" in res.output
    assert pg.sql("SELECT count(*) FROM pg_roles WHERE rolname = %s", params=(f"kdb_d_{tag}",)
                  ) == [(0,)]


def test_shared_init_refuses_a_role_that_reaches_past_the_tenant(pg, request):
    """``--role`` naming an existing role keeps it as it is: a superuser (printed as
    "CREATE ROLE postgres LOGIN NOSUPERUSER ...", and its name put in the nodes' URL) or
    another tenant's role (whose credentials then read and write both) was taken."""
    db, tag = fresh_database(pg, request)
    admin = pg.url(db)
    runner = CliRunner()
    res = runner.invoke(cli, ["shared", "init", "--tenant", f"e_{tag}", "--apply", admin])
    assert res.exit_code == 0, res.output
    superuser = pg.sql("SELECT rolname FROM pg_roles WHERE rolsuper LIMIT 1")[0][0]
    for role, says in ((superuser, "is a superuser"), (f"kdb_e_{tag}", f"owns kdb_e_{tag}")):
        res = runner.invoke(cli, ["shared", "init", "--tenant", f"f_{tag}", "--role", role,
                                  "--apply", admin])
        assert res.exit_code == 1 and says in res.output, res.output
        assert "nothing was changed" in res.output and "Traceback" not in res.output
        assert pg.sql("SELECT count(*) FROM pg_namespace WHERE nspname = %s", db,
                      (f"kdb_f_{tag}",)) == [(0,)]


def test_a_tenants_role_without_its_namespace_is_told_to_set_it(two, pg, tmp_path, monkeypatch,
                                                                 caplog):
    """b's role is not named after its schema: with no namespace its nodes meet ``public``,
    where init revoked CREATE. They were told "kdb creates it on first use" (kdb stats) and
    retried every 30 s for ever ("permission denied for schema public")."""
    import kdb.shared.tier
    from kdb.shared import report

    _, b = two
    monkeypatch.setenv("KDB_SHARED_URL", b.url)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db = KernelDB(cache_dir=tmp_path / "b")
        assert db.get_or_compile(attrs(1), lambda: BINARY) == BINARY
        db.flush()
    assert "KDB_SHARED_NAMESPACE to the role's tenant" in caplog.text, caplog.text
    assert "tries the server again" not in caplog.text
    kdb.shared.tier.reset()
    shown = report.summary(kdb.shared.tier.tier(b.url))
    assert "KDB_SHARED_NAMESPACE" in shown["problem"], shown

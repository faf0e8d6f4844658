"""Compact files (schema revision 0006, kdb.file.compact): attributes compressed, each source
once; a file at most 1.15x its compressed binaries plus an empty file's pages. An older user
file is read as it is and upgraded in place by its writer; an older system file is only read;
keys, signatures, `kdb verify`, `kdb explain`, packs and the shared tier work on both."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from kdb import HashAttributes, KernelDB
from kdb.cli import cli
from kdb.file import codec, compact, migrate
from kdb.pack.systemfile import write_system_db
from kdb.signing import policy as signing
from conftest import attributes_of, sql
from test_shared import pg, shared_url  # noqa: F401 - the PostgreSQL fixtures, used by name
from test_signing import key_id, keys, signer  # noqa: F401 - the key pairs' fixture

ARCH = "c1"
#: A source many entries share (built with other options), large as generated code is.
SHARED = "".join(f"__kernel void k{i}(__global float *a) {{ a[{i}] = {i}.0f * a[{i}]; }}\n"
                 for i in range(300))


def attrs(i: int, source: str | None = None, options: tuple[str, ...] = ()) -> HashAttributes:
    return HashAttributes(backend="test", source=source or f"__kernel void k{i}() {{}}",
                          arch=ARCH, build_options=options, compiler={"cc": "1.0"},
                          name=f"k{i}")


def binary(i: int) -> bytes:
    return os.urandom(2000) + f"binary {i} ".encode() * 500


def entries(n: int = 6) -> list[HashAttributes]:
    """Entries of which all but the last share one large source, with other options."""
    out = [attrs(i, SHARED, (f"-DN={i}",)) for i in range(n - 1)]
    return [*out, attrs(n - 1)]


def file_at_0005(path: Path, items, sign=None) -> Path:
    """A tier file as kdb at revision 0005 wrote it (whole attributes text in each row)."""
    from kdb.keys import compiler_free_key

    path.parent.mkdir(parents=True, exist_ok=True)
    sql(path, "PRAGMA journal_mode=WAL")  # as kdb makes a user file
    migrate.upgrade_sqlite(path, "0005")
    for a, raw in items:
        kind, blob = codec.encode(raw)
        text = a.encoded().decode()
        who, sig = sign.sign(a.key, text, codec.checksum(raw)) if sign else (None, None)
        sql(path, "INSERT INTO kernels (key, arch, backend, name, attributes, details, codec, "
                  "blob, raw_size, stored_size, checksum, compile_seconds, created, last_access, "
                  "hits, compiler_free_key, signer, signature) "
                  "VALUES (?, ?, ?, ?, ?, '{}', ?, ?, ?, ?, ?, 0.5, 1, 1, 0, ?, ?, ?)",
            (a.key, a.arch, a.backend, a.name, text, kind, blob, len(raw), len(blob),
             codec.checksum(raw), compiler_free_key(text), who, sig))
    stored = sum(r[0] for r in sql(path, "SELECT stored_size FROM kernels"))
    raw_total = sum(r[0] for r in sql(path, "SELECT raw_size FROM kernels"))
    sql(path, "INSERT OR REPLACE INTO meta (name, value) VALUES ('entries', ?), "
              "('raw_bytes', ?), ('stored_bytes', ?)",
        (str(len(items)), str(raw_total), str(stored)))
    return path


def revision(path: Path) -> str | None:
    return sql(path, "SELECT version_num FROM alembic_version")[0][0]


def invoke(*args: object, env: dict[str, str] | None = None):
    return CliRunner(env=env).invoke(cli, [str(a) for a in args], catch_exceptions=False)


def policy_env(monkeypatch, keys, require: bool = True) -> None:  # noqa: F811
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    if require:
        monkeypatch.setenv("KDB_REQUIRE_SIGNED", "1")


# -- the format ------------------------------------------------------------------------------

_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=60) | st.sampled_from(
    [',"source":"', '\\",\\"source\\":\\"', '"', "\\", '","spec_constants":[', "\u2028"])


@settings(max_examples=300, deadline=None)
@given(source=st.lists(_TEXT, min_size=1, max_size=4).map("".join).filter(str.strip),
       options=st.lists(_TEXT, max_size=3), headers=st.lists(st.tuples(_TEXT, _TEXT), max_size=2))
def test_packed_attributes_give_back_the_exact_text_and_its_key(source, options, headers):
    try:
        a = HashAttributes("test", source, "c1", build_options=options, headers=headers)
        text = a.encoded().decode()
    except Exception:  # noqa: BLE001 - lone surrogates: not attributes kdb would store
        return
    packed = compact.pack(text)
    assert packed.source is not None  # every canonical text has a source literal to cut out
    assert compact.unpack(packed.attrs, packed.source, packed.body) == text
    assert packed.sha256 == a.key
    assert json.loads(compact.unpack(packed.body))  == source  # the literal alone, as JSON


def test_text_without_a_source_is_stored_whole():
    for text in ("{}", '{"source":3}', '{"a":1,"source":"unterminated}', "not json"):
        packed = compact.pack(text)
        assert packed.source is None and compact.unpack(packed.attrs) == text


def test_entries_that_share_a_source_store_it_once_and_the_last_one_takes_it(cache_dir):
    db = KernelDB(use_system=False)
    items = entries()
    for i, a in enumerate(items):
        db.put(a, binary(i))
    db.close()
    path = cache_dir / "v1" / f"{ARCH}.kdb"
    [(n, body)] = sql(path, "SELECT count(*), sum(length(body)) FROM sources WHERE size > 9000")
    assert n == 1 and body < len(SHARED) / 5  # once, and compressed
    assert sql(path, "SELECT count(*) FROM sources") == [(2,)]
    assert [t for _, _, t in attributes_of(path)] == [a.encoded().decode() for a in items]
    explained = json.loads(invoke("explain", items[0].key[:12], "--json").output)
    assert explained["entry"]["attributes"] == json.loads(items[0].encoded())
    assert list(explained["nearest"][0]["differs"]) == ["build_options"]
    db = KernelDB(use_system=False)
    for a in items[:-2]:
        db.tiers.storing.discard(a, "a test drops it")
    db.flush()
    assert sql(path, "SELECT count(*) FROM sources") == [(2,)]  # one entry still names it
    assert db.get(items[-2]) is not None
    db.tiers.storing.discard(items[-2], "a test drops it")
    db.flush()
    assert sql(path, "SELECT count(*) FROM sources") == [(1,)]
    [(last,)] = sql(path, "SELECT stored_size FROM kernels")
    assert db.tiers.user_file(ARCH).evict_to(0) == (1, last)
    assert sql(path, "SELECT count(*) FROM sources") == [(0,)]
    assert invoke("verify").exit_code == 0


def test_a_row_whose_digest_is_not_its_key_is_a_collision_miss(cache_dir, caplog):
    a = attrs(0)
    KernelDB().put(a, binary(0))
    path = cache_dir / "v1" / f"{ARCH}.kdb"
    sql(path, "UPDATE kernels SET attributes_sha256 = ?", (attrs(1).key,))
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert KernelDB().get(a) is None
    assert "collision" in caplog.text


# -- older files -----------------------------------------------------------------------------

def test_a_user_file_at_0005_is_read_as_it_is_and_upgraded_in_place_by_its_writer(
        cache_dir, keys, monkeypatch):  # noqa: F811
    items = [(a, binary(i)) for i, a in enumerate(entries())]
    path = file_at_0005(cache_dir / "v1" / f"{ARCH}.kdb", items, sign=signer(keys["ci"]))
    texts = [t for _, _, t in attributes_of(path)]
    before = path.stat().st_size
    policy_env(monkeypatch, keys)
    db = KernelDB(use_system=False)
    assert all(db.get(a) == raw for a, raw in items)  # signed over the whole text: verified
    assert revision(path) == "0005" and path.stat().st_size == before  # never on a read
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["ci"]))
    new = attrs(99, SHARED, ("-DN=99",))
    assert db.put(new, binary(99)) is True  # the writer upgrades it, then stores
    db.close()
    assert revision(path) == migrate.HEAD
    assert path.stat().st_size < before - 4 * len(SHARED)  # the copies of the source went
    assert sql(path, "SELECT count(*) FROM sources") == [(2,)]
    assert [t for _, _, t in attributes_of(path) if t in texts] == texts  # byte for byte
    db = KernelDB(use_system=False)
    assert all(db.get(a) == raw for a, raw in items)  # the old signatures still verify
    result = invoke("verify")
    assert result.exit_code == 0, result.output
    assert f"{len(items) + 1} by key {key_id(keys['ci.pub'])}" in result.output
    explained = json.loads(invoke("explain", items[0][0].key[:12], "--json").output)
    assert explained["entry"]["attributes"]["source"] == SHARED
    assert list(explained["nearest"][0]["differs"]) == ["build_options"]


def test_the_upgrade_leaves_no_wal_the_size_of_the_file(cache_dir):
    """VACUUM writes the whole file through the -wal, which keeps its size while another
    process has the file open, unless the upgrade truncates it."""
    items = [(attrs(i), os.urandom(30000)) for i in range(30)]
    path = file_at_0005(cache_dir / "v1" / f"{ARCH}.kdb", items)
    other = sqlite3.connect(path)  # another process that has the file open
    other.execute("SELECT count(*) FROM kernels").fetchall()
    try:
        assert KernelDB(use_system=False).put(attrs(99), binary(99)) is True
        assert revision(path) == migrate.HEAD
        assert Path(f"{path}-wal").stat().st_size < path.stat().st_size / 4
    finally:
        other.close()


def test_a_system_file_at_0005_is_served_as_it_is(tmp_path, keys, monkeypatch):  # noqa: F811
    items = [(a, binary(i)) for i, a in enumerate(entries())]
    d = tmp_path / "system"
    path = file_at_0005(d / f"{ARCH}.kdb", items, sign=signer(keys["ci"]))
    sql(path, "PRAGMA journal_mode=DELETE")
    path.chmod(0o644)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(d))
    policy_env(monkeypatch, keys, require=False)  # the system tier's entries must verify
    db = KernelDB(cache_dir=tmp_path / "cache")
    for a, raw in items:
        hit = db.lookup(a)
        assert hit is not None and hit.tier == "system" and hit.binary == raw
    db.close()
    result = invoke("--cache-dir", tmp_path / "cache", "verify")
    assert result.exit_code == 0, result.output
    explained = json.loads(invoke("--cache-dir", tmp_path / "cache", "explain",
                                  items[-1][0].key[:12], "--json").output)
    assert explained["entry"]["attributes"] == json.loads(items[-1][0].encoded())
    assert revision(path) == "0005"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest  # never written


def test_a_reader_goes_on_when_another_process_upgrades_the_file_under_it(cache_dir, caplog):
    items = [(a, binary(i)) for i, a in enumerate(entries(3))]
    path = file_at_0005(cache_dir / "v1" / f"{ARCH}.kdb", items)
    db = KernelDB(use_system=False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get(items[0][0]) == items[0][1]  # read with revision 0005's columns
        migrate.upgrade_sqlite(path, create=False)  # another process's writer upgrades it
        assert [db.get(a) for a, _ in items] == [raw for _, raw in items]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    db.close()


def test_a_pack_from_files_of_both_revisions_keeps_every_signature(tmp_path, keys,
                                                                   monkeypatch):  # noqa: F811
    items = [(a, binary(i)) for i, a in enumerate(entries())]
    old = file_at_0005(tmp_path / "old" / f"{ARCH}.kdb", items[:3], sign=signer(keys["ci"]))
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["ci"]))
    db = KernelDB(cache_dir=tmp_path / "new", use_system=False)
    for a, raw in items[3:]:
        db.put(a, raw)
    db.close()
    monkeypatch.delenv("KDB_SIGNING_KEY")
    policy_env(monkeypatch, keys, require=False)
    vouch = signing.current()
    out = tmp_path / "sys" / f"{ARCH}.kdb"
    result = write_system_db(out, ARCH, [old, tmp_path / "new" / "v1" / f"{ARCH}.kdb"],
                             vouch=vouch)
    assert result.entries == len(items) and not result.refused
    assert revision(out) == migrate.HEAD
    assert sql(out, "SELECT count(*) FROM sources") == [(2,)]
    assert sorted(t for _, _, t in attributes_of(out)) == sorted(
        a.encoded().decode() for a, _ in items)
    db = KernelDB(cache_dir=tmp_path / "reader", system_path=[out.parent])
    assert all(db.lookup(a).tier == "system" for a, _ in items)
    db.close()


# -- size ----------------------------------------------------------------------------------

#: A fresh process builds what a pyopencl program builds (pyopencl.array's generated
#: elementwise programs for two dtypes) and one elementwise program with a large preamble
#: under several options (one source, many entries), every build through kdb, on PoCL.
#: Not scans: reading a scan program's binaries back from PoCL 3.0 costs 40 CPU-s
#: (docs/storing.md), and sizes need real binaries, not costly ones.
_REALISTIC = r'''
import numpy as np, pyopencl as cl, pyopencl.array as cla
import kdb, kdb.opencl
kdb.opencl.install()
plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1]); q = cl.CommandQueue(ctx)
for dt in (np.int32, np.float32):
    a = cla.to_device(q, np.arange(100, dtype=dt))
    (a + a * 2 - 1).get(); (a.astype(np.float64) / 3).get(); cla.if_positive(a, a, -a).get()
preamble = open(PREAMBLE).read()
src = preamble + "\n__kernel void mul(__global cfloat_t *a) { size_t i = get_global_id(0); " \
      "a[i] = cfloat_mul(a[i], cfloat_new(SCALE, 0)); }\n"
for scale in ("0.25f", "0.5f", "1.0f", "1.5f", "2.0f", "2.5f", "3.0f", "3.5f",
              "4.0f", "5.0f", "6.0f", "7.0f"):
    kdb.opencl.build(ctx, src, ["-DSCALE=" + scale], name="mul")
kdb.default_db().flush()
'''


def _ratio(path: Path) -> tuple[float, int, int]:
    stored = sql(path, "SELECT sum(stored_size) FROM kernels")[0][0]
    return path.stat().st_size / stored, path.stat().st_size, stored


def empty_file_bytes(tmp_path: Path) -> int:
    """The fixed overhead: a file at the head revision holding nothing (a page per table
    and index)."""
    path = tmp_path / "empty.kdb"
    migrate.upgrade_sqlite(path)
    return path.stat().st_size


def test_a_realistic_file_is_at_most_1_15x_its_compressed_binaries(cache_dir, tmp_path, run_py):
    import pyopencl

    preamble = Path(pyopencl.__file__).parent / "cl" / "pyopencl-complex.h"
    run_py(f"PREAMBLE = {str(preamble)!r}\n" + _REALISTIC,
           env={"KDB_CACHE_DIR": str(cache_dir), "KDB_STORE_AT_EXIT": "wait"})
    [path] = (cache_dir / "v1").glob("*.kdb")
    sql(path, "PRAGMA wal_checkpoint(TRUNCATE)")
    empty = empty_file_bytes(tmp_path)
    count, distinct = sql(path, "SELECT count(*), count(DISTINCT source) FROM kernels")[0]
    assert count >= 8 and distinct <= count - 3  # the preamble's program: one source
    ratio, size, stored = _ratio(path)
    assert size <= 1.15 * stored + empty, (ratio, size, stored)
    # The same entries as revision 0005 stored them: over the bound (what this revision fixed).
    old = tmp_path / "old.kdb"
    shutil.copyfile(path, old)
    _downgrade(old, "0005")
    sql(old, "VACUUM")
    assert [t for _, _, t in attributes_of(old)] == [t for _, _, t in attributes_of(path)]
    assert old.stat().st_size > 1.15 * stored + empty, _ratio(old)
    # ... and a pack of them is as compact.
    packed = write_system_db(tmp_path / "sys" / path.name, path.stem, [path])
    assert packed.file_size <= 1.15 * packed.stored_bytes + empty


def _downgrade(path: Path, rev: str) -> None:
    from alembic import command
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)
    with engine.begin() as conn:
        command.downgrade(migrate.alembic_config(connection=conn), rev)
    engine.dispose()


# -- the shared tier -------------------------------------------------------------------------

def test_a_shared_tier_at_0005_is_upgraded_and_serves_its_signed_entries(
        pg, shared_url, tmp_path, keys, monkeypatch):  # noqa: F811
    from kdb.shared.tier import SharedTier, create_engine, upgrade

    pg_server, url = pg, shared_url

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            upgrade(conn, "0005")
            conn.commit()
    finally:
        engine.dispose()
    db_name = url.rsplit("/", 1)[1]
    sign = signer(keys["ci"])
    items = [(a, binary(i)) for i, a in enumerate(entries())]
    for a, raw in items:
        kind, blob = codec.encode(raw)
        text = a.encoded().decode()
        who, sig = sign.sign(a.key, text, codec.checksum(raw))
        pg_server.sql("INSERT INTO kernels (key, arch, backend, name, attributes, codec, blob, "
                      "raw_size, stored_size, checksum, created, last_access, signer, signature) "
                      "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 1, 1, %s, %s)", db_name,
                      (a.key, ARCH, "test", a.name, text, kind, blob, len(raw), len(blob),
                       codec.checksum(raw), who, sig))
    policy_env(monkeypatch, keys, require=False)
    db = KernelDB(cache_dir=tmp_path / "node", use_system=True)
    for a, raw in items:
        hit = db.lookup(a)
        assert hit is not None and hit.tier == "shared" and hit.binary == raw
    db.close()
    assert pg_server.sql("SELECT version_num FROM alembic_version", db_name) == [(migrate.HEAD,)]
    assert pg_server.sql("SELECT count(*) FROM sources", db_name) == [(2,)]
    # Copies in the user tier and a pack from the server keep the signed attributes.
    result = invoke("--cache-dir", tmp_path / "node", "verify")
    assert result.exit_code == 0, result.output
    out = tmp_path / "dist"
    result = invoke("pack", "--arch", ARCH, "--from-db", url, "--out", out)
    assert result.exit_code == 0, result.output
    assert sorted(t for _, _, t in attributes_of(out / f"{ARCH}.kdb")) == sorted(
        a.encoded().decode() for a, _ in items)
    # Dropping every entry that names the shared source drops it too.
    tier = SharedTier(url)
    tier.drop([a.key for a, _ in items[:-1]])
    assert pg_server.sql("SELECT count(*) FROM sources", db_name) == [(1,)]
    tier.drop([items[-1][0].key])
    assert pg_server.sql("SELECT count(*) FROM sources", db_name) == [(0,)]

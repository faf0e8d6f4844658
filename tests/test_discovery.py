"""The system tier: found in KDB_SYSTEM_DB_PATH and through installed packages' entry points,
checked first, never written."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

from kdb import HashAttributes, KernelDB, discovery, migrate
from conftest import sql

ARCH = "fake-arch"
FAKE_SITE = Path(__file__).resolve().parent / "data" / "site"
NOSYS = "no system kernel database"
SYSTEM_BINARY = b"binary from the system database " * 64
USER_BINARY = b"binary from the user database " * 64


def attrs(source: str = "__kernel void sys() {}", arch: str = ARCH) -> HashAttributes:
    return HashAttributes(backend="test", source=source, arch=arch, name="sys")


def build_system_db(dest: Path, entries: dict[HashAttributes, bytes], arch: str = ARCH) -> Path:
    """A system database as ``kdb pack`` writes one: a user file at head, journal_mode=DELETE."""
    work = dest.parent / f".build-{dest.name}"
    db = KernelDB(cache_dir=work, disabled=False, use_system=False)
    for a, raw in entries.items():
        assert db.put(a, raw)
    db.close()
    built = work / "v1" / f"{arch}.kdb"
    sql(built, "PRAGMA journal_mode=DELETE")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(built, dest)
    shutil.rmtree(work)
    return dest


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def system_dir(tmp_path, monkeypatch) -> Path:
    """A KDB_SYSTEM_DB_PATH directory holding fake-arch.kdb with one entry."""
    d = tmp_path / "system"
    build_system_db(d / f"{ARCH}.kdb", {attrs(): SYSTEM_BINARY})
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(d))
    return d


@pytest.fixture
def fake_site(tmp_path, monkeypatch) -> Path:
    """A copy of tests/data/site on sys.path, with the fake package's fake-arch.kdb built in."""
    site = tmp_path / "site"
    shutil.copytree(FAKE_SITE, site, ignore=shutil.ignore_patterns("__pycache__"))
    build_system_db(site / "kdb_system_fake" / f"{ARCH}.kdb", {attrs(): SYSTEM_BINARY})
    monkeypatch.setenv("KDB_TEST_IMPORT_MARKER", str(tmp_path / "imported"))
    monkeypatch.syspath_prepend(str(site))
    yield site
    assert not (tmp_path / "imported").exists(), "the system package was imported"
    assert "kdb_system_fake" not in sys.modules


def only_fake(site: Path) -> Path:
    """Hide the broken distribution, leaving the fake one."""
    shutil.rmtree(site / "kdb_system_broken-0.1.dist-info")
    return site


# -- KDB_SYSTEM_DB_PATH --------------------------------------------------------------------

def test_system_db_found_via_path_variable(cache_dir, system_dir, caplog):
    path = system_dir / f"{ARCH}.kdb"
    before = sha256(path)
    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        for _ in range(3):
            hit = db.lookup(attrs())
            assert (hit.tier, hit.path, hit.binary) == ("system", str(path), SYSTEM_BINARY)
        assert db.get(attrs("__kernel void other() {}")) is None
        db.flush()
        db.close()
    assert NOSYS not in caplog.text
    assert sha256(path) == before
    assert sorted(p.name for p in system_dir.iterdir()) == [f"{ARCH}.kdb"]
    assert [s.path for s in discovery.sources_for(ARCH)] == [path]


def test_explicit_system_path_beats_the_variable(cache_dir, system_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(tmp_path / "nothing-here"))
    assert KernelDB().get(attrs()) is None
    assert KernelDB(system_path=str(system_dir)).get(attrs()) == SYSTEM_BINARY
    assert KernelDB(system_path=[system_dir]).get(attrs()) == SYSTEM_BINARY


def test_path_variable_lists_several_directories_in_order(cache_dir, tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    build_system_db(first / f"{ARCH}.kdb", {attrs(): b"first" * 50})
    build_system_db(second / f"{ARCH}.kdb", {attrs(): b"second" * 50,
                                              attrs("only in second"): b"2nd" * 50})
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH",
                       os.pathsep.join([str(tmp_path / "absent"), str(first), "", str(second)]))
    db = KernelDB()
    assert db.get(attrs()) == b"first" * 50
    hit = db.lookup(attrs("only in second"))
    assert (hit.tier, hit.path) == ("system", str(second / f"{ARCH}.kdb"))


def test_hits_on_the_system_tier_are_counted_in_the_user_file(cache_dir, system_dir):
    KernelDB(system_path=[]).put(attrs("__kernel void other() {}"), USER_BINARY)  # a user file
    db = KernelDB()
    db.get(attrs())
    db.get(attrs())
    db.flush()
    counters = dict(sql(cache_dir / "v1" / f"{ARCH}.kdb", "SELECT name, value FROM counters"))
    assert counters["hits.system"] == 2
    assert "misses" not in counters


def test_a_process_that_only_hits_the_system_tier_creates_no_user_file(cache_dir, system_dir):
    """Creating one would run the alembic migrations at exit just to store two counters."""
    db = KernelDB()
    assert db.lookup(attrs()).tier == "system"
    db.flush()
    assert not (cache_dir / "v1" / f"{ARCH}.kdb").exists()


def test_system_tier_is_checked_before_the_user_tier(cache_dir, system_dir):
    db = KernelDB(system_path=[])  # no system tier: the user tier gets its own copy
    db.put(attrs(), USER_BINARY)
    db.put(attrs("__kernel void user_only() {}"), USER_BINARY)
    assert db.lookup(attrs()).tier == "user"
    db = KernelDB()
    hit = db.lookup(attrs())
    assert (hit.tier, hit.binary) == ("system", SYSTEM_BINARY)
    hit = db.lookup(attrs("__kernel void user_only() {}"))
    assert (hit.tier, hit.binary) == ("user", USER_BINARY)


def test_system_file_is_read_without_write_access(cache_dir, system_dir):
    path = system_dir / f"{ARCH}.kdb"
    path.chmod(0o444)
    system_dir.chmod(0o555)
    try:
        db = KernelDB()
        assert db.get(attrs()) == SYSTEM_BINARY
        db.close()
    finally:
        system_dir.chmod(0o755)
    assert sorted(p.name for p in system_dir.iterdir()) == [f"{ARCH}.kdb"]


def test_corrupt_system_entry_is_skipped_not_repaired(cache_dir, tmp_path, monkeypatch, caplog):
    d = tmp_path / "system"
    path = build_system_db(d / f"{ARCH}.kdb", {attrs(): SYSTEM_BINARY})
    [(blob,)] = sql(path, "SELECT blob FROM kernels")
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0xFF
    sql(path, "UPDATE kernels SET blob = ?", (bytes(bad),))
    before = sha256(path)
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(d))
    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get_or_compile(attrs(), lambda: b"compiled") == b"compiled"
        db.flush()
    assert "checksum mismatch" in caplog.text and str(path) in caplog.text
    assert sha256(path) == before
    hit = KernelDB().lookup(attrs())  # the compiled copy now serves from the user tier
    assert (hit.tier, hit.binary) == ("user", b"compiled")


def test_system_file_at_an_older_revision_is_read(cache_dir, tmp_path, monkeypatch):
    from kdb import codec

    d = tmp_path / "system"
    d.mkdir()
    path = d / f"{ARCH}.kdb"
    migrate.upgrade_sqlite(path, migrate.REVISIONS[0])
    a = attrs()
    kind, blob = codec.encode(SYSTEM_BINARY)
    sql(path, "INSERT INTO kernels (key, arch, backend, name, attributes, codec, blob, raw_size, "
              "stored_size, checksum, created, last_access) VALUES (?,?,?,?,?,?,?,?,?,?,0,0)",
        (a.key, ARCH, "test", "sys", a.encoded().decode(), kind, blob, len(SYSTEM_BINARY),
         len(blob), codec.checksum(SYSTEM_BINARY)))
    before = sha256(path)
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(d))
    assert KernelDB().lookup(a).tier == "system"
    assert sha256(path) == before


def test_system_file_from_the_future_is_skipped(cache_dir, system_dir, caplog):
    path = system_dir / f"{ARCH}.kdb"
    sql(path, "UPDATE alembic_version SET version_num = '9999'")
    before = sha256(path)
    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get_or_compile(attrs(), lambda: b"compiled") == b"compiled"
        db.flush()
    assert "9999" in caplog.text
    assert sha256(path) == before


def test_file_that_is_not_a_kdb_database_is_skipped(cache_dir, tmp_path, monkeypatch, caplog):
    d = tmp_path / "system"
    d.mkdir()
    (d / f"{ARCH}.kdb").write_bytes(os.urandom(4096))
    before = sha256(d / f"{ARCH}.kdb")
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(d))
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert KernelDB().get(attrs()) is None
    assert "skipped" in caplog.text
    assert sha256(d / f"{ARCH}.kdb") == before
    assert sorted(p.name for p in d.iterdir()) == [f"{ARCH}.kdb"]


def test_unsafe_file_names_in_system_dirs_are_ignored(tmp_path):
    (tmp_path / "UPPER.kdb").write_bytes(b"")
    (tmp_path / "good.kdb").write_bytes(b"")
    (tmp_path / "notes.txt").write_bytes(b"")
    found = [s for s in discovery.all_sources([tmp_path]) if s.origin == "KDB_SYSTEM_DB_PATH"]
    assert [(s.arch, s.path.name) for s in found] == [("good", "good.kdb")]


# -- entry points --------------------------------------------------------------------------

def test_system_db_found_via_entry_point(cache_dir, fake_site, caplog):
    only_fake(fake_site)
    path = fake_site / "kdb_system_fake" / f"{ARCH}.kdb"
    before = sha256(path)
    [src] = discovery.sources_for(ARCH, [])
    assert (src.path, src.origin, src.problem) == (path, "package kdb_system_fake 1.0", "")
    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        hit = db.lookup(attrs())
        db.flush()
        db.close()
    assert (hit.tier, hit.path, hit.binary) == ("system", str(path), SYSTEM_BINARY)
    assert caplog.text == ""
    assert sha256(path) == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["__init__.py", f"{ARCH}.kdb"]


def test_entry_points_read_from_dist_info(fake_site):
    eps = {(ep.dist, ep.name, ep.value) for ep in discovery.entry_points()}
    assert ("kdb_system_fake", ARCH, "kdb_system_fake") in eps
    assert ("kdb_system_broken", "bad-value", "not a package!") in eps
    assert not any(ep[1] == "not-ours" for ep in eps)  # other groups are ignored


def test_path_variable_comes_before_packages(cache_dir, fake_site, system_dir):
    only_fake(fake_site)
    srcs = discovery.sources_for(ARCH)
    assert [s.origin for s in srcs] == ["KDB_SYSTEM_DB_PATH", "package kdb_system_fake 1.0"]
    hit = KernelDB().lookup(attrs())
    assert hit.path == str(system_dir / f"{ARCH}.kdb")


def test_broken_entry_points_are_skipped_with_a_warning(cache_dir, fake_site, caplog):
    with caplog.at_level(logging.WARNING, logger="kdb"):
        srcs = discovery.sources_for(ARCH, [])
        assert [s.origin for s in srcs] == ["package kdb_system_fake 1.0"]
        hit = KernelDB().lookup(attrs())  # the good package still serves
        assert hit.tier == "system"
        assert KernelDB().get(attrs(arch="missing-arch")) is None
        assert KernelDB().get(attrs(arch="dotted-arch")) is None
        assert KernelDB().get(attrs(arch="bad-value")) is None
    text = caplog.text
    assert "kdb_system_not_installed" in text and "skipped" in text
    assert "missing-arch" in text and "file missing" in text
    assert "dotted-arch" in text and "kdb_system_fake.sub" in text
    assert "not a package!" in text


def test_all_sources_reports_broken_entries(fake_site):
    by_name = {(s.arch, s.origin): s for s in discovery.all_sources([])}
    good = by_name[(ARCH, "package kdb_system_fake 1.0")]
    assert good.problem == "" and good.path.is_file()
    problems = {arch: s.problem for (arch, origin), s in by_name.items()
                if origin == "package kdb_system_broken 0.1"}
    assert set(problems) == {ARCH, "missing-arch", "Bad_Arch", "bad-value", "dotted-arch"}
    assert all(problems.values())
    assert "bad arch id" in problems["Bad_Arch"]


def test_unreadable_entry_points_file_is_not_fatal(cache_dir, fake_site, caplog):
    ep_file = fake_site / "kdb_system_broken-0.1.dist-info" / "entry_points.txt"
    ep_file.write_bytes(b"\xff\xfe[kdb.system]\x00 = \n[[[\n")
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert KernelDB().lookup(attrs()).tier == "system"
    assert "kdb_system_broken-0.1.dist-info" in caplog.text


def test_garbled_entry_points_file_is_not_fatal(cache_dir, fake_site):
    ep_file = fake_site / "kdb_system_broken-0.1.dist-info" / "entry_points.txt"
    ep_file.write_text("[kdb.system\n= \n==\nfake-arch\n[kdb.system]\n = x\nfake-arch =\n")
    assert KernelDB().lookup(attrs()).tier == "system"


# -- the missing system database warning ---------------------------------------------------

def test_no_missing_warning_when_a_system_db_exists(cache_dir, system_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db = KernelDB()
        db.get(attrs())
        db.get_or_compile(attrs("__kernel void missed() {}"), lambda: b"x")
        db.flush()
    assert NOSYS not in caplog.text


def test_missing_warning_names_the_arch_that_has_none(cache_dir, system_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db = KernelDB()
        db.get(attrs())
        db.get(attrs(arch="other-arch"))
        db.get(attrs(arch="other-arch"))
    warnings = [r.getMessage() for r in caplog.records if NOSYS in r.getMessage()]
    assert len(warnings) == 1
    assert "'other-arch'" in warnings[0] and "other-arch.kdb" in warnings[0]
    assert str(system_dir) in warnings[0]

"""The system tier: found in KDB_SYSTEM_DB_PATH and through installed packages' entry points,
checked first, never written."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdb import HashAttributes, KernelDB
from kdb.file import discovery, migrate
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


# -- a system database others can write is not loaded (issue 19, defect 4) ------------------

def _not_loaded(path: Path, why: str, caplog, culprit: Path | None = None) -> None:
    """Not served, one warning naming it and the fix; ``kdb verify`` fails on it and ``kdb
    info`` marks it refused, each with the reason (``culprit``: the file, or its directory)."""
    culprit = culprit or path
    from click.testing import CliRunner

    from kdb.cli import cli

    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get(attrs()) is None  # the binary there may be anyone's
        assert db.get(attrs()) is None
        db.close()
    notes = [r.getMessage() for r in caplog.records
             if r.levelno >= logging.WARNING and "not loaded" in r.getMessage()]
    assert len(notes) == 1, caplog.text
    assert str(path) in notes[0] and f"{culprit}: {why}" in notes[0], notes
    assert "chmod go-w" in notes[0], notes
    # The warning that none is usable names the refused one: it read as if none was found.
    [none] = [r.getMessage() for r in caplog.records if "system kernel database for arch"
              in r.getMessage()]
    assert f"for arch {ARCH!r} that kdb may load ({path} refused" in none, none
    result = CliRunner().invoke(cli, ["verify", "--json"])
    assert result.exit_code == 1, result.output
    import json

    [f] = [f for f in json.loads(result.output)["files"] if f["tier"] == "system"]
    assert f["path"] == str(path) and not f["ok"] and f["unsafe"]
    assert why in f["problems"][0]
    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    assert f"[REFUSED: {culprit}: {why}" in result.output, result.output
    assert "all sound" not in CliRunner().invoke(cli, ["verify"]).output


def test_a_world_writable_system_file_is_not_loaded(cache_dir, system_dir, caplog):
    path = system_dir / f"{ARCH}.kdb"
    path.chmod(0o666)
    _not_loaded(path, "group or others can write it", caplog)


def test_a_system_file_in_a_world_writable_directory_is_not_loaded(cache_dir, system_dir,
                                                                     caplog):
    system_dir.chmod(0o777)  # anyone can swap the file for their own
    _not_loaded(system_dir / f"{ARCH}.kdb", "group or others can write it", caplog, system_dir)


def test_a_system_file_in_a_sticky_shared_directory_is_not_loaded(cache_dir, system_dir,
                                                                   caplog):
    """/tmp's bits: kept strict, one rule for a directory others can write."""
    system_dir.chmod(0o1777)
    _not_loaded(system_dir / f"{ARCH}.kdb", "group or others can write it", caplog, system_dir)


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_system_file_owned_by_another_user_is_not_loaded(cache_dir, system_dir, caplog):
    path = system_dir / f"{ARCH}.kdb"
    os.chown(path, 65534, 65534)  # nobody, 0644: they can rewrite it
    _not_loaded(path, "it is owned by another user (uid 65534)", caplog)


def test_a_system_file_of_root_or_this_user_readable_by_all_is_loaded(cache_dir, system_dir):
    """0644 in 0755, as pip installs into site-packages: the normal case."""
    (system_dir / f"{ARCH}.kdb").chmod(0o644)
    system_dir.chmod(0o755)
    [src] = discovery.sources_for(ARCH)
    assert src.problem == "" and discovery.unsafe(src.filename) is None
    assert KernelDB().get(attrs()) == SYSTEM_BINARY


def test_an_installed_system_package_others_can_write_is_not_loaded(cache_dir, fake_site,
                                                                      caplog):
    only_fake(fake_site)
    package = fake_site / "kdb_system_fake"
    package.chmod(0o777)
    assert discovery.sources_for(ARCH, []) == []
    [src] = [s for s in discovery.all_sources([]) if s.arch == ARCH]
    assert src.problem.startswith(discovery.REFUSED) and str(package) in src.problem
    _not_loaded(package / f"{ARCH}.kdb", "group or others can write it", caplog, package)


def test_an_entry_point_cache_others_can_write_is_not_read(fake_site, tmp_path):
    """Its records name the package a system database is read from."""
    memo = tmp_path / "memo"
    only_fake(fake_site)
    settle(fake_site)
    new_process()
    assert FAKE_EP in ours(discovery.entry_points(memo_dir=memo))
    new_process()  # writes the cache file
    memo_file = memo / "entry-points.txt"
    text = memo_file.read_text()
    memo_file.write_text(text.replace(f"\t{ARCH}\tkdb_system_fake", f"\t{ARCH}\tplanted"))
    assert ours(discovery.entry_points(memo_dir=memo))[0][3] == "planted"  # trusted: used
    new_process()
    memo_file.write_text(text.replace(f"\t{ARCH}\tkdb_system_fake", f"\t{ARCH}\tplanted"))
    memo_file.chmod(0o666)
    assert ours(discovery.entry_points(memo_dir=memo)) == [FAKE_EP]  # rescanned instead


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
    from kdb.file import codec

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


def test_another_groups_undecodable_entry_points_file_is_none_of_our_business(
        cache_dir, fake_site, caplog):
    """A file that does not mention kdb.system is not decoded at all (the scan reads bytes
    and looks for the group's name first): no warning about another package's file."""
    ep_file = fake_site / "kdb_system_broken-0.1.dist-info" / "entry_points.txt"
    ep_file.write_bytes(b"\xff\xfe[console_scripts]\ntool = x:main\n")
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert KernelDB().lookup(attrs()).tier == "system"
    assert "kdb_system_broken" not in caplog.text


def test_garbled_entry_points_file_is_not_fatal(cache_dir, fake_site):
    ep_file = fake_site / "kdb_system_broken-0.1.dist-info" / "entry_points.txt"
    ep_file.write_text("[kdb.system\n= \n==\nfake-arch\n[kdb.system]\n = x\nfake-arch =\n")
    assert KernelDB().lookup(attrs()).tier == "system"


# -- the cache of the entry point scan -----------------------------------------------------

def settle(path: Path, age: float = 60.0, mtime_ns: int | None = None) -> int:
    """Date a directory back ``age`` seconds (or to ``mtime_ns``), as one pip wrote a while
    ago: only a settled directory's scan is cached. Returns its new st_mtime_ns."""
    if mtime_ns is None:
        mtime_ns = time.time_ns() - int(age * 1e9)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path.stat().st_mtime_ns


def new_process() -> None:
    """End this process as far as the cache goes (write the cache file, as at exit) and
    forget what it memoized, as a new process would start: only the file is left."""
    discovery.flush()
    discovery._memo.clear()
    discovery._read.clear()


def ours(eps) -> list[tuple[str, str, str, str]]:
    return [tuple(ep) for ep in eps if ep.dist.lower().replace("-", "_").startswith("kdb_sys")]


def add_dist(site: Path, dirname: str, entry_points: str | bytes | None) -> Path:
    d = site / dirname
    d.mkdir()
    if isinstance(entry_points, str):
        (d / "entry_points.txt").write_text(entry_points)
    elif entry_points is not None:
        (d / "entry_points.txt").write_bytes(entry_points)
    return d


FAKE_EP = ("kdb_system_fake", "1.0", ARCH, "kdb_system_fake")
NOT_UTF8 = b"\xff\xfe[kdb.system]\nfake-arch = x\n"


def test_second_call_reads_the_cache_not_the_dist_infos(fake_site, tmp_path, monkeypatch,
                                                        caplog):
    memo = tmp_path / "memo"
    memo_file = memo / "entry-points.txt"
    monkeypatch.setattr(sys, "path", [str(fake_site)])  # no directory that others may change
    mtime = settle(fake_site)
    new_process()
    first = discovery.entry_points(memo_dir=memo)
    assert FAKE_EP in ours(first)
    assert not memo_file.exists()  # written at exit, off the start-up path
    discovery.flush()
    written = memo_file.read_bytes()
    assert (discovery.GROUP, str(fake_site)) in discovery._load(str(memo_file))
    assert [p.name for p in memo.iterdir()] == ["entry-points.txt"]  # no temporary left

    # The dist-infos change without a change of the site's mtime: the cache keeps answering.
    (fake_site / "kdb_system_fake-1.0.dist-info" / "entry_points.txt").write_bytes(NOT_UTF8)
    shutil.rmtree(fake_site / "kdb_system_broken-0.1.dist-info")
    settle(fake_site, mtime_ns=mtime)
    memo_file.unlink()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert discovery.entry_points(memo_dir=memo) == first  # this process's memo...
        discovery.flush()
        assert not memo_file.exists()  # ...read no file and wrote none: nothing changed
        memo_file.write_bytes(written)
        inode = memo_file.stat().st_ino
        new_process()
        assert discovery.entry_points(memo_dir=memo) == first  # the file, in a new process
    assert caplog.text == ""
    assert memo_file.stat().st_ino == inode  # not rewritten: nothing changed

    # A new mtime (as pip's install or removal of a dist-info gives) means a rescan.
    settle(fake_site, age=30)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert ours(discovery.entry_points(memo_dir=memo)) == []
    assert "kdb_system_fake-1.0.dist-info" in caplog.text


def test_an_installed_distribution_is_seen_at_once_and_by_a_new_process(
        fake_site, tmp_path, run_py):
    memo = tmp_path / "memo"
    only_fake(fake_site)
    settle(fake_site)
    new_process()
    assert ours(discovery.entry_points(memo_dir=memo)) == [FAKE_EP]
    extra = ("kdb_system_extra", "2.0", "extra-arch", "kdb_system_fake")
    add_dist(fake_site, "kdb_system_extra-2.0.dist-info",
             "[kdb.system]\nextra-arch = kdb_system_fake\n")
    assert ours(discovery.entry_points(memo_dir=memo)) == [extra, FAKE_EP]  # not yet settled

    settle(fake_site)
    new_process()
    assert ours(discovery.entry_points(memo_dir=memo)) == [extra, FAKE_EP]
    settle(fake_site, age=30)  # a later install, seen by a new process from the stale file
    shutil.rmtree(fake_site / "kdb_system_fake-1.0.dist-info")
    mtime = settle(fake_site, age=20)
    code = f"""
        import sys
        sys.path.insert(0, {str(fake_site)!r})
        from kdb.file import discovery
        for ep in discovery.entry_points(memo_dir={str(memo)!r}):
            print(*ep, sep="|")
    """
    lines = run_py(code).stdout.splitlines()
    assert [tuple(line.split("|")) for line in lines if line.startswith("kdb_sys")] == [extra]
    record = discovery._load(str(memo / "entry-points.txt"))[(discovery.GROUP, str(fake_site))]
    assert record[0] == mtime
    # The next process reads that record, not the dist-info (now unreadable).
    (fake_site / "kdb_system_extra-2.0.dist-info" / "entry_points.txt").write_bytes(NOT_UTF8)
    proc = run_py(code)
    assert [tuple(line.split("|")) for line in proc.stdout.splitlines()
            if line.startswith("kdb_sys")] == [extra]
    assert "cannot read" not in proc.stderr


@pytest.mark.parametrize("damage", [
    lambda text: b"",
    lambda text: b"\x00\xff garbage\n" * 10,
    lambda text: text[: text.index(b"\nP\t") + 1],  # cut short (by a crash, say)
    lambda text: text[: text.index(b"\nS\t") + 1] + b"end\n",  # a record without its names
    lambda text: text.replace(b"D\t", b"D\tx", 1),  # an mtime that is not a number
    lambda text: text.replace(b"\nS\t", b"\nP\ta\tb\nS\t", 1),  # a bad entry line
    lambda text: text.replace(b"kdb entry points 1", b"kdb entry points 2"),
])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(fake_site, tmp_path, damage):
    memo = tmp_path / "memo"
    memo_file = memo / "entry-points.txt"
    settle(fake_site)
    new_process()
    expected = discovery.entry_points(memo_dir=memo)
    discovery.flush()
    good = memo_file.read_bytes()
    memo_file.write_bytes(damage(good))
    assert discovery._load(str(memo_file)) == {}
    new_process()
    assert discovery.entry_points(memo_dir=memo) == expected
    discovery.flush()
    record = discovery._load(str(memo_file))[(discovery.GROUP, str(fake_site))]
    assert record[0] == fake_site.stat().st_mtime_ns


@pytest.mark.parametrize("junk", [False, True], ids=["cached", "unreadable-file"])
def test_shadowing_across_directories_is_the_same_with_the_cache(fake_site, tmp_path,
                                                                 monkeypatch, caplog, junk):
    """The first distribution of a normalised name on sys.path wins, whether or not it
    declares entry points; a directory with an unreadable entry_points.txt is never cached,
    so its warning comes on every call."""
    memo = tmp_path / "memo"
    front = tmp_path / "front"
    front.mkdir()
    add_dist(front, "kdb_system_fake-2.0.dist-info", None)  # hides kdb_system_fake 1.0
    add_dist(front, "Kdb_System_Broken-0.2.dist-info",
             "[kdb.system]\nfake-arch = kdb_system_fake\n")
    add_dist(front, "kdb_system_broken-0.3.dist-info", "[kdb.system]\nlater = x\n")
    add_dist(front, "kdb_system_front-1.0.dist-info", "[kdb.system]\nfront-arch = front\n")
    if junk:
        add_dist(front, "kdb_system_junk-1.0.dist-info", NOT_UTF8)
    add_dist(fake_site, "kdb_system_front-0.9.dist-info", "[kdb.system]\nhidden = y\n")
    add_dist(fake_site, "kdb_system_fron-1.0.dist-info", "[kdb.system]\nfron = z\n")  # a prefix
    (tmp_path / "archive.zip").write_bytes(b"PK\x05\x06" + bytes(18))
    monkeypatch.syspath_prepend(str(fake_site))  # again: a second time changes nothing
    for entry in (front, tmp_path / "archive.zip", tmp_path / "missing"):
        monkeypatch.syspath_prepend(str(entry))
    # Of two names in one directory, the first os.listdir gives wins (it need not be sorted).
    broken = {"Kdb_System_Broken-0.2.dist-info": ("Kdb_System_Broken", "0.2", "fake-arch",
                                                  "kdb_system_fake"),
              "kdb_system_broken-0.3.dist-info": ("kdb_system_broken", "0.3", "later", "x")}
    first_broken = next(n for n in os.listdir(front) if n in broken)
    expected = sorted([broken[first_broken], ("kdb_system_front", "1.0", "front-arch", "front"),
                       ("kdb_system_fron", "1.0", "fron", "z")],
                      key=lambda ep: (ep[0].lower(), ep[2]))

    def cached_dirs() -> set[str]:
        discovery.flush()
        return {path for _, path in discovery._load(str(memo / "entry-points.txt"))}

    def calls() -> list:
        with caplog.at_level(logging.WARNING, logger="kdb"):
            caplog.clear()
            result = discovery.entry_points(memo_dir=memo)
        assert ours(result) == expected
        assert ("kdb_system_junk-1.0.dist-info" in caplog.text) == junk
        assert "kdb_system_broken-0.1" not in caplog.text
        return result

    new_process()
    plain = calls()  # not settled: a plain scan, nothing cached
    assert not cached_dirs() & {str(front), str(fake_site)}
    assert calls() == plain
    settle(front)
    settle(fake_site)
    new_process()
    assert calls() == plain  # scanned and written
    assert calls() == plain  # this process's memo
    new_process()
    assert calls() == plain  # the file
    cached = cached_dirs()
    assert str(fake_site) in cached
    assert (str(front) in cached) != junk
    assert not cached & {str(tmp_path / "archive.zip"), str(tmp_path / "missing")}


def test_the_current_directory_on_sys_path_is_cached_by_its_real_path(fake_site, tmp_path,
                                                                      monkeypatch):
    memo = tmp_path / "memo"
    other = tmp_path / "other"
    other.mkdir()
    add_dist(other, "kdb_system_other-1.0.dist-info", "[kdb.system]\nother-arch = other\n")
    settle(fake_site, mtime_ns=settle(other))  # the same mtime: only the path tells them apart
    monkeypatch.setattr(sys, "path", ["", *sys.path[1:]])  # fake_site only as the cwd
    new_process()
    for _ in range(2):
        monkeypatch.chdir(fake_site)
        assert ours(discovery.entry_points(memo_dir=memo))[-1] == FAKE_EP
        monkeypatch.chdir(other)
        assert ours(discovery.entry_points(memo_dir=memo)) == [
            ("kdb_system_other", "1.0", "other-arch", "other")]
        new_process()


@pytest.mark.parametrize("how", ["under-a-file", "file-is-a-directory", "read-only"])
def test_an_unwritable_cache_still_gives_the_right_answer(fake_site, tmp_path, how):
    if how == "under-a-file":
        (tmp_path / "file").write_text("")
        memo = tmp_path / "file" / "memo"
    else:
        memo = tmp_path / "memo"
        memo.mkdir()
        if how == "file-is-a-directory":
            (memo / "entry-points.txt").mkdir()
        else:
            memo.chmod(0o555)  # root writes anyway: then this only shows nothing breaks
    try:
        only_fake(fake_site)
        settle(fake_site)
        for _ in range(2):
            new_process()
            assert ours(discovery.entry_points(memo_dir=memo)) == [FAKE_EP]
            assert ours(discovery.entry_points(memo_dir=memo)) == [FAKE_EP]
        add_dist(fake_site, "kdb_system_extra-2.0.dist-info", "[kdb.system]\nx = y\n")
        settle(fake_site, age=30)
        assert ours(discovery.entry_points(memo_dir=memo)) == [
            ("kdb_system_extra", "2.0", "x", "y"), FAKE_EP]
        discovery.flush()
        if how != "under-a-file":
            assert all(p.name == "entry-points.txt" for p in memo.iterdir())  # no temporary
    finally:
        if how == "read-only":
            memo.chmod(0o755)


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


# -- the package name of an arch's system database ------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.from_regex(r"[a-z0-9][a-z0-9_.+-]{0,16}", fullmatch=True))
def test_dist_name_spells_feature_flags_as_pip_accepts_them(arch):
    """dist_name runs on the missing-system-db warning's path, with string operations
    where a regex would have to be compiled: it must still mean what the regex said."""
    want = "kdb-system-" + re.sub(r"-(?=_|$)", "-off", arch.replace("+", "-on"))
    assert discovery.dist_name(arch) == want
    assert discovery.dist_name(arch, "myfw-kernels") == want.replace("kdb-system", "myfw-kernels")

"""The size cap of the user tier: parsing, LRU eviction, recency, and totals that never scan."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kdb import ConfigError, HashAttributes, KernelDB, config
from kdb.admin import maintenance, report
from kdb.cli import cli
from kdb.file.kernelfile import Entry, KernelFile
from conftest import sql

LONG = os.environ.get("KDB_LONG_TESTS") == "1"
SIZE = 4000  # incompressible: stored as is, so stored_size == SIZE exactly


def attrs(i: int, arch: str = "a1") -> HashAttributes:
    return HashAttributes(backend="test", source=f"kernel {i}", arch=arch, name=f"k{i}")


def blob(i: int, size: int = SIZE) -> bytes:
    return random.Random(i).randbytes(size)


def stored_names(path) -> list[str]:
    return sorted(r[0] for r in sql(path, "SELECT name FROM kernels"))


def meta_totals(path) -> dict[str, int]:
    return {k: int(v) for k, v in sql(
        path, "SELECT name, value FROM meta WHERE name IN ('entries', 'raw_bytes', "
              "'stored_bytes')")}


def scanned_totals(path) -> dict[str, int]:
    [(n, raw, stored)] = sql(path, "SELECT count(*), coalesce(sum(raw_size), 0), "
                                   "coalesce(sum(stored_size), 0) FROM kernels")
    return {"entries": n, "raw_bytes": raw, "stored_bytes": stored}


def cli_ok(args: list[str]) -> str:
    result = CliRunner().invoke(cli, args, catch_exceptions=True)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


# -- KDB_CACHE_MAX_SIZE --------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("500M", 500 << 20), ("2G", 2 << 30), ("0", 0), ("4096", 4096), ("1.5GiB", 3 << 29),
    ("64k", 64 << 10), (" 2g ", 2 << 30), ("1T", 1 << 40),
])
def test_cap_sizes_are_parsed(monkeypatch, text, value):
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", text)
    assert config.max_size() == value


def test_cap_default_is_one_gib(monkeypatch):
    monkeypatch.delenv("KDB_CACHE_MAX_SIZE", raising=False)
    assert config.max_size() == 1 << 30


@pytest.mark.parametrize("junk", ["junk", "-1", "5X", "1e3", "M", "2 G B", "0x10", "½G",
                                  "0.5", "9" * 400, "inf", "nan"])
def test_a_cap_that_is_not_a_size_warns_once_and_uses_the_default(monkeypatch, cache_dir,
                                                                   junk, caplog):
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", junk)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert config.max_size() == config.MAX_SIZE_DEFAULT
        db = KernelDB(use_system=False)
        assert db.put(attrs(0), blob(0))  # a program never ends over a setting
        db.close()
    notes = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(notes) == 1 and "KDB_CACHE_MAX_SIZE=" in notes[0] and "1G" in notes[0], notes
    with pytest.raises(ConfigError, match="500M"):  # an explicit value is the caller's
        config.parse_size(junk)


BUILD_ONE = """
import pyopencl as cl
import kdb.opencl
kdb.opencl.install()
plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1])
cl.Program(ctx, "__kernel void k(__global int *a) { a[0] = 3; }").build()
"""


@pytest.mark.parametrize("at_exit", ["detach", "wait"])
def test_a_bad_cap_only_the_store_worker_reads_warns_in_the_program(cache_dir, run_py,
                                                                    at_exit):
    """Stores go to the store worker (detach), which alone reads the cap: the program that
    set it still hears of a bad value, once."""
    pytest.importorskip("pyopencl")
    proc = run_py(BUILD_ONE, env={"KDB_CACHE_MAX_SIZE": "bogus", "KDB_STORE_AT_EXIT": at_exit})
    notes = [line for line in proc.stderr.splitlines() if "KDB_CACHE_MAX_SIZE" in line]
    assert len(notes) == 1 and "'bogus'" in notes[0] and "1G" in notes[0], proc.stderr


# -- eviction ------------------------------------------------------------------------------

def fill(db: KernelDB, n: int) -> None:
    for i in range(n):
        assert db.put(attrs(i), blob(i))


def test_an_insert_past_the_cap_evicts_lru_until_a_third_is_free(cache_dir, monkeypatch):
    cap = 7 * SIZE + 100  # seven fit; the eighth passes the cap
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", str(cap))
    db = KernelDB(use_system=False)
    fill(db, 7)
    path = cache_dir / "v1" / "a1.kdb"
    assert len(stored_names(path)) == 7
    assert db.put(attrs(7), blob(7))
    stored = meta_totals(path)["stored_bytes"]
    assert stored <= cap - cap // 3  # a third of the cap is free
    # Oldest first: k0, k1, k2, k3 go (8 * 4000 = 32000 down to <= 18734); the new one stays.
    assert stored_names(path) == ["k4", "k5", "k6", "k7"]
    assert db.get(attrs(7)) == blob(7)
    assert sql(path, "SELECT value FROM counters WHERE name = 'evicted'") == [(4.0,)]


def test_a_hit_refreshes_recency_so_the_entry_survives(cache_dir, monkeypatch):
    cap = 7 * SIZE + 100
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", str(cap))
    db = KernelDB(use_system=False)
    fill(db, 7)
    assert db.get(attrs(0)) == blob(0)  # the oldest entry, used again
    db.flush()  # hits are batched; recency lands in the database here
    assert db.put(attrs(7), blob(7))
    names = stored_names(cache_dir / "v1" / "a1.kdb")
    assert "k0" in names and "k7" in names
    assert names == ["k0", "k5", "k6", "k7"]  # k1..k4 were least recently used


def test_a_hit_in_the_same_write_as_a_new_entry_counts_before_the_eviction(cache_dir,
                                                                          monkeypatch):
    """A get, then a compile, flushed together (a program's bookkeeping): the hit's recency
    was applied after the eviction, so the entry just used went first, with its hits."""
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", str(7 * SIZE + 100))
    db = KernelDB(use_system=False)
    fill(db, 7)
    assert db.get(attrs(0)) == blob(0)
    assert db.get_or_compile(attrs(7), lambda: blob(7)) == blob(7)
    db.close()
    path = cache_dir / "v1" / "a1.kdb"
    assert stored_names(path) == ["k0", "k5", "k6", "k7"]
    assert sql(path, "SELECT hits FROM kernels WHERE name = 'k0'") == [(1,)]


def test_a_batch_bigger_than_the_cap_leaves_the_file_within_it(tmp_path):
    """A process's early entries at exit go in one write: every entry of the batch was kept,
    every other evicted, and the file stayed several times its cap."""
    file = KernelFile(tmp_path / "v1" / "a1.kdb", tier="user", readonly=False)
    cap = 3 * SIZE
    file.write([Entry(key="old", arch="a1", backend="test", name="old",
                      attributes=json.dumps({"k": "old"}), raw=os.urandom(SIZE))], [], {}, {},
               cap=cap)
    batch = [Entry(key=f"key{k}", arch="a1", backend="test", name=f"k{k}",
                   attributes=json.dumps({"k": k}), raw=os.urandom(SIZE)) for k in range(10)]
    file.write(batch, [], {}, {}, cap=cap)
    file.close()
    totals = meta_totals(tmp_path / "v1" / "a1.kdb")
    assert 0 < totals["stored_bytes"] <= cap and totals == scanned_totals(
        tmp_path / "v1" / "a1.kdb")


def test_a_batch_bigger_than_the_cap_writes_only_its_newest_and_the_file_stays_small(tmp_path):
    """Written whole and then mostly evicted in the same transaction, a batch (40 early
    entries at a process's exit) left the file four times its cap on disk: SQLite keeps the
    pages. Only the batch's newest entries that fit are written."""
    path = tmp_path / "v1" / "a1.kdb"
    file = KernelFile(path, tier="user", readonly=False)
    cap = 10 * SIZE
    batch = [Entry(key=f"key{k}", arch="a1", backend="test", name=f"k{k}",
                   attributes=json.dumps({"k": k}), raw=os.urandom(SIZE)) for k in range(40)]
    assert file.write(batch, [], {}, {}, cap=cap)
    file.close()
    names = stored_names(path)
    assert names and names == sorted(f"k{k}" for k in range(40 - len(names), 40))
    assert os.path.getsize(path) < 3 * cap  # schema pages and all (it was 6.3 times)


def test_the_wal_stays_in_proportion_to_a_small_cap(cache_dir, monkeypatch):
    """SQLite checkpoints every 1,000 pages and never cuts its ``-wal`` back: beside a
    300 KB cap it stood at 4 MB."""
    cap = 300_000
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", str(cap))
    db = KernelDB(use_system=False)
    for i in range(260):  # 5.2 MB through the file, 20 KB a write
        assert db.put(attrs(i), blob(i, 20_000))
    path = cache_dir / "v1" / "a1.kdb"
    assert os.path.getsize(f"{path}-wal") <= cap
    assert meta_totals(path)["stored_bytes"] <= cap
    db.close()


def test_a_binary_larger_than_the_cap_is_not_stored(cache_dir, monkeypatch, caplog):
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", str(3 * SIZE))
    db = KernelDB(use_system=False)
    fill(db, 2)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.put(attrs(9), blob(9, 4 * SIZE)) is False
        out = db.get_or_compile(attrs(10), lambda: blob(10, 5 * SIZE))
        db.flush()
    assert out == blob(10, 5 * SIZE)  # the caller gets its binary all the same
    path = cache_dir / "v1" / "a1.kdb"
    assert stored_names(path) == ["k0", "k1"]  # nothing evicted for a binary that cannot fit
    assert "exceeds the cache cap" in caplog.text
    assert caplog.text.count("exceeds the cache cap") == 1  # once per file and process
    assert db.get(attrs(9)) is None


def test_no_cap_stores_everything(cache_dir, monkeypatch):
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", "0")
    db = KernelDB(use_system=False)
    fill(db, 10)
    assert len(stored_names(cache_dir / "v1" / "a1.kdb")) == 10


def test_kdb_evict_and_kdb_stats_show_it(cache_dir, monkeypatch):
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", "2G")
    db = KernelDB(use_system=False)
    fill(db, 6)
    db.close()
    before = json.loads(cli_ok(["stats", "--json"]))
    assert before["cap"] == 2 << 30 and before["evicted"] == 0 and before["entries"] == 6
    rows = json.loads(cli_ok(["evict", "--to", str(3 * SIZE), "--json"]))
    path = cache_dir / "v1" / "a1.kdb"
    assert rows == [{"path": str(path), "arch": "a1", "removed": 3, "freed": 3 * SIZE,
                     "entries": 3, "stored_bytes": 3 * SIZE, "problem": ""}]
    assert stored_names(path) == ["k3", "k4", "k5"]
    after = json.loads(cli_ok(["stats", "--json"]))
    assert after["evicted"] == 3 and after["arches"]["a1"]["evicted"] == 3
    assert after["entries"] == 3 and after["stored_bytes"] == 3 * SIZE
    text = cli_ok(["stats"])
    assert "EVICTED" in text and "cap: 2.0 GiB per user file" in text
    assert "k3" not in cli_ok(["evict", "--to", "1G"])  # a table of files, not entries
    assert json.loads(cli_ok(["evict", "--to", "1G", "--json"]))[0]["removed"] == 0
    assert json.loads(cli_ok(["evict", "--to", "0", "--json"]))[0]["entries"] == 0
    assert stored_names(path) == []


def test_kdb_evict_refuses_a_bad_size(cache_dir):
    result = CliRunner().invoke(cli, ["evict", "--to", "lots"])
    assert result.exit_code != 0 and "500M" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(Exception, match="size in bytes"):
        maintenance.evict(cache_dir / "v1", -5)


def test_stats_show_no_cap(cache_dir, monkeypatch):
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", "0")
    KernelDB(use_system=False).put(attrs(0), blob(0))
    assert "cap: none" in cli_ok(["stats"])


# -- totals that never scan ----------------------------------------------------------------

def _traced(monkeypatch) -> list[str]:
    """Every SQL statement run by connections opened from now on."""
    seen: list[str] = []
    real = sqlite3.connect

    def connect(*args, **kwargs):
        conn = real(*args, **kwargs)
        conn.set_trace_callback(seen.append)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    return seen


def _scans(statements: list[str]) -> list[str]:
    return [s for s in statements
            if ("count(" in s.lower() or "sum(" in s.lower()) and "kernels" in s.lower()]


def test_stats_and_size_checks_read_meta_not_scans(cache_dir, monkeypatch):
    monkeypatch.setenv("KDB_CACHE_MAX_SIZE", str(5 * SIZE))
    db = KernelDB(use_system=False)
    fill(db, 3)  # the file exists and is migrated before tracing starts
    db.close()
    seen = _traced(monkeypatch)
    db = KernelDB(use_system=False)
    for i in range(3, 9):  # passes the cap twice: size checks and evictions
        db.put(attrs(i), blob(i))
    data = report.stats(cache_dir / "v1")
    assert data["evicted"] > 0
    assert seen and not _scans(seen), _scans(seen)
    assert any("FROM meta" in s for s in seen)


class TotalsMachine(RuleBasedStateMachine):
    """Random puts, replacements, deletes, hits and evictions: the running totals in
    ``meta`` always equal a scan, and what is stored is what the model says."""

    @initialize()
    def open_file(self):
        self.dir = tempfile.mkdtemp(prefix="kdb-cap-")
        self.file = KernelFile(Path(self.dir) / "v1" / "a1.kdb", tier="user", readonly=False)
        self.model: dict[str, int] = {}  # key -> stored size (incompressible blobs)
        self.cap = 0

    def teardown(self):
        self.file.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _entry(self, k: int, size: int) -> Entry:
        return Entry(key=f"key{k}", arch="a1", backend="test", name=f"k{k}",
                     attributes=json.dumps({"k": k}), raw=os.urandom(size))

    @rule(k=st.integers(0, 15), size=st.integers(1, 3000), cap=st.sampled_from([0, 0, 12000]))
    def put(self, k, size, cap):
        assert self.file.write([self._entry(k, size)], [], {}, {}, cap=cap) is True
        self.model[f"key{k}"] = size
        if cap and sum(self.model.values()) > cap:
            present = {r[0] for r in self.file.query("SELECT key FROM kernels")}
            assert f"key{k}" in present  # the new entry is never its own victim
            assert sum(v for kk, v in self.model.items() if kk in present) <= cap - cap // 3
            self.model = {kk: v for kk, v in self.model.items() if kk in present}

    @rule(ks=st.lists(st.integers(0, 15), max_size=4))
    def delete(self, ks):
        keys = {f"key{k}" for k in ks}
        assert self.file.delete(keys) == len(keys & set(self.model))
        for key in keys:
            self.model.pop(key, None)

    @rule(k=st.integers(0, 15), n=st.integers(1, 3))
    def hit(self, k, n):
        import time
        self.file.write([], [], {f"key{k}": (n, time.time())}, {"hits.user": n})

    @rule(to=st.integers(0, 20000))
    def evict(self, to):
        removed, freed = self.file.evict_to(to)
        present = {r[0] for r in self.file.query("SELECT key FROM kernels")}
        gone = set(self.model) - present
        assert removed == len(gone) and freed == sum(self.model[k] for k in gone)
        assert sum(self.model[k] for k in present) <= to
        self.model = {k: v for k, v in self.model.items() if k in present}

    @invariant()
    def totals_equal_a_scan(self):
        path = self.file.path
        if not path.exists():
            return
        meta = {"entries": 0, "raw_bytes": 0, "stored_bytes": 0} | meta_totals(path)
        assert meta == scanned_totals(path)
        assert meta["entries"] == len(self.model)
        assert meta["stored_bytes"] == sum(self.model.values())
        assert {r[0] for r in self.file.query("SELECT key FROM kernels")} == set(self.model)


TestTotals = TotalsMachine.TestCase
TestTotals.settings = settings(max_examples=200 if LONG else 25, stateful_step_count=30,
                               deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])


def test_the_compile_log_keeps_its_newest_rows_and_the_worker_log_is_rotated(
        cache_dir, monkeypatch, tmp_path):
    """Nothing removed compile-log rows (one a compile, kept past eviction, ``kdb evict``
    and ``verify --repair``) or ``store-worker.log``: a cache restored run after run grew by
    every compile. The newest rows are kept; the worker's log is moved aside past 1 MiB."""
    from kdb.file import filewriter
    from kdb.storing import spool

    monkeypatch.setattr(filewriter, "LOG_ROWS", 5)
    monkeypatch.setattr(filewriter, "MIN_LOG_ROWS", 5)
    db = KernelDB()
    for i in range(12):
        rec = db.tiers.record_compile(attrs(i), 0.01)
        db.tiers.storing.put_later(attrs(i), lambda i=i: blob(i), compile_seconds=0.01, log=rec)
        db.flush()
    db.close()
    names = [r[0] for r in sql(cache_dir / "v1" / "a1.kdb", "SELECT name FROM compile_log")]
    assert names == [f"k{i}" for i in range(6, 12)] or names == [f"k{i}" for i in range(7, 12)]

    log = tmp_path / "store-worker.log"
    log.write_bytes(b"x" * (spool.LOG_MAX + 1))
    os.close(spool._open_log(log))
    assert log.stat().st_size == 0 and (tmp_path / "store-worker.log.1").stat().st_size > 0

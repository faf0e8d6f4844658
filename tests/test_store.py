"""One SQLite kernel file: reads, writes, compression, checksums, and damaged files."""

from __future__ import annotations

import hashlib

import logging
import os
import sqlite3
import stat
import time

import pytest

from kdb import CacheFaultError
from kdb.file import codec, migrate
from kdb.file.kernelfile import CompileRecord, Entry, KernelFile
from conftest import sql


def entry(key: str = "k1", raw: bytes = b"kernel binary " * 200, **kw) -> Entry:
    return Entry(key=key, arch="a1", backend="x", name=kw.pop("name", key),
                 attributes=kw.pop("attributes", '{"k":"%s"}' % key), raw=raw, **kw)


@pytest.fixture
def user(tmp_path) -> KernelFile:
    return KernelFile(tmp_path / "v1" / "a1.kdb", tier="user", readonly=False)


# -- reads and writes ----------------------------------------------------------------------

def test_reading_a_missing_file_creates_nothing(user, tmp_path):
    assert user.fetch("k1") is None
    assert user.query("SELECT count(*) FROM kernels") == []
    assert not (tmp_path / "v1").exists()


def test_write_then_fetch(user):
    e = entry(compile_seconds=0.25, details={"device": "cpu"})
    assert user.write([e], [], {}, {})
    row = user.fetch("k1")
    assert row.attributes is None  # a hit reads the digest of the attributes, not the text
    assert row.attributes_sha256 == hashlib.sha256(e.attributes.encode()).hexdigest()
    assert row.compile_seconds == 0.25
    assert codec.decode(row.codec, row.blob, row.raw_size, row.checksum) == e.raw
    assert user.fetch("other") is None
    assert sql(user.path, "SELECT details FROM kernels") == [('{"device": "cpu"}',)]


def test_new_file_is_at_head_in_wal_mode(user):
    user.write([entry()], [], {}, {})
    conn = sqlite3.connect(user.path)
    assert migrate.revision_of(conn) == migrate.HEAD
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    conn.close()


def test_user_file_is_private(user, tmp_path):
    old = os.umask(0o022)
    try:
        user.write([entry()], [], {}, {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(user.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "v1").st_mode) == 0o700
    for side in ("-wal", "-shm", ".lock"):
        p = str(user.path) + side
        if os.path.exists(p):
            assert stat.S_IMODE(os.stat(p).st_mode) & 0o077 == 0, p


def test_compressible_binary_is_stored_with_zstd(user):
    raw = b"\x00\x01\x02\x03 LLVM bitcode-ish " * 500
    user.write([entry(raw=raw)], [], {}, {})
    [(kind, raw_size, stored_size, blob)] = sql(
        user.path, "SELECT codec, raw_size, stored_size, blob FROM kernels")
    assert kind == "zstd"
    assert raw_size == len(raw)
    assert stored_size == len(blob) < raw_size // 4
    assert blob[:4] == b"\x28\xb5\x2f\xfd"  # the zstd frame magic


def test_incompressible_binary_is_stored_raw(user):
    raw = os.urandom(4096)
    user.write([entry(raw=raw)], [], {}, {})
    assert sql(user.path, "SELECT codec, stored_size, blob FROM kernels") == [("raw", 4096, raw)]
    row = user.fetch("k1")
    assert codec.decode(row.codec, row.blob, row.raw_size, row.checksum) == raw


def test_stored_bytes_is_a_running_total(user):
    user.write([entry("a"), entry("b", raw=os.urandom(300))], [], {}, {})
    user.write([entry("a", raw=b"x" * 10_000)], [], {}, {})  # replace
    assert user.delete(["b", "absent"]) == 1
    meta = dict(sql(user.path, "SELECT name, value FROM meta"))
    [(stored, raw, count)] = sql(user.path,
                                 "SELECT sum(stored_size), sum(raw_size), count(*) FROM kernels")
    assert (int(meta["stored_bytes"]), int(meta["raw_bytes"]), int(meta["entries"])) == (
        stored, raw, count) == (stored, 10_000, 1)


def test_new_file_describes_itself_in_meta(user):
    user.write([entry("a")], [], {}, {})
    meta = dict(sql(user.path, "SELECT name, value FROM meta"))
    assert meta["arch"] == user.path.stem and meta["format"] == "1"
    assert meta["kdb_version"] and float(meta["created"]) > 0


def test_logs_hits_and_counters_are_written(user):
    user.write([entry()], [], {}, {})
    rec = CompileRecord(key="k1", name="k1", arch="a1", backend="x", seconds=0.5,
                        missed="system(none),user", reason="why", at=1.0, pid=42)
    later = time.time() + 1000
    user.write([], [rec], {"k1": (3, later)}, {"hits.user": 3, "compiles": 1})
    user.write([], [], {"k1": (1, later - 500)}, {"hits.user": 1})  # recency never goes back
    assert sql(user.path, "SELECT hits, last_access FROM kernels") == [(4, later)]
    assert dict(sql(user.path, "SELECT name, value FROM counters")) == {
        "hits.user": 4.0, "compiles": 1.0}
    assert sql(user.path, "SELECT key, seconds, missed, reason, pid FROM compile_log") == [
        ("k1", 0.5, "system(none),user", "why", 42)]


def test_a_latency_row_written_twice_is_kept_once(user):
    """A store job stored twice (its lane stopped after the write, before it removed the
    job; a hurry beside a starved lane) showed its compile twice in ``kdb log`` (CI, beside
    two CPU hogs: 7 rows for 6 compiles). Another compile of the key is a row of its own."""
    rec = CompileRecord(key="k1", name="k1", arch="a1", backend="x", seconds=0.5,
                        missed="user", reason="why", at=1.25, pid=42)
    for _ in range(2):
        user.write([entry()], [rec], {}, {})
    user.write([], [rec._replace(at=2.5), rec._replace(pid=43)], {}, {})
    assert sql(user.path, "SELECT at, pid FROM compile_log ORDER BY at, pid") == [
        (1.25, 42), (1.25, 43), (2.5, 42)]


def test_readonly_file_is_never_written(user, tmp_path):
    user.write([entry()], [], {}, {})
    user.close()
    sql(user.path, "PRAGMA journal_mode=DELETE")
    before = user.path.read_bytes()
    ro = KernelFile(user.path, tier="system", readonly=True)
    assert ro.fetch("k1") is not None
    assert ro.ensure() is None
    assert ro.write([entry("k2")], [], {}, {}) is False
    assert ro.delete(["k1"]) == 0
    ro.close()
    assert user.path.read_bytes() == before


# -- damaged files -------------------------------------------------------------------------

def test_corrupt_user_file_is_moved_aside_and_recreated(user, caplog):
    user.path.parent.mkdir(parents=True)
    junk = os.urandom(8192)
    user.path.write_bytes(junk)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert user.fetch("k1") is None
    aside = list(user.path.parent.glob("a1.kdb.corrupt-*"))
    assert [p.read_bytes() for p in aside] == [junk]
    assert not user.path.exists()
    assert any("damaged" in r.getMessage() and str(user.path) in r.getMessage()
               for r in caplog.records)
    assert user.write([entry()], [], {}, {})
    assert user.fetch("k1") is not None


def test_foreign_sqlite_file_is_moved_aside(user, caplog):
    user.path.parent.mkdir(parents=True)
    sql(user.path, "CREATE TABLE photos (id INTEGER)")
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert user.fetch("k1") is None
    assert "not a kdb database" in caplog.text
    assert len(list(user.path.parent.glob("a1.kdb.corrupt-*"))) == 1
    assert user.write([entry()], [], {}, {})
    assert user.fetch("k1") is not None


def test_corrupt_system_file_is_skipped_untouched(tmp_path, caplog):
    path = tmp_path / "a1.kdb"
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(4000))
    before = path.read_bytes()
    ro = KernelFile(path, tier="system", readonly=True)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert ro.fetch("k1") is None
        assert ro.fetch("k1") is None
    assert path.read_bytes() == before
    assert list(tmp_path.iterdir()) == [path]
    assert caplog.text.count("skipped") == 1


def test_strict_mode_raises_on_a_corrupt_file(user, monkeypatch):
    monkeypatch.setenv("KDB_STRICT", "1")
    user.path.parent.mkdir(parents=True)
    user.path.write_bytes(os.urandom(8192))
    with pytest.raises(CacheFaultError, match="damaged"):
        user.fetch("k1")


def test_empty_file_is_created_not_quarantined(user):
    user.path.parent.mkdir(parents=True)
    user.path.touch()
    assert user.fetch("k1") is None
    assert user.write([entry()], [], {}, {})
    assert user.fetch("k1") is not None
    assert not list(user.path.parent.glob("*.corrupt-*"))


# -- codec ---------------------------------------------------------------------------------

def test_codec_round_trip_and_refusals():
    raw = b"abc" * 1000
    kind, blob = codec.encode(raw)
    digest = codec.checksum(raw)
    assert kind == codec.ZSTD and len(blob) < len(raw)
    assert codec.decode(kind, blob, len(raw), digest) == raw
    flipped = bytearray(blob)
    flipped[len(flipped) // 2] ^= 0xFF
    assert codec.decode(kind, bytes(flipped), len(raw), digest) is None
    assert codec.decode(kind, blob[:-3], len(raw), digest) is None
    assert codec.decode(kind, blob, len(raw) - 1, digest) is None
    assert codec.decode(kind, blob, len(raw), "0" * 64, thorough=True) is None
    assert codec.decode("lz4", blob, len(raw), digest) is None
    assert codec.decode(codec.RAW, raw[:-1] + b"x", len(raw), digest) is None


def test_the_fast_level_is_kept_only_when_it_compresses_nearly_as_well():
    """Frames of zstd's fast level decompress about twice as fast (a warm start's hits);
    data it cannot shrink (redundancy in byte statistics, not in repeats) gets level 3."""
    import random

    import zstandard

    def frame(level: int, raw: bytes) -> bytes:
        return zstandard.ZstdCompressor(level=level, write_content_size=True,
                                        write_checksum=True).compress(raw)

    rnd = random.Random(7)
    repeats = b"".join(rnd.choice([b"define i32 @k", b"store float", b"%x = fadd"])
                       for _ in range(4000)) + rnd.randbytes(2000)
    statistics = bytes(b & 0x0F | 0x40 for b in rnd.randbytes(40_000))  # 4 bits a byte
    for raw, level in ((repeats, codec.FAST_LEVEL), (statistics, codec.LEVEL)):
        kind, blob = codec.encode(raw)
        assert kind == codec.ZSTD and blob == frame(level, raw), level
        assert codec.decode(kind, blob, len(raw), codec.checksum(raw)) == raw
    assert len(frame(codec.FAST_LEVEL, statistics)) >= len(statistics)  # why level 3 there


def test_zstd_frames_carry_their_own_checksum_and_thorough_checks_the_sha256():
    raw = b"kernel binary " * 500
    kind, blob = codec.encode(raw)
    assert kind == codec.ZSTD and blob[4] & 0x04  # zstd's content checksum is in the frame
    right = codec.checksum(raw)
    assert codec.decode(kind, blob, len(raw), right) == raw
    assert codec.decode(kind, blob, len(raw), right, thorough=True) == raw
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x10
    assert codec.decode(kind, bytes(flipped), len(raw), right) is None  # zstd refuses it
    # A wrong sha256 column is caught by the thorough check (kdb verify, kdb pack).
    assert codec.decode(kind, blob, len(raw), "0" * 64, thorough=True) is None
    assert codec.decode(kind, blob, len(raw) + 1, right) is None


def test_a_read_error_on_a_file_replaced_meanwhile_is_no_fault(user, monkeypatch):
    """``kdb clear`` removed the file with its -wal and -shm and another process made a new
    one: this thread's connection then fails ("disk I/O error"). That is the file gone, not
    a broken cache: no fault (strict mode raises on one), and the next read opens the new
    file. Before, only a file still missing counted; a new one there disabled the tier."""
    monkeypatch.setenv("KDB_STRICT", "1")
    assert user.write([entry("k1")], [], {}, {})
    assert user.fetch("k1") is not None  # this thread's connection, to the first file
    for p in user.path.parent.glob(user.path.name + "*"):
        p.unlink()
    other = KernelFile(user.path, tier="user", readonly=False)
    assert other.write([entry("k2")], [], {}, {})  # the new file
    moved = user.replaced()
    user.close()
    user.damaged(sqlite3.OperationalError("disk I/O error"), moved=moved)
    assert moved and user.usable
    assert user.fetch("k1") is None and user.fetch("k2") is not None
    with pytest.raises(CacheFaultError, match="cannot use"):  # a file still there: a fault
        user.damaged(sqlite3.OperationalError("disk I/O error"), moved=user.replaced())

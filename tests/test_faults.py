"""Faults the cache must survive: SIGKILL at any instant, damaged and foreign files, a
read-only cache, a full disk, a network file system.

KDB_LONG_TESTS=1 runs more kills and more random corruptions, and prints the figures.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kdb import HashAttributes, KernelDB, config
from kdb.file import codec, fs, migrate
from kdb.admin import integrity, maintenance
from conftest import set_attributes, sql

LONG = os.environ.get("KDB_LONG_TESTS") == "1"


def attrs(name: str, arch: str = "a1") -> HashAttributes:
    return HashAttributes(backend="test", source=f"__kernel void {name}() {{}}", arch=arch,
                          name=name)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and r.name.startswith("kdb")]


def tree(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory`` with its size and mtime (to prove nothing changed)."""
    out = {}
    for p in sorted(directory.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(directory))] = (st.st_size, st.st_mtime_ns)
    return out


# -- SIGKILL at random moments -------------------------------------------------------------

KILLER = r'''
import hashlib, json, os, random, signal, sqlite3, sys, time
import kdb
from kdb import HashAttributes, KernelDB; from kdb.file import migrate
import alembic.command, sqlalchemy  # noqa: F401 - forked writers create files without importing

work, target, writers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ARCHES = ("a1", "a2")
logs = os.path.join(work, "logs")
os.makedirs(logs, exist_ok=True)


def writer(seed):
    rnd = random.Random(seed)
    db = KernelDB(use_system=False)
    log = os.open(os.path.join(logs, f"{os.getpid()}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    mine, n = [], 0
    while True:
        if mine and rnd.random() < 0.2:
            arch, src = mine.pop(rnd.randrange(len(mine)))
            key = HashAttributes(backend="test", source=src, arch=arch).key
            os.write(log, f"d {arch} {src}\n".encode())  # intent: present or gone
            if db.tiers.user_file(arch).delete([key]) == 1:
                os.write(log, f"D {arch} {src}\n".encode())
            continue
        arch, src, n = rnd.choice(ARCHES), f"w{seed}-{n}", n + 1
        size = rnd.choice((rnd.randint(1, 400), rnd.randint(400, 24_000)))
        raw = rnd.randbytes(size) if rnd.random() < 0.5 else (b"op %d;" % n * size)[:size]
        if db.put(HashAttributes(backend="test", source=src, arch=arch, name=src), raw):
            # After put returns: put is synchronous, so the entry is committed.
            os.write(log, f"P {arch} {src} {hashlib.sha256(raw).hexdigest()}\n".encode())
            mine.append((arch, src))


def created():
    for arch in ARCHES:
        path = os.path.join(work, "cache", "v1", f"{arch}.kdb")
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            try:
                if migrate.revision_of(conn) != migrate.HEAD:
                    return False
            finally:
                conn.close()
        except sqlite3.Error:
            return False
    return True


rnd = random.Random()
children = {}
kills = unexpected = 0
start = time.monotonic()
while kills < target:
    while len(children) < writers:
        seed = rnd.getrandbits(32)
        pid = os.fork()
        if pid == 0:
            try:
                signal.alarm(30)  # never outlive a dead parent for long
                writer(seed)
            finally:
                os._exit(3)
        # Until both files exist a writer spends 30-120 ms creating and migrating one: the
        # first ones live longer, so that kills land in creation as well as in plain writes.
        longest = 0.05 if created() else 0.3
        children[pid] = time.monotonic() + rnd.uniform(0.005, longest)
    pid, deadline = min(children.items(), key=lambda kv: kv[1])
    time.sleep(max(0.0, deadline - time.monotonic()))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    del children[pid]
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        kills += 1
    else:
        unexpected += 1
for pid in children:  # the last writers die the same way
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    kills += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
print(json.dumps({"kills": kills, "unexpected_exits": unexpected,
                  "seconds": time.monotonic() - start}))
'''


def _kill_round(work: Path, kills: int, writers: int) -> dict:
    work.mkdir(parents=True)
    env = {**os.environ, "KDB_CACHE_DIR": str(work / "cache"), "KDB_CACHE_MAX_SIZE": "0"}
    proc = subprocess.run([sys.executable, "-c", KILLER, str(work), str(kills), str(writers)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kills"] >= kills and result["unexpected_exits"] == 0, (result, proc.stderr)

    # What each writer recorded after its put (or delete) returned; a torn last line is
    # something it never got to record.
    state: dict[tuple[str, str], tuple[str, str]] = {}
    for log in (work / "logs").glob("*.log"):
        text = log.read_text()
        lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
        for line in lines:
            op, arch, src, *digest = line.split()
            state[(arch, src)] = (op, digest[0] if digest else "")
    committed = {k: d for k, (op, d) in state.items() if op == "P"}
    deleted = {k for k, (op, _) in state.items() if op == "D"}
    assert len(committed) >= 50, "the writers committed too little to prove anything"

    user_dir = work / "cache" / "v1"
    present = 0
    for arch in ("a1", "a2"):
        path = user_dir / f"{arch}.kdb"
        conn = sqlite3.connect(path)  # opens: a killed writer left a usable database
        try:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            assert migrate.revision_of(conn) == migrate.HEAD
            for kind, blob, raw_size, digest in conn.execute(
                    "SELECT codec, blob, raw_size, checksum FROM kernels"):
                present += 1  # no half-written entry: every row decodes to its checksum
                assert codec.decode(kind, blob, raw_size, digest) is not None
        finally:
            conn.close()
    verified = maintenance.verify(user_dir)  # integrity, checksums, keys, and the running totals
    assert verified["ok"], [f["problems"] or f["bad_entries"] for f in verified["files"]]

    db = KernelDB(cache_dir=work / "cache", use_system=False)
    lost = [k for k, digest in committed.items()
            if (b := db.get(HashAttributes(backend="test", source=k[1], arch=k[0]))) is None
            or hashlib.sha256(b).hexdigest() != digest]
    resurrected = [k for k in deleted
                   if db.get(HashAttributes(backend="test", source=k[1], arch=k[0]))]
    db.close()
    assert lost == [] and resurrected == []
    return {**result, "committed": len(committed), "rows": present, "lost": len(lost)}


def test_sigkill_at_random_moments_loses_no_committed_entry(tmp_path):
    rounds = 10 if LONG else 1
    totals = {"kills": 0, "committed": 0, "lost": 0, "seconds": 0.0}
    for r in range(rounds):
        got = _kill_round(tmp_path / f"round-{r}", kills=200, writers=4)
        for k in totals:
            totals[k] += got[k]
        shutil.rmtree(tmp_path / f"round-{r}")
    print(f"\nkill test: {totals['kills']} SIGKILLs survived in {totals['seconds']:.1f} s, "
          f"{totals['committed']} committed entries checked, {totals['lost']} lost")


# -- damaged and foreign files -------------------------------------------------------------

GOOD_A, GOOD_B = b"A" * 3000 + b"binary", os.urandom(2000)


def good_file(path: Path, scratch: Path) -> None:
    """A kdb file at the head revision holding kernels a and b, in rollback-journal mode."""
    db = KernelDB(cache_dir=scratch, use_system=False)
    assert db.put(attrs("a"), GOOD_A) and db.put(attrs("b"), GOOD_B)
    db.close()
    src = scratch / "v1" / "a1.kdb"
    sql(src, "PRAGMA journal_mode=DELETE")
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, path)
    os.chmod(path, 0o600)


def _truncate_half(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _truncate_header(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:60])


def _random_bytes(p: Path) -> None:
    p.write_bytes(random.Random(7).randbytes(16384))


def _foreign_sqlite(p: Path) -> None:
    p.unlink()
    sql(p, "CREATE TABLE photos (id INTEGER PRIMARY KEY, jpeg BLOB)")
    sql(p, "INSERT INTO photos (jpeg) VALUES (?)", (b"\xff\xd8" * 100,))


def _flipped_blob(p: Path) -> None:
    [(blob,)] = sql(p, "SELECT blob FROM kernels WHERE key = ?", (attrs("a").key,))
    bad = bytearray(blob)
    for i in range(len(bad) // 3, len(bad) // 3 + 3):
        bad[i] ^= 0xA5
    sql(p, "UPDATE kernels SET blob = ? WHERE key = ?", (bytes(bad), attrs("a").key))


def _missing_tables(p: Path) -> None:
    sql(p, "DROP TABLE kernels")


def _damaged_schema(p: Path) -> None:
    """A schema entry that does not parse, named in bytes that are not UTF-8: SQLite quotes
    the name in its error, and Python's sqlite3 then raises UnicodeDecodeError."""
    conn = sqlite3.connect(p)
    conn.execute("PRAGMA writable_schema=ON")
    conn.execute("UPDATE sqlite_master SET name = CAST(X'6bbc' AS TEXT), sql = 'CREATE junk' "
                 "WHERE name = 'ix_kernels_name'")
    conn.commit()
    conn.close()


def _future_revision(p: Path) -> None:
    sql(p, "UPDATE alembic_version SET version_num = '9999'")


CORRUPTIONS = {
    "truncated": _truncate_half,
    "truncated-header": _truncate_header,
    "random-bytes": _random_bytes,
    "foreign-sqlite": _foreign_sqlite,
    "flipped-blob": _flipped_blob,
    "missing-tables": _missing_tables,
    "damaged-schema": _damaged_schema,
    "future-revision": _future_revision,
}
#: Damaged user files are moved aside and recreated; these are not damaged, only unusable
#: (one entry, or a file from a newer kdb that must be left as it is).
NOT_MOVED = {"flipped-blob", "future-revision"}


@pytest.mark.parametrize("tier", ["user", "system"])
@pytest.mark.parametrize("variant", sorted(CORRUPTIONS))
def test_a_damaged_or_foreign_file_gives_one_warning_and_a_correct_result(
        variant, tier, tmp_path, cache_dir, caplog):
    sysdir = tmp_path / "system"
    sysdir.mkdir()
    path = (cache_dir / "v1" if tier == "user" else sysdir) / "a1.kdb"
    good_file(path, tmp_path / "scratch")
    CORRUPTIONS[variant](path)
    damaged = path.read_bytes()

    compiled = []

    def compile_fn(name):
        return lambda: compiled.append(name) or b"fresh " + name.encode() * 100

    db = KernelDB(system_path=[sysdir])
    with caplog.at_level(logging.WARNING, logger="kdb"):
        a = db.get_or_compile(attrs("a"), compile_fn("a"))
        b = db.get_or_compile(attrs("b"), compile_fn("b"))
        db.flush()
        db.close()
    notes = [w for w in warnings_of(caplog) if "no system kernel database" not in w]
    assert len(notes) == 1, notes
    assert a == b"fresh " + b"a" * 100 and compiled[0] == "a"  # never the damaged bytes
    if variant == "flipped-blob":
        assert b == GOOD_B and compiled == ["a"]  # the sound entry is still served
        assert "checksum mismatch" in notes[0]
    else:
        assert b == b"fresh " + b"b" * 100 and compiled == ["a", "b"]

    user_file = cache_dir / "v1" / "a1.kdb"
    aside = list((cache_dir / "v1").glob("a1.kdb.corrupt-*"))
    if tier == "system":
        assert path.read_bytes() == damaged  # never written, never moved
        assert sorted(p.name for p in sysdir.iterdir()) == ["a1.kdb"]
        assert aside == []
    elif variant in NOT_MOVED:
        assert aside == []
    else:  # moved aside, as it was, and a new file created
        assert [p.read_bytes() for p in aside] == [damaged]
        assert "moved aside" in notes[0]
    if tier == "user" and variant == "future-revision":
        assert path.read_bytes() == damaged
        return
    # What was compiled is stored in a sound user file and served to the next process.
    again = KernelDB(system_path=[sysdir])
    assert again.get(attrs("a")) == a
    again.close()
    assert sql(user_file, "PRAGMA integrity_check") == [("ok",)]


def _wal_system_file(sysdir: Path, scratch: Path, with_wal: bool) -> Path:
    """A system file left in WAL mode: kernel a in the main file, b only in its -wal."""
    db = KernelDB(cache_dir=scratch, use_system=False)
    db.put(attrs("a"), GOOD_A)
    db.close()  # the last connection checkpoints: a is in the main file
    src = scratch / "v1" / "a1.kdb"
    sysdir.mkdir(exist_ok=True)
    db = KernelDB(cache_dir=scratch, use_system=False)
    db.put(attrs("b"), GOOD_B)  # in the -wal only while this connection lives
    for suffix in ("", "-wal") if with_wal else ("",):
        shutil.copy(str(src) + suffix, sysdir / f"a1.kdb{suffix}")
    db.close()
    if with_wal:
        assert (sysdir / "a1.kdb-wal").stat().st_size > 0
    assert (sysdir / "a1.kdb").read_bytes()[18:20] == b"\x02\x02"  # WAL mode in the header
    return sysdir / "a1.kdb"


def test_a_system_file_in_wal_mode_with_a_wal_is_skipped_with_one_warning(
        tmp_path, cache_dir, caplog):
    sysdir = tmp_path / "system"
    path = _wal_system_file(sysdir, tmp_path / "scratch", with_wal=True)
    before = {p.name: p.read_bytes() for p in sysdir.iterdir()}
    db = KernelDB(system_path=[sysdir])
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get_or_compile(attrs("a"), lambda: b"compiled a") == b"compiled a"
        assert db.get_or_compile(attrs("b"), lambda: b"compiled b") == b"compiled b"
        db.close()
    notes = warnings_of(caplog)
    assert len(notes) == 1 and "WAL mode" in notes[0] and "skipped" in notes[0], notes
    assert str(path) in notes[0] and "kdb pack" in notes[0]
    assert {p.name: p.read_bytes() for p in sysdir.iterdir()} == before  # nothing written


def test_a_system_file_in_wal_mode_without_a_wal_is_read_with_one_warning(
        tmp_path, cache_dir, caplog):
    sysdir = tmp_path / "system"
    _wal_system_file(sysdir, tmp_path / "scratch", with_wal=False)
    before = (sysdir / "a1.kdb").read_bytes()
    db = KernelDB(system_path=[sysdir])
    with caplog.at_level(logging.WARNING, logger="kdb"):
        hit = db.lookup(attrs("a"))
        assert hit is not None and hit.tier == "system" and hit.binary == GOOD_A
        assert db.lookup(attrs("b")) is None  # its -wal was never shipped
        db.close()
    notes = warnings_of(caplog)
    assert len(notes) == 1 and "WAL mode" in notes[0] and "read" in notes[0], notes
    assert (sysdir / "a1.kdb").read_bytes() == before
    assert sorted(p.name for p in sysdir.iterdir()) == ["a1.kdb"]


def _random_damage(data: bytes, rnd: random.Random) -> bytes:
    buf = bytearray(data)
    how = rnd.choice(["flip", "flip", "zero-page", "truncate", "splice"])
    if how == "flip":
        for _ in range(rnd.randint(1, 64)):
            buf[rnd.randrange(len(buf))] ^= rnd.randint(1, 255)
    elif how == "zero-page":
        page = rnd.randrange(len(buf) // 4096) * 4096
        buf[page:page + 4096] = bytes(4096)
    elif how == "truncate":
        del buf[rnd.randrange(len(buf)):]
    else:
        at = rnd.randrange(len(buf))
        buf[at:at + 512] = rnd.randbytes(512)
    return bytes(buf)


def test_random_damage_never_returns_wrong_bytes_or_raises(tmp_path):
    """Random flips, zeroed pages, truncations: every answer is the stored binary or a
    compile, in either tier; nothing raises."""
    scratch = tmp_path / "scratch"
    db = KernelDB(cache_dir=scratch, use_system=False)
    good = {f"k{i}": random.Random(i).randbytes(500 + 3000 * i) for i in range(6)}
    good |= {f"z{i}": b"compressible %d " % i * 400 for i in range(6)}
    for name, raw in good.items():
        db.put(attrs(name), raw)
    db.close()
    sql(scratch / "v1" / "a1.kdb", "PRAGMA journal_mode=DELETE")
    pristine = (scratch / "v1" / "a1.kdb").read_bytes()
    variants = 1000 if LONG else 40
    rnd = random.Random(int(os.environ.get("KDB_FUZZ_SEED", "2024")))
    served = compiled = bad_files = repaired = 0
    for n in range(variants):
        tier = "user" if n % 2 else "system"
        root = tmp_path / f"v{n}"
        where = root / ("cache/v1" if tier == "user" else "system")
        where.mkdir(parents=True)
        (where / "a1.kdb").write_bytes(_random_damage(pristine, rnd))
        for d in (root / "cache", root / "cache" / "v1"):
            if d.exists():
                d.chmod(0o700)
        (where / "a1.kdb").chmod(0o600)
        checked = integrity.verify_file(where / "a1.kdb", tier, "a1")  # never raises either
        bad_files += not checked["ok"]
        if tier == "user" and n % 4 == 1:  # and a repair leaves a file that verifies
            maintenance.verify(where, repair=True)
            assert maintenance.verify(where)["ok"], n
            repaired += 1
        db = KernelDB(cache_dir=root / "cache", system_path=[root / "system"])
        for name, raw in good.items():
            out = db.get_or_compile(attrs(name), lambda: b"recompiled")
            assert out in (raw, b"recompiled"), (n, name)
            served += out == raw
            compiled += out == b"recompiled"
        db.close()
        shutil.rmtree(root)
    print(f"\nrandom damage: {variants} corrupt files tried, {served} entries served intact, "
          f"{compiled} recompiled, 0 wrong; kdb verify found {bad_files} of them bad, "
          f"repaired {repaired}")
    assert compiled > 0 and bad_files > 0


# -- unfriendly file systems ---------------------------------------------------------------

def _without_dac_override(probe_dir: Path) -> list[str] | None:
    """A command prefix under which file permissions bind (root ignores them otherwise):
    nothing for a normal user; for root, setpriv dropping CAP_DAC_OVERRIDE. None if no way
    works here."""
    if os.getuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search"]
    probe_dir.mkdir()
    probe_dir.chmod(0o500)
    try:
        proc = subprocess.run(prefix + [sys.executable, "-c",
                                        f"open({str(probe_dir / 'x')!r}, 'w')"],
                              capture_output=True, text=True)
    except OSError:
        return None
    finally:
        probe_dir.chmod(0o700)
    return prefix if proc.returncode != 0 and "PermissionError" in proc.stderr else None


#: Start of a child that records kdb's warnings in ``seen``.
CATCHING_CHILD = """
    import json, logging, os, random, resource, signal
    import kdb
    from kdb import HashAttributes, KernelDB
    seen = []
    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    logging.getLogger("kdb").addHandler(Catch(logging.WARNING))
"""

READ_ONLY_CHILD = CATCHING_CHILD + """
    def a(name):
        return HashAttributes(backend="test", source=f"__kernel void {name}() {{}}", arch="a1")
    db = KernelDB(use_system=False)
    calls = []
    old = db.get_or_compile(a("old"), lambda: calls.append("old") or b"compiled old")
    new = db.get_or_compile(a("new"), lambda: calls.append("new") or b"compiled new")
    db.flush()
    stored = db.put(a("put"), b"put")
    again = db.get_or_compile(a("new"), lambda: calls.append("new") or b"compiled new")
    db.close()
    print(json.dumps({"old": old.decode(), "new": new.decode(), "again": again.decode(),
                      "stored": stored, "calls": calls, "warnings": seen}))
"""


@pytest.mark.parametrize("existing", ["file", "none", "zero-byte file"])
def test_a_read_only_cache_compiles_warns_once_and_stores_nothing(existing, cache_dir,
                                                                    tmp_path):
    prefix = _without_dac_override(tmp_path / "probe")
    if prefix is None:
        pytest.skip("cannot drop root's permission override here (no setpriv)")
    user_dir = cache_dir / "v1"
    if existing == "file":
        db = KernelDB(use_system=False)
        db.put(attrs("old"), b"stored old")
        db.close()
    else:
        config.private_dir(user_dir)
        if existing == "zero-byte file":  # created, then the writer was killed
            (user_dir / "a1.kdb").touch(mode=0o600)
    before = tree(cache_dir)
    user_dir.chmod(0o500)
    try:
        proc = subprocess.run(prefix + [sys.executable, "-c", textwrap.dedent(READ_ONLY_CHILD)],
                              env=dict(os.environ), capture_output=True, text=True, timeout=120)
    finally:
        user_dir.chmod(0o700)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["stored"] is False
    assert got["new"] == got["again"] == "compiled new"
    if existing == "file":  # what the cache holds is still served
        assert got["old"] == "stored old" and got["calls"] == ["new", "new"]
    else:
        assert got["old"] == "compiled old" and got["calls"] == ["old", "new", "new"]
    assert len(got["warnings"]) == 1, got["warnings"]
    assert "read-only" in got["warnings"][0] or "cannot write" in got["warnings"][0]
    assert "KDB_CACHE_DIR" in got["warnings"][0]
    assert tree(cache_dir) == before  # nothing stored, nothing moved aside


DISK_FULL_CHILD = CATCHING_CHILD + """
    def a(name):
        return HashAttributes(backend="test", source=name, arch="a1", name=name)
    rnd = random.Random(1)
    db = KernelDB(use_system=False)
    for i in range(3):
        assert db.put(a(f"before{i}"), rnd.randbytes(20_000))
    files = [os.path.join(db.user_dir, f) for f in os.listdir(db.user_dir)]
    limit = max(os.path.getsize(f) for f in files if os.path.isfile(f)) + 40_000
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    big = [db.put(a(f"big{i}"), rnd.randbytes(400_000)) for i in range(2)]
    small = db.put(a("small"), rnd.randbytes(1000))
    out = db.get_or_compile(a("compiled"), lambda: b"c" * 10 + rnd.randbytes(500_000))
    db.flush()
    print(json.dumps({"big": big, "small": small, "out": len(out), "warnings": seen}))
"""


def test_a_full_disk_stores_no_partial_entry_warns_and_goes_on(cache_dir, run_py):
    got = json.loads(run_py(DISK_FULL_CHILD).stdout.strip().splitlines()[-1])
    assert got["big"] == [False, False]  # not stored, and the program went on
    assert got["small"] is True  # what fits is still stored
    assert got["out"] == 500_010  # the caller got its binary
    notes = [w for w in got["warnings"] if "no system kernel database" not in w]
    assert len(notes) == 1 and "could not write" in notes[0], notes
    path = cache_dir / "v1" / "a1.kdb"
    assert sql(path, "PRAGMA integrity_check") == [("ok",)]
    names = sorted(r[0] for r in sql(path, "SELECT name FROM kernels"))
    assert names == ["before0", "before1", "before2", "small"]  # no partial entry
    assert maintenance.verify(cache_dir / "v1")["ok"]


MOUNTS = """\
rootfs / rootfs rw 0 0
/dev/sda1 / ext4 rw,relatime 0 0
server:/export/home {home} nfs4 rw,vers=4.2 0 0
mds@tcp:/scratch {home}/scratch lustre rw 0 0
/dev/gpfs0 /gpfs gpfs rw 0 0
tmpfs {home}/scratch/local\\040dir tmpfs rw 0 0
short line
"""


def test_network_file_systems_are_detected_from_the_mount_table(tmp_path):
    home = tmp_path / "home"
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS.format(home=home))
    assert fs.fs_type(home / "me" / ".cache", str(mounts)) == "nfs4"
    assert fs.fs_type(home / "scratch" / "job", str(mounts)) == "lustre"
    assert fs.fs_type(home / "scratch" / "local dir" / "x", str(mounts)) == "tmpfs"
    assert fs.fs_type("/gpfs/project", str(mounts)) == "gpfs"
    assert fs.fs_type("/usr/lib", str(mounts)) == "ext4"
    assert fs.fs_type("/usr", str(tmp_path / "no-such-mounts")) is None


def test_network_fs_names_only_network_types(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "scratch" / "local dir").mkdir(parents=True)
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS.format(home=home))
    monkeypatch.setattr(fs, "fs_type", functools.partial(fs.fs_type, mounts=str(mounts)))
    assert fs.network_fs(home / "not" / "created" / "yet") == "nfs4"  # nearest existing dir
    assert fs.network_fs(home / "scratch") == "lustre"
    assert fs.network_fs(home / "scratch" / "local dir") is None
    assert fs.network_fs("/usr") is None


def test_a_cache_on_a_network_fs_uses_a_rollback_journal_and_warns_once(cache_dir,
                                                                         monkeypatch, caplog):
    monkeypatch.setattr(fs, "network_fs", lambda path: "nfs4")
    db = KernelDB(use_system=False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.put(attrs("a"), GOOD_A)
        assert db.put(attrs("b", arch="a2"), GOOD_B)  # a second file in the same directory
        db.flush()
    for arch in ("a1", "a2"):
        assert sql(cache_dir / "v1" / f"{arch}.kdb", "PRAGMA journal_mode") == [("delete",)]
    notes = warnings_of(caplog)
    assert len(notes) == 1, notes
    assert "network file system (nfs4)" in notes[0] and "KDB_CACHE_DIR" in notes[0]
    assert KernelDB(use_system=False).get(attrs("a")) == GOOD_A


def test_a_local_cache_uses_wal(cache_dir):
    assert fs.network_fs(cache_dir.parent) is None  # the test machine's tmp is local
    KernelDB(use_system=False).put(attrs("a"), GOOD_A)
    assert sql(cache_dir / "v1" / "a1.kdb", "PRAGMA journal_mode") == [("wal",)]
    assert stat.S_IMODE((cache_dir / "v1" / "a1.kdb").stat().st_mode) == 0o600


# -- kdb verify ----------------------------------------------------------------------------

def _verify(*args: str, env: dict[str, str] | None = None):
    from click.testing import CliRunner

    from kdb.cli import cli

    return CliRunner().invoke(cli, ["verify", *args], env=env)


def _filled(cache_dir: Path, n: int = 6) -> dict[str, bytes]:
    db = KernelDB(use_system=False)
    good = {f"k{i}": random.Random(i).randbytes(300) + b"x" * 700 for i in range(n)}
    for name, raw in good.items():
        assert db.put(attrs(name), raw)
    db.close()
    return good


def test_verify_passes_a_sound_cache_of_both_tiers(tmp_path, cache_dir):
    _filled(cache_dir)
    sysdir = tmp_path / "system"
    good_file(sysdir / "a1.kdb", tmp_path / "scratch")
    result = _verify(env={"KDB_SYSTEM_DB_PATH": str(sysdir)})
    assert result.exit_code == 0, result.output
    assert "2 file(s), 8 entries: all sound" in result.output
    data = json.loads(_verify("--json", env={"KDB_SYSTEM_DB_PATH": str(sysdir)}).output)
    assert data["ok"] and [f["tier"] for f in data["files"]] == ["system", "user"]


def _key_of(name: str) -> str:
    return attrs(name).key


BAD_ENTRIES = {
    "checksum": ("UPDATE kernels SET blob = substr(blob, 1, 50) WHERE key = ?",
                 "checksum mismatch"),
    "attributes": ("UPDATE kernels SET attrs = CAST('{not json' AS BLOB), source = NULL "
                   "WHERE key = ?", "attributes are not JSON"),
    "key": (lambda path, key: set_attributes(path, key, attrs("other").encoded().decode()),
            "key is not the sha256"),
    "digest": ("UPDATE kernels SET attributes_sha256 = 'f00d' WHERE key = ?",
               "attributes_sha256 is not the sha256"),
    "source": ("UPDATE sources SET body = CAST('\"x\"' AS BLOB) WHERE digest = "
               "(SELECT source FROM kernels WHERE key = ?)", "key is not the sha256"),
    "arch": ("UPDATE kernels SET arch = 'sm_90' WHERE key = ?", "built for arch 'sm_90'"),
    "stored size": ("UPDATE kernels SET stored_size = stored_size + 1 WHERE key = ?",
                    "stored_size"),
}


def test_verify_finds_every_bad_entry_and_repair_drops_exactly_those(cache_dir):
    good = _filled(cache_dir, n=len(BAD_ENTRIES) + 2)
    path = cache_dir / "v1" / "a1.kdb"
    names = sorted(good)
    for name, (update, _) in zip(names, BAD_ENTRIES.values()):
        if callable(update):
            update(path, _key_of(name))
        else:
            sql(path, update, (_key_of(name),))
    sql(path, "UPDATE meta SET value = '999' WHERE name = 'raw_bytes'")
    result = _verify()
    assert result.exit_code == 1
    for name, (_, why) in zip(names, BAD_ENTRIES.values()):
        assert f"bad entry {_key_of(name)[:16]} ({name})" in result.output
        assert why in result.output
    assert "running totals in meta are wrong: raw_bytes 999" in result.output
    assert f"{len(BAD_ENTRIES)} bad entries" in result.output

    repaired = _verify("--repair")
    assert repaired.exit_code == 0, repaired.output
    assert f"dropped {len(BAD_ENTRIES)} bad entries" in repaired.output
    assert "running totals recomputed" in repaired.output
    assert _verify().exit_code == 0
    kept = names[len(BAD_ENTRIES):]
    assert sorted(r[0] for r in sql(path, "SELECT name FROM kernels")) == kept
    db = KernelDB(use_system=False)
    assert all(db.get(attrs(n)) == good[n] for n in kept)


def test_verify_repair_rebuilds_a_damaged_index(cache_dir):
    _filled(cache_dir)
    path = cache_dir / "v1" / "a1.kdb"
    [(root,)] = sql(path, "SELECT rootpage FROM sqlite_master WHERE name = 'ix_kernels_name'")
    [(page_size,)] = sql(path, "PRAGMA page_size")
    data = bytearray(path.read_bytes())
    at = (root - 1) * page_size + data[(root - 1) * page_size:root * page_size].index(b"k3")
    data[at + 1] = ord("9")  # the index says k9 where the table says k3
    path.write_bytes(bytes(data))
    result = _verify()
    assert result.exit_code == 1 and "integrity check failed" in result.output
    repaired = _verify("--repair")
    assert repaired.exit_code == 0 and "indexes rebuilt" in repaired.output
    assert sql(path, "PRAGMA integrity_check") == [("ok",)]
    assert len(sql(path, "SELECT key FROM kernels")) == 6


@pytest.mark.parametrize("variant", ["random-bytes", "truncated", "foreign-sqlite",
                                     "missing-tables", "damaged-schema"])
def test_verify_repair_moves_an_unusable_user_file_aside(variant, tmp_path, cache_dir):
    path = cache_dir / "v1" / "a1.kdb"
    good_file(path, tmp_path / "scratch")
    CORRUPTIONS[variant](path)
    damaged = path.read_bytes()
    result = _verify("--json")
    assert result.exit_code == 1
    [entry] = json.loads(result.output)["files"]
    assert entry["problems"] and not entry["ok"]
    repaired = _verify("--repair")
    assert repaired.exit_code == 0, repaired.output
    assert "moved aside" in repaired.output
    assert [p.read_bytes() for p in path.parent.glob("a1.kdb.corrupt-*")] == [damaged]
    assert _verify().exit_code == 0
    db = KernelDB(use_system=False)  # and kdb starts a new file
    assert db.get_or_compile(attrs("a"), lambda: b"new") == b"new"
    db.close()
    assert KernelDB(use_system=False).get(attrs("a")) == b"new"


def test_verify_reports_a_future_file_and_repair_leaves_it(tmp_path, cache_dir):
    path = cache_dir / "v1" / "a1.kdb"
    good_file(path, tmp_path / "scratch")
    _future_revision(path)
    before = path.read_bytes()
    result = _verify("--repair")
    assert result.exit_code == 1
    assert "schema revision 9999 is newer than this kdb" in result.output
    assert path.read_bytes() == before


def test_verify_reports_a_system_file_in_wal_mode(tmp_path, cache_dir):
    sysdir = tmp_path / "system"
    _wal_system_file(sysdir, tmp_path / "scratch", with_wal=False)
    result = _verify(env={"KDB_SYSTEM_DB_PATH": str(sysdir)})
    assert result.exit_code == 1 and "WAL mode" in result.output


# -- issue 15: each fault of the matrix, pinned -------------------------------------------

def _cli(*args: str, env: dict[str, str] | None = None):
    from click.testing import CliRunner

    from kdb.cli import cli

    return CliRunner().invoke(cli, list(args), env=env)


@pytest.mark.parametrize("where", ["regular file", "/dev/null"])
def test_a_cache_dir_that_is_a_file_compiles_with_one_warning(where, tmp_path, monkeypatch,
                                                              caplog):
    path = tmp_path / "f" if where == "regular file" else Path("/dev/null")
    if where == "regular file":
        path.write_text("x")
    monkeypatch.setenv("KDB_CACHE_DIR", str(path))
    db = KernelDB(use_system=False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get_or_compile(attrs("a"), lambda: b"compiled a") == b"compiled a"
        assert db.get_or_compile(attrs("b"), lambda: b"compiled b") == b"compiled b"
        db.flush()
    notes = warnings_of(caplog)
    assert len(notes) == 1 and "is not a directory" in notes[0], notes


HOLDER = """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1] + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(120)
"""


def _holding(path: Path) -> subprocess.Popen:
    """A process that holds ``path``'s upgrade lock and makes no progress."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_stuck_upgrader_costs_one_bounded_wait_not_one_per_kernel(cache_dir, run_py):
    user = cache_dir / "v1"
    config.private_dir(user)
    path = user / "a1.kdb"
    migrate.upgrade_sqlite(path, migrate.REVISIONS[1])  # needs an upgrade
    path.chmod(0o600)
    holder = _holding(path)
    try:
        proc = run_py(CATCHING_CHILD + """
    import time
    start = time.monotonic()
    db = KernelDB(use_system=False)
    got = [db.get_or_compile(HashAttributes(backend="test", source=n, arch="a1"),
                             lambda: b"compiled") for n in "abc"]
    db.flush()
    print(json.dumps({"got": [g.decode() for g in got], "warnings": seen,
                      "seconds": time.monotonic() - start}))
""", env={"KDB_LOCK_TIMEOUT": "0.5"}, timeout=60)
    finally:
        holder.kill()
        holder.wait()
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["got"] == ["compiled"] * 3
    notes = [w for w in got["warnings"] if "no system kernel" not in w]
    assert len(notes) == 1 and "KDB_LOCK_TIMEOUT" in notes[0], notes
    assert got["seconds"] < 10, got  # one bounded wait, not one per kernel


def test_kdb_migrate_gives_up_on_a_stuck_upgrader_with_status_1(cache_dir, monkeypatch):
    path = cache_dir / "v1" / "a1.kdb"
    config.private_dir(path.parent)
    migrate.upgrade_sqlite(path, migrate.REVISIONS[1])
    monkeypatch.setenv("KDB_LOCK_TIMEOUT", "0.2")
    holder = _holding(path)
    try:
        result = _cli("migrate", "--json")
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 1, result.output
    [row] = json.loads(result.stdout)
    assert row["action"] == "skipped" and "KDB_LOCK_TIMEOUT" in row["problem"]


def test_a_put_after_kdb_clear_lands_in_the_new_file(cache_dir):
    db = KernelDB(use_system=False)
    assert db.put(attrs("before"), b"before")
    result = subprocess.run([sys.executable, "-m", "kdb.cli", "clear", "--yes"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "removed" in result.stdout, result.stderr
    assert db.put(attrs("after"), b"after")
    db.close()
    fresh = KernelDB(use_system=False)
    assert fresh.get(attrs("after")) == b"after"  # not written into the unlinked file
    path = cache_dir / "v1" / "a1.kdb"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sql(path, "PRAGMA journal_mode") == [("wal",)]


def test_verify_repair_leaves_a_file_a_first_write_is_creating(cache_dir):
    path = cache_dir / "v1" / "a1.kdb"
    config.private_dir(path.parent)
    path.touch(mode=0o600)
    sql(path, "PRAGMA journal_mode=WAL")  # what ensure() leaves before the migration
    for args in (["verify"], ["verify", "--repair"]):
        result = _cli(*args)
        assert result.exit_code == 0 and "created" in result.output, result.output
    assert path.exists() and not list(path.parent.glob("*.corrupt-*"))
    assert json.loads(_cli("stats", "--json").stdout)["entries"] == 0
    db = KernelDB(use_system=False)
    assert db.put(attrs("a"), b"a")  # the writer then creates its tables
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sql(path, "PRAGMA journal_mode") == [("wal",)]


def test_an_upgrade_never_recreates_a_file_moved_aside(tmp_path):
    from sqlalchemy.exc import OperationalError

    with pytest.raises(OperationalError, match="unable to open"):
        migrate.upgrade_sqlite(tmp_path / "gone.kdb", create=False)
    assert not (tmp_path / "gone.kdb").exists()


@pytest.mark.parametrize("variant", ["zero-byte", "table-less"])
def test_every_report_reads_a_file_without_tables(variant, cache_dir):
    path = cache_dir / "v1" / "a1.kdb"
    config.private_dir(path.parent)
    path.touch(mode=0o600)
    if variant == "table-less":
        sql(path, "PRAGMA journal_mode=WAL")
    for args in (["stats"], ["stats", "--json"], ["info"], ["ls"], ["log"], ["migrate"]):
        result = _cli(*args)
        assert result.exit_code == 0 and result.exception is None, (args, result.output)
    assert json.loads(_cli("stats", "--json").stdout)["entries"] == 0


def test_kdb_commands_read_a_read_only_cache_and_repair_nothing(cache_dir, tmp_path):
    prefix = _without_dac_override(tmp_path / "probe")
    if prefix is None:
        pytest.skip("cannot drop root's permission override here (no setpriv)")
    _filled(cache_dir, 2)
    user = cache_dir / "v1"
    before = tree(user)

    def kdb_(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(prefix + [sys.executable, "-m", "kdb.cli", *args],
                              capture_output=True, text=True, timeout=60)

    user.chmod(0o500)
    try:
        ls, verify, repair = kdb_("ls", "--json"), kdb_("verify"), kdb_("verify", "--repair")
    finally:
        user.chmod(0o700)
    assert ls.returncode == 0 and len(json.loads(ls.stdout)) == 2, ls.stderr
    assert "skipped" not in ls.stderr
    assert verify.returncode == 0 and "all sound" in verify.stdout, verify.stdout
    assert repair.returncode == 0 and "repaired" not in repair.stdout
    assert tree(user) == before


def test_kdb_info_skips_a_fifo_in_the_system_path(tmp_path, cache_dir):
    sysdir = tmp_path / "system"
    sysdir.mkdir()
    os.mkfifo(sysdir / "a1.kdb")
    env = {**os.environ, "KDB_SYSTEM_DB_PATH": str(sysdir)}
    proc = subprocess.run([sys.executable, "-m", "kdb.cli", "info", "--json"], env=env,
                          capture_output=True, text=True, timeout=60)  # hung before
    assert proc.returncode == 0, proc.stderr
    [sysdb] = json.loads(proc.stdout)["system_databases"]
    assert "not a regular file" in sysdb["problem"]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_user_file_that_is_not_a_file_is_skipped_with_one_warning(kind, cache_dir, caplog):
    path = cache_dir / "v1" / "a1.kdb"
    config.private_dir(path.parent)
    os.mkfifo(path, 0o600) if kind == "fifo" else path.mkdir()
    db = KernelDB(use_system=False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get_or_compile(attrs("a"), lambda: b"a") == b"a"  # a FIFO hung open()
        assert db.get_or_compile(attrs("b"), lambda: b"b") == b"b"
        db.flush()
    notes = warnings_of(caplog)
    assert len(notes) == 1 and ("FIFO" in notes[0] or "directory" in notes[0]), notes
    result = _cli("verify")
    assert result.exit_code == 1 and "not a kdb file" in result.output


@pytest.mark.parametrize("name, value", [
    ("KDB_WAIT_TIMEOUT", "nan"), ("KDB_WAIT_TIMEOUT", "-5"), ("KDB_CACHE_MAX_SIZE", "abc"),
    ("KDB_CACHE_MAX_SIZE", "9" * 400), ("KDB_CACHE_MAX_SIZE", "0.5"),
    ("KDB_STORE_TIMEOUT", "inf"), ("KDB_STORE_AT_EXIT", "bogus"), ("KDB_TRACE", "maybe"),
])
def test_a_bad_setting_is_a_clean_usage_error_on_the_command_line(name, value, cache_dir):
    for args in (["ls"], ["stats", "--json"], ["verify"]):
        result = _cli(*args, env={name: value})
        assert result.exit_code == 2 and result.exception is not None
        assert isinstance(result.exception, SystemExit)
        assert name in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("name, value", [
    ("KDB_STORE_TIMEOUT", "-1"), ("KDB_CACHE_MAX_SIZE", "9" * 400),
    ("KDB_WAIT_TIMEOUT", "nan"), ("KDB_CACHE_MAX_SIZE", "abc"),
])
def test_a_bad_setting_never_ends_or_soils_a_program(name, value, cache_dir, run_py):
    proc = run_py("""
        from kdb import HashAttributes, KernelDB
        db = KernelDB(use_system=False)
        a = HashAttributes(backend="test", source="x", arch="a1")
        assert db.get_or_compile(a, lambda: b"compiled") == b"compiled"
        db.tiers.storing.put_later(a, lambda: b"compiled")
        print("done")
    """, env={name: value})
    assert proc.stdout.strip() == "done"
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    mentions = [ln for ln in proc.stderr.splitlines() if name in ln]
    assert len(mentions) == 1 and "instead" in mentions[0], proc.stderr


def test_many_corrupt_entries_give_one_warning(cache_dir, caplog):
    _filled(cache_dir, 4)
    path = cache_dir / "v1" / "a1.kdb"
    for key, blob in sql(path, "SELECT key, blob FROM kernels"):
        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 0xFF
        sql(path, "UPDATE kernels SET blob = ? WHERE key = ?", (bytes(bad), key))
    db = KernelDB(use_system=False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        for i in range(4):
            assert db.get_or_compile(attrs(f"k{i}"), lambda: b"again") == b"again"
        db.flush()
    notes = warnings_of(caplog)
    assert len(notes) == 1 and "checksum mismatch" in notes[0], notes


def test_kdb_clear_removes_hand_off_leftovers_and_takes_json(cache_dir):
    _filled(cache_dir, 1)
    leftover = cache_dir / "v1" / ".handoff-123-456.json"
    leftover.touch()
    result = _cli("clear", "--yes", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert str(leftover) in data["removed"] and data["failed"] == []
    assert not leftover.exists() and not (cache_dir / "v1" / "a1.kdb").exists()


def test_kdb_evict_that_cannot_change_a_file_exits_1(cache_dir, tmp_path):
    _filled(cache_dir, 2)
    path = cache_dir / "v1" / "a1.kdb"
    path.chmod(0o666)  # refused at run time: nothing may be evicted from it either
    try:
        result = _cli("evict", "--to", "0", "--json")
    finally:
        path.chmod(0o600)
    assert result.exit_code == 1, result.output
    [row] = json.loads(result.stdout)
    assert row["removed"] == 0 and "refused" in row["problem"]
    assert len(sql(path, "SELECT key FROM kernels")) == 2


def test_a_full_disk_is_one_cause_one_warning_whichever_write_meets_it(cache_dir, caplog):
    """A full disk met by a store's write, the hand-over of bookkeeping and the room check
    gave up to four warnings in one process, each under a key of its own."""
    import errno
    import logging

    from kdb import faults
    from kdb.file.filewriter import _write_failed

    db = KernelDB()
    db.put(attrs("k"), b"binary")
    f = db.tiers.user_file("a1")
    with caplog.at_level(logging.WARNING, logger="kdb"):
        _write_failed(f, sqlite3.OperationalError("database or disk is full"))
        assert faults.full_disk(OSError(errno.ENOSPC, "No space left on device"))
        faults.fault("another write met it", once=faults.full_disk_key(f.path.parent))
        faults.fault("the room check", once=faults.full_disk_key(db.user_dir))
    db.close()
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "disk is full" in said[0].getMessage(), said

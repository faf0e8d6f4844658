"""A kernel cache holds code the process will run: who may write it, where it may write.

Private directories and files; a user database someone else could change is refused;
arch ids cannot steer a write outside the cache; system files are never opened writable.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdb import HashAttributes, KernelDB, UnsafeArchError, claims, config, faults
from kdb.cli import cli

BINARY = b"\x7fELF kernel " * 100


def attrs(name: str = "k", arch: str = "a1") -> HashAttributes:
    return HashAttributes(backend="test", source=f"__kernel void {name}() {{}}", arch=arch,
                          name=name)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def snapshot(directory: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``directory``: size, mtime and content."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns,
                                            p.read_bytes())
            for p in sorted(directory.rglob("*")) if p.is_file()}


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


# -- private by default --------------------------------------------------------------------

def test_every_directory_kdb_creates_is_0700_and_every_file_0600(tmp_path, monkeypatch,
                                                                umask_022):
    root = tmp_path / "deep" / "er" / "cache"  # three parents kdb has to create
    monkeypatch.setenv("KDB_CACHE_DIR", str(root))
    db = KernelDB(use_system=False)
    got = db.tiers.claim_or_wait(attrs("held"))  # a claim, so its lock file exists now
    claims.want(db.user_dir / "claims", attrs("held").key)
    db.get_or_compile(attrs("k"), lambda: BINARY)
    db.flush()
    for d in (tmp_path / "deep", tmp_path / "deep" / "er", root, root / "v1",
              root / "v1" / "claims"):
        assert mode(d) == 0o700, d
    files = [p for p in root.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"a1.kdb", "a1.kdb-wal", "a1.kdb-shm", "a1.kdb.lock",
            f"{attrs('held').key}.lock", f"{attrs('held').key}.want"} <= names, names
    for p in files:
        assert mode(p) == 0o600, p
    got.release()


def test_a_private_dir_keeps_an_existing_parent_as_it_is(tmp_path, umask_022):
    (tmp_path / "shared").mkdir(mode=0o755)
    config.private_dir(tmp_path / "shared" / "mine" / "v1")
    assert mode(tmp_path / "shared") == 0o755  # not kdb's to change
    assert mode(tmp_path / "shared" / "mine") == mode(tmp_path / "shared" / "mine" / "v1") \
        == 0o700


# -- user files others can change are refused ----------------------------------------------

def _stored(cache_dir: Path) -> Path:
    db = KernelDB(use_system=False)
    db.put(attrs("old"), BINARY)
    db.close()
    path = cache_dir / "v1" / "a1.kdb"
    assert {p.name for p in path.parent.iterdir()} == {"a1.kdb", "a1.kdb.lock"}
    return path


def _refused(cache_dir: Path, caplog, why: str) -> None:
    """kdb compiles every kernel, warns once, reads nothing from the file, writes nothing."""
    before = snapshot(cache_dir)
    calls = []
    db = KernelDB(use_system=False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        # The stored kernel is not served from a file that could have been changed.
        assert db.get_or_compile(attrs("old"), lambda: calls.append(1) or b"compiled") \
            == b"compiled"
        assert db.get_or_compile(attrs("new"), lambda: calls.append(1) or b"new") == b"new"
        assert db.put(attrs("put"), b"put") is False
        db.flush()
        db.close()
    assert calls == [1, 1]
    notes = warnings_of(caplog)
    assert len(notes) == 1 and "refused" in notes[0] and why in notes[0], notes
    assert "KDB_CACHE_DIR" in notes[0] and "chmod 700" in notes[0]
    assert snapshot(cache_dir) == before  # not a byte written, no claims, no WAL


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_user_file_owned_by_another_user_is_refused(cache_dir, caplog):
    path = _stored(cache_dir)
    os.chown(path, 65534, 65534)  # nobody
    _refused(cache_dir, caplog, "owned by another user (uid 65534)")


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_user_dir_owned_by_another_user_is_refused(cache_dir, caplog):
    path = _stored(cache_dir)
    os.chown(path.parent, 65534, 65534)
    _refused(cache_dir, caplog, "owned by another user")


def test_a_group_writable_user_file_is_refused(cache_dir, caplog):
    path = _stored(cache_dir)
    path.chmod(0o664)
    _refused(cache_dir, caplog, "group or others can write it")


def test_a_world_writable_user_dir_is_refused(cache_dir, caplog):
    path = _stored(cache_dir)
    path.parent.chmod(0o777)
    _refused(cache_dir, caplog, "group or others can write it")


def test_no_file_is_created_in_a_directory_others_can_write(cache_dir, caplog):
    (cache_dir / "v1").mkdir(parents=True)
    (cache_dir / "v1").chmod(0o770)
    _refused(cache_dir, caplog, "group or others can write it")
    assert list((cache_dir / "v1").iterdir()) == []


def test_a_lock_planted_as_a_link_in_a_claims_directory_others_can_write_writes_nothing(
        cache_dir, tmp_path, caplog):
    """claims/ was never checked, and its lock file was opened through a link: a link
    planted there as ``<key>.lock`` had kdb write its claim state over the file it led to."""
    _stored(cache_dir)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    claims_dir = cache_dir / "v1" / "claims"
    claims_dir.mkdir(exist_ok=True)
    claims_dir.chmod(0o777)
    planted = attrs("planted")
    (claims_dir / f"{planted.key}.lock").symlink_to(victim)
    db = KernelDB(use_system=False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.get_or_compile(planted, lambda: b"compiled") == b"compiled"
        db.close()
    assert victim.read_text() == "precious\n"
    assert any("claims" in n and "group or others can write it" in n
               for n in warnings_of(caplog)), warnings_of(caplog)
    claims_dir.chmod(0o700)  # and in a claims directory of one's own, a link is not followed
    from kdb import claims

    with pytest.raises(OSError):
        claims.try_claim(claims_dir, planted.key)
    assert victim.read_text() == "precious\n"


# -- arch ids ------------------------------------------------------------------------------

UNSAFE = ["../x", "../../etc/passwd", "/abs", "/tmp/x", "A100", "Sm_90", "", ".", "..",
          ".hidden", "a/b", "a\\b", "x\x00y", "sm 90", "gfx90a:xnack-", "ü", "-rf", "_x"]


@pytest.mark.parametrize("arch", UNSAFE)
def test_unsafe_arch_ids_are_rejected_everywhere(arch, cache_dir, tmp_path):
    before = snapshot(tmp_path)
    db = KernelDB(use_system=False)
    with pytest.raises(UnsafeArchError, match="arch id"):
        db.tiers.user_file(arch)
    with pytest.raises(UnsafeArchError):
        db.tiers.system_files(arch)
    with pytest.raises(UnsafeArchError):
        HashAttributes(backend="test", source="kernel", arch=arch)
    with pytest.raises(UnsafeArchError):
        config.check_arch(arch)
    assert snapshot(tmp_path) == before
    assert not (cache_dir / "v1").exists()


@pytest.mark.parametrize("arch", [None, 90, b"sm_90", ["sm_90"]])
def test_arch_ids_must_be_strings(arch):
    with pytest.raises(UnsafeArchError):
        config.check_arch(arch)


@pytest.mark.parametrize("command", [
    ["ls"], ["stats"], ["log"], ["clear", "--yes"], ["verify"], ["verify", "--repair"],
    ["evict", "--to", "1M"],
])
@pytest.mark.parametrize("arch", ["../x", "/abs", "A100"])
def test_cli_rejects_unsafe_arch_ids(command, arch, cache_dir, tmp_path):
    db = KernelDB(use_system=False)
    db.put(attrs(), BINARY)
    db.close()  # its last connection checkpoints now, not during the command
    before = snapshot(tmp_path)
    result = CliRunner().invoke(cli, [*command, "--arch", arch])
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert "arch id" in result.output
    assert snapshot(tmp_path) == before


# -- system files are read-only ------------------------------------------------------------

def _system_file(directory: Path, scratch: Path) -> Path:
    db = KernelDB(cache_dir=scratch, use_system=False)
    db.put(attrs("sys"), BINARY)
    db.close()
    src = scratch / "v1" / "a1.kdb"
    conn = sqlite3.connect(src)
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    directory.mkdir()
    path = directory / "a1.kdb"
    path.write_bytes(src.read_bytes())
    path.chmod(0o444)
    directory.chmod(0o555)
    return path


def _open_modes(path: Path) -> list[int]:
    """The access modes (O_RDONLY, O_RDWR...) of this process's open descriptors of ``path``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != str(path):
                continue
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = int(next(line for line in f if line.startswith("flags:")).split()[1], 8)
        except (OSError, StopIteration):
            continue
        out.append(flags & os.O_ACCMODE)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fdinfo"), reason="needs Linux /proc")
def test_system_files_are_opened_read_only_and_never_change(tmp_path, cache_dir):
    sysdir = tmp_path / "system"
    path = _system_file(sysdir, tmp_path / "scratch")
    before = snapshot(sysdir)
    try:
        db = KernelDB(system_path=[sysdir])
        hit = db.lookup(attrs("sys"))
        assert hit is not None and hit.tier == "system" and hit.binary == BINARY
        assert _open_modes(path) == [os.O_RDONLY]
        db.get_or_compile(attrs("other"), lambda: b"compiled")  # a miss stores...
        db.put(attrs("sys"), b"user copy")  # ...and a put writes, in the user tier only
        db.flush()
        assert _open_modes(path) == [os.O_RDONLY]
        assert set(_open_modes(cache_dir / "v1" / "a1.kdb")) == {os.O_RDWR}  # can fail
        db.close()
        assert snapshot(sysdir) == before
        assert sorted(p.name for p in sysdir.iterdir()) == ["a1.kdb"]  # no journal, no WAL
    finally:
        sysdir.chmod(0o755)


def test_verify_repair_never_touches_a_system_file(tmp_path, cache_dir):
    sysdir = tmp_path / "system"
    path = _system_file(sysdir, tmp_path / "scratch")
    sysdir.chmod(0o755)
    path.chmod(0o644)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE kernels SET blob = substr(blob, 1, 10)")  # a bad entry
    conn.commit()
    conn.close()
    before = snapshot(sysdir)
    result = CliRunner().invoke(cli, ["verify", "--repair", "--json"],
                                env={"KDB_SYSTEM_DB_PATH": str(sysdir)})
    assert result.exit_code == 1  # still wrong: repair does not fix system files
    assert snapshot(sysdir) == before


# -- a cache another user can write: no store worker, no job (issue 19, defect 3) -----------

RUNUSER = "/usr/sbin/runuser"
needs_another_user = pytest.mark.skipif(
    not (hasattr(os, "getuid") and os.getuid() == 0 and os.access(RUNUSER, os.X_OK)),
    reason="acting as user nobody needs root and /usr/sbin/runuser")

#: Run as the other user (sh: their Python may be out of their reach): a planted executable
#: and a PYTHONPATH whose sitecustomize runs in any Python started with it, each touching the
#: marker; a spool naming them, with a job.
PLANT = r"""
set -e
root=$1 evil=$2 marker=$3
mkdir -p "$evil" "$root/v1/spool/x"
printf '#!/bin/sh\ntouch %s\n' "$marker" > "$evil/python"
chmod 755 "$evil/python"
printf 'open(%s, "a").close()\n' "'$marker'" > "$evil/sitecustomize.py"
printf '{"executable": "%s/python", "variables": [["PYTHONPATH", "%s"], ["LD_LIBRARY_PATH", "%s"]]}' \
    "$evil" "$evil" "$evil" > "$root/v1/spool/x/environment.json"
printf '{"kind": "store", "backend": "opencl", "entries": []}' \
    > "$root/v1/spool/x/00000000000000000001-1-1.job"
"""

#: The victim's program: pyopencl through kdb.opencl.install(), its answer on stdout.
TWICE = """
import numpy as np, pyopencl as cl, kdb.opencl
kdb.opencl.install()
plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1])
queue = cl.CommandQueue(ctx)
prg = cl.Program(ctx, "__kernel void twice(__global int *a) "
                      "{ int i = get_global_id(0); a[i] = 2 * i; }").build()
a = np.zeros(8, np.int32)
buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, a.nbytes)
prg.twice(queue, a.shape, None, buf)
cl.enqueue_copy(queue, a, buf)
print(a.tolist())
"""
TWICE_ANSWER = str([2 * i for i in range(8)])


@pytest.fixture
def open_dir():
    """A directory anyone may create in, as /tmp (pytest's own tmp_path is private)."""
    d = Path(tempfile.mkdtemp(prefix="kdb-open-", dir="/tmp"))
    d.chmod(0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(*cmd: str) -> None:
    subprocess.run([RUNUSER, "-u", "nobody", "--", *cmd], check=True, timeout=60)


def plant(root: Path, open_dir: Path) -> Path:
    """The other user's cache root with a spool naming their executable; the marker path."""
    marker = open_dir / "planted-code-ran"
    as_nobody("/bin/sh", "-c", PLANT, "plant", str(root), str(open_dir / "evil"), str(marker))
    assert (root / "v1").stat().st_uid == 65534
    return marker


def never_ran(marker: Path, seconds: float = 4.0) -> None:
    """A store worker starts at once and runs after a job's MIN_AGE_S: give it the time."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert not marker.exists(), "code planted by another user ran"
        time.sleep(0.1)


def victim_env(root: Path, **more: str) -> dict[str, str]:
    return {"KDB_CACHE_DIR": str(root), "KDB_STORE_AT_EXIT": "detach", **more}


@needs_another_user
def test_a_program_never_runs_a_spool_another_user_planted(open_dir, run_py):
    """With the shared tier set, a miss used to spool into the other user's cache and start
    the worker of every spool there: with their executable, or their PYTHONPATH."""
    pytest.importorskip("pyopencl")
    root = open_dir / "kdb"
    marker = plant(root, open_dir)
    url = "postgresql+psycopg://kdb@127.0.0.1:9/kdb"  # nothing listens: the tier is off
    proc = run_py(TWICE, env=victim_env(root, KDB_SHARED_URL=url))
    assert proc.stdout.splitlines()[-1] == TWICE_ANSWER
    never_ran(marker)
    assert f"{root} is refused: it is owned by another user (uid 65534)" in proc.stderr, proc.stderr
    assert "KDB_CACHE_DIR to a directory of your own" in proc.stderr
    assert [p.name for p in (root / "v1" / "spool").iterdir()] == ["x"]  # no job written
    assert not (root / "v1" / "spool" / "x" / "worker.lock").exists()


@needs_another_user
def test_pack_from_log_never_runs_a_spool_another_user_planted(open_dir):
    """``kdb pack --from-log`` waits for the spool's jobs, starting their worker: it ran the
    other user's executable over and over, and waited its full 900 s."""
    pytest.importorskip("pyopencl")
    root = open_dir / "kdb"
    marker = plant(root, open_dir)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kdb.cli", "pack", "--arch", "native",
                           "--from-log", "--out", str(open_dir / "out")],
                          env={**os.environ, **victim_env(root)}, capture_output=True,
                          text=True, timeout=300)
    assert time.monotonic() - start < 120, proc.stdout + proc.stderr
    never_ran(marker)
    assert "is refused" in proc.stderr and str(root / "v1") in proc.stderr, proc.stderr


@needs_another_user
def test_a_cache_root_another_user_created_is_refused(open_dir, run_py):
    """They only made the directory (others can rename what the victim creates in it)."""
    pytest.importorskip("pyopencl")
    root = open_dir / "kdb"
    as_nobody("mkdir", "-m", "0777", str(root))
    proc = run_py(TWICE, env=victim_env(root, KDB_SHARED_URL="postgresql+psycopg://kdb@127."
                                                             "0.0.1:9/kdb"))
    assert proc.stdout.splitlines()[-1] == TWICE_ANSWER
    assert f"{root} is refused: it is owned by another user (uid 65534)" in proc.stderr
    assert not (root / "v1" / "spool").exists()  # no spool, no job


def test_a_spool_group_or_others_can_write_starts_no_worker(cache_dir, tmp_path, caplog):
    """Our own spool, made writable by others: its environment.json's executable and
    variables are never used, its jobs never read. (Without runuser: only the bits.)"""
    from kdb.storing import spool

    marker = tmp_path / "ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "python").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (evil / "python").chmod(0o755)
    d = config.private_dir(cache_dir / "v1" / "spool" / "x")
    (d / "environment.json").write_text(json.dumps({"executable": str(evil / "python"),
                                                    "variables": []}))
    (d / "environment.json").chmod(0o600)
    job = d / "00000000000000000001-1-1.job"
    job.write_text(json.dumps({"entries": [], "logs": [["row"]]}))
    job.chmod(0o600)
    d.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        spool.ensure_worker(d)
        assert spool.read_job(job) is None
        assert spool.pending_log_rows(cache_dir / "v1") == []
        assert spool.wait(cache_dir / "v1", 30) == 0  # nothing to wait for: refused
    never_ran(marker, 1.0)
    assert not (d / "worker.lock").exists()
    notes = warnings_of(caplog)
    assert len(notes) == 1 and f"{d} is refused: group or others can write it" in notes[0]
    d.chmod(0o700)
    (d / "environment.json").chmod(0o666)  # the file alone
    faults.reset()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        spool.ensure_worker(d)
    never_ran(marker, 1.0)
    assert f"{d / 'environment.json'} is refused" in caplog.text
    assert spool.read_job(job) == {"entries": [], "logs": [["row"]]}  # the job itself is ours


def test_the_worker_never_applies_a_spool_others_can_write(cache_dir, tmp_path):
    """Started by hand on such a spool, the worker stores nothing and applies none of its
    variables: a PYTHONPATH there would run code in every store it starts."""
    marker = tmp_path / "ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'a').close()\n")
    d = config.private_dir(cache_dir / "v1" / "spool" / "x")
    (d / "environment.json").write_text(json.dumps({"executable": sys.executable,
                                                    "variables": [["PYTHONPATH", str(evil)]]}))
    (d / "00000000000000000001-1-1.job").write_text(json.dumps({"kind": "store"}))
    for p in d.iterdir():
        p.chmod(0o600)
    d.chmod(0o770)
    proc = subprocess.run([sys.executable, "-m", "kdb.worker", str(d)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "refused" in proc.stderr and not marker.exists()


def test_the_store_worker_is_always_this_python(cache_dir, tmp_path):
    """environment.json names the Python its jobs were written with; a worker is started
    with this process's own, and only for this Python's spools, never with a path read."""
    from kdb.storing import spool

    marker = tmp_path / "ran"
    other = tmp_path / "python"
    other.write_text(f"#!/bin/sh\ntouch {marker}\n")
    other.chmod(0o755)
    d = config.private_dir(cache_dir / "v1" / "spool" / "x")
    (d / "environment.json").write_text(json.dumps({"executable": str(other),
                                                    "variables": []}))
    (d / "environment.json").chmod(0o600)
    spool.ensure_worker(d)
    never_ran(marker, 1.0)
    assert not (d / "worker.lock").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_can_store_is_false_where_the_user_dir_is_refused_even_with_a_shared_tier(
        cache_dir, monkeypatch, caplog):
    db = KernelDB(use_system=False)
    db.put(attrs("old"), BINARY)
    db.close()
    os.chown(cache_dir / "v1", 65534, 65534)
    monkeypatch.setenv("KDB_SHARED_URL", "postgresql+psycopg://kdb@127.0.0.1:9/kdb")
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db = KernelDB()  # the shared tier is consulted with the system tier
        assert db.tiers._shared() is not None
        assert db.tiers.storing.can_store("a1") is False
        assert db.tiers.claim_or_wait(attrs("new")) is None  # no claim file in their directory
    assert "owned by another user" in caplog.text
    assert not (cache_dir / "v1" / "claims").exists()


def test_can_store_is_false_under_a_cache_root_others_can_write(cache_dir, caplog):
    db = KernelDB(use_system=False)
    db.put(attrs("old"), BINARY)
    db.close()
    cache_dir.chmod(0o777)  # others could rename v1 away and put their own in its place
    db = KernelDB(use_system=False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert db.tiers.storing.can_store("a1") is False
        assert db.put(attrs("put"), BINARY) is False
    notes = warnings_of(caplog)
    assert len(notes) == 1 and f"{cache_dir} is refused" in notes[0], notes


# -- every open is checked: a new thread, a forked child (issue 27) -------------------------

needs_root = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                                reason="chown to another user needs root")


def _cache_holding(root: Path, binary: bytes) -> Path:
    """A cache at ``root`` whose user file holds ``binary`` under ``attrs("k")``; that file."""
    db = KernelDB(cache_dir=root, use_system=False)
    assert db.put(attrs("k"), binary)
    db.close()
    return root / "v1" / "a1.kdb"


def _system_dir_holding(where: Path, binary: bytes) -> Path:
    """A system directory at ``where`` whose ``a1.kdb`` serves ``binary`` for ``attrs("k")``."""
    from kdb.pack.systemfile import write_system_db

    where.mkdir(mode=0o755)
    write_system_db(where / "a1.kdb", "a1", [_cache_holding(where.parent / (where.name + "-src"),
                                                            binary)])
    return where


def _theirs(path: Path) -> None:
    """Everything at and under ``path`` now belongs to the other user (uid 65534)."""
    for p in [path, *path.rglob("*")]:
        os.lchown(p, 65534, 65534)


def _in_a_thread_and_a_child(db: KernelDB) -> tuple[bytes | None, bytes | None]:
    """What a lookup of ``attrs("k")`` serves in a new thread, and in a forked child."""
    import threading

    got = []
    t = threading.Thread(target=lambda: got.append(db.lookup(attrs("k"))))
    t.start()
    t.join()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one lookup, its answer down the pipe
        try:
            hit = db.lookup(attrs("k"))
            os.write(w, b"-" if hit is None else b"+" + hit.binary)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read()
    os.waitpid(pid, 0)
    return (None if got[0] is None else got[0].binary,
            None if answer == b"-" else answer[1:])


@needs_root
@pytest.mark.parametrize("tier", ["user", "system"])
@pytest.mark.parametrize("swap", ["rename", "symlink"])
def test_a_tier_swapped_after_the_first_lookup_is_never_served_to_a_thread_or_a_child(
        tmp_path, tier, swap, caplog):
    """Its trust was checked once per process: a new thread's connection, or a forked
    child's, reopened the path unchecked, and served what the other user had put there."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    if tier == "user":
        place = shared / "cache"
        _cache_holding(place, BINARY)
        db = KernelDB(cache_dir=place, use_system=False)
    else:
        place = _system_dir_holding(shared / "system", BINARY)
        db = KernelDB(cache_dir=tmp_path / "cache", system_path=place)
    assert db.lookup(attrs("k")).binary == BINARY  # this thread's connection is open
    # The other user gets the directory above (theirs, and anyone's) and swaps in their own.
    os.chown(shared, 65534, 65534)
    shared.chmod(0o777)
    os.rename(place, shared / "old")
    theirs = tmp_path / "theirs"
    if tier == "user":
        _cache_holding(theirs, b"PLANTED")
    else:
        _system_dir_holding(theirs, b"PLANTED")
    _theirs(theirs)
    if swap == "rename":
        os.rename(theirs, place)
    else:
        place.symlink_to(theirs)
        os.lchown(place, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert _in_a_thread_and_a_child(db) == (None, None)
    assert "refused" in caplog.text, caplog.text
    assert db.lookup(attrs("k")).binary == BINARY  # the connection opened before: the old file


@pytest.mark.parametrize("tier", ["user", "user file as a link", "system"])
def test_a_tier_under_a_directory_others_can_write_is_refused(tmp_path, tier, caplog):
    """Its files and directories are private, but anyone could rename it away and put theirs
    in its place between two opens; under a sticky directory (/tmp) only its owner could.
    A file that is a link is judged where it leads."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    if tier == "user":
        _cache_holding(shared / "cache", BINARY)
        args = {"cache_dir": shared / "cache", "use_system": False}
    elif tier == "user file as a link":
        user_file = _cache_holding(tmp_path / "cache", BINARY)
        user_file.rename(shared / "a1.kdb")
        user_file.symlink_to(shared / "a1.kdb")
        args = {"cache_dir": tmp_path / "cache", "use_system": False}
    else:
        args = {"cache_dir": tmp_path / "cache",
                "system_path": _system_dir_holding(shared / "system", BINARY)}
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db = KernelDB(**args)
        assert db.lookup(attrs("k")) is None
        assert tier == "system" or db.put(attrs("new"), BINARY) is False
    notes = [n for n in warnings_of(caplog) if "no system kernel database" not in n]
    assert len(notes) == 1 and f"{shared}: group or others can write it" in notes[0] \
        or f"{shared} is refused: group or others can write it" in notes[0], notes
    shared.chmod(0o1777)
    faults.reset()
    assert KernelDB(**args).lookup(attrs("k")).binary == BINARY


def test_a_spool_of_this_python_under_another_name_is_run(cache_dir, tmp_path, monkeypatch):
    """``python`` and ``python3`` of one environment are one Python (a ``kdb`` command and
    the program it packs for may spell it differently); another directory's is not."""
    from kdb.storing import spool

    for env in ("one", "two"):
        (tmp_path / env).mkdir()
        (tmp_path / env / "python3").symlink_to(sys.executable)
        (tmp_path / env / "python").symlink_to("python3")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "one" / "python"))
    d = config.private_dir(cache_dir / "v1" / "spool" / "x")
    for exe, runs in (("one/python3", True), ("two/python", False), ("two/python3", False)):
        (d / "environment.json").write_text(json.dumps({"executable": str(tmp_path / exe),
                                                        "variables": []}))
        (d / "environment.json").chmod(0o600)
        assert spool.runnable(d) is runs, exe

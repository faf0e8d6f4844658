"""A kernel cache holds code the process will run: who may write it, where it may write.

Private directories and files; a user database someone else could change is refused;
arch ids cannot steer a write outside the cache; system files are never opened writable.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdb import HashAttributes, KernelDB, UnsafeArchError, claims, config
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
    got = db.claim_or_wait(attrs("held"))  # a claim, so its lock file exists now
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


# -- arch ids ------------------------------------------------------------------------------

UNSAFE = ["../x", "../../etc/passwd", "/abs", "/tmp/x", "A100", "Sm_90", "", ".", "..",
          ".hidden", "a/b", "a\\b", "x\x00y", "sm 90", "gfx90a:xnack-", "ü", "-rf", "_x"]


@pytest.mark.parametrize("arch", UNSAFE)
def test_unsafe_arch_ids_are_rejected_everywhere(arch, cache_dir, tmp_path):
    before = snapshot(tmp_path)
    db = KernelDB(use_system=False)
    with pytest.raises(UnsafeArchError, match="arch id"):
        db.user_file(arch)
    with pytest.raises(UnsafeArchError):
        db.system_files(arch)
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

"""What kdb leaves behind, and where: one spool per environment (not per ``kdb run``),
``kdb clear`` taking spool leftovers and stale claim files, claim files ending with their
process, and a cache that never lands at ``/.cache`` when ``HOME`` is unset or empty."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest
from click.testing import CliRunner

from kdb import dirs, logs
from kdb.storing import spool
from kdb.cli import cli

BUILD = """
import pyopencl as cl
import kdb.opencl
kdb.opencl.install()
plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1])
cl.Program(ctx, "__kernel void k{0}(__global int *a) {{ a[0] = {0}; }}").build()
"""


def build_one(n: int = 0) -> str:
    """A program building kernel ``k<n>`` through install()."""
    return BUILD.format(n)

#: Holds an exclusive flock on argv[1] until stdin closes (another live process).
HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def _hold(path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# -- one spool per environment -------------------------------------------------------------

def test_the_run_report_does_not_make_a_spool_per_run(tmp_path):
    base = {"PATH": "/bin", "POCL_DEVICES": "cpu"}
    one = spool.spool_dir(tmp_path, {**base, "KDB_RUN_REPORT": str(tmp_path / "run1")})
    two = spool.spool_dir(tmp_path, {**base, "KDB_RUN_REPORT": str(tmp_path / "run2")})
    plain = spool.spool_dir(tmp_path, {**base, "KDB_AUTO": "1"})
    assert one == two == plain == spool.spool_dir(tmp_path, base)
    assert spool.spool_dir(tmp_path, {**base, "POCL_DEVICES": "pthread"}) != one


def test_two_runs_with_their_own_reports_share_one_spool(cache_dir, run_py, tmp_path):
    pytest.importorskip("pyopencl")
    for i in range(2):
        run_py(build_one(i), env={"KDB_RUN_REPORT": str(tmp_path / f"report{i}"),
                                  "KDB_STORE_AT_EXIT": "detach",
                                  "POCL_CACHE_DIR": str(tmp_path / "pocl")})
    spools = [p.name for p in (cache_dir / "v1" / "spool").iterdir()]
    assert len(spools) == 1, spools


# -- kdb clear -------------------------------------------------------------------------------

def test_clear_removes_spool_leftovers_and_stale_claims_but_not_live_ones(cache_dir):
    user = cache_dir / "v1"
    idle = user / "spool" / ("0" * 16)
    busy = user / "spool" / ("1" * 16)
    claims = user / "claims"
    for d in (idle, busy, claims):
        d.mkdir(parents=True, mode=0o700)
    for d in (idle, busy):
        (d / "environment.json").write_text("{}")
        (d / "1-2-3.job").write_text("{}")
        (d / "1-2-4.taken").write_text("{}")
    (idle / "worker.lock").write_text("")
    dead_pid = 4194304 + 7  # above Linux's largest pid
    (idle / f".1-2-5.job.{dead_pid}.tmp").write_text("{")
    (idle / f".1-2-6.job.{os.getpid()}.tmp").write_text("{")  # a live writer's
    (claims / "stale.lock").write_text("pending 1 0.1 0\n")
    (claims / "stale.want").write_text("")
    (claims / "orphan.want").write_text("")
    workers = [_hold(busy / "worker.lock"), _hold(claims / "live.lock")]
    try:
        result = CliRunner().invoke(cli, ["clear", "--yes"])
        assert result.exit_code == 0, result.output
        assert not (claims / "stale.lock").exists() and not (claims / "stale.want").exists()
        assert not (claims / "orphan.want").exists()
        assert (claims / "live.lock").exists()  # its holder runs
        # Just written to: a process may be starting its worker there.
        assert sorted(p.name for p in idle.iterdir()) == [
            f".1-2-6.job.{os.getpid()}.tmp", "environment.json", "worker.lock"]
        assert sorted(p.name for p in busy.iterdir()) == ["environment.json", "worker.lock"]
        (idle / f".1-2-6.job.{os.getpid()}.tmp").unlink()
        past = time.time() - 120
        os.utime(idle, (past, past))
        assert CliRunner().invoke(cli, ["clear", "--yes"]).exit_code == 0
        assert not idle.exists()  # an empty spool no worker uses, unwritten for a while
        assert sorted(p.name for p in busy.iterdir()) == ["environment.json", "worker.lock"]
    finally:
        for w in workers:
            w.communicate("")


def test_claim_files_end_with_their_process(cache_dir, run_py):
    """A process that exits with its store still queued leaves no claim file behind; the
    marks naming its jobs (``<key>.queued``) go once the jobs are stored."""
    pytest.importorskip("pyopencl")
    for i in range(3):
        run_py(build_one(i), env={"KDB_STORE_AT_EXIT": "detach"}).check_returncode()
    claims = cache_dir / "v1" / "claims"
    left = sorted(p.name for p in claims.glob("*") if not p.name.endswith(".queued"))
    assert left == [], left
    deadline = time.monotonic() + 120
    while spool.jobs(cache_dir / "v1") or any(claims.glob("*")):
        assert time.monotonic() < deadline, sorted(p.name for p in claims.glob("*"))
        time.sleep(0.1)


# -- HOME unset or empty -----------------------------------------------------------------------

@pytest.mark.parametrize("home", ["", "/", "relative"])
def test_no_usable_home_gets_a_private_dir_under_tmp_and_one_warning(tmp_path, home):
    pytest.importorskip("pyopencl")
    env = {k: v for k, v in os.environ.items() if k not in ("KDB_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(HOME=home, TMPDIR=str(tmp_path), KDB_STORE_AT_EXIT="wait",
               PYOPENCL_NO_CACHE="1", POCL_CACHE_DIR=str(tmp_path / "pocl"))
    work = tmp_path / "work"  # where a relative cache would land
    work.mkdir()
    proc = subprocess.run([sys.executable, "-c", build_one()], env=env, cwd=work,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "HOME" in line]
    private = tmp_path / f"kdb-{os.getuid()}"
    assert len(notes) == 1 and str(private) in notes[0] and repr(home) in notes[0], notes
    assert list((private / ".cache" / "kdb" / "v1").glob("*.kdb")), proc.stderr
    assert private.stat().st_mode & 0o777 == 0o700
    assert not list(work.iterdir())


def test_a_planted_stand_in_home_is_not_used(tmp_path, monkeypatch, caplog):
    planted = tmp_path / f"kdb-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("HOME", "")
    monkeypatch.setattr(dirs, "_stand_ins", {})
    logs.forget_once()
    got = dirs.home()
    assert got != str(planted) and got.startswith(str(tmp_path))
    st = os.stat(got)
    assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
    assert dirs.home() == got  # once per process


def test_a_home_is_used_as_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert dirs.home() == str(tmp_path)
    monkeypatch.delenv("HOME")
    assert dirs.home() == os.path.expanduser("~")

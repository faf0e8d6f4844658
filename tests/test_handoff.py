"""KDB_STORE_AT_EXIT=detach (the default): an exiting process hands its OpenCL stores, with
their claims, to a detached process and exits at once; what it compiled is stored after it.

Real processes, real PoCL builds, real flocks. The rest of the suite runs with ``wait``
(conftest), so that a test reads what a child stored as soon as the child has exited.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from pathlib import Path

import pytest

from kdb import ConfigError, HashAttributes, KernelDB, claims, config, handoff
from conftest import sql

pytest.importorskip("pyopencl")

ARCH = "pocl-x86_64-znver3"

BUILD = """
    import json, sys
    import pyopencl as cl
    import kdb.opencl, kdb.latency
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    for i in range({n}):
        kdb.opencl.build(ctx, f"__kernel void h{{i}}(__global float *a) {{{{ a[0] = {{i}}; }}}}")
    print(json.dumps({{"compiles": len(kdb.latency.records())}}))
"""


def user_file(cache: Path) -> Path:
    return cache / "v1" / f"{ARCH}.kdb"


def wait_for_worker(cache: Path, timeout: float = 120) -> None:
    """Until the detached process is done: its spec read and every claim it held released."""
    v1 = cache / "v1"
    deadline = time.monotonic() + timeout
    while list(v1.glob(".handoff-*.json")) or list((v1 / "claims").glob("*.lock")):
        assert time.monotonic() < deadline, "the detached store never finished"
        time.sleep(0.05)


def stored(cache: Path) -> int:
    f = user_file(cache)
    return sql(f, "SELECT count(*) FROM kernels")[0][0] if f.exists() else 0


def test_an_exiting_process_leaves_its_stores_to_a_detached_process(cache_dir, run_py):
    import json

    detach = {"KDB_STORE_AT_EXIT": "detach"}
    out = json.loads(run_py(BUILD.format(n=3), env=detach).stdout.splitlines()[-1])
    assert out["compiles"] == 3
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 3
    # The exiting process wrote nothing itself: its latency log came through the worker.
    assert sql(user_file(cache_dir), "SELECT count(*) FROM compile_log")[0][0] == 3
    assert dict(sql(user_file(cache_dir), "SELECT name, value FROM counters"))["compiles"] == 3
    log = cache_dir / "v1" / handoff.LOG_NAME
    assert log.read_text() == ""
    assert log.stat().st_mode & 0o077 == 0
    again = json.loads(run_py(BUILD.format(n=3), env=detach).stdout.splitlines()[-1])
    assert again["compiles"] == 0


def test_a_process_started_meanwhile_waits_for_the_detached_store(cache_dir, run_py):
    """The detached process inherits the claims: the next process waits for the entries
    instead of compiling them again."""
    import json

    detach = {"KDB_STORE_AT_EXIT": "detach"}
    first = json.loads(run_py(BUILD.format(n=4), env=detach).stdout.splitlines()[-1])
    second = json.loads(run_py(BUILD.format(n=4), env=detach).stdout.splitlines()[-1])
    assert (first["compiles"], second["compiles"]) == (4, 0)
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 4


def test_a_failed_detached_store_reports_and_releases_its_claims(cache_dir, tmp_path):
    """A program the detached process cannot build again (its platform is gone) is
    reported in its log, and its claim is released so that others compile it."""
    db = KernelDB()
    attrs = HashAttributes(backend="opencl", source="__kernel void gone() {}", arch=ARCH,
                           name="gone")
    claim_dir = db.user_dir / "claims"
    claim = claims.try_claim(claim_dir, attrs.key)
    assert claim is not None
    program = {"source": attrs.source, "options": "", "platform": "No Such Platform",
               "devices": [["cpu", 0]], "cwd": str(tmp_path)}
    handoff.start([handoff.Redo(db, program, 0, attrs, 0.5, None, claim)])
    assert not claims.held_here(attrs.key)  # handed over, not released
    wait_for_worker(db.cache_root)
    text = (db.user_dir / handoff.LOG_NAME).read_text()
    assert "gone" in text and "No Such Platform" in text
    assert not (claim_dir / f"{attrs.key}.lock").exists()
    again = claims.try_claim(claim_dir, attrs.key)
    assert again is not None
    again.release()


def test_store_at_exit_setting(monkeypatch):
    monkeypatch.delenv("KDB_STORE_AT_EXIT", raising=False)
    assert config.store_at_exit() == "detach"
    monkeypatch.setenv("KDB_STORE_AT_EXIT", " Wait ")
    assert config.store_at_exit() == "wait"
    monkeypatch.setenv("KDB_STORE_AT_EXIT", "later")
    assert config.store_at_exit() == "wait"  # warned once; storing before exit needs no one
    with pytest.raises(ConfigError, match="KDB_STORE_AT_EXIT='later'.*detach, wait"):
        config.store_at_exit("later")  # an explicit value is the caller's mistake


def test_a_bad_setting_stores_before_exit_with_a_warning(cache_dir, run_py):
    proc = run_py(BUILD.format(n=1), env={"KDB_STORE_AT_EXIT": "later"})
    assert "KDB_STORE_AT_EXIT='later'" in proc.stderr and "storing before exit" in proc.stderr
    assert stored(cache_dir) == 1  # stored by the process itself, before it exited


def test_a_claim_handed_over_outlives_its_process(tmp_path, run_py):
    """The mechanism the detached store relies on: a flock held through an inherited
    descriptor stays held after the process that took it exits."""
    code = f"""
        import subprocess, sys
        from pathlib import Path
        from kdb import claims
        c = claims.try_claim(Path({str(tmp_path)!r}), "k")
        fd = c.hand_over()
        heir = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                pass_fds=[fd], start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(heir.pid)
    """
    heir = int(run_py(code).stdout.split()[-1])
    fd = os.open(tmp_path / "k.lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.kill(heir, signal.SIGKILL)  # the last holder gone: the kernel releases the lock
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    finally:
        os.close(fd)


def test_only_a_python_executable_is_started(monkeypatch):
    """In an application that embeds Python, or a frozen one, sys.executable is the
    application: starting it with -m kdb.handoff would start the application again."""
    monkeypatch.setattr("sys.executable", "/usr/bin/python3.11")
    assert handoff.can_detach()
    for exe in ("/opt/app/bin/mysim", ""):
        monkeypatch.setattr("sys.executable", exe)
        assert not handoff.can_detach()
    monkeypatch.setattr("sys.executable", "/usr/bin/python3")
    monkeypatch.setattr("sys.frozen", True, raising=False)
    assert not handoff.can_detach()


def test_a_build_under_a_deleted_working_directory_is_served(cache_dir, run_py, tmp_path):
    """os.getcwd() fails there: the build still works (no detached store is described
    for it; it is stored before exit) and so does the system-database lookup."""
    gone = tmp_path / "gone"
    code = BUILD.format(n=2).replace(
        "import json, sys", f"import json, os, sys\n    os.mkdir({str(gone)!r}); "
                            f"os.chdir({str(gone)!r}); os.rmdir({str(gone)!r})")
    import json

    out = json.loads(run_py(code, env={"KDB_STORE_AT_EXIT": "detach"}).stdout.splitlines()[-1])
    assert out["compiles"] == 2
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 2

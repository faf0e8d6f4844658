"""The store worker (``KDB_STORE_AT_EXIT=detach``, the default): a process that compiled
writes a job and goes on; one low-priority worker stores it. (The next process waiting for
a queued store when that is cheaper than compiling: tests/test_queued.py.)

Real processes, real PoCL builds, real flocks. The rest of the suite runs with ``wait``
(conftest), so that a test reads what a child stored as soon as the child has exited.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdb import ConfigError, HashAttributes, KernelDB, claims, config
from kdb.storing import spool
from kdb.cli import cli
from conftest import no_store_worker, sql

cl = pytest.importorskip("pyopencl")


def _pocl_arch() -> str:
    """The arch of the PoCL CPU device here (the user file the children write)."""
    import kdb.opencl

    for plat in cl.get_platforms():
        if "Portable" in plat.name:
            return kdb.opencl.arch_of(plat.get_devices()[0])
    return "pocl-x86_64-znver3"


ARCH = _pocl_arch()
DETACH = {"KDB_STORE_AT_EXIT": "detach"}

BUILD = """
    import json, sys, time
    import pyopencl as cl
    import kdb.opencl, kdb.bookkeeping
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    start = time.perf_counter()
    for i in range({n}):
        kdb.opencl.build(ctx, f"__kernel void h{{i}}(__global float *a) {{{{ a[0] = {{i}}; }}}}")
    print(json.dumps({{"compiles": len(kdb.bookkeeping.records()),
                       "build_s": time.perf_counter() - start}}))
"""


def user_file(cache: Path) -> Path:
    return cache / "v1" / f"{ARCH}.kdb"


def stored(cache: Path) -> int:
    """Entries in the user file (0 before it exists, or while its tables are being made)."""
    f = user_file(cache)
    try:
        return sql(f, "SELECT count(*) FROM kernels")[0][0] if f.exists() else 0
    except sqlite3.OperationalError as err:
        if "no such table" not in str(err):
            raise
        return 0


def wait_for_worker(cache: Path, timeout: float = 300) -> None:
    """Until the spool is empty and no worker runs (beside CPU hogs only the floor lane,
    a tenth of one core, may store: minutes for a few jobs)."""
    v1 = cache / "v1"
    deadline = time.monotonic() + timeout
    while spool.jobs(v1) or any(spool.worker_running(d) for d in (v1 / "spool").glob("*")):
        assert time.monotonic() < deadline, "the store worker never finished"
        time.sleep(0.05)


def run_json(run_py, code: str, env=None) -> dict:
    return json.loads(run_py(code, env={**DETACH, **(env or {})}).stdout.splitlines()[-1])


def test_a_process_leaves_its_stores_to_the_worker_and_exits_at_once(cache_dir, run_py):
    out = run_json(run_py, BUILD.format(n=3))
    assert out["compiles"] == 3
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 3
    # The process wrote nothing itself: its latency log and counters came through the worker.
    assert sql(user_file(cache_dir), "SELECT count(*) FROM compile_log")[0][0] == 3
    assert dict(sql(user_file(cache_dir), "SELECT name, value FROM counters"))["compiles"] == 3
    log = cache_dir / "v1" / spool.LOG_NAME
    # On a busy machine the floor lane may store a job a starved lane held, or leave one an
    # early entry serves to idle CPU: said, not wrong.
    assert [line for line in log.read_text().splitlines()
            if not line.endswith(("handed to the floor lane",
                                  "an early entry serves it; left to idle CPU"))] == []
    assert log.stat().st_mode & 0o077 == 0
    assert run_json(run_py, BUILD.format(n=3))["compiles"] == 0


class HeldWorker:
    """The store worker's lock of the spool a process run with ``env`` writes its jobs to,
    taken by this test before that process starts: no worker starts, and its jobs stay
    queued however long it runs, as a worker stopped before it took any would leave them.
    (Stopped only after the process exits, a worker may have stored the oldest already: a job
    a second old is its to take, and a process of several compiles outlasts that.)"""

    def __init__(self, cache: Path, env: dict | None = None) -> None:
        import fcntl

        from kdb.config import private_dir

        self.spool = spool.spool_dir(cache / "v1", {**os.environ, **DETACH, **(env or {})})
        private_dir(self.spool)
        self.fd: int | None = os.open(self.spool / spool.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def release(self, start: bool = True) -> None:
        """Let go of the lock and (``start``) start the spool's worker, as its next job would:
        else the jobs wait for the next process (as a killed worker leaves them)."""
        if self.fd is None:
            return
        os.close(self.fd)
        self.fd = None
        if start and spool.exists_any(self.spool):
            spool.ensure_worker(self.spool)


def run_held(run_py, cache: Path, code: str, env: dict) -> tuple[dict, HeldWorker]:
    """:func:`run_json` with the store worker held back (:class:`HeldWorker`) before the
    process starts: its jobs are all queued when it returns. ``release()`` the worker.
    ``env`` names ``POCL_CACHE_DIR``: a spool is per its value, and ``run_py`` picks one."""
    assert "POCL_CACHE_DIR" in env
    held = HeldWorker(cache, env)
    try:
        return run_json(run_py, code, env), held
    except BaseException:
        held.release()
        raise


def killed(run_py, cache: Path, code: str, tmp_path: Path) -> None:
    """Run ``code`` with its worker held back, then let go of the worker's lock as a worker
    killed before it stored a job leaves it: the jobs wait for the next process."""
    run_held(run_py, cache, code, {"POCL_CACHE_DIR": str(tmp_path / "pocl-killed")}
             )[1].release(start=False)


def test_a_held_worker_stores_nothing_of_a_process_that_outlasts_a_job_s_age(cache_dir,
                                                                           run_py, tmp_path):
    """The tests that need a process's stores still queued hold its worker back from before
    it starts: stopped only after the process exits, the worker would already have stored
    a job older than ``MIN_AGE_S`` (the cause of a failure seen under load)."""
    from kdb.worker.supervisor import MIN_AGE_S

    code = f"""
        import time
        import pyopencl as cl
        import kdb.opencl
        plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
        ctx = cl.Context(plat.get_devices()[:1])
        kdb.opencl.build(ctx, "__kernel void g0(__global float *a) {{ a[0] = 0; }}")
        time.sleep({MIN_AGE_S + 2})  # g0's job is older than a worker leaves a job
        kdb.opencl.build(ctx, "__kernel void g1(__global float *a) {{ a[0] = 1; }}")
        print("{{}}")
    """
    out, held = run_held(run_py, cache_dir, code, {"POCL_CACHE_DIR": str(tmp_path / "pocl"),
                                                   "KDB_DISABLE_EARLY_STORE": "1"})
    try:
        assert stored(cache_dir) == 0
        assert len([p for p in spool.jobs(cache_dir / "v1") if "bookkeeping" not in p.name]) >= 2
    finally:
        held.release()
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 2


def test_kdb_log_shows_a_run_s_compiles_before_they_are_stored(cache_dir, run_py, tmp_path):
    from click.testing import CliRunner

    _, held = run_held(run_py, cache_dir, BUILD.format(n=2),
                       {"POCL_CACHE_DIR": str(tmp_path / "pocl")})
    try:
        res = CliRunner().invoke(cli, ["log", "--json"])
        assert res.exit_code == 0, res.output
        rows = json.loads(res.output)
        assert len(rows) == 2 and all(r["pending"] for r in rows)
        text = CliRunner().invoke(cli, ["log"]).output
        assert "binary not stored yet" in text
    finally:
        held.release()
    wait_for_worker(cache_dir)
    rows = json.loads(CliRunner().invoke(cli, ["log", "--json"]).output)
    assert len(rows) == 2 and not any(r["pending"] for r in rows)


def _cli_json(*args: str):
    from click.testing import CliRunner

    res = CliRunner().invoke(cli, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_compiles_count_when_they_happen_and_pending_stores_show(cache_dir, run_py):
    """Issue 35: two processes compile the same kernels while no store worker can run
    (nothing is stored, and no user file exists: each hands its counts to the spool at
    exit); kdb stats counts both processes' compiles at once and shows the stores pending,
    and once the worker has stored them, the counts are the same, not doubled."""
    # One spool for both; no early stores, so that the second compiles them again.
    env = {**DETACH, "POCL_CACHE_DIR": str(cache_dir / "pocl"), "KDB_DISABLE_EARLY_STORE": "1"}
    with no_store_worker(cache_dir, env):
        first = run_json(run_py, BUILD.format(n=3), env)["compiles"]
        second = run_json(run_py, BUILD.format(n=3), env)["compiles"]
        assert (first, second) == (3, 3)  # nothing stored: the second compiled them again
        before = _cli_json("stats")
        assert stored(cache_dir) == 0 and before["entries"] == 0
        assert before["compiles"] == before["misses"] == 6
        assert before["arches"][ARCH]["compiles"] == 6 and before["compile_seconds"] > 0
        assert before["pending"]["programs"] == before["pending"]["entries"] == 6
        assert before["pending"]["oldest_seconds"] >= 0
        rows = _cli_json("log")
        assert len(rows) == 6 and all(r["pending"] for r in rows)
        text = CliRunner().invoke(cli, ["stats"]).output
        assert "pending stores: 6 programs (6 entries) queued in the spool, oldest" in text
    assert spool.wait(cache_dir / "v1", 300) == 0
    wait_for_worker(cache_dir)
    after = _cli_json("stats")
    assert stored(cache_dir) == after["entries"] == 3
    assert (after["compiles"], after["misses"]) == (6, 6)
    assert after["compile_seconds"] == pytest.approx(before["compile_seconds"])
    assert after["pending"] == {"programs": 0, "entries": 0, "oldest_seconds": None}
    rows = _cli_json("log")
    assert len(rows) == 6 and not any(r["pending"] for r in rows)
    assert "pending stores: none" in CliRunner().invoke(cli, ["stats"]).output


def test_kdb_pack_from_log_waits_for_pending_stores(cache_dir, run_py, tmp_path):
    run_json(run_py, BUILD.format(n=2))
    proc = subprocess.run([sys.executable, "-m", "kdb.cli", "pack", "--arch", ARCH,
                           "--from-log", "--out", str(tmp_path / "out")],
                          env={**os.environ, "KDB_CACHE_DIR": str(cache_dir)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    packed = tmp_path / "out" / f"{ARCH}.kdb"
    assert sql(packed, "SELECT count(*) FROM kernels")[0][0] == 2


def test_kdb_pack_waits_out_a_locked_user_file_and_packs_every_entry(cache_dir, run_py,
                                                                    tmp_path):
    """``kdb pack`` stores the queued jobs itself first; one whose write found the user file
    locked was dropped (the worker's lanes queue such a job again), and the pack said
    nothing and held fewer entries. It waits for the lock now, as the lanes do."""
    import threading

    run_json(run_py, BUILD.format(n=1))
    wait_for_worker(cache_dir)
    env = {"POCL_CACHE_DIR": str(tmp_path / "pocl")}
    out, held = run_held(run_py, cache_dir, BUILD.format(n=3), env)
    assert out["compiles"] == 2
    hold = sqlite3.connect(user_file(cache_dir), isolation_level=None, timeout=30,
                           check_same_thread=False)
    hold.execute("BEGIN IMMEDIATE")
    done = threading.Timer(8.0, hold.execute, ("ROLLBACK",))
    done.start()
    try:
        proc = subprocess.run([sys.executable, "-m", "kdb.cli", "pack", "--arch", ARCH,
                               "--from-db", "--out", str(tmp_path / "out")],
                              env={**os.environ, **DETACH, **env,
                                   "KDB_CACHE_DIR": str(cache_dir)},
                              capture_output=True, text=True, timeout=300)
    finally:
        done.join()
        hold.close()
        held.release(start=False)
    assert proc.returncode == 0, proc.stderr
    assert sql(tmp_path / "out" / f"{ARCH}.kdb", "SELECT count(*) FROM kernels")[0][0] == 3


def test_a_pending_claim_is_waited_for_at_most_its_compile_time(cache_dir, run_py):
    """A holder alive, its compile done and its store queued: a waiter gives up after about
    the compile's seconds and builds it itself."""
    db = KernelDB()
    attrs = HashAttributes(backend="opencl", source="__kernel void p() {}", arch=ARCH, name="p")
    directory = db.user_dir / "claims"
    code = f"""
        import sys, time
        from pathlib import Path
        from kdb import claims
        c = claims.try_claim(Path({str(directory)!r}), {attrs.key!r})
        c.mark_pending(0.3)
        print("held", flush=True)
        time.sleep(60)
    """
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert claims.holder(directory, attrs.key).state == claims.PENDING
        start = time.monotonic()
        assert db.tiers.claim_or_wait(attrs) is None
        # About 2 s (the pending wait's floor); the holder sleeps 60 s: far short of that,
        # with room for a busy machine (5.3 s beside a CPU hog and a benchmark).
        assert 0.25 <= time.monotonic() - start < 30
    finally:
        holder.kill()
        holder.wait()


def test_a_stuck_holder_is_given_up_on_once_per_process(cache_dir, monkeypatch, caplog):
    """A holder stopped mid-compile: the first key costs the wait bound, the next ones
    nothing, and there is one warning."""
    monkeypatch.setenv("KDB_WAIT_TIMEOUT", "2")
    db = KernelDB()
    keys = [HashAttributes(backend="opencl", source=f"__kernel void s{i}() {{}}", arch=ARCH,
                           name=f"s{i}") for i in range(3)]
    directory = db.user_dir / "claims"
    code = f"""
        import os, signal, time
        from pathlib import Path
        from kdb import claims
        held = [claims.try_claim(Path({str(directory)!r}), k) for k in {[a.key for a in keys]!r}]
        print("held", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    """
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        got = [db.tiers.claim_or_wait(a) for a in keys]
        took = time.monotonic() - start
        assert got == [None, None, None]
        assert 1 <= took < 5.5, took  # a wait per key: 6 s and more; room for a busy machine
        assert sum("waited" in r.getMessage() for r in caplog.records) == 1
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_worker_loses_nothing(cache_dir, run_py, tmp_path):
    """Jobs are files: a worker killed mid-way leaves them, and the next process that
    writes a job starts a new worker that stores them all."""
    killed(run_py, cache_dir, BUILD.format(n=2), tmp_path)
    assert len([p for p in spool.jobs(cache_dir / "v1") if "bookkeeping" not in p.name]) >= 2
    code = BUILD.format(n=3)  # h0, h1 compile again (not stored), h2 is new
    run_json(run_py, code)
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 3


def test_a_store_locked_out_by_another_connection_is_queued_again(cache_dir, run_py):
    """A ``sqlite3`` session holding the user file's write lock past SQLite's busy timeout
    failed every store the worker tried meanwhile, and those jobs were dropped: the next
    run compiled them all again. They are queued again, and stored once the lock is gone."""
    run_json(run_py, BUILD.format(n=1))
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 1
    hold = sqlite3.connect(user_file(cache_dir), isolation_level=None, timeout=30)
    hold.execute("BEGIN IMMEDIATE")
    try:
        assert run_json(run_py, BUILD.format(n=3))["compiles"] == 2
        log = cache_dir / "v1" / spool.LOG_NAME
        deadline = time.monotonic() + 120
        while "queued again" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "no store was tried under the lock"
            time.sleep(0.2)
    finally:
        hold.execute("ROLLBACK")
        hold.close()
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 3
    assert "locked by another connection" in log.read_text()
    assert run_json(run_py, BUILD.format(n=3))["compiles"] == 0


def test_a_slow_store_is_set_aside_and_done_when_idle(cache_dir, run_py, tmp_path):
    """A store that takes far longer than its compile is stopped and retried only when no
    other job waits; it is still stored in the end."""
    killed(run_py, cache_dir, BUILD.format(n=2), tmp_path)
    spool_dir = next((cache_dir / "v1" / "spool").iterdir())
    (spool_dir / spool.LOCK).unlink(missing_ok=True)
    code = f"""
        from pathlib import Path
        from kdb.worker import supervisor as worker
        worker.SLOW_MIN_S = 0.0
        worker.SLOW_FACTOR = 0.0
        worker.MIN_AGE_S = 0.0
        worker.supervise(Path({str(spool_dir)!r}))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], timeout=300,
                          check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert "set aside" in proc.stdout
    assert stored(cache_dir) == 2
    assert not spool.jobs(cache_dir / "v1")


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


def test_only_a_python_executable_is_started(monkeypatch):
    """In an application that embeds Python, or a frozen one, sys.executable is the
    application: starting it with -m kdb.worker would start the application again."""
    monkeypatch.setattr("sys.executable", "/usr/bin/python3.11")
    assert spool.can_spool()
    for exe in ("/opt/app/bin/mysim", ""):
        monkeypatch.setattr("sys.executable", exe)
        assert not spool.can_spool()
    monkeypatch.setattr("sys.executable", "/usr/bin/python3")
    monkeypatch.setattr("sys.frozen", True, raising=False)
    assert not spool.can_spool()


def test_a_build_under_a_deleted_working_directory_is_served(cache_dir, run_py, tmp_path):
    """os.getcwd() fails there: the build still works (no job can describe it; it is stored
    before exit) and so does the system-database lookup. The directory goes after pyopencl's
    import and before kdb's: CPython 3.13.0 fails numpy's import from a deleted working
    directory (``SystemError``; fine with ``python -P``, which leaves it off ``sys.path``)."""
    gone = tmp_path / "gone"
    code = BUILD.format(n=2).replace(
        "import pyopencl as cl", f"import os, pyopencl as cl\n    os.mkdir({str(gone)!r}); "
                                 f"os.chdir({str(gone)!r}); os.rmdir({str(gone)!r})")
    out = run_json(run_py, code)
    assert out["compiles"] == 2
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 2


def test_jobs_are_private_and_a_worker_runs_per_environment(cache_dir, run_py):
    run_json(run_py, BUILD.format(n=1), {"POCL_CACHE_DIR": str(cache_dir / "p1")})
    run_json(run_py, BUILD.format(n=2), {"POCL_CACHE_DIR": str(cache_dir / "p2")})  # h1 is new
    dirs = list((cache_dir / "v1" / "spool").iterdir())
    assert len(dirs) == 2  # PoCL's cache dir differs: each worker builds with its own
    for d in dirs:
        assert d.stat().st_mode & 0o077 == 0
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 2


def test_a_holder_still_running_stores_a_wanted_entry_itself(cache_dir, tmp_path):
    """Ranks starting together: the one that compiled still holds the program, so when
    another waits for the entry it stores it at once (no worker runs here at all)."""
    import fcntl

    from kdb.config import private_dir

    env = {**os.environ, **DETACH, "KDB_CACHE_DIR": str(cache_dir),
           "POCL_CACHE_DIR": str(tmp_path / "pocl-holder")}
    sdir = private_dir(spool.spool_dir(cache_dir / "v1", env))
    held = os.open(sdir / spool.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # no store worker for the holder's jobs
    holder_code = textwrap.dedent(BUILD.format(n=1)) + "\nprint('built', flush=True)\ntime.sleep(60)\n"
    holder = subprocess.Popen([sys.executable, "-c", holder_code], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        while "built" not in holder.stdout.readline():
            assert holder.poll() is None
        waiter_env = {**env, "POCL_CACHE_DIR": str(tmp_path / "pocl-waiter")}
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(BUILD.format(n=1))],
                             env=waiter_env, capture_output=True, text=True, timeout=120)
        assert json.loads(out.stdout.splitlines()[-1])["compiles"] == 0, out.stderr
        assert stored(cache_dir) == 1
        # Its latency row is in the file, or still with its job (the holder kept PoCL's
        # files for the waiter, not the binary: kdb.backends.opencl.early.keep_now).
        logged = sql(user_file(cache_dir), "SELECT count(*) FROM compile_log")[0][0]
        assert logged + len(spool.pending_log_rows(cache_dir / "v1")) == 1
    finally:
        holder.kill()
        holder.wait()
        os.close(held)


def test_no_store_worker_for_a_user_file_that_is_refused(cache_dir, run_py):
    """A user file newer than this kdb is left alone: the kernels compile, and no job is
    written or worker started to store what could not be stored anyway."""
    run_py(BUILD.format(n=1), env={"KDB_STORE_AT_EXIT": "wait"})
    sql(user_file(cache_dir), "UPDATE alembic_version SET version_num = '9999'")
    out = run_json(run_py, BUILD.format(n=2))
    assert out["compiles"] == 2
    assert not spool.jobs(cache_dir / "v1")
    assert not (cache_dir / "v1" / spool.SPOOL).exists()


def _mount_tmpfs(target: Path, size: str) -> None:
    if os.getuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    target.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(target)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")


def _warnings(stderr: str) -> list[str]:
    info = ("no system kernel database", "this start-up compiled")
    return [ln for ln in stderr.splitlines() if ln.startswith("kdb:")
            and not any(i in ln for i in info)]


def test_a_full_disk_queues_no_job_and_storing_resumes_once_there_is_room(tmp_path, run_py):
    """A real file system (a tmpfs) filled to 1 MiB short of full: a run compiles, queues
    no job (kdb leaves jobfiles.MIN_FREE free) and says so once; a half-written job a killed
    writer left is removed by the next worker; once there is room the next run's stores
    land and the worker logs again."""
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, "48m")
    try:
        cache = mnt / "cache"  # PoCL's cache elsewhere, and one for every run: one spool
        env = {**DETACH, "KDB_CACHE_DIR": str(cache), "POCL_CACHE_DIR": str(tmp_path / "pocl")}
        filler = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        st = os.statvfs(mnt)
        os.posix_fallocate(filler, 0, st.f_bavail * st.f_frsize - (1 << 20))
        os.close(filler)

        full = run_py(BUILD.format(n=3), env=env)
        assert json.loads(full.stdout.splitlines()[-1])["compiles"] == 3
        warned = _warnings(full.stderr)
        assert len(warned) == 1 and "not stored until there is room" in warned[0], full.stderr
        assert not spool.jobs(cache / "v1"), "a job was queued on a full disk"
        spool_dir = spool.spool_dir(cache / "v1", {**os.environ, **env})
        spool_dir.mkdir(parents=True, mode=0o700, exist_ok=True)
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        partial = spool_dir / f".{time.time_ns():020d}-{dead.pid}-1.job.{dead.pid}.tmp"
        partial.write_text('{"kind": "store", "entr')  # what a killed writer leaves

        os.unlink(mnt / "filler")
        assert json.loads(run_py(BUILD.format(n=3), env=env).stdout.splitlines()[-1])[
            "compiles"] == 3
        wait_for_worker(cache)
        assert stored(cache) == 3
        assert not partial.exists()
        assert partial.name in (cache / "v1" / spool.LOG_NAME).read_text()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_worker_whose_log_cannot_be_written_still_stores(cache_dir, run_py, tmp_path):
    """Every line the worker writes fails (its log leads to /dev/full, which answers every
    write with ENOSPC, as a full disk does): it stores its jobs all the same."""
    killed(run_py, cache_dir, BUILD.format(n=2), tmp_path)
    v1 = cache_dir / "v1"
    spool_dir = next(d for d in (v1 / "spool").iterdir() if d.is_dir())
    (spool_dir / spool.LOCK).unlink(missing_ok=True)
    (spool_dir / f"{1000:020d}-1-1.job").write_text("[1]")  # one line to say: not a job
    (v1 / spool.LOG_NAME).unlink(missing_ok=True)
    (v1 / spool.LOG_NAME).symlink_to("/dev/full")
    with open("/dev/full", "wb") as log:
        proc = subprocess.run([sys.executable, "-m", "kdb.worker", str(spool_dir)],
                              stdout=log, stderr=log, timeout=300)
    assert proc.returncode == 0
    assert stored(cache_dir) == 2
    assert not spool.jobs(v1)


def test_a_spool_holding_max_jobs_takes_no_more(tmp_path):
    """A worker that cannot keep up, or cannot run: past MAX_JOBS queued jobs a process is
    told so (and stores its entries itself) instead of adding to the pile."""
    from kdb.storing import jobfiles

    spool_dir = tmp_path / "spool" / "0123456789abcdef"
    spool_dir.mkdir(parents=True)
    for i in range(jobfiles.MAX_JOBS - 1):
        (spool_dir / f"{i:020d}-1-{i}.job").touch()
    jobfiles.check_room(tmp_path, spool_dir)  # the last one that fits
    (spool_dir / f"{jobfiles.MAX_JOBS:020d}-1-0.job").touch()
    with pytest.raises(jobfiles.SpoolFull, match="5000 jobs not stored yet"):
        jobfiles.check_room(tmp_path, spool_dir)
    for p in list(spool_dir.iterdir())[:10]:  # the worker stored some meanwhile
        p.unlink()
    jobfiles.check_room(tmp_path, spool_dir)


def test_a_job_swapped_for_a_fifo_is_set_aside_when_a_lane_would_take_it(tmp_path):
    """A worker that read a job before it was swapped for a FIFO still lists it as a job:
    the lane that would take it sets it aside (``.bad``), so the worker does not hand it
    out for ever (a worker that never exits, nothing stored after it)."""
    from kdb.storing import jobfiles

    job = tmp_path / "00000000000000000001-1-0.job"
    os.mkfifo(job)
    assert jobfiles.take(job) is None
    assert not job.exists() and job.with_suffix(jobfiles.BAD).exists()
    os.mkdir(tmp_path / "00000000000000000002-1-0.job")
    assert jobfiles.take(tmp_path / "00000000000000000002-1-0.job") is None
    assert (tmp_path / "00000000000000000002-1-0.bad").is_dir()
    assert jobfiles.take(tmp_path / "00000000000000000003-1-0.job") is None  # none: no file


def test_a_cache_moved_with_its_queued_jobs_stores_them_where_it_is_now(cache_dir, run_py,
                                                                        tmp_path):
    """A CI runner restores the cache, queued jobs and all, in another workspace: the store
    worker stored them at the old path (making it again) or dropped them where it could not
    be made, and the moved cache kept early entries for good."""
    env = {**DETACH, "POCL_CACHE_DIR": str(tmp_path / "pocl-gone"),
           "KDB_DISABLE_EARLY_STORE": "1"}
    with no_store_worker(cache_dir, env):
        assert run_json(run_py, BUILD.format(n=2), env)["compiles"] == 2
    assert stored(cache_dir) == 0
    moved = tmp_path / "elsewhere" / "cache"
    moved.parent.mkdir()
    cache_dir.rename(moved)
    shutil.rmtree(tmp_path / "pocl-gone")  # the old runner's PoCL cache is gone too
    assert spool.wait(moved / "v1", 300) == 0
    wait_for_worker(moved)
    assert stored(moved) == 2
    assert not cache_dir.exists() and not (tmp_path / "pocl-gone").exists()
    again = run_json(run_py, BUILD.format(n=2), {"KDB_CACHE_DIR": str(moved)})
    assert again["compiles"] == 0

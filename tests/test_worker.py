"""The store worker never stops and never hides: malformed jobs are set aside, jobs of a dead
taker are taken again, every failure reaches ``store-worker.log`` with its job and reason, a
lane's pipe carries only its protocol, a relative cache directory still gets its entries
stored, a long queue costs the supervisor little, and the worker's session stays in the
background under autogroup scheduling.

Real processes, real PoCL builds, real job files and real flocks. The jobs are written by a
child that builds with ``KDB_STORE_AT_EXIT=detach`` but starts no worker, so that each test
starts the worker itself, when its spool is set up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kdb.storing import spool
from kdb.cli import cli
from conftest import sql

cl = pytest.importorskip("pyopencl")


@pytest.fixture(autouse=True)
def _no_early_stores(monkeypatch):
    """No early stores (kdb.backends.opencl.early) in these tests' processes: the worker's own behaviour is tested on the jobs a process leaves, not on what
    the process keeps itself at exit
    (tests/test_early.py)."""
    monkeypatch.setenv("KDB_DISABLE_EARLY_STORE", "1")

#: Build ``n`` kernels h0.. and leave their stores in the spool (no worker started).
JOBS = """
    import pyopencl as cl
    import kdb.opencl, kdb.storing.spool
    kdb.storing.spool.ensure_worker = lambda spool: None
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    for i in range({n}):
        kdb.opencl.build(ctx, f"__kernel void h{{i}}(__global float *a) {{{{ a[0] = {{i}}; }}}}")
"""


def stored(cache: Path) -> int:
    """Entries in the user files (0 while a worker is creating one)."""
    import sqlite3

    try:
        return sum(sql(f, "SELECT count(*) FROM kernels")[0][0]
                   for f in (cache / "v1").glob("pocl-*.kdb"))
    except sqlite3.OperationalError:
        return 0


def make_jobs(run_py, cache: Path, n: int) -> Path:
    """A spool holding the store jobs of ``n`` built kernels, oldest first, then the
    bookkeeping job of a user file not created yet; returns its directory."""
    run_py(JOBS.format(n=n), env={"KDB_STORE_AT_EXIT": "detach", "KDB_CACHE_DIR": str(cache),
                                  "KDB_DISABLE_REFRESH": "1"})  # refresh jobs: test_refresh.py
    (found,) = (cache / "v1" / "spool").iterdir()
    assert len(list(found.glob("*.job"))) == n + 1
    return found


def drain(cache: Path, timeout: float = 180) -> None:
    """Start the spool's worker as kdb does and wait until nothing is left to store."""
    assert spool.wait(cache / "v1", timeout) == 0, "the store worker left jobs"
    deadline = time.monotonic() + timeout
    while any(spool.worker_running(d) for d in (cache / "v1" / "spool").iterdir()):
        assert time.monotonic() < deadline, "the store worker never exited"
        time.sleep(0.05)


def worker_log(cache: Path) -> str:
    path = cache / "v1" / spool.LOG_NAME
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_malformed_job_is_set_aside_and_the_others_are_stored(cache_dir, run_py):
    jobs = make_jobs(run_py, cache_dir, 2)
    bad = {"00000000000000000001-1-1": "[1]", "00000000000000000001-1-2": '{"seconds": "x"}',
           "00000000000000000001-1-3": '{"entries": [1]}', "00000000000000000001-1-4": "{no"}
    for stem, text in bad.items():  # the oldest: the worker meets them first
        (jobs / (stem + spool.JOB)).write_text(text)
    drain(cache_dir)
    assert stored(cache_dir) == 2
    assert sorted(p.name for p in jobs.glob("*" + spool.BAD)) == sorted(s + ".bad" for s in bad)
    log = worker_log(cache_dir)
    for stem in bad:
        assert f"{stem}.job is not a store job" in log, log
    assert "Traceback" not in log, log
    assert spool.jobs(cache_dir / "v1") == []  # kdb log and kdb pack do not wait for them


def test_a_taken_job_whose_taker_died_is_taken_again(cache_dir, run_py):
    """A worker (or a process storing a wanted entry itself) killed mid-store leaves a
    ``.taken`` file: without a live taker's flock on it, the next worker queues it again."""
    from click.testing import CliRunner

    jobs = make_jobs(run_py, cache_dir, 2)
    first = sorted(jobs.glob("*.job"))[0]
    first.rename(first.with_suffix(spool.TAKEN))  # taken, and its taker gone
    rows = json.loads(CliRunner().invoke(cli, ["log", "--json"]).output)
    assert len(rows) == 2 and all(r["pending"] for r in rows)
    drain(cache_dir)
    assert stored(cache_dir) == 2
    assert "queued again" in worker_log(cache_dir)
    rows = json.loads(CliRunner().invoke(cli, ["log", "--json"]).output)
    assert len(rows) == 2 and not any(r["pending"] for r in rows)


def test_a_worker_killed_mid_store_leaves_nothing_stuck(cache_dir, run_py):
    """The supervisor and its lanes killed while a lane stores a job: the next worker stores
    that job too, instead of leaving it "not stored yet" for ever."""
    import signal

    jobs = make_jobs(run_py, cache_dir, 3)
    proc = subprocess.Popen([sys.executable, "-m", "kdb.worker", str(jobs)], cwd="/",
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(jobs.glob("*" + spool.TAKEN)):
        assert time.monotonic() < deadline and proc.poll() is None, "no store was seen"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # its session: the supervisor and both lanes
    proc.wait()
    assert list(jobs.glob("*" + spool.TAKEN))
    drain(cache_dir)
    assert stored(cache_dir) == 3


#: A supervisor that would wait a long time before it leaves an empty spool.
PATIENT_WORKER = ("import sys; from pathlib import Path; from kdb.worker import supervisor; "
                  "supervisor.IDLE_EXIT_S = 600.0; sys.exit(supervisor.supervise(Path(sys.argv[1])))")


def test_a_worker_whose_cache_dir_was_removed_and_made_again_leaves_it(cache_dir, run_py):
    """``rm -rf`` of the cache directory while its worker idles, then a process writes jobs
    there again and starts a worker, which locks a new ``worker.lock``. The old one served
    that spool beside it (two floor lanes, one no waiter saw) until it had been idle for
    ``IDLE_EXIT_S``; it leaves at once."""
    import fcntl
    import shutil

    jobs = make_jobs(run_py, cache_dir, 1)
    old = subprocess.Popen([sys.executable, "-c", PATIENT_WORKER, str(jobs)], cwd="/",
                           start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while spool.jobs(cache_dir / "v1") or stored(cache_dir) < 1:
            assert time.monotonic() < deadline and old.poll() is None, "no store was seen"
            time.sleep(0.05)
        shutil.rmtree(cache_dir / "v1")
        jobs.mkdir(parents=True)
        fd = os.open(jobs / spool.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # the new spool's worker
        try:
            assert old.wait(timeout=60) == 0
        finally:
            os.close(fd)
    finally:
        if old.poll() is None:
            old.kill()
            old.wait()


def _kill_a_lane_storing(jobs: Path, proc: subprocess.Popen, stem: str | None = None,
                         spare: int | None = None) -> tuple[str, int]:
    """SIGKILL a lane of ``proc`` (the supervisor of ``jobs``) caught storing a job (``stem``,
    else any), but the lane ``spare`` (one killed before); that job's stem and the lane."""
    import signal

    from kdb.storing import jobfiles

    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline and proc.poll() is None, "no lane was caught"
        for taken in jobs.glob(f"{stem or '*'}{spool.TAKEN}"):
            lane = jobfiles.lane_of(taken)
            if lane is None or lane[0] == spare:
                continue
            os.kill(lane[0], signal.SIGSTOP)  # then it cannot finish before the kill
            if taken.exists():
                os.kill(lane[0], signal.SIGKILL)
                return taken.stem, lane[0]
            os.kill(lane[0], signal.SIGCONT)
        time.sleep(0.002)


@pytest.mark.parametrize("kills", [1, 2])
def test_a_lane_killed_mid_store_has_its_job_tried_once_more(kills, cache_dir, run_py):
    """A lane ended from outside (the OOM killer, a user) while it stores a job: that job
    is tried again, not dropped; one that ends its lane twice is dropped (a driver that
    crashes on it would otherwise take a lane down for ever)."""
    import signal

    jobs = make_jobs(run_py, cache_dir, 3)
    said = cache_dir / "said.log"
    with open(said, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kdb.worker", str(jobs)], cwd="/",
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)
    try:
        killed, lane = _kill_a_lane_storing(jobs, proc)
        if kills == 2:
            _kill_a_lane_storing(jobs, proc, killed, spare=lane)
        drain(cache_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log = said.read_text()
    assert f"the store of {killed} (" in log and "tried once more" in log, log
    assert ("ended its process again; the job is dropped" in log) == (kills == 2), log
    if kills == 1:  # (killed twice, its entry may have been written before the second kill)
        assert stored(cache_dir) == 3


def test_a_job_taken_by_a_live_process_is_left_to_it_until_it_dies(cache_dir, run_py):
    jobs = make_jobs(run_py, cache_dir, 2)
    first = sorted(jobs.glob("*.job"))[0]
    fd = spool.take(first)  # this process stores it, as a process with a wanted entry does
    assert fd is not None and first.with_suffix(spool.TAKEN).exists()
    assert spool.take(first) is None  # nobody else can take it meanwhile
    try:
        spool.ensure_worker(jobs)
        deadline = time.monotonic() + 120
        while stored(cache_dir) < 1:
            assert time.monotonic() < deadline, worker_log(cache_dir)
            time.sleep(0.1)
        time.sleep(1.0)
        assert first.with_suffix(spool.TAKEN).exists() and stored(cache_dir) == 1
        assert spool.worker_running(jobs)  # it stays while a taken job may come back
    finally:
        os.close(fd)  # the taker "dies" without storing it
    drain(cache_dir)
    assert stored(cache_dir) == 2


def test_every_failing_store_reaches_the_log_with_its_job_and_reason(cache_dir, run_py):
    jobs = make_jobs(run_py, cache_dir, 3)
    broken = sorted(jobs.glob("*.job"))[0]
    data = json.loads(broken.read_text())
    data["program"]["source"] = "__kernel void h0(__global float *a) { a[0] = nosuchname; }"
    broken.write_text(json.dumps(data))
    drain(cache_dir)
    assert stored(cache_dir) == 2
    log = worker_log(cache_dir)
    key = data["entries"][0]["key"][:16]
    assert f"could not store {broken.stem} (h0 {key}): " in log, log
    assert "BUILD_PROGRAM_FAILURE" in log or "clBuildProgram" in log, log
    assert "ended its process" not in log and "set aside" not in log, log


def test_a_lanes_pipe_carries_only_its_protocol(cache_dir, run_py):
    """The compiler's output and kdb's messages go to the log (stderr), never to the pipe the
    supervisor reads one line per job from."""
    jobs = make_jobs(run_py, cache_dir, 2)
    broken, good = sorted(jobs.glob("*.job"))[:2]
    data = json.loads(broken.read_text())
    data["program"]["source"] = "__kernel void h0(__global float *a) { a[0] = nosuchname; }"
    broken.write_text(json.dumps(data))
    env = dict(os.environ, **dict(json.loads((jobs / spool.ENVIRONMENT).read_text())["variables"]))
    proc = subprocess.run([sys.executable, "-m", "kdb.worker", "--child"], env=env, cwd="/",
                          input=f"{broken}\n{good}\n{good}\n".encode(), capture_output=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"done\n" * 3
    assert b"could not store" in proc.stderr and b"nosuchname" in proc.stderr
    assert stored(cache_dir) == 1 and not broken.exists() and not good.exists()


@pytest.mark.parametrize("variable", ["KDB_CACHE_DIR", "XDG_CACHE_HOME"])
def test_a_relative_cache_dir_is_made_absolute_before_anything_is_spooled(tmp_path, monkeypatch,
                                                                          variable):
    monkeypatch.delenv("KDB_CACHE_DIR", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    code = JOBS.replace("kdb.storing.spool.ensure_worker = lambda spool: None", "").format(n=2)
    env = dict(os.environ, KDB_STORE_AT_EXIT="detach", POCL_CACHE_DIR=str(tmp_path / "pocl"))
    env[variable] = "relc"
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=work, check=True,
                   capture_output=True, timeout=300)
    cache = work / "relc" if variable == "KDB_CACHE_DIR" else work / "relc" / "kdb"
    job = next(iter(spool.jobs(cache / "v1")), None)
    if job is not None:  # not stored yet: it names the cache absolutely
        data = spool.read_job(job)
        assert data is None or Path(data["cache_dir"]).is_absolute()
    drain(cache)
    assert stored(cache) == 2, worker_log(cache)


def test_the_compiled_programs_held_in_memory_are_bounded(cache_dir, run_py):
    """Programs whose stores went to the worker are not held for the process's life; the
    newest are, so a repeated build is still served at once."""
    code = JOBS.format(n=40) + """
    import json, kdb.bookkeeping
    from kdb.backends.opencl import stores as clstore
    before = len(kdb.bookkeeping.records())
    kdb.opencl.build(ctx, "__kernel void h39(__global float *a) { a[0] = 39; }")
    print(json.dumps([len(clstore.compiled), clstore._Recent.LIMIT,
                      len(kdb.bookkeeping.records()) - before]))
    """
    held, limit, compiles = json.loads(run_py(code, env={"KDB_STORE_AT_EXIT": "detach"})
                                       .stdout.splitlines()[-1])
    assert held <= limit < 40
    assert compiles == 0  # the newest program was served from memory


def test_a_program_built_again_and_again_stays_held_while_others_come_and_go(cache_dir,
                                                                            run_py):
    """A program rebuilt between many others (its store not landed yet) is served from
    memory every time: each repeat makes it the newest, where before it was evicted
    ``LIMIT`` builds after its first and compiled again (found by
    tests/test_options_differential.py: one key compiled twice in a process)."""
    code = """
    import json, kdb.bookkeeping
    import pyopencl as cl
    import kdb.opencl
    from kdb.backends.opencl import stores as clstore
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    clstore._Recent.LIMIT = 4  # 32: the same, eight times the compiles
    again = "__kernel void again(__global float *a) { a[0] = -1; }"
    for i in range(clstore._Recent.LIMIT + 4):
        kdb.opencl.build(ctx, again)
        kdb.opencl.build(ctx, f"__kernel void h{i}(__global float *a) {{ a[0] = {i}; }}")
    kdb.opencl.build(ctx, again)
    print(json.dumps([r.name for r in kdb.bookkeeping.records()].count("again")))
    """
    out = run_py(code, env={"KDB_STORE_AT_EXIT": "wait"})
    assert json.loads(out.stdout.splitlines()[-1]) == 1


def _long_queue(cache_dir: Path, run_py, n: int, floor: bool) -> dict:
    """``n`` queued jobs of a program stored already (cheap to store), stored by a
    supervisor whose queue counts its listings and the floor lane's looks at jobs
    (``floor``: the machine taken to have no idle CPU, so that the floor lane stores them)."""
    jobs = make_jobs(run_py, cache_dir, 1)
    text = sorted(jobs.glob("*.job"))[0].read_text()
    for i in range(n):
        (jobs / f"{1000 + i:020d}-1-{i}.job").write_text(text)
    code = f"""
        import json, resource, time
        from pathlib import Path
        from kdb.worker import supervisor as worker
        worker.MIN_AGE_S = 0.0
        if {floor!r}:  # no idle CPU: the idle lanes store nothing, the floor lane all
            worker._no_idle_cpu = lambda lanes, share, before: True
            pick = worker._pick
            worker._pick = lambda queue, lane, busy: (
                None if lane.pacer is None else pick(queue, lane, busy))
        queues = []
        class Counted(worker._Queue):
            def __init__(self, spool):
                super().__init__(spool)
                self.looks = 0
                queues.append(self)
            def floor_may(self, *args):
                self.looks += 1
                return super().floor_may(*args)
        worker._Queue = Counted
        start = resource.getrusage(resource.RUSAGE_SELF)  # its imports: not the queue's
        began = time.monotonic()
        worker.supervise(Path({str(jobs)!r}), share=0.5 if {floor!r} else None)
        wall = time.monotonic() - began
        me = resource.getrusage(resource.RUSAGE_SELF)
        lanes = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(json.dumps({{"listings": sum(q.listings for q in queues),
                          "looks": sum(q.looks for q in queues), "wall_s": wall,
                          "supervisor_s": me.ru_utime + me.ru_stime - start.ru_utime
                                          - start.ru_stime,
                          "lanes_s": lanes.ru_utime + lanes.ru_stime}}))
    """
    env = dict(os.environ, **dict(json.loads((jobs / spool.ENVIRONMENT).read_text())["variables"]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd="/",
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert not list(jobs.glob("*.job"))
    assert stored(cache_dir) == 1
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_long_queue_costs_the_supervisor_a_small_share_of_the_lanes_cpu(cache_dir, run_py):
    """The supervisor lists the spool a bounded number of times, not once per job and pass,
    and uses little CPU."""
    n = 300
    got = _long_queue(cache_dir, run_py, n, floor=False)
    assert got["listings"] < n / 3, got
    # The lanes did the stores. The supervisor's share of them is small, plus what waking
    # to pace a floor lane costs while the queue lasts (a busy machine: at most 5% of a
    # core). On a busy machine the queue lasts longer; its share of the jobs stays the same.
    assert got["supervisor_s"] < 0.5 * got["lanes_s"] + 0.05 * got["wall_s"], got


def test_the_floor_lane_looks_at_a_long_queue_once_a_job_not_once_a_job_and_pick(cache_dir,
                                                                                    run_py):
    """With no idle CPU the floor lane stores the queue; each of its picks looks at the queue
    only as far as the first job it may take (it once looked at every queued job each time:
    n**2 / 2 looks, most of what the supervisor did on a busy machine)."""
    n = 300
    got = _long_queue(cache_dir, run_py, n, floor=True)
    assert 0 < got["looks"] < 3 * n, got
    assert got["supervisor_s"] < 0.5 * got["lanes_s"] + 0.05 * got["wall_s"], got


def autogroup_in_effect() -> bool:
    """Autogroup scheduling shares the CPU here: the kernel has it, and this process is not in
    a cgroup of its own that decides instead (its ``/proc/self/autogroup`` then reads empty)."""
    try:
        return bool(Path("/proc/self/autogroup").read_text().strip())
    except OSError:
        return False


NO_AUTOGROUP = ("no autogroup scheduling for this process (/proc/self/autogroup is missing or "
                "empty: the kernel lacks it, or a cgroup shares the CPU instead)")

@pytest.mark.skipif(not autogroup_in_effect(), reason=NO_AUTOGROUP)
def test_the_workers_session_has_the_lowest_autogroup_weight(cache_dir, run_py):
    """The worker without a floor (``KDB_STORE_SHARE=0``) starts its own session; under
    autogroup scheduling its nice values count only if its session's group has the lowest
    weight too. (With a floor its idle lanes take sessions of their own: test_floor.py.)"""
    jobs = make_jobs(run_py, cache_dir, 1)
    fd = spool.take(sorted(jobs.glob("*.job"))[0])  # a live taker: the worker waits for it
    proc = subprocess.Popen([sys.executable, "-m", "kdb.worker", str(jobs)], cwd="/",
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=dict(os.environ, KDB_STORE_SHARE="0"))
    try:
        deadline = time.monotonic() + 60
        group = ""
        while "nice 19" not in group and time.monotonic() < deadline:
            time.sleep(0.1)
            group = Path(f"/proc/{proc.pid}/autogroup").read_text()
        assert "nice 19" in group, group
    finally:
        os.close(fd)
    proc.wait(timeout=300)
    assert stored(cache_dir) == 1


@pytest.mark.skipif(not autogroup_in_effect(), reason=NO_AUTOGROUP)
def test_a_worker_run_inside_another_session_leaves_its_autogroup_alone(tmp_path):
    """Only a session of the worker's own is lowered: never the terminal's or a test's."""
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    before = Path("/proc/self/autogroup").read_text().split()[-1]
    code = f"""
        from pathlib import Path
        from kdb.worker import supervisor as worker
        worker.IDLE_EXIT_S = 0.0
        worker.supervise(Path({str(spool_dir)!r}))
        print(open("/proc/self/autogroup").read().split()[-1])
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True,
                         capture_output=True, text=True, timeout=120).stdout.split()
    assert out == [before] and Path("/proc/self/autogroup").read_text().split()[-1] == before


# -- each job is rebuilt in the environment its keys hold (issue 27, item 7) ----------------

#: Build kernel ``NAME`` (it returns the macro N, which POCL_EXTRA_BUILD_FLAGS defines) and
#: leave its store in the spool; ``SET_AFTER``: a value this process gives the variable once
#: the build is done (another thread's doing, say), before the job is written.
BUILD_N = """
    import os
    import pyopencl as cl
    import kdb.opencl, kdb.storing.spool
    kdb.storing.spool.ensure_worker = lambda spool: None
    real = cl._Program.build

    def build(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if SET_AFTER is not None:
            os.environ["POCL_EXTRA_BUILD_FLAGS"] = SET_AFTER
        return out

    cl._Program.build = build
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    kdb.opencl.build(ctx, "__kernel void NAME(__global int *o) { o[0] = N; }")
"""

#: Run kernel ``NAME`` once; print its result and how many programs this process compiled.
RUN_N = """
    import json
    import numpy as np
    import pyopencl as cl
    import kdb.opencl
    from kdb import bookkeeping
    plat = [p for p in cl.get_platforms() if "Portable" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    prg = kdb.opencl.build(ctx, "__kernel void NAME(__global int *o) { o[0] = N; }")
    q = cl.CommandQueue(ctx)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, 4)
    getattr(prg, "NAME")(q, (1,), None, buf)
    out = np.zeros(1, np.int32)
    cl.enqueue_copy(q, out, buf)
    print(json.dumps([int(out[0]), len(bookkeeping.records())]))
"""


def _n_child(code: str, name: str, set_after: str | None = None) -> str:
    return f"SET_AFTER = {set_after!r}\n" + textwrap.dedent(code).replace("NAME", name)


def test_a_job_is_rebuilt_with_the_build_variables_its_key_holds(cache_dir, run_py, tmp_path):
    """PoCL reads POCL_EXTRA_BUILD_FLAGS once per process. Kernel ``two`` was built and keyed
    with ``-DN=2``, but its job lands in the spool of ``-DN=5`` (the variable changed before
    the job was written), beside kernel ``five``'s: the worker stores each in a lane of its
    own environment, so each stored binary computes what its key says."""
    pocl = {"POCL_CACHE_DIR": str(tmp_path / "pocl"), "KDB_STORE_AT_EXIT": "detach"}
    run_py(_n_child(BUILD_N, "two", "-DN=5"), env={**pocl, "POCL_EXTRA_BUILD_FLAGS": "-DN=2"})
    run_py(_n_child(BUILD_N, "five"), env={**pocl, "POCL_EXTRA_BUILD_FLAGS": "-DN=5"})
    (jobs,) = (cache_dir / "v1" / "spool").iterdir()  # one spool: the environment of -DN=5
    assert sum(bool(json.loads(p.read_text()).get("entries")) for p in jobs.glob("*.job")) == 2
    drain(cache_dir)
    assert stored(cache_dir) == 2, worker_log(cache_dir)
    for name, n in (("two", 2), ("five", 5)):
        got = run_py(_n_child(RUN_N, name), env={**pocl, "POCL_EXTRA_BUILD_FLAGS": f"-DN={n}"})
        assert json.loads(got.stdout.splitlines()[-1]) == [n, 0]  # served, and right


def test_a_job_is_rebuilt_without_the_variables_its_key_left_unset(cache_dir, run_py, tmp_path,
                                                                   monkeypatch):
    """AMD_OCL_BUILD_OPTIONS does not tell spools apart: jobs keyed with and without it share
    one, and the worker inherits whatever the process that started it had. Each job is
    stored from a lane that has exactly its keys' value (a lane with another value would
    drop it: the lane checks), and none from the worker's own."""
    pocl = {"POCL_CACHE_DIR": str(tmp_path / "pocl"), "KDB_STORE_AT_EXIT": "detach"}
    run_py(JOBS.format(n=1), env={**pocl, "AMD_OCL_BUILD_OPTIONS": "-DA"})
    run_py(JOBS.format(n=1).replace("h{i}", "g{i}"), env=pocl)
    (jobs,) = (cache_dir / "v1" / "spool").iterdir()
    envs = [json.loads(p.read_text()).get("environment") for p in sorted(jobs.glob("*.job"))]
    assert [e["AMD_OCL_BUILD_OPTIONS"] for e in envs if e] == ["-DA", None]
    monkeypatch.setenv("AMD_OCL_BUILD_OPTIONS", "-DZ")  # the worker's starter has another
    drain(cache_dir)
    assert stored(cache_dir) == 2, worker_log(cache_dir)
    assert "job dropped" not in worker_log(cache_dir)


def test_a_lane_whose_environment_differs_from_the_key_drops_the_job(cache_dir, run_py,
                                                                     tmp_path, monkeypatch):
    """The lane's own check: a rebuild under other build variables than the key's is never
    stored (a job from an older kdb, or a lane started by hand)."""
    import kdb
    from kdb.backends.opencl import stores
    from kdb.storing.jobs import StoreJob

    run_py(JOBS.format(n=1), env={"KDB_STORE_AT_EXIT": "detach", "AMD_OCL_BUILD_OPTIONS": "-DA",
                                  "POCL_CACHE_DIR": str(tmp_path / "pocl")})
    job = [j for j in (StoreJob.from_dict(spool.read_job(p))
                       for p in (cache_dir / "v1" / "spool").glob("*/*.job")) if j.entries][0]
    monkeypatch.setenv("AMD_OCL_BUILD_OPTIONS", "-DZ")
    db = kdb.KernelDB(use_system=False)
    with pytest.raises(LookupError, match="built with AMD_OCL_BUILD_OPTIONS='-DA', the store "
                                          "worker has '-DZ'"):
        stores.rebuild_and_store(db, job)
    db.flush()
    assert stored(cache_dir) == 0


def test_counts_handed_to_the_worker_land_before_any_store_made_the_file(cache_dir):
    """A process with no user file hands its counts to the worker as a bookkeeping job; the
    worker's lanes run side by side (the floor lane beside the idle ones), so that job may
    run before the store job that creates the file. Its counts land all the same (they were
    lost: kdb stats then showed one process's compiles of two)."""
    import kdb
    from kdb.bookkeeping import Pending

    p = Pending()
    p.counters.update({"compiles": 1.0, "misses": 1.0})
    db = kdb.KernelDB(use_system=False)
    db.tiers.storing.write_bookkeeping({"pocl-test": p.to_json()})
    f = cache_dir / "v1" / "pocl-test.kdb"
    assert dict(sql(f, "SELECT name, value FROM counters")) == {"compiles": 1.0, "misses": 1.0}


def test_a_job_nothing_stands_in_for_is_stored_before_older_ones(tmp_path):
    """The queue's order: a job another process waits for, then one marked ``first`` (the
    next process would compile its programs: no early entry stands in), then the oldest;
    a ``first`` job too young to take leaves the older ones takeable."""
    from kdb.storing.jobs import StoreJob
    from kdb.worker import supervisor as worker

    now = time.time_ns()
    jobs = {f"{now - 9_000_000_000 - i:020d}-1-{i}": False for i in range(3)}
    jobs[f"{now - 5_000_000_000:020d}-1-7"] = True   # old enough, put first
    # Too young yet, however long this test takes to get there (a loaded machine with a cold
    # disk took more than MIN_AGE_S between here and the last pick).
    jobs[f"{now + 600_000_000_000:020d}-1-8"] = True
    for stem, first in jobs.items():
        job = StoreJob(backend="opencl", entries=[{"key": stem}], first=first)
        (tmp_path / (stem + spool.JOB)).write_text(job.to_json())
    queue = worker._Queue(tmp_path)
    queue.scan(set(), force=True)
    order = [queue.pick(False, set()) for _ in range(4)]
    stems = sorted(jobs)
    assert [p.stem for p in order] == [stems[3], stems[0], stems[1], stems[2]]
    assert queue.pick(False, set()) is None  # the young one waits for its age


@pytest.mark.parametrize("given, seen", [(None, "1"), ("4", "4")])
def test_the_workers_processes_start_no_blas_threads_unless_the_user_asks(given, seen):
    """A lane imports numpy (through pyopencl) to load binaries, and OpenBLAS would start a
    spinning thread a core for linear algebra no store does: kdb's worker processes run with
    one, unless the user set ``OPENBLAS_NUM_THREADS``."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    code = "import os, kdb.worker.__main__; print(os.environ['OPENBLAS_NUM_THREADS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.split() == [seen], out.stderr


def test_a_job_taken_for_a_moment_and_put_back_is_still_stored(tmp_path):
    """A compiling process takes its own job to store a wanted entry and puts it back
    (:mod:`kdb.storing.holding`). Read in that moment, the job was remembered as gone: each
    later pick passed it over, it was never stored, and its worker never left (the job
    kept the queue from being empty)."""
    from kdb.storing.jobs import StoreJob
    from kdb.worker import supervisor as worker

    stem = f"{time.time_ns() - 9_000_000_000:020d}-1-1"
    job = tmp_path / (stem + spool.JOB)
    job.write_text(StoreJob(backend="opencl", entries=[{"key": "k"}]).to_json())
    queue = worker._Queue(tmp_path)
    queue.scan(set(), force=True)
    taken = job.with_suffix(spool.TAKEN)
    job.rename(taken)  # its process takes it ...
    assert queue.pick(False, set()) is None
    taken.rename(job)  # ... and puts it back
    queue.scan(set(), force=True)
    assert queue.pick(False, set()) == job

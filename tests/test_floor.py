"""The floor under the store worker's stores (``KDB_STORE_SHARE``, :mod:`kdb.worker.floor`):
with every core busy at normal priority, queued stores still land, through a lane at normal
priority held to its share of one core; without the floor they wait for idle CPU.

Real processes: the busy machine is CPU-bound children of this test at nice 0, each in a
session of its own (the worst case under autogroup scheduling), bounded in time and killed
at the end; the jobs are real PoCL builds (:func:`test_worker.make_jobs`). The bounds are
generous: these run on a loaded 2-core machine. Nothing here needs root: the worker never
raises a priority (an unprivileged process could not), which the structural checks below
hold it to; the tests run as whoever runs them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from kdb import config
from kdb.errors import ConfigError
from kdb.storing import spool
from kdb.worker import floor
from test_worker import make_jobs, stored, worker_log


@pytest.fixture(autouse=True)
def _no_early_stores(monkeypatch):
    """No early stores (kdb.backends.opencl.early): what lands here is the worker's, so the
    counts say what the floor did, not what a process kept at its exit."""
    monkeypatch.setenv("KDB_DISABLE_EARLY_STORE", "1")

pytest.importorskip("pyopencl")

#: A CPU-bound child that ends by itself after the given seconds (should a finally not run).
HOG = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass"


@contextmanager
def busy_machine(per_core: int = 2, seconds: float = 60):
    """Every core kept busy by ``per_core`` normal-priority processes, each its own session."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(seconds)], start_new_session=True)
            for _ in range(per_core * (os.cpu_count() or 1))]
    try:
        time.sleep(0.5)  # they run before anything is measured
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def cpu_of(pid: int) -> float:
    """CPU seconds process ``pid`` used (utime + stime), from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_share_is_a_fraction_of_one_core():
    assert config.parse_share(config.ENV_STORE_SHARE, "0") == 0.0  # the floor off
    assert config.parse_share(config.ENV_STORE_SHARE, " 0.25 ") == 0.25
    for bad in ("1.5", "-0.1", "nan", "a tenth"):
        with pytest.raises(ConfigError, match="KDB_STORE_SHARE=.* fraction of one core"):
            config.parse_share(config.ENV_STORE_SHARE, bad)
    assert config.store_share(0.5) == 0.5
    assert config.SETTINGS[config.ENV_STORE_SHARE].default == 0.1


def test_the_share_is_not_part_of_a_spools_environment(monkeypatch, tmp_path):
    """Programs with other shares write to one spool; its worker takes the share of the
    process that started it."""
    monkeypatch.setenv("KDB_STORE_SHARE", "0.3")
    one = spool.spool_dir(tmp_path)
    monkeypatch.setenv("KDB_STORE_SHARE", "0")
    assert spool.spool_dir(tmp_path) == one


def _paced_cpu(share: float, window: float) -> float:
    """CPU seconds a real CPU-bound process at nice 0 got in ``window`` seconds under a
    :class:`floor.Pacer` of ``share``."""
    paced = subprocess.Popen([sys.executable, "-c", HOG, "30"])
    try:
        time.sleep(0.3)
        pacer = floor.Pacer(share)
        pacer.reset(paced.pid, cpu_of(paced.pid))
        start, end = cpu_of(paced.pid), time.monotonic() + window
        while time.monotonic() < end:
            time.sleep(pacer.look(cpu_of(paced.pid)))
        used = cpu_of(paced.pid) - start
        pacer.release()
    finally:
        paced.kill()
        paced.wait()
    return used


def test_a_paced_process_gets_its_share_of_a_busy_machine_and_no_more():
    """The pacer holds a real CPU-bound process at nice 0 to its share while every core is
    busy: it gets at least part of the share (the floor) and at most twice it (the bound)."""
    share, window = 0.1, 4.0
    with busy_machine():
        used = _paced_cpu(share, window)
    assert used <= 2 * share * window, used
    assert used >= 0.25 * share * window, used


def test_a_paced_process_gets_no_more_than_its_share_of_an_idle_core():
    """Every CPU second the floor lane runs is counted, also where it waits for no CPU: on
    a quiet machine a lane at nice 0 that ran unpaced there took CPU a program's threads
    wanted in bursts (issue 35), which its own wait for a CPU never showed."""
    share, window = 0.1, 3.0
    used = _paced_cpu(share, window)
    assert used <= 1.5 * share * window, used


class _Judged:
    """An idle lane as :func:`supervisor._no_idle_cpu` sees it: its last window's verdict."""

    pacer = None

    def __init__(self, fed):
        self.fed = fed

    def judge(self, share, window):
        return self.fed


def test_the_floor_waits_while_an_idle_lane_gets_idle_cpu():
    """One idle lane that got the share over its last window says the machine has idle
    CPU: the floor lane stores nothing then, whatever another lane got; only lanes that
    got less say it has none; lanes with no verdict yet change nothing."""
    from kdb.worker import supervisor

    no_idle = supervisor._no_idle_cpu
    assert no_idle([_Judged(True), _Judged(False)], 0.1, True) is False
    assert no_idle([_Judged(None), _Judged(False)], 0.1, False) is True
    assert no_idle([_Judged(None), _Judged(None)], 0.1, True) is True
    assert no_idle([_Judged(None), _Judged(None)], 0.1, False) is False


def test_an_idle_lane_judges_the_cpu_it_got_over_a_window(cache_dir, run_py):
    """A real idle lane that got no CPU over a window (stopped, as a lane gets none on a
    machine that is never idle) starved; its verdict holds until its next window ends, and
    it has none before its first one has."""
    from kdb.worker.lane import Lane

    jobs = make_jobs(run_py, cache_dir, 1)
    (job,) = sorted(jobs.glob("*.job"))[:1]
    lane = Lane(slow=False)
    lane.start(job)
    try:
        os.kill(lane.proc.pid, signal.SIGSTOP)
        lane.window = (time.monotonic(), lane.clock())  # its start-up aside
        assert lane.judge(0.1, 0.5) is None
        time.sleep(0.6)
        assert lane.judge(0.1, 0.5) is False and lane.starved(0.1, 0.5)
        time.sleep(0.2)
        assert lane.judge(0.1, 0.5) is False
    finally:
        os.kill(lane.proc.pid, signal.SIGCONT)
        lane.close()


#: A worker whose judgement of the machine is fixed (``{none}``: no idle CPU there), that
#: says which lanes took jobs.
FIXED = """
    import sys
    from pathlib import Path
    from kdb.worker import lane, supervisor
    supervisor._no_idle_cpu = lambda lanes, share, before: {none}
    took = []
    start = lane.Lane.start
    def noted(self, path, *args, **kwargs):
        took.append("floor" if self.pacer else "slow" if self.slow else "idle")
        return start(self, path, *args, **kwargs)
    lane.Lane.start = noted
    supervisor.supervise(Path({jobs!r}), share=0.5)
    print(" ".join(sorted(set(took))))
"""


def test_the_floor_lane_stores_nothing_while_the_machine_has_idle_cpu(cache_dir, run_py,
                                                                    tmp_path):
    """With idle CPU the idle lanes store every job and the floor lane (nice 0) takes none,
    not even the first: on a quiet machine it would compete with the program's threads
    (issue 35's first run, 1.27x with it against 1.05x without). With none, it takes the
    first job at once."""
    jobs = make_jobs(run_py, cache_dir, 2)
    quiet = run_py(FIXED.format(none=False, jobs=str(jobs)))
    assert quiet.stdout.split() == ["idle"], quiet.stderr
    assert stored(cache_dir) == 2, worker_log(cache_dir)
    other = tmp_path / "busy"
    jobs = make_jobs(run_py, other, 2)
    busy = run_py(FIXED.format(none=True, jobs=str(jobs)))
    assert "floor" in busy.stdout.split(), busy.stderr
    assert stored(other) == 2, worker_log(other)


def start_worker(jobs: Path) -> subprocess.Popen:
    """The spool's worker, started as :func:`kdb.storing.spool.ensure_worker` starts it."""
    with open(jobs.parent.parent / spool.LOG_NAME, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "kdb.worker", str(jobs)], cwd="/",
                                start_new_session=True, stdout=log, stderr=log)


def worker_tree(pid: int) -> list[int]:
    """The pids of ``pid``'s children (the supervisor's lanes)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[16])


def test_stores_land_when_every_core_is_busy(cache_dir, run_py, monkeypatch):
    """Two normal-priority processes per core: the floor lane stores the queued job, then
    takes over the job an idle lane took and could not get CPU for; the floor lane stays
    at nice 0 in the supervisor's session, the idle lanes at nice 19 in sessions of their
    own."""
    jobs = make_jobs(run_py, cache_dir, 2)  # two store jobs and a bookkeeping job
    monkeypatch.setenv("KDB_STORE_SHARE", "0.5")  # a wide floor: a quick test
    with busy_machine():
        proc = start_worker(jobs)
        try:
            niceness, deadline = {}, time.monotonic() + 90
            while list(jobs.glob("*.job")) + list(jobs.glob("*.taken")):
                assert time.monotonic() < deadline, worker_log(cache_dir)
                for pid in worker_tree(proc.pid):
                    try:
                        niceness[pid] = (nice_of(pid), os.getsid(pid) == proc.pid)
                    except OSError:
                        pass
                time.sleep(0.1)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert stored(cache_dir) == 2, worker_log(cache_dir)
    assert (0, True) in niceness.values(), niceness  # the floor lane
    assert (19, False) in niceness.values(), niceness  # an idle lane, apart
    assert "handed to the floor lane" in worker_log(cache_dir)


def test_without_the_floor_stores_wait_for_idle_cpu(cache_dir, run_py, monkeypatch):
    """``KDB_STORE_SHARE=0``: the worker's lanes get only CPU nobody else wants, so while
    every core is busy the queued store does not land (it does once the machine is idle)."""
    jobs = make_jobs(run_py, cache_dir, 1)
    monkeypatch.setenv("KDB_STORE_SHARE", "0")
    with busy_machine():
        proc = start_worker(jobs)
        try:
            time.sleep(8)
            assert stored(cache_dir) == 0
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_floor_takes_only_stores_no_early_entry_can_serve(tmp_path):
    """The floor lane's CPU goes where the next process would otherwise compile: a job
    another process waits for, one marked ``first``, one whose process ended (killed before
    it could keep an early entry, or the entry was not kept); not one whose process still
    runs (it keeps its early entries at exit), nor one the floor lane found an early entry
    serving. A later process that took the pid over is not the job's."""
    from kdb.storing.jobs import StoreJob
    from kdb.worker import supervisor as worker

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    born = time.time_ns() - 5_000_000_000
    later = subprocess.Popen(["sleep", "60"])  # started after the job was written
    try:
        stems = {"running": f"{born:020d}-1-1",  # pid 1 started at boot: still running
                 "first": f"{born:020d}-1-2", "wanted": f"{born:020d}-1-3",
                 "ended": f"{born:020d}-{ended.pid}-4", "reused": f"{born:020d}-{later.pid}-5",
                 # its entries are binaries already: the floor lane leaves it to idle CPU,
                 # so it took a starved idle lane's store of one over only to hand it back
                 "refresh": f"{born:020d}-{ended.pid}-6-refresh"}
        for what, stem in stems.items():
            job = StoreJob(backend="opencl", entries=[{"key": what}], first=what == "first")
            (tmp_path / (stem + spool.JOB)).write_text(job.to_json())
        queue = worker._Queue(tmp_path)
        queue.scan(set(), force=True)
        queue.wanted = {"wanted"}
        may = {what: queue.floor_may(stem) for what, stem in stems.items()}
        assert may == {"running": False, "first": True, "wanted": True, "ended": True,
                       "reused": True, "refresh": False}, may
        asked = {what: queue.may_stand_in(stem) for what, stem in stems.items()}
        assert [w for w, a in asked.items() if a] == ["running", "ended", "reused",
                                                      "refresh"], asked
        queue.stood_in.add(stems["ended"])
        assert not queue.floor_may(stems["ended"])
        took = [queue.pick(False, set(), floor=True) for _ in range(4)]
        assert [p and p.stem for p in took] == [stems["wanted"], stems["first"],
                                                stems["reused"], None], took
        # The idle lanes take what the floor leaves.
        assert {queue.pick(False, set()).stem for _ in range(2)} == {stems["running"],
                                                                    stems["ended"]}
    finally:
        later.kill()
        later.wait()


def test_the_floor_lane_leaves_a_store_an_early_entry_serves_to_idle_cpu(cache_dir, run_py,
                                                                       monkeypatch):
    """A process that ended kept early entries for what it compiled: with no idle CPU the
    floor lane, asked, finds them serving and leaves the full stores to the idle lanes
    (here they get CPU and store them), so its share of a busy machine goes to nothing that
    saves no compile."""
    import json

    from conftest import sql

    monkeypatch.delenv("KDB_DISABLE_EARLY_STORE")
    jobs = make_jobs(run_py, cache_dir, 2)
    [user] = (cache_dir / "v1").glob("pocl-*.kdb")
    details = [json.loads(d or "{}") for (d,) in sql(user, "SELECT details FROM kernels")]
    assert len(details) == 2 and all(d.get("provisional") for d in details), details
    busy = run_py(FIXED.format(none=True, jobs=str(jobs)))
    assert "floor" in busy.stdout.split() and "idle" in busy.stdout.split(), busy.stderr
    assert "an early entry serves it; left to idle CPU" in busy.stderr, busy.stderr
    details = [json.loads(d or "{}") for (d,) in sql(user, "SELECT details FROM kernels")]
    assert len(details) == 2 and not any(d.get("provisional") for d in details), details


def test_the_floor_lane_asks_before_it_takes_so_a_job_never_moves_back(cache_dir, run_py,
                                                                       monkeypatch):
    """Asked about a job an early entry serves (``?path``), the floor lane's child answers
    ``left`` without taking it: the job stays ``.job``, never renamed. Taking it and
    renaming it back could, to a process waiting for its store, look like a job that ended
    without its entry (that process then compiled it again: 10 compiles of 5, eight
    processes in step beside a CPU hog). Asked about a job nothing serves, it stores it."""
    import json

    from conftest import sql

    monkeypatch.delenv("KDB_DISABLE_EARLY_STORE")
    jobs = make_jobs(run_py, cache_dir, 1)
    (job,) = sorted(jobs.glob("*.job"))[:1]
    before = job.stat().st_ctime_ns  # a rename changes it, even one back to the same name
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDB_")}
    asked = subprocess.run([sys.executable, "-m", "kdb.worker", "--floor-child"],
                           input=f"?{job}\n", env=env, capture_output=True, text=True,
                           timeout=120)
    assert asked.stdout == "left\n", asked.stderr
    assert job.exists() and job.stat().st_ctime_ns == before
    stored_now = subprocess.run([sys.executable, "-m", "kdb.worker", "--floor-child"],
                                input=f"{job}\n", env=env, capture_output=True, text=True,
                                timeout=120)
    assert stored_now.stdout == "done\n", stored_now.stderr
    [user] = (cache_dir / "v1").glob("pocl-*.kdb")
    [(details,)] = sql(user, "SELECT details FROM kernels")
    assert not job.exists() and not json.loads(details or "{}").get("provisional")


def test_no_early_entry_stands_in_where_a_shared_tier_waits_for_the_publish(tmp_path,
                                                                           monkeypatch):
    """An early entry serves its node only; with a shared tier the job's store is the
    publish other nodes wait for (a keeper holds its cross-node locks until the job is
    gone): left to idle CPU as "served", other nodes waited out KDB_WAIT_TIMEOUT for it."""
    from kdb.storing.jobs import StoreJob
    from kdb.worker import supervisor as worker

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    stem = f"{time.time_ns() - 5_000_000_000:020d}-{ended.pid}-1"
    job = StoreJob(backend="opencl", entries=[{"key": "k"}])
    (tmp_path / (stem + spool.JOB)).write_text(job.to_json())
    queue = worker._Queue(tmp_path)
    queue.scan(set(), force=True)
    queue.stood_in.add(stem)  # the floor lane found an early entry serving it
    assert queue.may_stand_in(stem) and not queue.floor_may(stem)
    monkeypatch.setenv("KDB_SHARED_URL", "postgresql+psycopg://kdb@db.example/kdb")
    assert not queue.may_stand_in(stem) and queue.floor_may(stem)

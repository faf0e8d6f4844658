"""How long a process waits for another that compiles the same kernel (kdb.claims.waiting).

A waiter waits while the holder makes progress, however slow the machine makes it, and gives a
stuck holder up after its compile time and 2 s; a killed holder's claim comes free at once.
The processes are real, the compiles real PoCL builds (a slow one: ~2 s of CPU time), the
load real CPU-bound processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kdb import HashAttributes, KernelDB
from kdb.db import Hit
from conftest import sql
from test_claims import OPENCL_CHILD, start_together


# -- a holder that makes progress, slowly ------------------------------------------------------

SLOW_HOLDER = """
    import os, sys, time
    from kdb import HashAttributes, KernelDB
    from kdb.claims import Claim
    a = HashAttributes(backend="test", source="__kernel void k0() {}", arch="a1", name="k0")
    db = KernelDB(use_system=False)
    got = db.tiers.claim_or_wait(a)
    assert isinstance(got, Claim), got
    open(sys.argv[1], "w").close()
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:  # a compile on a crowded machine: a third of a CPU
        t = time.monotonic()
        while time.monotonic() - t < 0.02:
            pass
        time.sleep(0.04)
    db.tiers.storing.put_later(a, lambda: b"slow" * 20, compile_seconds=1.0, claim=got)
    db.flush()
    time.sleep(60)
"""


def _start(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.01)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.communicate()


def test_a_holder_that_makes_progress_is_waited_for_past_the_wall_clock_bound(
        cache_dir, tmp_path, monkeypatch):
    """4 s of a third of a CPU: more wall time than KDB_WAIT_TIMEOUT=2, less CPU time."""
    monkeypatch.setenv("KDB_WAIT_TIMEOUT", "2")
    ready = tmp_path / "held"
    holder = _start(SLOW_HOLDER, str(ready), "4")
    try:
        _wait_for(ready, holder)
        start = time.monotonic()
        got = KernelDB(use_system=False).tiers.claim_or_wait(
            HashAttributes(backend="test", source="__kernel void k0() {}", arch="a1", name="k0"))
        waited = time.monotonic() - start
        assert isinstance(got, Hit) and got.binary == b"slow" * 20, got
        assert waited > 2.5  # past KDB_WAIT_TIMEOUT in wall time: the holder made progress
    finally:
        _stop(holder)


def test_a_waiter_makes_the_user_file_while_the_holder_compiles(cache_dir, tmp_path):
    """A cold cache: the waiter, with nothing else to do, creates the user file the holder's
    store needs, while the holder still compiles (the claim file says so)."""
    import threading

    from kdb.claims import holder as holder_of

    a = HashAttributes(backend="test", source="__kernel void k0() {}", arch="a1", name="k0")
    ready = tmp_path / "held"
    holder = _start(SLOW_HOLDER, str(ready), "6")
    try:
        _wait_for(ready, holder)
        user = cache_dir / "v1" / "a1.kdb"
        assert not user.exists()
        got: list = []
        waiter = threading.Thread(
            target=lambda: got.append(KernelDB(use_system=False).tiers.claim_or_wait(a)))
        waiter.start()
        deadline = time.monotonic() + 60
        while not user.exists():
            assert time.monotonic() < deadline, "the user file never came"
            time.sleep(0.01)
        assert holder_of(cache_dir / "v1" / "claims", a.key).state == "compiling"
        waiter.join(timeout=120)
        assert isinstance(got[0], Hit), got
    finally:
        _stop(holder)


def test_progress_reads_a_process_tree_and_knows_a_stopped_one():
    from kdb.claims import progress

    burn = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                             "while time.time() - t < 30: pass"])
    try:
        start = progress.start_time(burn.pid)
        first = progress.sample(burn.pid, start)
        time.sleep(0.5)
        second = progress.sample(burn.pid, start)
        assert second.cpu > first.cpu and not second.stopped
        os.kill(burn.pid, signal.SIGSTOP)
        time.sleep(0.2)
        stopped = progress.sample(burn.pid, start)
        time.sleep(0.5)
        assert progress.sample(burn.pid, start).cpu == stopped.cpu and stopped.stopped
        assert progress.sample(burn.pid, start + 1) is None  # a reused pid is not the holder
        # This process's tree holds the burner: its CPU time counts as ours.
        assert progress.sample(os.getpid(), progress.start_time()).cpu >= stopped.cpu
    finally:
        os.kill(burn.pid, signal.SIGCONT)
        burn.kill()
        burn.wait()


# -- a holder that waits for the disk -------------------------------------------------------

class _Clock:
    """Stands in for :mod:`time` in :mod:`kdb.claims.waiting`: seconds that pass when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def test_a_holder_reading_from_the_disk_is_waited_for_until_kdb_wait_timeout(monkeypatch):
    """No CPU time for seconds while its compiler's pages come from a busy disk (state D) is
    not a stuck holder; a holder asleep (S) that long is. The first compile of a process that
    ran ptxas cold in CI took 2 s of such waiting, and three waiters compiled it again."""
    from kdb.claims import progress, waiting

    clock = _Clock()
    monkeypatch.setattr(waiting, "time", clock)
    monkeypatch.setattr(waiting, "longest", lambda: 0.0)  # no compile of this process counts
    ident = (1, 2, "compiling", 3.0)
    watch = waiting.Watch(timeout=60)
    assert watch.verdict(ident, "compiling", 0.0, 0.0, progress.Sample(1.0)) is None
    for _ in range(50):  # 50 s on the disk, without CPU time: past the 2 s stall bound
        clock.now += 1
        assert watch.verdict(ident, "compiling", 0.0, 0.0, progress.Sample(1.0, io=True)) is None
    clock.now += 11  # 61 s without CPU time: a hung file system is given up on after all
    why, stuck = watch.verdict(ident, "compiling", 0.0, 0.0, progress.Sample(1.0, io=True))
    assert stuck and "disk" in why and "KDB_WAIT_TIMEOUT" in why
    # Asleep, not on the disk: 2 s without progress is a stuck holder, as before.
    asleep = waiting.Watch(timeout=60)
    assert asleep.verdict(ident, "compiling", 0.0, 0.0, progress.Sample(1.0)) is None
    clock.now += 2.5
    why, stuck = asleep.verdict(ident, "compiling", 0.0, 0.0, progress.Sample(1.0))
    assert stuck and "made no progress" in why
    # A stopped holder is given up on whatever its state says.
    stopped = waiting.Watch(timeout=60)
    assert stopped.verdict(ident, "compiling", 0.0, 0.0, progress.Sample(1.0, True)) is None
    clock.now += 2.5
    why, _ = stopped.verdict(ident, "compiling", 0.0, 0.0, progress.Sample(1.0, True, io=True))
    assert "was stopped" in why


def _whole_disk(dev: int) -> str | None:
    """``major:minor`` of the disk holding device ``dev`` (a partition's disk), or None."""
    node = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not node.exists():
        return None  # overlayfs, tmpfs: no block device to throttle
    if (node / "partition").exists():
        node = node.resolve().parent
    return (node / "dev").read_text().strip()


@pytest.fixture
def slow_disk(tmp_path):
    """A block I/O cgroup (v1) that reads the disk under ``tmp_path`` at 1 MB/s; yields the
    file its processes join by writing their pid. Skips where there is none (no cgroup v1
    blkio, not root, tmp_path not on a disk)."""
    base = Path("/sys/fs/cgroup/blkio")
    disk = _whole_disk(os.stat(tmp_path).st_dev)
    if disk is None or not os.access(base, os.W_OK) \
            or not (base / "blkio.throttle.read_bps_device").exists():
        pytest.skip("no cgroup v1 block I/O throttle here (root, /sys/fs/cgroup/blkio and "
                    "a disk under the temporary directory are needed) to make a disk slow")
    group = base / f"kdb-test-{os.getpid()}-{tmp_path.name}"
    try:
        group.mkdir()
        (group / "blkio.throttle.read_bps_device").write_text(f"{disk} 1000000")
    except OSError as err:
        if group.exists():
            group.rmdir()
        pytest.skip(f"cannot throttle disk {disk} here ({err})")
    try:
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            (base / "cgroup.procs").write_text(pid)
        group.rmdir()


DISK_HOLDER = """
    import os, sys
    from kdb import HashAttributes, KernelDB
    from kdb.claims import Claim
    data, procs, ready = sys.argv[1:4]
    a = HashAttributes(backend="test", source="__kernel void k0() {}", arch="a1", name="k0")
    db = KernelDB(use_system=False)
    got = db.tiers.claim_or_wait(a)
    assert isinstance(got, Claim), got
    with open(procs, "w") as f:  # from now on this process reads the disk at 1 MB/s
        f.write(str(os.getpid()))
    open(ready, "w").close()
    fd = os.open(data, os.O_RDONLY)
    while os.read(fd, 1 << 16):  # a compiler's pages, read in from a busy disk: 4 s
        pass
    db.tiers.storing.put_later(a, lambda: b"read" * 20, compile_seconds=0.1, claim=got)
    db.flush()
    print("stored", flush=True)
"""


def test_a_holder_waiting_for_a_slow_disk_is_not_compiled_around(cache_dir, tmp_path,
                                                                 slow_disk):
    """The holder reads 4 MB at 1 MB/s before it stores: 4 s in uninterruptible sleep with no
    CPU time. The waiter waits for it (its claim says its compile took 0 s: 2 s without
    progress gives a sleeping holder up) and is served its entry."""
    from kdb.claims import progress

    data = tmp_path / "pages"
    with open(data, "wb") as f:
        f.write(os.urandom(4 << 20))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(data, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: from the disk
    os.close(fd)
    ready = tmp_path / "held"
    holder = _start(DISK_HOLDER, str(data), str(slow_disk), str(ready))
    try:
        _wait_for(ready, holder)
        start = time.monotonic()
        seen = []
        while len(seen) < 20 and holder.poll() is None:
            seen.append(progress.sample(holder.pid, progress.start_time(holder.pid)))
            time.sleep(0.05)
        got = KernelDB(use_system=False).tiers.claim_or_wait(
            HashAttributes(backend="test", source="__kernel void k0() {}", arch="a1", name="k0"))
        waited = time.monotonic() - start
        out, err = holder.communicate(timeout=120)
        assert holder.returncode == 0 and "stored" in out, err
        assert isinstance(got, Hit) and got.binary == b"read" * 20, got
        assert waited > 2.5  # past the stall bound: the disk, not a stuck holder
        assert any(s is not None and s.io for s in seen), "the holder never waited for the disk"
    finally:
        _stop(holder)


# -- a holder killed or stopped mid-compile (a real PoCL build) --------------------------------

#: A program PoCL takes about 2 s of CPU time to build (its front end and optimizer).
SLOW_SOURCE = ("__kernel void slow(__global float *a)\n{\n    float x = a[get_global_id(0)];\n"
               + "".join(f"    x = x * {1.0 + i * 1e-4:.6f}f + sin(x * {i % 7 + 1}.0f);\n"
                         for i in range(20000))
               + "    a[get_global_id(0)] = x;\n}\n")

BUILDER = """
    import json, os, sys, time
    import pyopencl as cl
    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    cl.Program(ctx, "__kernel void w(__global float *a) { a[0] = 1; }").build()  # PoCL is up
    import kdb.opencl
    from kdb import bookkeeping
    go = sys.argv[1]
    open(go + ".ready", "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    kdb.opencl.build(ctx, open(sys.argv[2]).read(), name="slow")
    done = time.time()
    recs = bookkeeping.records()
    print(json.dumps({"done": done, "compiles": len(recs),
                      "seconds": sum(r.seconds for r in recs)}), flush=True)
    os._exit(0)  # reading this program's binaries back takes PoCL minutes: never stored
"""


def _holder_and_waiter(tmp_path: Path, env: dict[str, str]):
    """A holder compiling the slow program and a waiter waiting for it; returns both."""
    src = tmp_path / "slow.cl"
    src.write_text(SLOW_SOURCE)
    cache = tmp_path / "cache"
    procs = []
    for name in ("holder", "waiter"):
        procs.append(_start(BUILDER, str(tmp_path / f"go-{name}"), str(src), env={
            **env, "KDB_CACHE_DIR": str(cache), "POCL_CACHE_DIR": str(tmp_path / f"pocl-{name}")}))
    holder, waiter = procs
    for name, proc in zip(("holder", "waiter"), procs):
        _wait_for(tmp_path / f"go-{name}.ready", proc)
    (tmp_path / "go-holder").touch()
    claims = cache / "v1" / "claims"
    deadline = time.monotonic() + 60
    while not [p for p in claims.glob("*.lock")
               if p.read_bytes().split()[:2] == [b"compiling", str(holder.pid).encode()]]:
        assert holder.poll() is None, holder.communicate()
        assert time.monotonic() < deadline, "the holder never claimed"
        time.sleep(0.005)
    (tmp_path / "go-waiter").touch()
    deadline = time.monotonic() + 60
    while not list(claims.glob("*.want")):  # the waiter waits for the holder now
        assert waiter.poll() is None, waiter.communicate()
        assert holder.poll() is None, "the holder finished before the waiter came: slow.cl builds too fast"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return holder, waiter


def test_a_holder_killed_mid_compile_costs_its_waiter_one_compile_and_2_s(tmp_path):
    holder, waiter = _holder_and_waiter(tmp_path, {"KDB_WAIT_TIMEOUT": "120"})
    try:
        killed = time.time()
        holder.kill()
        out, err = waiter.communicate(timeout=120)
        assert waiter.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["compiles"] == 1  # the claim came free with the holder's death
        # Far short of KDB_WAIT_TIMEOUT (120 s), with room for a busy machine (about 0.3 s).
        assert got["done"] - killed <= got["seconds"] + 10.0, (got, killed)
        assert "waited" not in err  # not given up on: it was gone
    finally:
        _stop(holder)
        _stop(waiter)


def test_a_stopped_holder_is_given_up_on_after_a_compile_time_and_2_s(tmp_path):
    """SIGSTOP: alive, its claim held, no progress. Not KDB_WAIT_TIMEOUT (120 s here)."""
    holder, waiter = _holder_and_waiter(tmp_path, {"KDB_WAIT_TIMEOUT": "120"})
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        stopped = time.time()
        out, err = waiter.communicate(timeout=120)
        assert waiter.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["compiles"] == 1
        # The stall bound (2 s: neither process compiled before), a look every 0.25 s; far
        # short of KDB_WAIT_TIMEOUT (120 s), with room for a busy machine.
        assert got["done"] - stopped <= got["seconds"] + 2.0 + 10.0, (got, stopped)
        assert "was stopped" in err and "not waiting for that process again" in err
    finally:
        _stop(holder)
        _stop(waiter)


# -- a holder others follow stores what it compiled since before it exits ------------------

STEP = """
    import json, os, sys, time
    import pyopencl as cl
    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
    ctx = cl.Context(plat.get_devices()[:1])
    import kdb.opencl
    from kdb import bookkeeping
    work = sys.argv[1]
    src = "__kernel void k%d(__global float *a) { a[get_global_id(0)] += %d.0f; }"

    def after(name):
        while not os.path.exists(os.path.join(work, name)):
            time.sleep(0.005)

    def build(i, done):
        kdb.opencl.build(ctx, src % (i, i), name=f"k{i}")
        open(os.path.join(work, done), "w").close()
"""

LEADER = STEP + """
    build(0, "leader-k0")
    after("go-leader-k1")
    build(1, "leader-k1")  # and exits at once
"""

FOLLOWER = STEP + """
    after("go-follower-k0")
    build(0, "follower-k0")  # waits for the leader, which stores k0 for it
    after("go-follower-k1")
    build(1, "follower-k1")  # the leader has exited by now
    print(json.dumps({"compiles": [r.name for r in bookkeeping.records()]}), flush=True)
"""


def test_a_followed_holder_stores_what_it_compiled_since_before_it_exits(tmp_path):
    """Ranks in step: the leader compiles the last kernel and exits before the others ask
    for it. They followed it (waited for k0), so it stores k1 before it goes; else, with the
    store worker behind (here it cannot run at all), each of them compiled k1 again."""
    import fcntl

    from kdb.config import private_dir
    from kdb.storing import spool

    import pyopencl  # noqa: F401 - sets PYOPENCL_HOME, a variable of the children's spool

    work = tmp_path / "work"
    work.mkdir()
    base = {**os.environ, "KDB_CACHE_DIR": str(tmp_path / "cache"),
            "KDB_STORE_AT_EXIT": "detach", "KDB_WAIT_TIMEOUT": "120"}
    env_leader = {**base, "POCL_CACHE_DIR": str(tmp_path / "pocl-leader")}
    sdir = private_dir(spool.spool_dir(tmp_path / "cache" / "v1", env_leader))
    held = os.open(sdir / spool.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # no store worker for the leader's jobs
    leader = _start(LEADER, str(work), env=env_leader)
    follower = _start(FOLLOWER, str(work), env={**base, "POCL_CACHE_DIR": str(tmp_path / "pf")})
    try:
        _wait_for(work / "leader-k0", leader)
        (work / "go-follower-k0").touch()
        _wait_for(work / "follower-k0", follower)
        (work / "go-leader-k1").touch()
        _, err = leader.communicate(timeout=120)
        assert leader.returncode == 0, err
        (work / "go-follower-k1").touch()
        out, err = follower.communicate(timeout=120)
        assert follower.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"compiles": []}
    finally:
        os.close(held)
        _stop(leader)
        _stop(follower)


HOLDS_ON = STEP + """
    build(0, "holder-k0")
    time.sleep(120)  # alive, the program in hand, its store job queued
"""

ASKS = STEP + """
    after("go-asker")
    build(0, "asker-k0")
    print(json.dumps({"compiles": [r.name for r in bookkeeping.records()]}), flush=True)
"""


def test_a_holder_stores_a_wanted_entry_that_a_starved_lane_took(tmp_path):
    """A store worker's lane took the job first and gets no CPU (played here by this test,
    holding the job's flock): the holder, alive with the program in hand, stores the entry
    for the process that waits anyway; it used to leave it to the lane."""
    import fcntl

    from kdb.config import private_dir
    from kdb.storing import jobfiles, spool

    import pyopencl  # noqa: F401 - sets PYOPENCL_HOME, a variable of the children's spool

    work = tmp_path / "work"
    work.mkdir()
    base = {**os.environ, "KDB_CACHE_DIR": str(tmp_path / "cache"),
            "KDB_STORE_AT_EXIT": "detach", "KDB_WAIT_TIMEOUT": "120"}
    env_holder = {**base, "POCL_CACHE_DIR": str(tmp_path / "pocl-holder")}
    sdir = private_dir(spool.spool_dir(tmp_path / "cache" / "v1", env_holder))
    held = os.open(sdir / spool.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # no real worker
    holder = _start(HOLDS_ON, str(work), env=env_holder)
    asker = _start(ASKS, str(work), env={**base, "POCL_CACHE_DIR": str(tmp_path / "pa")})
    lane = None
    try:
        _wait_for(work / "holder-k0", holder)
        [job] = [p for p in sdir.iterdir() if p.suffix == jobfiles.JOB]
        lane = jobfiles.take(job)  # the lane's flock and rename: it "stores" it, never done
        assert lane is not None
        (work / "go-asker").touch()
        out, err = asker.communicate(timeout=120)
        assert asker.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"compiles": []}
        assert "waited" not in err
    finally:
        if lane is not None:
            os.close(lane)
        os.close(held)
        _stop(holder)
        _stop(asker)


# -- many processes: exactly one compile each, on a quiet or a loaded machine ------------------

def _lockstep(tmp_path: Path, procs: int, kernels: int, env: dict[str, str]) -> int:
    """``procs`` processes build the same ``kernels`` in the same order (ranks of one job);
    returns how many compiles they made, after checking every result and the user file."""
    from kdb.backends.opencl import arch_of
    import pyopencl as cl

    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
    arch = arch_of(plat.get_devices()[0])
    cache = tmp_path / "cache"
    results, _ = start_together(OPENCL_CHILD, procs, tmp_path / "work", {
        "KDB_CACHE_DIR": str(cache), "TEST_KERNELS": str(kernels), "TEST_ORDER": "same",
        "KDB_STORE_AT_EXIT": "detach", **env})
    assert [r["correct"] for r in results] == [kernels] * procs
    path = cache / "v1" / f"{arch}.kdb"
    deadline = time.monotonic() + 120
    while sql(path, "SELECT count(*) FROM kernels") != [(kernels,)]:  # the worker's stores
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return sum(r["compiles"] for r in results)


def test_eight_processes_in_step_compile_each_kernel_once(tmp_path, cl_ctx):
    """The same order in every process: one holder ahead, seven a step behind, the last
    kernel wanted as the holder exits (it stores it before it goes)."""
    assert _lockstep(tmp_path, 8, 5, {}) == 5


@pytest.fixture
def loaded_machine():
    """CPU-bound processes, four per CPU, at the tests' own priority, while the test runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(4 * (os.cpu_count() or 1))]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_loaded_machine_still_compiles_each_kernel_once(tmp_path, cl_ctx, loaded_machine):
    """Each compile and store takes many times its wall time under the load (9-13 s beside
    more load), far past KDB_WAIT_TIMEOUT=3; the holders make progress all along, so nobody
    compiles twice. (The timeout also bounds the CPU time a holder may spend on one step: at
    1 s, a compile under that much load once passed it.)"""
    assert _lockstep(tmp_path, 4, 3, {"KDB_WAIT_TIMEOUT": "3"}) == 3


def test_the_account_of_waits_for_other_nodes_is_one_budget_and_survives_damage(tmp_path):
    """kdb.claims.nodes: waits in vain add up to one budget (10 x the timeout) shared by the
    node's processes; an entry clears it; old waits are forgotten; garbage, a FIFO or a
    directory where the account should be cost nothing and never block."""
    from kdb.claims import nodes

    assert nodes.left(tmp_path, 1.0) == 10.0
    nodes.add(tmp_path, 4.0)
    nodes.add(tmp_path, 3.5)
    assert nodes.spent(tmp_path, 1.0) == pytest.approx(7.5)
    assert nodes.left(tmp_path, 1.0) == pytest.approx(2.5)
    nodes.clear(tmp_path)  # a wait that ended with the other node's entry
    assert nodes.left(tmp_path, 1.0) == 10.0
    nodes.add(tmp_path, 20.0)
    assert nodes.left(tmp_path, 1.0) == 0.0
    old = time.time() - nodes.window(1.0) - 1
    with open(tmp_path / nodes.NAME, "w") as f:  # a wait from before the window, and damage
        f.write(f"{old} 20.0\nnot numbers\n1 2 3\n{time.time()} -5\n{time.time()} nan\n\x00\x00")
    assert nodes.spent(tmp_path, 1.0) == 0.0
    for make in (os.mkfifo, os.mkdir):
        path = tmp_path / make.__name__
        path.mkdir()
        make(str(path / nodes.NAME))
        start = time.monotonic()
        nodes.add(path, 5.0)
        assert nodes.spent(path, 1.0) == 0.0 and time.monotonic() - start < 10  # no hang

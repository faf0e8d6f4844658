"""Single-flight compiles across processes: one process compiles a key, the others wait.

The processes here are real (fresh interpreters started together behind a barrier: each
waits for a start file), the compiles real (PoCL) or a function that sleeps and counts its
calls in a shared file. KDB_LONG_TESTS=1 repeats the stress runs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kdb import HashAttributes, KernelDB, claims
from kdb.storing import background
from kdb.claims import Claim
from kdb.db import Hit
from conftest import sql

LONG = os.environ.get("KDB_LONG_TESTS") == "1"


def attrs(i: int | str = 0, arch: str = "a1") -> HashAttributes:
    return HashAttributes(backend="test", source=f"__kernel void k{i}() {{}}", arch=arch,
                          name=f"k{i}")


def start_together(code: str, n: int, work: Path, env: dict[str, str],
                   timeout: float = 600) -> tuple[list[dict], float]:
    """Start ``n`` children running ``code`` (argv: work dir, index); each signals
    ``ready-<i>`` and waits for ``start``. Returns their last stdout lines as JSON and the
    wall time from the start signal until the last one exited."""
    work.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(n):
        full = {**os.environ, **env, "POCL_CACHE_DIR": str(work / f"pocl-{i}")}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(work), str(i)], env=full,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + timeout
        while len(list(work.glob("ready-*"))) < n:
            dead = [p for p in procs if p.poll() is not None]
            assert not dead, dead[0].communicate()
            assert time.monotonic() < deadline, "children never got ready"
            time.sleep(0.01)
        start = time.perf_counter()
        (work / "start").touch()
        outs = [p.communicate(timeout=timeout) for p in procs]
        wall = time.perf_counter() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"child failed ({p.returncode}):\n{out}\n{err}"
        for bad in ("Traceback", "Error", "FAILURE", "could not"):
            assert bad not in err, err
        assert "waited" not in err, err  # no process ran past KDB_WAIT_TIMEOUT
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results, wall


BARRIER = """
    import os, sys, time
    work, idx = sys.argv[1], int(sys.argv[2])
    def barrier():
        open(os.path.join(work, f"ready-{idx}"), "w").close()
        while not os.path.exists(os.path.join(work, "start")):
            time.sleep(0.002)
"""

# -- the generic API -----------------------------------------------------------------------

GENERIC_CHILD = BARRIER + """
    import json, random
    import kdb
    from kdb import HashAttributes, KernelDB, bookkeeping
    keys = int(os.environ["TEST_KEYS"])
    db = KernelDB(use_system=False)
    barrier()

    def compile_fn(i):
        def run():
            time.sleep(0.2)
            with open(os.path.join(work, "compiled"), "a") as f:
                f.write(f"{idx} {i}\\n")
            return b"binary of kernel %d;" % i * 100
        return run

    order = list(range(keys))
    random.Random(idx).shuffle(order)
    ok = True
    for i in order:
        a = HashAttributes(backend="test", source=f"kernel {i}", arch="a1", name=f"k{i}")
        ok &= db.get_or_compile(a, compile_fn(i)) == b"binary of kernel %d;" % i * 100
    print(json.dumps({"ok": ok, "compiles": len(bookkeeping.records())}))
"""


def _generic_round(work: Path, procs: int, keys: int) -> float:
    cache = work / "cache"
    results, wall = start_together(GENERIC_CHILD, procs, work,
                                   {"KDB_CACHE_DIR": str(cache), "TEST_KEYS": str(keys)})
    assert all(r["ok"] for r in results)
    compiled = (work / "compiled").read_text().splitlines()
    assert len(compiled) == keys, compiled  # each key compiled exactly once
    assert sorted(int(line.split()[1]) for line in compiled) == list(range(keys))
    assert sum(r["compiles"] for r in results) == keys
    path = cache / "v1" / "a1.kdb"
    assert sql(path, "SELECT count(*) FROM compile_log") == [(keys,)]
    assert sql(path, "SELECT count(*) FROM kernels") == [(keys,)]
    return wall


def test_threads_of_one_process_building_one_kernel_compile_it_once(cache_dir):
    """A second thread asking for a kernel the first is compiling waits for it (it compiled
    too: the claim was this process's, and a process never waits on itself)."""
    db = KernelDB(use_system=False)
    calls, started = [], threading.Event()

    def compile_fn() -> bytes:
        calls.append(threading.get_ident())
        started.set()
        time.sleep(0.5)
        return b"binary"

    got: list[bytes] = []
    first = threading.Thread(target=lambda: got.append(db.get_or_compile(attrs(), compile_fn)))
    first.start()
    assert started.wait(30)
    got.append(db.get_or_compile(attrs(), compile_fn))
    first.join()
    db.flush()
    assert got == [b"binary", b"binary"] and len(calls) == 1, calls
    # A compile that fails leaves the waiter to compile itself (its failure is its own).
    calls.clear()
    started.clear()

    def failing() -> bytes:
        calls.append(1)
        started.set()
        time.sleep(0.3)
        raise RuntimeError("boom")

    def try_it() -> None:
        try:
            db.get_or_compile(attrs(2), failing)
        except RuntimeError:
            pass
    thread = threading.Thread(target=try_it)
    thread.start()
    assert started.wait(30)
    assert db.get_or_compile(attrs(2), lambda: b"second") == b"second"
    thread.join()


def test_eight_processes_compile_each_key_once(tmp_path):
    rounds = 10 if LONG else 1
    walls = [_generic_round(tmp_path / f"round-{r}", 8, 10) for r in range(rounds)]
    print(f"\ngeneric single flight: {rounds} round(s) of 8 processes x 10 keys, "
          f"10 compiles each, wall {min(walls):.2f}-{max(walls):.2f} s")


# -- the stress test: 8 processes, 20 OpenCL kernels on PoCL --------------------------------

OPENCL_CHILD = BARRIER + """
    import json, random
    import numpy as np
    import pyopencl as cl
    import kdb, kdb.opencl
    from kdb import bookkeeping
    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
    ctx = cl.Context(plat.get_devices())
    queue = cl.CommandQueue(ctx)
    src = ("__kernel void k%d(__global float *a) "
           "{ int g = get_global_id(0); a[g] = a[g] * %d.0f + %d.0f; }")
    kernels = int(os.environ["TEST_KERNELS"])
    barrier()
    order = list(range(kernels))
    if os.environ.get("TEST_ORDER") != "same":
        random.Random(idx).shuffle(order)  # processes ask in different orders: many holders
    correct = 0
    for i in order:
        prg = kdb.opencl.build(ctx, src % (i, i + 2, i), name=f"k{i}")
        host = np.arange(64, dtype=np.float32)
        buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
        getattr(prg, f"k{i}")(queue, host.shape, None, buf)
        out = np.empty_like(host)
        cl.enqueue_copy(queue, out, buf)
        correct += bool(np.array_equal(out, host * (i + 2) + i))
    kdb.default_db().flush()
    print(json.dumps({"correct": correct, "compiles": len(bookkeeping.records())}))
"""


def test_eight_processes_on_a_cold_cache_compile_twenty_kernels_once(tmp_path, cl_ctx):
    from kdb.backends.opencl import arch_of

    arch = arch_of(cl_ctx.devices[0])
    rounds = 3 if LONG else 1
    walls = []
    for r in range(rounds):
        work = tmp_path / f"round-{r}"
        cache = work / "cache"
        results, wall = start_together(OPENCL_CHILD, 8, work,
                                       {"KDB_CACHE_DIR": str(cache), "TEST_KERNELS": "20"})
        walls.append(wall)
        assert [r["correct"] for r in results] == [20] * 8
        assert sum(r["compiles"] for r in results) == 20
        path = cache / "v1" / f"{arch}.kdb"
        assert sql(path, "SELECT count(*) FROM compile_log") == [(20,)]
        assert sql(path, "SELECT count(DISTINCT key) FROM compile_log") == [(20,)]
        assert sql(path, "SELECT count(*) FROM kernels") == [(20,)]
        assert not list((cache / "v1" / "claims").glob("*.lock"))
    print(f"\nOpenCL stress: {rounds} round(s) of 8 processes x 20 kernels, 20 compiles each, "
          f"wall {min(walls):.1f}-{max(walls):.1f} s")


# -- claims: expiry, bounded waits ---------------------------------------------------------

HOLDER = """
    import os, sys, time
    import kdb
    from kdb import HashAttributes, KernelDB
    from kdb.claims import Claim
    a = HashAttributes(backend="test", source="__kernel void k0() {}", arch="a1", name="k0")
    got = KernelDB(use_system=False).tiers.claim_or_wait(a)
    assert isinstance(got, Claim), got
    open(sys.argv[1], "w").close()
    time.sleep(120)
"""


@pytest.fixture
def holder(cache_dir, tmp_path):
    """Start a process that claims attrs(0) and sleeps; yields it (killed at the end)."""
    ready = tmp_path / "held"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(ready)],
                            env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_claim_of_a_killed_process_is_taken_over(cache_dir, holder, monkeypatch):
    monkeypatch.setenv("KDB_WAIT_TIMEOUT", "120")  # the wait must end by the kill, not this
    a = attrs(0)
    db = KernelDB(use_system=False)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(db.tiers.claim_or_wait(a)), daemon=True)
    waiter.start()
    want = cache_dir / "v1" / "claims" / f"{a.key}.want"
    deadline = time.monotonic() + 60
    while not want.exists():  # the waiter is waiting
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not got
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    waiter.join(60)
    assert not waiter.is_alive()
    assert isinstance(got[0], Claim)  # the claim passed to the waiter: no timeout (None)
    out = db.get_or_compile(a.with_(source="__kernel void other() {}"), lambda: b"x" * 10)
    assert out == b"x" * 10
    got[0].release()


def test_a_forked_child_does_not_keep_its_parents_claims(tmp_path):
    """A child forked while its parent compiled (a pool worker, a DataLoader) kept the claim's
    fd, and so its ``flock``, after the parent died: another process waited for the dead
    holder up to ``KDB_WAIT_TIMEOUT``. The child's copy is closed at the fork; the parent's
    lock is the parent's alone."""
    code = textwrap.dedent("""
        import os, sys, time
        from pathlib import Path
        from kdb import claims
        assert claims.try_claim(Path(sys.argv[1]), "f0" * 32) is not None
        child = os.fork()
        if child == 0:  # kdb's fork hooks have run here
            Path(sys.argv[1], "forked").touch()
            time.sleep(120)
            os._exit(0)
        while not Path(sys.argv[1], "forked").exists():
            time.sleep(0.01)
        print(child, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], text=True,
                              stdout=subprocess.PIPE)
    child = int(parent.stdout.readline())
    try:
        assert claims.try_claim(tmp_path, "f0" * 32) is None  # the parent holds it
        parent.kill()
        parent.wait()
        claim = claims.try_claim(tmp_path, "f0" * 32)
        assert claim is not None, "the forked child still holds its dead parent's claim"
        claim.release()
    finally:
        parent.kill()
        os.kill(child, signal.SIGKILL)


def test_a_waiter_past_its_bound_compiles_itself(cache_dir, holder, monkeypatch, caplog):
    monkeypatch.setenv("KDB_WAIT_TIMEOUT", "0.3")
    calls = []
    db = KernelDB(use_system=False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        out = db.get_or_compile(attrs(0), lambda: calls.append(1) or b"mine" * 10)
    assert out == b"mine" * 10 and calls == [1]
    assert holder.poll() is None  # the holder still holds it: this process did not wait it out
    assert "waited" in caplog.text and "KDB_WAIT_TIMEOUT" in caplog.text
    db.flush()
    assert KernelDB(use_system=False).get(attrs(0)) == b"mine" * 10


PUBLISHER = """
    import os, sys, time
    import kdb
    from kdb import HashAttributes, KernelDB; from kdb.storing import background
    background.QUIET_S = 3600  # without a waiter this process would not store for an hour
    a = HashAttributes(backend="test", source="__kernel void k0() {}", arch="a1", name="k0")
    KernelDB(use_system=False).get_or_compile(a, lambda: b"published" * 20)
    open(sys.argv[1], "w").close()
    time.sleep(120)
"""


def test_a_holder_publishes_at_once_when_another_process_waits(cache_dir, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("KDB_WAIT_TIMEOUT", "60")
    ready = tmp_path / "compiled"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PUBLISHER), str(ready)],
                            env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    try:
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.01)
        got = KernelDB(use_system=False).tiers.claim_or_wait(attrs(0))
        assert isinstance(got, Hit) and got.binary == b"published" * 20
        assert proc.poll() is None  # published by a live process, not at its exit
    finally:
        proc.kill()
        proc.wait()


def test_no_database_lock_is_held_while_compiling(cache_dir, run_py):
    """Another process stores while this one compiles (it holds a claim, not a lock)."""
    db = KernelDB(use_system=False)
    db.put(attrs("seed"), b"seed")  # the file exists, at the head revision

    def compile_fn() -> bytes:
        proc = run_py("""
            import kdb
            a = kdb.HashAttributes(backend="test", source="other", arch="a1")
            print(kdb.KernelDB(use_system=False).put(a, b"other" * 10))
        """, env={"KDB_STRICT": "1"})
        assert proc.stdout.split() == ["True"]
        return b"compiled" * 10

    assert db.get_or_compile(attrs(1), compile_fn) == b"compiled" * 10
    db.flush()
    other = HashAttributes(backend="test", source="other", arch="a1")
    assert db.get(other) == b"other" * 10 and db.get(attrs(1)) == b"compiled" * 10


def test_claims_leave_no_files_behind(cache_dir):
    db = KernelDB(use_system=False)
    for i in range(3):
        db.get_or_compile(attrs(i), lambda: b"bin" * 10)
    db.flush()
    left = list((cache_dir / "v1" / "claims").iterdir())
    assert left == []
    assert claims.any_wanted() is False


def test_a_failed_compile_releases_its_claim(cache_dir, monkeypatch):
    monkeypatch.setenv("KDB_WAIT_TIMEOUT", "2")  # a kept claim: a 2 s wait, then None
    db = KernelDB(use_system=False)

    def fail() -> bytes:
        raise RuntimeError("compiler exploded")

    with pytest.raises(RuntimeError):
        db.get_or_compile(attrs(0), fail)
    got = db.tiers.claim_or_wait(attrs(0))  # would wait for itself if the claim were kept
    assert isinstance(got, Claim)
    got.release()
    background.drain()


def test_a_pending_claim_given_a_budget_is_waited_for_that_long(tmp_path):
    """``mark_pending(seconds, budget=)``: the lock file says what makes a waiter give the
    holder ``budget`` of CPU time (an AOTAutograd entry that may never come), not a few
    times the compile; without a budget, a few times the compile."""
    from kdb import claims
    from kdb.claims.waiting import pending_wait

    claim = claims.try_claim(tmp_path, "k" * 64)
    try:
        claim.mark_pending(100.0, budget=20.0)
        said = claims.holder(tmp_path, "k" * 64)
        assert said.state == claims.PENDING and pending_wait(said.seconds) == pytest.approx(20.0)
        claim.mark_pending(3.0)
        assert pending_wait(claims.holder(tmp_path, "k" * 64).seconds) == pytest.approx(12.0)
    finally:
        claim.release()


def test_a_request_served_after_waiting_is_one_hit_not_also_a_miss(cache_dir):
    """A build that waited for another's compile and was then served counted a miss and a
    hit: kdb stats and kdb run's report said 6 misses and 3 hits for 6 requests."""
    from kdb import bookkeeping

    db = KernelDB()
    a = attrs("waited")
    started, go = threading.Event(), threading.Event()

    def slow() -> bytes:
        started.set()
        go.wait(30)
        return b"binary" * 10

    before = dict(bookkeeping.process_counts())
    first = threading.Thread(target=db.get_or_compile, args=(a, slow))
    first.start()
    assert started.wait(30)
    served = []
    second = threading.Thread(target=lambda: served.append(
        db.get_or_compile(a, lambda: b"never compiled")))
    second.start()
    time.sleep(0.3)  # the second thread is waiting for the first's compile
    go.set()
    first.join(30)
    second.join(30)
    db.flush()
    db.close()
    assert served == [b"binary" * 10]
    now = bookkeeping.process_counts()
    delta = {k: now.get(k, 0) - before.get(k, 0) for k in ("misses", "compiles")}
    hits = sum(now.get(k, 0) - before.get(k, 0) for k in now if k.startswith("hits."))
    assert delta == {"misses": 1, "compiles": 1} and hits == 1, (delta, hits)

"""kdb.storing.background beside CPU-bound work: a costly store (reading a PoCL program's
binaries) waits for idle CPU before it starts, a store of bytes in hand does not, and one
that started finishes at exit at the process's priority (KDB_STORE_AT_EXIT=wait)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"),
                                reason="the idle-CPU test reads /proc/stat (Linux)")

# A job that spends about a second of CPU time in this process.
CHILD = """
    import os, sys, threading, time
    from kdb.storing import background
    background.QUIET_S = 0.0
    background.IDLE_CPUS = {idle_cpus}

    def job():
        where = "main" if threading.current_thread() is threading.main_thread() else "thread"
        print("started", where, flush=True)
        end = time.process_time() + 1.0
        while time.process_time() < end:
            pass
        print("stored", flush=True)

    background.submit(job, costly={costly})
    print("submitted", flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def _hogs() -> list[subprocess.Popen]:
    """One CPU-bound process per CPU this process may use, at normal priority."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def _child(tmp_path, idle_cpus: float, costly: bool = True) -> subprocess.Popen:
    code = textwrap.dedent(CHILD.format(idle_cpus=idle_cpus, costly=costly))
    return subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "go")],
                            stdout=subprocess.PIPE, text=True)


def test_a_store_started_in_a_quiet_moment_finishes_at_exit_beside_cpu_bound_work(tmp_path):
    """The thread started the store (the machine counted as idle), then every CPU got busy:
    the exit waits for it at the process's priority, a few seconds. At nice 19 it got about
    1% of a CPU and the exit waited out KDB_STORE_TIMEOUT (120 s) for it."""
    child = _child(tmp_path, idle_cpus=0.0)
    hogs = []
    try:
        assert child.stdout.readline().strip() == "submitted"
        assert child.stdout.readline().strip() == "started thread"
        hogs = _hogs()
        time.sleep(0.5)
        start = time.monotonic()
        (tmp_path / "go").touch()
        out, _ = child.communicate(timeout=120)
        took = time.monotonic() - start
    finally:
        _stop(hogs + [child])
    assert child.returncode == 0 and out.split() == ["stored"]
    assert took < 30, took  # about 2 s; 60 s and more at nice 19


def _busy_machine() -> list[subprocess.Popen]:
    """Hogs that leave this machine no idle CPU (skips where they cannot)."""
    from kdb.storing import background

    hogs = _hogs()
    time.sleep(0.5)
    before = background._idle_seconds()
    time.sleep(1.0)
    if background._idle_seconds() - before >= background.IDLE_CPUS:
        _stop(hogs)
        pytest.skip("CPU-bound processes could not fill this machine's CPUs "
                    "(a CPU quota smaller than the CPUs /proc/stat counts)")
    return hogs


def test_no_costly_store_starts_while_the_machine_has_no_idle_cpu(tmp_path):
    """Beside one CPU-bound process per CPU the quiet process does not start a costly store;
    the exit stores it."""
    from kdb.storing import background

    hogs = _busy_machine()
    child = None
    try:
        child = _child(tmp_path, idle_cpus=background.IDLE_CPUS)
        assert child.stdout.readline().strip() == "submitted"
        time.sleep(3.0)
        (tmp_path / "go").touch()
        out, _ = child.communicate(timeout=120)
    finally:
        _stop(hogs + ([child] if child else []))
    assert child.returncode == 0 and out.splitlines() == ["started main", "stored"]


def test_a_store_of_bytes_in_hand_starts_once_quiet_on_a_machine_never_idle(tmp_path):
    """A store whose binary is in hand (a compress and an insert) does not wait for idle CPU:
    on a machine that is never idle it would wait for the exit, and a job killed at its time
    limit would lose it. Beside one CPU-bound process per CPU it starts on the thread."""
    from kdb.storing import background

    hogs = _busy_machine()
    child = None
    try:
        child = _child(tmp_path, idle_cpus=background.IDLE_CPUS, costly=False)
        time.sleep(3.0)  # the costly store above is still waiting by now
        (tmp_path / "go").touch()
        out, _ = child.communicate(timeout=120)
    finally:
        _stop(hogs + ([child] if child else []))
    # The thread's lines and the main thread's may interleave, even within a line.
    assert child.returncode == 0 and "thread" in out and "main" not in out, out
    assert "stored" in out, out


BURST = """
    import threading, time
    from kdb.storing import background
    background.QUIET_S = 3600.0  # never quiet: a process that compiles without pause
    stored = []
    backlog = getattr(background, "BACKLOG", 64)
    for i in range(3 * backlog):
        background.submit(lambda i=i: stored.append(threading.current_thread().name))
        time.sleep(0.002)
    deadline = time.monotonic() + 60
    while background.pending() > backlog and time.monotonic() < deadline:
        time.sleep(0.01)
    print(background.pending(), stored.count("kdb-store"), flush=True)
"""


def test_a_process_that_never_pauses_holds_at_most_a_backlog_of_stores():
    """Stores of bytes in hand wait for a quiet moment, but not past ``BACKLOG`` of them: an
    autotuner that compiles for an hour would otherwise hold every binary until its exit."""
    from kdb.storing import background

    out = subprocess.run([sys.executable, "-c", textwrap.dedent(BURST)], capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    pending, by_thread = int(out[0]), int(out[1])
    assert pending <= background.BACKLOG
    assert by_thread >= 2 * background.BACKLOG - 1  # stored on the thread, before the exit


CTRL_C = """
    import os, signal, sys, threading, time
    from kdb import HashAttributes, KernelDB

    db = KernelDB(cache_dir=sys.argv[1], use_system=False)
    attrs = [HashAttributes(backend="test", source=f"s{i}", arch="a1", name=f"k{i}")
             for i in range(3)]

    def recheck(a):
        return lambda: (time.sleep(3), a.headers)[1]

    for a in attrs:
        db.get_or_compile(a, lambda: b"x" * 10, recheck=recheck(a))
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.daemon = True  # else the exit waits for it, and the Ctrl-C lands there
    timer.start()
    {end}
"""


def test_ctrl_c_interrupts_a_flush(tmp_path):
    """A flush runs the stores not started yet on the caller's thread: the catch that keeps
    a store's failure from killing the store thread caught the caller's KeyboardInterrupt
    too ("background store failed: "), and the flush returned as if done."""
    end = """
    try:
        db.flush()
    except KeyboardInterrupt:
        print("interrupted")
        sys.exit(3)
    print("finished normally")
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CTRL_C.replace("{end}", end)),
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip()) == (3, "interrupted"), proc.stderr
    assert "background store failed" not in proc.stderr


def test_ctrl_c_at_exit_stops_the_stores_with_one_line(tmp_path):
    """At exit, each Ctrl-C ended only the store it landed in: three queued stores took
    three presses, each "background store failed: " with no reason."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CTRL_C.replace("{end}", "")),
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 7 + 3 * 3  # not every store's 3 s
    assert "background store failed" not in proc.stderr
    assert "interrupted" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

"""kdb.lifecycle: the exit runs in the order its docstring gives; a forked child starts with
none of its parent's per-process state."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import kdb
from kdb import lifecycle
from conftest import sql


def test_exit_hooks_run_phase_by_phase_whatever_the_registration_order():
    code = """
        from kdb import lifecycle
        for phase, text in [(lifecycle.REPORT, "report"), (lifecycle.SUMMARY, "summary"),
                            (lifecycle.STORES, "stores"), (lifecycle.BOOKKEEPING, "book"),
                            (lifecycle.STORES, "stores-2")]:
            lifecycle.on_exit(phase, lambda text=text: print(text, flush=True))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == ["book", "stores", "stores-2", "summary", "report"]


def test_a_failing_exit_hook_does_not_stop_the_others():
    code = """
        from kdb import lifecycle
        lifecycle.on_exit(lifecycle.BOOKKEEPING, lambda: 1 / 0)
        lifecycle.on_exit(lifecycle.REPORT, lambda: print("reported", flush=True))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True)
    assert proc.returncode == 0
    assert proc.stdout.split() == ["reported"]
    assert "division by zero" in proc.stderr


def test_kdb_registers_its_hooks_in_the_documented_phases():
    from kdb.storing import background, holding
    from kdb import bookkeeping  # noqa: F401 - they register

    holding._register_exit() if not holding._exit_registered else None
    phases = {}
    for phase, hook in lifecycle._exit_hooks:
        phases.setdefault(hook.__module__, set()).add(phase)
    assert lifecycle.BOOKKEEPING in phases["kdb.bookkeeping"]
    assert phases["kdb.storing.background"] == {lifecycle.STORES}
    assert phases["kdb.storing.holding"] == {lifecycle.STORES}
    assert lifecycle.SUMMARY in phases["kdb.bookkeeping"]
    assert lifecycle.REPORT in phases["kdb.bookkeeping"]


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError):
        lifecycle.on_exit(99, lambda: None)


def test_a_forked_child_that_exits_normally_does_not_count_the_parents_hits(cache_dir):
    """Batched hit counts belong to the process that counted them: a child forked before
    they were written exits without writing them a second time."""
    attrs = kdb.HashAttributes(backend="opencl", source="__kernel void f() {}", arch="forkarch",
                               name="f")
    db = kdb.KernelDB()
    assert db.put(attrs, b"binary")
    db.close()
    code = f"""
        import os, sys
        import kdb
        db = kdb.KernelDB()
        a = kdb.HashAttributes(backend="opencl", source="__kernel void f() {{}}",
                               arch="forkarch", name="f")
        for _ in range(3):
            assert db.get(a) == b"binary"
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: the child runs the exit hooks too
        os.waitpid(pid, 0)
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True)
    path = cache_dir / "v1" / "forkarch.kdb"
    assert sql(path, "SELECT hits FROM kernels WHERE key = ?", (attrs.key,)) == [(3,)]
    assert sql(path, "SELECT value FROM counters WHERE name = 'hits.user'") == [(3,)]


def test_a_drain_runs_the_stores_not_started_in_the_waiting_thread():
    """A thread that waits for the background stores (at exit, a flush) runs those not
    started itself, at its own priority, without waiting for the quiet period or idle CPU
    (tests/test_background.py)."""
    import threading

    from kdb.storing import background

    ran = []
    background.submit(lambda: ran.append(threading.get_ident()))
    assert background.drain(30) == [] and background.pending() == 0
    assert ran == [threading.get_ident()]


def test_ctrl_c_at_exit_says_what_its_phase_loses_and_the_later_hooks_run(monkeypatch,
                                                                         caplog):
    """One line for one Ctrl-C, naming what was lost where it landed: in the bookkeeping
    phase it said "kernels not stored yet compile again next run" while the stores then ran
    in full and the counts and compile log were what was lost."""
    import logging

    from kdb import lifecycle

    ran = []

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(lifecycle, "_exit_hooks", [
        (lifecycle.BOOKKEEPING, interrupted), (lifecycle.STORES, lambda: ran.append("stores")),
        (lifecycle.SUMMARY, lambda: ran.append("summary"))])
    with caplog.at_level(logging.WARNING, logger="kdb"):
        lifecycle.run_exit_hooks()
    assert ran == ["stores", "summary"]
    assert "counts and compile log are not written" in caplog.text
    assert "compile again" not in caplog.text

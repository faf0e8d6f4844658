"""``kdb clear`` beside running programs: no process loses its user tier, none is misled.

Real processes build the same kernels through ``install()`` (storing them themselves,
``KDB_STORE_AT_EXIT=wait``) while another process runs ``kdb clear`` in a loop. A writer
that finds its file removed mid-upgrade or mid-write makes the new one; after the clears
stop, each process's next build is stored.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("pyopencl")

PROCESSES = 3
KERNELS = 10

CHILD = r"""
import os, sys, time
import numpy as np
import pyopencl as cl
import kdb, kdb.opencl
from kdb.storing import background
tag, n, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kdb.opencl.install()
plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1])
queue = cl.CommandQueue(ctx)

def run(name, value):
    src = f"__kernel void {name}(__global int *a) {{ a[get_global_id(0)] = {value}; }}"
    t = time.monotonic()
    prg = cl.Program(ctx, src).build()
    took = time.monotonic() - t
    a = np.zeros(8, np.int32)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, a.nbytes)
    getattr(prg, name)(queue, a.shape, None, buf)
    cl.enqueue_copy(queue, a, buf)
    assert a.tolist() == [value] * 8, (name, a)
    return took

start = time.monotonic()
worst = max(run(f"k{i}", i + 1) for i in range(n))
print(f"{tag}: {n} builds in {time.monotonic() - start:.1f} s, slowest {worst:.2f} s",
      flush=True)
open(f"{go}.ready-{tag}", "w").close()
while not os.path.exists(go):  # the clears stop
    time.sleep(0.05)
run(f"final_{tag}", 99)
kdb.default_db().flush()
background.drain()
"""


def test_clear_in_a_loop_beside_building_processes(tmp_path, capsys):
    cache = tmp_path / "cache"
    go = tmp_path / "go"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    tags = "abc"[:PROCESSES]
    env = {**os.environ, "KDB_CACHE_DIR": str(cache), "KDB_STORE_AT_EXIT": "wait"}
    env.pop("KDB_DISABLE_CACHE", None)
    children = [subprocess.Popen([sys.executable, str(script), tag, str(KERNELS), str(go)],
                                 env={**env, "POCL_CACHE_DIR": str(tmp_path / f"pocl-{tag}")},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for tag in tags]
    clears = 0
    deadline = time.monotonic() + 120
    try:
        # Clear until every child has done its builds (and at least a few times).
        while clears < 5 or not all((tmp_path / f"go.ready-{t}").exists() for t in tags):
            assert time.monotonic() < deadline, "the children did not finish their builds"
            subprocess.run([sys.executable, "-m", "kdb.cli", "clear", "--yes"], env=env,
                           capture_output=True, timeout=60)
            clears += 1
            time.sleep(0.2)
            if all(c.poll() is not None for c in children):
                break
    finally:
        go.write_text("")
    outs = [c.communicate(timeout=120) for c in children]
    for c, (out, err) in zip(children, outs):
        assert c.returncode == 0, err
        assert "could not be upgraded" not in err and "Delete it" not in err, err
        assert "cannot use" not in err and "could not write" not in err, err
    with capsys.disabled():  # the timings, for the record (not asserted)
        print(f"\n{clears} clears; " + "; ".join(o.strip() for o, _ in outs))
    stored = [name for (name,) in _names(cache)]
    for tag in tags:
        assert any(f"final_{tag}" in (n or "") for n in stored), (tag, stored)


def _names(cache) -> list[tuple]:
    files = list((cache / "v1").glob("*.kdb"))
    assert len(files) == 1, files
    conn = sqlite3.connect(files[0])
    try:
        return conn.execute("SELECT name FROM kernels").fetchall()
    finally:
        conn.close()

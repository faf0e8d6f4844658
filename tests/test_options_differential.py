"""A differential test of build options: plain pyopencl as the oracle.

Each case draws build options that change what a kernel computes (macros defined and
redefined in every order and spelling, values with parentheses, quoted and not, the math
flags the compiler announces as macros, the OpenCL C version), as a string or as a list.
A kernel writes what it was built with (its macros' values, the flags' macros, a result of
the math they govern) into a buffer. The same cases run in three fresh processes: plain
pyopencl, then through ``install()`` on an empty kdb cache (each compiled and stored), then
through ``install()`` again on a fresh PoCL cache (each served by kdb).
The property: all three give the same bytes for every case, and a build that fails fails in
all three. Options that give another kernel but the same key would serve the first one's
binary to the second: a stored wrong kernel.

``KDB_DIFFERENTIAL_CASES=N`` runs N cases (default: a CI-sized run);
``KDB_DIFFERENTIAL_SEED=S`` starts from seed S. A failure names its seed.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from conftest import stored_entries

pytest.importorskip("pyopencl")

CASES = int(os.environ.get("KDB_DIFFERENTIAL_CASES", "0") or 0) or 16
SEED = int(os.environ.get("KDB_DIFFERENTIAL_SEED", "0") or 0)

#: Options as words; some are two (``-D NAME``: a list element holding a space), one is
#: refused by PoCL (``-UA``: it must be refused through kdb too).
WORDS = ["-DA=3", "-DA=5", "-D A=7", "-DA", "-UA", "-DB=4", "-D B=9", "-DB", "-DS=(2*3)",
         "-DFAST", "-cl-fast-relaxed-math", "-cl-finite-math-only",
         "-cl-unsafe-math-optimizations", "-cl-mad-enable", "-cl-opt-disable", "-w",
         "-cl-std=CL1.2", "-cl-std=CL2.0", "-cl-std=CL3.0", "-cl-denorms-are-zero",
         "-cl-no-signed-zeros", "-DA=5 -DB=3"]
#: One option spelled as a list element and, quoted, in a string (shell-like quoting, which
#: pyopencl's split removes: the driver gets the same text).
QUOTED = [("-DS=(2*3)", '"-DS=(2*3)"'), ("-DS=(1+1)", "'-DS=(1+1)'"),
          ("-DB=(4-1)", '-DB="(4-1)"')]

SOURCE = r"""
#ifndef A
#define A 1
#endif
#ifndef B
#define B 2
#endif
#ifndef S
#define S 0
#endif
__kernel void k(__global float *o, __global const float *x) {
  int i = get_global_id(0);
  o[8 * i + 0] = A;
  o[8 * i + 1] = B;
  o[8 * i + 2] = S;
  o[8 * i + 3] = __OPENCL_C_VERSION__;
#ifdef __FAST_RELAXED_MATH__
  o[8 * i + 4] = 1;
#else
  o[8 * i + 4] = 0;
#endif
#ifdef __OPTIMIZE__
  o[8 * i + 5] = 1;
#else
  o[8 * i + 5] = 0;
#endif
#ifdef FAST
  o[8 * i + 6] = native_sin(x[i]) * native_exp(x[i]);
#else
  o[8 * i + 6] = sin(x[i]) * exp(x[i]);
#endif
  o[8 * i + 7] = x[i] * A + B - S;
}
"""

#: Builds every case's program in one process and prints each one's output as hex, or
#: "error" where the build failed (pyopencl or the driver refused the options).
CHILD = r"""
import json, sys
import numpy as np
import pyopencl as cl
if sys.argv[1] == "kdb":
    import kdb.opencl
    kdb.opencl.install()
import kdb.bookkeeping
cases, source = json.loads(sys.argv[2]), sys.argv[3]
ctx = cl.create_some_context(interactive=False)
q = cl.CommandQueue(ctx)
x = np.linspace(-3, 3, 16).astype(np.float32)
mf = cl.mem_flags
xb = cl.Buffer(ctx, mf.READ_ONLY | mf.COPY_HOST_PTR, hostbuf=x)
out = []
for options in cases:
    try:
        prg = cl.Program(ctx, source).build(options=options)
    except Exception:  # refused options: refused alike with kdb or without
        out.append("error")
        continue
    o = cl.Buffer(ctx, mf.WRITE_ONLY, 8 * x.nbytes)
    prg.k(q, x.shape, None, o, xb)
    got = np.empty(8 * x.size, np.float32)
    cl.enqueue_copy(q, got, o)
    out.append(got.tobytes().hex())
records = kdb.bookkeeping.records()
print(json.dumps({"out": out, "compiles": len(records), "keys": len({r.key for r in records})}))
"""


def draw(rng: random.Random) -> str | list[str]:
    """One case's options: up to five words, as a list or joined into a string."""
    n = rng.randint(0, 5)
    as_list = rng.random() < 0.5
    words: list[str] = []
    for _ in range(n):
        if rng.random() < 0.2:
            element, quoted = rng.choice(QUOTED)
            words.append(element if as_list else quoted)
        else:
            words.append(rng.choice(WORDS))
    return words if as_list else rng.choice([" ", "  ", "\t"]).join(words)


def test_options_give_the_same_kernel_through_kdb_as_without_it(run_py, cache_dir, tmp_path):
    rng = random.Random(SEED)
    cases = [draw(rng) for _ in range(CASES)]
    cases += [["-DA=3", "-DA=5"], ["-DA=5", "-DA=3"], "-DA=3 -DB=4", "-DB=4 -DA=3",  # order
              ["-DA=5 -DB=3"], ["-DA=5", "-DB=3"]]
    # The cold arm shares PoCL's cache with the oracle's (PoCL hashes the options as it gets
    # them: options kdb changed would compile anew), the warm arm starts from an empty one.
    shared = {"POCL_CACHE_DIR": str(tmp_path / "pocl-shared")}
    runs = {}
    for arm, mode, env in (("plain", "plain", shared), ("cold", "kdb", shared),
                           ("warm", "kdb", None)):
        code = (f"import sys; sys.argv[1:] = [{mode!r}, {json.dumps(cases)!r}, "
                f"{SOURCE!r}]\n" + CHILD)
        runs[arm] = json.loads(run_py(code, env=env).stdout.splitlines()[-1])
    built = sum(o != "error" for o in runs["plain"]["out"])
    assert built >= len(cases) // 2, runs["plain"]  # the pool is mostly valid options
    assert len(set(runs["plain"]["out"])) > 3  # and the cases differ in what they build
    for i, options in enumerate(cases):
        got = {arm: run["out"][i] for arm, run in runs.items()}
        assert got["cold"] == got["plain"] == got["warm"], (
            f"seed {SEED}, case {i}: options {options!r} gave another kernel through kdb "
            f"({'cold' if got['cold'] != got['plain'] else 'warm'})")
    assert runs["warm"]["compiles"] == 0, runs["warm"]  # each served from kdb
    assert runs["cold"]["keys"] >= len(set(runs["plain"]["out"]) - {"error"})
    assert stored_entries(cache_dir) == runs["cold"]["keys"]

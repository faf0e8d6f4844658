"""The ``hip`` scenario: ``kdb.hip.compile`` against ``hipcc --genco`` alone, as ``cuda``'s.

hipcc and HIPRTC compile for an explicit gfx target on a machine without a GPU (Debian's
ROCm 5.2: ``apt-get install hipcc``). Arms, each a fresh process: a miss (empty cache) and a
hit (primed cache, then warm calls in that process) with each compiler, a hit in a process
that finds no hipcc (served the stored build), and a bare ``hipcc --genco`` of the same kernel.
"""

from __future__ import annotations

import json
import shutil
from statistics import median

from _harness import PYTHON, Metric, Outcome, Workspace, command, kdb_files

SOURCE = ('#include <hip/hip_runtime.h>\n'
          'extern "C" __global__ void saxpy(int n, float a, const float *x, float *y) {\n'
          '    int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
          '    if (i < n) y[i] = a * x[i] + y[i];\n}\n')

#: argv[1]: JSON {source, arch, compiler, reps}; prints BENCH-JSON with the call's phases.
PROGRAM = r'''
import json, sys, time
a = json.loads(sys.argv[1])
t = time.perf_counter()
import kdb.hip
t1 = time.perf_counter()
first = kdb.hip.compile(a["source"], arch=a["arch"], compiler=a["compiler"])
t2 = time.perf_counter()
warm = []
for _ in range(a["reps"]):
    s = time.perf_counter()
    kdb.hip.compile(a["source"], arch=a["arch"], compiler=a["compiler"])
    warm.append(time.perf_counter() - s)
import kdb.bookkeeping as b
print("BENCH-JSON:" + json.dumps({"phases": {"import": t1 - t, "first_call": t2 - t1},
      "warm_calls": warm, "binary_size": len(first), "compiles": len(b.records())}))
'''


def _compilers(o: Outcome) -> list[str]:
    from kdb.backends.hip import hiprtc

    try:
        hiprtc.find_hiprtc()
        return ["hipcc", "hiprtc"]
    except Exception as err:  # noqa: BLE001 - HIPRTC's arms are skipped, hipcc's still run
        o.notes.append(f"HIPRTC arms skipped: {err}")
        return ["hipcc"]


def hip(ws: Workspace, o: Outcome) -> None:
    runs = ws.opts.n(3)
    arch = "gfx90a"
    o.title = f"HIP: hipcc and HIPRTC compiles against kdb hits ({arch}, median of {runs})"
    hipcc = shutil.which("hipcc")
    if hipcc is None:
        o.status, o.reason = "skipped", "hipcc is not on PATH (apt-get install hipcc)"
        return
    compilers = _compilers(o)
    script = ws.path / "hip_child.py"
    script.write_text(PROGRAM)
    src = ws.path / "saxpy.hip"
    src.write_text(SOURCE)
    t = o.table("one kernel (saxpy); fresh process per run", "hipcc",
                [Metric("call", "compile / hit call"), Metric("wall", "process")],
                note="miss: empty cache; hit: a fresh process on the primed cache; warm: "
                     "repeated calls in it; no hipcc: PATH without hipcc, compiler='hipcc'")
    t.arm("hipcc", f"hipcc --genco --offload-arch={arch} (HIP_PLATFORM=amd)")
    for c in compilers:
        t.arm(f"{c}-miss", f"kdb.hip.compile(compiler={c!r}), miss")
        t.arm(f"{c}-hit", f"kdb.hip.compile(compiler={c!r}), hit (fresh process)")
        t.arm(f"{c}-warm", f"kdb.hip.compile(compiler={c!r}), hit (warm process)")
    t.arm("nocc-hit", "kdb.hip.compile, no hipcc: stored build (fresh process)")
    primed = ws.path / "hip-primed"
    args = {"source": SOURCE, "arch": arch, "reps": 0}

    def child(a, env):
        return command([PYTHON, str(script), json.dumps(a)], env)

    for c in compilers:
        child({**args, "compiler": c}, ws.env(KDB_CACHE_DIR=primed))
    if not kdb_files(primed):
        o.status, o.reason = "failed", "kdb.hip.compile stored nothing in the user tier"
        return
    no_hipcc = ws.env(KDB_CACHE_DIR=primed, PATH=ws.path / "no-bin")
    hit_compiles = 0
    for r in range(runs):
        ws.log(f"hip: run {r + 1}/{runs}")
        out = ws.fresh("hipcc") / "saxpy.co"
        p = command([hipcc, "--genco", f"--offload-arch={arch}", "-o", str(out), str(src)],
                    ws.env(HIP_PLATFORM="amd"))
        t.add("hipcc", "call", p.wall)
        t.add("hipcc", "wall", p.wall)
        for c in compilers:
            a = {**args, "compiler": c}
            p = child(a, ws.env(KDB_CACHE_DIR=ws.fresh("kdb-hip")))
            t.add(f"{c}-miss", "call", p.phase("first_call"))
            t.add(f"{c}-miss", "wall", p.wall)
            p = child({**a, "reps": 20}, ws.env(KDB_CACHE_DIR=primed))
            t.add(f"{c}-hit", "call", p.phase("first_call"))
            t.add(f"{c}-hit", "wall", p.wall)
            t.add(f"{c}-warm", "call", median(p.data["warm_calls"]))
            hit_compiles += p.data.get("compiles") or 0
        p = child({**args, "compiler": "hipcc"}, no_hipcc)
        t.add("nocc-hit", "call", p.phase("first_call"))
        t.add("nocc-hit", "wall", p.wall)
        hit_compiles += p.data.get("compiles") or 0
    if hit_compiles:
        o.notes.append(f"the hit arms compiled {hit_compiles} time(s): not served from the cache")
    o.info["code_object_size"] = p.data.get("binary_size")

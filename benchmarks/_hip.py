"""The ``hip`` scenario: ``kdb.hip.compile`` against ``hipcc --genco`` alone, as ``cuda``'s.

hipcc and HIPRTC compile for an explicit gfx target on a machine without a GPU (Debian's
ROCm 5.2: ``apt-get install hipcc``). Arms, each a fresh process: a miss (empty cache) and a
hit (primed cache, then warm calls in that process) with each compiler, a hit in a process
that finds no hipcc (served the stored build), and a bare ``hipcc --genco`` of the same kernel.
A second table: ``kdb pack`` of 50 kernels for 3 arches, twice (time, size, byte-identical),
against a loop of bare ``hipcc --genco`` runs building the same code objects.
"""

from __future__ import annotations

import json
import shutil
from statistics import median

from _harness import PYTHON, Check, Metric, Outcome, Workspace, command, kdb_files

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
    t.arm("alternating", "kdb.hip.compile(compiler='hipcc'), hit (fresh process), "
                         "HIPCC_COMPILE_FLAGS_APPEND alternating between two settings")
    primed = ws.path / "hip-primed"
    settings = [{"HIPCC_COMPILE_FLAGS_APPEND": f"-DSETTING={i}"} for i in (1, 2)]
    args = {"source": SOURCE, "arch": arch, "reps": 0}

    def child(a, env):
        return command([PYTHON, str(script), json.dumps(a)], env)

    for c in compilers:
        child({**args, "compiler": c}, ws.env(KDB_CACHE_DIR=primed))
    for setting in settings:  # two projects' flags on one machine
        child({**args, "compiler": "hipcc"}, ws.env(KDB_CACHE_DIR=primed, **setting))
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
        for setting in settings:
            p = child({**args, "compiler": "hipcc"}, ws.env(KDB_CACHE_DIR=primed, **setting))
            t.add("alternating", "call", p.phase("first_call"))
            t.add("alternating", "wall", p.wall)
            hit_compiles += p.data.get("compiles") or 0
        p = child({**args, "compiler": "hipcc"}, no_hipcc)
        t.add("nocc-hit", "call", p.phase("first_call"))
        t.add("nocc-hit", "wall", p.wall)
        hit_compiles += p.data.get("compiles") or 0
    if hit_compiles:
        o.notes.append(f"the hit arms compiled {hit_compiles} time(s): not served from the cache")
    o.info["code_object_size"] = p.data.get("binary_size")
    _pack_table(ws, o, hipcc)


#: The pack's arches: three processors Debian's ROCm 5.2 builds (gfx942 and gfx1100 need a
#: newer one), one system file each.
PACK_ARCHES = ("gfx90a", "gfx940", "gfx1030")
#: Five kernels, each at ten values of its constant: the pack's 50 manifest entries.
PACK_BODIES = {
    "saxpy": "if (i < n) y[i] = K * x[i] + y[i];",
    "scale": "if (i < n) y[i] = x[i] * K;",
    "clamp": "if (i < n) y[i] = fminf(fmaxf(x[i], -K), K);",
    "stencil": "if (i > 0 && i < n - 1) y[i] = (x[i - 1] + K * x[i] + x[i + 1]) / (K + 2);",
    "poly": "if (i < n) { float v = x[i]; y[i] = ((K * v + 1.0f) * v + 2.0f) * v; }",
}


def _pack_manifest(ws: Workspace) -> tuple:
    """The manifest of 50 HIP kernels (5 sources x 10 values of K; ``--quick``: 2 values,
    10 kernels) and their sources."""
    (ws.path / "pack-src").mkdir(exist_ok=True)
    lines, sources = ['[defaults]\nbackend = "hip"\n'], []
    for name, body in PACK_BODIES.items():
        path = ws.path / "pack-src" / f"{name}.hip"
        path.write_text('#include <hip/hip_runtime.h>\n'
                        f'extern "C" __global__ void {name}(int n, const float *x, float *y) {{\n'
                        f'    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    {body}\n}}\n')
        for k in range(1, 3 if ws.opts.quick else 11):
            lines.append(f'[[kernel]]\nname = "{name}_{k}"\nfile = "pack-src/{name}.hip"\n'
                         f'defines = {{ K = "{k}.0f" }}\n')
            sources.append((path, f"-DK={k}.0f"))
    manifest = ws.path / "pack.toml"
    manifest.write_text("\n".join(lines))
    return manifest, sources


def _pack_table(ws: Workspace, o: Outcome, hipcc: str) -> None:
    """``kdb pack`` of 50 kernels for 3 arches, twice from empty caches, against bare hipcc."""
    manifest, sources = _pack_manifest(ws)
    t = o.table(f"kdb pack: {len(sources)} kernels x {len(PACK_ARCHES)} arches "
                f"({', '.join(PACK_ARCHES)}), hipcc", "hipcc",
                [Metric("wall", "time", unit="s"), Metric("files", "system files", unit="B"),
                 Metric("wheels", "wheels", unit="B"),
                 Metric("entries", "entries", unit="n", ratio=False)],
                note="one run each; pack-2 is a second build from an empty cache, compared "
                     "byte for byte with pack-1 (SOURCE_DATE_EPOCH set)")
    t.arm("hipcc", f"hipcc --genco, {len(sources) * len(PACK_ARCHES)} runs in a loop")
    outs = []
    for run in ("pack-1", "pack-2"):
        t.arm(run, "kdb pack --manifest ... --version 1.0.0" + (" (again)" if outs else ""))
        out = ws.fresh(run)
        ws.log(f"hip: {run}")
        argv = [PYTHON, "-m", "kdb.cli", "pack", "--manifest", str(manifest), "--version",
                "1.0.0", "--out", str(out), *(x for a in PACK_ARCHES for x in ("--arch", a))]
        p = command(argv, ws.env(KDB_CACHE_DIR=ws.fresh("kdb-pack"),
                                 SOURCE_DATE_EPOCH="1700000000"), timeout=1800)
        t.add(run, "wall", p.wall)
        t.add(run, "files", sum(f.stat().st_size for f in out.glob("*.kdb")))
        t.add(run, "wheels", sum(f.stat().st_size for f in out.glob("*.whl")))
        t.add(run, "entries", len(sources) * len(PACK_ARCHES))
        outs.append({f.name: f.read_bytes() for f in sorted(out.iterdir())})
    ws.log("hip: bare hipcc loop")
    bare, size = ws.fresh("hipcc-loop"), 0
    start = _now()
    for i, (path, define) in enumerate(sources):
        for arch in PACK_ARCHES:
            co = bare / f"{i}-{arch}.co"
            command([hipcc, "--genco", "--no-gpu-bundle-output", f"--offload-arch={arch}",
                     define, "-o", str(co), str(path)], ws.env(HIP_PLATFORM="amd"))
            size += co.stat().st_size
    t.add("hipcc", "wall", _now() - start)
    t.add("hipcc", "files", size)
    same = len(outs[0]) == 2 * len(PACK_ARCHES) and outs[0] == outs[1]
    o.checks.append(Check("HIP pack: a second build is byte-identical", "== 1", float(same),
                          same, f"{len(outs[0])} files: " + ", ".join(outs[0])))


def _now() -> float:
    import time

    return time.perf_counter()

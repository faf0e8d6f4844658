"""The ``triton`` scenario: Triton's kernels with kdb as its cache against Triton's own.

Triton compiles for an explicit target on a machine without a GPU (here ``sm_90``), so the
scenario runs anywhere Triton installs. Three measurements, each arm with empty caches of
its own:

- **many processes**: 8 processes started together compile the same 20 kernels. Triton's
  compiles are counted with its own listener (``triton.knobs.compilation.listener``), not
  with kdb's report. Triton has no cross-process deduplication; kdb claims each key.
- **a warm start**: a fresh process compiles the same 20 kernels, every one a cache hit.
- **files on disk**: N distinct kernels (default 1,000; ``--quick`` 50) compiled once: the
  files and bytes of Triton's cache directory against kdb's.
"""

from __future__ import annotations

from pathlib import Path

from _harness import PYTHON, Metric, Outcome, Running, Workspace, at_most, command, \
    file_bytes, kdb_files

KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def scale(x_ptr, out_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * FACTOR, mask=mask)
'''

#: argv: first, count. Compiles scale with FACTOR = first .. first+count-1 for sm_90 through
#: plain triton.compile (kdb, when on, is Triton's cache manager through KDB_AUTO).
PROGRAM = '''
import json, os, sys, time
t0 = time.perf_counter()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels

misses = []
triton.knobs.compilation.listener = lambda **kw: misses.append(not kw["cache_hit"])
target = GPUTarget("cuda", 90, 32)
sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "FACTOR": "constexpr",
       "BLOCK": "constexpr"}
first, count = int(sys.argv[1]), int(sys.argv[2])
for f in range(first, first + count):
    src = ASTSource(fn=kernels.scale, signature=sig, constexprs={"FACTOR": f, "BLOCK": 64})
    triton.compile(src, target=target)
print("BENCH-JSON:" + json.dumps({"compiles": sum(misses), "kernels": count,
                                  "seconds": time.perf_counter() - t0}))
'''

PROCESSES, SHARED_KERNELS = 8, 20


def _program(ws: Workspace) -> Path:
    def build() -> Path:
        d = ws.fresh("triton-program")
        (d / "kernels.py").write_text(KERNELS)
        (d / "program.py").write_text(PROGRAM)
        return d / "program.py"

    return ws.memo("triton_program", build)


def _envs(ws: Workspace, stem: str) -> dict[str, dict[str, str]]:
    return {"triton": ws.env(TRITON_CACHE_DIR=ws.fresh(f"{stem}-triton-cache")),
            "kdb": ws.env(TRITON_CACHE_DIR=ws.fresh(f"{stem}-triton-cache-kdb"),
                          KDB_CACHE_DIR=ws.fresh(f"{stem}-kdb"), KDB_AUTO="1")}


def _files(directory: Path) -> tuple[int, int]:
    files = [p for p in directory.rglob("*") if p.is_file()] if directory.exists() else []
    return len(files), sum(p.stat().st_size for p in files)


def triton(ws: Workspace, o: Outcome) -> None:
    try:
        import triton as _t  # noqa: F401
    except ImportError:
        o.title = "Triton: skipped (Triton is not installed: pip install 'kdb[triton]')"
        return
    program = str(_program(ws))
    n_files = 50 if ws.opts.quick else 1000
    o.title = (f"Triton (sm_90, no GPU): {PROCESSES} processes x {SHARED_KERNELS} kernels at "
               f"once, a warm start of {SHARED_KERNELS}, and {n_files:,} kernels on disk")
    many = o.table(f"{PROCESSES} processes started together, {SHARED_KERNELS} kernels each, "
                   "empty caches", "triton",
                   [Metric("compiles", "compiles (Triton's listener)", unit="n"),
                    Metric("slowest", "slowest process", unit="s")])
    many.arm("triton", "Triton's own cache")
    many.arm("kdb", "kdb (KDB_AUTO=1)")
    warm = o.table(f"a fresh process, {SHARED_KERNELS} kernels, every one a hit", "triton",
                   [Metric("wall", "process wall", unit="ms"),
                    Metric("compiles", "compiles", unit="n", ratio=False)])
    warm.arm("triton", "Triton's own cache")
    warm.arm("kdb", "kdb (KDB_AUTO=1)")
    envs = _envs(ws, "triton-many")
    for arm, env in envs.items():
        ws.log(f"triton: {PROCESSES} processes, {arm}")
        running = [spawn_program(program, 1, SHARED_KERNELS, env) for _ in range(PROCESSES)]
        procs = [r.wait(timeout=1800) for r in running]
        many.add(arm, "compiles", sum(p.data["compiles"] for p in procs))
        many.add(arm, "slowest", max(p.wall for p in procs))
    for r in range(ws.opts.n(5)):
        for arm in (("triton", "kdb") if r % 2 == 0 else ("kdb", "triton")):
            ws.log(f"triton: warm start {r + 1}, {arm}")
            p = command([PYTHON, program, "1", str(SHARED_KERNELS)], envs[arm], timeout=900)
            warm.add(arm, "wall", p.wall)
            warm.add(arm, "compiles", p.data["compiles"])
    disk = o.table(f"{n_files:,} kernels compiled once", None,
                   [Metric("files", "files", unit="n"), Metric("bytes", "bytes on disk", unit="B"),
                    Metric("seconds", "compiling", unit="s")])
    disk.arm("triton", "Triton's own cache")
    disk.arm("kdb", "kdb (one SQLite file per arch)")
    envs = _envs(ws, "triton-disk")
    running = {arm: spawn_program(program, 1000, n_files, env) for arm, env in envs.items()}
    for arm, r in running.items():
        ws.log(f"triton: {n_files} kernels, {arm}")
        p = r.wait(timeout=7200)
        disk.add(arm, "seconds", p.data["seconds"])
    tc_files, tc_bytes = _files(Path(envs["triton"]["TRITON_CACHE_DIR"]))
    disk.add("triton", "files", tc_files)
    disk.add("triton", "bytes", tc_bytes)
    kdb_tc_files, _ = _files(Path(envs["kdb"]["TRITON_CACHE_DIR"]))
    ours = kdb_files(Path(envs["kdb"]["KDB_CACHE_DIR"]))
    disk.add("kdb", "files", len(ours) + kdb_tc_files)
    disk.add("kdb", "bytes", sum(file_bytes(p) for p in ours))
    o.info["kdb_arm_triton_cache_files"] = kdb_tc_files  # launchers etc.: none for compile()
    o.checks.append(at_most(f"triton, {PROCESSES} processes x {SHARED_KERNELS} kernels: "
                            "compiles with kdb", many.median("kdb", "compiles"),
                            SHARED_KERNELS, unit=""))
    o.checks.append(at_most(f"triton, {PROCESSES} processes: slowest process, kdb vs "
                            "Triton's own cache", many.ratio("kdb", "slowest"), 1.0))
    o.checks.append(at_most(f"triton, warm start of {SHARED_KERNELS} kernels: kdb vs "
                            "Triton's own cache", warm.ratio("kdb", "wall"), 1.05))
    o.checks.append(at_most(f"triton, {n_files:,} kernels: files on disk with kdb",
                            disk.median("kdb", "files"), 1, unit=""))


def spawn_program(program: str, first: int, count: int, env: dict[str, str]) -> Running:
    """Start the program (not ``_child.py``): its BENCH-JSON line is read the same way."""
    return Running([PYTHON, program, str(first), str(count)], env, None)

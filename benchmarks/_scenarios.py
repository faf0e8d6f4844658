"""The scenarios of issue 6, each measured against what a user would otherwise have.

Every scenario takes the :class:`Workspace` and returns an :class:`Outcome` (tables, the
figures' checks, notes). Arms run interleaved, run by run, in fresh processes where the
start-up is what is measured.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import sys
import sqlite3
from pathlib import Path
from typing import Any, Callable

import _workloads
from _fixtures import floor_bins, kdb_primed, pocl_copy, regular_install, system_dir
from _harness import (
    PYTHON,
    BenchError,
    Metric,
    Outcome,
    Proc,
    Table,
    Workspace,
    at_least,
    at_most,
    child,
    command,
    count_rows,
    file_bytes,
    kdb_files,
    median,
    wait_for_worker,
)
from _adopt import adopt
from _batch import batch
from _busy import busy
from _fresh import fresh
from _hip import hip
from _many import many
from _triton import triton
from _trust import trust
from _uncached import uncached
from _xdist import xdist
from _script import autogroup, script

KB = 1024


def _size_label(n: int) -> str:
    return f"{n // (1 << 20)} MB" if n >= 1 << 20 else f"{n // KB} KB"


def _record(t: Table, arm: str, p: Proc, *phases: str) -> None:
    for ph in phases:
        t.add(arm, ph, p.phase(ph))
    t.add(arm, "wall", p.wall)
    t.add(arm, "exit", p.exit)


# -- 1. warm start --------------------------------------------------------------------------

def warm(ws: Workspace, o: Outcome) -> None:
    n_k, runs = ws.opts.kernels, ws.opts.n(7)  # the noisiest figure: its floor is short
    o.title = (f"Warm start: a fresh process builds {n_k} distinct OpenCL kernels on PoCL "
               f"and launches each once (median of {runs} runs)")
    primed, floor, sysdir = kdb_primed(ws), floor_bins(ws), system_dir(ws)

    metrics = [Metric("build", "build"), Metric("launch", "1st launch"),
               Metric("import_kdb", "import kdb.opencl", ratio=False),
               Metric("import_pyopencl", "import pyopencl", ratio=False),
               Metric("wall", "process"), Metric("exit", "exit", ratio=False)]
    warm_t = o.table("PoCL cache warm: each run gets a fresh copy of one primed POCL_CACHE_DIR "
                     "(no-cache arm: POCL_KERNEL_CACHE=0)", "floor", metrics)
    empty_t = o.table("PoCL cache empty: each run gets a fresh, empty POCL_CACHE_DIR",
                      "floor_empty", metrics)

    def sys_after_start() -> Path:
        """What a first start that only hit the system tier leaves in KDB_CACHE_DIR (the
        entry-point scan, digests): later starts begin from a copy of it."""
        def build() -> Path:
            d = ws.fresh("kdb-sys-first")
            child("opencl", {**kern, "mode": "kdb"},
                  ws.env(KDB_CACHE_DIR=d, KDB_SYSTEM_DB_PATH=sysdir,
                         POCL_CACHE_DIR=pocl_copy(ws)))
            return d

        first = ws.memo("kdb_sys_first_start", build)
        d = ws.fresh("kdb-sys-later")
        shutil.copytree(first, d, dirs_exist_ok=True)
        return d

    kern = {"workload": "kernels", "kernels": n_k}
    arms: list[tuple[Table, str, str, Callable[[], tuple[dict, dict]]]] = [
        (warm_t, "nocache", "no cache (PYOPENCL_NO_CACHE=1 POCL_KERNEL_CACHE=0)",
         lambda: ({"mode": "pyopencl"}, ws.env(PYOPENCL_NO_CACHE=1, POCL_KERNEL_CACHE=0,
                                               POCL_CACHE_DIR=ws.fresh("pocl-off")))),
        (warm_t, "pocl", "PoCL's own cache (warm)",
         lambda: ({"mode": "pyopencl"}, ws.env(POCL_CACHE_DIR=pocl_copy(ws)))),
        (warm_t, "kdb_user", "kdb user tier",
         lambda: ({"mode": "kdb"}, ws.env(KDB_CACHE_DIR=primed.cache_dir,
                                          POCL_CACHE_DIR=pocl_copy(ws)))),
        (warm_t, "kdb_system", "kdb system tier, first start (empty KDB_CACHE_DIR)",
         lambda: ({"mode": "kdb"}, ws.env(KDB_CACHE_DIR=ws.fresh("kdb-empty"),
                                          KDB_SYSTEM_DB_PATH=sysdir,
                                          POCL_CACHE_DIR=pocl_copy(ws)))),
        (warm_t, "kdb_system_later", "kdb system tier, later start (KDB_CACHE_DIR as the "
                                    "first left it)",
         lambda: ({"mode": "kdb"}, ws.env(KDB_CACHE_DIR=sys_after_start(),
                                          KDB_SYSTEM_DB_PATH=sysdir,
                                          POCL_CACHE_DIR=pocl_copy(ws)))),
        (warm_t, "floor", "floor (plain files, clCreateProgramWithBinary)",
         lambda: ({"mode": "floor", "bin_dir": str(floor)}, ws.env(POCL_CACHE_DIR=pocl_copy(ws)))),
        (empty_t, "kdb_user_empty", "kdb user tier",
         lambda: ({"mode": "kdb"}, ws.env(KDB_CACHE_DIR=primed.cache_dir,
                                          POCL_CACHE_DIR=ws.fresh("pocl-empty")))),
        (empty_t, "floor_empty", "floor (plain files, clCreateProgramWithBinary)",
         lambda: ({"mode": "floor", "bin_dir": str(floor)},
                  ws.env(POCL_CACHE_DIR=ws.fresh("pocl-empty")))),
    ]
    for t, arm, label, _ in arms:
        t.arm(arm, label)
    compiled: dict[str, int] = {}
    for r in range(runs):
        ws.log(f"warm: run {r + 1}/{runs}")
        for t, arm, _, setup in arms:
            args, env = setup()
            p = child("opencl", {**kern, **args}, env)
            _record(t, arm, p, "build", "launch", "import_kdb", "import_pyopencl")
            if p.data.get("compiles"):
                compiled[arm] = compiled.get(arm, 0) + p.data["compiles"]
    for arm, n in compiled.items():
        o.notes.append(f"arm {arm} compiled {n} kernel(s) over {runs} runs: it was not served "
                       "from the cache as intended")
    o.notes.append("Seen here before kdb existed: floor 17 ms, PoCL cache "
                   "500 ms, no cache 2,700 ms for 20 kernels.")
    o.notes.append("'exit' is the process's last statement to its end (atexit handlers: kdb "
                   "writes its batched hit counters there).")

    pf, nf = warm_t.ratio("pocl", "build"), warm_t.ratio("nocache", "build")
    if pf and nf:
        o.notes.append(f"Ceiling of the two 'faster than' figures in this run: the floor itself "
                       f"is {pf:.1f}x faster than PoCL's cache and {nf:.0f}x faster than no "
                       "cache.")
    _warm_intel(ws, o, kern, runs, metrics)
    kdb_build = warm_t.median("kdb_user", "build")
    o.checks += [
        at_most("warm start build phase, kdb user tier vs floor",
                warm_t.ratio("kdb_user", "build"), 1.2),
        at_most("warm start build phase, kdb system tier, first start (empty cache dir) vs "
                "floor", warm_t.ratio("kdb_system", "build"), 1.2),
        at_most("warm start build phase, kdb system tier, later start vs floor",
                warm_t.ratio("kdb_system_later", "build"), 1.2),
        at_least("warm start build phase, PoCL's own cache vs kdb user tier",
                 warm_t.ratio("pocl", "build", "kdb_user"), 25),
        at_least("warm start build phase, no cache vs kdb user tier",
                 warm_t.ratio("nocache", "build", "kdb_user"), 100),
    ]
    o.info["kdb_user_build_ms"] = None if kdb_build is None else kdb_build * 1e3


def _warm_intel(ws: Workspace, o: Outcome, kern: dict, runs: int, metrics: list) -> None:
    """The warm start on Intel's CPU runtime, where installed (tools/ensure_opencl.sh puts
    it in <venv>/opencl-intel): there pyopencl's own binary cache is on (it is off only on
    PoCL and NVIDIA's), so it is the reference kdb is held to."""
    intel = _intel_env(ws)
    if intel is None:
        o.notes.append("Intel's CPU runtime is not installed (tools/ensure_opencl.sh): no "
                       "Intel arms.")
        return
    t = o.table("Intel's CPU runtime: each run gets a fresh copy of a primed pyopencl cache "
                "(XDG_CACHE_HOME) or kdb user tier", "intel_pyopencl", metrics)

    def primed(name: str, mode: str, var: str) -> Path:
        def build() -> Path:
            d = ws.fresh(f"intel-{name}")
            child("opencl", {**kern, "mode": mode}, ws.env(**intel, **{var: d}))
            return d
        return ws.memo(f"intel_{name}", build)

    def copy_of(src: Path) -> Path:
        d = ws.fresh("intel-copy")
        shutil.copytree(src, d, dirs_exist_ok=True)
        return d

    arms = [
        ("intel_nocache", "no cache (PYOPENCL_NO_CACHE=1)",
         lambda: ({"mode": "pyopencl"}, ws.env(**intel, PYOPENCL_NO_CACHE=1))),
        ("intel_pyopencl", "pyopencl's own binary cache (warm)",
         lambda: ({"mode": "pyopencl"}, ws.env(**intel, XDG_CACHE_HOME=copy_of(
             primed("pyopencl", "pyopencl", "XDG_CACHE_HOME"))))),
        ("intel_kdb", "kdb user tier",
         lambda: ({"mode": "kdb"}, ws.env(**intel, KDB_CACHE_DIR=copy_of(
             primed("kdb", "kdb", "KDB_CACHE_DIR"))))),
    ]
    for arm, label, _ in arms:
        t.arm(arm, label)
    compiled = 0
    for r in range(runs):
        ws.log(f"warm (Intel's runtime): run {r + 1}/{runs}")
        for arm, _, setup in arms:
            args, env = setup()
            p = child("opencl", {**kern, **args}, env)
            _record(t, arm, p, "build", "launch", "import_kdb", "import_pyopencl")
            compiled += (p.data.get("compiles") or 0) if arm == "intel_kdb" else 0
    if compiled:
        o.notes.append(f"arm intel_kdb compiled {compiled} kernel(s) over {runs} runs: it was "
                       "not served from the cache as intended")
    o.checks.append(at_most("warm start build phase on Intel's CPU runtime, kdb user tier vs "
                            "pyopencl's own binary cache", t.ratio("intel_kdb", "build"), 1.0))


# -- 2. cold run ----------------------------------------------------------------------------

def cold(ws: Workspace, o: Outcome) -> None:
    n_k = ws.opts.kernels
    runs = ws.opts.n(3)
    o.title = ("Cold run: a first start with kdb (empty cache) against the same start "
               "without kdb; pyopencl code routed through kdb.opencl.install()")
    workloads = [("kernels", f"{n_k} kernels", {"kernels": n_k}, runs)]
    if ws.opts.quick:
        o.notes.append("--quick: the GenericScanKernel workload is left out (its binaries "
                       "take tens of seconds to read on PoCL).")
    else:
        # Its binaries are slow to read on PoCL (the wait arm's exit pays it): 2 runs.
        workloads.append(("scan", "pyopencl GenericScanKernel (InclusiveScanKernel, int32)", {},
                          ws.opts.n(2)))
    metrics = [Metric("wall", "process (incl. exit)"), Metric("phase", "build+launch"),
               Metric("build", "build"), Metric("exit", "exit"),
               Metric("compiles", "compiles", unit="n", ratio=False),
               Metric("detached", "store worker after exit", ratio=False),
               Metric("stored", "stored", unit="n", ratio=False)]
    for wl, wl_label, extra, runs in workloads:
        t = o.table(f"{wl_label}; median of {runs}; each run a fresh, empty POCL_CACHE_DIR",
                    "kdb_off", metrics)
        arms = [
            ("kdb", "kdb, empty cache (stores by the store worker, the default)", "kdb-install",
             {"KDB_STORE_AT_EXIT": "detach"}),
            ("kdb_wait", "kdb, empty cache, KDB_STORE_AT_EXIT=wait", "kdb-install", {}),
            ("kdb_off", "kdb off (KDB_DISABLE_CACHE=1)", "kdb-install", {"KDB_DISABLE_CACHE": "1"}),
            ("pyopencl", "plain pyopencl (kdb not imported)", "pyopencl", {}),
        ]
        for arm, label, _, _ in arms:
            t.arm(arm, label)
        for r in range(runs):
            ws.log(f"cold: {wl} run {r + 1}/{runs}")
            for arm, _, mode, env_extra in arms:
                cache = ws.fresh("kdb-cold")
                env = ws.env(KDB_CACHE_DIR=cache, POCL_CACHE_DIR=ws.fresh("pocl-cold"),
                             **env_extra)
                p = child("opencl", {"mode": mode, "workload": wl, **extra}, env)
                _record(t, arm, p, "build")
                b, la = p.phase("build"), p.phase("launch")
                t.add(arm, "phase", None if b is None or la is None else b + la)
                t.add(arm, "compiles", p.data.get("compiles"))
                if mode != "pyopencl":
                    if arm == "kdb":  # its stores run after it: wait, and count them too
                        t.add(arm, "detached", wait_for_worker(cache))
                    files = kdb_files(cache)
                    t.add(arm, "stored", sum(count_rows(f, "kernels") for f in files))
        o.checks.append(at_most(f"cold run, {wl_label}: process wall time, kdb vs kdb off",
                                t.ratio("kdb", "wall"), 1.1))
        o.checks.append(at_most(f"cold run, {wl_label}: build+launch phase, kdb vs kdb off",
                                t.ratio("kdb", "phase"), 1.1))
    o.notes.append("kdb hands each store to its store worker as the program is compiled "
                   "(KDB_STORE_AT_EXIT=detach, the default: 'store worker after exit' is how "
                   "long it went on after the process exited, waited for before the next run) "
                   "or, with KDB_STORE_AT_EXIT=wait, stores in a background thread once the "
                   "process is quiet 5 s and the machine has idle CPU, and before exiting "
                   "(bounded by KDB_STORE_TIMEOUT, "
                   "default 120 s): 'exit' holds what that costs.")


# -- 3. hit cost ----------------------------------------------------------------------------

HIT_SIZES = (4 * KB, 70 * KB, 1 << 20)

_FRESH_KDB = """\
import kdb
b = kdb.KernelDB().get(kdb.HashAttributes(**{attrs!r}))
raise SystemExit(0 if b is not None and len(b) == {size} else 3)
"""

_FRESH_SKETCH = """\
import sqlite3, zstandard
c = sqlite3.connect({uri!r}, uri=True)
row = c.execute("SELECT blob FROM kernels WHERE key = ?", ({key!r},)).fetchone()
b = zstandard.ZstdDecompressor().decompress(row[0])
raise SystemExit(0 if len(b) == {size} else 3)
"""


def _hit_fixture(ws: Workspace) -> dict[str, Any]:
    def build() -> dict[str, Any]:
        import kdb
        from kdb.file import codec

        cache = ws.path / "hit-cache"
        db = kdb.KernelDB(cache_dir=cache, system_path=[], use_system=False)
        entries = []
        for size in HIT_SIZES:
            attrs = kdb.HashAttributes(**_workloads.hit_attrs(size))
            raw = _workloads.compressible(size, seed=size)
            if not db.put(attrs, raw, compile_seconds=0.5):
                raise BenchError(f"KernelDB.put did not store the {size}-byte entry")
            blob_file = ws.path / f"hit-{size}.zst"
            blob_file.write_bytes(codec.encode(raw)[1])  # the very bytes kdb stores
            entries.append({"size": size, "key": attrs.key, "file": str(blob_file)})
        db.close()
        files = kdb_files(cache)
        if len(files) != 1:
            raise BenchError(f"expected one user file in {cache}, found {files}")
        return {"cache": cache, "user_file": files[0], "entries": entries}

    return ws.memo("hit", build)


def hit(ws: Workspace, o: Outcome) -> None:
    fresh_runs = ws.opts.runs or (3 if ws.opts.quick else 20)
    warm_procs = ws.opts.n(3)
    reps = 20 if ws.opts.quick else 300
    o.title = ("Hit cost: import kdb + one hit in a fresh process against a bare Python "
               f"start (median of {fresh_runs}); one hit in a warm process against reading "
               f"the same bytes from a file and decompressing them (median of "
               f"{warm_procs} x {reps})")
    fx = _hit_fixture(ws)
    cols = [Metric(str(s), _size_label(s), unit="ms") for s in HIT_SIZES]
    fresh_t = o.table("fresh process, spawn to exit", "bare", cols,
                      note="kdb: `import kdb; KernelDB().get(HashAttributes(...))`; sketch: "
                           "sqlite3 SELECT + zstd, no kdb; KDB_SYSTEM_DB_PATH unset")
    fresh_t.arm("bare", "python -c pass")
    fresh_t.arm("sketch", "sqlite3 + zstd sketch")
    fresh_t.arm("kdb", "import kdb + 1 hit")
    env = ws.env(KDB_CACHE_DIR=fx["cache"])
    uri = f"file:{fx['user_file']}?mode=ro"
    regular_t = None
    if not ws.opts.quick:
        regular_py, why = regular_install(ws)
        regular_t = o.table(
            "fresh process, spawn to exit, kdb installed from its wheel (not editable)",
            "bare", cols, note="the same three programs, in a new virtual environment: "
                               "what `pip install kdb` gives a user" + (
                                   f"; not measured: {why}" if regular_py is None else ""))
        for arm, label in (("bare", "python -c pass"), ("sketch", "sqlite3 + zstd sketch"),
                           ("kdb", "import kdb + 1 hit")):
            regular_t.arm(arm, label)
        if regular_py is None:
            regular_t = None
    for r in range(fresh_runs):
        ws.log(f"hit: fresh processes, run {r + 1}/{fresh_runs}")
        for e in fx["entries"]:
            size = e["size"]
            codes = {
                "bare": "pass",
                "sketch": _FRESH_SKETCH.format(uri=uri, key=e["key"], size=size),
                "kdb": _FRESH_KDB.format(attrs=_workloads.hit_attrs(size), size=size),
            }
            for arm, code in codes.items():
                p = command([PYTHON, "-c", code], env)
                fresh_t.add(arm, str(size), p.wall)
                if regular_t is not None:
                    p = command([str(regular_py), "-c", code], env)
                    regular_t.add(arm, str(size), p.wall)

    cols_us = [Metric(str(s), _size_label(s), unit="us") for s in HIT_SIZES]
    warm_t = o.table("warm process, one hit", "file", cols_us,
                     note="kdb hit: builds HashAttributes + lookup (a request's full cost); "
                          "lookup only: attributes already hashed; first hit: opens the file")
    for arm, label in (("file", "file read + zstd decompress"),
                       ("sqlite", "sqlite3 SELECT + zstd decompress"),
                       ("kdb_lookup", "kdb lookup only"), ("kdb", "kdb hit"),
                       ("first", "kdb first hit in process")):
        warm_t.arm(arm, label)
    for r in range(warm_procs):
        ws.log(f"hit: warm process {r + 1}/{warm_procs}")
        p = child("hit-warm", {"user_file": str(fx["user_file"]), "entries": fx["entries"],
                               "reps": reps}, env)
        for size, s in p.data["sizes"].items():
            warm_t.add("first", size, s["first"])
            for arm in ("file", "sqlite", "kdb_lookup", "kdb"):
                for v in s[arm]:
                    warm_t.add(arm, size, v)
    k70 = str(70 * KB)
    # The fresh-process tables compare with `python -c pass`, a program nobody runs: they are
    # reported, not held to a figure; what adopting kdb costs a real program is `adopt`'s.
    for t in (fresh_t, regular_t):
        sketch = t.ratio("sketch", k70) if t is not None else None
        if sketch is not None:
            o.notes.append(f"{t.name}: the sqlite3 + zstd sketch alone takes {sketch:.2f}x a "
                           "bare start: importing sqlite3 and "
                           "zstandard is most of it.")
    o.checks += [
        at_most("hit overhead: warm process, one 70 KB hit vs file read + decompress",
                warm_t.ratio("kdb", k70), 2.0),
    ]


# -- 4. many processes: benchmarks/_many.py -------------------------------------------------

# -- 5. scale -------------------------------------------------------------------------------

def _scale_file(ws: Workspace, n: int) -> tuple[Path, float]:
    """A user file with ``n`` synthetic entries, written with KernelFile.write."""
    import time

    import kdb
    from kdb import config
    from kdb.file.kernelfile import Entry, KernelFile

    cache = ws.path / f"scale-{n}"
    path = config.user_dir(cache) / f"{_workloads.SCALE_ARCH}.kdb"
    base = _workloads.compressible(8 * KB, seed=7)
    f = KernelFile(path, tier="user", readonly=False)
    t0 = time.perf_counter()
    batch: list[Entry] = []
    for i in range(n):
        attrs = kdb.HashAttributes(**_workloads.scale_attrs(i))
        off = (i * 37) % (4 * KB)
        raw = base[off:off + 200 + i % 300] + i.to_bytes(4, "little")
        batch.append(Entry(key=attrs.key, arch=attrs.arch, backend=attrs.backend,
                           name=attrs.name, attributes=attrs.encoded().decode("utf-8"),
                           raw=raw, compile_seconds=0.2))
        if len(batch) == 5000 or i == n - 1:
            if not f.write(batch, [], {}, {}):
                raise BenchError(f"KernelFile.write failed on {path}")
            batch = []
    f.close()
    return cache, time.perf_counter() - t0


def _evict_once(path) -> tuple[float, float, int]:
    """Seconds to evict 100 entries' bytes (fewer in tiny files), then a third of the
    rest, from a copy of the file."""
    import shutil
    import tempfile
    import time as _time
    from pathlib import Path

    from kdb.file.kernelfile import KernelFile

    with tempfile.TemporaryDirectory(prefix="kdb-evict-") as tmp:
        copy = Path(tmp) / Path(path).name
        shutil.copyfile(path, copy)
        f = KernelFile(copy, tier="user", readonly=False)
        conn = sqlite3.connect(copy)
        count, stored, avg = conn.execute(
            "SELECT count(*), sum(stored_size), avg(stored_size) FROM kernels").fetchone()
        conn.close()
        t0 = _time.perf_counter()
        f.evict_to(int(stored - min(100, count // 10) * avg))
        t1 = _time.perf_counter()
        conn = sqlite3.connect(copy)
        stored = conn.execute("SELECT coalesce(sum(stored_size), 0) FROM kernels").fetchone()[0]
        conn.close()
        t2 = _time.perf_counter()
        removed, _ = f.evict_to(stored - stored // 3)
        t3 = _time.perf_counter()
        f.close()
    return t1 - t0, t3 - t2, removed


def _zstd_levels(ws: Workspace, o: Outcome, user_file: Path) -> None:
    """What kdb.file.codec chooses between: the real PoCL binaries at zstd's LEVEL and FAST_LEVEL,
    their size against the raw bytes and the time to decompress one (median of 50 rounds)."""
    import time

    import zstandard

    from kdb.file import codec

    conn = sqlite3.connect(f"file:{user_file}?mode=ro", uri=True)
    try:
        stored = conn.execute("SELECT codec, blob, raw_size, checksum FROM kernels").fetchall()
    finally:
        conn.close()
    raws = [codec.decode(*row) for row in stored]
    t = o.table(f"zstd levels on the real PoCL binaries ({len(raws)} kernels)", str(codec.LEVEL),
                [Metric("ratio", "compressed / raw", unit="x"),
                 Metric("decode", "decompress one", unit="us")])
    dctx = zstandard.ZstdDecompressor()
    for level in (codec.LEVEL, codec.FAST_LEVEL):
        t.arm(str(level), f"level {level}")
        comp = zstandard.ZstdCompressor(level=level, write_content_size=True,
                                        write_checksum=True)
        frames = [comp.compress(raw) for raw in raws]
        t.add(str(level), "ratio", sum(map(len, frames)) / sum(map(len, raws)))
        for _ in range(50):
            start = time.perf_counter()
            for frame, raw in zip(frames, raws):
                dctx.decompress(frame, max_output_size=len(raw))
            t.add(str(level), "decode", (time.perf_counter() - start) / len(frames))


SIZE_SCRIPT = Path(__file__).resolve().parent / "_size_workload.py"


def _compact_size(ws: Workspace, o: Outcome) -> list[Check]:
    """A file of what a pyopencl program builds (``_size_workload.py``: the demo's programs,
    pyopencl's scans, one source under four options) against its compressed binaries: the
    user file, its pack, and the same entries as revision 0005 stored them. The fixed
    overhead, an empty file at this revision (a page per table and index), is left out."""
    from kdb.file import migrate
    from kdb.pack.systemfile import write_system_db

    cache = ws.path / "size"
    ws.log("scale: building the size table's file (a pyopencl program's builds)")
    command([PYTHON, str(SIZE_SCRIPT)], ws.env(KDB_CACHE_DIR=cache,
                                               POCL_CACHE_DIR=ws.path / "size-pocl"), 1800)
    [user] = kdb_files(cache)
    conn = sqlite3.connect(user)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    empty = ws.path / "size-empty.kdb"
    migrate.upgrade_sqlite(empty)
    packed = write_system_db(ws.path / "size-sys" / user.name, user.stem, [user]).path
    old = ws.path / "size-0005.kdb"
    shutil.copyfile(user, old)
    _downgrade(old, "0005")
    t = o.table(f"size: file bytes against its compressed binaries, less an empty file "
                f"({empty.stat().st_size // KB} KiB)", None,
                [Metric("entries", "entries", unit="n"), Metric("sources", "sources", unit="n"),
                 Metric("stored", "compressed binaries", unit="B"),
                 Metric("file", "file bytes", unit="B"),
                 Metric("ratio", "(file - empty) / compressed binaries", unit="x")])
    ratios = {}
    for arm, label, path in (("user", "user file", user), ("system", "its pack", packed),
                             ("0005", "user file as revision 0005 stored it", old)):
        c = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            n, stored = c.execute("SELECT count(*), sum(stored_size) FROM kernels").fetchone()
            has = {r[1] for r in c.execute("PRAGMA table_info(kernels)")}
            distinct = c.execute("SELECT count(DISTINCT source) FROM kernels").fetchone()[0] \
                if "source" in has else c.execute(
                    "SELECT count(DISTINCT json_extract(attributes, '$.source')) FROM kernels"
                ).fetchone()[0]
        finally:
            c.close()
        t.arm(arm, label)
        ratios[arm] = (path.stat().st_size - empty.stat().st_size) / stored
        for k, v in (("entries", n), ("sources", distinct), ("stored", stored),
                     ("file", path.stat().st_size), ("ratio", ratios[arm])):
            t.add(arm, k, v)
    o.info["size_empty_file_bytes"] = empty.stat().st_size
    return [at_most("size: user file vs its compressed binaries (less an empty file)",
                    ratios["user"], 1.15),
            at_most("size: system file (kdb pack) vs its compressed binaries (less an empty "
                    "file)", ratios["system"], 1.15)]


def _downgrade(path: Path, rev: str) -> None:
    """An upgraded file taken back to ``rev`` with alembic, then vacuumed."""
    from alembic import command as alembic
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from kdb.file import migrate

    engine = create_engine(f"sqlite:///{path}", poolclass=NullPool)
    with engine.begin() as conn:
        alembic.downgrade(migrate.alembic_config(connection=conn), rev)
    engine.dispose()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("VACUUM")
    conn.close()


def scale(ws: Workspace, o: Outcome) -> None:
    sizes = (100, 1000) if ws.opts.quick else (1000, 10_000, 100_000)
    runs = ws.opts.n(3)
    hits = 50 if ws.opts.quick else 300
    o.title = (f"Scale: hit cost and `kdb stats` against the number of entries (median of "
               f"{runs} fresh processes x {hits} hits on random entries); database size "
               "against the raw bytes stored")
    ref = str(sizes[0])
    metrics = [Metric("first", "first hit", unit="us"), Metric("hit", "hit", unit="us"),
               Metric("stats", "report.stats()", unit="ms"),
               Metric("cli", "`kdb stats --json` process", unit="ms"),
               Metric("bytes_per_entry", "file bytes/entry", unit="B", ratio=False)]
    t = o.table("user file of N synthetic entries (200-500 byte blobs)", ref, metrics)
    caches = {}
    for n in sizes:
        ws.log(f"scale: writing {n:,} entries")
        caches[n], secs = _scale_file(ws, n)
        t.arm(str(n), f"{n:,} entries")
        o.info[f"write_seconds_{n}"] = secs
        path = kdb_files(caches[n])[0]
        t.add(str(n), "bytes_per_entry", file_bytes(path) / n)
    for r in range(runs):
        for n in sizes:
            ws.log(f"scale: {n:,} entries, run {r + 1}/{runs}")
            rnd = random.Random(1000 * r + n)
            idx = [rnd.randrange(n) for _ in range(hits + 1)]
            env = ws.env(KDB_CACHE_DIR=caches[n])
            p = child("scale", {"indices": idx, "stats_reps": 5}, env)
            t.add(str(n), "first", p.data["first_hit"])
            for v in p.data["hits"]:
                t.add(str(n), "hit", v)
            t.add(str(n), "stats", median(p.data["stats"]))
            cli = command([PYTHON, "-m", "kdb.cli", "stats", "--json"], env)
            t.add(str(n), "cli", cli.wall)
    ev = o.table("eviction on a copy of each file: a fixed 100 entries' bytes, then a third "
                 "of what is stored (the cap's rule)", ref,
                 [Metric("fixed", "evict 100 entries", unit="ms"),
                  Metric("third", "evict a third", unit="ms"),
                  Metric("removed", "entries removed (third)", unit="n", ratio=False)])
    for n in sizes:
        ev.arm(str(n), f"{n:,} entries")
        for r in range(runs):
            fixed, third, removed = _evict_once(kdb_files(caches[n])[0])
            ev.add(str(n), "fixed", fixed)
            ev.add(str(n), "third", third)
            ev.add(str(n), "removed", removed)

    size_t = o.table("size on disk: user file against the raw bytes it holds", None,
                     [Metric("entries", "entries", unit="n"),
                      Metric("raw", "raw bytes", unit="B"),
                      Metric("stored", "stored (zstd) bytes", unit="B"),
                      Metric("file", "file bytes", unit="B"),
                      Metric("file_raw", "file / raw", unit="x"),
                      Metric("stored_raw", "stored / raw", unit="x")])
    primed = kdb_primed(ws)
    rows = [("pocl", f"real PoCL binaries ({ws.opts.kernels} kernels)", primed.user_file)]
    rows += [(str(n), f"synthetic, {n:,} entries", kdb_files(caches[n])[0]) for n in sizes]
    for arm, label, path in rows:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            cnt, raw, stored = conn.execute(
                "SELECT count(*), coalesce(sum(raw_size), 0), coalesce(sum(stored_size), 0) "
                "FROM kernels").fetchone()
        finally:
            conn.close()
        size_t.arm(arm, label)
        fb = file_bytes(path)
        for k, v in (("entries", cnt), ("raw", raw), ("stored", stored), ("file", fb),
                     ("file_raw", fb / raw if raw else None),
                     ("stored_raw", stored / raw if raw else None)):
            size_t.add(arm, k, v)
    _zstd_levels(ws, o, primed.user_file)
    compact_checks = _compact_size(ws, o)
    big = str(sizes[-1])
    o.checks += [
        at_most(f"scale: hit with {sizes[-1]:,} entries vs {sizes[0]:,}", t.ratio(big, "hit"), 1.5),
        at_most(f"scale: report.stats() with {sizes[-1]:,} entries vs {sizes[0]:,} "
                "(no scan: ~1x)", t.ratio(big, "stats"), 1.5),
        at_most("size: user file vs raw bytes of real PoCL binaries",
                size_t.median("pocl", "file_raw"), 0.6),
        *compact_checks,
    ]


# -- 6. CUDA --------------------------------------------------------------------------------

def cuda(ws: Workspace, o: Outcome) -> None:
    runs = ws.opts.n(3)
    arch = "sm_90"
    o.title = (f"CUDA: nvcc and NVRTC compiles against kdb hits for the same kernel ({arch}, "
               f"median of {runs})")
    if importlib.util.find_spec("kdb.cuda") is None:
        o.status, o.reason = "skipped", "kdb.cuda does not exist (yet)"
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        o.status, o.reason = "skipped", "nvcc is not on PATH"
        return
    from kdb.backends.cuda import nvrtc as _nvrtc

    try:
        _nvrtc.find_nvrtc()
        compilers = ["nvcc", "nvrtc"]
    except Exception as err:  # noqa: BLE001 - NVRTC's arms are skipped, nvcc's still run
        compilers = ["nvcc"]
        o.notes.append(f"NVRTC arms skipped: {err}")
    src = ws.path / "saxpy.cu"
    src.write_text(_workloads.CUDA_SOURCE)
    metrics = [Metric("call", "compile / hit call"), Metric("wall", "process")]
    t = o.table("one kernel (saxpy); fresh process per run", "nvcc", metrics,
                note="kdb miss: empty cache; kdb hit: a fresh process on the primed cache; "
                     "warm: repeated calls in that process; no compiler: a fresh process with "
                     "neither nvcc nor NVRTC reachable, served the newest stored build")
    t.arm("nvcc", f"nvcc -cubin -arch={arch}")
    for c in compilers:
        t.arm(f"{c}-miss", f"kdb.cuda.compile(compiler={c!r}), miss")
        t.arm(f"{c}-hit", f"kdb.cuda.compile(compiler={c!r}), hit (fresh process)")
        t.arm(f"{c}-warm", f"kdb.cuda.compile(compiler={c!r}), hit (warm process)")
    t.arm("nocc-hit", "kdb.cuda.compile, no compiler: stored build (fresh process)")
    primed = ws.path / "cuda-primed"
    args = {"source": _workloads.CUDA_SOURCE, "arch": arch}
    for c in compilers:
        child("cuda", {**args, "reps": 0, "compiler": c}, ws.env(KDB_CACHE_DIR=primed))
    if not kdb_files(primed):
        raise BenchError("kdb.cuda.compile stored nothing in the user tier at exit")
    hide = ws.path / "hide-nvrtc"
    (hide / "nvidia").mkdir(parents=True, exist_ok=True)
    (hide / "nvidia" / "__init__.py").write_text("")  # shadows NVIDIA's wheels' namespace
    no_compiler = ws.env(KDB_CACHE_DIR=primed, PATH=ws.path / "no-bin", KDB_NVCC=None,
                         KDB_NVRTC=None, CUDA_HOME=ws.path / "no-cuda", PYTHONPATH=hide)
    hit_compiles = 0
    for r in range(runs):
        ws.log(f"cuda: run {r + 1}/{runs}")
        out = ws.fresh("nvcc") / "saxpy.cubin"
        p = command([nvcc, "-cubin", f"-arch={arch}", "-o", str(out), str(src)], ws.env())
        t.add("nvcc", "call", p.wall)
        t.add("nvcc", "wall", p.wall)
        for c in compilers:
            a = {**args, "compiler": c}
            p = child("cuda", {**a, "reps": 0}, ws.env(KDB_CACHE_DIR=ws.fresh("kdb-cuda")))
            t.add(f"{c}-miss", "call", p.phase("first_call"))
            t.add(f"{c}-miss", "wall", p.wall)
            p = child("cuda", {**a, "reps": 20}, ws.env(KDB_CACHE_DIR=primed))
            t.add(f"{c}-hit", "call", p.phase("first_call"))
            t.add(f"{c}-hit", "wall", p.wall)
            t.add(f"{c}-warm", "call", median(p.data["warm_calls"]))
            hit_compiles += p.data.get("compiles") or 0
        p = child("cuda", {**args, "reps": 0}, no_compiler)
        t.add("nocc-hit", "call", p.phase("first_call"))
        t.add("nocc-hit", "wall", p.wall)
        hit_compiles += p.data.get("compiles") or 0
    if hit_compiles:
        o.notes.append(f"the hit arms compiled {hit_compiles} time(s): not served from the cache")
    o.info["binary_size"] = p.data.get("binary_size")
    ratio = t.ratio("nvcc-hit", "call")
    if ratio:
        o.notes.append(f"a kdb hit in a fresh process costs 1/{1 / ratio:,.0f} of an nvcc "
                       "compile (the call alone)")


# -- 7. a test suite run twice, back to back -------------------------------------------------

SUITE_PARTS = ("array", "kernels")
SUITE_SCRIPT = Path(__file__).resolve().parent / "_suite_workload.py"


def _suite_run(env: dict[str, str], scale: int) -> dict[str, float]:
    """The suite's processes, each started as soon as the previous one exited."""
    out = {"wall": 0.0, "compiles": 0, "programs": 0, "slowest_part": 0.0}
    for part in SUITE_PARTS:
        p = command([PYTHON, str(SUITE_SCRIPT), part, str(scale)], env, timeout=1800)
        out[part] = p.wall
        out["wall"] += p.wall
        out["compiles"] += p.data.get("compiles", 0)
        out["programs"] += p.data.get("programs", 0)
    return out


def suite(ws: Workspace, o: Outcome) -> None:
    scale = 1 if ws.opts.quick else 2
    runs = ws.opts.n(1)
    o.title = ("Suite: a framework's test suite (unmodified pyopencl code: arrays, math, "
               "reductions, scans, kernels with #include; every result checked), "
               f"{len(SUITE_PARTS)} processes back to back, run twice in a row")
    metrics = [Metric("run1", "run 1"), Metric("run2", "run 2"),
               Metric("c1", "compiles run 1", unit="n", ratio=False),
               Metric("c2", "compiles run 2", unit="n", ratio=False),
               Metric("programs", "programs a run", unit="n", ratio=False),
               Metric("after", "store worker after run 2", ratio=False),
               Metric("run3", "run 3 (later)"),
               Metric("c3", "compiles run 3", unit="n", ratio=False)]
    limits = {"kept": 0.6, "fresh": 0.4}
    ag = "absent" if autogroup() is None else autogroup()
    o.info["sched_autogroup_enabled"] = autogroup()
    for policy in ("kept", "fresh"):
        t = o.table(f"PoCL's cache {policy} between run 1 and run 2"
                    + (" (only kdb's cache survives)" if policy == "fresh" else "")
                    + f"; median of {runs}; run 3 starts once kdb's store worker is idle"
                    + f"; sched_autogroup_enabled = {ag}",
                    "nokdb", metrics)
        t.arm("nokdb", "no kdb (plain pyopencl)")
        t.arm("kdb", "kdb through kdb.opencl.install(), defaults")
        ratios_2_to_1: list[float] = []
        for r in range(runs):
            for arm in ("nokdb", "kdb"):
                ws.log(f"suite: PoCL cache {policy}, {arm}, run {r + 1}/{runs}")
                cache = ws.fresh("kdb-suite")
                pocl = ws.fresh("pocl-suite")
                env = ws.env(KDB_CACHE_DIR=cache, KDB_STORE_AT_EXIT=None,
                             KDB_SUITE="1" if arm == "kdb" else None)
                one = _suite_run({**env, "POCL_CACHE_DIR": str(pocl)}, scale)
                if policy == "fresh":
                    pocl = ws.fresh("pocl-suite")
                two = _suite_run({**env, "POCL_CACHE_DIR": str(pocl)}, scale)
                t.add(arm, "run1", one["wall"])
                t.add(arm, "run2", two["wall"])
                t.add(arm, "c1", one["compiles"])
                t.add(arm, "c2", two["compiles"])
                t.add(arm, "programs", one["programs"])
                if arm == "kdb":
                    ratios_2_to_1 += [two[p] / one[p] for p in SUITE_PARTS]
                    t.add(arm, "after", wait_for_worker(cache, timeout=3600))
                if policy == "fresh":
                    pocl = ws.fresh("pocl-suite")
                three = _suite_run({**env, "POCL_CACHE_DIR": str(pocl)}, scale)
                t.add(arm, "run3", three["wall"])
                t.add(arm, "c3", three["compiles"])
        o.checks.append(at_most(f"suite, PoCL cache {policy}: run 1, kdb vs no kdb "
                                f"(autogroup {ag})", t.ratio("kdb", "run1"), 1.05))
        o.checks.append(at_most(f"suite, PoCL cache {policy}: run 2, kdb vs no kdb",
                                t.ratio("kdb", "run2"), limits[policy]))
        o.checks.append(at_most(f"suite, PoCL cache {policy}: run 2 compiles, kdb",
                                t.median("kdb", "c2"), 0, unit=" compiles"))
        o.checks.append(at_most(f"suite, PoCL cache {policy}: run 3 compiles, kdb",
                                t.median("kdb", "c3"), 0, unit=" compiles"))
        o.checks.append(at_most(f"suite, PoCL cache {policy}: slowest process of run 2 vs "
                                "the same process in run 1, kdb", max(ratios_2_to_1), 1.0))
    _suite_intel(ws, o, scale, runs, metrics[:5])
    o.notes.append("Each run's time is every process from spawn to exit, started back to back, "
                   "so whatever kdb leaves running (its store worker) is paid for by the next "
                   "process; 'store worker after run 2' is how long it went on after run 2.")


def _intel_env(ws: Workspace) -> dict[str, Any] | None:
    """The environment that runs a child on Intel's CPU runtime alone; None where it is not
    installed (tools/ensure_opencl.sh puts it in <venv>/opencl-intel)."""
    lib = Path(sys.prefix) / "opencl-intel" / "lib" / "libintelocl.so"
    if not lib.exists():
        return None
    icds = ws.path / "intel-icds"
    icds.mkdir(exist_ok=True)
    (icds / "intel.icd").write_text(f"{lib}\n")
    return {"OCL_ICD_VENDORS": icds, "KDB_BENCH_PLATFORM": "Intel"}


def _suite_intel(ws: Workspace, o: Outcome, scale: int, runs: int, metrics: list) -> None:
    """The suite on Intel's CPU runtime, twice: pyopencl's own binary cache (on for that
    runtime) kept between the runs is the reference, against kdb with defaults."""
    intel = _intel_env(ws)
    if intel is None:
        o.notes.append("Intel's CPU runtime is not installed: no Intel arms.")
        return
    t = o.table(f"Intel's CPU runtime: pyopencl's own cache kept between run 1 and run 2 "
                f"(XDG_CACHE_HOME); median of {runs}", "pyopencl", metrics)
    t.arm("pyopencl", "no kdb (pyopencl's own binary cache)")
    t.arm("kdb", "kdb through kdb.opencl.install(), defaults (pyopencl's cache kept too)")
    for r in range(runs):
        for arm in ("pyopencl", "kdb"):
            ws.log(f"suite: Intel's runtime, {arm}, run {r + 1}/{runs}")
            env = ws.env(**intel, KDB_CACHE_DIR=ws.fresh("kdb-suite"), KDB_STORE_AT_EXIT=None,
                         XDG_CACHE_HOME=ws.fresh("xdg-suite"),
                         KDB_SUITE="1" if arm == "kdb" else None)
            one, two = _suite_run(env, scale), _suite_run(env, scale)
            for metric, value in (("run1", one["wall"]), ("run2", two["wall"]),
                                  ("c1", one["compiles"]), ("c2", two["compiles"]),
                                  ("programs", one["programs"])):
                t.add(arm, metric, value)
    o.checks.append(at_most("suite on Intel's CPU runtime: run 1, kdb vs pyopencl's own cache",
                            t.ratio("kdb", "run1"), 1.05))
    o.checks.append(at_most("suite on Intel's CPU runtime: run 2, kdb vs pyopencl's own cache",
                            t.ratio("kdb", "run2"), 1.0))


# -- 8. zero-code adoption --------------------------------------------------------------------

_PLAIN_APP = """\
import json, sys
import numpy as np
import pyopencl as cl

ctx = cl.Context(cl.get_platforms()[0].get_devices())
q = cl.CommandQueue(ctx)
a = np.arange(256, dtype=np.float32)
d_a = cl.Buffer(ctx, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
d_out = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, a.nbytes)
for k in json.load(open(sys.argv[1])):
    prg = cl.Program(ctx, k["source"]).build()
    getattr(prg, k["name"])(q, a.shape, None, d_out, d_a, np.float32(2))
q.finish()
"""


def _bare_venvs(ws: Workspace) -> tuple[Path, Path]:
    """Two new virtual environments without pip, identical but for kdb's wheel (installed
    ``--no-deps``: a bare start imports none of kdb's dependencies) in the second."""

    def build() -> tuple[Path, Path]:
        import subprocess
        import venv

        from _harness import REPO

        d = ws.path / "auto-venvs"
        ws.log("auto: building a wheel of kdb and two bare virtual environments")
        subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w",
                        str(d / "dist"), str(REPO)], check=True, capture_output=True, timeout=600)
        pythons = []
        for name in ("without-kdb", "with-kdb"):
            venv.EnvBuilder(with_pip=False).create(d / name)
            pythons.append(d / name / "bin" / "python")
        wheel = sorted((d / "dist").glob("kdb-*.whl"))[-1]
        subprocess.run([PYTHON, "-m", "pip", "--python", str(pythons[1]), "install",
                        "--no-deps", "--quiet", str(wheel)], check=True, capture_output=True,
                       timeout=600)
        return pythons[0], pythons[1]

    return ws.memo("auto_venvs", build)


_SITE_PASS = """\
import json, site, sysconfig, timeit
sp = sysconfig.get_paths()["purelib"]
t = min(timeit.repeat(lambda: site.addsitedir(sp, set()), number=500, repeat=7)) / 500
print("BENCH-JSON:" + json.dumps({"pass": t}))
"""


def _site_passes(python: Path) -> int:
    """How many times ``site`` reads this venv's .pth files at start-up (Python 3.11: 2)."""
    import subprocess

    [sp] = python.parent.parent.glob("lib/python*/site-packages")
    probe = sp / "zz-kdb-bench-count.pth"
    probe.write_text("import sys; sys.__dict__.setdefault('_kdb_bench_passes', []).append(1)\n")
    try:
        out = subprocess.run([str(python), "-c", "import sys; print(len(sys._kdb_bench_passes))"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    finally:
        probe.unlink()
    return int(out.strip())


def auto(ws: Workspace, o: Outcome) -> None:
    runs = ws.opts.runs or (15 if ws.opts.quick else 100)
    o.title = ("Zero-code adoption: interpreter start-up with kdb installed (KDB_AUTO unset, "
               "0, 1) against a venv without kdb; an unmodified pyopencl script run twice "
               "under `kdb run`")
    without, with_kdb = _bare_venvs(ws)
    t = o.table(f"interpreter start-up; median of {runs}, arms interleaved", "without",
                [Metric("wall", "python -c pass, wall", unit="ms"),
                 Metric("wall_diff", "wall, paired diff", unit="us", ratio=False),
                 Metric("site", "site.main()", unit="us"),
                 Metric("site_diff", "site, paired diff", unit="us", ratio=False)],
                note="two new venvs without pip, the second with kdb's wheel (--no-deps). "
                     "wall: `python -c pass`, spawn to exit; site: `python -S` timing "
                     "`import site; site.main()` in the child (every .pth file read and run, "
                     "without a process start's noise); paired diff: median over runs of "
                     "(arm - without) within a run")
    arms = [("without", "venv without kdb", without, None),
            ("unset", "kdb installed, KDB_AUTO unset", with_kdb, None),
            ("zero", "kdb installed, KDB_AUTO=0", with_kdb, "0"),
            ("on", "kdb installed, KDB_AUTO=1 (hook in place, no pyopencl)", with_kdb, "1")]
    for arm, label, _, _ in arms:
        t.arm(arm, label)
    site_code = ("import time; t = time.perf_counter(); import site; site.main(); "
                 "print('BENCH-JSON:{\"site\": %r}' % (time.perf_counter() - t))")
    diffs: dict[str, dict[str, list[float]]] = {"wall": {}, "site": {}}
    for r in range(runs):
        if r % 25 == 0:
            ws.log(f"auto: start-up run {r + 1}/{runs}")
        got: dict[str, dict[str, float]] = {"wall": {}, "site": {}}
        for arm, _, py, value in random.sample(arms, len(arms)):
            env = ws.env(KDB_AUTO=value)
            got["wall"][arm] = command([str(py), "-c", "pass"], env).wall
            got["site"][arm] = command([str(py), "-S", "-c", site_code], env).data["site"]
        for metric, per_arm in got.items():
            for arm, v in per_arm.items():
                t.add(arm, metric, v)
                diffs[metric].setdefault(arm, []).append(v - per_arm["without"])
    for metric in ("wall", "site"):
        for arm, d in diffs[metric].items():
            t.add(arm, f"{metric}_diff", median(d))
    passes = _site_passes(without)
    pt = o.table("one pass of site over the venv's site-packages, in one process (best of "
                 "7 x 500 addsitedir calls, KDB_AUTO unset)", "without",
                 [Metric("pass", "per pass", unit="us"),
                  Metric("start", f"per start ({passes} passes)", unit="us")],
                 note="the process-noise-free cost of what kdb adds to every start: reading "
                      "kdb-auto.pth and compiling and running its line")
    pt.arm("without", "venv without kdb")
    pt.arm("with", "kdb installed")
    for arm, py in (("without", without), ("with", with_kdb)):
        p = command([str(py), "-c", _SITE_PASS], ws.env())
        pt.add(arm, "pass", p.data["pass"])
        pt.add(arm, "start", p.data["pass"] * passes)
    per_start = (pt.median("with", "start") or 0) - (pt.median("without", "start") or 0)
    o.info["site_passes"] = passes
    o.checks.append(at_most("start-up with kdb installed, KDB_AUTO unset: site's work on "
                            "site-packages per start, vs a venv without kdb (in-process)",
                            per_start * 1e3, 0.2, unit=" ms"))
    o.checks.append(at_most("start-up with kdb installed, KDB_AUTO unset: site.main() "
                            "paired difference vs a venv without kdb",
                            median(diffs["site"]["unset"]) * 1e3, 0.2, unit=" ms"))
    o.checks.append(at_most("start-up with kdb installed, KDB_AUTO unset: python -c pass "
                            "wall, paired difference vs a venv without kdb (noisy)",
                            median(diffs["wall"]["unset"]) * 1e3, 0.2, unit=" ms"))

    # An unmodified pyopencl script, twice under `kdb run`.
    n_k = ws.opts.kernels
    kfile = ws.path / "auto-kernels.json"
    kfile.write_text(json.dumps(_workloads.kernels(n_k)))
    app = ws.path / "plain_app.py"
    app.write_text(_PLAIN_APP)
    kdb_exe = str(Path(PYTHON).parent / "kdb")
    rt = o.table(f"plain pyopencl script, {n_k} kernels, under `kdb run` (one cache; each run "
                 "a fresh POCL_CACHE_DIR)", "plain",
                 [Metric("wall", "wall", unit="s"),
                  Metric("compiled", "compiled", unit="n", ratio=False),
                  Metric("served", "served", unit="n", ratio=False)])
    rt.arm("plain", "python app.py (no kdb)")
    rt.arm("first", "kdb run, first run (empty cache)")
    rt.arm("second", "kdb run, second run")
    rt.note = ("KDB_STORE_AT_EXIT=detach (the default); the detached store of the first run "
               "is waited for before the second")
    cache = ws.fresh("auto-cache")
    p = command([PYTHON, str(app), str(kfile)], ws.env(POCL_CACHE_DIR=ws.fresh("auto-pocl")))
    rt.add("plain", "wall", p.wall)
    for arm in ("first", "second"):
        ws.log(f"auto: kdb run, {arm} run")
        p = command([kdb_exe, "run", "--json", "--", PYTHON, str(app), str(kfile)],
                    ws.env(KDB_CACHE_DIR=cache, POCL_CACHE_DIR=ws.fresh("auto-pocl"),
                           KDB_STORE_AT_EXIT="detach"))
        summary = json.loads(p.stderr.strip().splitlines()[-1])
        o.info[f"kdb_run_{arm}_detached_store_s"] = wait_for_worker(cache)
        rt.add(arm, "wall", p.wall)
        rt.add(arm, "compiled", summary["compiled"])
        rt.add(arm, "served", summary["served"])
    o.checks.append(at_most("plain pyopencl script under `kdb run`, second run: kernels "
                            "compiled", rt.median("second", "compiled"), 0, unit=""))


SCENARIOS: dict[str, Callable[[Workspace, Outcome], None]] = {
    "warm": warm, "cold": cold, "hit": hit, "many": many, "scale": scale, "cuda": cuda, "hip": hip,
    "suite": suite, "auto": auto, "script": script, "adopt": adopt, "triton": triton,
    "trust": trust, "uncached": uncached, "fresh": fresh, "busy": busy,
    "batch": batch, "xdist": xdist,
}

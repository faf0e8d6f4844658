"""The ``fresh`` scenario: a fresh machine with the pack (issue 28, item 3).

A client-style suite (``_suite_workload.py`` with ``SUITE_RESIZE=1``: unmodified pyopencl
code through ``kdb.opencl.install()``, 2 processes back to back, each part run again at two
other sizes after its stores landed) runs once with kdb on empty caches; once
the store worker is idle, ``kdb pack --from-db`` packs what it stored, and the pack is
installed on a "fresh machine" through ``KDB_SYSTEM_DB_PATH`` (the way ``warm`` installs its
system file): an empty kdb user tier, empty PoCL and pyopencl caches. That run is held
against the same suite with every cache warm (run 1's kdb user tier and PoCL cache). The
whole is done twice: with the stored binaries refreshed (the default) and with
``KDB_DISABLE_REFRESH=1`` (what kdb did before: binaries as the store read them).
"""

from __future__ import annotations

import os
from pathlib import Path

from _harness import PYTHON, Metric, Outcome, Table, Workspace, at_most, command, wait_for_worker


def _suite(env: dict[str, str], scale: int) -> dict[str, float]:
    from _scenarios import _suite_run  # the suite scenario's runner (imported late: no cycle)

    return _suite_run({**env, "SUITE_RESIZE": "1"}, scale)


def _so_files(pocl: Path) -> set[tuple[str, str]]:
    """``(build hash, path)`` of every work-group function in a PoCL cache directory."""
    out = set()
    for root, _, names in os.walk(pocl):
        for name in names:
            if name.endswith(".so"):
                rel = os.path.relpath(os.path.join(root, name), pocl)
                parts = rel.split(os.sep)
                if len(parts) >= 5:  # AB/CDE.../kernel/variant/kernel.so
                    out.add(("/".join(parts[:2]), "/" + "/".join(parts[2:])))
    return out


def _packed_files(pack_dir: Path) -> tuple[set[tuple[str, str]], int, int]:
    """What the pack's binaries carry (``(build hash, path)``), its entries and its bytes."""
    import sqlite3

    from kdb.backends.opencl import poclbin
    from kdb.file import codec

    carried, entries, size = set(), 0, 0
    for f in pack_dir.glob("*.kdb"):
        size += f.stat().st_size
        conn = sqlite3.connect(f"file:{f}?mode=ro", uri=True)
        try:
            rows = conn.execute("SELECT codec, blob, raw_size, checksum FROM kernels").fetchall()
        finally:
            conn.close()
        for kind, blob, raw_size, checksum in rows:
            entries += 1
            raw = codec.decode(kind, blob, raw_size, checksum)
            found = poclbin.layout(raw) if raw else None
            if found is not None:
                carried |= {(found.build_hash, p) for k in found.kernels for p in k.files}
    return carried, entries, size


def _arm(ws: Workspace, t: Table, arm: str, scale: int, refresh: bool) -> dict[str, float]:
    """Run 1, the pack, and the fresh machine's run for one arm; returns run 1's caches."""
    cache, pocl = ws.fresh("kdb-fresh"), ws.fresh("pocl-fresh")
    env = ws.env(KDB_CACHE_DIR=cache, KDB_STORE_AT_EXIT=None, KDB_SUITE="1",
                 POCL_CACHE_DIR=pocl, XDG_CACHE_HOME=ws.fresh("xdg-fresh"),
                 KDB_DISABLE_REFRESH=None if refresh else "1")
    ws.log(f"fresh: {arm}: run 1 (empty caches)")
    one = _suite(env, scale)
    settled = wait_for_worker(cache, timeout=3600)
    pack_dir = ws.fresh("fresh-pack")
    pack = command([PYTHON, "-m", "kdb.cli", "pack", "--arch", "native", "--from-db", str(cache),
                    "--out", str(pack_dir)], env, timeout=1800)
    carried, entries, size = _packed_files(pack_dir)
    ws.log(f"fresh: {arm}: the fresh machine's run ({entries} entries in the pack)")
    machine = ws.fresh("pocl-machine")
    two = _suite(ws.env(KDB_CACHE_DIR=ws.fresh("kdb-machine"), KDB_STORE_AT_EXIT=None,
                        KDB_SUITE="1", KDB_SYSTEM_DB_PATH=pack_dir, POCL_CACHE_DIR=machine,
                        XDG_CACHE_HOME=ws.fresh("xdg-machine")), scale)
    t.add(arm, "run1", one["wall"])
    t.add(arm, "settle", settled)
    t.add(arm, "pack_s", pack.wall)
    t.add(arm, "entries", entries)
    t.add(arm, "pack_mb", size / 2**20)
    t.add(arm, "wall", two["wall"])
    t.add(arm, "compiles", two["compiles"])
    t.add(arm, "generated", len(_so_files(machine) - carried))
    return {"cache": cache, "pocl": pocl, "env": env, "programs": two["programs"]}


def fresh(ws: Workspace, o: Outcome) -> None:
    scale = 1 if ws.opts.quick else 2
    o.title = ("A fresh machine with the pack: a client-style suite (2 processes, unmodified "
               "pyopencl code through kdb.opencl.install()) on empty kdb, PoCL and pyopencl "
               "caches, served by a pack `kdb pack --from-db` built from one earlier run, "
               "against the same suite with every cache warm")
    metrics = [Metric("wall", "suite", unit="s"),
               Metric("compiles", "compiles", unit="n", ratio=False),
               Metric("generated", "work-group functions PoCL generated", unit="n", ratio=False),
               Metric("run1", "run 1 (empty caches)", unit="s", ratio=False),
               Metric("settle", "store worker after run 1", unit="s", ratio=False),
               Metric("pack_s", "kdb pack", unit="s", ratio=False),
               Metric("entries", "pack entries", unit="n", ratio=False),
               Metric("pack_mb", "pack MiB", unit="x", ratio=False)]
    t = o.table("each arm its own run 1 and pack; the fresh machine: KDB_SYSTEM_DB_PATH = the "
                "pack, every cache empty", "warm", metrics)
    t.arm("warm", "every cache warm (run 1's kdb user tier and PoCL cache)")
    t.arm("pocl_empty", "run 1's kdb user tier, PoCL's and pyopencl's caches empty")
    t.arm("pack", "fresh machine, pack of refreshed binaries (default)")
    t.arm("before", "fresh machine, pack with KDB_DISABLE_REFRESH=1 (binaries as stored)")
    got = _arm(ws, t, "pack", scale, refresh=True)
    ws.log("fresh: every cache warm; then PoCL's cache empty")
    warm = _suite({**got["env"], "POCL_CACHE_DIR": str(got["pocl"])}, scale)
    t.add("warm", "wall", warm["wall"])
    t.add("warm", "compiles", warm["compiles"])
    machine = ws.fresh("pocl-user-tier")
    bound = _suite({**got["env"], "POCL_CACHE_DIR": str(machine),
                    "XDG_CACHE_HOME": str(ws.fresh("xdg-user-tier"))}, scale)
    t.add("pocl_empty", "wall", bound["wall"])
    t.add("pocl_empty", "compiles", bound["compiles"])
    _arm(ws, t, "before", scale, refresh=False)
    o.info["programs"] = got["programs"]
    o.checks.append(at_most("fresh machine with the pack vs every cache warm",
                            t.ratio("pack", "wall"), 1.5))
    o.checks.append(at_most("fresh machine with the pack: compiles", t.median("pack", "compiles"),
                            0, unit=" compiles"))
    o.checks.append(at_most("fresh machine with the pack: work-group functions PoCL generated",
                            t.median("pack", "generated"), 0, unit=""))
    o.checks.append(at_most("fresh machine with the pack vs run 1's user tier with PoCL's cache "
                            "empty (what PoCL's own unpacking costs)",
                            t.ratio("pack", "wall", "pocl_empty"), 1.2))
    o.notes.append("'before': the same with KDB_DISABLE_REFRESH=1 in run 1, so the pack holds "
                   "each binary as the store worker read it, about a second after its build "
                   f"(fresh machine vs warm: {_fmt(t.ratio('before', 'wall'))}).")
    o.notes.append("'work-group functions PoCL generated': .so files in the fresh machine's "
                   "PoCL cache that no binary of the pack carried (each is a JIT at a launch).")
    o.notes.append("'PoCL's cache empty': every binary at hand in the user tier; what PoCL "
                   "itself costs a fresh machine (it unpacks each loaded binary into its "
                   "cache, one fdatasync per file), which no pack can save "
                   f"({_fmt(t.ratio('pocl_empty', 'wall'))} of warm).")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"

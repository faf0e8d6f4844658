"""What every benchmark scenario shares: child processes, medians, tables, checks, fixtures.

Times are taken with :func:`time.perf_counter`, which on Linux reads ``CLOCK_MONOTONIC``, a
clock shared by all processes: a child's stamps can be set against the parent's, so a
process's wall time splits into start-up (spawn to the child's first statement), the phases
the child times itself, and exit (its last statement to the parent seeing it gone: atexit
handlers, kdb's deferred stores, interpreter teardown).

Only ratios measured in the same run mean anything on these shared machines; absolute times
drift. Arms are interleaved run by run for the same reason.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
CHILD = BENCH_DIR / "_child.py"
PYTHON = sys.executable
JSON_TAG = "BENCH-JSON:"

#: Variables the harness sets itself, per arm; inherited values would make arms unequal.
_OWNED_PREFIXES = ("KDB_", "TRITON_CACHE", "TRITON_REMOTE_CACHE")
_OWNED = ("POCL_CACHE_DIR", "POCL_KERNEL_CACHE", "PYOPENCL_NO_CACHE", "PYOPENCL_CTX")


class BenchError(Exception):
    """A benchmark could not run as designed (a child failed, a fixture is incomplete)."""


# -- child processes ------------------------------------------------------------------------

@dataclass
class Proc:
    """One finished child process."""

    wall: float  # spawn to exit, seen by the parent
    data: dict[str, Any]  # the child's JSON (empty for plain commands)
    rc: int
    stderr: str
    t_spawn: float
    t_exit: float

    @property
    def startup(self) -> float | None:
        t = self.data.get("t_begin")
        return None if t is None else t - self.t_spawn

    @property
    def exit(self) -> float | None:
        t = self.data.get("t_end")
        return None if t is None else self.t_exit - t

    def phase(self, name: str) -> float | None:
        return self.data.get("phases", {}).get(name)


class Running:
    """A child started by :func:`spawn`; :meth:`wait` returns its :class:`Proc`."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None) -> None:
        self.argv = argv
        self.t_spawn = time.perf_counter()
        self.popen = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)

    def wait(self, timeout: float = 600, check: bool = True) -> Proc:
        try:
            out, err = self.popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            out, err = self.popen.communicate()
            raise BenchError(f"timed out after {timeout:.0f} s: {_show(self.argv)}\n"
                             f"{_tail(err)}") from None
        t_exit = time.perf_counter()
        data: dict[str, Any] = {}
        for line in out.splitlines():
            if line.startswith(JSON_TAG):
                data = json.loads(line[len(JSON_TAG):])
        proc = Proc(t_exit - self.t_spawn, data, self.popen.returncode, err, self.t_spawn, t_exit)
        if check and proc.rc != 0:
            raise BenchError(f"child failed (exit {proc.rc}): {_show(self.argv)}\n{_tail(err)}")
        return proc


def spawn(task: str, args: dict[str, Any], env: dict[str, str]) -> Running:
    """Start ``_child.py task`` in a fresh interpreter (it prints one JSON line)."""
    return Running([PYTHON, str(CHILD), task, json.dumps(args)], env, None)


def child(task: str, args: dict[str, Any], env: dict[str, str], timeout: float = 600,
          check: bool = True) -> Proc:
    """Run ``_child.py task`` to completion."""
    return spawn(task, args, env).wait(timeout, check)


def command(argv: list[str], env: dict[str, str], timeout: float = 600,
            check: bool = True) -> Proc:
    """Run any command to completion, timing it from spawn to exit."""
    return Running(argv, env, None).wait(timeout, check)


def _show(argv: list[str]) -> str:
    return " ".join(a if len(a) < 120 else a[:117] + "..." for a in argv)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def base_env(ws: "Workspace") -> dict[str, str]:
    """The parent's environment less every variable the arms set, with private caches."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_OWNED_PREFIXES) and k not in _OWNED}
    env["XDG_CACHE_HOME"] = str(ws.path / "xdg-cache")  # nothing lands in the real home cache
    env["KDB_CACHE_DIR"] = str(ws.path / "kdb-unused")  # each arm sets its own
    # Children store before they exit, so what they stored can be counted at once; the
    # scenarios about exit (cold, many) set the default, detach, and wait for the worker.
    env["KDB_STORE_AT_EXIT"] = "wait"
    return env


def precompile() -> None:
    """Bring the ``.pyc`` files of kdb and of the benchmarks up to date.

    An installed kdb imports from ``.pyc``; a module edited since its ``.pyc`` was written is
    compiled from source by every fresh process that imports it (never cached where
    PYTHONDONTWRITEBYTECODE=1 is set, as on these machines), which would add a compile per
    module to kdb's arms. Run before each scenario: kdb's files may change while the suite runs.
    """
    import compileall
    import importlib.util

    import kdb

    dirs = [Path(kdb.__file__).resolve().parent, BENCH_DIR]
    spec = importlib.util.find_spec("kdb.migrations")  # the tree's migrations/ when editable
    if spec is not None and spec.origin:
        dirs.append(Path(spec.origin).resolve().parent)
    for d in dirs:
        compileall.compile_dir(str(d), quiet=2)


# -- numbers --------------------------------------------------------------------------------

def median(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


@dataclass(frozen=True)
class Metric:
    """A column: ``key`` in the samples, its heading, and how to print it."""

    key: str
    label: str
    unit: str = "ms"  # "s", "ms", "us" (values are seconds), or "n", "B", "x" (as is)
    ratio: bool = True  # print the ratio to the reference arm

    def show(self, value: float | None) -> str:
        if value is None:
            return "-"
        if self.unit == "s":
            return f"{value:.2f}"
        if self.unit == "ms":
            v = value * 1e3
            return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"
        if self.unit == "us":
            v = value * 1e6
            return f"{v:.1f}" if v < 1000 else f"{v:,.0f}"
        if self.unit == "B":
            return f"{value:,.0f}"
        if self.unit == "x":
            return f"{value:.3f}"
        return f"{value:g}"


@dataclass
class Table:
    """Arms (rows) by metrics (columns), each cell the median of its samples."""

    name: str
    reference: str | None
    metrics: list[Metric]
    note: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def arm(self, arm: str, label: str) -> None:
        self.labels.setdefault(arm, label)
        self.samples.setdefault(arm, {})

    def add(self, arm: str, metric: str, value: float | None) -> None:
        if value is None:
            return
        self.samples.setdefault(arm, {}).setdefault(metric, []).append(value)

    def median(self, arm: str, metric: str) -> float | None:
        return median(self.samples.get(arm, {}).get(metric, []))

    def ratio(self, arm: str, metric: str, reference: str | None = None) -> float | None:
        ref = reference or self.reference
        if ref is None:
            return None
        num, den = self.median(arm, metric), self.median(ref, metric)
        if num is None or not den:
            return None
        return num / den

    def to_json(self) -> dict[str, Any]:
        rows = []
        for arm in self.samples:
            cells = {}
            for m in self.metrics:
                vals = self.samples[arm].get(m.key, [])
                if not vals:
                    continue
                cells[m.key] = {"median": median(vals), "ratio": self.ratio(arm, m.key),
                                "n": len(vals), "min": min(vals), "max": max(vals),
                                "samples": vals}
            rows.append({"arm": arm, "label": self.labels.get(arm, arm), "metrics": cells})
        return {"name": self.name, "reference": self.reference, "note": self.note,
                "metrics": [{"key": m.key, "label": m.label, "unit": m.unit}
                            for m in self.metrics],
                "rows": rows}

    def render(self) -> str:
        ref = self.labels.get(self.reference or "", self.reference)
        head = ["arm"]
        for m in self.metrics:
            unit = "" if m.unit in ("n", "x") else f" {m.unit}"
            head.append(f"{m.label}{unit}")
            if m.ratio and self.reference:
                head.append("ratio")
        body = []
        for arm in self.samples:
            row = [self.labels.get(arm, arm)]
            for m in self.metrics:
                row.append(m.show(self.median(arm, m.key)))
                if m.ratio and self.reference:
                    r = self.ratio(arm, m.key)
                    row.append("-" if r is None else f"{r:.2f}x")
            body.append(row)
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

        def line(cells: list[str]) -> str:
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths)))

        title = f"-- {self.name}" + (f" (ratio: arm / {ref})" if self.reference else "")
        out = [title, line(head), line(["-" * w for w in widths])]
        out += [line(r) for r in body]
        if self.note:
            out.append(f"   {self.note}")
        return "\n".join(out)


@dataclass
class Check:
    """One of the figures docs/design.md holds kdb to, against what this run measured."""

    figure: str
    target: str
    value: float | None
    met: bool | None  # None: could not be decided (an arm missing)
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"figure": self.figure, "target": self.target, "value": self.value,
                "met": self.met, "detail": self.detail}

    def render(self) -> str:
        mark = {True: "MET   ", False: "MISSED", None: "n/a   "}[self.met]
        val = "-" if self.value is None else f"{self.value:.3g}"
        extra = f"  ({self.detail})" if self.detail else ""
        return f"  [{mark}] {self.figure}: {val}, target {self.target}{extra}"


def at_most(figure: str, value: float | None, limit: float, unit: str = "x",
            detail: str = "") -> Check:
    met = None if value is None else value <= limit
    return Check(figure, f"<= {limit:g}{unit}", value, met, detail)


def at_least(figure: str, value: float | None, limit: float, unit: str = "x",
             detail: str = "") -> Check:
    met = None if value is None else value >= limit
    return Check(figure, f">= {limit:g}{unit}", value, met, detail)


@dataclass
class Outcome:
    """What a scenario hands back to ``run.py``."""

    title: str
    tables: list[Table] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"  # "ok", "skipped", "error"
    reason: str = ""

    def table(self, *args: Any, **kwargs: Any) -> Table:
        t = Table(*args, **kwargs)
        self.tables.append(t)
        return t


# -- the workspace and its fixtures ------------------------------------------------------

@dataclass
class Options:
    quick: bool
    runs: int | None  # None: each scenario's default
    kernels: int
    verbose: bool

    def n(self, default: int) -> int:
        """Runs for a scenario: --runs if given, else 1 in --quick, else ``default``."""
        if self.runs is not None:
            return self.runs
        return 1 if self.quick else default


class Workspace:
    """A private temporary directory, and fixtures built in it on first use."""

    def __init__(self, opts: Options, root: Path | None = None) -> None:
        self.opts = opts
        self.path = Path(root or tempfile.mkdtemp(prefix="kdb-bench-"))
        self.path.mkdir(parents=True, exist_ok=True)
        self._count = 0
        self._memo: dict[str, Any] = {}
        self.log: Callable[[str], None] = lambda msg: None

    def fresh(self, stem: str) -> Path:
        """A new, empty directory."""
        self._count += 1
        d = self.path / f"{stem}-{self._count}"
        d.mkdir(parents=True)
        return d

    def env(self, **extra: str | Path | None) -> dict[str, str]:
        env = base_env(self)
        for k, v in extra.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = str(v)
        return env

    def memo(self, name: str, build: Callable[[], Any]) -> Any:
        if name not in self._memo:
            self._memo[name] = build()
        return self._memo[name]

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def wait_for_worker(cache_dir: Path, timeout: float = 900) -> float:
    """Wait for the store worker a child left (KDB_STORE_AT_EXIT=detach) to finish: every
    job stored and no worker running. Returns the seconds waited."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kdb.storing import spool

    start = time.perf_counter()
    deadline = start + timeout
    for v in cache_dir.glob("v*"):
        while spool.jobs(v) or any(spool.worker_running(d) for d in (v / "spool").glob("*")):
            if time.perf_counter() > deadline:
                raise BenchError(f"the store worker in {v} did not finish in {timeout:g} s")
            time.sleep(0.02)
    return time.perf_counter() - start


def kdb_files(cache_dir: Path) -> list[Path]:
    """The user tier's ``<arch>.kdb`` files under a ``KDB_CACHE_DIR``."""
    return sorted(p for p in cache_dir.glob("v*/*.kdb") if p.is_file())


def file_bytes(path: Path) -> int:
    """A SQLite file's size with its WAL (what it costs on disk right now)."""
    total = 0
    for suffix in ("", "-wal"):
        p = Path(str(path) + suffix)
        if p.exists():
            total += p.stat().st_size
    return total


def count_rows(path: Path, table: str) -> int:
    """Rows of ``table`` in a kdb file (read-only; 0 if the file or table is missing)."""
    if not path.exists():
        return 0
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: S608 - fixed names
    except sqlite3.DatabaseError:
        return 0
    finally:
        conn.close()

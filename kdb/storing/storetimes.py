"""What stores cost, per device: recorded by whoever stores a job, read by a process that
weighs waiting for a queued store against compiling (:mod:`kdb.storing.queued`).

A job holds its program's compile seconds; what storing it costs (building it again, then
reading its binaries back, which on PoCL generates code for every kernel) is recorded here
after each store, as ratios to the compile: the store's CPU seconds, and its rebuild's alone
(what a build costs where PoCL's cache already holds the program). The newest
:data:`RECENT` of each, per device, in ``<user dir>/store-times.json``; read as medians, so
that a few programs whose binaries take a minute to read (pyopencl's scans) do not make
every store look slow. A lost update (two lanes writing at once) loses one sample.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE = "store-times.json"
#: Samples kept per device and kind.
RECENT = 64
#: Compiles shorter than this are too short to measure a ratio against.
MIN_COMPILE_S = 0.005
#: With nothing recorded yet: a store costs about its compile (reading PoCL's binaries back
#: generates code much as the build did), and a rebuild that PoCL's cache answers a quarter
#: of it (measured on PoCL 3.0: 0.025 s after a 0.1 s build).
DEFAULT_STORE = 1.0
DEFAULT_BUILD = 0.25


def _read(user_dir: Path) -> dict:
    try:
        with open(Path(user_dir) / FILE, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(user_dir: Path, samples: list[tuple[str, float, float, float | None]]) -> None:
    """Add ``(arch, compile seconds, store CPU seconds, rebuild CPU seconds or None)`` samples."""
    samples = [s for s in samples if s[1] >= MIN_COMPILE_S]
    if not samples:
        return
    data = _read(user_dir)
    for arch, compile_s, store_s, build_s in samples:
        per = data.get(arch)
        per = per if isinstance(per, dict) else {}
        for kind, value in (("store", store_s), ("build", build_s)):
            if value is None:
                continue
            old = per.get(kind)
            old = [x for x in old if isinstance(x, (int, float))] if isinstance(old, list) else []
            per[kind] = (old + [round(value / compile_s, 4)])[-RECENT:]
        data[arch] = per
    path = Path(user_dir) / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _median(values, default: float) -> float:
    values = sorted(v for v in values or () if isinstance(v, (int, float)) and v >= 0)
    if not values:
        return default
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def ratios(user_dir: Path, arch: str) -> tuple[float, float]:
    """``(store, rebuild)``: the median ratios of a store's CPU time, and of its rebuild's, to
    the compile, on device ``arch`` (the defaults where none were recorded)."""
    per = _read(user_dir).get(arch)
    per = per if isinstance(per, dict) else {}
    return _median(per.get("store"), DEFAULT_STORE), _median(per.get("build"), DEFAULT_BUILD)

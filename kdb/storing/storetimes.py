"""What stores cost, per device and per program name: recorded by whoever stores a job, read
by a process that weighs waiting for a queued store against compiling
(:mod:`kdb.storing.queued`).

A job holds its program's compile seconds; what storing it costs (building it again, then
reading its binaries back, which on PoCL generates code for every kernel) is recorded here
after each store, as ratios to the compile: the store's CPU seconds, and its rebuild's alone
(what a build costs where PoCL's cache already holds the program). The newest
:data:`RECENT` of each per device, and the newest few per program name (pyopencl's
generated programs share names across types: a reduction's ``reduce_kernel_stage1`` costs
7 times its compile to store, an elementwise program about once, a scan over 100 times), in
``<user dir>/store-times.json``. Read as medians, so that a few programs whose binaries take
a minute to read do not make every store look slow. A lost update (two stores writing at
once) loses one sample.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

FILE = "store-times.json"
#: Samples kept per device and kind; per program name; names kept per device.
RECENT = 64
PER_NAME = 4
NAMES = 512
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


def _numbers(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float))] if isinstance(values, list) else []


def record(user_dir: Path, samples: list[tuple[str, str, float, float, float | None]]) -> None:
    """Add ``(arch, name, compile seconds, store CPU seconds, rebuild CPU seconds or None)``
    samples (a store that was stopped: its CPU seconds so far, a lower bound)."""
    samples = [s for s in samples if s[2] >= MIN_COMPILE_S]
    if not samples:
        return
    data = _read(user_dir)
    for arch, name, compile_s, store_s, build_s in samples:
        per = data.get(arch) if isinstance(data.get(arch), dict) else {}
        for kind, value in (("store", store_s), ("build", build_s)):
            if value is not None:
                per[kind] = (_numbers(per.get(kind)) + [round(value / compile_s, 4)])[-RECENT:]
        names = per.get("names") if isinstance(per.get("names"), dict) else {}
        if name:
            old = _numbers(names.pop(name, None))  # re-inserted: the newest names are kept
            names[name] = (old + [round(store_s / compile_s, 4)])[-PER_NAME:]
        per["names"] = dict(list(names.items())[-NAMES:])
        data[arch] = per
    _write(Path(user_dir) / FILE, data)


def _write(path: Path, data: dict) -> None:
    """Atomically, as a job file is written; a failed write (a full disk) loses only times."""
    from .spool import write_json

    try:
        write_json(path, data)
    except OSError:
        pass


def _median(values, default: float) -> float:
    values = sorted(v for v in _numbers(values) if v >= 0)
    if not values:
        return default
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


class Ratios:
    """The recorded ratios of one device: :meth:`store` for a program name (the name's own
    median where it was stored before, else the device's), ``build`` (a rebuild's)."""

    def __init__(self, per: dict) -> None:
        self._per = per
        self._names = per.get("names") if isinstance(per.get("names"), dict) else {}
        self.device = _median(per.get("store"), DEFAULT_STORE)
        self.build = _median(per.get("build"), DEFAULT_BUILD)

    def store(self, name: str = "") -> float:
        return _median(self._names.get(name), self.device) if name else self.device


def ratios(user_dir: Path, arch: str) -> Ratios:
    """What stores and rebuilds have cost on device ``arch`` (the defaults where nothing was
    recorded)."""
    per = _read(user_dir).get(arch)
    return Ratios(per if isinstance(per, dict) else {})

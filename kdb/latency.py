"""The start-up latency log: what this process compiled, how long it took, and why.

Every compile is kept in memory here (and written to the user file's ``compile_log`` by the
background writer). At exit, a process that compiled logs one summary warning: how many
kernels, how many seconds, and the missing system databases if that is why.
"""

from __future__ import annotations

import os
import threading
import time

from . import lifecycle, logs
from .file.kernelfile import CompileRecord

log = logs.get("kdb")

_records: list[CompileRecord] = []
_missing_system: dict[str, str] = {}  # arch -> file name looked for
_lock = threading.Lock()


def record(key: str, name: str, arch: str, backend: str, seconds: float, missed: str,
           reason: str) -> CompileRecord:
    """Remember one compile of this process and return its log row."""
    rec = CompileRecord(key=key, name=name, arch=arch, backend=backend, seconds=seconds,
                        missed=missed, reason=reason, at=time.time(), pid=os.getpid())
    with _lock:
        _records.append(rec)
    return rec


def note_missing_system(arch: str) -> None:
    with _lock:
        _missing_system[arch] = f"{arch}.kdb"


def records() -> list[CompileRecord]:
    """This process's compiles so far."""
    with _lock:
        return list(_records)


def summary() -> str | None:
    """The one-line summary of this start-up's compiles, or ``None`` if it compiled nothing."""
    recs = records()
    if not recs:
        return None
    total = sum(r.seconds for r in recs)
    arches = sorted({r.arch for r in recs})
    text = (f"kdb: this start-up compiled {len(recs)} kernel(s) in {total:.2f} s "
            f"(arch {', '.join(arches)})")
    missing = sorted(a for a in arches if a in _missing_system)
    if missing:
        text += ("; no system kernel database for " + ", ".join(missing)
                 + ": install its package or build one with `kdb pack`")
    text += ". Later starts load them from the cache; `kdb log` shows the details."
    return text


def _at_exit() -> None:
    text = summary()
    if text:
        log.warning("%s", text)


def reset() -> None:
    with _lock:
        _records.clear()
        _missing_system.clear()


def _after_fork() -> None:
    reset()


lifecycle.on_fork(_after_fork)
lifecycle.on_exit(lifecycle.SUMMARY, _at_exit)

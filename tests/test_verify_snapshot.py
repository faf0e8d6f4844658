"""``kdb verify`` reads one snapshot of a user file while other processes store into it."""

from __future__ import annotations

import multiprocessing
import os
import time

from kdb import HashAttributes, KernelDB
from kdb.admin import integrity


def _store_forever(cache: str, stop) -> None:
    """Store an entry every few milliseconds until ``stop``: many commits during each verify,
    and not so many entries that each verify reads thousands (unpaced, the writers made the
    test cost 12-24 CPU-s)."""
    db = KernelDB(cache)
    i = 0
    while not stop.wait(0.005):
        i += 1
        attrs = HashAttributes("opencl", f"kernel void k{os.getpid()}_{i}() {{}}", "arch0")
        db.put(attrs, os.urandom(64) * (1 + i % 7))
        db.flush()
    db.close()


def test_verify_reads_one_snapshot_while_others_store(tmp_path):
    cache = tmp_path / "cache"
    db = KernelDB(cache)
    db.put(HashAttributes("opencl", "kernel void first() {}", "arch0"), b"x" * 100)
    db.flush()
    db.close()
    path = cache / "v1" / "arch0.kdb"
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    writers = [ctx.Process(target=_store_forever, args=(str(cache), stop)) for _ in range(2)]
    for w in writers:
        w.start()
    try:
        deadline = time.monotonic() + 120
        while integrity.verify_file(path, "user", "arch0")["entries"] < 20:
            assert time.monotonic() < deadline, "the writers stored nothing"
            time.sleep(0.05)
        results = [integrity.verify_file(path, "user", "arch0") for _ in range(30)]
    finally:
        stop.set()
        for w in writers:
            w.join(60)
    assert [r["problems"] for r in results if r["problems"]] == []
    assert results[-1]["entries"] > results[0]["entries"]  # they did store meanwhile

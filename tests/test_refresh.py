"""Stored PoCL binaries carry the work-group code their programs generated after the store
(issue 28, item 3; kdb.backends.opencl.refresh). Real PoCL, real processes, the real store
worker: a launch with a new local size after the store is refreshed into the stored binary,
which a fresh process with an empty PoCL cache then launches without generating code."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdb.storing import spool

from conftest import sql

pytest.importorskip("pyopencl")

SOURCE = """__kernel void add(__global float *a, float b) { a[get_global_id(0)] += b; }
__kernel void mul(__global float *a, float b) { a[get_global_id(0)] *= b; }"""
OTHER = "__kernel void neg(__global float *a) { a[get_global_id(0)] = -a[get_global_id(0)]; }"

#: A client: builds the program(s) through kdb, then for each argument launches with that
#: local size ("NAME:SIZE" for a kernel of OTHER), or waits for the store worker ("stored").
#: Prints the compiles and, per launch, the work-group functions PoCL wrote for it.
CLIENT = r"""
import json, os, sys, time
from pathlib import Path
import numpy as np
import pyopencl as cl
import kdb.opencl, kdb.bookkeeping
from kdb.storing import spool
SOURCE, OTHER = json.loads(sys.argv[1])
plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1])
q = cl.CommandQueue(ctx)
progs = {"": kdb.opencl.build(ctx, SOURCE)}
if OTHER:
    progs["neg"] = kdb.opencl.build(ctx, OTHER)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4 * 1024)
pocl = Path(os.environ["POCL_CACHE_DIR"])
count = lambda: sum(1 for _ in pocl.rglob("*.so"))
generated = []
for arg in sys.argv[2:]:
    if arg == "stored":
        user = Path(os.environ["KDB_CACHE_DIR"]) / "v1"
        deadline = time.time() + 120
        while spool.jobs(user) and time.time() < deadline:
            time.sleep(0.05)
        continue
    if arg.startswith("forget:"):  # PoCL's cache loses a function (a cleaner, a wipe)
        for d in pocl.rglob("add/%s-1-1-*" % arg[7:]):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()
        continue
    name, _, size = arg.rpartition(":")
    before = count()
    if name:
        cl.Kernel(progs["neg"], name)(q, (1024,), (int(size),), buf)
    else:
        cl.Kernel(progs[""], "add")(q, (1024,), (int(size),), buf, np.float32(1))
    q.finish()
    generated.append(count() - before)
print(json.dumps({"compiles": len(kdb.bookkeeping.records()), "generated": generated}))
"""


def _client(tmp_path: Path, pocl: str, *args: str, other: bool = False,
            **env: str) -> dict:
    full = {**os.environ, "KDB_CACHE_DIR": str(tmp_path / "cache"),
            "POCL_CACHE_DIR": str(tmp_path / pocl), **env}
    full.pop("KDB_STORE_AT_EXIT")  # the default: the store worker stores, after launches
    proc = subprocess.run([sys.executable, "-c", CLIENT,
                           json.dumps([SOURCE, OTHER if other else ""]), *args],
                          env=full, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _settle(tmp_path: Path, timeout: float = 180) -> None:
    """Until the store worker has stored and refreshed everything and exited."""
    user = tmp_path / "cache" / "v1"
    deadline = time.monotonic() + timeout
    while spool.jobs(user) or any(spool.worker_running(d) for d in (user / "spool").iterdir()):
        assert time.monotonic() < deadline, "the store worker never finished"
        time.sleep(0.05)


def _entries(path: Path) -> dict[str, tuple[bytes, dict]]:
    """name -> (binary, details) of every entry of a kdb file."""
    import zstandard

    out = {}
    for name, kind, blob, details in sql(path, "SELECT name, codec, blob, details FROM kernels"):
        raw = zstandard.ZstdDecompressor().decompress(blob) if kind == "zstd" else blob
        out[name] = (raw, json.loads(details))
    return out


def _files(binary: bytes) -> set[str]:
    """The files a PoCL 3.0 binary (layout 8) carries, read as ``pocl_binary.c`` reads them."""
    assert binary[:8] == b"poclbin\0" and struct.unpack_from("<I", binary, 16)[0] == 8

    def file_at(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<I", binary, at)
        (size,) = struct.unpack_from("<I", binary, at + 4 + n)
        return binary[at + 4:at + 4 + n].decode(), at + 8 + n + size

    (count,) = struct.unpack_from("<I", binary, 20)
    _, pos = file_at(73)
    files = set()
    for _ in range(count):
        size, files_size = struct.unpack_from("<QQ", binary, pos)
        at, end = pos + size - files_size, pos + size
        while at < end:
            path, at = file_at(at)
            files.add(path)
        pos = end
    assert pos == len(binary)
    return files


def _user_file(tmp_path: Path) -> Path:
    (path,) = (tmp_path / "cache" / "v1").glob("pocl-*.kdb")
    return path


def _variant(size: int) -> str:
    return f"/add/{size}-1-1-goffs0-smallgrid/add.so"


@pytest.fixture(scope="module", autouse=True)
def _layout_8(cl_ctx):
    """The refresh reads PoCL 3.0's binary layout (8) only: skip on a PoCL that writes
    another (Debian's PoCL 3.1, where pip's does not know this CPU: tools/default_opencl.py)."""
    import pyopencl as cl

    prg = cl.Program(cl_ctx, "__kernel void k(__global int *a) { *a = 1; }").build()
    binary = prg.get_info(cl.program_info.BINARIES)[0]
    if binary[:8] != b"poclbin\0" or struct.unpack_from("<I", binary, 16)[0] != 8:
        version = struct.unpack_from("<I", binary, 16)[0] if len(binary) >= 20 else None
        pytest.skip(f"this device's PoCL writes binary layout {version}, and the refresh "
                    "reads layout 8 (PoCL 3.0) only; it stores and serves, not refreshes")


@pytest.fixture(scope="module")
def refreshed(tmp_path_factory):
    """A program compiled, launched with local size 16, stored by the worker, then launched
    with 32 (after the store) before its process exits; the worker has settled since."""
    tmp = tmp_path_factory.mktemp("refreshed")
    first = _client(tmp, "pocl", "16", "stored", "32", KDB_DISABLE_REFRESH="0")
    assert first["compiles"] == 1
    _settle(tmp)
    return tmp


def test_a_launch_after_the_store_is_refreshed_into_the_stored_binary(refreshed):
    """The stored binary carries the function of the launch made after the store (and still
    those it carried), and says it was refreshed once; header and program are unchanged."""
    binary, details = _entries(_user_file(refreshed))["add,mul"]
    assert {_variant(16), _variant(32), "/add/0-0-0/add.so"} <= _files(binary)
    assert details.get("refreshes") == 1
    log = (refreshed / "cache" / "v1" / spool.LOG_NAME).read_text()
    assert "refreshed add,mul" in log and "refresh 1 of 3" in log


def test_a_fresh_process_with_an_empty_pocl_cache_generates_no_work_group_code(refreshed):
    """Loaded in a fresh process from the refreshed binary, with PoCL's cache empty, the
    program's launches with both local sizes find their functions: PoCL writes none."""
    got = _client(refreshed, "pocl-fresh-machine", "16", "32")
    assert got == {"compiles": 0, "generated": [0, 0]}


def test_pack_from_db_ships_the_refreshed_binary(refreshed):
    """``kdb pack --from-db`` copies the refreshed binary into the system file."""
    out = refreshed / "pack"
    proc = subprocess.run([sys.executable, "-m", "kdb.cli", "pack", "--arch", "native",
                           "--from-db", str(refreshed / "cache"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KDB_CACHE_DIR": str(refreshed / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (packed,) = out.glob("*.kdb")
    binary, _ = _entries(packed)["add,mul"]
    assert binary == _entries(_user_file(refreshed))["add,mul"][0]
    assert _variant(32) in _files(binary)


def test_a_warm_run_that_generates_nothing_queues_no_refresh(refreshed):
    """A process served from the user tier whose launches find their functions in PoCL's
    cache sends the worker nothing (its exit: a scandir and a stat per kernel)."""
    time.sleep(2.5)  # past the margin kept around a program's load time
    got = _client(refreshed, "pocl", "16", "32")
    assert got == {"compiles": 0, "generated": [0, 0]}
    assert not spool.jobs(refreshed / "cache" / "v1")  # the worker waits a second for a job


def test_refreshed_binaries_never_shrink_and_refresh_at_most_three_times(tmp_path):
    """A refresh keeps every file the binary held, even one gone from PoCL's cache since,
    and adds what is new; each later process that launches a new local size refreshes
    again, three times in all: the fourth new size is left to PoCL, as without kdb."""
    first = _client(tmp_path, "pocl", "16", "stored", "forget:16", "32")
    assert first == {"compiles": 1, "generated": [1, 1]}
    _settle(tmp_path)
    stored, details = _entries(_user_file(tmp_path))["add,mul"]
    assert {_variant(16), _variant(32)} <= _files(stored) and details["refreshes"] == 1
    for n, size in enumerate([64, 128, 256], 2):
        got = _client(tmp_path, "pocl", str(size))
        assert got == {"compiles": 0, "generated": [1]}
        _settle(tmp_path)
        binary, details = _entries(_user_file(tmp_path))["add,mul"]
        assert _files(stored) <= _files(binary) and len(binary) >= len(stored)
        assert details["refreshes"] == min(n, 3)
        assert (_variant(size) in _files(binary)) is (n <= 3)
        stored = binary


def test_a_refresh_takes_only_its_own_programs_code(tmp_path):
    """Two programs, one launched with a new local size after both were stored: only its
    entry is refreshed, with only its own kernel's functions; the other's binary (another
    key, another build hash) keeps what its store read."""
    first = _client(tmp_path, "pocl", "16", "neg:16", "stored", "neg:32", other=True)
    assert first["compiles"] == 2
    _settle(tmp_path)
    entries = _entries(_user_file(tmp_path))
    binary, details = entries["add,mul"]
    assert _files(binary) == {_variant(16), "/add/0-0-0/add.so", "/mul/0-0-0/mul.so"}
    assert "refreshes" not in details
    binary, details = entries["neg"]
    assert _files(binary) == {"/neg/16-1-1-goffs0-smallgrid/neg.so", "/neg/0-0-0/neg.so",
                              "/neg/32-1-1-goffs0-smallgrid/neg.so"}
    assert details["refreshes"] == 1


def test_a_refresh_replaces_only_the_binary_it_read(tmp_path):
    """The refreshed binary is the stored one with files added (its header, device and
    build hash, unchanged), and it replaces the entry only while that entry is still the
    binary that was read: one whose checksum changed since is left as it is."""
    import kdb
    from kdb.backends.opencl import refresh
    from kdb.file.filewriter import replace_binary

    first = _client(tmp_path, "pocl", "16", "stored", "32", KDB_DISABLE_REFRESH="1")
    assert first["compiles"] == 1
    _settle(tmp_path)
    path = _user_file(tmp_path)
    old, _ = _entries(path)["add,mul"]
    assert _variant(32) not in _files(old)  # refresh off: as the store read it
    ((key,),) = sql(path, "SELECT key FROM kernels")
    f = kdb.KernelDB(cache_dir=tmp_path / "cache").tiers.user_file(path.stem)
    assert replace_binary(f, key, "another-checksum", old + b"x", {}) is False
    assert _entries(path)["add,mul"][0] == old
    assert "refresh 1 of 3" in refresh.refresh_entry(f, tmp_path / "pocl", key)
    new, details = _entries(path)["add,mul"]
    assert new[:73] == old[:73] and _files(old) | {_variant(32)} == _files(new)
    assert refresh.refresh_entry(f, tmp_path / "pocl", key) is None  # nothing new since

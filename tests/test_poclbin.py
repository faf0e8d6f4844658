"""PoCL with its kernel cache off (``POCL_KERNEL_CACHE=0``): processes that load the same
stored binaries at once must not share, and delete, one directory (kdb.backends.opencl.poclbin)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time

import pytest

from kdb.backends.opencl import poclbin

from conftest import attributes_of

pytest.importorskip("pyopencl")

#: Each process builds these (all hits once primed), launches each once and exits holding
#: them: PoCL releases them, and with its cache off deletes their directories, at exit.
PROGRAM = r"""
import json, sys
import numpy as np
import pyopencl as cl
import kdb.opencl, kdb.bookkeeping
plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1])
queue = cl.CommandQueue(ctx)
a = np.arange(64, dtype=np.float32)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
held, ok = [], []
for i in range(int(sys.argv[1])):
    prg = kdb.opencl.build(ctx, "__kernel void u%d(__global float *a) "
                                "{ int g = get_global_id(0); a[g] = a[g] + %d.0f; }" % (i, i))
    getattr(prg, "u%d" % i)(queue, (64,), None, buf)
    held.append(prg)
out = np.empty_like(a)
cl.enqueue_copy(queue, out, buf)
ok = bool((out == a + sum(range(int(sys.argv[1])))).all())
print(json.dumps({"ok": ok, "compiles": len(kdb.bookkeeping.records())}))
"""

PROCESSES, KERNELS, ROUNDS = 8, 10, 2


def _env(tmp_path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "KDB_CACHE_DIR": str(tmp_path / "cache"), "POCL_KERNEL_CACHE": "0",
           "POCL_CACHE_DIR": str(tmp_path / "pocl-uncached"), **extra}
    env.pop("KDB_TRACE", None)
    return env


def _run_together(env: dict[str, str], n: int, kernels: int) -> list[tuple[int, dict, str]]:
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM, str(kernels)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a process loading binaries hung")
        lines = out.strip().splitlines()
        done.append((p.returncode, json.loads(lines[-1]) if lines else {}, err))
    return done


def test_processes_loading_the_same_binaries_with_pocl_kernel_cache_off_all_finish(tmp_path):
    """8 processes served the same 10 programs at once, PoCL's cache off and its directory
    shared (as ``~/.cache/pocl/uncached`` is): each exits 0 with the right results and
    compiles nothing. PoCL 3.0 aborted 1-6 of 8 (``Can't get stat()``) or failed to link a
    kernel when each load of one binary used one directory that every release deleted."""
    env = _env(tmp_path, KDB_STORE_AT_EXIT="wait")
    [(rc, first, err)] = _run_together(env, 1, KERNELS)  # stores all of them before it exits
    assert rc == 0 and first["ok"] and first["compiles"] == KERNELS, err[-3000:]
    for r in range(ROUNDS):
        for rc, got, err in _run_together(env, PROCESSES, KERNELS):
            assert rc == 0, (f"round {r + 1}: exit status {rc}", err[-2000:])
            assert got == {"ok": True, "compiles": 0}, (got, err[-2000:])
    leftovers = [p.name for p in (tmp_path / "pocl-uncached").iterdir()
                 if p.name.startswith("_UNCACHED_kdb")]
    assert not leftovers, leftovers  # every load's directory went with its program


def _pocl_binary(version: int) -> bytes:
    """A PoCL binary header as PoCL writes it (``lib/CL/pocl_binary.c``), then a body."""
    head = b"poclbin\0" + struct.pack("<QIIQ", 0x1234, version, 1, 0)
    if version >= 9:
        head += struct.pack("<I", 1)  # root entries
    return head + b"JJ/DPMDJEKNCCHEBNNJFHDHFNBEILJJPEFIGKHJJ\0" + b"\x0b\0\0\0/program.bc"


@pytest.mark.parametrize("version", [8, 9, 12])
def test_with_pocl_kernel_cache_off_each_load_names_a_directory_of_its_own(monkeypatch, version):
    monkeypatch.setenv("POCL_KERNEL_CACHE", "0")
    binary, other = _pocl_binary(version), b"\x7fELF not PoCL's format"
    first = poclbin.private_copies([binary, other])
    second = poclbin.private_copies([binary])
    offset = 32 if version == 8 else 36
    names = {b[offset:offset + 41] for b in (first[0], second[0])}
    assert len(names) == 2 and all(n.startswith(b"_UNCACHED_kdb") and n.endswith(b"\0")
                                   for n in names), names
    assert first[1] is other  # not PoCL's: as it is
    for copy in (first[0], second[0]):  # only the name differs
        assert copy[:offset] == binary[:offset]
        assert copy[offset + 41:] == binary[offset + 41:]


@pytest.mark.parametrize("value, off", [(None, False), ("1", False), ("1yes", False),
                                        ("0", True), ("", True), ("true", True)])
def test_kernel_cache_is_off_as_pocl_reads_the_variable(monkeypatch, value, off):
    """``pocl_get_bool_option``: set and not starting with "1" is off ("true" too)."""
    if value is None:
        monkeypatch.delenv("POCL_KERNEL_CACHE", raising=False)
    else:
        monkeypatch.setenv("POCL_KERNEL_CACHE", value)
    binary = _pocl_binary(8)
    assert poclbin.kernel_cache_off() is off
    assert (poclbin.private_copies([binary])[0] is binary) is not off


def test_a_binary_of_an_unknown_layout_is_not_loaded_with_the_cache_off(monkeypatch):
    monkeypatch.setenv("POCL_KERNEL_CACHE", "0")
    assert poclbin.private_copies([_pocl_binary(99)]) is None
    monkeypatch.setenv("POCL_KERNEL_CACHE", "1")
    assert poclbin.private_copies([_pocl_binary(99)]) is not None  # nothing deletes it


def test_unknown_layout_builds_from_source_with_one_warning(tmp_path):
    """A stored PoCL binary whose header this kdb does not know, PoCL's cache off: the
    program is built from source (right results), one warning says why, nothing breaks."""
    import kdb

    env = _env(tmp_path, KDB_STORE_AT_EXIT="wait")
    [(rc, first, err)] = _run_together(env, 1, 2)
    assert rc == 0 and first["compiles"] == 2, err[-3000:]
    [user_file] = (tmp_path / "cache" / "v1").glob("*.kdb")
    attributes = [text for _, _, text in attributes_of(user_file)]
    db = kdb.KernelDB(cache_dir=tmp_path / "cache", use_system=False)
    for text in attributes:
        attrs = kdb.HashAttributes.from_canonical(text)
        binary = db.get(attrs)
        assert binary.startswith(poclbin.MAGIC)
        assert db.put(attrs, binary[:16] + struct.pack("<I", 99) + binary[20:])
    db.close()
    time.sleep(0.01)
    [(rc, got, err)] = _run_together(env, 1, 2)
    assert rc == 0 and got["ok"], err[-3000:]
    warned = [ln for ln in err.splitlines() if "does not know this PoCL's binary format" in ln]
    assert len(warned) == 1, err[-3000:]


# Builds one kernel through install(); "rm" empties PoCL's cache after the build (a cleaner,
# a CI step), before kdb reads the program's binaries at exit. Prints the result.
TORN = r"""
import os, shutil, sys
import numpy as np, pyopencl as cl, kdb.opencl
kdb.opencl.install()
ctx = cl.Context(cl.get_platforms()[0].get_devices()[:1])
queue = cl.CommandQueue(ctx)
prg = cl.Program(ctx, "__kernel void h(__global int *o) { o[get_global_id(0)] = 42; }").build()
if sys.argv[1:] == ["rm"]:
    shutil.rmtree(os.environ["POCL_CACHE_DIR"])
out = np.zeros(4, np.int32)
buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, out.nbytes)
prg.h(queue, (4,), None, buf)
cl.enqueue_copy(queue, out, buf)
print(out.tolist())
"""


def _torn_child(tmp_path, cache, *args: str, env: dict | None = None
                ) -> subprocess.CompletedProcess:
    pocl = tmp_path / "pocl"
    import shutil
    shutil.rmtree(pocl, ignore_errors=True)  # every process meets an empty PoCL cache
    env = {**os.environ, "KDB_CACHE_DIR": str(cache), "POCL_CACHE_DIR": str(pocl),
           "KDB_STORE_AT_EXIT": "wait", **(env or {})}
    return subprocess.run([sys.executable, "-c", TORN, *args], env=env, capture_output=True,
                          text=True, timeout=300)


def _user_binaries(cache) -> list[bytes]:
    """Every binary of the user tier's files, through kdb (decompressed, checked)."""
    from kdb import HashAttributes, KernelDB

    db = KernelDB(cache_dir=cache, system_path=[])
    try:
        return [db.get(HashAttributes.from_canonical(text))
                for f in (cache / "v1").glob("*.kdb") for _, _, text in attributes_of(f)]
    finally:
        db.close()


def _debian_pocl_first(tmp_path) -> dict:
    """The environment that lists Debian's PoCL before pip's (skips where it is absent)."""
    from test_opencl_impls import _debian_pocl, _vendors

    return _vendors(tmp_path, _debian_pocl())


@pytest.mark.parametrize("pocl", ["pip's PoCL 3.0", "Debian's PoCL 3.1"])
def test_a_binary_pocl_serialised_after_its_cache_files_went_is_never_stored(tmp_path, pocl):
    """PoCL serialises a program from the files in its cache directory; emptied between the
    build and kdb's read, PoCL 3.0 hands back a binary with an empty ``/program.bc`` and
    PoCL 3.1 one with none, which kdb stored and served: every later process PoCL's cache
    did not hold the program for crashed at the first launch (SIGSEGV; 3.1: an assertion)."""
    env = _debian_pocl_first(tmp_path) if "Debian" in pocl else {}
    cache = tmp_path / "kdb"
    first = _torn_child(tmp_path, cache, "rm", env=env)
    assert first.returncode == 0 and "[42, 42, 42, 42]" in first.stdout, first.stderr
    assert not any(poclbin.torn(b) for b in _user_binaries(cache))
    for _ in range(2):  # compiled again, stored whole, then served
        again = _torn_child(tmp_path, cache, env=env)
        assert again.returncode == 0 and "[42, 42, 42, 42]" in again.stdout, again.stderr
    assert _user_binaries(cache) and not any(poclbin.torn(b) for b in _user_binaries(cache))


def test_a_torn_pocl_binary_stored_by_an_older_kdb_is_dropped_and_rebuilt(tmp_path):
    """An entry an older kdb stored torn is not loaded: dropped, compiled again, replaced."""
    from kdb import HashAttributes, KernelDB

    cache = tmp_path / "kdb"
    assert _torn_child(tmp_path, cache).returncode == 0
    (f,) = (cache / "v1").glob("*.kdb")
    (text,) = [t for _, _, t in attributes_of(f)]
    attrs = HashAttributes.from_canonical(text)
    db = KernelDB(cache_dir=cache, system_path=[])
    whole = db.get(attrs)
    assert poclbin.layout(whole) is not None
    at = poclbin._HEADER_8
    (name_len,) = struct.unpack_from("<I", whole, at)  # /program.bc, emptied as PoCL does
    (size,) = struct.unpack_from("<I", whole, at + 4 + name_len)
    broken = (whole[:at + 4 + name_len] + struct.pack("<I", 0)
              + whole[at + 8 + name_len + size:])
    assert poclbin.torn(broken)
    db.put(attrs, broken)
    db.close()
    assert _user_binaries(cache) == [broken]
    for _ in range(2):
        run = _torn_child(tmp_path, cache)
        assert run.returncode == 0 and "[42, 42, 42, 42]" in run.stdout, run.stderr
    assert not any(poclbin.torn(b) for b in _user_binaries(cache))

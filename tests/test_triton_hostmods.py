"""Triton's host modules from kdb, for real: Triton's own ``compile_module_from_src`` builds a
small C extension with this machine's C compiler through its cache manager, as it builds
``cuda_utils`` and the launchers on a GPU node, and each test counts the compiler runs Triton
makes. Triton's driver utilities need the GPU's driver library to build: the GPU check
(``benchmarks/gpu/check.py``, part ``timing``) counts those."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install 'kdb[triton]')")
build = pytest.importorskip("triton.runtime.build")
if not hasattr(build, "compile_module_from_src"):  # 3.2 and 3.3: inside each driver
    pytest.skip(f"Triton {triton.__version__} builds its host modules only inside its GPU "
                "drivers", allow_module_level=True)

#: Builds the module ``kdbhello`` through Triton, with kdb as Triton's cache; prints what the
#: module answers, how many times Triton ran the C compiler, and where the module was loaded.
APP = r'''
import json, os, subprocess, sys

runs = []
check_call = subprocess.check_call


def counting(cmd, *args, **kwargs):  # Triton's _build runs the compiler through this
    if sys._getframe(1).f_globals.get("__name__") == "triton.runtime.build":
        runs.append(cmd[0])
    return check_call(cmd, *args, **kwargs)


subprocess.check_call = counting
import triton
from triton.runtime.build import compile_module_from_src

if not os.environ.get("PLAIN"):
    import kdb.triton
    kdb.triton.install()

SRC = """
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kdbhello", NULL, -1, methods};
PyMODINIT_FUNC PyInit_kdbhello(void) { return PyModule_Create(&module); }
""".replace("ANSWER", os.environ.get("ANSWER", "42"))


def built():
    return compile_module_from_src(SRC, "kdbhello")


if os.environ.get("TARGET") and not os.environ.get("PLAIN"):
    from triton.backends.compiler import GPUTarget
    with kdb.triton.target(GPUTarget("cuda", int(os.environ["TARGET"]), 32)):
        mod = built()
else:
    mod = built()
if os.environ.get("THEN_KERNEL"):  # a kernel compiled after: the device's arch is known
    sys.path.insert(0, os.environ["KERNELS_DIR"])
    import kernels
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kdb.triton.compile(ASTSource(fn=kernels.add, signature={"x_ptr": "*fp32", "n": "i32",
                                                           "BLOCK": "constexpr"},
                                 constexprs={"BLOCK": 64}), GPUTarget("cuda", 90, 32))
print(json.dumps({"answer": mod.answer(), "compiler_runs": len(runs), "file": mod.__file__}))
'''

KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def add(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)
'''


@pytest.fixture
def host_env(tmp_path, cache_dir):
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "kernels.py").write_text(KERNELS)
    env = dict(os.environ, KERNELS_DIR=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path / "tc"),
               KDB_STORE_AT_EXIT="wait", TARGET="90")
    env.pop("TRITON_CACHE_MANAGER", None)
    return env


def run(tmp_path, env, *args, **more):
    proc = subprocess.run([sys.executable, str(tmp_path / "app.py"), *args],
                          env={**env, **more}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


def stored(cache_dir: Path, arch: str = "sm_90") -> list[tuple]:
    path = cache_dir / "v1" / f"{arch}.kdb"
    if not path.exists():
        return []
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT backend, name FROM kernels ORDER BY name").fetchall()


def triton_files(tmp_path: Path) -> list[Path]:
    tc = tmp_path / "tc"
    return [p for p in tc.rglob("*") if p.is_file()] if tc.exists() else []


def test_a_host_module_built_once_is_loaded_from_kdb_by_the_next_process(tmp_path, host_env,
                                                                         cache_dir):
    first, _ = run(tmp_path, host_env)
    assert first == {**first, "answer": 42, "compiler_runs": 1}
    assert stored(cache_dir) == [("triton", "kdbhello")]
    second, _ = run(tmp_path, host_env, TRITON_CACHE_DIR=str(tmp_path / "tc-empty"))
    assert second["answer"] == 42 and second["compiler_runs"] == 0
    # Loaded from the process's private directory, under the file name Triton asked for.
    assert Path(second["file"]).name == Path(first["file"]).name
    assert "kdb-triton-" in second["file"]
    assert triton_files(tmp_path) == []  # nothing in Triton's own cache


def test_another_source_is_another_module(tmp_path, host_env, cache_dir):
    run(tmp_path, host_env)
    other, _ = run(tmp_path, host_env, ANSWER="7")
    assert other["answer"] == 7 and other["compiler_runs"] == 1
    assert stored(cache_dir) == [("triton", "kdbhello"), ("triton", "kdbhello")]


def test_a_module_built_before_the_arch_is_known_is_stored_with_the_first_kernel(
        tmp_path, host_env, cache_dir):
    """Triton builds cuda_utils while it makes its driver, where kdb cannot ask the device's
    arch: the module is stored once a kernel names it, and found in every arch kdb has a file
    for by a process that does not know its arch yet."""
    alone, _ = run(tmp_path, host_env, TARGET="")
    assert alone["compiler_runs"] == 1 and stored(cache_dir) == []
    first, _ = run(tmp_path, host_env, TARGET="", THEN_KERNEL="1")
    assert first["compiler_runs"] == 1
    assert stored(cache_dir) == [("triton", "add"), ("triton", "kdbhello")]
    second, _ = run(tmp_path, host_env, TARGET="")
    assert second["compiler_runs"] == 0 and second["answer"] == 42


def test_a_module_built_by_another_python_is_a_miss_that_kdb_explain_names(tmp_path, host_env,
                                                                            cache_dir):
    """A C extension loads only into the Python (and platform, C library) it was built for:
    each is in the key, and ``kdb explain`` names the one that differs."""
    other = "import sys, runpy; sys.implementation.cache_tag = 'cpython-399'; " \
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", other, str(tmp_path / "app.py")],
                          env={**host_env, "PYTHONDONTWRITEBYTECODE": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert stored(cache_dir) == [("triton", "kdbhello")]
    mine, _ = run(tmp_path, host_env)
    assert mine["compiler_runs"] == 1
    kdb = Path(sys.executable).with_name("kdb")
    why = subprocess.run([kdb, "explain", "kdbhello", "--json"], env=host_env,
                         capture_output=True, text=True, timeout=120)
    assert why.returncode == 0, why.stderr
    assert "compiler" in why.stdout and "cpython-399" in why.stdout, why.stdout


def _rewrite(cache_dir: Path, raw: bytes) -> None:
    """Every entry's bytes replaced by ``raw``, in a sound zstd frame with its checksum."""
    import zstandard

    blob = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    with sqlite3.connect(cache_dir / "v1" / "sm_90.kdb") as conn:
        conn.execute("UPDATE kernels SET blob = ?, raw_size = ?, checksum = ?",
                     (blob, len(raw), hashlib.sha256(raw).hexdigest()))


def _module_bytes(cache_dir: Path) -> tuple[str, bytes]:
    from kdb.backends.triton import groups
    from kdb.file.codec import decode

    with sqlite3.connect(cache_dir / "v1" / "sm_90.kdb") as conn:
        row = conn.execute("SELECT codec, blob, raw_size, checksum FROM kernels").fetchone()
    [(name, data)] = groups.unpack(decode(*row)).items()
    return name, data


@pytest.mark.parametrize("damage", ["truncated", "not a module", "checksum"])
def test_a_damaged_module_is_dropped_and_built_again_never_loaded(tmp_path, host_env,
                                                                  cache_dir, damage):
    from kdb.backends.triton import groups

    run(tmp_path, host_env)
    name, data = _module_bytes(cache_dir)
    if damage == "truncated":  # the packed sizes agree: only the module's own bytes say so
        _rewrite(cache_dir, groups.pack({name: data[:len(data) - 100]}))
    elif damage == "not a module":
        _rewrite(cache_dir, groups.pack({name: b"#!/bin/sh\n" + data}))
    else:  # a byte of the stored frame flipped: the codec's checksum fails
        with sqlite3.connect(cache_dir / "v1" / "sm_90.kdb") as conn:
            blob = bytearray(conn.execute("SELECT blob FROM kernels").fetchone()[0])
            blob[len(blob) // 2] ^= 0xFF
            conn.execute("UPDATE kernels SET blob = ?", (bytes(blob),))
    got, err = run(tmp_path, host_env)
    assert got["answer"] == 42 and got["compiler_runs"] == 1
    assert "dropped" in err and "could not be loaded" not in err, err
    again, _ = run(tmp_path, host_env)
    assert again["compiler_runs"] == 0


@pytest.mark.slow
def test_a_pack_from_the_database_carries_the_host_modules(tmp_path, host_env, cache_dir):
    """``kdb pack --from-db`` ships the modules a run on the GPU node built, for the Python
    and platform they were built for; a node with the pack and every cache empty builds
    none."""
    run(tmp_path, host_env, THEN_KERNEL="1")
    kdb = Path(sys.executable).with_name("kdb")
    proc = subprocess.run([kdb, "pack", "--arch", "sm_90", "--from-db", "--out",
                           tmp_path / "packs"], env=host_env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = {**host_env, "KDB_CACHE_DIR": str(tmp_path / "fresh"),
             "KDB_SYSTEM_DB_PATH": str(tmp_path / "packs")}
    got, _ = run(tmp_path, fresh, TARGET="", TRITON_CACHE_DIR=str(tmp_path / "tc-fresh"))
    assert got["compiler_runs"] == 0 and got["answer"] == 42
    assert stored(tmp_path / "fresh") == []


def test_without_kdb_triton_builds_into_its_own_cache(tmp_path, host_env, cache_dir):
    """The counting in these tests is Triton's: without kdb its own cache serves the module
    the second time."""
    first, _ = run(tmp_path, host_env, PLAIN="1")
    second, _ = run(tmp_path, host_env, PLAIN="1")
    assert (first["compiler_runs"], second["compiler_runs"]) == (1, 0)
    assert stored(cache_dir) == [] and triton_files(tmp_path)


def test_only_c_extensions_are_host_modules():
    from kdb.backends.triton import hostmods

    import sysconfig

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert hostmods.module_name(f"cuda_utils{suffix}") == "cuda_utils"
    assert hostmods.module_name("__triton_launcher.so") == "__triton_launcher"
    for other in ("add.json", "add.cubin", "matmul.autotune.json", ".so", "a/b.so"):
        assert hostmods.module_name(other) is None, other


def test_a_host_module_is_written_where_it_can_be_loaded(monkeypatch, tmp_path):
    """A container's /dev/shm is mounted noexec: a module written there could not be
    loaded, so host modules go to the first runtime directory that allows it."""
    from kdb.backends.triton import groups

    noexec, other = tmp_path / "noexec", tmp_path / "exec"
    noexec.mkdir(mode=0o700)
    other.mkdir(mode=0o700)
    monkeypatch.setattr(groups, "runtime_dirs", lambda: [str(noexec), str(other)])
    monkeypatch.setattr(groups, "_noexec", lambda p: str(p).startswith(str(noexec)))
    monkeypatch.setattr(groups, "_root", [])
    monkeypatch.setattr(groups, "_exec_root", [])
    kernel = groups.write_files("K", {"k.json": b"{}"})["k.json"]
    module = groups.write_files("M", {"m.so": b"\x7fELF"}, loadable=True)["m.so"]
    assert kernel.startswith(str(noexec)) and module.startswith(str(other))

"""kdb.cuda: cubins through the real nvcc (no GPU needed), keys, errors; pycuda loading on a GPU."""

from __future__ import annotations

import doctest
import hashlib
import json
import os
import re
import shutil
import sqlite3
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import kdb
import kdb.cuda
from kdb import BackendUnavailableError, CompileError, InvalidArgumentError, UnsupportedTypeError
from kdb.backends import cuda as backend
from kdb.backends.cuda import keys as cuda_keys
from kdb.backends.cuda import nvcc as cuda_nvcc
from kdb.backends.cuda import nvrtc as cuda_nvrtc
from kdb.keys import differences

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

SCALE_SRC = "__global__ void scale(float *a) { a[threadIdx.x] *= SCALE; }\n"
DOUBLE_SRC = "__global__ void twice(float *a) { a[threadIdx.x] *= 2.0f; }\n"
HEADER_SRC = '#include "scale.cuh"\n' + SCALE_SRC

# PTX spells float constants as their IEEE bits: 3.0f, 5.0f, 7.0f.
PTX_3, PTX_5, PTX_7 = b"0f40400000", b"0f40A00000", b"0f40E00000"


@pytest.fixture
def db(cache_dir):
    d = kdb.KernelDB()
    yield d
    d.close()


def _wrapper(directory: Path, body: str) -> Path:
    """An executable ``nvcc`` shell script in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "nvcc"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def counting_nvcc(tmp_path):
    """A wrapper named nvcc that logs each invocation, then runs the real nvcc."""
    log = tmp_path / "nvcc-calls.log"
    wrapper = _wrapper(tmp_path / "bin", f'echo "$*" >> "{log}"\nexec "{NVCC}" "$@"\n')
    return wrapper, log


def _nvrtc_found() -> str | None:
    try:
        return backend.find_nvrtc().path
    except BackendUnavailableError:
        return None


NVRTC = _nvrtc_found()
needs_nvrtc = pytest.mark.skipif(
    NVRTC is None, reason="NVRTC not found (pip install nvidia-cuda-nvrtc, the test extra)")


def _hide_compilers(tmp_path: Path, monkeypatch) -> dict[str, str]:
    """No nvcc and no NVRTC reachable from here on, in this process and in children given
    the returned variables: PATH and CUDA_HOME lead nowhere, and a regular package
    ``nvidia`` first on the path hides the namespace package where NVIDIA's wheels put
    libnvrtc.so."""
    hide = tmp_path / "hide"
    (hide / "nvidia").mkdir(parents=True, exist_ok=True)
    (hide / "nvidia" / "__init__.py").write_text("")
    (tmp_path / "no-cuda").mkdir(exist_ok=True)
    env = {"PATH": str(tmp_path / "no-bin"), "CUDA_HOME": str(tmp_path / "no-cuda"),
           "PYTHONPATH": str(hide)}
    for var in ("KDB_NVCC", "KDB_NVRTC"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.syspath_prepend(str(hide))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    return env


@pytest.fixture
def no_compiler(tmp_path, monkeypatch) -> dict[str, str]:
    """No compiler reachable (:func:`_hide_compilers`) for the whole test."""
    return _hide_compilers(tmp_path, monkeypatch)


def _calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _elf_sm(cubin: bytes) -> int:
    """The SM version in a cubin's ELF header, read independently of kdb's helper."""
    assert cubin[:4] == b"\x7fELF"
    assert struct.unpack_from("<H", cubin, 18)[0] == 190  # EM_CUDA
    flags = struct.unpack_from("<I", cubin, 48)[0]
    return (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF


# -- compile ------------------------------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_cubin_is_built_for_the_requested_arch(db, arch, tmp_path):
    cubin = kdb.cuda.compile(DOUBLE_SRC, arch=arch, db=db)
    assert _elf_sm(cubin) == int(arch[3:])
    assert kdb.cuda.cubin_arch(cubin) == arch
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:  # the toolkit's own reading, where the toolkit ships it
        path = tmp_path / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True)
        assert re.search(rf"\b{arch}\b", out.stdout + out.stderr)
    db.flush()
    hit = db.lookup(kdb.cuda.attributes_for(DOUBLE_SRC, arch=arch, memo_dir=db.cache_root))
    assert hit is not None and hit.tier == "user" and hit.binary == cubin
    assert (db.user_dir / f"{arch}.kdb").is_file()


@needs_nvcc
def test_ptx_and_fatbin_outputs(db):
    ptx = kdb.cuda.compile(DOUBLE_SRC, arch="sm_90", output="ptx", db=db)
    assert b".target sm_90" in ptx and b".entry _Z5twicePf" in ptx  # C++ mangled name
    fatbin = kdb.cuda.compile(DOUBLE_SRC, arch="sm_90", output="fatbin", db=db)
    assert fatbin[:4] == bytes.fromhex("50ed55ba")  # fatbin magic 0xba55ed50
    keys = {kdb.cuda.attributes_for(DOUBLE_SRC, "sm_90", output=o).key
            for o in ("cubin", "ptx", "fatbin")}
    assert len(keys) == 3


@needs_nvcc
def test_fresh_process_is_served_without_running_nvcc(cache_dir, counting_nvcc, run_py):
    wrapper, log = counting_nvcc
    env = {"PATH": f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}"}
    code = f"""
        import hashlib, kdb.cuda
        cubin = kdb.cuda.compile({DOUBLE_SRC!r}, arch="sm_90")
        print(kdb.cuda.find_nvcc().path)
        print(kdb.cuda.attributes_for({DOUBLE_SRC!r}, arch="sm_90").key)
        print(hashlib.sha256(cubin).hexdigest())
    """
    first = run_py(code, env=env).stdout.split()
    assert first[0] == str(wrapper)
    calls = _calls(log)
    assert sum("-cubin -arch=sm_90" in c for c in calls) == 1, calls
    second = run_py(code, env=env).stdout.split()
    assert second == first
    assert _calls(log) == calls, "a warm process ran nvcc"
    # The wrapper's path is not in the key: the toolkit's own nvcc gives the same key.
    real = kdb.cuda.identity(kdb.cuda.find_nvcc(), cache_dir)
    real_nvcc = os.path.join(real.toolkit, "bin", "nvcc")
    assert kdb.cuda.attributes_for(DOUBLE_SRC, "sm_90", nvcc=real_nvcc,
                                   memo_dir=cache_dir).key == first[1]


@needs_nvcc
def test_key_holds_nothing_machine_local(db, tmp_path, counting_nvcc):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "scale.cuh").write_text("#define SCALE 3.0f\n")
    attrs = kdb.cuda.attributes_for(HEADER_SRC, "sm_90", ["-I", str(inc)],
                                    nvcc=counting_nvcc[0], memo_dir=db.cache_root)
    ident = kdb.cuda.identity(counting_nvcc[0], db.cache_root)
    text = attrs.encoded().decode()
    for local in (str(tmp_path), ident.toolkit, NVCC, os.path.dirname(NVCC)):
        assert local not in text
    compiler = dict(attrs.compiler)
    assert "release" in compiler["nvcc_version"]
    assert {"nvcc_sha256", "cicc_sha256", "ptxas_sha256"} <= set(compiler)
    assert dict(attrs.headers)["scale.cuh"] == hashlib.sha256(b"#define SCALE 3.0f\n").hexdigest()


@needs_nvcc
def test_header_edit_misses(db, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    header = inc / "scale.cuh"
    header.write_text("#define SCALE 3.0f\n")
    ptx = kdb.cuda.compile(HEADER_SRC, "sm_90", include_dirs=[inc], output="ptx", db=db)
    assert PTX_3 in ptx
    before = kdb.cuda.attributes_for(HEADER_SRC, "sm_90", include_dirs=[inc], output="ptx")
    # -I in the options is the same request as include_dirs=.
    assert kdb.cuda.attributes_for(HEADER_SRC, "sm_90", [f"-I{inc}"], output="ptx") == before
    header.write_text("#define SCALE 5.0f\n")
    after = kdb.cuda.attributes_for(HEADER_SRC, "sm_90", include_dirs=[inc], output="ptx")
    assert after.key != before.key
    assert differences(before.canonical(), after.canonical()) == ["headers"]
    ptx = kdb.cuda.compile(HEADER_SRC, "sm_90", include_dirs=[inc], output="ptx", db=db)
    assert PTX_5 in ptx and PTX_3 not in ptx


#: A child that compiles HEADER_SRC to PTX and says which SCALE the PTX holds; ``SAVE``
#: runs first (a header saved while the compiler runs, for NVRTC, which runs in-process).
SAVED_CHILD = """
import kdb.cuda
from kdb.backends.cuda import nvrtc
SAVE
ptx = kdb.cuda.compile(SRC, "sm_90", include_dirs=[INC], output="ptx", compiler=COMPILER)
print("5" if PTX_5 in ptx else "3" if PTX_3 in ptx else "?")
"""

NVRTC_SAVES = """
real = nvrtc.run
def run(*args, **kwargs):
    open(HEADER, "w").write("#define SCALE 5.0f\\n")
    return real(*args, **kwargs)
nvrtc.run = run
"""


@pytest.mark.parametrize("compiler", [
    pytest.param("nvcc", marks=needs_nvcc), pytest.param("nvrtc", marks=needs_nvrtc)])
def test_a_header_saved_while_the_compiler_runs_is_not_stored(compiler, cache_dir, run_py,
                                                              tmp_path):
    """The key holds ``SCALE 3.0f`` (read before the compile); the compiler read
    ``SCALE 5.0f``. The store checks the headers again and stores nothing, so a process
    whose header says 3.0f again never gets the PTX of 5.0f. nvcc is a wrapper that saves
    the header, then runs the real nvcc."""
    inc = tmp_path / "inc"
    inc.mkdir()
    header = inc / "scale.cuh"
    header.write_text("#define SCALE 3.0f\n")
    env = {"KDB_STORE_AT_EXIT": "wait"}
    save = ""
    if compiler == "nvcc":
        wrapper = _wrapper(tmp_path / "bin", f'case "$*" in *-ptx*) printf "#define SCALE '
                           f'5.0f\\n" > "{header}";; esac\nexec "{NVCC}" "$@"\n')
        env["PATH"] = f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}"
    else:
        save = NVRTC_SAVES
    code = (f"SRC, INC, HEADER = {HEADER_SRC!r}, {str(inc)!r}, {str(header)!r}\n"
            f"PTX_3, PTX_5, COMPILER = {PTX_3!r}, {PTX_5!r}, {compiler!r}\n" + SAVED_CHILD)
    first = run_py(code.replace("SAVE", save), env=env)
    assert first.stdout.split() == ["5"]  # what the compiler read
    assert "header 'scale.cuh' was edited since the build of scale" in first.stderr
    header.write_text("#define SCALE 3.0f\n")  # the key of the first compile again
    db = kdb.KernelDB()
    assert db.get(kdb.cuda.attributes_for(HEADER_SRC, "sm_90", include_dirs=[inc],
                                          output="ptx", compiler=compiler)) is None
    assert run_py(code.replace("SAVE", "")).stdout.split() == ["3"]


@needs_nvcc
def test_option_change_misses(db):
    three = kdb.cuda.compile(SCALE_SRC, "sm_90", ["-DSCALE=3.0f"], output="ptx", db=db)
    five = kdb.cuda.compile(SCALE_SRC, "sm_90", "-DSCALE=5.0f", output="ptx", db=db)
    assert PTX_3 in three and PTX_5 in five
    a3 = kdb.cuda.attributes_for(SCALE_SRC, "sm_90", ["-DSCALE=3.0f"], output="ptx")
    # Before the background store lands, this process answers from memory (no nvcc, no wait).
    assert db.lookup(a3).binary == three
    db.flush()
    assert db.lookup(a3).binary == three
    assert db.lookup(a3.with_(build_options=("-DSCALE=4.0f",))) is None


@needs_nvcc
def test_nvcc_environment_variables_enter_the_key(db, monkeypatch):
    plain = kdb.cuda.attributes_for(SCALE_SRC, "sm_90", output="ptx")
    monkeypatch.setenv("NVCC_PREPEND_FLAGS", "-DSCALE=7.0f")
    flagged = kdb.cuda.attributes_for(SCALE_SRC, "sm_90", output="ptx")
    assert flagged.key != plain.key
    assert dict(flagged.environment) == {"NVCC_PREPEND_FLAGS": "-DSCALE=7.0f"}
    assert PTX_7 in kdb.cuda.compile(SCALE_SRC, "sm_90", output="ptx", db=db)


@needs_nvcc
@pytest.mark.parametrize("name, value", [
    ("PTXAS_FLAGS", "-O0"), ("CUDAFE_FLAGS", "-O0"), ("INCLUDES", "-I/nowhere"),
    ("SYSTEM_INCLUDES", "-isystem /nowhere")])
def test_variables_nvcc_profile_adds_to_enter_the_key(name, value, db, monkeypatch):
    """nvcc.profile writes ``PTXAS_FLAGS +=`` and the like: nvcc keeps what the environment
    holds and adds to it, so each changes the cubin (``PTXAS_FLAGS=-O0``: ptxas's -O0)."""
    plain = kdb.cuda.attributes_for(SCALE_SRC, "sm_90")
    monkeypatch.setenv(name, value)
    flagged = kdb.cuda.attributes_for(SCALE_SRC, "sm_90")
    assert flagged.key != plain.key
    assert dict(flagged.environment) == {name: value}


@needs_nvcc
def test_ptxas_flags_from_the_environment_are_never_served_another_build(db, monkeypatch):
    plain = kdb.cuda.compile(DOUBLE_SRC, "sm_90", db=db, compiler="nvcc")
    db.flush()
    monkeypatch.setenv("PTXAS_FLAGS", "-O0")
    unoptimized = kdb.cuda.compile(DOUBLE_SRC, "sm_90", db=db, compiler="nvcc")
    assert unoptimized != plain


@needs_nvcc
def test_another_nvcc_misses(db, tmp_path, counting_nvcc):
    """An nvcc that reports another version is another compiler: its own key, its own compile."""
    _, log = counting_nvcc
    other = _wrapper(tmp_path / "other", (
        'if [ "$1" = "--version" ]; then\n'
        f'  "{NVCC}" --version | sed "s/, V/, V99./"\n  exit 0\nfi\n'
        f'echo "other $*" >> "{log}"\nexec "{NVCC}" "$@"\n'))
    kdb.cuda.compile(DOUBLE_SRC, "sm_90", output="ptx", db=db)
    db.flush()
    mine = kdb.cuda.attributes_for(DOUBLE_SRC, "sm_90", output="ptx")
    theirs = kdb.cuda.attributes_for(DOUBLE_SRC, "sm_90", output="ptx", nvcc=other)
    assert "V99." in dict(theirs.compiler)["nvcc_version"]
    assert differences(mine.canonical(), theirs.canonical()) == ["compiler"]
    assert db.lookup(theirs) is None
    kdb.cuda.compile(DOUBLE_SRC, "sm_90", output="ptx", db=db, nvcc=other)
    assert any(c.startswith("other -ptx") for c in _calls(log))


GNUC_SRC = "__global__ void host_cc(int *a) { a[0] = __GNUC__ * 100 + HOST_TAG; }\n"
HOST_GCC = shutil.which("gcc")


def _host_gcc(directory: Path, tag: int) -> Path:
    """A host compiler named ``gcc`` in ``directory``: the real gcc with one more predefined
    macro, as a site's gcc built with other defaults (or another release) differs."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "gcc"
    path.write_text(f'#!/bin/sh\nexec "{HOST_GCC}" -DHOST_TAG={tag} "$@"\n')
    path.chmod(0o755)
    return path


@needs_nvcc
@pytest.mark.skipif(HOST_GCC is None, reason="gcc, nvcc's host compiler, is not on PATH")
@pytest.mark.parametrize("how", ["PATH", "NVCC_CCBIN", "-ccbin"])
def test_another_host_compiler_is_another_key(how, cache_dir, tmp_path, run_py):
    """nvcc preprocesses the device code with the host compiler and passes its version on
    to cicc: one nvcc with another gcc (a ``module load gcc/13``, ``NVCC_CCBIN``, ``-ccbin``)
    builds another cubin. Before, the key held nvcc alone, and a process whose gcc differed
    was served the first one's cubin."""
    one, two = _host_gcc(tmp_path / "gcc-one", 1), _host_gcc(tmp_path / "gcc-two", 2)
    code = f"""
        import hashlib, json, kdb.bookkeeping, kdb.cuda
        opts = {["-ccbin", "CCBIN"] if how == "-ccbin" else []!r}
        opts = [os.environ["CCBIN"] if o == "CCBIN" else o for o in opts]
        b = kdb.cuda.compile({GNUC_SRC!r}, "sm_90", opts, output="ptx")
        print(json.dumps({{"ptx": b.decode(), "compiles": len(kdb.bookkeeping.records())}}))
    """
    code = "import os\n" + textwrap.dedent(code)

    def env(gcc: Path) -> dict[str, str]:
        if how == "PATH":
            return {"PATH": f"{gcc.parent}{os.pathsep}{os.environ['PATH']}"}
        return {"NVCC_CCBIN" if how == "NVCC_CCBIN" else "CCBIN": str(gcc)}

    def built(gcc: Path) -> dict:
        return json.loads(run_py(code, env={**env(gcc), "KDB_STORE_AT_EXIT": "wait"}
                                 ).stdout.splitlines()[-1])

    first, second = built(one), built(two)
    assert first["compiles"] == 1 and second["compiles"] == 1, (first, second)
    assert first["ptx"] != second["ptx"]  # HOST_TAG 1 and 2 reached the device code
    again = built(one)
    assert again == {**first, "compiles": 0}
    if how == "PATH":  # kdb info names the compiler the keys hold
        info = subprocess.run([sys.executable, "-m", "kdb.cli", "info", "--json"],
                              env={**os.environ, **env(two)}, capture_output=True, text=True,
                              timeout=120)
        host = json.loads(info.stdout)["cuda"]["host_compiler"]
        assert host["path"] == str(two.resolve()) and host["named"] == "gcc", host


@needs_nvcc
@needs_nvrtc
def test_an_nvcc_without_its_host_compiler_leaves_it_to_nvrtc(cache_dir, tmp_path, run_py):
    """nvcc builds nothing without its host compiler (a toolkit on a machine with no gcc):
    ``compiler=None`` then takes NVRTC, as where no nvcc is found, and says so when neither
    can build; a compile that would only fail is not tried."""
    real = kdb.cuda.identity(kdb.cuda.find_nvcc(), cache_dir)
    (tmp_path / "no-bin").mkdir()
    env = {"PATH": str(tmp_path / "no-bin"), "KDB_NVCC": os.path.join(real.toolkit, "bin", "nvcc")}
    code = f"""
        import json, kdb.bookkeeping, kdb.cuda
        kdb.cuda.compile({DOUBLE_SRC!r}, "sm_90")
        attrs = kdb.cuda.attributes_for({DOUBLE_SRC!r}, "sm_90")
        print(json.dumps({{"compiler": [k for k, _ in attrs.compiler],
                          "compiles": len(kdb.bookkeeping.records())}}))
    """
    out = json.loads(run_py(code, env=env).stdout.splitlines()[-1])
    assert out["compiles"] == 1 and "nvrtc_version" in out["compiler"], out


def _clangxx() -> str | None:
    """A clang++ on PATH (Debian names it clang++-<major>), for nvcc's host compiler."""
    return shutil.which("clang++") or next(
        (p for v in range(25, 10, -1) if (p := shutil.which(f"clang++-{v}"))), None)


@needs_nvcc
@pytest.mark.skipif(_clangxx() is None, reason="no clang++ on PATH to be nvcc's host compiler")
def test_a_header_clangs_argument_edits_find_is_never_served_stale(cache_dir, tmp_path, run_py):
    """With clang as nvcc's host compiler, ``CCC_OVERRIDE_OPTIONS="+-I<dir>"`` puts a
    directory on its search that no option names: nvcc's probe of its default directories
    listed it, and an edit of a header there was served the cubin built before it. Probed
    without the variable, the build reads a file its key does not hold: served, not stored."""
    inc = tmp_path / "edits"
    inc.mkdir()
    (inc / "scale.cuh").write_text("#define SCALE 3.0f\n")
    code = f"""
        import json, kdb.cuda
        b = kdb.cuda.compile({HEADER_SRC!r}, "sm_90", output="ptx", compiler="nvcc")
        print(json.dumps({{"ptx": b.decode()}}))
    """
    env = {"KDB_STORE_AT_EXIT": "wait", "NVCC_CCBIN": _clangxx(),
           "CCC_OVERRIDE_OPTIONS": f"+-I{inc}"}
    first = json.loads(run_py(code, env=env).stdout.splitlines()[-1])["ptx"]
    (inc / "scale.cuh").write_text("#define SCALE 7.0f\n")
    edited = run_py(code, env=env)
    assert "a file kdb's include model did not find" in edited.stderr, edited.stderr
    ptx = json.loads(edited.stdout.splitlines()[-1])["ptx"]
    assert PTX_3 in first.encode() and PTX_7 in ptx.encode()


@needs_nvcc
@pytest.mark.parametrize("name, form", [("INCLUDES", "-I{}"),
                                        ("SYSTEM_INCLUDES", "-isystem {}")])
def test_a_header_nvccs_profile_variables_find_is_never_served_stale(name, form, cache_dir,
                                                                     tmp_path, run_py):
    """``nvcc.profile`` adds to ``INCLUDES`` and ``SYSTEM_INCLUDES``, so a directory they
    name is searched. The probe of nvcc's default directories ran with them and listed it:
    its headers counted as the toolkit's, keyed by its identity, and an edited one was
    served the cubin built before the edit."""
    inc = tmp_path / "profile"
    inc.mkdir()
    (inc / "scale.cuh").write_text("#define SCALE 3.0f\n")
    code = f"""
        import json, kdb.cuda
        b = kdb.cuda.compile({HEADER_SRC.replace('"scale.cuh"', "<scale.cuh>")!r}, "sm_90",
                             output="ptx", compiler="nvcc")
        print(json.dumps({{"ptx": b.decode()}}))
    """
    env = {"KDB_STORE_AT_EXIT": "wait", name: form.format(inc)}
    first = json.loads(run_py(code, env=env).stdout.splitlines()[-1])["ptx"]
    (inc / "scale.cuh").write_text("#define SCALE 7.0f\n")
    edited = json.loads(run_py(code, env=env).stdout.splitlines()[-1])["ptx"]
    assert PTX_3 in first.encode() and PTX_7 in edited.encode()


def test_remembered_identity_is_rechecked_against_its_pieces(tmp_path):
    from kdb.backends.digests import file_stamp

    piece = tmp_path / "ptxas"
    piece.write_bytes(b"one")
    st = piece.stat()
    rec = {"version": "v", "sha256": {}, "include_dirs": [], "stamps": {
        "ptxas": file_stamp(str(piece))}, "probe": cuda_nvcc.PROBE_REVISION}
    assert cuda_nvcc._still_valid(rec)
    # remembered with size and mtime only: probed again
    assert not cuda_nvcc._still_valid({**rec, "stamps": {
        "ptxas": f"{piece}|{st.st_size}|{st.st_mtime_ns}"}})
    # one probed before CCC_OVERRIDE_OPTIONS was left out may list a directory it added
    assert not cuda_nvcc._still_valid({k: v for k, v in rec.items() if k != "probe"})
    assert not cuda_nvcc._still_valid({k: v for k, v in rec.items() if k != "include_dirs"})
    piece.write_bytes(b"three")
    assert not cuda_nvcc._still_valid(rec)
    piece.unlink()
    assert not cuda_nvcc._still_valid(rec)
    assert not cuda_nvcc._still_valid({"stamps": "garbage"})


# -- errors -------------------------------------------------------------------------------

@needs_nvrtc
def test_an_nvrtc_build_that_gives_no_cubin_is_an_error_and_stores_nothing(db, cache_dir):
    """``-dlto``: NVRTC makes LTO IR and no cubin; kdb stored the empty cubin and served it."""
    with pytest.raises(CompileError, match="-dlto"):
        kdb.cuda.compile(DOUBLE_SRC, "sm_80", ["-dlto"], db=db, compiler="nvrtc")
    db.flush()
    assert not list(cache_dir.glob("v1/*.kdb")) or all(
        not sqlite3.connect(f).execute("SELECT count(*) FROM kernels").fetchone()[0]
        for f in cache_dir.glob("v1/*.kdb"))


@needs_nvcc
def test_nvcc_failure_raises_compile_error_with_its_message(db):
    bad = "__global__ void broken(float *a) { a[0] = undefined_thing; }\n"
    with pytest.raises(CompileError) as info:
        kdb.cuda.compile(bad, "sm_90", ["-DX=1"], db=db)
    err = info.value
    assert "undefined_thing" in err.log and "undefined" in str(err)
    assert "-arch=sm_90" in str(err) and "-DX=1" in str(err)
    assert err.command[1:3] == ["-cubin", "-arch=sm_90"]
    db.flush()
    assert db.lookup(kdb.cuda.attributes_for(bad, "sm_90", ["-DX=1"])) is None


def test_missing_nvcc_says_how_to_point_kdb_at_one(cache_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("KDB_NVCC", str(tmp_path / "nowhere" / "nvcc"))
    with pytest.raises(BackendUnavailableError, match="KDB_NVCC"):
        kdb.cuda.compile(DOUBLE_SRC, "sm_90")
    monkeypatch.delenv("KDB_NVCC")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("PATH", "")
    with pytest.raises(BackendUnavailableError) as info:
        kdb.cuda.compile(DOUBLE_SRC, "sm_90", compiler="nvcc")
    assert "KDB_NVCC" in str(info.value) and "CUDA_HOME" in str(info.value)


@pytest.mark.parametrize("arch", ["sm90", "SM_90", "gfx90a", "../sm_90", "sm_9", 90, None])
def test_bad_arch_is_refused_before_nvcc_runs(arch, cache_dir, monkeypatch):
    monkeypatch.setenv("PATH", "")  # nothing runs: validation comes first
    with pytest.raises(InvalidArgumentError):
        kdb.cuda.compile(DOUBLE_SRC, arch)


def test_bad_output_and_options_are_refused(cache_dir, monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(InvalidArgumentError, match="output"):
        kdb.cuda.compile(DOUBLE_SRC, "sm_90", output="elf")
    with pytest.raises(InvalidArgumentError, match="real arch"):
        kdb.cuda.compile(DOUBLE_SRC, "compute_90")
    for opts in (["-arch=sm_80"], ["-o", "x.cubin"], ["--gpu-architecture", "sm_80"], ["-ptx"]):
        with pytest.raises(InvalidArgumentError, match="set by kdb"):
            kdb.cuda.compile(DOUBLE_SRC, "sm_90", opts)
    # nvcc -M returned its make rule of the headers as the "cubin", with no error
    for opts in (["-M"], ["-MM"], ["--generate-dependencies"], ["-MD"], ["-MF", "x.d"]):
        with pytest.raises(InvalidArgumentError, match="list of the headers, not a binary"):
            kdb.cuda.compile(DOUBLE_SRC, "sm_90", opts)
    with pytest.raises(UnsupportedTypeError):
        kdb.cuda.compile(DOUBLE_SRC, "sm_90", [3])
    with pytest.raises(InvalidArgumentError):
        kdb.cuda.compile(DOUBLE_SRC, "sm_90", include_dirs="/usr/include")
    with pytest.raises(InvalidArgumentError):
        kdb.cuda.cubin_arch(b"not an elf file at all" * 4)


@needs_nvcc
@pytest.mark.parametrize("variable", ["NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS"])
@pytest.mark.parametrize("value", ["-arch=sm_90", "-ptx", "--gpu-architecture sm_90", "-M"])
def test_nvccs_variables_may_not_set_what_kdb_sets(variable, value, cache_dir, monkeypatch):
    """``NVCC_APPEND_FLAGS=-arch=sm_90`` made an sm_90 cubin, stored and served as sm_80's
    (``-ptx``: PTX text as the cubin); as an option it is refused, and is in a variable."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(InvalidArgumentError, match=f"{variable} holds"):
        kdb.cuda.compile(DOUBLE_SRC, "sm_80", compiler="nvcc")
    monkeypatch.setenv(variable, "-lineinfo")  # others are in the key, and build
    assert kdb.cuda.cubin_arch(kdb.cuda.compile(DOUBLE_SRC, "sm_80", compiler="nvcc")) == "sm_80"


@pytest.mark.parametrize("compiler", ["nvcc", "nvrtc"])
def test_an_arch_the_compiler_does_not_build_is_invalid_naming_those_it_does(compiler,
                                                                              cache_dir):
    """It was a CompileError, "fix the source or options", with the compiler's one line."""
    try:
        kdb.cuda.find_compiler(compiler)
    except kdb.KdbError as err:
        pytest.skip(str(err))
    with pytest.raises(InvalidArgumentError, match=r"does not build for sm_99; it builds .*sm_90"):
        kdb.cuda.compile(DOUBLE_SRC, "sm_99", compiler=compiler)


@needs_nvcc
def test_line_information_is_the_same_from_build_to_build(tmp_path, monkeypatch):
    """nvcc's -lineinfo holds the directory it ran in and the program file's time: a random
    directory and the time of writing made two packs of such kernels differ (-G holds
    nvcc's own temporary file name, with its pid, too: not reproducible)."""
    monkeypatch.setenv("KDB_DISABLE_CACHE", "1")
    once = kdb.cuda.compile(DOUBLE_SRC, "sm_80", ["-lineinfo"], compiler="nvcc")
    again = kdb.cuda.compile(DOUBLE_SRC, "sm_80", ["-lineinfo"], compiler="nvcc")
    assert once == again
    root = Path(tempfile.gettempdir()) / f"kdb-nvcc-{os.getuid()}"
    assert not root.exists() or list(root.iterdir()) == []  # nothing is left behind


# -- loading ------------------------------------------------------------------------------

def test_source_module_without_pycuda_says_what_is_missing(cache_dir):
    try:
        import pycuda  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("pycuda is installed here")
    with pytest.raises(BackendUnavailableError, match=r"kdb\[pycuda\]"):
        kdb.cuda.SourceModule(DOUBLE_SRC)


@needs_nvcc
def test_compile_never_imports_pycuda_and_loading_needs_a_driver(tmp_path, run_py):
    """With a pycuda whose driver cannot load (no libcuda.so.1), compiling works untouched."""
    fake = tmp_path / "site" / "pycuda"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "driver.py").write_text(
        "raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    out = run_py(f"""
        import sys, kdb, kdb.cuda
        cubin = kdb.cuda.compile({DOUBLE_SRC!r}, arch="sm_90")
        assert cubin[:4] == b"\\x7fELF"
        assert not any(m.split(".")[0] == "pycuda" for m in sys.modules), "pycuda imported"
        try:
            kdb.cuda.SourceModule({DOUBLE_SRC!r})
        except kdb.BackendUnavailableError as err:
            print("unavailable:", err)
    """, env={"PYTHONPATH": str(tmp_path / "site"), "KDB_CACHE_DIR": str(tmp_path / "c")})
    assert "unavailable:" in out.stdout and "libcuda.so.1" in out.stdout


def _gpu_driver():
    drv = pytest.importorskip("pycuda.driver", reason="pycuda with a working driver")
    try:
        drv.init()
        if drv.Device.count() == 0:
            pytest.skip("no CUDA device")
    except drv.Error as err:
        pytest.skip(f"no CUDA device: {err}")
    return drv


@pytest.mark.gpu
@needs_nvcc
def test_source_module_runs_and_a_fresh_process_loads_it_from_kdb(cache_dir, counting_nvcc,
                                                                  run_py):
    _gpu_driver()
    wrapper, log = counting_nvcc
    env = {"PATH": f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}"}
    code = f"""
        import numpy as np, pycuda.autoinit, pycuda.driver as drv, kdb.cuda
        mod = kdb.cuda.SourceModule({DOUBLE_SRC!r})
        a = np.arange(64, dtype=np.float32)
        out = a.copy()
        mod.get_function("twice")(drv.InOut(out), block=(64, 1, 1), grid=(1, 1))
        assert np.array_equal(out, a * 2), out
        print(mod.arch)
    """
    arch = run_py(code, env=env).stdout.strip()
    assert re.fullmatch(r"sm_\d+", arch)
    calls = _calls(log)
    assert sum(f"-cubin -arch={arch}" in c for c in calls) == 1
    run_py(code, env=env)
    assert _calls(log) == calls, "the second process ran nvcc"


# -- NVRTC ----------------------------------------------------------------------------------

@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_nvrtc_cubin_is_built_for_the_requested_arch_and_served_again(db, arch):
    cubin = kdb.cuda.compile(SCALE_SRC, arch, ["-DSCALE=3.0f"], db=db, compiler="nvrtc")
    assert _elf_sm(cubin) == int(arch[3:]) and kdb.cuda.cubin_arch(cubin) == arch
    attrs = kdb.cuda.attributes_for(SCALE_SRC, arch, ["-DSCALE=3.0f"], compiler="nvrtc")
    names = dict(attrs.compiler)
    assert re.fullmatch(r"\d+\.\d+", names["nvrtc_version"])
    assert names["libnvrtc"].startswith(("gnu-build-id:", "sha256:"))
    assert NVRTC not in json.dumps(attrs.canonical())  # the library's path is not in the key
    db.flush()
    hit = db.lookup(attrs)
    assert hit is not None and hit.binary == cubin
    assert len(kdb.bookkeeping.records()) == 1
    assert kdb.cuda.compile(SCALE_SRC, arch, ["-DSCALE=3.0f"], db=db, compiler="nvrtc") == cubin
    assert len(kdb.bookkeeping.records()) == 1, "a second request compiled again"


@needs_nvrtc
@needs_nvcc
def test_nvcc_and_nvrtc_builds_are_different_keys_with_one_compiler_free_key(db):
    by = {c: kdb.cuda.attributes_for(DOUBLE_SRC, "sm_90", compiler=c) for c in ("nvcc", "nvrtc")}
    assert by["nvcc"].key != by["nvrtc"].key
    assert differences(by["nvcc"].canonical(), by["nvrtc"].canonical()) == ["compiler"]
    assert by["nvcc"].compiler_free_key == by["nvrtc"].compiler_free_key
    assert kdb.cuda.attributes_for(DOUBLE_SRC, "sm_90").key == by["nvcc"].key  # None: nvcc


@needs_nvrtc
def test_nvrtc_ptx(db):
    ptx = kdb.cuda.compile(SCALE_SRC, "sm_90", ["-DSCALE=7.0f"], db=db, output="ptx",
                           compiler="nvrtc")
    assert b".target sm_90" in ptx and PTX_7 in ptx and not ptx.endswith(b"\0")
    ptx80 = kdb.cuda.compile(SCALE_SRC, "compute_80", ["-DSCALE=7.0f"], db=db, output="ptx",
                             compiler="nvrtc")
    assert b".target sm_80" in ptx80
    with pytest.raises(InvalidArgumentError, match="fatbin"):
        kdb.cuda.compile(SCALE_SRC, "sm_90", db=db, output="fatbin", compiler="nvrtc")


@needs_nvrtc
def test_nvrtc_with_headers_and_a_failure_with_its_log(db, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "scale.cuh").write_text("#define SCALE 5.0f\n")
    ptx = kdb.cuda.compile(HEADER_SRC, "sm_90", include_dirs=[inc], output="ptx", db=db,
                           compiler="nvrtc")
    assert PTX_5 in ptx
    with pytest.raises(CompileError) as info:
        kdb.cuda.compile("__global__ void bad() { undeclared_thing = 1; }", "sm_90", db=db,
                         compiler="nvrtc")
    assert "undeclared_thing" in info.value.log and "NVRTC" in str(info.value)


@needs_nvrtc
def test_compiler_none_uses_nvrtc_where_there_is_no_nvcc(db, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.delenv("KDB_NVCC", raising=False)
    kind, ident, _ = kdb.cuda.find_compiler(None)
    assert kind == "nvrtc" and ident.path == NVRTC
    cubin = kdb.cuda.compile(DOUBLE_SRC, "sm_80", db=db)
    assert _elf_sm(cubin) == 80
    with pytest.raises(BackendUnavailableError, match="fatbin needs nvcc"):
        kdb.cuda.compile(DOUBLE_SRC, "sm_80", db=db, output="fatbin")
    with pytest.raises(InvalidArgumentError, match="compiler"):
        kdb.cuda.compile(DOUBLE_SRC, "sm_80", db=db, compiler="clang")
    monkeypatch.setenv("KDB_NVRTC", str(tmp_path / "nowhere.so"))  # named, absent: an error
    with pytest.raises(BackendUnavailableError, match="KDB_NVRTC"):
        kdb.cuda.compile(DOUBLE_SRC, "sm_80", db=db)


# -- no compiler installed ----------------------------------------------------------------

def _pack(tmp_path: Path, compilers: list[str], arches=("sm_80", "sm_90")) -> Path:
    """`kdb pack` of DOUBLE_SRC and SCALE_SRC for ``arches``, once per compiler, into one dir."""
    from kdb.pack import build as packing

    out = tmp_path / "sys"
    manifest = tmp_path / "cuda.toml"
    kernels = "".join(
        f'[[kernel]]\nname = "{name}_{c}"\nsource = """{src}"""\noptions = {opts}\n'
        f'backend = "cuda"\ncompiler = "{c}"\n\n'
        for c in compilers
        for name, src, opts in (("twice", DOUBLE_SRC, "[]"),
                                ("scale", SCALE_SRC, '["-DSCALE=3.0f"]')))
    manifest.write_text(kernels)
    packing.pack(arches, out_dir=out, manifest=manifest)
    return out


def _system_binary(path: Path, compiler: str, src: str) -> bytes:
    import sqlite3

    from kdb.file import codec

    from conftest import attributes_of

    conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    try:
        for key, _, attributes in attributes_of(path):
            data = json.loads(attributes)
            if data["source"] == src and f"{compiler}_version" in dict(data["compiler"]):
                kind, blob, raw, digest = conn.execute(
                    "SELECT codec, blob, raw_size, checksum FROM kernels WHERE key = ?",
                    (key,)).fetchone()
                return codec.decode(kind, blob, raw, digest)
    finally:
        conn.close()
    raise AssertionError(f"no {compiler} build in {path}")


_SERVE = """
    import hashlib, json, logging, kdb, kdb.cuda
    out = {}
    for arch in ("sm_80", "sm_90"):
        cubin = kdb.cuda.compile(%r, arch, %r)
        out[arch] = [kdb.cuda.cubin_arch(cubin), hashlib.sha256(cubin).hexdigest()]
    try:
        kdb.cuda.compile("__global__ void never_stored() {}", "sm_90")
    except kdb.BackendUnavailableError as err:
        out["miss"] = str(err)
    print(json.dumps(out))
"""


@needs_nvcc
def test_a_process_with_no_compiler_is_served_from_a_system_database_built_by_nvcc(
        tmp_path, cache_dir, run_py, monkeypatch):
    sysdir = _pack(tmp_path, ["nvcc"])
    env = {**_hide_compilers(tmp_path, monkeypatch), "KDB_SYSTEM_DB_PATH": str(sysdir),
           "KDB_TRACE": "1"}
    proc = run_py(_SERVE % (SCALE_SRC, ["-DSCALE=3.0f"]), env=env)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch in ("sm_80", "sm_90"):
        want = _system_binary(sysdir / f"{arch}.kdb", "nvcc", SCALE_SRC)
        assert out[arch] == [arch, hashlib.sha256(want).hexdigest()]
    assert "no compiler here" in proc.stderr and "built by nvcc release" in proc.stderr
    assert "served from the system tier" in proc.stderr
    assert "compiled" not in proc.stderr  # no exit summary: nothing was compiled


@needs_nvcc
@needs_nvrtc
def test_without_a_compiler_the_newest_compiler_wins_and_a_true_miss_says_what_to_install(
        tmp_path, cache_dir, run_py, monkeypatch):
    sysdir = _pack(tmp_path, ["nvcc", "nvrtc"])
    nvcc_rank = kdb.cuda.compiler_rank(kdb.cuda.identity(kdb.cuda.find_nvcc()).compiler)
    nvrtc_rank = kdb.cuda.compiler_rank(cuda_nvrtc.identity(NVRTC).compiler)
    assert nvcc_rank != nvrtc_rank  # else the tie-break below decides, not the version
    newest = "nvrtc" if nvrtc_rank > nvcc_rank else "nvcc"
    env = {**_hide_compilers(tmp_path, monkeypatch), "KDB_SYSTEM_DB_PATH": str(sysdir),
           "KDB_TRACE": "1"}
    proc = run_py(_SERVE % (DOUBLE_SRC, []), env=env)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch in ("sm_80", "sm_90"):
        want = _system_binary(sysdir / f"{arch}.kdb", newest, DOUBLE_SRC)
        assert out[arch] == [arch, hashlib.sha256(want).hexdigest()]
    assert "2 candidate(s)" in proc.stderr and f"built by {newest}" in proc.stderr
    miss = out["miss"]
    assert "sm_90" in miss and "pip install kdb-system-sm_90" in miss
    assert "kdb[cuda]" in miss and "KDB_NVCC" in miss
    # kdb explain says the same, from the packed entries alone.
    from kdb.cli import cli

    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(sysdir))
    result = CliRunner().invoke(cli, ["explain", "twice_nvcc"])
    assert result.exit_code == 0, result.output
    assert f"no compiler: a process with no CUDA compiler installed is served" in result.output
    assert f"built by {newest}" in result.output


def test_a_true_miss_without_a_compiler_raises_in_this_process(cache_dir, no_compiler):
    kind, ident, why = kdb.cuda.find_compiler()
    assert (kind, ident) == (None, None)
    assert "nvcc not found" in why and "NVRTC not found" in why
    with pytest.raises(BackendUnavailableError) as info:
        kdb.cuda.compile(DOUBLE_SRC, "sm_90")
    text = str(info.value)
    assert "no compiler is installed" in text and "for sm_90" in text
    assert "kdb-system-sm_90" in text and "kdb[cuda]" in text and "CUDA toolkit" in text
    assert kdb.cuda.attributes_for(DOUBLE_SRC, "sm_90").compiler == ()


@needs_nvcc
def test_without_a_compiler_a_user_tier_build_is_served_and_compiler_nvcc_is_kept(
        cache_dir, tmp_path, monkeypatch):
    d = kdb.KernelDB()
    stored = kdb.cuda.compile(DOUBLE_SRC, "sm_90", db=d, compiler="nvcc")
    d.close()
    _hide_compilers(tmp_path, monkeypatch)
    d = kdb.KernelDB()
    assert kdb.cuda.compile(DOUBLE_SRC, "sm_90", db=d) == stored
    assert kdb.cuda.compile(DOUBLE_SRC, "sm_90", db=d, compiler="nvcc") == stored
    with pytest.raises(BackendUnavailableError, match="no nvrtc compiler"):
        kdb.cuda.compile(DOUBLE_SRC, "sm_90", db=d, compiler="nvrtc")
    d.flush()
    assert d.tiers.user_file("sm_90").query("SELECT value FROM counters WHERE name = 'hits.user'") \
        == [(2.0,)]
    d.close()


def test_a_refused_stored_build_is_dropped_and_the_next_one_loaded(cache_dir, no_compiler,
                                                                   monkeypatch):
    """SourceModule with no compiler: the driver refuses the newest build, the next loads."""
    db = kdb.KernelDB()
    base = kdb.cuda.attributes_for(DOUBLE_SRC, "sm_90")
    old = base.with_(compiler={"nvcc_version": "Cuda compilation tools, release 12.4, V12.4.1"})
    new = base.with_(compiler={"nvrtc_version": "13.5"})
    db.put(old, b"old cubin")
    db.put(new, b"new cubin refused by this driver")

    class Driver:
        class Error(Exception):
            pass

        loaded: list = []

        def module_from_buffer(self, data):
            if data.startswith(b"new"):
                raise self.Error("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
            self.loaded.append(data)
            return object()

    drv = Driver()
    req = cuda_keys._request(DOUBLE_SRC, "sm_90", (), (), "cubin", nvcc=None,
                             memo_dir=cache_dir, name=None)
    assert req.tool is None
    backend.SourceModule._load_stored_build(drv, db, req)
    assert drv.loaded == [b"old cubin"]
    db.flush()
    assert db.lookup(new) is None and db.lookup(old).binary == b"old cubin"
    db.close()


# -- report, docs -------------------------------------------------------------------------

@needs_nvrtc
def test_kdb_info_shows_nvrtc_beside_nvcc(cache_dir):
    from kdb.cli import cli

    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    assert f"nvrtc:     {NVRTC}" in result.output
    data = json.loads(CliRunner().invoke(cli, ["info", "--json"]).output)["cuda"]
    assert data["nvrtc"]["path"] == NVRTC and not data["nvrtc"]["problem"]
    assert "sm_80" in data["nvrtc"]["arches"] and "sm_90" in data["nvrtc"]["arches"]
    assert data["default"] == ("nvcc" if NVCC else "nvrtc")
    if NVCC and data["nvcc_arches"] != data["nvrtc"]["arches"]:
        # each compiler's arches: the merged list named arches compiler=None refuses
        assert f"arches:    nvcc: {' '.join(data['nvcc_arches'])}" in result.output
        assert f"NVRTC: {' '.join(data['nvrtc']['arches'])}" in result.output


@needs_nvcc
def test_kdb_info_shows_the_cuda_toolchain(cache_dir):
    from kdb.cli import cli

    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    assert "CUDA toolchain" in result.output and "sm_90" in result.output
    data = json.loads(CliRunner().invoke(cli, ["info", "--json"]).output)["cuda"]
    assert data["nvcc"] == kdb.cuda.find_nvcc().path
    assert "sm_80" in data["arches"] and "sm_90" in data["arches"]
    assert data["release"] and not data["problem"]


def test_kdb_info_without_nvcc_says_how_to_get_one(cache_dir, no_compiler):
    from kdb.cli import cli

    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    assert "nvcc not found" in result.output and "KDB_NVCC" in result.output
    assert "NVRTC not found" in result.output and "kdb[cuda]" in result.output
    assert "stored builds are served" in result.output


def test_doctests():
    from kdb.backends.cuda import keys as cudakeys  # the argument helpers and their examples live there

    result = doctest.testmod(cudakeys, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("options", ['-DA="1', "-DX='2 -O3", "-I\\"])
def test_options_a_shell_cannot_split_are_a_kdb_error(options):
    """A string of options with an unclosed quote is the caller's mistake: a kdb error that
    says what to do, as OpenCL's split_options gives, and still a ValueError."""
    with pytest.raises(kdb.InvalidArgumentError, match="close the quote") as err:
        backend.split_options(options)
    assert isinstance(err.value, ValueError)
    with pytest.raises(kdb.InvalidArgumentError):
        kdb.cuda.attributes_for(DOUBLE_SRC, "sm_90", options, output="ptx")


def test_public_module_exports(cache_dir):
    import kdb.cuda as public

    for name in public.__all__:
        assert getattr(public, name) is getattr(backend, name)


def test_back_ends_read_variables_through_config():
    """Config owns every variable: a back end asks ``kdb.config.read_variables`` for a
    mapping by name, never ``os.environ`` (nor a tuple sliced by position)."""
    backends = Path(kdb.__file__).parent / "backends"
    readers = [p.name for p in sorted(backends.glob("*.py"))
               if "os.environ" in p.read_text(encoding="utf-8")]
    assert readers == []
    assert "environ_values" not in "".join(p.read_text(encoding="utf-8")
                                           for p in backends.glob("*.py"))

"""CUDA's include search, seen as nvcc and NVRTC see it: every form that finds a header.

Each case builds PTX whose constant comes from a header, edits the header, and builds again
through kdb: the PTX must show the new constant (a stale hit shows the old one). Each form
here served the old PTX before kdb read CUDA's include options as the compilers do.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

import kdb
import kdb.cuda
from kdb import BackendUnavailableError
from kdb.backends import cuda as backend
from kdb.backends.cuda import keys as cuda_keys
from conftest import stored_entries as stored

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


def _nvrtc_found() -> str | None:
    try:
        return backend.find_nvrtc().path
    except BackendUnavailableError:
        return None


needs_nvrtc = pytest.mark.skipif(
    _nvrtc_found() is None, reason="NVRTC not found (pip install nvidia-cuda-nvrtc, the test extra)")

KERNEL = "__global__ void scale(float *a) { a[threadIdx.x] *= SCALE; }\n"
#: PTX spells float constants as their IEEE bits: 3.0f, 5.0f.
PTX = {3: b"0f40400000", 5: b"0f40A00000"}


@pytest.fixture
def db(cache_dir):
    d = kdb.KernelDB()
    yield d
    d.close()


#: id: (compiler, the program's first line, options given the header's dir d, variables
#: given d, where the header lives relative to the working directory w; d is w/inc).
CASES = {
    "CPATH": ("nvcc", '#include "scale.cuh"', lambda d: [], lambda d: {"CPATH": d}, "inc"),
    "CPLUS_INCLUDE_PATH": ("nvcc", "#include <scale.cuh>", lambda d: [],
                           lambda d: {"CPLUS_INCLUDE_PATH": d}, "inc"),
    "--include-path=": ("nvcc", '#include "scale.cuh"', lambda d: [f"--include-path={d}"],
                        lambda d: {}, "inc"),
    "--include-path dir": ("nvcc", '#include "scale.cuh"', lambda d: ["--include-path", d],
                           lambda d: {}, "inc"),
    "--include-path relative": ("nvcc", '#include "scale.cuh"',
                                lambda d: ["--include-path=inc"], lambda d: {}, "inc"),
    "-I a comma list": ("nvcc", '#include "scale.cuh"', lambda d: [f"-I/nowhere,{d}"],
                        lambda d: {}, "inc"),
    "-isystem": ("nvcc", "#include <scale.cuh>", lambda d: ["-isystem", d], lambda d: {}, "inc"),
    "--system-include=": ("nvcc", "#include <scale.cuh>", lambda d: [f"--system-include={d}"],
                          lambda d: {}, "inc"),
    "-include": ("nvcc", "", lambda d: ["-include", f"{d}/scale.cuh"], lambda d: {}, "inc"),
    "--pre-include=": ("nvcc", "", lambda d: [f"--pre-include={d}/scale.cuh"], lambda d: {},
                       "inc"),
    "NVCC_APPEND_FLAGS=-I": ("nvcc", '#include "scale.cuh"', lambda d: [],
                             lambda d: {"NVCC_APPEND_FLAGS": f"-I{d}"}, "inc"),
    "NVCC_PREPEND_FLAGS=--include-path": (
        "nvcc", '#include "scale.cuh"', lambda d: [],
        lambda d: {"NVCC_PREPEND_FLAGS": f"--include-path {d}"}, "inc"),
    # nvcc.profile's "INCLUDES +=" and "SYSTEM_INCLUDES +=" keep what the environment holds
    "INCLUDES": ("nvcc", '#include "scale.cuh"', lambda d: [],
                 lambda d: {"INCLUDES": f'"-I{d}"'}, "inc"),
    "SYSTEM_INCLUDES": ("nvcc", "#include <scale.cuh>", lambda d: [],
                        lambda d: {"SYSTEM_INCLUDES": f"-isystem {d}"}, "inc"),
    "-I=dir": ("nvcc", '#include "scale.cuh"', lambda d: [f"-I={d}"], lambda d: {}, "inc"),
    "-include=file": ("nvcc", "", lambda d: [f"-include={d}/scale.cuh"], lambda d: {}, "inc"),
    "NVRTC: -I=dir": ("nvrtc", '#include "scale.cuh"', lambda d: [f"-I={d}"], lambda d: {},
                      "inc"),
    "NVRTC: -include=file": ("nvrtc", "", lambda d: [f"-include={d}/scale.cuh"], lambda d: {},
                             "inc"),
    "#\\ splice": ("nvcc", '#\\\ninclude "scale.cuh"', lambda d: ["-I", d], lambda d: {}, "inc"),
    "macro include into a subdirectory": (
        "nvcc", '#define H "sub/scale.cuh"\n#include H', lambda d: ["-I", d], lambda d: {},
        "inc/sub"),
    "NVRTC: the working directory": ("nvrtc", '#include "scale.cuh"', lambda d: [],
                                     lambda d: {}, "."),
    "NVRTC: --include-path=": ("nvrtc", '#include "scale.cuh"',
                               lambda d: [f"--include-path={d}"], lambda d: {}, "inc"),
    "NVRTC: --pre-include=": ("nvrtc", "", lambda d: [f"--pre-include={d}/scale.cuh"],
                              lambda d: {}, "inc"),
    "NVRTC: -I relative": ("nvrtc", "#include <scale.cuh>", lambda d: ["-Iinc"], lambda d: {},
                           "inc"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_edited_header_is_never_served_stale(case, db, tmp_path, monkeypatch):
    compiler, first, options, variables, where = CASES[case]
    if compiler == "nvcc" and NVCC is None:
        pytest.skip("nvcc is not on PATH")
    if compiler == "nvrtc" and _nvrtc_found() is None:
        pytest.skip("NVRTC not found")
    work = tmp_path / "work"
    d = work / "inc"
    header = work / where / "scale.cuh"
    header.parent.mkdir(parents=True, exist_ok=True)
    d.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    for name, value in variables(str(d)).items():
        monkeypatch.setenv(name, value)
    src = first + "\n" + KERNEL

    def build() -> bytes:
        return kdb.cuda.compile(src, "sm_90", options(str(d)), output="ptx", db=db,
                                compiler=compiler)

    header.write_text("#define SCALE 3.0f\n")
    assert PTX[3] in build()
    db.flush()
    header.write_text("#define SCALE 5.0f\n")
    assert PTX[5] in build()


def test_nvrtc_is_never_served_stale_for_a_header_reached_by_a_link_elsewhere(db, tmp_path,
                                                                           monkeypatch):
    """``y/a.h`` a link to ``x/a.h``; NVRTC takes its ``#include "b.h"`` as ``y/b.h``. An
    edit of ``y/b.h`` was a hit on the binary built before it."""
    if _nvrtc_found() is None:
        pytest.skip("NVRTC not found")
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    (tmp_path / "x" / "a.h").write_text('#include "b.h"\n')
    (tmp_path / "y" / "a.h").symlink_to("../x/a.h")
    (tmp_path / "x" / "b.h").write_text("#define UNUSED 1\n")
    monkeypatch.chdir(tmp_path)
    src = '#include "x/a.h"\n#include "y/a.h"\n' + KERNEL

    def build(k: int) -> bytes:
        (tmp_path / "y" / "b.h").write_text(f"#define SCALE {k}.0f\n")
        return kdb.cuda.compile(src, "sm_90", output="ptx", db=db, compiler="nvrtc")

    assert PTX[3] in build(3)
    db.flush()
    assert PTX[5] in build(5)


@needs_nvcc
def test_a_macro_include_is_built_without_the_cache_with_one_warning(cache_dir, db, tmp_path,
                                                                     caplog):
    (tmp_path / "scale.cuh").write_text("#define SCALE 3.0f\n")
    src = '#define H "scale.cuh"\n#include H\n' + KERNEL
    with caplog.at_level(logging.WARNING, logger="kdb"):
        for _ in range(2):
            assert PTX[3] in kdb.cuda.compile(src, "sm_90", [f"-I{tmp_path}"], output="ptx",
                                              db=db)
    db.flush()
    assert stored(cache_dir) == 0
    warned = [r for r in caplog.records if "names its header by a macro" in r.getMessage()]
    assert len(warned) == 1 and "without the cache" in warned[0].getMessage()


@needs_nvcc
@pytest.mark.parametrize("options, why", [
    (["-Xcompiler", "-I/somewhere"], "may change where headers are found"),
    (["--options-file", "x"], "may change where headers are found"),
    (["--libdevice-directory=/somewhere", "--dont-use-profile"], "read files kdb would key"),
    (["-ldir", "/somewhere"], "read files kdb would key")])
def test_options_kdb_does_not_read_make_the_build_uncertain(options, why, db):
    req = cuda_keys._request(KERNEL.replace("SCALE", "2.0f"), "sm_90", options, (), "ptx",
                             nvcc=None, memo_dir=db.cache_root, name=None)
    assert req.uncertain and why in req.uncertain


@needs_nvcc
def test_an_option_passed_on_to_another_tool_keeps_its_value(db):
    """``-Xcompiler -I/x``: the host compiler's ``-I``, not nvcc's (it was handed to nvcc as
    a device include directory, and ``-Xcompiler`` took the option after it)."""
    req = cuda_keys._request(KERNEL.replace("SCALE", "2.0f"), "sm_90",
                             ["-Xcompiler", "-I/x", "-DFOO", "-Xptxas", "-v"], (), "ptx",
                             nvcc=None, memo_dir=db.cache_root, name=None)
    assert req.options == ("-Xcompiler", "-I/x", "-DFOO", "-Xptxas", "-v")
    assert "-I/x" not in req.include_args


@needs_nvcc
def test_a_relative_directory_in_nvccs_variables_is_uncertain(db, monkeypatch):
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-Iinc")
    req = cuda_keys._request(KERNEL, "sm_90", [], (), "ptx", nvcc=None,
                             memo_dir=db.cache_root, name=None)
    assert req.uncertain and "relative path" in req.uncertain


@needs_nvcc
def test_include_options_leave_the_key_and_reach_nvcc_absolute(db, tmp_path, monkeypatch):
    """Two working trees with the same header: one key; nvcc gets each path absolute."""
    keys = []
    for tree in ("a", "b"):
        inc = tmp_path / tree / "inc"
        inc.mkdir(parents=True)
        (inc / "scale.cuh").write_text("#define SCALE 3.0f\n")
        monkeypatch.chdir(tmp_path / tree)
        req = cuda_keys._request('#include "scale.cuh"\n' + KERNEL, "sm_90",
                                 ["--include-path=inc", "-isystem", "inc", "-DX=1"], (), "ptx",
                                 nvcc=None, memo_dir=db.cache_root, name=None)
        assert req.attrs.build_options == ("-DX=1",)
        assert f"-I{inc}" in req.include_args and str(inc) in req.include_args
        keys.append(req.attrs.key)
    assert keys[0] == keys[1]


@needs_nvcc
def test_a_file_nvcc_read_that_the_key_does_not_hold_is_not_stored(cache_dir, db, tmp_path,
                                                                   monkeypatch, caplog):
    """The compiler is the oracle: nvcc lists what it read (-MD); a header kdb's model did
    not find (here: a model made blind on purpose) keeps the binary out of the cache."""
    (tmp_path / "scale.cuh").write_text("#define SCALE 3.0f\n")
    monkeypatch.setattr(cuda_keys, "read_headers", lambda *a, **k: ())
    with caplog.at_level(logging.WARNING, logger="kdb"):
        ptx = kdb.cuda.compile('#include "scale.cuh"\n' + KERNEL, "sm_90", [f"-I{tmp_path}"],
                               output="ptx", db=db)
    assert PTX[3] in ptx
    db.flush()
    assert stored(cache_dir) == 0
    assert any("did not find" in r.getMessage() and "scale.cuh" in r.getMessage()
               for r in caplog.records)


@needs_nvcc
def test_headers_from_the_toolkit_and_the_system_do_not_count_as_unkeyed(cache_dir, db):
    src = "#include <cuda_fp16.h>\n#include <stdint.h>\n" + KERNEL.replace("SCALE", "2.0f")
    kdb.cuda.compile(src, "sm_90", output="ptx", db=db)
    db.flush()
    assert stored(cache_dir) == 1


@needs_nvcc
def test_a_header_nvccs_host_compiler_finds_in_usr_local_include_is_keyed(db, tmp_path):
    """nvcc's host compiler searches /usr/local/include with no option, where ``make
    install`` puts CUTLASS or CUB: an edited header there is a miss, never the old binary
    (it was keyed as missing and served stale)."""
    site = Path("/usr/local/include")
    if not os.access(site, os.W_OK):
        pytest.skip(f"{site} is not writable by this user")
    header = site / f"kdb_test_site_{os.getpid()}_{tmp_path.name}.cuh"
    src = f"#include <{header.name}>\n" + KERNEL
    try:
        header.write_text("#define SCALE 3.0f\n")
        assert PTX[3] in kdb.cuda.compile(src, "sm_90", output="ptx", db=db, compiler="nvcc")
        db.flush()
        header.write_text("#define SCALE 5.0f\n")
        assert PTX[5] in kdb.cuda.compile(src, "sm_90", output="ptx", db=db, compiler="nvcc")
    finally:
        header.unlink(missing_ok=True)


def test_dependency_lists_are_read_as_make_writes_them():
    from kdb.backends.includes import dependency_paths

    text = "kernel.ptx : kernel.cu \\\n    /usr/include/a.h \\\n    sp\\ ace/w.h \\\n    b.h\n"
    assert dependency_paths(text) == ["kernel.cu", "/usr/include/a.h", "sp ace/w.h", "b.h"]

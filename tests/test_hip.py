"""kdb.hip: code objects through the real hipcc and HIPRTC (no GPU needed), keys, errors.

The toolchain is Debian's ROCm 5.2 (``tools/ensure_hip.sh`` installs it for ``make test``);
without it these tests skip, saying so.
"""

from __future__ import annotations

import doctest
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest

import kdb
import kdb.hip
from kdb import BackendUnavailableError, CompileError, InvalidArgumentError
from kdb.backends.hip import hipcc as hip_hipcc
from kdb.backends.hip import hiprtc as hip_hiprtc
from kdb.backends.hip import keys as hip_keys
from kdb.backends.hip import targets as hip_targets

HIPCC = shutil.which("hipcc")
needs_hipcc = pytest.mark.skipif(
    HIPCC is None, reason="hipcc is not on PATH (apt-get install hipcc; tools/ensure_hip.sh)")


def _hiprtc_found() -> str | None:
    try:
        return hip_hiprtc.find_hiprtc()
    except BackendUnavailableError:
        return None


HIPRTC = _hiprtc_found()
needs_hiprtc = pytest.mark.skipif(
    HIPRTC is None, reason="HIPRTC not found (apt-get install libamdhip64-5 libhiprtc-builtins5)")

SRC = ('#include <hip/hip_runtime.h>\n'
       'extern "C" __global__ void scale(float *a) { a[threadIdx.x] *= SCALE; }\n')
HEADER_SRC = '#include "scale.h"\nextern "C" __global__ void sc(float *a) { a[0] *= K; }\n'


@pytest.fixture
def db(cache_dir):
    d = kdb.KernelDB()
    yield d
    d.close()


@pytest.fixture
def counting_hipcc(tmp_path):
    """A wrapper named hipcc that logs each invocation, then runs the real hipcc."""
    log = tmp_path / "hipcc-calls.log"
    path = tmp_path / "bin" / "hipcc"
    path.parent.mkdir()
    path.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{HIPCC}" "$@"\n')
    path.chmod(0o755)
    return path, log


def _compiles(log: Path) -> int:
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for line in lines if "--genco" in line and " -E " not in line)


def _elf_mach(co: bytes) -> int:
    """EF_AMDGPU_MACH of a code object, read independently of kdb's helper."""
    assert co[:4] == b"\x7fELF" and struct.unpack_from("<H", co, 18)[0] == 224
    return struct.unpack_from("<I", co, 48)[0] & 0xFF


def test_doctests():
    for mod in (hip_targets, hip_keys):
        assert doctest.testmod(mod).failed == 0


@needs_hipcc
def test_a_miss_runs_hipcc_once_and_a_second_call_is_a_hit(db, counting_hipcc):
    wrapper, log = counting_hipcc
    co = kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=3.0f"], db=db, hipcc=wrapper)
    assert _elf_mach(co) == 0x3F and kdb.hip.code_object_target(co) == "gfx90a"
    assert _compiles(log) == 1
    assert kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=3.0f"], db=db, hipcc=wrapper) == co
    db.flush()
    d2 = kdb.KernelDB()  # a new handle on the stored file: still no compile
    assert kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=3.0f"], db=d2, hipcc=wrapper) == co
    d2.close()
    assert _compiles(log) == 1


@needs_hipcc
def test_the_key_changes_with_an_option_a_target_feature_and_the_arch(cache_dir):
    base = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=3.0f"])
    assert base.arch == "gfx90a" and dict(base.compiler)["hipcc_version"].startswith("HIP version")
    for other in (kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=5.0f"]),
                  kdb.hip.attributes_for(SRC, "gfx90a:xnack-:sramecc+", ["-DSCALE=3.0f"]),
                  kdb.hip.attributes_for(SRC, "gfx1030", ["-DSCALE=3.0f"])):
        assert other.key != base.key
    featured = kdb.hip.attributes_for(SRC, "gfx90a:xnack-:sramecc+", ["-DSCALE=3.0f"])
    assert featured.arch == "gfx90a"  # one system file per processor
    assert "--offload-arch=gfx90a:sramecc+:xnack-" in featured.internal_options


@needs_hipcc
def test_a_header_enters_the_key_by_content_and_an_edit_rebuilds(db, tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "scale.h").write_text("#define K 3.0f\n")
    monkeypatch.chdir(tmp_path)
    first = kdb.hip.compile(HEADER_SRC, "gfx1030", include_dirs=["inc"], db=db)
    key = kdb.hip.attributes_for(HEADER_SRC, "gfx1030", include_dirs=["inc"]).key
    (inc / "scale.h").write_text("#define K 7.0f\n")
    edited = kdb.hip.attributes_for(HEADER_SRC, "gfx1030", ["-Iinc"])
    assert edited.key != key  # -Iinc and include_dirs=["inc"] are one search
    assert kdb.hip.attributes_for(HEADER_SRC, "gfx1030", include_dirs=["inc"]).key == edited.key
    second = kdb.hip.compile(HEADER_SRC, "gfx1030", ["-Iinc"], db=db)
    assert second != first
    # The same headers elsewhere: the same key (paths never enter it).
    other = tmp_path / "elsewhere"
    shutil.copytree(inc, other)
    assert kdb.hip.attributes_for(HEADER_SRC, "gfx1030", [f"-I{other}"]).key == edited.key


@needs_hipcc
def test_hipccs_variables_enter_the_key(cache_dir, monkeypatch):
    base = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=1"])
    monkeypatch.setenv("HIPCC_COMPILE_FLAGS_APPEND", "-DEXTRA=1")
    appended = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=1"])
    assert appended.key != base.key
    assert ("HIPCC_COMPILE_FLAGS_APPEND", "-DEXTRA=1") in appended.environment


_SERVE = r"""
import json, sys
import kdb, kdb.hip
out = {}
co = kdb.hip.compile(%r, "gfx90a", ["-DSCALE=3.0f"], compiler="hipcc")
out["co"] = co.hex()
try:
    kdb.hip.compile(%r, "gfx90a", ["-DSCALE=9.0f"], compiler="hipcc")
except kdb.BackendUnavailableError as err:
    out["miss"] = str(err)
print(json.dumps(out))
"""


@needs_hipcc
def test_a_process_with_no_hipcc_is_served_the_stored_code_object(cache_dir, tmp_path,
                                                                   run_py):
    d = kdb.KernelDB()
    stored = kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=3.0f"], db=d, compiler="hipcc")
    d.close()
    # ROCM_PATH is a variable hipcc reads (in the key): the child leaves it as this one has it
    env = {"PATH": str(tmp_path / "no-bin"), "KDB_TRACE": "1"}
    proc = run_py(_SERVE % (SRC, SRC), env=env)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert bytes.fromhex(out["co"]) == stored
    release = kdb.hip.identity(HIPCC).release  # "hipcc 5.2.21153-0": HIP's, not clang's
    assert "no compiler here" in proc.stderr and f"built by {release}" in proc.stderr
    assert "Thread model" not in proc.stderr
    assert "apt-get install hipcc" in out["miss"] and "gfx90a" in out["miss"]


@needs_hipcc
def test_a_stored_code_object_for_another_target_is_never_served(db):
    attrs = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=2.0f"])
    wrong = kdb.hip.compile(SRC, "gfx1030", ["-DSCALE=2.0f"], db=db)
    db.flush()
    assert db.put(attrs, wrong)  # a gfx1030 code object under gfx90a's key
    got = kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=2.0f"], db=db)
    assert kdb.hip.code_object_target(got) == "gfx90a" and got != wrong
    db.flush()
    assert db.tiers.lookup(attrs).binary == got  # the wrong one was dropped, the right one stored


@needs_hipcc
@pytest.mark.parametrize("arch, words", [
    ("gfx942", ["does not know", "gfx90a", "gfx1030", "newer ROCm"]),
    ("gfx950", ["does not know", "gfx90a"]),
    ("gfx1100", ["knows gfx1100", "no bitcode", "newer ROCm", "gfx1030"]),
    ("gfx1030:xnack+", ["no xnack setting"]),
    ("sm_90", ["not a target ID"]),
])
def test_an_arch_the_toolchain_does_not_build_is_invalid_naming_those_it_does(cache_dir, arch,
                                                                              words):
    with pytest.raises(InvalidArgumentError) as info:
        kdb.hip.compile(SRC, arch, ["-DSCALE=1"], compiler="hipcc")
    for w in words:
        assert w in str(info.value)


@needs_hipcc
def test_bad_options_and_sources_are_clear_errors(db):
    with pytest.raises(InvalidArgumentError, match="set by kdb"):
        kdb.hip.compile(SRC, "gfx90a", ["--offload-arch=gfx1030"], db=db)
    with pytest.raises(CompileError, match="hipcc failed") as info:
        kdb.hip.compile("__global__ void f() { nonsense }", "gfx90a", db=db)
    assert "nonsense" in info.value.log


def test_a_missing_toolchain_names_the_package(cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    with pytest.raises(BackendUnavailableError, match="apt-get install hipcc"):
        hip_hipcc.find_hipcc()
    with pytest.raises(BackendUnavailableError, match="apt-get install hipcc"):
        kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=4.0f"], compiler="hipcc")


@needs_hiprtc
def test_hiprtc_builds_the_target_and_a_second_call_is_a_hit(db, monkeypatch):
    co = kdb.hip.compile(SRC, "gfx90a:sramecc+:xnack-", ["-DSCALE=3.0f"], db=db,
                         compiler="hiprtc")
    assert kdb.hip.code_object_target(co) == "gfx90a:sramecc+:xnack-"
    attrs = kdb.hip.attributes_for(SRC, "gfx90a:sramecc+:xnack-", ["-DSCALE=3.0f"],
                                   compiler="hiprtc")
    assert dict(attrs.compiler).get("hiprtc_version") and attrs.environment == ()

    def refuse(*_args, **_kw):
        raise AssertionError("HIPRTC ran on a hit")

    monkeypatch.setattr(hip_hiprtc, "run", refuse)
    assert kdb.hip.compile(SRC, "gfx90a:sramecc+:xnack-", ["-DSCALE=3.0f"], db=db,
                           compiler="hiprtc") == co


@needs_hiprtc
def test_hiprtc_refuses_an_unknown_target_before_it_can_abort_the_process(cache_dir):
    # HIPRTC 5.2 aborts the process on a target it does not know: kdb checks first.
    with pytest.raises(InvalidArgumentError, match="gfx90a"):
        kdb.hip.compile(SRC, "gfx942", compiler="hiprtc")


def test_code_object_targets_are_read_from_the_elf_header():
    head = bytearray(64)
    head[:4], head[4], head[8] = b"\x7fELF", 2, 2
    struct.pack_into("<H", head, 18, 224)
    struct.pack_into("<I", head, 48, 0x3F | 0x300 | 0x800)  # gfx90a, xnack on, sramecc off
    assert hip_targets.code_object_target(bytes(head)) == "gfx90a:sramecc-:xnack+"
    struct.pack_into("<I", head, 48, 0x4C | 0x100 | 0x400)  # gfx942, both "any"
    assert hip_targets.code_object_target(bytes(head)) == "gfx942"
    assert hip_targets.code_object_target(b"__CLANG_OFFLOAD_BUNDLE__") is None


def test_the_hip_back_end_is_registered():
    from kdb import registry

    assert registry.get("hip").label == "HIP"
    assert registry.load(registry.get("hip").compiler_rank) is kdb.hip.compiler_rank


# -- kdb info ---------------------------------------------------------------------------------

@needs_hipcc
@needs_hiprtc
def test_kdb_info_shows_hipcc_and_hiprtc_with_their_releases(cache_dir):
    from click.testing import CliRunner

    from kdb.cli import cli

    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    release = kdb.hip.identity(kdb.hip.find_hipcc()).release
    assert f"hipcc:     {kdb.hip.find_hipcc()}\n             {release}\n" in result.output
    assert f"hiprtc:    {HIPRTC}\n             HIPRTC " in result.output
    data = json.loads(CliRunner().invoke(cli, ["info", "--json"]).output)["hip"]
    assert data["hipcc"]["release"] == release and data["default"] == "hipcc"
    assert "gfx90a" in data["hipcc"]["arches"] and "gfx942" not in data["hipcc"]["arches"]
    assert data["hiprtc"]["path"] == HIPRTC and not data["hiprtc"]["problem"]


def test_kdb_info_without_hipcc_or_hiprtc_says_what_to_install(cache_dir, tmp_path,
                                                              monkeypatch):
    from click.testing import CliRunner

    from kdb.cli import cli

    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.delenv("ROCM_PATH", raising=False)
    monkeypatch.setattr(hip_hiprtc, "_dirs", lambda: [str(tmp_path / "no-lib")])
    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    assert "hipcc:     (not installed: hipcc not found" in result.output
    assert "apt-get install hipcc" in result.output
    assert "hiprtc:    (not installed: HIPRTC not found" in result.output
    assert "apt-get install libamdhip64-5" in result.output
    hip = result.output[result.output.index("HIP toolchain"):]
    assert "compiles:  nothing: no compiler; stored builds are served" in hip

"""kdb.hip: code objects through the real hipcc and HIPRTC (no GPU needed), keys, errors.

The toolchain is Debian's ROCm 5.2 (``tools/ensure_hip.sh`` installs it for ``make test``);
without it these tests skip, saying so.
"""

from __future__ import annotations

import doctest
import json
import os
import re
import shutil
import sqlite3
import struct
import subprocess
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
def test_a_build_leaves_nothing_in_the_temporary_directory(cache_dir, tmp_path, monkeypatch):
    """clang makes a directory of its own in ``TMPDIR`` for each HIP compile and never removes
    it (``kernel-<6 hex digits>``, two a build): kdb points hipcc's ``TMPDIR`` at its own
    temporary directory, removed with all it holds."""
    import tempfile

    watched = tmp_path / "tmp"
    watched.mkdir()
    monkeypatch.setenv("TMPDIR", str(watched))
    monkeypatch.setattr(tempfile, "tempdir", None)  # kdb's own directories go there too
    d = kdb.KernelDB()
    kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=5.0f"], db=d)
    d.close()
    assert sorted(os.listdir(watched)) == []


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


BOTH = [pytest.param("hipcc", marks=needs_hipcc), pytest.param("hiprtc", marks=needs_hiprtc)]


@pytest.mark.parametrize("compiler", BOTH)
@pytest.mark.parametrize("how", ["include_dirs", "-I", "CPATH"])
def test_a_header_found_any_way_either_compiler_finds_it_is_keyed(compiler, how, db, tmp_path,
                                                                  monkeypatch):
    """HIPRTC was handed no include option at all (a build with one failed: 'scale.h' file
    not found), and read CPATH, which its key did not follow: an edited header there was
    served the code object built before the edit."""
    inc = tmp_path / "inc"
    inc.mkdir()
    monkeypatch.chdir(tmp_path)
    if how == "CPATH":
        monkeypatch.setenv("CPATH", str(inc))
    given = {"include_dirs": {"include_dirs": ["inc"]}, "-I": {"options": ["-Iinc"]},
             "CPATH": {}}[how]

    _edits_are_seen(db, inc / "scale.h", compiler=compiler, **given)


@needs_hipcc
def test_a_header_hipcc_finds_in_usr_local_include_is_keyed(db, tmp_path):
    """clang searches /usr/local/include with no option (where ``make install`` puts a
    header-only library): an edited header there is a new code object, never the old one."""
    site = Path("/usr/local/include")
    if not os.access(site, os.W_OK):
        pytest.skip(f"{site} is not writable by this user")
    header = site / f"kdb_test_site_{os.getpid()}_{tmp_path.name}.h"
    src = HEADER_SRC.replace('"scale.h"', f"<{header.name}>")

    def build(k: str) -> bytes:
        header.write_text(f"#define K {k}f\n")
        return kdb.hip.compile(src, "gfx90a", db=db, compiler="hipcc")

    try:
        three = build("3.0")
        db.flush()
        assert build("7.0") != three
    finally:
        header.unlink(missing_ok=True)


def _edits_are_seen(db, header: Path, **how) -> None:
    """``header`` edited, a new code object; edited back, the first one again."""
    def build(k: str) -> bytes:
        header.write_text(f"#define K {k}f\n")
        return kdb.hip.compile(HEADER_SRC, "gfx90a", db=db, **how)

    three = build("3.0")
    db.flush()
    seven = build("7.0")
    assert seven != three
    db.flush()
    assert build("3.0") == three


@needs_hipcc
def test_debug_information_is_the_same_from_build_to_build(monkeypatch):
    """hipcc's -g holds the directory it ran in: a random one made two packs differ."""
    monkeypatch.setenv("KDB_DISABLE_CACHE", "1")
    once = kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=2.0f", "-g"], compiler="hipcc")
    assert once == kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=2.0f", "-g"], compiler="hipcc")


@needs_hiprtc
@pytest.mark.parametrize("variable", ["HIP_PATH", "ROCM_PATH"])
def test_a_header_hiprtc_finds_under_hip_path_or_rocm_path_is_keyed(variable, db, tmp_path,
                                                                    monkeypatch):
    """HIPRTC searches ``$HIP_PATH/include`` and ``$ROCM_PATH/include``: a header there was
    served the code object built before its edit, and a process without the variable (whose
    build fails: not found) was served the one built with it."""
    root = tmp_path / "rocm"
    (root / "include").mkdir(parents=True)
    monkeypatch.setenv(variable, str(root))

    _edits_are_seen(db, root / "include" / "scale.h", compiler="hiprtc")
    with_it = kdb.hip.attributes_for(HEADER_SRC, "gfx90a", compiler="hiprtc")
    assert (variable, str(root)) in with_it.environment
    monkeypatch.delenv(variable)
    assert kdb.hip.attributes_for(HEADER_SRC, "gfx90a", compiler="hiprtc").key != with_it.key


@pytest.mark.parametrize("compiler", BOTH)
def test_a_directory_reached_through_a_link_and_dotdot_is_the_one_the_system_finds(
        compiler, db, tmp_path, monkeypatch):
    """``-Ilink/../inc``, ``link`` leading to ``real/sub``: the compiler reads
    ``real/inc``. kdb tidied the path as text into ``inc`` (another directory), and built
    and keyed the header there."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "real" / "inc").mkdir()
    (tmp_path / "inc").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    (tmp_path / "real" / "inc" / "scale.h").write_text("#define K 3.0f\n")
    (tmp_path / "inc" / "scale.h").write_text("#define K 7.0f\n")
    monkeypatch.chdir(tmp_path)
    through = kdb.hip.compile(HEADER_SRC, "gfx90a", ["-Ilink/../inc"], db=db, compiler=compiler)
    assert through == kdb.hip.compile(HEADER_SRC, "gfx90a", db=db, compiler=compiler,
                                      include_dirs=[tmp_path / "real" / "inc"])
    assert kdb.hip.compile(HEADER_SRC, "gfx90a", db=db, compiler=compiler,
                           include_dirs=["link/../inc"]) == through


@pytest.mark.parametrize("compiler", BOTH)
@pytest.mark.parametrize("form", ["--include {}", "--include={}", "-include {}"])
def test_every_spelling_of_a_forced_include_is_keyed_by_its_content(compiler, form, db,
                                                                    tmp_path):
    """``--include f.h`` (clang's long spelling) was an option kdb did not read: HIPRTC,
    which has no list of what it read to check, was served the code object built before an
    edit of ``f.h``."""
    forced = tmp_path / "pre.h"
    options = form.format(forced).split(" ")
    src = 'extern "C" __global__ void sc(float *a) { a[0] *= K; }\n'

    def build(k: str) -> bytes:
        forced.write_text(f"#define K {k}f\n")
        return kdb.hip.compile(src, "gfx90a", options, db=db, compiler=compiler)

    three = build("3.0")
    db.flush()
    assert build("7.0") != three


@needs_hipcc
@pytest.mark.parametrize("options", [["-F/d"], ["-iframework", "/d"], ["-iwithsysroot/d"],
                                     ["-Xclang", "-include", "-Xclang", "/d/pre.h"],
                                     ["-imacros", "/d/m.h"], ["-imacros/d/m.h"],
                                     ["-include-pch", "/d/pre.pch"]])
def test_search_options_kdb_does_not_follow_are_uncertain_and_passed_on_in_order(options,
                                                                                 cache_dir):
    """``-Xclang -include -Xclang f.h`` was read as kdb's own ``-include``: the command
    said ``-Xclang f.h -include -Xclang`` and the build failed."""
    req = hip_keys.request(SRC, "gfx90a", ["-DSCALE=2.0f", *options], ())
    assert req.uncertain and "may change where headers are found" in req.uncertain
    assert req.options == ("-DSCALE=2.0f", *options) and req.include_args == ()


@needs_hipcc
def test_idirafter_is_handed_on_as_idirafter(cache_dir):
    """Searched after the system directories, not before them as ``-isystem`` is."""
    req = hip_keys.request(SRC, "gfx90a", ["-idirafter", "/a", "--include-directory-after=/b"],
                           ())
    assert req.include_args == ("-idirafter", "/a", "-idirafter", "/b")


@needs_hipcc
@pytest.mark.parametrize("option", ["--hip-device-lib=my.bc", "--hip-device-lib-path=/bc",
                                    "-fprofile-instr-use=p.profdata", "-Wl,--script=x.ld"])
def test_options_that_read_files_other_than_headers_make_the_build_uncertain(option,
                                                                           cache_dir):
    """A bitcode library named by ``--hip-device-lib=`` was keyed by the option only: an
    edited library was served the code object built with the one before."""
    req = hip_keys.request(SRC, "gfx90a", ["-DSCALE=2.0f", option], ())
    assert req.uncertain and "read files kdb would key by name only" in req.uncertain


@needs_hipcc
def test_hipccs_variables_enter_the_key(cache_dir, monkeypatch):
    base = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=1"])
    monkeypatch.setenv("HIPCC_COMPILE_FLAGS_APPEND", "-DEXTRA=1")
    appended = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=1"])
    assert appended.key != base.key
    assert ("HIPCC_COMPILE_FLAGS_APPEND", "-DEXTRA=1") in appended.environment


@needs_hipcc
def test_hipcc_is_probed_once_per_environment_as_environments_alternate(cache_dir,
                                                                         monkeypatch):
    """Processes that alternate between settings of hipcc's variables read the machine
    memo: a variable that adds options (two projects' HIPCC_COMPILE_FLAGS_APPEND) is in the
    key and never reaches the probes; one that reaches them (HIP_COMPILER) is probed once a
    setting."""
    probes = []
    real = hip_hipcc._probe

    def counted(*args):
        probes.append(os.environ.get("HIP_COMPILER"))
        return real(*args)

    monkeypatch.setattr(hip_hipcc, "_probe", counted)
    keys = {}
    for flags, compiler in [("-DA=1", None), ("-DB=1", None), ("-DA=1", "clang")] * 3:
        hip_hipcc._identities.clear()  # each pass as a new process
        monkeypatch.setenv("HIPCC_COMPILE_FLAGS_APPEND", flags)
        if compiler is None:
            monkeypatch.delenv("HIP_COMPILER", raising=False)
        else:
            monkeypatch.setenv("HIP_COMPILER", compiler)
        keys.setdefault((flags, compiler), set()).add(
            kdb.hip.attributes_for(SRC, "gfx90a").key)
    assert probes == [None, "clang"]
    assert all(len(k) == 1 for k in keys.values()) and len(set.union(*keys.values())) == 3


@needs_hipcc
def test_clangs_argument_edits_are_another_key(cache_dir, run_py):
    """clang's driver edits its own arguments by ``CCC_OVERRIDE_OPTIONS``: hipcc's clang
    built another code object with ``x-DSCALE=1 +-DSCALE=7``, and a process with it set was
    served the one built without it."""
    code = f"""
        import json, kdb.bookkeeping, kdb.hip
        co = kdb.hip.compile({SRC!r}, "gfx90a", ["-DSCALE=1"], compiler="hipcc")
        print(json.dumps({{"co": co.hex(), "compiles": len(kdb.bookkeeping.records())}}))
    """
    wait = {"KDB_STORE_AT_EXIT": "wait"}
    plain = json.loads(run_py(code, env=wait).stdout.splitlines()[-1])
    edited = json.loads(run_py(code, env={**wait, "CCC_OVERRIDE_OPTIONS": "x-DSCALE=1 +-DSCALE=7"}
                               ).stdout.splitlines()[-1])
    assert plain["compiles"] == 1 and edited["compiles"] == 1, (plain, edited)
    assert edited["co"] != plain["co"]


@needs_hipcc
def test_a_header_clangs_argument_edits_find_is_never_served_stale(cache_dir, tmp_path, run_py):
    """``CCC_OVERRIDE_OPTIONS="+-I<dir>"`` puts a directory on clang's search that no option
    names: hipcc's probe took it for one of clang's own, so the key held its header only
    through the compiler's identity, and an edit of the header was served the code object
    built before it. The probes leave the variable out: the build reads a file its key does
    not hold, so it is served, logged as not cached, and never stored."""
    inc = tmp_path / "edits"
    inc.mkdir()
    (inc / "scale.h").write_text("#define K 3.0f\n")
    code = f"""
        import json, kdb.hip
        co = kdb.hip.compile({HEADER_SRC!r}, "gfx90a", compiler="hipcc")
        print(json.dumps({{"co": co.hex()}}))
    """
    env = {"KDB_STORE_AT_EXIT": "wait", "CCC_OVERRIDE_OPTIONS": f"+-I{inc}"}
    first = json.loads(run_py(code, env=env).stdout.splitlines()[-1])["co"]
    (inc / "scale.h").write_text("#define K 7.0f\n")
    edited = run_py(code, env=env)
    assert "a file kdb's include model did not find" in edited.stderr, edited.stderr
    plain = run_py(code, env={**env, "KDB_DISABLE_CACHE": "1"}).stdout.splitlines()[-1]
    assert json.loads(edited.stdout.splitlines()[-1])["co"] == json.loads(plain)["co"] != first
    assert not list((cache_dir / "v1").glob("*.kdb")) or all(
        not sqlite3.connect(f).execute("SELECT count(*) FROM kernels").fetchone()[0]
        for f in (cache_dir / "v1").glob("*.kdb"))
    log = subprocess.run([str(Path(sys.executable).with_name("kdb")), "log", "--json"],
                         capture_output=True, text=True, timeout=120).stdout
    assert "not cached: hipcc read" in log, log


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


@pytest.mark.parametrize("option, says", [
    ("--offload-arch=gfx1030", "pass arch="),
    ("--amdgpu-target=gfx90a", "pass arch="),
    ("-o", "leave it out"),
    ("--genco", "leave it out"),
    ("-MD", "list of the headers"),
])
def test_an_option_kdb_sets_says_what_to_do_instead(option, says):
    """``-o`` was told to "pass arch=" (the one message for every option kdb sets)."""
    from kdb.backends.hip.keys import split_options
    with pytest.raises(InvalidArgumentError, match="set by kdb|headers") as info:
        split_options(["-DN=1", option])
    assert says in str(info.value)
    if says != "pass arch=":
        assert "arch=" not in str(info.value)


@needs_hipcc
def test_bad_options_and_sources_are_clear_errors(db):
    with pytest.raises(InvalidArgumentError, match="set by kdb"):
        kdb.hip.compile(SRC, "gfx90a", ["--offload-arch=gfx1030"], db=db)
    with pytest.raises(CompileError, match="hipcc failed") as info:
        kdb.hip.compile("__global__ void f() { nonsense }", "gfx90a", db=db)
    assert "nonsense" in info.value.log
    assert info.value.command[0] == HIPCC and "--offload-arch=gfx90a" in info.value.command


@needs_hipcc
def test_a_hipcc_that_cannot_run_any_more_is_a_clear_error(db, counting_hipcc):
    """hipcc known to this process (its identity probed), then replaced by a file that
    cannot be executed: the build names it and what to do, a BackendUnavailableError, not
    the OSError."""
    wrapper, _ = counting_hipcc
    kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=5.0f"], db=db, hipcc=wrapper)
    st = wrapper.stat()  # the same size and time (its identity still holds), not a program
    wrapper.write_bytes(b"\0" * st.st_size)
    os.utime(wrapper, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(BackendUnavailableError, match=f"cannot run {wrapper}.*working hipcc"):
        kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=6.0f"], db=db, hipcc=wrapper)


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


# -- KDB_HIPCC and KDB_HIPRTC --------------------------------------------------------------------

@needs_hipcc
def test_kdb_hipcc_names_the_hipcc_that_runs_and_the_key_is_its_own(db, counting_hipcc,
                                                                    monkeypatch):
    wrapper, log = counting_hipcc
    base = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=6.0f"])  # the hipcc on PATH
    monkeypatch.setenv("KDB_HIPCC", str(wrapper))
    monkeypatch.setenv("ROCM_PATH", os.path.dirname(os.path.dirname(HIPCC)))  # has bin/hipcc
    assert hip_hipcc.locate_hipcc() == (str(wrapper), "KDB_HIPCC")  # before ROCM_PATH, PATH
    assert hip_hipcc.locate_hipcc(HIPCC) == (HIPCC, "argument")  # hipcc= before it
    kind, ident, _ = kdb.hip.find_compiler()
    assert kind == "hipcc" and ident.path == str(wrapper)
    co = kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=6.0f"], db=db)
    assert _compiles(log) == 1 and kdb.hip.code_object_target(co) == "gfx90a"
    # The wrapper is a compiler of its own: its content is in the key, the variable is not.
    monkeypatch.delenv("ROCM_PATH")
    attrs = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=6.0f"])
    assert attrs.key != base.key and attrs.environment == base.environment
    assert dict(attrs.compiler)["hipcc_id"] != dict(base.compiler)["hipcc_id"]
    assert dict(attrs.compiler)["hipcc_version"] == dict(base.compiler)["hipcc_version"]


def _linked_hipcc(where: Path, script: str | None = None) -> Path:
    """``where/hipcc``, a link to the real hipcc, beside the hipcc.pl it runs (Debian's hipcc
    runs the one in the directory it was run from): a link to the real one, or ``script``."""
    real = Path(os.path.realpath(HIPCC)).parent
    where.mkdir()
    (where / "hipcc").symlink_to(real / "hipcc")
    if script is None:
        (where / "hipcc.pl").symlink_to(real / "hipcc.pl")
    else:
        (where / "hipcc.pl").write_text(script)
        (where / "hipvars.pm").symlink_to(real / "hipvars.pm")  # beside the real hipcc.pl
    return where / "hipcc"


@needs_hipcc
def test_kdb_hipcc_naming_a_link_keys_the_hipcc_it_runs(cache_dir, tmp_path, monkeypatch):
    if not os.path.isfile(os.path.join(os.path.dirname(os.path.realpath(HIPCC)), "hipcc.pl")):
        pytest.skip("this hipcc is not ROCm 5's script beside its hipcc.pl")
    # A hipcc.pl that is not a link derives its ROCm from its own directory: pin the real one.
    said = hip_hipcc._run([HIPCC, "--offload-arch=gfx900", "--version"],
                          env={"HIPCC_VERBOSE": "3"}).stdout.decode()
    for var in ("HIP_PATH", "ROCM_PATH", "HIP_CLANG_PATH"):
        monkeypatch.setenv(var, re.search(rf"^{var}=(.*)$", said, re.MULTILINE).group(1))
    base = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=2.0f"])
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # KDB_HIPCC comes before ROCM_PATH
    same = _linked_hipcc(tmp_path / "same")
    monkeypatch.setenv("KDB_HIPCC", str(same))
    kind, ident, _ = kdb.hip.find_compiler()
    assert kind == "hipcc" and ident.path == str(same)
    assert kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=2.0f"]).key == base.key
    # A link to the same hipcc beside another hipcc.pl runs that one: another compiler, though
    # the machine's memo of identities is kept per real path (the link's and hipcc's are one).
    script = Path(os.path.realpath(HIPCC)).with_name("hipcc.pl").read_text()
    other = _linked_hipcc(tmp_path / "other", script + "\n# edited\n")
    monkeypatch.setenv("KDB_HIPCC", str(other))
    edited = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=2.0f"])
    assert edited.key != base.key
    assert dict(edited.compiler)["hipcc.pl_id"] != dict(base.compiler)["hipcc.pl_id"]
    monkeypatch.setenv("KDB_HIPCC", str(same))
    assert kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=2.0f"]).key == base.key


@pytest.mark.parametrize("what", ["missing", "not executable", "a directory"])
def test_kdb_hipcc_naming_no_hipcc_is_a_clear_error_not_a_fallback(cache_dir, tmp_path,
                                                                   monkeypatch, what):
    target = tmp_path / "hipcc"
    if what == "not executable":
        target.write_text("#!/bin/sh\n")
        target.chmod(0o644)
    elif what == "a directory":
        target.mkdir()
    monkeypatch.setenv("KDB_HIPCC", str(target))
    with pytest.raises(BackendUnavailableError) as info:
        hip_hipcc.find_hipcc()
    said = str(info.value)
    assert f"KDB_HIPCC={str(target)!r} is not an executable file" in said
    assert "point it at hipcc" in said and "unset it" in said
    # compiler=None raises too: no quiet HIPRTC, no stored build from another compiler.
    for call in (lambda: kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=1"]),
                 lambda: kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=1"]),
                 lambda: kdb.hip.compile(SRC, "gfx90a", ["-DSCALE=1"], compiler="hipcc")):
        with pytest.raises(BackendUnavailableError, match="KDB_HIPCC"):
            call()


@needs_hipcc
def test_kdb_hipcc_may_name_a_command_on_path_and_is_never_in_the_key(cache_dir, monkeypatch):
    monkeypatch.setenv("KDB_HIPCC", "hipcc")
    assert hip_hipcc.locate_hipcc() == (HIPCC, "KDB_HIPCC")
    attrs = kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=1"])
    assert "KDB_HIPCC" not in dict(attrs.environment)
    monkeypatch.delenv("KDB_HIPCC")
    assert kdb.hip.attributes_for(SRC, "gfx90a", ["-DSCALE=1"]).key == attrs.key


def test_a_missing_toolchain_names_the_variables_too(cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    with pytest.raises(BackendUnavailableError) as info:
        hip_hipcc.find_hipcc()
    assert "KDB_HIPCC is not set" in str(info.value)
    assert "set KDB_HIPCC=/path/to/hipcc" in str(info.value)


@needs_hiprtc
def test_kdb_hiprtc_names_the_library_that_compiles(db, tmp_path, monkeypatch):
    base = kdb.hip.attributes_for(SRC, "gfx1030", ["-DSCALE=3.0f"], compiler="hiprtc")
    link = tmp_path / "libhiprtc.so"
    link.symlink_to(os.path.realpath(HIPRTC))
    monkeypatch.setenv("KDB_HIPRTC", str(link))
    assert hip_hiprtc.locate_hiprtc() == (str(link), "KDB_HIPRTC")
    assert hip_hiprtc.locate_hiprtc(HIPRTC) == (HIPRTC, "argument")
    kind, ident, _ = kdb.hip.find_compiler("hiprtc")
    assert kind == "hiprtc" and ident.path == str(link)
    ran = []
    real_run = hip_hiprtc.run

    def spy(path, *args, **kw):
        ran.append(path)
        return real_run(path, *args, **kw)

    monkeypatch.setattr(hip_hiprtc, "run", spy)
    co = kdb.hip.compile(SRC, "gfx1030", ["-DSCALE=3.0f"], db=db, compiler="hiprtc")
    assert ran == [str(link)] and kdb.hip.code_object_target(co) == "gfx1030"
    # The same library by another name: the same compiler, the same key.
    again = kdb.hip.attributes_for(SRC, "gfx1030", ["-DSCALE=3.0f"], compiler="hiprtc")
    assert again.key == base.key
    # The HIP runtime that loads code objects is not chosen by KDB_HIPRTC.
    from kdb.backends.hip import loading

    monkeypatch.setenv("KDB_HIPRTC", str(tmp_path / "nowhere.so"))
    assert loading._library(None) == HIPRTC


@needs_hiprtc
def test_kdb_hiprtc_naming_a_file_that_is_not_hiprtc_is_a_clear_error(cache_dir, tmp_path,
                                                                      monkeypatch):
    bogus = tmp_path / "libhiprtc.so"
    bogus.write_text("not a library\n")
    monkeypatch.setenv("KDB_HIPRTC", str(bogus))
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no hipcc: HIPRTC is the choice
    monkeypatch.delenv("ROCM_PATH", raising=False)
    with pytest.raises(BackendUnavailableError, match="set KDB_HIPRTC=") as err:
        kdb.hip.compile(SRC, "gfx1030", ["-DSCALE=1"])
    # what the child said, not "(list index out of range)" and its traceback
    assert "OSError: " in str(err.value) and "index out of range" not in str(err.value)
    assert "Traceback" not in str(err.value)


@pytest.mark.parametrize("what", ["missing", "a directory"])
def test_kdb_hiprtc_naming_no_file_is_a_clear_error_not_a_fallback(cache_dir, tmp_path,
                                                                   monkeypatch, what):
    target = tmp_path / "libhiprtc.so"
    if what == "a directory":
        target.mkdir()
    monkeypatch.setenv("KDB_HIPRTC", str(target))
    with pytest.raises(BackendUnavailableError) as info:
        hip_hiprtc.find_hiprtc()
    said = str(info.value)
    assert f"KDB_HIPRTC={str(target)!r} is not a file" in said and "unset it" in said
    with pytest.raises(BackendUnavailableError, match="KDB_HIPRTC"):
        kdb.hip.compile(SRC, "gfx1030", ["-DSCALE=1"], compiler="hiprtc")
    # With no hipcc, compiler=None raises as well, rather than serve stored builds.
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    with pytest.raises(BackendUnavailableError, match="KDB_HIPRTC"):
        kdb.hip.compile(SRC, "gfx1030", ["-DSCALE=1"])


@needs_hipcc
@needs_hiprtc
def test_compiler_hiprtc_does_not_read_kdb_hipcc(cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("KDB_HIPCC", str(tmp_path / "nowhere"))
    kind, _, _ = kdb.hip.find_compiler("hiprtc")
    assert kind == "hiprtc"


# -- kdb info ---------------------------------------------------------------------------------

@needs_hipcc
@needs_hiprtc
def test_kdb_info_shows_hipcc_and_hiprtc_with_their_releases(cache_dir):
    from click.testing import CliRunner

    from kdb.cli import cli

    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    path, how = hip_hipcc.locate_hipcc()
    ident = kdb.hip.identity(path)
    release = ident.release
    assert f"hipcc:     {path} (from {how})\n             {release} (reads {ident.stdlib})\n" \
        in result.output
    assert ident.stdlib.startswith("libstdc++ ")  # the C++ library clang reads, in the key
    how = hip_hiprtc.locate_hiprtc()[1]
    assert f"hiprtc:    {HIPRTC} (from {how})\n             HIPRTC " in result.output
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


@needs_hipcc
def test_kdb_info_says_which_variable_chose_hipcc_or_names_none_that_works(
        cache_dir, counting_hipcc, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from kdb.cli import cli

    wrapper, _ = counting_hipcc
    monkeypatch.setenv("KDB_HIPCC", str(wrapper))
    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    assert f"hipcc:     {wrapper} (from KDB_HIPCC)\n" in result.output
    assert "compiles:  with hipcc (compiler=None)" in result.output
    data = json.loads(CliRunner().invoke(cli, ["info", "--json"]).output)
    assert data["hip"]["hipcc"]["found_by"] == "KDB_HIPCC"
    assert {"name": "KDB_HIPCC", "value": str(wrapper),
            "default": "$ROCM_PATH/bin/hipcc, else hipcc on PATH"} in data["settings"]
    monkeypatch.setenv("KDB_HIPCC", str(tmp_path / "nowhere"))
    result = CliRunner().invoke(cli, ["info"])
    assert result.exit_code == 0, result.output
    assert f"hipcc:     (unusable: KDB_HIPCC={str(tmp_path / 'nowhere')!r} is not an " \
        in result.output
    assert "compiles:  nothing: KDB_HIPCC names no working compiler" in result.output

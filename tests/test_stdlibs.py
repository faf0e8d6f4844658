"""The C and C++ libraries a compiler finds by default are part of its identity.

HIP's and CUDA's headers include ``<cmath>``, ``<cstddef>``: every device build reads
libstdc++'s and glibc's headers from the compiler's default directories, which kdb keys by
the compiler, not by content. clang (hipcc's, or nvcc's host compiler) reads the newest GCC
installation it finds, so installing another GCC changed every build's headers with no change
to clang, and kdb served the code objects built before (shown by hand with a GCC 13 tree
beside Debian's 12: hipcc built a code object with the new ``__GLIBCXX__``, kdb served the
old). The identity now holds the libraries' macros, and its machine memo is probed again
when their configuration headers or the directory of GCC installations change.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kdb.backends import stdlibs

GXX = shutil.which("g++")
HIPCC = shutil.which("hipcc")
NVCC = shutil.which("nvcc")


def _libstdcxx_of_gxx() -> str:
    """``__GLIBCXX__`` as g++ itself sees it: an answer kdb did not compute."""
    out = subprocess.run([GXX, "-dM", "-E", "-x", "c++", "-"], input="#include <cstddef>\n",
                         capture_output=True, text=True, check=True).stdout
    return re.search(r"#define __GLIBCXX__ (\d+)", out).group(1)


def test_the_label_names_each_library_and_the_digest_every_macro():
    a = stdlibs.identity("#define _GLIBCXX_RELEASE 12\n#define __GLIBCXX__ 20220819\n"
                         "#define __GLIBC__ 2\n#define __GLIBC_MINOR__ 36\n#define X 1\n")
    assert a.startswith("libstdc++ 12 20220819, glibc 2.36; macros sha256:")
    b = stdlibs.identity("#define _GLIBCXX_RELEASE 12\n#define __GLIBCXX__ 20220819\n"
                         "#define __GLIBC__ 2\n#define __GLIBC_MINOR__ 36\n#define X 2\n")
    assert a != b  # one configuration macro differs: another identity
    assert stdlibs.identity("#define _LIBCPP_VERSION 170000\n").startswith("libc++ 170000;")
    assert stdlibs.identity("").startswith("no C library found;")


def test_what_is_watched_is_the_configuration_and_the_gcc_installations(tmp_path):
    config = tmp_path / "inc" / "bits" / "c++config.h"
    features = tmp_path / "inc" / "features.h"
    other = tmp_path / "inc" / "cstddef"
    gcc = tmp_path / "lib" / "gcc" / "x86_64-linux-gnu" / "12"
    for p in (config, features, other):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    gcc.mkdir(parents=True)
    said = f"Found candidate GCC installation: {gcc}\nSelected GCC installation: {gcc}\n"
    assert stdlibs.watched([str(other), str(config), str(features)], said) == sorted(
        [str(config), str(features), str(gcc.parent)])


def _stamped(stamps: list[str], suffix: str) -> bool:
    return any(s.rsplit("|", 5)[0].endswith(suffix) for s in stamps)


@pytest.mark.skipif(HIPCC is None or GXX is None, reason="hipcc or g++ is not on PATH")
def test_hipccs_identity_holds_the_libstdcxx_its_clang_reads(tmp_path, monkeypatch):
    from kdb.backends.hip import hipcc

    monkeypatch.setattr(hipcc, "_identities", {})
    ident = hipcc.identity(hipcc.find_hipcc(), tmp_path)
    stdlib = dict(ident.compiler)["stdlib_id"]
    assert f" {_libstdcxx_of_gxx()}" in stdlib and "glibc" in stdlib, stdlib
    memo = tmp_path / "hipcc.json"
    [rec] = json.loads(memo.read_text()).values()
    assert _stamped(rec["stamps"], "/bits/c++config.h")
    assert _stamped(rec["stamps"], "/gcc/x86_64-linux-gnu") or not os.path.isdir(
        "/usr/lib/gcc/x86_64-linux-gnu")
    # Another GCC installed since the probe: that directory's stamp no longer holds, and the
    # remembered identity is probed again (here: the stamp made stale, the identity edited).
    rec["ids"]["stdlib"] = "from before"
    rec["stamps"] = [s if not s.rsplit("|", 5)[0].endswith("/bits/c++config.h")
                     else s.rsplit("|", 1)[0] + "|1" for s in rec["stamps"]]
    memo.write_text(json.dumps({k: rec for k in json.loads(memo.read_text())}))
    monkeypatch.setattr(hipcc, "_identities", {})
    assert dict(hipcc.identity(hipcc.find_hipcc(), tmp_path).compiler)["stdlib_id"] == stdlib


@pytest.mark.skipif(NVCC is None or GXX is None, reason="nvcc or g++ is not on PATH")
def test_nvccs_host_compiler_identity_holds_its_libraries(tmp_path, monkeypatch):
    from kdb.backends.cuda import hostcc

    monkeypatch.setattr(hostcc, "_identities", {})
    found = hostcc.identity("gcc", os.path.dirname(NVCC), str(tmp_path), tmp_path)
    assert f" {_libstdcxx_of_gxx()}" in found.stdlib and "glibc" in found.stdlib, found
    memo = tmp_path / "cxx.json"
    [rec] = json.loads(memo.read_text()).values()
    assert _stamped(rec["stamps"], "/bits/c++config.h") and _stamped(rec["stamps"], "/features.h")
    # A remembered probe from before the libraries were watched (no stamps), or from before
    # CCC_OVERRIDE_OPTIONS was left out (it could list a directory it added), is probed again.
    macros = rec["macros"]
    for older in ("stamps", "probe"):
        [rec] = json.loads(memo.read_text()).values()
        del rec[older]
        rec["macros"] = "from before"
        memo.write_text(json.dumps({k: rec for k in json.loads(memo.read_text())}))
        monkeypatch.setattr(hostcc, "_identities", {})
        again = hostcc.identity("gcc", os.path.dirname(NVCC), str(tmp_path), tmp_path)
        assert dict(again.pairs)["host_compiler_macros_sha256"] == macros, older


@pytest.mark.skipif(GXX is None, reason="g++ is not on PATH")
def test_inductors_compiler_identity_holds_its_libraries_and_no_path(cache_dir):
    """The compiler of Inductor's C++ modules, in their key: the same probe, remembered per
    machine, so a warm start runs no compiler to name it."""
    pytest.importorskip("torch", reason="torch is not installed (pip install 'kdb[torch]')")
    from kdb.backends.torch import targets

    targets.cxx_identity.cache_clear()
    named = targets.cxx_identity("g++")
    assert f" {_libstdcxx_of_gxx()}" in named and "glibc" in named, named
    assert "/" not in named.partition("macros")[0], named
    assert (cache_dir / "cxx.json").is_file()
    targets.cxx_identity.cache_clear()

"""Temporary include directories built from a copy named by their content
(kdb.backends.opencl.tempincludes): the options a build is given, and every case where a
copy would not be faithful, so the build runs as asked. Real files, no OpenCL (the builds
themselves: tests/test_early.py, tests/test_fault_matrix.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kdb.backends.opencl import tempincludes as ti

HEADERS = (("two.h", "d1"), ("sub>three.h", "d2"))


@pytest.fixture
def inc(tmp_path) -> Path:
    d = tmp_path / "inc"
    (d / "sub").mkdir(parents=True)
    (d / "two.h").write_text('#include "sub/three.h"\n')
    (d / "sub" / "three.h").write_text("#define THREE 3\n")
    return d


def test_each_spelling_of_the_directory_is_given_its_copy_and_the_rest_is_kept(inc, tmp_path):
    root = str(tmp_path / "copies")
    options = f"-DX=1 -I {inc} -I{inc} -isystem {inc} -I-  -cl-fast-relaxed-math".encode()
    got = ti.rewritten(options, [str(inc)], root, HEADERS, "__kernel void k() {}").decode()
    (copy,) = os.listdir(root)
    path = os.path.join(root, copy)
    assert got == f"-DX=1 -I {path} -I {path} -isystem {path} -I- -cl-fast-relaxed-math"
    assert (Path(path) / "sub" / "three.h").read_text() == "#define THREE 3\n"
    assert oct(os.stat(path).st_mode & 0o777) == "0o700"
    # The same files elsewhere: the same copy; another byte: another copy.
    other = tmp_path / "other"
    os.rename(inc, other)
    assert ti.rewritten(f"-I {other}".encode(), [str(other)], root, HEADERS, "") == \
        f"-I {path}".encode()
    (other / "two.h").write_text('#include "sub/three.h" \n')
    assert ti.rewritten(f"-I {other}".encode(), [str(other)], root, HEADERS, "") != \
        f"-I {path}".encode()
    assert len(os.listdir(root)) == 2


@pytest.mark.parametrize("case", ["link", "hard link", "fifo", "__FILE__ in a header",
                                  "__FILE__ in the source", "climbs out", "absolute include",
                                  "quoted option", "too many files", "too large", "missing"])
def test_a_copy_that_would_not_be_faithful_leaves_the_build_as_asked(case, inc, tmp_path):
    source, headers, options = "__kernel void k() {}", HEADERS, f"-I {inc}"
    if case == "link":
        (inc / "alias.h").symlink_to("two.h")
    elif case == "hard link":
        os.link(inc / "two.h", inc / "again.h")
    elif case == "fifo":
        os.mkfifo(inc / "pipe.h")
    elif case == "__FILE__ in a header":
        (inc / "where.h").write_text("#define WHERE __FILE__\n")
    elif case == "__FILE__ in the source":
        source = "__constant char w[] = __FILE__;\n" + source
    elif case == "climbs out":
        headers = (("two.h", "d1"), ("two.h>../up.h", "missing"))
    elif case == "absolute include":
        headers = (("/usr/include/x.h", "missing"),)
    elif case == "quoted option":
        options = f'-I "{inc}"'
    elif case == "too many files":
        for i in range(ti.MAX_FILES + 1):
            (inc / f"h{i}.h").write_text("")
    elif case == "too large":
        (inc / "big.h").write_bytes(b"/* */" * (ti.MAX_BYTES // 5 + 1))
    elif case == "missing":
        inc = tmp_path / "gone"
        options = f"-I {inc}"
    root = tmp_path / "copies"
    assert ti.rewritten(options.encode(), [str(inc)], str(root), headers, source) is None
    assert not root.exists() or not [p for p in root.iterdir() if not p.name.endswith(".tmp")]


def test_only_directories_below_a_temporary_directory_count(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "scratch"))
    (tmp_path / "scratch" / "t").mkdir(parents=True)
    ti._roots.clear()
    assert ti.temporary(str(tmp_path / "scratch" / "t"))
    assert ti.temporary("/tmp/x") and not ti.temporary("/tmp") and not ti.temporary("/usr/include")

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


def test_a_copy_another_process_just_made_is_kept_not_replaced(inc, tmp_path):
    """Processes that start together each find no copy and write one: the first rename
    wins, and a later writer keeps that copy (its builds may be reading it) instead of
    moving it aside; only a copy that is not intact is replaced."""
    root = str(tmp_path / "copies")
    files = ti.files_of(str(inc))
    target = os.path.join(root, ti.digest_of(files))
    ti._write(root, target, files)  # the first process
    first = os.stat(target).st_ino
    ti._write(root, target, files)  # the second, which looked before the first renamed
    assert os.stat(target).st_ino == first
    assert sorted(os.listdir(root)) == [os.path.basename(target)]
    (Path(target) / "two.h").write_text("changed\n")
    ti._write(root, target, files)  # a copy changed since: replaced
    assert os.stat(target).st_ino != first and ti._intact(target, files)


def test_processes_starting_together_share_one_intact_copy(inc, tmp_path):
    import multiprocessing as mp

    root = str(tmp_path / "copies")
    ctx = mp.get_context("fork")
    start, results = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_copy_in_step, args=(start, results, str(inc), root))
             for _ in range(6)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    assert len({path for path, _ in got}) == 1 and all(ok for _, ok in got), got
    assert len([p for p in os.listdir(root) if not p.endswith((".tmp", ".stale"))]) == 1


def _copy_in_step(start, results, top: str, root: str) -> None:
    start.wait()
    ti._checked.clear()
    path = ti.copy_of(top, root)
    results.put((path, path is not None and ti._intact(path, ti.files_of(top))))


def test_a_copy_made_first_leaves_the_cache_directories_private_whatever_the_umask(
        inc, tmp_path):
    """Under umask 002 (Debian's, Fedora's for a user) a first build whose include directory
    is copied made the cache root and ``v1`` group-writable on the way to ``includes``:
    kdb then refused its own cache for good (nothing stored, one warning a start)."""
    from kdb.file import fs

    cache = tmp_path / "cache"
    root = cache / "v1" / "includes"
    old = os.umask(0o002)
    try:
        assert ti.copy_of(str(inc), str(root)) is not None
    finally:
        os.umask(old)
    for d in (cache, cache / "v1", root):
        assert d.stat().st_mode & 0o777 == 0o700, d
    assert not fs.refused([cache, cache / "v1"], ("x", "y"))


def test_copies_are_bounded_least_recently_used_first_and_kdb_clear_removes_them(
        inc, tmp_path, monkeypatch):
    """Each edit of a header made another copy of its directory, and nothing removed them
    (the hunter: 23.5 MB of copies under a 300 KB cap, left by ``kdb clear``). Beyond
    ``MAX_COPIES`` the least recently used go when one is made, never one used in the last
    ten minutes; ``kdb clear`` removes them all."""
    import time

    from click.testing import CliRunner

    from kdb.cli import cli

    monkeypatch.setattr(ti, "MAX_COPIES", 3)
    user = tmp_path / "cache" / "v1"
    root = str(user / "includes")
    copies = []
    for k in range(6):
        (inc / "two.h").write_text(f'#include "sub/three.h" // edit {k}\n')
        copies.append(ti.copy_of(str(inc), root))
        if k < 4:
            old = time.time() - 3600 + k  # used an hour ago, in this order
            os.utime(copies[-1], (old, old))
    assert sorted(os.listdir(root)) == sorted(os.path.basename(c) for c in copies[3:])
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / "cache"))
    res = CliRunner().invoke(cli, ["clear", "--yes"])
    assert res.exit_code == 0, res.output
    assert not os.path.exists(root)

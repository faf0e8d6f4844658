"""Content digests: compiler-library identities (the ELF build ID when there is one, else the
content sha256) and headers' digests, never fooled by a file that kept its size and mtime."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from kdb.backends.digests import elf_build_id, file_digest, library_id


def test_build_id_matches_what_readelf_reports():
    exe = sys.executable
    build_id = elf_build_id(exe)
    if shutil.which("readelf"):
        notes = subprocess.run(["readelf", "-n", exe], capture_output=True, text=True).stdout
        m = re.search(r"Build ID: ([0-9a-f]+)", notes)
        assert build_id == (m.group(1) if m else None)


def test_non_elf_files_fall_back_to_the_content_digest(tmp_path):
    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"not an ELF file at all")
    assert elf_build_id(lib) is None
    assert library_id(lib, tmp_path / "memo") == "sha256:" + hashlib.sha256(
        lib.read_bytes()).hexdigest()
    truncated = tmp_path / "libcut.so"
    truncated.write_bytes(b"\x7fELF\x02\x01" + b"\x00" * 20)
    assert elf_build_id(truncated) is None
    assert elf_build_id(tmp_path / "absent.so") is None


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="chown to another user needs root")
@pytest.mark.parametrize("whose", ["another user's", "anyone's"])
def test_a_memo_someone_else_can_write_is_never_read_nor_written(tmp_path, whose, caplog):
    """The memo's digests and compiler identities enter kernels' keys: a planted one would
    key a kernel by another compiler's identity (issue 27)."""
    from kdb.backends.digests import machine_digest, machine_memo

    lib = tmp_path / "libcompiler.so"
    lib.write_bytes(b"the compiler's library")
    real = hashlib.sha256(lib.read_bytes()).hexdigest()
    memo = tmp_path / "cache"
    memo.mkdir(mode=0o700)
    st = os.stat(os.path.realpath(lib))
    tag = f"{os.path.realpath(lib)}|{st.st_size}|{st.st_mtime_ns}"
    (memo / "digests.json").write_text(json.dumps({tag: "0" * 64}))
    (memo / "nvcc.json").write_text(json.dumps({tag: {"version": "planted"}}))
    if whose == "anyone's":
        memo.chmod(0o777)
    else:
        for p in (memo, *memo.iterdir()):
            os.chown(p, 65534, 65534)
    planted = {p.name: p.read_bytes() for p in memo.iterdir()}
    assert machine_digest(lib, memo) == real
    assert machine_memo(memo, "nvcc", lib, lambda: {"version": "probed"}) == {"version": "probed"}
    assert {p.name: p.read_bytes() for p in memo.iterdir()} == planted  # nothing written there
    assert "is refused" in caplog.text and str(memo) in caplog.text


# -- a file replaced by one of the same size and mtime ------------------------------------

def _same_size_and_mtime(path, text: str, like) -> None:
    """Write ``text`` to ``path`` and give it ``like``'s mtime (as ``cp -p``, ``tar`` or
    ``rsync -t`` would)."""
    st = os.stat(like)
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def settled(monkeypatch):
    """Files count as settled (memoised) SETTLED_S after their last change, not 2 s."""
    from kdb.backends import digests

    monkeypatch.setattr(digests, "_SETTLED_S", 0.3)
    return lambda: time.sleep(0.4)


def test_a_header_rewritten_with_its_size_and_mtime_kept_is_digested_anew(tmp_path, settled):
    h = tmp_path / "h.h"
    h.write_text("#define K 2\n")
    settled()
    assert file_digest(h) == _sha(h)  # memoised: settled
    _same_size_and_mtime(h, "#define K 3\n", h)
    assert file_digest(h) == _sha(h)
    settled()
    assert file_digest(h) == _sha(h)  # memoised again, under its new stamp


def test_a_symlink_swapped_between_files_of_the_same_size_and_mtime_is_seen(tmp_path, settled):
    a, b, h = tmp_path / "a.h", tmp_path / "b.h", tmp_path / "h.h"
    a.write_text("#define K 2\n")
    _same_size_and_mtime(b, "#define K 3\n", a)
    h.symlink_to("a.h")
    settled()
    assert file_digest(h) == _sha(a)
    tmp = tmp_path / "h.tmp"
    tmp.symlink_to("b.h")
    os.replace(tmp, h)  # an atomic swap: the path never misses
    assert file_digest(h) == _sha(b)


def test_a_library_replaced_by_one_of_the_same_size_and_mtime_gets_its_own_identity(tmp_path):
    """The library memo outlives the process (``digests.json``): a library replaced in place
    (a package upgrade that keeps sizes and mtimes) must not keep the old identity."""
    memo = tmp_path / "memo"
    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"not an ELF file, version 1")
    first = library_id(lib, memo)
    new = tmp_path / "libfake.so.new"
    _same_size_and_mtime(new, "not an ELF file, version 2", lib)
    os.replace(new, lib)
    assert library_id(lib, memo) == "sha256:" + _sha(lib) != first
    assert len(json.loads((memo / "digests.json").read_text())) == 1  # the stale one went


@pytest.mark.parametrize("how", ["replaced", "rewritten in place"])
def test_a_file_a_memo_depends_on_no_longer_holds_once_changed_with_size_and_mtime_kept(
        tmp_path, how):
    """The stamps a compiler's identity is remembered with (its device libraries, the C++
    library's configuration): a device library overwritten by its same-size twin with the
    old mtime kept the identity, and the code object built with the old one was served."""
    from kdb.backends.digests import file_stamp, stamps_hold

    lib = tmp_path / "oclc_finite_only_off.bc"
    lib.write_bytes(b"finite only: off")
    stamps = [file_stamp(str(lib))]
    assert stamps_hold(stamps)
    if how == "replaced":
        new = tmp_path / "twin"
        _same_size_and_mtime(new, "finite only: on!", lib)
        os.replace(new, lib)
    else:
        st = lib.stat()
        lib.write_bytes(b"finite only: on!")
        os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not stamps_hold(stamps)


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_machine_memo_keeps_a_value_per_variant_of_each_version_of_a_file(tmp_path):
    """One value per version of a file (a value ``valid`` rejects is computed again);
    variants (the environments a compiler was probed in) alternate without a recompute; a
    new version of the file drops them all; a file keeps a bounded number of them."""
    from kdb.backends import digests

    target = tmp_path / "tool"
    target.write_text("a")
    calls = []

    def compute():
        calls.append(1)
        return {"n": len(calls)}

    assert digests.machine_memo(tmp_path, "m", target, compute) == {"n": 1}
    assert digests.machine_memo(tmp_path, "m", target, compute) == {"n": 1}
    assert digests.machine_memo(tmp_path, "m", target, compute, valid=lambda v: False) == {"n": 2}
    for variant in ("aa", "bb", "aa", "bb", ""):
        digests.machine_memo(tmp_path, "m", target, compute, variant=variant)
    assert len(calls) == 4
    target.write_text("bb")
    assert digests.machine_memo(tmp_path, "m", target, compute, variant="aa") == {"n": 5}
    assert len(json.loads((tmp_path / "m.json").read_text())) == 1
    for i in range(3 * digests._VARIANTS):
        digests.machine_memo(tmp_path, "m", target, compute, variant=f"{i:x}")
    kept = json.loads((tmp_path / "m.json").read_text())
    assert len(kept) == digests._VARIANTS
    assert all(digests._tag_path(k) == os.path.realpath(target) for k in kept)

"""Compiler-library identities: the ELF build ID when there is one, else the content sha256."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from kdb.backends.digests import elf_build_id, library_id


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

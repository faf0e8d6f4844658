"""Compiler-library identities: the ELF build ID when there is one, else the content sha256."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys

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

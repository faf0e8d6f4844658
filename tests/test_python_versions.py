"""tools/python_versions.py finds the interpreters it runs the suite under: those given and
those on PATH, each by the version it reports, one that does not run left out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import python_versions  # noqa: E402 - a tool of this repository, not a package

sys.path.pop(0)


def test_an_interpreter_is_known_by_the_version_it_reports_and_a_broken_one_is_left_out(
        tmp_path, monkeypatch):
    mine = "%d.%d" % sys.version_info[:2]
    shim = tmp_path / f"python{mine}"  # a pyenv shim of a version not selected: exits 127
    shim.write_text("#!/bin/sh\nexit 127\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert python_versions.interpreters(None, []) == {}
    found = python_versions.interpreters(None, [str(shim), sys.executable])
    assert found == {mine: sys.executable}
    assert python_versions.interpreters(["3.9"], [sys.executable]) == {}

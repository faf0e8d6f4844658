"""The examples in kdb's docstrings run and hold."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["kdb", "kdb.keys", "kdb.config", "kdb.includes", "kdb.fs", "kdb.wheel", "kdb.pack",
           "kdb.fallback", "kdb.tally", "kdb.run", "_kdb_auto", "kdb.backends.common",
           "kdb.backends.opencl", "kdb.backends.cuda"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    if name == "kdb.backends.opencl":
        pytest.importorskip("pyopencl")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True, verbose=False)
    assert result.attempted > 0, f"{name} has no doctests"
    assert result.failed == 0

"""The examples in kdb's docstrings run and hold: every module of the package is searched,
so a module that gains an example is tested without being listed here."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import kdb

#: Modules whose examples cannot run here, and why, by name prefix.
SKIP = {"kdb.migrations": "alembic's scripts (a wheel ships them inside kdb) run only under "
                          "alembic, which sets up their context"}

#: Optional imports a module may need; without them its examples are skipped, saying so.
OPTIONAL = ("pyopencl",)


def _modules() -> list[str]:
    names = ["_kdb_auto"]
    # onerror: a package that fails to import is reported by its own test below.
    for info in pkgutil.walk_packages(kdb.__path__, prefix="kdb.", onerror=lambda name: None):
        names.append(info.name)
    return sorted(names)


MODULES = _modules()


def test_the_walk_finds_the_modules_that_used_to_be_missed():
    """The hand-written list this replaced left out store, discovery and demo."""
    assert {"kdb.file.kernelfile", "kdb.file.discovery", "kdb.demo.runs", "kdb.backends.opencl",
            "kdb.backends.cuda.keys", "_kdb_auto"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    for prefix, why in SKIP.items():
        if name == prefix or name.startswith(prefix + "."):
            pytest.skip(why)
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        if err.name not in OPTIONAL:
            raise
        pytest.skip(f"{name} needs {err.name}, which is not installed")
    except kdb.BackendUnavailableError as err:  # kdb.opencl says so itself
        pytest.skip(f"{name}: {err}")
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(module) if t.examples]
    if not tests:
        pytest.skip(f"{name} has no examples")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed (output above)"

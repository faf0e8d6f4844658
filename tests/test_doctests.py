"""The examples in kdb's docstrings run and hold: every module of the distribution whose
source holds an example is collected (found by reading the files, not by importing them), so
a module that gains an example is tested without being listed here, and a module without
one adds no skip to ``make test``'s count."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

import _kdb_auto
import kdb

#: Modules whose examples cannot run here, and why, by name prefix.
SKIP = {"kdb.migrations": "alembic's scripts (a wheel ships them inside kdb) run only under "
                          "alembic, which sets up their context"}

#: Optional imports a module may need; without them its examples are skipped, saying so.
OPTIONAL = ("pyopencl",)


#: An interactive example in a docstring: a line that starts with the prompt.
EXAMPLE = re.compile(r"^\s*>>> ", re.MULTILINE)


def _modules() -> list[str]:
    """The modules of the distribution (the package's files and the start-up hook) whose
    source holds an example, by name."""
    files = {"_kdb_auto": Path(_kdb_auto.__file__)}
    for root in map(Path, kdb.__path__):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root.parent).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return sorted(n for n, p in files.items() if EXAMPLE.search(p.read_text(encoding="utf-8")))


MODULES = _modules()


def test_the_walk_finds_the_modules_with_examples_and_only_those():
    """The hand-written list this replaced left out store, discovery and demo; the walk that
    imported every module reported one skip per module without an example."""
    assert {"kdb.config", "kdb.file.discovery", "kdb.demo.programs", "kdb.backends.opencl.keys",
            "kdb.backends.cuda.keys", "_kdb_auto"} <= set(MODULES)
    assert "kdb.file.kernelfile" not in MODULES and "kdb.tiers" not in MODULES  # none there


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
    assert tests, f"{name}'s example is where doctest does not look: put it in a docstring"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed (output above)"

"""A pytest plugin, off unless asked: ``pytest --kdb`` (or ``-p kdb.pytest``).

Switches kdb on for the test session and every process it starts (``KDB_AUTO=1``, see
:mod:`kdb.adopt.auto`) and adds one line to pytest's terminal summary: kernels compiled, served,
seconds saved, over the session's process and its subprocesses. A CI pipeline that caches
one directory (``--kdb-cache-dir``, else ``KDB_CACHE_DIR``) keeps its kernels between runs.

Loaded through the ``pytest11`` entry point in every session, so that ``--kdb`` exists; until
it is asked for, it only adds its options.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

PLUGIN_NAME = "kdb.pytest"  # the documented name: -p kdb.pytest, and the pytest11 entry point
_state: dict[str, Any] = {}


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("kdb", "kdb kernel database")
    group.addoption("--kdb", action="store_true", default=False,
                    help="Serve the session's OpenCL and CUDA kernels from kdb, in the "
                         "session and its subprocesses (KDB_AUTO=1); summary at the end.")
    group.addoption("--kdb-cache-dir", default=None, metavar="DIR",
                    help="kdb's user tier root for the session (default: KDB_CACHE_DIR, "
                         "else the user's cache directory).")


def _asked(config: Any) -> bool:
    if config.getoption("kdb", False):
        return True
    return PLUGIN_NAME in (config.getoption("plugins", None) or [])  # -p kdb.pytest


def pytest_configure(config: Any) -> None:
    if not _asked(config) or hasattr(config, "workerinput"):
        # An xdist worker inherits KDB_AUTO and the report directory from the controller.
        return
    from . import auto
    from .. import config as settings

    report_dir = os.environ.get(settings.ENV_RUN_REPORT)
    if report_dir and Path(report_dir).is_dir():  # under `kdb run`: report there as well
        own = None
        before = {p.name for p in Path(report_dir).glob("*.json")}
    else:
        report_dir = own = tempfile.mkdtemp(prefix="kdb-pytest-")
        before = set()
    cache_dir = config.getoption("kdb_cache_dir", None)
    if cache_dir is not None:  # a test that changes directory would make another cache of it
        cache_dir = os.path.abspath(cache_dir)
    saved_env = {k: os.environ.get(k) for k in (settings.ENV_AUTO, settings.ENV_RUN_REPORT,
                                                settings.ENV_CACHE_DIR)}
    _state.update(report_dir=report_dir, own=own, before=before, env=saved_env)
    auto.switch_on(cache_dir=cache_dir, report_dir=report_dir)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if "report_dir" not in _state:
        return
    from . import tally

    # This process reports at its exit, after this line: its counts are added live.
    s = tally.read_reports(_state["report_dir"], skip=_state["before"], plus=tally.counts(),
                           plus_warnings=tally.warnings())
    terminalreporter.write_line(f"kdb: {tally.describe(s)}")
    for text, processes in s["warnings"]:  # pytest kept a passing test's to itself
        terminalreporter.write_line(f"kdb: warned ({processes} process"
                                    f"{'es' if processes != 1 else ''}): "
                                    f"{text.removeprefix('kdb: ')}")


def pytest_unconfigure(config: Any) -> None:
    if "report_dir" not in _state:
        return
    for k, v in _state["env"].items():  # the session's processes are done: put it back
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if _state["own"]:
        shutil.rmtree(_state["own"], ignore_errors=True)
    _state.clear()

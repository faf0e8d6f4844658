"""``pytest -p kdb.pytest`` and the ``pytest11`` entry point: the plugin lives in
:mod:`kdb.adopt.pytest`."""

from kdb.adopt.pytest import (  # noqa: F401 - pytest reads the hooks here
    pytest_addoption,
    pytest_configure,
    pytest_terminal_summary,
    pytest_unconfigure,
)

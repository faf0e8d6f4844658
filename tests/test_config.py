"""kdb.config's one table of settings (:data:`kdb.config.SETTINGS`): docs/configuration.md
writes it out, and the readers, the command line's check (``problems``), the program's early
check (``check_settings``) and ``kdb info`` all take their variables from it."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

import kdb
from kdb import config
from kdb.admin.info import settings as info_settings

PAGE = Path(kdb.__file__).resolve().parent.parent / "docs" / "configuration.md"
PARSED = [r for r in config.SETTINGS.values() if r.parse is not None]
FALLING_BACK = [r for r in PARSED if r.fallback is not config.CHECKED_WHERE_USED]
#: A value no parsed setting accepts: not a boolean, a duration, a size, a store mode or a name.
BOGUS = "Bogus-Value"


def page_rows() -> list[list[str]]:
    """The cells of the page's settings table, backticks removed."""
    rows = []
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `"):
            rows.append([c.strip().replace("`", "") for c in line.strip().strip("|").split("|")])
    return rows


def test_the_page_is_the_table_written_out():
    rows = page_rows()
    assert [r[0] for r in rows] == list(config.SETTINGS)  # every variable, in its order
    for name, _meaning, default, bad in rows:
        row = config.SETTINGS[name]
        assert default.startswith(row.shown), (name, default, row.shown)
        assert bad == (row.bad or "—"), (name, bad, row.bad)


def test_every_variable_kdb_names_is_in_the_table():
    named = {v for k, v in vars(config).items() if k.startswith("ENV_")}
    assert named <= set(config.SETTINGS)


@pytest.mark.parametrize("row", PARSED, ids=lambda r: r.name)
def test_the_command_line_refuses_a_bad_value_of_every_parsed_setting(row):
    [problem] = config.problems({row.name: BOGUS})
    assert row.name in problem and BOGUS in problem
    assert config.problems({row.name: "  "}) == []  # blank: the default


def test_text_settings_are_never_refused_here():
    texts = [r.name for r in config.SETTINGS.values() if r.parse is None]
    assert config.problems({name: BOGUS for name in texts}) == []


@pytest.mark.parametrize("row", FALLING_BACK, ids=lambda r: r.name)
def test_a_bad_value_reads_as_the_rows_fallback_with_one_warning(row, monkeypatch, caplog):
    monkeypatch.setenv(row.name, BOGUS)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert config.read(row.name) == row.fallback
        assert config.read(row.name) == row.fallback
    [note] = [r.getMessage() for r in caplog.records]
    assert row.name in note and repr(BOGUS) in note and f"using {row.bad} instead" in note
    monkeypatch.delenv(row.name)
    assert config.read(row.name) == row.default


def test_a_name_checked_where_it_is_used_reads_as_written(monkeypatch):
    monkeypatch.setenv(config.ENV_SHARED_NAMESPACE, f" {BOGUS} ")
    assert config.shared_namespace() == BOGUS  # the shared tier refuses it and turns off


def test_check_settings_warns_of_every_setting_that_falls_back(monkeypatch, caplog):
    for row in FALLING_BACK:
        monkeypatch.setenv(row.name, BOGUS)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        config.check_settings()
    warned = {name for r in caplog.records for name in config.SETTINGS
              if re.search(rf"\b{name}\b", r.getMessage())}
    assert warned == {r.name for r in FALLING_BACK}


def test_kdb_info_lists_every_setting_with_its_value_and_default(monkeypatch):
    monkeypatch.setenv(config.ENV_WAIT_TIMEOUT, "5")
    monkeypatch.delenv(config.ENV_TRACE, raising=False)
    got = {r["name"]: r for r in info_settings()}
    assert list(got) == list(config.SETTINGS)
    assert got[config.ENV_WAIT_TIMEOUT] == {"name": "KDB_WAIT_TIMEOUT", "value": "5",
                                            "default": "60"}
    assert got[config.ENV_TRACE]["value"] is None


def test_kdb_info_never_shows_the_shared_tiers_password(monkeypatch):
    pytest.importorskip("sqlalchemy")
    monkeypatch.setenv(config.ENV_SHARED_URL, "postgresql+psycopg://kdb:s3cret-pw@db:5432/kdb")
    [url] = [r["value"] for r in info_settings() if r["name"] == config.ENV_SHARED_URL]
    assert url == "postgresql+psycopg://kdb:***@db:5432/kdb"


@pytest.mark.parametrize("extra", [0, 400], ids=["small environment", "large environment"])
def test_read_variables_reads_what_os_environ_holds(monkeypatch, extra):
    """Both ways of reading (one pass over a small environment's names, or a lookup per name
    where the environment is large) give what os.environ.get gives, empty values included."""
    from kdb.backends.opencl.keys import BUILD_VARIABLES

    for i in range(extra):
        monkeypatch.setenv(f"KDB_TEST_FILLER_{i}", "x")
    monkeypatch.setenv("POCL_WORK_GROUP_METHOD", "loopvec")
    monkeypatch.setenv("PYOPENCL_BUILD_OPTIONS", "")
    monkeypatch.delenv("KDB_CACHE_DIR", raising=False)
    got = config.read_variables(BUILD_VARIABLES)
    assert list(got) == list(BUILD_VARIABLES)
    assert got == {n: os.environ.get(n) for n in BUILD_VARIABLES}
    assert got["POCL_WORK_GROUP_METHOD"] == "loopvec" and got["PYOPENCL_BUILD_OPTIONS"] == ""
    assert got["KDB_CACHE_DIR"] is None

"""kdb.strpaths spells paths as pathlib does (the hit path keeps str paths and hands out
``Path(...)`` of them, so both must name the same file and print the same)."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

from kdb import config, strpaths

PIECES = ["a", "/", ".", "..", "~", "~root", "~no-such-user-kdb"]
SAMPLES = ["".join(p) for n in range(1, 5) for p in itertools.product(PIECES, repeat=n)]


def _outcome(fn, arg):
    try:
        return fn(arg)
    except Exception as err:  # noqa: BLE001 - the kind of failure must match too
        return type(err)


@pytest.mark.skipif(sys.platform == "win32", reason="Windows paths are spelled by pathlib")
def test_strpaths_spell_as_pathlib_does():
    for s in SAMPLES:
        assert strpaths.spelled(s) == str(Path(s)), s
        assert _outcome(strpaths.expanded, s) == _outcome(lambda x: str(Path(x).expanduser()), s)
        assert strpaths.parent(strpaths.spelled(s)) == str(Path(s).parent), s
        assert strpaths.join(strpaths.spelled(s), "v1") == str(Path(s) / "v1"), s


def test_the_str_settings_are_the_path_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path) + "//./cache/")
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", os.pathsep.join(["~/a/", "", str(tmp_path)]))
    assert config.cache_root() == Path(config.cache_root_str()) == tmp_path / "cache"
    assert str(config.user_dir()) == config.user_dir_str() == str(tmp_path / "cache" / "v1")
    assert [str(d) for d in config.system_dirs()] == config.system_dirs_str() == [
        str(Path("~/a").expanduser()), str(tmp_path)]
    monkeypatch.delenv("KDB_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", ".")
    assert config.cache_root_str() == os.path.join(os.getcwd(), "kdb") == str(config.cache_root())


def test_exists_and_is_file_answer_as_pathlib_does(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    for p in [tmp_path / "f", tmp_path, tmp_path / "none", tmp_path / "f" / "under-a-file"]:
        assert strpaths.exists(str(p)) == p.exists(), p
        assert strpaths.is_file(str(p)) == p.is_file(), p


def test_make_private_dir_creates_the_missing_parents_private(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    strpaths.make_private_dir(str(target) + "/")
    for d in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert d.is_dir() and d.stat().st_mode & 0o777 == 0o700, d
    assert config.private_dir(target) == target  # there already: nothing to do

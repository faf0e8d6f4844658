"""kdb.dirs: private directories; kdb.config: the cache's paths, absolute and tidied."""

from __future__ import annotations

import os
from pathlib import Path

from kdb import config, dirs


def test_make_private_dir_creates_the_missing_parents_private(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    assert dirs.make_private_dir(str(target) + "/") == target
    for d in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert d.is_dir() and d.stat().st_mode & 0o777 == 0o700, d
    assert config.private_dir(target) == target  # there already: nothing to do


def test_the_cache_paths_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path) + "//./cache/")
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", os.pathsep.join(["~/a/", "", str(tmp_path)]))
    assert config.cache_root() == tmp_path / "cache"
    assert config.user_dir() == tmp_path / "cache" / "v1"
    assert config.system_dirs() == [Path("~/a").expanduser(), tmp_path]
    monkeypatch.delenv("KDB_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", ".")
    assert config.cache_root() == Path(os.getcwd(), "kdb")  # absolute: the worker runs in /

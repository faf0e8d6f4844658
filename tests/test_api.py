"""The public surface is what docs/api.md documents: KernelDB offers exactly the members its
table lists, and the interface back ends use (``KernelDB.tiers``) has every member the page
names. A member added or removed without the page fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kdb
from kdb.tiers import Tiers

API_PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def documented_members() -> set[str]:
    section = API_PAGE.read_text(encoding="utf-8").split("## `kdb.KernelDB`", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `KernelDB\.(\w+)", section, flags=re.M))


def test_kernel_db_offers_exactly_what_the_api_page_documents(cache_dir):
    db = kdb.KernelDB()
    public = {n for n in dir(db) if not n.startswith("_")}
    assert public == documented_members()


def test_every_public_member_says_what_it_does():
    for name in documented_members() - {"tiers"}:
        assert getattr(kdb.KernelDB, name).__doc__, name


def test_the_back_end_interface_has_every_member_the_page_names():
    """``db.tiers``' members, then those of the store side it holds (``db.tiers.storing``)."""
    from kdb.storing.stores import Storing

    section = API_PAGE.read_text(encoding="utf-8").split("## For back ends", 1)[1]
    policy, store_side = section.split("`db.tiers.storing`", 1)
    for text, cls in ((policy, Tiers), (store_side, Storing)):
        named = set(re.findall(r"`(\w+)(?:\(\w*\))?`", text)) - {"HashAttributes", "db",
                                                                     "recheck", "Tiers"}
        named -= {"get_or_compile"} if cls is Storing else set()  # "like get_or_compile"
        assert named and all(callable(getattr(cls, n, None)) for n in named), \
            (cls.__name__, sorted(n for n in named if not callable(getattr(cls, n, None))))


def test_internals_are_not_reachable_through_kernel_db(cache_dir):
    db = kdb.KernelDB()
    for name in ("claim_or_wait", "record_compile", "user_file", "system_files"):
        assert not hasattr(db, name), name
        assert callable(getattr(db.tiers, name)), name
    for name in ("spool", "store", "can_store", "write_bookkeeping", "put_later", "discard"):
        assert not hasattr(db, name) and not hasattr(db.tiers, name), name
        assert callable(getattr(db.tiers.storing, name)), name
    with pytest.raises(AttributeError):
        db.anything_else = 1  # a fixed surface: no attribute added by accident


def test_the_errors_the_page_lists_are_kdbs():
    text = API_PAGE.read_text(encoding="utf-8").split("## Errors", 1)[1].split("\n## ", 1)[0]
    names = set(re.findall(r"`(?:kdb\.)?(\w+Error)`", text))
    assert names == {n for n in kdb.__all__ if n.endswith("Error")}
    assert all(issubclass(getattr(kdb, n), kdb.KdbError) for n in names)


def test_a_kernel_db_is_not_pickled_and_a_nul_path_is_refused(cache_dir):
    import pickle

    with pytest.raises(kdb.UnsupportedTypeError, match="open its own"):
        pickle.dumps(kdb.KernelDB())
    with pytest.raises(kdb.InvalidArgumentError, match="NUL"):
        kdb.KernelDB(cache_dir="/tmp/a\0b")


def test_an_empty_binary_is_never_stored(cache_dir):
    """A compile_fn that returned b"" had it stored and served to every later process."""
    db = kdb.KernelDB()
    attrs = kdb.HashAttributes("cc", "kernel void k() {}", "sm_90")
    with pytest.raises(kdb.InvalidArgumentError, match="no bytes"):
        db.get_or_compile(attrs, lambda: b"")
    with pytest.raises(kdb.InvalidArgumentError, match="empty"):
        db.put(attrs, b"")
    assert db.get_or_compile(attrs, lambda: b"built") == b"built"
    db.close()

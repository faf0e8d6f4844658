"""kdb.backends.fallback: where no compiler is installed, entries that match on all but the compiler
serve, the newest compiler's first; files older than revision 0004 give none."""

from __future__ import annotations

import doctest
import shutil
from pathlib import Path

from conftest import sql
from test_migrate import file_at_0001

from kdb import HashAttributes, KernelDB, keys
from kdb.backends import fallback
from kdb.file import migrate

SRC = "__global__ void k(float *a) { a[0] = 1.0f; }"


def _rank(compiler) -> tuple[int, ...]:
    return tuple(int(x) for x in dict(compiler).get("cc_version", "0").split("."))


def _attrs(version: str | None = None, **changes) -> HashAttributes:
    base = HashAttributes("mycc", SRC, "sm_90", build_options=("-O3",),
                          compiler={} if version is None else {"cc_version": version},
                          name="k")
    return base.with_(**changes) if changes else base


def test_the_compiler_free_key_leaves_out_the_compiler_and_nothing_else():
    a, b = _attrs("1.0"), _attrs("2.0")
    assert a.key != b.key and a.compiler_free_key == b.compiler_free_key == _attrs().key
    assert _attrs("1.0", build_options=("-O2",)).compiler_free_key != a.compiler_free_key
    assert keys.compiler_free_key(a.encoded()) == a.compiler_free_key
    assert keys.compiler_free_key("not json") is None


def test_candidates_rank_the_newest_compiler_first_and_system_before_user(cache_dir, tmp_path):
    sysdir = tmp_path / "sys"
    sysdir.mkdir()
    builder = KernelDB(cache_dir=tmp_path / "build")
    builder.put(_attrs("2.0"), b"system 2.0")
    builder.put(_attrs("1.0", build_options=("-O2",)), b"other options")
    builder.close()
    shutil.copyfile(tmp_path / "build" / "v1" / "sm_90.kdb", sysdir / "sm_90.kdb")
    db = KernelDB(system_path=[sysdir])
    db.put(_attrs("1.0"), b"user 1.0")
    db.put(_attrs("2.0"), b"user 2.0")  # the same key as the system entry: listed once
    db.put(_attrs("3.0"), b"user 3.0")
    found = fallback.candidates(db, _attrs(), _rank)
    assert [(c.binary, c.tier) for c in found] == [
        (b"user 3.0", "user"), (b"system 2.0", "system"), (b"user 1.0", "user")]
    assert found[0].attrs == _attrs("3.0")
    only_old = fallback.candidates(db, _attrs(), _rank, accept=lambda c: _rank(c) < (2,))
    assert [c.binary for c in only_old] == [b"user 1.0"]
    assert fallback.candidates(db, _attrs(build_options=("-O1",)), _rank) == []
    db.close()


def test_a_row_that_differs_in_another_attribute_is_never_served(cache_dir):
    db = KernelDB()
    db.put(_attrs("1.0", source=SRC + " // another kernel"), b"another kernel")
    path = cache_dir / "v1" / "sm_90.kdb"
    sql(path, "UPDATE kernels SET compiler_free_key = ?", (_attrs().key,))  # a forged digest
    assert fallback.candidates(db, _attrs(), _rank) == []
    db.close()


def test_a_system_file_before_revision_0004_gives_none_and_a_user_file_is_backfilled(
        cache_dir, tmp_path):
    old = file_at_0001(tmp_path / "sys" / "sm_90.kdb", _attrs("1.0"), raw=b"from 0001",
                       journal="delete")
    migrate.upgrade_sqlite(old, "0003")
    db = KernelDB(system_path=[old.parent])
    assert db.lookup(_attrs("1.0")).binary == b"from 0001"  # read as before
    assert fallback.candidates(db, _attrs(), _rank) == []  # no column: no candidates
    db.close()
    user = file_at_0001(cache_dir / "v1" / "sm_90.kdb", _attrs("1.0"), raw=b"user, 0001")
    (cache_dir / "v1").chmod(0o700)
    user.chmod(0o600)
    db = KernelDB(system_path=[])
    assert fallback.candidates(db, _attrs(), _rank) == []  # read as it is: no column yet
    assert db.put(_attrs("1.0", source=SRC + " // another kernel"), b"x")  # the writer upgrades
    found = fallback.candidates(db, _attrs(), _rank)
    assert [c.binary for c in found] == [b"user, 0001"]
    assert sql(user, "SELECT compiler_free_key FROM kernels WHERE key = ?",
               (_attrs("1.0").key,)) == [(_attrs().key,)]
    db.close()


def test_doctests():
    result = doctest.testmod(fallback)
    assert result.attempted > 0 and result.failed == 0
    assert doctest.testmod(keys).failed == 0


def test_under_a_trust_policy_only_signed_candidates_serve(cache_dir, tmp_path, monkeypatch):
    from kdb.signing import keyfiles

    keyfiles.generate(str(tmp_path / "ci.pem"), str(tmp_path / "ci.pub"))
    sysdir = tmp_path / "sys"
    sysdir.mkdir()
    monkeypatch.setenv("KDB_SIGNING_KEY", str(tmp_path / "ci.pem"))
    builder = KernelDB(cache_dir=tmp_path / "build")
    builder.put(_attrs("2.0"), b"signed 2.0")
    builder.close()
    monkeypatch.delenv("KDB_SIGNING_KEY")
    builder = KernelDB(cache_dir=tmp_path / "build")
    builder.put(_attrs("3.0"), b"unsigned 3.0")
    builder.close()
    shutil.copyfile(tmp_path / "build" / "v1" / "sm_90.kdb", sysdir / "sm_90.kdb")
    db = KernelDB(system_path=[sysdir])
    assert [c.binary for c in fallback.candidates(db, _attrs(), _rank)] == [
        b"unsigned 3.0", b"signed 2.0"]
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(tmp_path / "ci.pub"))
    assert [c.binary for c in fallback.candidates(db, _attrs(), _rank)] == [b"signed 2.0"]
    db.close()

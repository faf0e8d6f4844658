"""The ``kdb`` command line, through click's runner, on caches filled by real puts and builds."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdb import HashAttributes, KernelDB
from kdb.file import migrate
from kdb.cli import cli

SAXPY = """
__kernel void saxpy(__global float *y, __global const float *x, const float a) {
    int i = get_global_id(0);
    y[i] += a * x[i] * N;
}
"""


def attrs(name: str, source: str, arch: str = "sm_90", **kw) -> HashAttributes:
    return HashAttributes(backend="test", source=source, arch=arch, name=name,
                          compiler=(("nvcc", "13.0"),), **kw)


def make_system_db(directory: Path, arch: str, items: list[tuple[HashAttributes, bytes]]) -> Path:
    """A system database as `kdb pack` would ship it: head revision, rollback journal."""
    build = directory.parent / f"build-{arch}"
    db = KernelDB(cache_dir=build, system_path=[])
    for a, binary in items:
        assert db.put(a, binary)
    db.close()
    conn = sqlite3.connect(build / "v1" / f"{arch}.kdb")
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    directory.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(build / "v1" / f"{arch}.kdb", directory / f"{arch}.kdb"))


def run(args: list[str], env: dict[str, str] | None = None, input: str | None = None):
    return CliRunner().invoke(cli, args, env=env, input=input, catch_exceptions=True)


def ok(args: list[str], env: dict[str, str] | None = None) -> str:
    result = run(args, env)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def clean_error(result) -> None:
    """Failed with a message, a non-zero status and no traceback."""
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    assert result.output.strip().startswith(("Error:", "Usage:"))


@pytest.fixture(scope="module")
def store(tmp_path_factory, cl_ctx):
    """A cache filled the way programs fill it, and the environment pointing at it.

    sm_90 (backend "test"): two puts, one compile, one user hit, one system hit, one miss.
    PoCL: saxpy built with -DN=8 and -DN=16 (two compiles), then -DN=8 again (a user hit).
    """
    import kdb.opencl
    from kdb.storing import background
    from kdb.backends.opencl import arch_of

    base = tmp_path_factory.mktemp("cli")
    root, sysdir = base / "cache", base / "system"
    blur = attrs("blur", "kernel void blur() {}")
    system_file = make_system_db(sysdir, "sm_90", [(blur, b"BLUR" * 100)])

    db = KernelDB(cache_dir=root, system_path=[sysdir])
    scale = attrs("scale", "kernel void scale() {}", build_options=("-O3",))
    assert db.put(scale, b"\x01" * 4000, compile_seconds=0.5)
    assert db.put(attrs("shift", "kernel void shift() {}"), b"\x02" * 3000)
    compiled = db.get_or_compile(scale.with_(build_options=("-O2",)), lambda: b"\x03" * 5000,
                                 details={"host": "builder-1", "device": "H100"})
    assert compiled == b"\x03" * 5000
    assert db.get(scale) == b"\x01" * 4000  # user hit
    assert db.get(blur) == b"BLUR" * 100  # system hit
    assert db.get(attrs("absent", "kernel void absent() {}")) is None  # miss

    kdb.opencl.build(cl_ctx, SAXPY, ["-DN=8"], db=db)
    kdb.opencl.build(cl_ctx, SAXPY, ["-DN=16"], db=db)
    db.flush()
    kdb.opencl.build(cl_ctx, SAXPY, ["-DN=8"], db=db)  # served from the user tier
    db.close()
    background.drain()
    return {
        "root": root, "sysdir": sysdir, "system_file": system_file,
        "env": {"KDB_CACHE_DIR": str(root), "KDB_SYSTEM_DB_PATH": str(sysdir)},
        "pocl": arch_of(cl_ctx.devices[0]), "scale": scale, "blur": blur,
    }


@pytest.mark.parametrize("name", ["kdb.admin.info", "kdb.admin.explain", "kdb.admin.tierfiles", "kdb.file.fileformat"])
def test_report_doctests(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted >= 1 and result.failed == 0


def test_reading_commands_do_not_import_sqlalchemy(store, run_py):
    proc = run_py("""
        import sys
        from kdb.cli import cli
        for args in (["ls"], ["stats"], ["log"], ["explain", "saxpy"]):
            cli.main(args=args, prog_name="kdb", standalone_mode=False)
        print("SQLALCHEMY" if "sqlalchemy" in sys.modules else "LIGHT")
    """, env=store["env"])
    assert proc.stdout.strip().endswith("LIGHT"), proc.stdout
    assert "saxpy" in proc.stdout


# -- help and errors --------------------------------------------------------------------------

def test_every_command_has_help_with_an_example():
    assert "Example:" in ok(["--help"])
    assert set(cli.commands) >= {"info", "ls", "stats", "log", "explain", "clear", "migrate",
                                 "demo"}
    for name in cli.commands:
        out = ok([name, "--help"])
        assert "Example:" in out, name
        assert f"kdb {name}" in out, name


def test_the_installed_kdb_script_runs():
    script = Path(sys.executable).with_name("kdb")
    assert script.is_file(), f"no kdb script beside {sys.executable}; pip install -e ."
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "explain" in proc.stdout and "Example:" in proc.stdout


def test_an_unsafe_arch_is_a_clean_error(cache_dir):
    result = run(["ls", "--arch", "../x"])
    clean_error(result)
    assert "arch id '../x' is not valid" in result.output


def test_a_usage_error_is_clean(cache_dir):
    result = run(["ls", "--tier", "shared"])
    clean_error(result)
    assert result.exit_code == 2


@pytest.mark.parametrize("args", [
    ["log", "--limit", "99999999999999999999999"],
    ["explain", "x", "--nearest", "99999999999999999999999"],
    ["demo", "--kernels", "99"],
    ["demo", "--kernels", "1", "--json", "/nonexistent-dir/x.json"],
    ["ls", "--arch", ""],
    ["pack", "--arch", "BAD!", "--from-db"],
], ids=["log-limit", "explain-nearest", "demo-kernels", "demo-json-dir", "ls-arch", "pack-arch"])
def test_an_out_of_range_argument_is_a_usage_error_before_any_work(args, cache_dir):
    """A count past SQLite's integers was an OverflowError's traceback; the demo's --json
    in a directory that does not exist failed only after the whole demo had run."""
    result = run(args)
    clean_error(result)
    assert result.exit_code == 2, result.output
    assert "Invalid value" in result.output


def test_a_cache_dir_variable_naming_a_file_is_refused_as_the_option_is(tmp_path):
    """``--cache-dir FILE`` was a usage error while ``KDB_CACHE_DIR=FILE`` listed an empty
    cache with status 0."""
    afile = tmp_path / "afile"
    afile.write_text("")
    result = run(["ls"], {"KDB_CACHE_DIR": str(afile)})
    clean_error(result)
    assert result.exit_code == 2 and "KDB_CACHE_DIR=" in result.output
    assert "is not a directory" in result.output


def test_key_files_in_a_missing_directory_are_usage_errors(tmp_path):
    """Both said ``FileNotFoundError: [Errno 2] ...`` with status 1."""
    gen = run(["key", "gen", str(tmp_path / "no-such-dir" / "k.pem")])
    clean_error(gen)
    assert gen.exit_code == 2 and "is not a directory: make it first" in gen.output
    ident = run(["key", "id", str(tmp_path / "missing.pem")])
    clean_error(ident)
    assert ident.exit_code == 2 and "does not exist" in ident.output


def test_pack_from_the_log_of_a_missing_database_names_that_option(tmp_path):
    result = run(["pack", "--arch", "sm_90", "--from-log", "--out", str(tmp_path / "out")],
                 {"KDB_CACHE_DIR": str(tmp_path / "cache")})
    clean_error(result)
    assert result.exit_code == 1 and "--from-log " in result.output
    assert "--from-db" not in result.output


def test_an_unknown_key_is_a_clean_error(store):
    result = run(["explain", "deadbeef0000"], store["env"])
    clean_error(result)
    assert "no stored entry or compile record matches 'deadbeef0000'" in result.output


# -- info -------------------------------------------------------------------------------------

def test_info_shows_devices_files_and_system_dbs(store, tmp_path):
    sysdir = tmp_path / "more-system"
    sysdir.mkdir()
    (sysdir / "gfx90a.kdb").write_bytes(b"this is not sqlite" * 10)
    env = dict(store["env"], KDB_SYSTEM_DB_PATH=f"{store['sysdir']}:{sysdir}")

    data = json.loads(ok(["info", "--json"], env))
    users = {Path(f["path"]).name: f for f in data["user_files"]}
    assert users["sm_90.kdb"]["entries"] == 3
    assert users[f"{store['pocl']}.kdb"]["entries"] == 2
    assert all(f["revision"] == migrate.HEAD and f["size"] > 0 for f in users.values())
    systems = {s["arch"]: s for s in data["system_databases"]}
    assert systems["sm_90"]["entries"] == 1 and systems["sm_90"]["problem"] == ""
    assert systems["sm_90"]["origin"] == "KDB_SYSTEM_DB_PATH"
    assert systems["gfx90a"]["problem"]  # broken, reported, not fatal
    pocl = [d for d in data["devices"] if d["arch"] == store["pocl"]]
    kind, _, digest = pocl[0]["identity"]["library"].partition(":")
    assert pocl and f"{kind}:{digest[:12]}" in pocl[0]["compiler"]
    assert pocl[0]["compiler"] and pocl[0]["system_db"] is False
    assert store["pocl"] in data["missing_system"]

    text = ok(["info"], env)
    assert f"arch:      {store['pocl']}" in text
    assert f"MISSING ({store['pocl']}.kdb)" in text
    assert f"sm_90.kdb  rev {migrate.HEAD}  3 entries" in text
    assert "gfx90a" in text and "BROKEN" in text


def test_info_says_found_when_the_device_has_a_system_db(store, tmp_path):
    sysdir = tmp_path / "sys"
    make_system_db(sysdir, store["pocl"], [(attrs("x", "kernel void x() {}", store["pocl"]),
                                            b"x" * 10)])
    data = json.loads(ok(["info", "--json"], dict(store["env"], KDB_SYSTEM_DB_PATH=str(sysdir))))
    assert store["pocl"] not in data["missing_system"]
    assert any(d["system_db"] for d in data["devices"] if d["arch"] == store["pocl"])


def test_info_without_pyopencl_is_not_an_error(store, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyopencl", None)  # `import pyopencl` now fails
    data = json.loads(ok(["info", "--json"], store["env"]))
    assert data["devices"] == [] and "pyopencl is not installed" in data["devices_note"]
    assert len(data["user_files"]) == 2


def test_cache_dir_option_overrides_the_variable(store, tmp_path):
    env = {"KDB_CACHE_DIR": str(tmp_path / "empty"), "KDB_SYSTEM_DB_PATH": ""}
    assert json.loads(ok(["ls", "--json"], env)) == []
    rows = json.loads(ok(["--cache-dir", str(store["root"]), "ls", "--json"], env))
    assert len(rows) == 5


# -- ls, stats, log ---------------------------------------------------------------------------

def test_ls_lists_entries_of_both_tiers(store):
    rows = json.loads(ok(["ls", "--json"], store["env"]))
    by_name: dict[str, list] = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    assert sorted(by_name) == ["blur", "saxpy", "scale", "shift"]
    assert [r["tier"] for r in by_name["blur"]] == ["system"]
    assert len(by_name["saxpy"]) == 2 and {r["arch"] for r in by_name["saxpy"]} == {store["pocl"]}
    assert {r["backend"] for r in by_name["saxpy"]} == {"opencl"}
    hit = [r for r in by_name["scale"] if r["key"] == store["scale"].key][0]
    assert hit["hits"] == 1 and hit["raw_size"] == 4000 and 0 < hit["stored_size"] < 4000
    assert all(r["created"] > 0 and r["last_access"] >= r["created"] for r in rows)

    text = ok(["ls"], store["env"])
    assert store["scale"].key[:12] in text and "LAST ACCESS" in text and "saxpy" in text

    only = json.loads(ok(["ls", "--json", "--arch", "sm_90", "--tier", "user"], store["env"]))
    assert sorted(r["name"] for r in only) == ["scale", "scale", "shift"]
    system = json.loads(ok(["ls", "--json", "--tier", "system"], store["env"]))
    assert [r["name"] for r in system] == ["blur"]


def test_ls_of_an_arch_with_nothing_stored_names_the_arches_that_have_entries(store, tmp_path):
    said = ok(["ls", "--arch", "sm_80"], store["env"])
    assert said.startswith("no entries for arch 'sm_80' in the user tier")
    assert f"entries are stored for: {', '.join(sorted({store['pocl'], 'sm_90'}))}" in said
    assert "kdb info" in said
    system = ok(["ls", "--arch", "sm_80", "--tier", "system"], store["env"])
    assert system.startswith("no entries for arch 'sm_80' in the system databases; entries "
                             "are stored for: sm_90 (")
    empty = {"KDB_CACHE_DIR": str(tmp_path / "empty"), "KDB_SYSTEM_DB_PATH": ""}
    assert ok(["ls"], empty).startswith("no entries in the user tier")
    assert "none for any arch" in ok(["ls", "--arch", "sm_80"], empty)


def test_arch_native_stands_for_this_machines_opencl_arch(store):
    """`--arch native` works where `kdb pack` taught it: the PoCL device's arch."""
    native = json.loads(ok(["ls", "--json", "--arch", "native"], store["env"]))
    assert native and {r["arch"] for r in native} == {store["pocl"]}
    assert native == json.loads(ok(["ls", "--json", "--arch", store["pocl"]], store["env"]))


def test_stats_counts_hits_per_tier_and_compiles(store):
    data = json.loads(ok(["stats", "--json"], store["env"]))
    assert data["compiles"] == 3
    assert data["hits"] == {"system": 1, "user": 2}
    assert data["misses"] == 4  # absent, the -O2 compile, two saxpy builds
    sm90 = data["arches"]["sm_90"]
    assert sm90["compiles"] == 1 and sm90["hits"] == {"system": 1, "user": 1}
    assert sm90["saved_seconds"] == pytest.approx(0.5)  # the -O3 entry's compile time
    assert sm90["entries"] == 3 and sm90["system_entries"] == 1
    assert sm90["raw_bytes"] == 4000 + 3000 + 5000
    pocl = data["arches"][store["pocl"]]
    assert pocl["compiles"] == 2 and pocl["compile_seconds"] > 0 and pocl["hits"]["user"] == 1
    rows = json.loads(ok(["ls", "--json", "--tier", "user"], store["env"]))
    assert data["stored_bytes"] == sum(r["stored_size"] for r in rows)
    assert data["raw_bytes"] == sum(r["raw_size"] for r in rows)

    text = ok(["stats"], store["env"])
    assert "HITS SYSTEM" in text and "total" in text and "sm_90" in text


def test_log_has_one_record_per_compile(store):
    rows = json.loads(ok(["log", "--json"], store["env"]))
    assert len(rows) == 3
    assert [r["at"] for r in rows] == sorted((r["at"] for r in rows), reverse=True)
    saxpy = [r for r in rows if r["name"] == "saxpy"]
    assert len(saxpy) == 2 and all(r["seconds"] > 0 and r["pid"] > 0 for r in saxpy)
    assert all(r["missed"] == ["system(none)", "user"] for r in saxpy)
    assert all("no system database" in r["reason"] for r in saxpy)
    scale = [r for r in rows if r["name"] == "scale"][0]
    assert scale["missed"] == ["system", "user"] and scale["arch"] == "sm_90"

    assert len(json.loads(ok(["log", "--json", "--limit", "1"], store["env"]))) == 1
    every = json.loads(ok(["log", "--json", "--limit", "0"], store["env"]))  # showed none
    assert len(every) >= 2 and every == json.loads(ok(["log", "--json"], store["env"]))
    only = json.loads(ok(["log", "--json", "--arch", "sm_90"], store["env"]))
    assert [r["name"] for r in only] == ["scale"]
    text = ok(["log"], store["env"])
    assert "REASON" in text and "saxpy" in text and "system(none),user" in text


# -- explain ----------------------------------------------------------------------------------

def test_explain_a_key_shows_the_nearest_entry_and_what_differs(store):
    compiled = store["scale"].with_(build_options=("-O2",))
    data = json.loads(ok(["explain", compiled.key[:10], "--json"], store["env"]))
    assert data["key"] == compiled.key and data["name"] == "scale"
    assert len(data["compiles"]) == 1 and data["entry"]["details"] == {
        "device": "H100", "host": "builder-1"}
    nearest = data["nearest"][0]
    assert nearest["key"] == store["scale"].key
    assert list(nearest["differs"]) == ["build_options"]
    assert "-O2" in nearest["differs"]["build_options"]
    assert "build_options" in data["why"]
    # the next ranks differ in more than one attribute
    assert all(len(e["differs"]) > 1 for e in data["nearest"][1:])

    text = ok(["explain", compiled.key[:10]], store["env"])
    assert "differs in 1: build_options" in text
    assert "this: -O2; other: -O3" in text
    assert "host: builder-1" in text


def test_explain_finds_the_nearest_entry_of_its_name_among_many_newer_ones(tmp_path):
    """The candidates were the 1000 most recently used entries of its name or back end and
    arch: past 1000 newer entries of other kernels, the older entry of its own name fell
    out, and the why named another kernel's entry, differing in source too."""
    import sqlite3

    cache = tmp_path / "cache"
    db = KernelDB(cache_dir=cache, system_path=[])
    target = attrs("target", "kernel void target() {}", build_options=("-DN=1",))
    db.put(target, b"t" * 100)
    db.flush()
    path = cache / "v1" / "sm_90.kdb"
    conn = sqlite3.connect(path)
    with conn:  # the entry of its name is the least recently used
        conn.execute("UPDATE kernels SET last_access = 1, created = 1")
    conn.close()
    for i in range(1001):
        db.put(attrs(f"other{i}", f"kernel void other{i}() {{}}", build_options=("-DN=2",)),
               b"o" * 100)
    compiled = target.with_(build_options=("-DN=2",))
    db.get_or_compile(compiled, lambda: b"n" * 100)
    db.close()
    data = json.loads(ok(["explain", compiled.key[:16], "--json"], {"KDB_CACHE_DIR": str(cache)}))
    assert data["nearest"][0]["key"] == target.key, data["nearest"][0]
    assert list(data["nearest"][0]["differs"]) == ["build_options"], data["why"]
    assert "source" not in data["why"], data["why"]


def test_explain_says_a_key_compiled_again_had_left_the_tier(tmp_path):
    """Compiled, evicted (`kdb evict`), compiled again: the why said only "not in any tier"
    and named the nearest entry's differences, as if the key were new."""
    import time

    cache = tmp_path / "cache"
    env = {"KDB_CACHE_DIR": str(cache)}
    gone = attrs("gone", "kernel void gone() {}")
    db = KernelDB(cache_dir=cache, system_path=[])
    db.get_or_compile(gone, lambda: b"g" * 100)
    db.get_or_compile(attrs("kept", "kernel void kept() {}"), lambda: b"k" * 100)
    db.close()
    ok(["evict", "--to", "0"], env)
    time.sleep(0.05)
    db = KernelDB(cache_dir=cache, system_path=[])
    db.get_or_compile(gone, lambda: b"g" * 100)
    db.close()
    data = json.loads(ok(["explain", gone.key[:16], "--json"], env))
    assert len(data["compiles"]) == 2
    assert "it was compiled before" in data["why"] and "evicted" in data["why"], data["why"]


def test_explain_a_kernel_name_from_a_real_build(store):
    data = json.loads(ok(["explain", "saxpy", "--json"], store["env"]))
    assert data["name"] == "saxpy" and data["arch"] == store["pocl"]
    assert data["compiles"][0]["name"] == "saxpy"
    assert data["entry"]["details"]["device"]  # machine-local metadata kept beside the entry
    assert data["nearest"][0]["name"] == "saxpy"
    assert list(data["nearest"][0]["differs"]) == ["build_options"]
    assert len(data["other_matches"]) == 1

    text = ok(["explain", "saxpy"], store["env"])
    assert "why:" in text and "build_options: this: -DN=" in text


def test_explain_an_ambiguous_prefix_is_a_clean_error(tmp_path):
    seen: dict[str, HashAttributes] = {}
    for i in range(100_000):  # birthday search: two keys sharing their first 4 hex digits
        a = attrs(f"k{i}", f"kernel void k{i}() {{}}")
        if a.key[:4] in seen:
            pair = [seen[a.key[:4]], a]
            break
        seen[a.key[:4]] = a
    db = KernelDB(cache_dir=tmp_path / "c", system_path=[])
    for a in pair:
        db.put(a, b"x")
    db.close()
    env = {"KDB_CACHE_DIR": str(tmp_path / "c")}
    result = run(["explain", pair[0].key[:4]], env)
    clean_error(result)
    assert "ambiguous (2 keys" in result.output
    assert json.loads(ok(["explain", pair[0].key[:12], "--json"], env))["key"] == pair[0].key


# -- clear and migrate ------------------------------------------------------------------------

def test_clear_removes_user_files_and_never_a_system_file(tmp_path):
    root, sysdir = tmp_path / "cache", tmp_path / "system"
    system_file = make_system_db(sysdir, "sm_90", [(attrs("s", "kernel void s() {}"), b"s")])
    before = hashlib.sha256(system_file.read_bytes()).hexdigest()
    db = KernelDB(cache_dir=root, system_path=[sysdir])
    db.put(attrs("a", "kernel void a() {}"), b"a")
    db.put(attrs("b", "kernel void b() {}", arch="sm_80"), b"b")
    db.close()
    env = {"KDB_CACHE_DIR": str(root), "KDB_SYSTEM_DB_PATH": str(sysdir)}
    user = root / "v1"
    assert {p.name for p in user.glob("*.kdb")} == {"sm_90.kdb", "sm_80.kdb"}

    result = run(["clear"], env, input="n\n")  # declined: nothing removed
    assert result.exit_code != 0 and "Aborted" in result.output
    assert {p.name for p in user.glob("*.kdb")} == {"sm_90.kdb", "sm_80.kdb"}
    for answer in ("n\n", ""):  # with --json, declined or unanswered (no terminal): JSON
        result = CliRunner().invoke(cli, ["clear", "--json"], env=env, input=answer)
        assert result.exit_code == 1
        assert json.loads(result.stdout)["aborted"] is True and "Aborted" in result.stderr
    assert {p.name for p in user.glob("*.kdb")} == {"sm_90.kdb", "sm_80.kdb"}

    assert "removed" in ok(["clear", "--arch", "sm_80", "--yes"], env)
    assert {p.name for p in user.glob("*.kdb*")} >= {"sm_90.kdb"}
    assert not list(user.glob("sm_80.kdb*"))

    result = run(["clear"], env, input="y\n")
    assert result.exit_code == 0, result.output
    assert not list(user.glob("*.kdb*"))
    assert hashlib.sha256(system_file.read_bytes()).hexdigest() == before
    assert "nothing to clear" in ok(["clear", "--yes"], env)


def test_clear_skips_a_system_file_in_the_user_dir(tmp_path):
    root = tmp_path / "cache"
    system_file = make_system_db(root / "v1", "sm_90", [(attrs("s", "kernel void s() {}"), b"s")])
    before = system_file.read_bytes()
    env = {"KDB_CACHE_DIR": str(root), "KDB_SYSTEM_DB_PATH": str(root / "v1")}
    ok(["clear", "--yes"], env)
    assert system_file.read_bytes() == before


def test_migrate_upgrades_a_revision_0001_file(tmp_path):
    user = tmp_path / "cache" / "v1"
    user.mkdir(parents=True)
    old = user / "sm_90.kdb"
    migrate.upgrade_sqlite(old, "0001")
    env = {"KDB_CACHE_DIR": str(tmp_path / "cache")}

    def revision() -> str | None:
        conn = sqlite3.connect(old)
        try:
            return migrate.revision_of(conn)
        finally:
            conn.close()

    assert json.loads(ok(["stats", "--json"], env))["compiles"] == 0  # old files still read
    result = run(["migrate", "--check"], env)
    assert result.exit_code == 1 and f"0001 -> {migrate.HEAD} needs upgrade" in result.output
    assert revision() == "0001"

    data = json.loads(ok(["migrate", "--json"], env))
    assert data == [{"path": str(old), "arch": "sm_90", "from": "0001", "to": migrate.HEAD,
                     "action": "upgraded", "problem": ""}]
    assert revision() == migrate.HEAD
    assert f"{migrate.HEAD} current" in ok(["migrate", "--check"], env)


def test_reading_commands_change_no_file_at_any_revision(tmp_path):
    user = tmp_path / "cache" / "v1"
    user.mkdir(parents=True)
    old = user / "sm_90.kdb"
    migrate.upgrade_sqlite(old, "0001")
    head = user / "sm_80.kdb"
    migrate.upgrade_sqlite(head)
    before = {p: p.read_bytes() for p in (old, head)}
    env = {"KDB_CACHE_DIR": str(tmp_path / "cache")}
    for args in (["info"], ["ls"], ["stats"], ["log"], ["verify"], ["migrate", "--check"]):
        result = run(args, env)
        assert result.exit_code in (0, 1), (args, result.output)  # --check: 1, needs upgrade
    assert {p: p.read_bytes() for p in (old, head)} == before
    assert sorted(p.name for p in user.iterdir()) == ["sm_80.kdb", "sm_90.kdb"]


def test_migrate_leaves_a_future_file_untouched(tmp_path):
    user = tmp_path / "cache" / "v1"
    user.mkdir(parents=True)
    future = user / "sm_90.kdb"
    migrate.upgrade_sqlite(future)
    conn = sqlite3.connect(future)
    conn.execute("UPDATE alembic_version SET version_num = '9999'")
    conn.commit()
    conn.close()
    before = future.read_bytes()
    result = run(["migrate", "--json"], {"KDB_CACHE_DIR": str(tmp_path / "cache")})
    assert result.exit_code == 1  # the file could not be brought to this kdb's revision
    data = json.loads(result.output)
    assert data[0]["action"] == "skipped" and "newer" in data[0]["problem"]
    assert future.read_bytes() == before


# -- demo -------------------------------------------------------------------------------------

def test_demo_runs_cold_then_warm_in_the_given_cache(tmp_path, cache_dir):
    out, demo_cache = tmp_path / "demo.json", tmp_path / "demo-cache"
    result = run(["--cache-dir", str(demo_cache), "demo", "--kernels", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output  # 0: results match numpy, warm run compiled 0
    assert "cold" in result.output and "warm" in result.output
    assert json.loads(out.read_text())
    rows = json.loads(ok(["--cache-dir", str(demo_cache), "ls", "--json"]))
    assert len(rows) >= 2 and {r["backend"] for r in rows} == {"opencl"}
    assert json.loads(ok(["--cache-dir", str(demo_cache), "stats", "--json"]))["hits"]["user"] >= 2


@pytest.mark.parametrize("command", [["verify"], ["verify", "--repair"],
                                     ["pack", "--arch", "sm_90", "--from-db", "-", "--out"]])
def test_ctrl_c_inside_kdbs_sql_function_aborts_and_is_no_database_error(
        command, cache_dir, tmp_path, monkeypatch):
    """A Ctrl-C that lands in the SQL function reading entries' attributes reached kdb as
    sqlite3's 'user-defined function raised exception': verify called a sound file
    unreadable (and --repair 'repaired' it, exit 0), migrate skipped the file as a failed
    upgrade, pack said OperationalError. Each now stops as an interrupted command does (the
    interrupt is put where it lands: in the function)."""
    from kdb.file import compact

    db = KernelDB(cache_dir)
    for i in range(3):
        db.put(attrs(f"k{i}", f"source {i}"), b"binary %d" % i)
    db.close()
    path = cache_dir / "v1" / "sm_90.kdb"
    if command[0] == "pack":
        command = [*command[:4], str(cache_dir), command[-1], str(tmp_path / "out")]
    before = path.read_bytes()

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(compact, "unpack", interrupted)
    result = run(command)
    assert result.exit_code == 1 and "Aborted!" in result.output, (result.output,
                                                                   result.exception)
    for wrong in ("cannot be read now", "repaired", "upgrade failed", "OperationalError"):
        assert wrong not in result.output, result.output
    assert path.read_bytes() == before
    assert not compact._interrupted


@pytest.mark.parametrize("command", [["ls"], ["stats"], ["verify"], ["log"]])
def test_a_reading_command_on_a_cache_that_is_not_there_makes_no_directory(command, tmp_path):
    """``KDB_CACHE_DIR=/tmp/typo kdb ls`` made /tmp/typo, to save its scan of installed
    packages there."""
    typo = tmp_path / "typo"
    proc = subprocess.run([str(Path(sys.executable).with_name("kdb")), *command],
                          env={**__import__("os").environ, "KDB_CACHE_DIR": str(typo)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not typo.exists()


def test_verify_notes_a_file_mostly_free_pages_and_repair_gives_them_back(tmp_path):
    """An upgrade's VACUUM killed halfway left a file at twice its size for good (only the
    upgrade vacuums). verify notes the free pages, still sound; --repair runs the VACUUM,
    and a sound file is not 'repaired' otherwise (its totals were recomputed, exit 0)."""
    import os

    cache = tmp_path / "cache"
    db = KernelDB(cache_dir=cache, system_path=[])
    for i in range(60):
        db.put(attrs(f"k{i}", f"kernel void k{i}() {{}}"), os.urandom(64_000))
    db.close()
    path = cache / "v1" / "sm_90.kdb"
    from kdb.file.kernelfile import KernelFile

    f = KernelFile(path, tier="user", readonly=False)
    assert f.delete([attrs(f"k{i}", f"kernel void k{i}() {{}}").key for i in range(1, 60)]) == 59
    f.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    env = {"KDB_CACHE_DIR": str(cache)}
    before = path.stat().st_size
    said = json.loads(ok(["verify", "--json"], env))
    [f] = said["files"]
    assert f["ok"] and f["reclaimable"] > 3_000_000, f
    assert any("kdb verify --repair" in n for n in f["notes"]), f["notes"]
    fixed = json.loads(ok(["verify", "--repair", "--json"], env))
    [f] = fixed["files"]
    assert f["ok"] and [d for d in f["repaired"] if "VACUUM" in d], f
    assert not [d for d in f["repaired"] if "totals" in d], f  # nothing else was wrong
    assert path.stat().st_size < before / 4
    assert KernelDB(cache_dir=cache, system_path=[]).lookup(attrs("k0", "kernel void k0() {}"))


def test_explain_keeps_a_value_with_a_newline_on_its_line(tmp_path):
    """Intel's runtime names its cl.cfg in the compiler's identity, newlines and all: the
    table broke its indentation."""
    cache = tmp_path / "cache"
    db = KernelDB(cache_dir=cache, system_path=[])
    a = HashAttributes(backend="test", source="k", arch="sm_90", name="k",
                       compiler=(("cl.cfg", "a=1\nb=2"),))
    db.put(a, b"x" * 10)
    b = a.with_(compiler=(("cl.cfg", "a=1\nb=3"),))
    db.get_or_compile(b, lambda: b"y" * 10)
    db.close()
    text = ok(["explain", b.key[:16]], {"KDB_CACHE_DIR": str(cache)})
    [line] = [ln for ln in text.splitlines() if ln.strip().startswith("compiler:")]
    assert "b=2" in line and "b=3" in line, text

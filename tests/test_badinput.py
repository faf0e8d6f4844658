"""Bad input through the API and the CLI: a KdbError subclass with a message, nothing written.

Property tests (hypothesis) throw wrong types and odd text at every entry point; the rule
is the same for all: either the input is accepted and works, or a :class:`kdb.KdbError`
subclass says what is wrong. Never a bare TypeError, never a traceback, never a file.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kdb
from kdb import (
    ConfigError,
    HashAttributes,
    InvalidArgumentError,
    KdbError,
    KernelDB,
    UnsupportedTypeError,
    config,
)
from kdb.cli import cli

FIELDS = ("backend", "source", "arch", "build_options", "internal_options", "headers",
          "spec_constants", "compiler", "environment", "name")
VALID = {"backend": "test", "source": "__kernel void k() {}", "arch": "a1"}
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8) | st.builds(object) | st.just(Path("/tmp")) | st.just(print),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=4) | st.integers(), inner, max_size=3)
    | st.frozensets(st.integers(), max_size=3),
    max_leaves=6)


def snapshot(directory: Path) -> dict:
    """What the user tier holds: its files (SQLite's -wal/-shm aside, which a read may
    create), and every file's entries and compile log. Counters (a miss is a miss) aside."""
    import sqlite3

    if not directory.exists():
        return {}
    out: dict = {}
    for p in sorted(directory.rglob("*")):
        if not p.is_file() or p.name.endswith(("-wal", "-shm")):
            continue
        name = str(p.relative_to(directory))
        out[name] = p.stat().st_size if p.suffix != ".kdb" else None
        if p.suffix == ".kdb":
            conn = sqlite3.connect(p)
            try:
                out[name] = (conn.execute("SELECT key, checksum FROM kernels ORDER BY key")
                             .fetchall(), conn.execute("SELECT count(*) FROM compile_log")
                             .fetchall())
            finally:
                conn.close()
    return out


@pytest.fixture
def unchanged(cache_dir):
    """Asserts at the end of the test that the user tier holds exactly what it held before."""
    db = KernelDB(use_system=False)
    db.put(HashAttributes(**{**VALID, "source": "__kernel void seed() {}"}), b"seed" * 10)
    db.close()
    before = snapshot(cache_dir)
    yield
    kdb.storing.background.drain()
    assert snapshot(cache_dir) == before


# -- HashAttributes ------------------------------------------------------------------------

@SETTINGS
@given(field=st.sampled_from(FIELDS), value=anything)
def test_any_attribute_value_is_accepted_or_refused_with_a_kdb_error(field, value):
    try:
        a = HashAttributes(**{**VALID, field: value})
    except KdbError as err:
        assert str(err)  # a message that says what is wrong
        return
    assert len(a.key) == 64
    assert HashAttributes.from_canonical(a.encoded(), name=a.name) == a


@SETTINGS
@given(data=st.binary(min_size=1, max_size=64))
def test_source_bytes_must_be_utf8(data):
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        with pytest.raises(InvalidArgumentError, match="UTF-8"):
            HashAttributes(**{**VALID, "source": data})
        return
    if text.strip():
        assert HashAttributes(**{**VALID, "source": data}).source == text


@pytest.mark.parametrize("source", ["", " ", "\n\t ", b"", b"   "])
def test_an_empty_source_is_refused(source):
    with pytest.raises(InvalidArgumentError, match="source is empty"):
        HashAttributes(**{**VALID, "source": source})


@SETTINGS
@given(text=st.text(min_size=1, max_size=20))
def test_lone_surrogates_are_refused_when_hashed(text):
    a_text = "x" + text + "\udcff"  # as surrogateescape leaves undecodable bytes
    try:
        a = HashAttributes(**{**VALID, "source": a_text})
    except KdbError:
        return
    with pytest.raises(InvalidArgumentError, match="surrogate"):
        a.key


def test_huge_options_are_accepted(cache_dir):
    big = "-DBIG=" + "x" * 1_000_000  # a 1 MB option
    a = HashAttributes(**VALID, build_options=(big,), name="big")
    assert len(a.key) == 64
    db = KernelDB(use_system=False)
    assert db.get_or_compile(a, lambda: b"built with a big option") == \
        b"built with a big option"
    db.close()
    assert KernelDB(use_system=False).get(a) == b"built with a big option"


# -- KernelDB ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"cache_dir": 123}, {"cache_dir": b"/tmp/x"}, {"cache_dir": ["/tmp"]},
    {"system_path": 5}, {"system_path": [None]}, {"system_path": {"a": 1}},
    {"disabled": "yes"}, {"disabled": 1}, {"trace": "no"}, {"use_system": "no"},
])
def test_kerneldb_arguments_of_the_wrong_type_are_refused(kwargs, cache_dir, unchanged):
    with pytest.raises(InvalidArgumentError):
        KernelDB(**kwargs)


BAD_CALLS = {
    "lookup(str)": lambda db, a: db.lookup("kernel"),
    "lookup(dict)": lambda db, a: db.lookup(a.canonical()),
    "get(None)": lambda db, a: db.get(None),
    "put(str)": lambda db, a: db.put(a, "binary"),
    "put(None)": lambda db, a: db.put(a, None),
    "put(list)": lambda db, a: db.put(a, [1, 2]),
    "put(attrs=str)": lambda db, a: db.put("key", b"binary"),
    "put(details=object)": lambda db, a: db.put(a, b"x", details={"d": object()}),
    "put(details=list)": lambda db, a: db.put(a, b"x", details=["x"]),
    "put(compile_seconds=str)": lambda db, a: db.put(a, b"x", compile_seconds="fast"),
    # kdb stats showed -100 s saved for a negative one, and NaN was stored as 0
    "put(compile_seconds=-100)": lambda db, a: db.put(a, b"x", compile_seconds=-100.0),
    "put(compile_seconds=nan)": lambda db, a: db.put(a, b"x", compile_seconds=float("nan")),
    "put(compile_seconds=inf)": lambda db, a: db.put(a, b"x", compile_seconds=float("inf")),
    "get_or_compile(not callable)": lambda db, a: db.get_or_compile(a, b"binary"),
    "get_or_compile(returns str)": lambda db, a: db.get_or_compile(a, lambda: "binary"),
    "get_or_compile(returns None)": lambda db, a: db.get_or_compile(a, lambda: None),
    "get_or_compile(details=set)": lambda db, a: db.get_or_compile(a, lambda: b"x",
                                                                   details={"s": {1}}),
    "user_file(None)": lambda db, a: db.tiers.user_file(None),
}


@pytest.mark.parametrize("call", sorted(BAD_CALLS))
def test_kerneldb_calls_with_bad_arguments_raise_and_write_nothing(call, cache_dir, unchanged):
    db = KernelDB(use_system=False)
    with pytest.raises(KdbError) as info:
        BAD_CALLS[call](db, HashAttributes(**VALID, name="bad"))
    assert str(info.value)
    db.flush()
    db.close()


@SETTINGS
@given(binary=anything)
def test_put_takes_bytes_or_raises_a_kdb_error(binary, cache_dir):
    db = KernelDB(use_system=False)
    a = HashAttributes(**VALID, name="prop")
    try:
        assert db.put(a, binary)
    except KdbError:
        assert not isinstance(binary, (bytes, bytearray, memoryview))
        return
    finally:
        db.close()
    assert KernelDB(use_system=False).get(a) == bytes(binary)


@pytest.mark.parametrize("name, value, error, used", [
    ("KDB_DISABLE_CACHE", "maybe", "not a boolean", "cache is turned off"),
    ("KDB_TRACE", "2", "not a boolean", "0 (the default)"),
    ("KDB_CACHE_MAX_SIZE", "lots", "not understood", "1G (the default)"),
    ("KDB_WAIT_TIMEOUT", "soon", "not a number", "60 s (the default)"),
    ("KDB_WAIT_TIMEOUT", "-1", "from 0 to", "60 s (the default)"),
    ("KDB_WAIT_TIMEOUT", "nan", "from 0 to", "60 s (the default)"),
])
def test_bad_settings_warn_once_and_use_a_fallback(name, value, error, used, cache_dir,
                                                   monkeypatch, caplog):
    monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        for _ in range(2):
            got = KernelDB(use_system=False).get_or_compile(
                HashAttributes(**VALID, name="cfg"), lambda: b"x")
            assert got == b"x"
    notes = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(notes) == 1, notes
    assert error in notes[0] and used in notes[0] and repr(value) in notes[0]
    assert config.problems() and name in config.problems()[0]  # the CLI refuses it


# -- OpenCL --------------------------------------------------------------------------------

@pytest.fixture
def build(cl_ctx):
    from kdb.backends.opencl import build as build_

    return lambda *args, **kwargs: build_(cl_ctx, *args, **kwargs)


@pytest.mark.parametrize("args, kwargs, error", [
    ((b"__kernel void k() {} \xff\xfe",), {}, kdb.CompileError),  # as pyopencl: a build failure
    (("",), {}, InvalidArgumentError),
    (("  \n",), {}, InvalidArgumentError),
    ((42,), {}, UnsupportedTypeError),
    ((None,), {}, UnsupportedTypeError),
    (("__kernel void k() {}", 5), {}, UnsupportedTypeError),
    (("__kernel void k() {}", ["-O2", 3]), {}, UnsupportedTypeError),
    (("__kernel void k() {}", b"-DV=1"), {}, UnsupportedTypeError),  # said "got int (45)"
    (("__kernel void k() {}", '-DX="unclosed'), {}, InvalidArgumentError),
    (("__kernel void k() {}",), {"devices": "cpu"}, InvalidArgumentError),
    (("__kernel void k() {}",), {"devices": []}, InvalidArgumentError),
    (("__kernel void k() {}",), {"devices": [1]}, InvalidArgumentError),
    (("__kernel void k() {}",), {"db": "my cache"}, InvalidArgumentError),
    (("__kernel void k() {}",), {"name": 7}, UnsupportedTypeError),
    (("__kernel void k() {}",), {"arch": "../x"}, kdb.UnsafeArchError),
])
def test_opencl_build_refuses_bad_input(args, kwargs, error, build, cache_dir, unchanged):
    with pytest.raises(error) as info:
        build(*args, **kwargs)
    assert str(info.value)
    if len(args) > 1 and isinstance(args[1], bytes):
        assert "got bytes (b'-DV=1'): decode them first" in str(info.value)


def test_opencl_build_refuses_a_non_context(cache_dir):
    from kdb.backends.opencl import build

    with pytest.raises(InvalidArgumentError, match="pyopencl.Context"):
        build("not a context", "__kernel void k() {}")


def test_opencl_build_with_a_1mb_option_string_works(build, cache_dir):
    src = "__kernel void k(__global int *a) { a[0] = ONE; }"
    prg = build(src, "-DBIG=" + "y" * 1_000_000 + " -DONE=1")
    assert prg.k.function_name == "k"


def test_opencl_build_of_a_bad_kernel_raises_compile_error_and_stores_nothing(build,
                                                                              cache_dir):
    with pytest.raises(kdb.CompileError, match="fix the kernel source") as info:
        build("__kernel void k() { syntax error here }")
    assert "syntax" in info.value.log
    kdb.default_db().flush()
    path = next((cache_dir / "v1").glob("*.kdb"), None)
    if path is not None:
        import sqlite3

        conn = sqlite3.connect(path)
        assert conn.execute("SELECT count(*) FROM kernels").fetchone() == (0,)
        conn.close()


# -- the CLI -------------------------------------------------------------------------------

def clean_error(result) -> None:
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()  # progress on stderr may come first
    assert any(line.startswith(("Error:", "Usage:")) for line in lines), result.output


@pytest.mark.parametrize("args", [
    ["explain", ""], ["explain", "   "], ["explain", "deadbeef"], ["log", "--limit", "-1"],
    ["ls", "--tier", "bogus"], ["evict", "--to", "-5"], ["evict", "--to", "1Q"],
    ["evict", "--to", ""], ["evict"], ["verify", "--bogus"], ["stats", "--arch", ""],
    ["pack", "--arch", "a1", "--out", "x"],
])
def test_cli_bad_arguments_are_clean_errors(args, cache_dir, unchanged):
    clean_error(CliRunner().invoke(cli, args))


@SETTINGS
@given(text=st.text(max_size=30))
def test_cli_never_shows_a_traceback_for_any_text(text, cache_dir):
    runner = CliRunner()
    for args in (["explain", text], ["evict", "--to", text, "--json"],
                 ["ls", "--arch", text, "--json"], ["log", "--arch", text]):
        if "\x00" in text:
            continue  # not passable as a command-line argument
        result = runner.invoke(cli, args)
        if result.exit_code != 0:
            clean_error(result)


MANIFESTS = {
    "unknown back end": '[[kernel]]\nname = "a"\nsource = "__kernel void a() {}"\n'
                        'backend = "vulkan"\n',
    "not TOML": "[[kernel\nname = ",
    "not UTF-8": b"\xff\xfe[[kernel]]",
    "source not a string": '[[kernel]]\nname = "a"\nsource = 5\n',
    "empty source": '[[kernel]]\nname = "a"\nsource = ""\n',
    "no kernels": '[defaults]\noptions = []\n',
    "options not a list": '[[kernel]]\nname = "a"\nsource = "k"\noptions = "-O2"\n',
    "unknown key": '[[kernel]]\nname = "a"\nsource = "k"\ncolour = "blue"\n',
    "missing file": '[[kernel]]\nname = "a"\nfile = "nowhere.cl"\n',
    "unsafe arch": '[[kernel]]\nname = "a"\nsource = "k"\narches = ["../x"]\n',
}


@pytest.mark.parametrize("what", sorted(MANIFESTS))
def test_kdb_pack_refuses_a_bad_manifest(what, tmp_path, cache_dir, cl_ctx, unchanged):
    manifest = tmp_path / "kernels.toml"
    content = MANIFESTS[what]
    manifest.write_bytes(content if isinstance(content, bytes) else content.encode())
    from kdb.backends.opencl import arch_of

    result = CliRunner().invoke(cli, ["pack", "--arch", arch_of(cl_ctx.devices[0]),
                                      "--manifest", str(manifest), "--out",
                                      str(tmp_path / "out")])
    clean_error(result)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_verify_json_is_json_even_when_files_are_bad(cache_dir):
    (cache_dir / "v1").mkdir(parents=True)
    (cache_dir / "v1" / "a1.kdb").write_bytes(os.urandom(4096))
    os.chmod(cache_dir / "v1" / "a1.kdb", 0o600)
    os.chmod(cache_dir / "v1", 0o700)
    result = CliRunner().invoke(cli, ["verify", "--json"])
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert data["ok"] is False and "unreadable" in data["files"][0]["problems"][0]


LONG_NAME = "n" * 300  # past NAME_MAX (255) on every Linux file system


@pytest.mark.parametrize("variable", ["KDB_SYSTEM_DB_PATH", "KDB_CACHE_DIR"])
def test_a_path_component_too_long_warns_and_builds(variable, tmp_path, run_py):
    """``OSError: File name too long`` from a setting is a cache that cannot be used: one
    warning, then the kernel is built as without kdb."""
    env = {"KDB_CACHE_DIR": str(tmp_path / "cache"), variable: str(tmp_path / LONG_NAME)}
    out = run_py("""
        import pyopencl as cl, kdb.opencl
        plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
        ctx = cl.Context(plat.get_devices()[:1])
        prg = kdb.opencl.build(ctx, "__kernel void v(__global int *o) { o[0] = 1; }")
        print("built", len(prg.kernel_names))
    """, env=env)
    assert "built" in out.stdout and "Traceback" not in out.stderr
    assert "too long" in out.stderr

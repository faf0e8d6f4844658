"""`kdb pack`: system databases built from a manifest, a user database or the start-up latency
log, wrapped in wheels that a new virtual environment installs and serves from."""

from __future__ import annotations

import base64
import csv
import doctest
import hashlib
import io
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import REPO, attributes_of, purelib, run_checked, venv_over
from kdb import HashAttributes, KernelDB, bookkeeping
from kdb.demo import runs as demo
from kdb.file import discovery, migrate
from kdb.admin import info
from kdb.pack import wheel
from kdb.pack import build as packing
from kdb.cli import cli
from kdb.errors import InvalidArgumentError

NOSYS = demo.MISSING_SYSTEM_DB
SCALE = "__kernel void scale(__global float *x, float a) { x[get_global_id(0)] *= a; }\n"
ADD = "__kernel void add_n(__global int *x) { x[get_global_id(0)] += N; }\n"
BROKEN = "__kernel void broken(__global float *x) { x[0] = undeclared_thing; }\n"
SMALL_MANIFEST = f'''
[[kernel]]
name = "scale"
source = """{SCALE}"""

[[kernel]]
name = "add_n"
source = """{ADD}"""
defines = {{ N = 3 }}
'''


def invoke(*args: object) -> object:
    """Run ``kdb ARGS`` in this process; stdout and stderr kept apart."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def keys_in(path: Path) -> set[str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)  # sees a user file's WAL too
    try:
        return {r[0] for r in conn.execute("SELECT key FROM kernels")}
    finally:
        conn.close()


def rows_of(path: Path) -> list[tuple[str, str, str]]:
    """(key, name, attributes) of every entry."""
    return attributes_of(path)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def arch(cl_ctx) -> str:
    """The arch of this machine's PoCL device (what `--arch native` packs)."""
    from kdb.opencl import arch_of

    return arch_of(cl_ctx.devices[0])


@pytest.fixture(scope="module")
def small(tmp_path_factory, cl_ctx, arch) -> dict:
    """`kdb pack --arch native` of a two-kernel manifest, with a wheel: the CLI's result,
    with kdb's default store mode, as a user has it (the tests' children store before they
    exit): stores handed to the store worker failed every OpenCL kernel of the pack."""
    tmp = tmp_path_factory.mktemp("small-pack")
    manifest = tmp / "small.toml"
    manifest.write_text(SMALL_MANIFEST)
    out = tmp / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("KDB_STORE_AT_EXIT", raising=False)
        result = invoke("pack", "--arch", "native", "--manifest", manifest, "--version",
                        "1.2.3", "--out", out)
        assert os.environ.get("KDB_STORE_AT_EXIT") is None  # the pack's setting undone
    assert result.exit_code == 0, result.output
    return {"manifest": manifest, "out": out, "file": out / f"{arch}.kdb", "result": result}


# -- the manifest ----------------------------------------------------------------------------

def test_demo_manifest_builds_exactly_what_the_demo_builds():
    """Same sources, same option list (options, then -I <demo_kernels>): the same keys."""
    specs = packing.load_manifest(REPO / "prebuilt" / "demo.toml")
    assert [s.name for s in specs] == [p.name for p in demo.PROGRAMS]
    for spec, prog in zip(specs, demo.PROGRAMS):
        assert spec.backend == "opencl" and spec.arches == ()
        assert spec.source == (demo.KERNEL_DIR / prog.file).read_text()
        assert spec.build_options() == [*prog.options, "-I", str(demo.KERNEL_DIR)]


@pytest.mark.parametrize("text, message", [
    ("", "no [[kernel]]"),
    ("[[kernel]]\nname = 'a'\n", "exactly one of 'file' or 'source'"),
    ("[[kernel]]\nname = 'a'\nsource = 'x'\n[[kernel]]\nname = 'a'\nsource = 'y'\n",
     "duplicate kernel name"),
    ("[[kernel]]\nname = 'a'\nsource = 'x'\nflags = []\n", "unknown keys"),
    ("[[kernel]]\nname = 'a'\nfile = 'absent.cl'\n", "cannot read"),
    ("[[kernel]]\nname = 'a'\nsource = 'x'\narches = ['../x']\n", "not valid"),
    ("[[kernel\n", "not valid TOML"),
])
def test_a_bad_manifest_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "m.toml"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match="m.toml") as err:
        packing.load_manifest(path)
    assert message in str(err.value)


def test_manifest_defaults_defines_and_relative_paths(tmp_path):
    (tmp_path / "inc").mkdir()
    (tmp_path / "k.cl").write_text(SCALE)
    path = tmp_path / "m.toml"
    path.write_text('[defaults]\noptions = ["-cl-mad-enable"]\ninclude_dirs = ["inc"]\n'
                    '[[kernel]]\nname = "k"\nfile = "k.cl"\noptions = ["-DA=1"]\n'
                    'defines = { B = 2, C = true }\n')
    [spec] = packing.load_manifest(path)
    assert spec.source == SCALE
    assert spec.build_options() == ["-cl-mad-enable", "-DA=1", "-DB=2", "-DC=1",
                                     "-I", str(tmp_path / "inc")]


def test_pack_and_wheel_doctests():
    from kdb.pack import manifest, inputs as pack_inputs, systemfile

    for module in (packing, manifest, pack_inputs, systemfile, wheel):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# -- pack from a manifest --------------------------------------------------------------------

def test_pack_reports_progress_and_a_summary(small, arch):
    result = small["result"]
    err = result.stderr
    assert "[1/2] scale" in err and "[2/2] add_n" in err and "2/2 kernels done" in err
    assert f"{arch}: writing" in err and "building the wheel" in err
    header, row = result.stdout.splitlines()[:2]
    assert header.split()[:3] == ["ARCH", "FILE", "ENTRIES"] and "SECONDS" in header
    assert row.split()[:3] == [arch, f"{arch}.kdb", "2"]
    assert f"{wheel.module_name(arch)}-1.2.3-py3-none-any.whl" in row
    assert {name for _, name, _ in rows_of(small["file"])} == {"scale", "add_n"}


def test_packed_file_is_a_read_only_system_database(small, arch, tmp_path, monkeypatch,
                                                    cl_ctx):
    """journal_mode=DELETE, head revision, vacuumed, readable without write access, and
    byte for byte unchanged after serving as a system tier."""
    import pyopencl as cl

    import kdb.opencl

    packed = small["file"]
    assert packed.stat().st_mode & 0o777 == 0o644
    d = tmp_path / "system"
    d.mkdir()
    path = d / packed.name
    shutil.copyfile(packed, path)
    header = path.read_bytes()[:100]
    assert header[:16] == b"SQLite format 3\x00"
    assert header[18:20] == b"\x01\x01"  # rollback journal, not WAL (2, 2)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
        assert migrate.revision_of(conn) == migrate.HEAD
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] == 0  # vacuumed
        meta = dict(conn.execute("SELECT name, value FROM meta"))
        assert conn.execute("SELECT count(*) FROM compile_log").fetchone()[0] == 0
        assert conn.execute("SELECT sum(hits) FROM kernels").fetchone()[0] == 0
    finally:
        conn.close()
    assert meta["arch"] == arch
    before = sha256(path)
    path.chmod(0o444)
    d.chmod(0o555)
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(d))
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / "cache"))
    try:
        db = KernelDB()
        for key, name, attributes in rows_of(path):
            hit = db.lookup(HashAttributes.from_canonical(attributes, name))
            assert (hit.tier, hit.path) == ("system", str(path)), name
        prg = kdb.opencl.build(cl_ctx, SCALE, [], db=db, name="scale")
        assert prg.get_info(cl.program_info.KERNEL_NAMES) == "scale"
        assert bookkeeping.records() == []  # served, not compiled
        db.close()
    finally:
        d.chmod(0o755)
    assert sha256(path) == before
    assert sorted(p.name for p in d.iterdir()) == [path.name]


def test_wheel_holds_the_file_the_entry_point_and_a_valid_record(small, arch):
    mod, dist = wheel.module_name(arch), wheel.dist_name(arch)
    [whl] = small["out"].glob("*.whl")
    assert whl.name == f"{mod}-1.2.3-py3-none-any.whl"
    info = f"{mod}-1.2.3.dist-info"
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        assert z.read(f"{mod}/{arch}.kdb") == small["file"].read_bytes()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        assert discovery._parse_group(entry_points, discovery.GROUP) == [(arch, mod)]
        tags = z.read(f"{info}/WHEEL").decode().splitlines()
        assert "Tag: py3-none-any" in tags and "Root-Is-Purelib: true" in tags
        metadata = z.read(f"{info}/METADATA").decode().splitlines()
        assert f"Name: {dist}" in metadata and "Version: 1.2.3" in metadata
        record = list(csv.reader(io.StringIO(z.read(f"{info}/RECORD").decode())))
        assert {row[0] for row in record} == names  # every file listed, nothing else
        assert not any(n.endswith(".py") and n != f"{mod}/__init__.py" for n in names)
        for path, digest, size in record:
            if path == f"{info}/RECORD":
                assert (digest, size) == ("", "")
                continue
            data = z.read(path)
            algo, _, value = digest.partition("=")
            assert algo == "sha256", path
            expect = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert value == expect.decode(), path
            assert int(size) == len(data), path


def test_a_kernel_that_fails_to_compile_is_named_with_its_log(tmp_path, arch, cl_ctx):
    manifest = tmp_path / "m.toml"
    manifest.write_text(SMALL_MANIFEST.replace('[[kernel]]\nname = "add_n"',
                                               f'[[kernel]]\nname = "broken"\nsource = '
                                               f'"""{BROKEN}"""\n\n[[kernel]]\nname = "add_n"'))
    out = tmp_path / "out"
    result = invoke("pack", "--arch", arch, "--manifest", manifest, "--version", "1.0",
                    "--out", out)
    assert result.exit_code == 1
    assert "kernel 'broken' could not be packed" in result.stderr
    assert "undeclared_thing" in result.stderr  # the build log
    assert "--keep-going" in result.stderr
    assert "[3/3] add_n" not in result.stderr  # it stopped at the failure
    assert not out.exists() or list(out.iterdir()) == []

    result = invoke("pack", "--arch", arch, "--manifest", manifest, "--version", "1.0",
                    "--out", out, "--keep-going", "--json")
    assert result.exit_code == 1  # documented: a failure is never a success
    [res] = json.loads(result.stdout)
    assert res["entries"] == 2 and Path(res["wheel"]).is_file()
    [failure] = res["failures"]
    assert failure["kernel"] == "broken" and "undeclared_thing" in failure["reason"]
    assert "FAILED: kernel 'broken'" in result.stderr and "undeclared_thing" in result.stderr
    assert {name for _, name, _ in rows_of(out / f"{arch}.kdb")} == {"scale", "add_n"}


def test_an_opencl_arch_that_is_not_present_names_those_that_are(small, arch, tmp_path):
    result = invoke("pack", "--arch", "sm_90", "--manifest", small["manifest"], "--out",
                    tmp_path / "out")
    assert result.exit_code == 1
    assert "'sm_90'" in result.stderr and arch in result.stderr
    assert "present" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message, code", [  # each a usage error of its option: 2
    (["--arch", "../x"], "not valid", 2),
    (["--arch", "native", "--version", "one"], "not a valid package version", 2),
    (["--arch", "native", "--version", ""], "not a valid package version", 2),
    (["--arch", "native", "--version", "1.0", "--name", "Bad Name"], "prefix", 2),
    (["--arch", "native", "--version", "1.0", "--name", "a/b"], "prefix", 2),
])
def test_bad_arguments_fail_before_compiling(small, tmp_path, args, message, code):
    result = invoke("pack", "--manifest", small["manifest"], "--out", tmp_path / "out", *args)
    assert result.exit_code == code and message in result.stderr
    assert "[1/2]" not in result.stderr


@pytest.mark.parametrize("inputs", [[], ["--manifest", "m.toml", "--from-log"],
                                    ["--manifest", "m.toml", "--from-db", "x.kdb"]])
def test_exactly_one_input_is_required(tmp_path, inputs):
    result = invoke("pack", "--arch", "native", "--out", tmp_path, *inputs)
    assert result.exit_code == 2 and "--manifest" in result.stderr


CUDA_SRC = ('extern "C" __global__ void saxpy(float a, const float *x, float *y) '
            '{ int i = threadIdx.x; y[i] += A * a * x[i]; }')


def test_cuda_arches_cross_compile_without_a_gpu(tmp_path, monkeypatch):
    """nvcc builds sm_80 and sm_90 here (no GPU); kdb.cuda.compile then hits the packed file.
    OpenCL kernels of the same manifest go to OpenCL arches only when named for them."""
    cuda = pytest.importorskip("kdb.backends.cuda")
    try:
        cuda.find_nvcc()
    except Exception as err:  # noqa: BLE001 - no toolkit on this machine
        pytest.skip(f"no nvcc: {err}")
    manifest = tmp_path / "m.toml"
    manifest.write_text(f"""
[[kernel]]
name = "saxpy"
backend = "cuda"
source = '{CUDA_SRC}'
defines = {{ A = 2 }}

[[kernel]]
name = "scale"
source = \"\"\"{SCALE}\"\"\"
arches = ["pocl-x86_64-znver3", "pocl-x86_64-skylake"]
""")
    out = tmp_path / "out"
    result = invoke("pack", "--arch", "sm_80", "--arch", "sm_90", "--manifest", manifest,
                    "--out", out, "--json")
    assert result.exit_code == 0, result.output
    assert [(r["arch"], r["entries"]) for r in json.loads(result.stdout)] == [("sm_80", 1),
                                                                              ("sm_90", 1)]
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", str(out))
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / "cache"))
    for arch in ("sm_80", "sm_90"):
        cubin = cuda.compile(CUDA_SRC, arch=arch, options=["-DA=2"], name="saxpy")
        assert cuda.cubin_arch(cubin) == arch
    assert bookkeeping.records() == []  # both served by the packed files


def _cuda_compilers() -> list[str]:
    from kdb.backends import cuda

    found = []
    for c in cuda.COMPILERS:
        try:
            if cuda.find_compiler(c)[0] == c:
                found.append(c)
        except Exception:  # noqa: BLE001 - a compiler named but broken: not usable here
            pass
    return found


CUDA_MANIFEST = """
[[kernel]]
name = "saxpy_{c}"
backend = "cuda"
compiler = "{c}"
source = '{src}'
defines = {{ A = 2 }}

[[kernel]]
name = "twice_{c}"
backend = "cuda"
compiler = "{c}"
source = '__global__ void twice(float *a) {{ a[threadIdx.x] *= 2.0f; }}'
"""


def _build_twice(tmp_path: Path, inputs: list[str], epoch: str) -> list[Path]:
    """`kdb pack ... --version 1.0.0` twice into two directories; the two runs' outputs."""
    outs = []
    for run in ("a", "b"):
        out = tmp_path / f"out-{run}"
        runner = CliRunner(env={"SOURCE_DATE_EPOCH": epoch})
        result = runner.invoke(cli, [*inputs, "--version", "1.0.0", "--out", str(out)],
                               catch_exceptions=False)
        assert result.exit_code == 0, result.output
        outs.append(out)
    return outs


def test_a_cuda_pack_twice_gives_byte_identical_files_and_wheels(tmp_path, cache_dir):
    """Both compilers where present; from a manifest, then from the user database it left."""
    compilers = _cuda_compilers()
    if not compilers:
        pytest.skip("neither nvcc nor NVRTC is reachable here")
    manifest = tmp_path / "m.toml"
    manifest.write_text("".join(CUDA_MANIFEST.format(c=c, src=CUDA_SRC) for c in compilers))
    inputs = ["pack", "--arch", "sm_80", "--arch", "sm_90", "--manifest", str(manifest)]
    a, b = _build_twice(tmp_path / "manifest", inputs, "1700000000")
    names = sorted(p.name for p in a.iterdir())
    assert names == ["kdb_system_sm_80-1.0.0-py3-none-any.whl", "kdb_system_sm_90-1.0.0-py3-none-any.whl",
                     "sm_80.kdb", "sm_90.kdb"]
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # What made them equal: SOURCE_DATE_EPOCH stamps, no host, sorted rows.
    conn = sqlite3.connect(f"file:{a / 'sm_90.kdb'}?mode=ro&immutable=1", uri=True)
    try:
        rows = conn.execute("SELECT key, created, last_access, compile_seconds, details, "
                            "compiler_free_key FROM kernels ORDER BY rowid").fetchall()
        created = conn.execute("SELECT value FROM meta WHERE name = 'created'").fetchone()
    finally:
        conn.close()
    assert len(rows) == 2 * len(compilers) and created == ("1700000000",)
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert {r[1:4] for r in rows} == {(1700000000.0, 1700000000.0, 0.0)}
    assert not any("host" in json.loads(r[4]) for r in rows) and all(r[5] for r in rows)
    with zipfile.ZipFile(a / "kdb_system_sm_90-1.0.0-py3-none-any.whl") as z:
        assert {i.date_time for i in z.infolist()} == {(2023, 11, 14, 22, 13, 20)}
        assert z.namelist()[-1].endswith(".dist-info/RECORD")
    # From the user database: the same source, the same bytes; another epoch, other bytes.
    user = tmp_path / "user.kdb"
    shutil.copyfile(a / "sm_90.kdb", user)
    from_db = ["pack", "--arch", "sm_90", "--from-db", str(user)]
    c, d = _build_twice(tmp_path / "from-db", from_db, "1700000000")
    for name in ("sm_90.kdb", "kdb_system_sm_90-1.0.0-py3-none-any.whl"):
        assert (c / name).read_bytes() == (d / name).read_bytes() == (a / name).read_bytes()
    [e, _] = _build_twice(tmp_path / "other-epoch", from_db, "1800000000")
    assert (e / "sm_90.kdb").read_bytes() != (c / "sm_90.kdb").read_bytes()


def test_a_manifest_pack_does_not_depend_on_where_the_manifest_is(tmp_path, cache_dir):
    """The same manifest and headers in two directories give the same bytes: the include
    directories' absolute paths (and the compiler's) stayed in each entry's details."""
    compilers = _cuda_compilers()
    if not compilers:
        pytest.skip("neither nvcc nor NVRTC is reachable here")
    outs = []
    for where in ("one", "two/deeper"):
        d = tmp_path / where
        (d / "inc").mkdir(parents=True)
        (d / "inc" / "k.h").write_text("#define A 2\n")
        (d / "m.toml").write_text(
            f'[[kernel]]\nname = "ki"\nbackend = "cuda"\ncompiler = "{compilers[0]}"\n'
            f'source = \'#include "k.h"\\n{CUDA_SRC}\'\ninclude_dirs = ["inc"]\n')
        result = CliRunner(env={"SOURCE_DATE_EPOCH": "1700000000"}).invoke(
            cli, ["pack", "--arch", "sm_90", "--manifest", str(d / "m.toml"), "--version",
                  "1.0.0", "--out", str(d / "out")], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        outs.append(d / "out")
    for name in ("sm_90.kdb", "kdb_system_sm_90-1.0.0-py3-none-any.whl"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_a_manifest_names_the_compiler(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[defaults]\ncompiler = "nvrtc"\n'
                    '[[kernel]]\nname = "a"\nsource = "x"\nbackend = "cuda"\n'
                    '[[kernel]]\nname = "b"\nsource = "y"\nbackend = "cuda"\ncompiler = "nvcc"\n'
                    '[[kernel]]\nname = "c"\nsource = "z"\n')
    assert [(s.name, s.compiler) for s in packing.load_manifest(path)] == [
        ("a", "nvrtc"), ("b", "nvcc"), ("c", None)]
    path.write_text('[[kernel]]\nname = "a"\nsource = "x"\ncompiler = "nvrtc"\n')
    with pytest.raises(InvalidArgumentError, match="compiler"):
        packing.load_manifest(path)  # an OpenCL kernel names no compiler
    path.write_text('[[kernel]]\nname = "a"\nsource = "x"\nbackend = "cuda"\ncompiler = "gcc"\n')
    with pytest.raises(InvalidArgumentError, match="'nvcc' or 'nvrtc'"):
        packing.load_manifest(path)


def test_verify_compares_an_installed_system_file_with_its_wheel_record(small, arch, tmp_path,
                                                                        monkeypatch):
    [whl] = small["out"].glob("*.whl")
    site = tmp_path / "site"
    run_checked([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                 site, whl], cwd=tmp_path)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", "")
    installed = site / wheel.module_name(arch) / f"{arch}.kdb"
    assert installed.read_bytes() == small["file"].read_bytes()

    def mine() -> dict:
        result = invoke("verify", "--arch", arch, "--json")
        [f] = [f for f in json.loads(result.stdout)["files"] if f["path"] == str(installed)]
        return f

    f = mine()
    assert f["ok"] and f["matches_wheel"] is True
    assert any(n.startswith("matches its wheel") for n in f["notes"])
    # Changed after installation, in a byte SQLite does not mind: the header's
    # "version-valid-for" number (sqlite.org/fileformat2.html#database_header, bytes 92-95).
    data = bytearray(installed.read_bytes())
    data[95] ^= 0xFF
    installed.write_bytes(bytes(data))
    f = mine()
    assert not f["ok"] and f["matches_wheel"] is False
    assert any("differs from the sha256 its wheel recorded" in p for p in f["problems"])
    assert invoke("verify", "--arch", arch).exit_code == 1


# -- pack from the latency log or a user database --------------------------------------------

def test_from_log_packs_exactly_the_logged_kernels_and_from_db_all(cache_dir, cl_ctx, arch,
                                                                   tmp_path):
    import kdb.opencl

    db = KernelDB()
    sources = [SCALE, ADD, "__kernel void twice(__global float *x) { x[0] *= 2.0f; }"]
    for i, src in enumerate(sources):
        kdb.opencl.build(cl_ctx, src, ["-DN=1"], db=db, name=f"k{i}")
    db.flush()
    logged = {r.key for r in bookkeeping.records()}
    assert len(logged) == 3
    bookkeeping.forget_compiles()
    kdb.opencl.build(cl_ctx, SCALE, ["-DN=1"], db=db, name="k0")  # a hit: not logged
    assert bookkeeping.records() == []
    extra = HashAttributes(backend="test", source="stored, never compiled", arch=arch)
    assert db.put(extra, b"\x01" * 256)
    db.close()
    user_file = cache_dir / "v1" / f"{arch}.kdb"
    assert keys_in(user_file) == logged | {extra.key}

    result = invoke("pack", "--arch", arch, "--from-log", "--out", tmp_path / "log")
    assert result.exit_code == 0, result.output
    assert keys_in(tmp_path / "log" / f"{arch}.kdb") == logged

    for i, source in enumerate(([], [user_file], [f"sqlite:///{user_file}"],
                                [f"file://{cache_dir}"])):
        out = tmp_path / f"db{i}"
        result = invoke("--cache-dir", cache_dir, "pack", "--arch", arch, "--from-db", *source,
                        "--out", out)
        assert result.exit_code == 0, result.output
        assert keys_in(out / f"{arch}.kdb") == logged | {extra.key}, source


def test_from_db_stores_what_the_store_worker_has_not_yet_at_its_own_priority(
        cache_dir, arch, tmp_path):
    """The store worker gets only CPU nothing else wants: on a busy machine `kdb pack
    --from-db` waited 7.5 minutes for it (issue 28). Here no worker can run at all (its lock
    is held): the pack stores the queued programs itself, in seconds, and says so."""
    import fcntl
    import time

    from kdb import config
    from kdb.storing import spool

    env = {**os.environ, "KDB_CACHE_DIR": str(cache_dir), "KDB_STORE_AT_EXIT": "detach",
           "POCL_CACHE_DIR": str(tmp_path / "pocl")}
    sdir = config.private_dir(spool.spool_dir(cache_dir / "v1", env))
    held = os.open(sdir / spool.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # the worker that would store them never runs
    try:
        code = ("import pyopencl as cl, kdb.opencl\n"
                "plat = [p for p in cl.get_platforms() if 'Portable' in p.name][0]\n"
                "ctx = cl.Context(plat.get_devices()[:1])\n"
                f"kdb.opencl.build(ctx, {SCALE!r}, name='scale')\n"
                f"kdb.opencl.build(ctx, {ADD!r}, ['-DN=1'], name='add')\n")
        run_checked([sys.executable, "-c", code], tmp_path, env)
        # Two programs, the bookkeeping (no user file yet) and the refresh job of its exit.
        assert len(spool.jobs(cache_dir / "v1")) == 4
        start = time.monotonic()
        result = invoke("--cache-dir", cache_dir, "pack", "--arch", arch, "--from-db",
                        "--out", tmp_path / "out")
        took = time.monotonic() - start
    finally:
        os.close(held)
    assert result.exit_code == 0, result.output
    assert len(keys_in(tmp_path / "out" / f"{arch}.kdb")) == 2
    assert "storing 4 job(s) the store worker has not run yet" in result.stderr
    assert took < 60 and spool.jobs(cache_dir / "v1") == []


def test_from_db_errors_are_clear(cache_dir, arch, tmp_path):
    result = invoke("pack", "--arch", arch, "--from-db", tmp_path / "nothing", "--out", tmp_path)
    assert result.exit_code == 1 and "no database for arch" in result.stderr
    result = invoke("pack", "--arch", arch, "--from-db", "mysql://h/db", "--out", tmp_path)
    assert result.exit_code == 1 and "needs a PostgreSQL URL" in result.stderr
    result = invoke("pack", "--arch", arch, "--from-log", "--out", tmp_path)
    assert result.exit_code == 1 and "no database for arch" in result.stderr
    empty = tmp_path / "empty.kdb"  # 0 bytes: was "OperationalError: no such table"
    empty.write_bytes(b"")
    result = invoke("pack", "--arch", arch, "--from-db", empty, "--out", tmp_path / "o")
    assert result.exit_code == 1 and "is empty: no kernel was ever stored" in result.stderr
    assert not (tmp_path / "o").exists()


def test_a_user_file_from_a_newer_kdb_is_never_repacked_as_an_older_revision(cache_dir,
                                                                             tmp_path):
    """Revision 0099 (a newer kdb): pack refuses it, naming what it found and the fix, from
    the database and from its log alike; verify reports it and what it holds."""
    db = KernelDB(use_system=False)
    attrs = HashAttributes(backend="test", source="from a newer kdb", arch="sm_90")
    assert db.put(attrs, b"\x02" * 64)
    db.close()
    user = cache_dir / "v1" / "sm_90.kdb"
    conn = sqlite3.connect(user)
    with conn:
        conn.execute("INSERT INTO compile_log (at, key, name, arch, backend, seconds, missed, "
                     "reason, pid) VALUES (1, ?, 'k', 'sm_90', 'test', 0.1, 'user', '', 1)",
                     (attrs.key,))
        conn.execute("UPDATE alembic_version SET version_num = '0099'")
    conn.close()
    out = tmp_path / "out"
    for inputs in (["--from-db"], ["--from-db", user], ["--from-log"]):
        result = invoke("pack", "--arch", "sm_90", *inputs, "--out", out)
        assert result.exit_code == 1, (inputs, result.output)
        assert "0099" in result.stderr and "newer kdb" in result.stderr, result.stderr
        assert "Upgrade kdb" in result.stderr and "empty" not in result.stderr, result.stderr
        assert not (out / "sm_90.kdb").exists()
    result = invoke("verify")
    assert result.exit_code == 1 and "all sound" not in result.output, result.output
    assert "0099" in result.output and "1 entries this kdb cannot check" in result.output
    assert "upgrade kdb" in result.output and "--repair" not in result.output


# -- several system databases for one arch ---------------------------------------------------

def _split(small: dict, arch: str, dest: Path) -> dict[str, Path]:
    """One system file per kernel of the small pack, each in its own directory."""
    out = {}
    for key, name, _ in rows_of(small["file"]):
        res = packing.write_system_db(dest / name / f"{arch}.kdb", arch, [small["file"]], {key})
        assert res.entries == 1
        out[name] = res.path
    return out


def test_two_system_directories_for_one_arch_both_serve(small, arch, tmp_path, monkeypatch,
                                                        cl_ctx, caplog):
    import kdb.opencl

    files = _split(small, arch, tmp_path / "sys")
    full = tmp_path / "full"
    full.mkdir()
    shutil.copyfile(small["file"], full / f"{arch}.kdb")
    order = [files["scale"].parent, full, files["add_n"].parent]
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", os.pathsep.join(map(str, order)))
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / "cache"))
    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        kdb.opencl.build(cl_ctx, SCALE, [], db=db, name="scale")
        kdb.opencl.build(cl_ctx, ADD, ["-DN=3"], db=db, name="add_n")
    assert bookkeeping.records() == []
    assert NOSYS not in caplog.text
    served = {name: db.lookup(HashAttributes.from_canonical(attrs, name)).path
              for _, name, attrs in rows_of(small["file"])}
    # The first directory that holds a key answers: add_n is in `full` before its own file.
    assert served == {"scale": str(files["scale"]), "add_n": str(full / f"{arch}.kdb")}
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH",
                       os.pathsep.join(str(files[n].parent) for n in ("scale", "add_n")))
    db = KernelDB()
    served = {name: db.lookup(HashAttributes.from_canonical(attrs, name)).path
              for _, name, attrs in rows_of(small["file"])}
    assert served == {n: str(p) for n, p in files.items()}


def test_a_system_file_from_a_newer_schema_is_skipped_and_the_next_serves(
        small, arch, tmp_path, monkeypatch, caplog):
    future, good = tmp_path / "future", tmp_path / "good"
    for d in (future, good):
        d.mkdir()
        shutil.copyfile(small["file"], d / f"{arch}.kdb")
    conn = sqlite3.connect(future / f"{arch}.kdb")
    with conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    conn.close()
    before = sha256(future / f"{arch}.kdb")
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", f"{future}{os.pathsep}{good}")
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / "cache"))
    [(_, name, attrs)] = [r for r in rows_of(small["file"]) if r[1] == "scale"]
    with caplog.at_level(logging.WARNING, logger="kdb"):
        hit = KernelDB().lookup(HashAttributes.from_canonical(attrs, name))
    assert hit.path == str(good / f"{arch}.kdb")
    assert "9999" in caplog.text and str(future / f"{arch}.kdb") in caplog.text
    assert sha256(future / f"{arch}.kdb") == before
    systems = {s["path"]: s for s in info.info(tmp_path / "cache" / "v1",
                                                 tmp_path / "cache")["system_databases"]}
    assert "newer than this kdb" in systems[str(future / f"{arch}.kdb")]["problem"]
    assert systems[str(good / f"{arch}.kdb")]["problem"] == ""


def test_two_installed_packages_for_one_arch_both_serve_and_info_lists_them(
        small, arch, tmp_path, monkeypatch, caplog):
    """Two wheels for one arch (kdb's and a framework's, `--name`), installed by pip; a
    package whose file is gone is reported by `kdb info` and skipped, never fatal."""
    files = _split(small, arch, tmp_path / "sys")
    wheels = []
    for name, prefix, version in (("scale", "kdb-system", "1.0"),
                                  ("add_n", "myfw-kernels", "2.0")):
        result = invoke("pack", "--arch", arch, "--from-db", files[name], "--version", version,
                        "--name", prefix, "--out", tmp_path / "wheels")
        assert result.exit_code == 0, result.output
        wheels.append(tmp_path / "wheels" /
                      f"{wheel.module_name(arch, prefix)}-{version}-py3-none-any.whl")
    site = tmp_path / "site"
    run_checked([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                 site, *wheels], cwd=tmp_path)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / "cache"))
    kdb_mod, fw_mod = wheel.module_name(arch), wheel.module_name(arch, "myfw-kernels")
    srcs = discovery.sources_for(arch, [])
    assert [(s.origin, s.path) for s in srcs] == [
        (f"package {kdb_mod} 1.0", site / kdb_mod / f"{arch}.kdb"),
        (f"package {fw_mod} 2.0", site / fw_mod / f"{arch}.kdb")]
    db = KernelDB(system_path=[])
    attrs = {name: HashAttributes.from_canonical(a, name) for _, name, a in rows_of(small["file"])}
    assert db.lookup(attrs["scale"]).path == str(site / kdb_mod / f"{arch}.kdb")
    assert db.lookup(attrs["add_n"]).path == str(site / fw_mod / f"{arch}.kdb")

    result = invoke("info", "--json")
    assert result.exit_code == 0, result.output
    listed = {s["package"]: s for s in json.loads(result.stdout)["system_databases"]
              if s["arch"] == arch}
    for mod, version in ((kdb_mod, "1.0"), (fw_mod, "2.0")):
        s = listed[mod]
        assert (s["version"], s["entries"], s["problem"]) == (version, 1, "")
        assert s["size"] == (site / mod / f"{arch}.kdb").stat().st_size
    text = invoke("info").stdout
    assert f"package {fw_mod} 2.0" in text and "1 entries" in text

    (site / fw_mod / f"{arch}.kdb").unlink()  # a broken install
    result = invoke("info", "--json")
    assert result.exit_code == 0
    [broken] = [s for s in json.loads(result.stdout)["system_databases"]
                if s["package"] == fw_mod]
    assert broken["problem"] == "file missing"
    assert "BROKEN: file missing" in invoke("info").stdout
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db = KernelDB(system_path=[])
        assert db.lookup(attrs["add_n"]) is None
        assert db.lookup(attrs["scale"]).tier == "system"
    assert "file missing" in caplog.text and fw_mod in caplog.text


# -- end to end: a new virtual environment ---------------------------------------------------

def _demo_worker(venv: Path, work: Path) -> tuple[dict, str]:
    """Run the demo's worker with the venv's Python, an empty user cache and PoCL cache."""
    work.mkdir()
    out = work / "figures.json"
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "kdb.demo.runs", "--worker", str(out)], cwd=work,
        env={**os.environ, "KDB_CACHE_DIR": str(work / "kdb-cache"),
             "POCL_CACHE_DIR": str(work / "pocl-cache")},
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stderr


@pytest.mark.slow
def test_installed_system_wheel_serves_the_demo_with_zero_compiles(kdb_venv, arch, tmp_path):
    n = len(demo.PROGRAMS)
    out = tmp_path / "dist"
    kdb_script = Path(sys.executable).parent / "kdb"
    proc = run_checked([kdb_script, "pack", "--arch", "native", "--manifest",
                        REPO / "prebuilt" / "demo.toml", "--version", "0.1.0", "--out", out],
                       cwd=tmp_path)
    assert f"[{n}/{n}] nbody" in proc.stderr and f"{n}/{n} kernels done" in proc.stderr
    [whl] = out.glob("*.whl")
    assert whl.name == f"{wheel.module_name(arch)}-0.1.0-py3-none-any.whl"
    assert whl.name in proc.stdout
    # Installed by pip into a venv of its own over the shared kdb_venv (kdb, pyopencl): the
    # tests that share that one must not see this system database.
    with_wheel = venv_over(tmp_path / "venv", purelib(kdb_venv / "bin" / "python"), whl)
    figures, stderr = _demo_worker(with_wheel, tmp_path / "with-wheel")
    assert figures["arch"] == arch
    assert figures["compiles"] == 0, figures["compiled"]
    assert NOSYS not in stderr, stderr
    assert figures["kernels"] == n and figures["ok"]
    assert [r["name"] for r in figures["results"] if r["ok"]] == [p.name for p in
                                                                   demo.PROGRAMS]
    info = json.loads(run_checked([with_wheel / "bin" / "python", "-m", "kdb.cli", "info",
                                   "--json"], cwd=tmp_path).stdout)
    [sysdb] = [s for s in info["system_databases"] if s["arch"] == arch]
    assert sysdb["path"].startswith(str(with_wheel))
    assert (sysdb["package"], sysdb["version"]) == (wheel.module_name(arch), "0.1.0")
    assert (sysdb["entries"], sysdb["problem"]) == (n, "")
    assert sysdb["size"] == (out / f"{arch}.kdb").stat().st_size
    assert sha256(Path(sysdb["path"])) == sha256(out / f"{arch}.kdb")
    figures, stderr = _demo_worker(kdb_venv, tmp_path / "without-wheel")
    assert NOSYS in stderr
    assert figures["compiles"] == n and figures["ok"]


#: A start-up hook (``sitecustomize``, first on PYTHONPATH) that makes the modules named in
#: $HIDE unimportable in that process, as on a machine where they are not installed.
HIDE = '''
import os, sys

class _Hidden:
    names = set(os.environ["HIDE"].split(","))

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, _Hidden())
'''

MANIFESTS = {"triton": '''
[[kernel]]
name = "add_64"
backend = "triton"
file = "kernels.py"
function = "add"
signature = { x_ptr = "*fp32", n = "i32", BLOCK = "constexpr" }
constexprs = { BLOCK = 64 }
arches = ["sm_90"]
''', "pyopencl": '''
[[kernel]]
name = "twice"
backend = "opencl"
source = "__kernel void twice(__global float *a) { a[get_global_id(0)] *= 2.0f; }"
'''}


@pytest.mark.parametrize("hidden, extra", [("triton", "kdb[triton]"),
                                           ("pyopencl", "kdb[opencl]")])
def test_pack_without_a_back_ends_module_says_which_extra_to_install(tmp_path, hidden, extra):
    """The real ``kdb`` script where Triton (or pyopencl) cannot be imported: one line that
    names the extra, exit status 1, no traceback (Triton's was ModuleNotFoundError's, and
    pyopencl's said that no OpenCL device is present)."""
    (tmp_path / "hide").mkdir()
    (tmp_path / "hide" / "sitecustomize.py").write_text(HIDE)
    (tmp_path / "kernels.py").write_text("add = None\n")
    (tmp_path / "kernels.toml").write_text(MANIFESTS[hidden])
    path = os.pathsep.join(filter(None, [str(tmp_path / "hide"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "HIDE": hidden,
           "KDB_CACHE_DIR": str(tmp_path / "cache")}
    kdb = Path(sys.executable).with_name("kdb")
    proc = subprocess.run([str(kdb), "pack", "--arch", "sm_90", "--manifest", "kernels.toml",
                           "--version", "1.0.0", "--out", "out"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("Error:")]
    assert line.endswith(f"pip install '{extra}'") and f"No module named '{hidden}'" in line
    assert ("add_64" if hidden == "triton" else "twice") in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_pack_onto_a_full_disk_says_so_in_one_line(tmp_path, cache_dir):
    """``--out`` on a file system with no room: SQLAlchemy's wrapper of the driver's error
    gave a 30-line traceback (the command line turned only sqlite3's own into a message)."""
    import os

    if os.getuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small tmpfs needs root and mount(8)")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs is not allowed here")
    try:
        db = KernelDB(cache_dir)
        for i in range(40):
            db.put(HashAttributes("opencl", f"k{i}", "a1", name=f"k{i}"), os.urandom(20_000))
        db.close()
        room = os.statvfs(small)
        (small / "filler").write_bytes(b"x" * (room.f_bavail * room.f_frsize - 16384))
        result = CliRunner().invoke(cli, ["pack", "--arch", "a1", "--from-db", str(cache_dir),
                                          "--out", str(small / "dist")])
        assert result.exit_code == 1, result.output
        assert not isinstance(result.exception, Exception) or isinstance(
            result.exception, SystemExit), result.exception
        assert "disk is full" in result.output and "Traceback" not in result.output, \
            result.output
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_the_pack_command_the_no_system_database_warning_suggests_works_as_written(
        cache_dir, tmp_path, monkeypatch, caplog):
    """The warning said `kdb pack --arch a1`, a usage error as written (no input, no --out)."""
    import logging
    import re
    import shlex

    db = KernelDB()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db.get_or_compile(HashAttributes("test", "kernel", "a1", name="k"), lambda: b"b" * 64)
    db.close()
    [said] = [r.getMessage() for r in caplog.records if "no system kernel database" in
              r.getMessage()]
    command = re.search(r"`kdb (pack [^`]*)`", said).group(1)
    monkeypatch.chdir(tmp_path)
    result = invoke(*shlex.split(command))
    assert result.exit_code == 0, (command, result.output)
    assert (tmp_path / "DIR" / "a1.kdb").is_file() and "DIR" in said


@pytest.mark.parametrize("case", ["no-device-arch", "no-kernel-arch", "no-cuda-compiler",
                                  "epoch-after-2107", "out-under-a-file"])
def test_a_pack_that_cannot_finish_fails_before_anything_is_compiled_or_written(
        case, tmp_path, cache_dir, arch, monkeypatch):
    """Each was found only at its turn: the arches before were compiled, written and made
    wheels of, then the pack failed (no device of sm_90's, no kernel for sm_80); a CUDA
    compiler missing told the packager to install the system package being built; a
    SOURCE_DATE_EPOCH past 2107 crashed building the wheel; an --out under a file failed
    after every compile."""
    manifest = tmp_path / "m.toml"
    manifest.write_text(SMALL_MANIFEST)
    out = tmp_path / "out"
    arches = [arch, "sm_90"]
    if case == "no-kernel-arch":
        manifest.write_text('[[kernel]]\nname = "c"\nbackend = "cuda"\n'
                            f'source = \'{CUDA_SRC}\'\narches = ["sm_90"]\n')
        arches = ["sm_90", "sm_80"]
    if case == "no-cuda-compiler":
        manifest.write_text(f'[[kernel]]\nname = "c"\nbackend = "cuda"\ncompiler = "nvcc"\n'
                            f'source = \'{CUDA_SRC}\'\n')
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
        monkeypatch.delenv("KDB_NVCC", raising=False)
        monkeypatch.delenv("CUDA_HOME", raising=False)
        monkeypatch.delenv("CUDA_PATH", raising=False)
        arches = ["sm_90"]
    if case == "epoch-after-2107":
        monkeypatch.setenv("SOURCE_DATE_EPOCH", "4354819200")
        arches = [arch]
    if case == "out-under-a-file":
        (tmp_path / "afile").write_text("")
        out = tmp_path / "afile" / "sub"
        arches = [arch]
    before = len(bookkeeping.records())
    result = CliRunner().invoke(cli, ["pack", *(x for a in arches for x in ("--arch", a)),
                                      "--manifest", str(manifest), "--version", "1.0.0",
                                      "--out", str(out)])
    assert result.exit_code in (1, 2), result.output
    assert isinstance(result.exception, SystemExit), result.exception
    assert "compiling" not in result.output, result.output  # nothing compiled, ...
    assert not list(tmp_path.glob("out/*")), list(tmp_path.glob("out/*"))  # ... or written
    assert len(bookkeeping.records()) == before
    said = {"no-device-arch": "no OpenCL device of arch 'sm_90'",
            "no-kernel-arch": "no kernel for arch 'sm_80': its kernels name sm_90",
            "no-cuda-compiler": "need nvcc",
            "epoch-after-2107": "after 2107-12-31",
            "out-under-a-file": "nothing can be written there"}[case]
    assert said in result.output, result.output
    assert "kdb-system-" not in result.output, result.output


def test_a_manifest_pack_leaves_nothing_in_the_temporary_directory(tmp_path, cache_dir):
    """With kdb's default store mode the pack's builds were noted for early stores, kept at
    exit into the pack's removed work directory: a copy of every pack was left in $TMPDIR."""
    manifest = tmp_path / "m.toml"
    manifest.write_text(SMALL_MANIFEST)
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "KDB_STORE_AT_EXIT"}
    proc = subprocess.run([str(Path(sys.executable).with_name("kdb")), "pack", "--arch",
                           "native", "--manifest", str(manifest), "--out", str(tmp_path / "o")],
                          env={**env, "TMPDIR": str(temp), "POCL_CACHE_DIR": str(tmp_path / "p")},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert list(temp.iterdir()) == []

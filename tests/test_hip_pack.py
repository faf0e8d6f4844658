"""`kdb pack` of HIP kernels on the real hipcc and HIPRTC (no GPU): one file per processor,
byte-identical twice, served by its installed wheel to a process with no hipcc; arches the
toolchain cannot build fail before anything compiles. Skips, saying why, without hipcc."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

import kdb
import kdb.hip
from kdb import BackendUnavailableError, InvalidArgumentError
from kdb.backends.hip import packing as hip_packing
from kdb.cli import cli
from kdb.pack import build as packing
from kdb.pack.manifest import KernelSpec, applicable

from test_hip import HIPCC, HIPRTC, needs_hipcc, needs_hiprtc

SCALE = '#include <hip/hip_runtime.h>\nextern "C" __global__ void scale(float *a) { a[threadIdx.x] *= S; }'
TWICE = 'extern "C" __global__ void twice(float *a) { a[threadIdx.x] *= 2.0f; }'
ARCHES = ("gfx90a", "gfx1030")
# scale: hipcc, the processors alone; twice: HIPRTC where found, gfx90a with and without
# its features (two entries in gfx90a.kdb) and gfx1030.
MANIFEST = f"""
[defaults]
backend = "hip"

[[kernel]]
name = "scale"
source = {json.dumps(SCALE)}
defines = {{ S = 2 }}
compiler = "hipcc"

[[kernel]]
name = "twice"
source = '{TWICE}'
arches = ["gfx90a:sramecc+:xnack-", "gfx90a", "gfx1030"]
{'compiler = "hiprtc"' if HIPRTC else ''}
"""
WHEELS = [f"kdb_system_{a}-1.0.0-py3-none-any.whl" for a in ARCHES]


def _pack(args: list[object], epoch: str = "1700000000"):
    runner = CliRunner(env={"SOURCE_DATE_EPOCH": epoch})
    return runner.invoke(cli, ["pack", *map(str, args)], catch_exceptions=False)


def _code_objects(path: Path) -> dict[tuple[str, str], bytes]:
    """``{(kernel name, target ID): code object}`` of a system file."""
    from kdb.file import codec
    from kdb.file.kernelfile import KernelFile

    f = KernelFile(path, tier="system", readonly=True)
    try:
        rows = [(name, f.fetch(key)) for key, name in f.query("SELECT key, name FROM kernels")]
    finally:
        f.close()
    bins = [(n, codec.decode(r.codec, r.blob, r.raw_size, r.checksum)) for n, r in rows]
    got = {(n, kdb.hip.code_object_target(b)): b for n, b in bins}
    assert len(got) == len(rows)
    return got


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> dict:
    """The manifest packed twice for gfx90a and gfx1030, with wheels, into two directories."""
    if HIPCC is None:
        pytest.skip("hipcc is not on PATH (apt-get install hipcc; tools/ensure_hip.sh)")
    tmp = tmp_path_factory.mktemp("hip-pack")
    (tmp / "m.toml").write_text(MANIFEST)
    outs = []
    for run in ("a", "b"):
        out = tmp / f"out-{run}"
        arches = [a for arch in ARCHES for a in ("--arch", arch)]
        result = _pack([*arches, "--manifest", tmp / "m.toml", "--version", "1.0.0",
                        "--out", out, "--json"])
        assert result.exit_code == 0, result.output
        outs.append(out)
    return {"tmp": tmp, "a": outs[0], "b": outs[1], "json": json.loads(result.stdout)}


def test_a_hip_pack_writes_one_file_per_processor_byte_identical_twice(packed):
    a, b = packed["a"], packed["b"]
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted([*WHEELS, "gfx1030.kdb", "gfx90a.kdb"])  # no CU count in a name
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert [(r["arch"], r["entries"]) for r in packed["json"]] == [("gfx90a", 3), ("gfx1030", 2)]
    assert set(_code_objects(a / "gfx90a.kdb")) == {
        ("scale", "gfx90a"), ("twice", "gfx90a"), ("twice", "gfx90a:sramecc+:xnack-")}
    assert set(_code_objects(a / "gfx1030.kdb")) == {("scale", "gfx1030"), ("twice", "gfx1030")}
    conn = sqlite3.connect(f"file:{a / 'gfx90a.kdb'}?mode=ro&immutable=1", uri=True)
    try:
        rows = conn.execute("SELECT created, compile_seconds, details FROM kernels").fetchall()
    finally:
        conn.close()
    assert {r[:2] for r in rows} == {(1700000000.0, 0.0)}
    assert not any("host" in json.loads(r[2]) for r in rows)


SERVE = r"""
import json, sys
import kdb, kdb.hip
from kdb import bookkeeping
out = {}
for arch in sys.argv[1:]:
    co = kdb.hip.compile(%r, arch, ["-DS=2"], compiler="hipcc", name="scale")
    out[arch] = co.hex()
out["twice"] = kdb.hip.compile(%r, "gfx90a:sramecc+:xnack-", name="twice",
                               compiler=%r).hex()
out["compiles"] = len(bookkeeping.records())
print(json.dumps(out))
"""


def test_the_installed_wheel_serves_a_process_with_no_hipcc(packed, tmp_path):
    """pip installs each wheel (into a directory on PYTHONPATH: its entry point is found);
    a process with no hipcc on PATH is served every code object, compiling nothing."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-index", "--target", site, *(packed["a"] / w for w in WHEELS)],
                   check=True, capture_output=True)
    env = {"PATH": str(tmp_path / "no-bin"), "PYTHONPATH": str(site), "KDB_TRACE": "1",
           "KDB_CACHE_DIR": str(tmp_path / "cache"), "KDB_SYSTEM_DB_PATH": ""}
    compiler = "hiprtc" if HIPRTC else "hipcc"
    proc = subprocess.run([sys.executable, "-c", SERVE % (SCALE, TWICE, compiler), *ARCHES],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["compiles"] == 0
    for arch in ARCHES:
        packed_co = _code_objects(packed["a"] / f"{arch}.kdb")[("scale", arch)]
        assert bytes.fromhex(out[arch]) == packed_co
        assert f"kdb_system_{arch}/{arch}.kdb" in proc.stderr  # served from the system tier
    assert bytes.fromhex(out["twice"]) == _code_objects(
        packed["a"] / "gfx90a.kdb")[("twice", "gfx90a:sramecc+:xnack-")]


@needs_hipcc
def test_from_db_packs_the_user_file_of_each_processor(cache_dir, tmp_path):
    db = kdb.KernelDB()
    built = {arch: kdb.hip.compile(SCALE, arch, ["-DS=3"], db=db, compiler="hipcc")
             for arch in ARCHES}
    db.close()
    result = _pack([*(x for a in ARCHES for x in ("--arch", a)), "--from-db", "--json",
                    "--out", tmp_path / "out"])
    assert result.exit_code == 0, result.output
    assert [(r["arch"], r["entries"]) for r in json.loads(result.stdout)] == [
        (a, 1) for a in ARCHES]
    for arch in ARCHES:
        assert _code_objects(tmp_path / "out" / f"{arch}.kdb") == {("scale", arch): built[arch]}


@needs_hipcc
@pytest.mark.parametrize("arch, said", [("gfx942", "does not know the AMD GPU 'gfx942'"),
                                        ("gfx1100", "device libraries have no bitcode")])
def test_an_arch_the_toolchain_cannot_build_fails_before_anything_compiles(
        tmp_path, cache_dir, arch, said):
    (tmp_path / "m.toml").write_text(MANIFEST)
    out = tmp_path / "out"
    with pytest.raises(InvalidArgumentError, match=said) as err:
        packing.pack(["gfx90a", arch], manifest=tmp_path / "m.toml", out_dir=out)
    assert f"--arch {arch}" in str(err.value) and "gfx90a, gfx90c, gfx940" in str(err.value)
    assert "newer ROCm" in str(err.value)
    assert not out.exists()  # gfx90a was not packed first


@needs_hipcc
def test_a_missing_toolchain_names_the_package_before_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no-rocm"))
    (tmp_path / "m.toml").write_text(MANIFEST)
    with pytest.raises(BackendUnavailableError, match="apt-get install hipcc"):
        packing.pack(["gfx90a"], manifest=tmp_path / "m.toml", out_dir=tmp_path / "out")


@needs_hiprtc
def test_a_target_id_that_is_not_well_formed_is_named(tmp_path):
    (tmp_path / "m.toml").write_text('[[kernel]]\nname = "t"\nbackend = "hip"\n'
                                     f"source = '{TWICE}'\narches = [\"gfx90a:foo+\"]\n")
    with pytest.raises(InvalidArgumentError, match="kernel 't'.*'foo\\+' is not a feature"):
        packing.pack(["gfx90a"], manifest=tmp_path / "m.toml", out_dir=tmp_path / "out")


def test_hip_kernels_go_to_gfx_processors_and_name_hipcc_or_hiprtc(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('[defaults]\ncompiler = "hiprtc"\n'
                    '[[kernel]]\nname = "a"\nsource = "x"\nbackend = "hip"\n'
                    '[[kernel]]\nname = "b"\nsource = "y"\nbackend = "hip"\n'
                    'arches = ["gfx90a:xnack-"]\ncompiler = "hipcc"\n'
                    '[[kernel]]\nname = "c"\nsource = "z"\nbackend = "cuda"\n')
    specs = packing.load_manifest(path)
    assert [(s.name, s.compiler) for s in specs] == [("a", "hiprtc"), ("b", "hipcc"),
                                                     ("c", None)]
    assert [s.name for s in applicable(specs, "gfx90a")] == ["a", "b"]
    assert [s.name for s in applicable(specs, "gfx1030")] == ["a"]
    assert [s.name for s in applicable(specs, "sm_90")] == ["c"]
    assert hip_packing.targets(specs[1].arches, "gfx90a") == ["gfx90a:xnack-"]
    path.write_text('[[kernel]]\nname = "a"\nsource = "x"\nbackend = "hip"\ncompiler = "nvcc"\n')
    with pytest.raises(InvalidArgumentError, match="'hipcc' or 'hiprtc'"):
        packing.load_manifest(path)
    path.write_text('[defaults]\ncompiler = "gcc"\n[[kernel]]\nname = "a"\nsource = "x"\n')
    with pytest.raises(InvalidArgumentError, match="none kdb runs"):
        packing.load_manifest(path)


def test_doctests():
    import doctest

    from kdb.pack import manifest

    for mod in (hip_packing, manifest):
        assert doctest.testmod(mod).failed == 0
    assert KernelSpec("k", "", backend="hip", arches=("gfx90a:xnack-",)).processors() == [
        "gfx90a"]

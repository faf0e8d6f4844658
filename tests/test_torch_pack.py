"""torch.compile's entries in a pack, for real: a cold run stores them, ``kdb pack --from-db``
wraps them in a wheel for this torch and Python, pip installs it into a second venv at
another path (torch there too), and a fresh process there with every cache empty compiles no
graph and builds no C++ module, with torch's own counters saying so. And what must not be
served: a damaged entry is dropped and compiled again. Skips where torch is absent."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import torch_step as step

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'kdb[torch]')")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cold(torch_cold):
    """One cold compile with kdb on, its entries in a kdb cache of this module's own
    (conftest: made once a run)."""
    env, root, first = torch_cold
    assert first["fx_miss"] >= 2 and first["cpp_builds"] > 0  # it compiled
    return env, root, first


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import _torch_pack

    return _torch_pack


@pytest.mark.slow
def test_a_pack_installed_in_another_venv_serves_a_fresh_process_everything(cold, bench,
                                                                            tmp_path):
    from kdb.backends.torch.targets import host_arch

    env, root, first = cold
    arch = host_arch()
    wheel = bench.build_pack(root / "kdb", arch, tmp_path / "dist")
    tag = "cp" + sys.implementation.cache_tag.removeprefix("cpython-")
    assert wheel.name.endswith(f"-1.0.0-{tag}-none-any.whl")  # pip installs it on this Python only
    with zipfile.ZipFile(wheel) as z:
        [meta] = [n for n in z.namelist() if n.endswith("/METADATA")]
        summary = z.read(meta).decode()
    assert f"torch {torch.__version__}" in summary and sys.implementation.cache_tag in summary
    python = bench.other_venv(tmp_path / "elsewhere" / "venv",
                              [bench.kdb_wheel(tmp_path / "kdb-dist"), wheel])
    where = subprocess.run([str(python), "-c", "import kdb, torch; print(kdb.__file__); "
                            "print(torch.__file__)"], capture_output=True, text=True,
                           check=True, cwd=tmp_path).stdout.split()
    assert all(w.startswith(str(tmp_path / "elsewhere")) for w in where), where

    fresh = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    fresh.update(KDB_CACHE_DIR=str(tmp_path / "fresh-kdb"), KDB_AUTO="1")
    got, _ = step(python, fresh, tmp_path / "fresh")
    assert (got["fx_miss"], got["aot_miss"], got["cpp_builds"]) == (0, 0, 0), got
    assert got["fx_hit"] == first["fx_miss"] and got["digest"] == first["digest"]


def test_a_pack_for_another_python_is_refused_by_pip(bench, tmp_path):
    """The wheel's tag names the Python its entries load into: pip refuses it elsewhere."""
    from kdb.pack.wheel import build_wheel
    from kdb.pack.builtfor import BuiltFor

    (tmp_path / "cpu-x.kdb").write_bytes(b"")
    wheel = build_wheel(tmp_path / "cpu-x.kdb", "cpu-x", "1.0.0", tmp_path / "dist",
                        built=BuiltFor((("python", ("cpython-399",)),), "cpython-399"))
    assert wheel.name.endswith("-cp399-none-any.whl")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "not a supported wheel" in proc.stderr, proc.stderr


def _rewrite(kdb_file: Path, like: str, damage, limit: int = -1) -> int:
    """Entries whose name starts with ``like`` (the first ``limit`` by name; -1: all)
    rewritten as ``damage(raw, blob)`` makes them: ``("raw", bytes)`` in a sound zstd frame
    with its checksum, or ``("blob", bytes)``."""
    import zstandard

    from kdb.file.codec import decode

    with sqlite3.connect(kdb_file) as conn:
        rows = conn.execute("SELECT key, codec, blob, raw_size, checksum FROM kernels "
                            "WHERE name LIKE ? ORDER BY name LIMIT ?", (like + "%", limit)
                            ).fetchall()
        for key, *frame in rows:
            kind, data = damage(decode(*frame), frame[1])
            if kind == "raw":
                blob = zstandard.ZstdCompressor(write_checksum=True).compress(data)
                conn.execute("UPDATE kernels SET blob = ?, raw_size = ?, checksum = ? "
                             "WHERE key = ?", (blob, len(data), hashlib.sha256(data).hexdigest(),
                                               key))
            else:
                conn.execute("UPDATE kernels SET blob = ? WHERE key = ?", (data, key))
    return len(rows)


def _flipped(blob: bytes) -> bytes:
    out = bytearray(blob)
    out[len(out) // 2] ^= 0xFF
    return bytes(out)


@pytest.mark.slow
def test_damaged_entries_are_dropped_and_compiled_again_never_loaded(cold, tmp_path):
    """Graphs cut short (their frame sound: only Inductor's format says so), the AOTAutograd
    entry with a byte flipped (the codec's checksum says so), a C++ module cut short (only
    the ELF header says so: loading it would fail): each is dropped and compiled again, and
    the step gives the same bits. The graphs compiled again ask for every C++ module: the
    sound ones are served, the cut one is built (one, not all: a cold step's 35 CPU-s)."""
    from kdb.backends.torch.targets import host_arch

    env, root, first = cold
    shutil.copytree(root / "kdb", tmp_path / "kdb")
    kdb_file = tmp_path / "kdb" / "v1" / f"{host_arch()}.kdb"
    assert _rewrite(kdb_file, "fx-graph", lambda raw, _: ("raw", raw[:len(raw) // 2])) >= 2
    assert _rewrite(kdb_file, "autograd", lambda _, blob: ("blob", _flipped(blob))) == 1
    assert _rewrite(kdb_file, "cpp:", lambda raw, _: ("raw", raw[:len(raw) - 100]), 1) == 1
    damaged = {**env, "KDB_CACHE_DIR": str(tmp_path / "kdb"), "KDB_AUTO": "1"}
    got, stderr = step(Path(sys.executable), damaged, tmp_path / "damaged")
    assert (got["fx_miss"], got["aot_miss"]) == (first["fx_miss"], 1), got
    assert got["cpp_builds"] == 1, got  # the cut module built again, never loaded
    assert got["digest"] == first["digest"]
    assert "dropped" in stderr, stderr[-3000:]


def test_kdb_explain_names_another_python(tmp_path, monkeypatch):
    """An entry keyed for another Python is a miss whose nearest entry differs in the
    compiler, and ``kdb explain`` says which part: "another python"."""
    from click.testing import CliRunner

    from kdb import KernelDB
    from kdb.cli import cli
    from kdb.keys import HashAttributes

    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / "kdb"))
    db = KernelDB(system_path=[])
    for python in ("cpython-399", "cpython-311"):  # the later compile is the one explained
        db.get_or_compile(HashAttributes(
            backend="torch", source="pt2:fx-graph-v1::fabc:c1", arch="cpu-x",
            compiler=(("torch", "2.13.0+cpu"), ("python", python)),
            name="fx-graph-v1:fabc"), lambda: b"{}")
    db.close()
    res = CliRunner().invoke(cli, ["explain", "fx-graph-v1:fabc", "--json"])
    assert res.exit_code == 0, res.output
    why = json.loads(res.output)["why"]
    assert "differs in compiler (another python)" in why, why

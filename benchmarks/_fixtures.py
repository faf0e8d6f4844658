"""Fixtures several scenarios share, built once per run in the workspace on first use.

- a kdb user tier primed by a kdb start-up (on a PoCL cache a plain pyopencl start-up primed);
- the floor: the very binaries kdb stored, as plain files;
- a PoCL cache primed by both a source start-up and a start-up from the stored binaries;
- a system tier: ``kdb.pack.build.write_system_db`` from the primed user file.
"""

from __future__ import annotations

import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from _harness import BenchError, Workspace, child, count_rows, kdb_files


def _pocl_source_primed(ws: Workspace) -> Path:
    """A POCL_CACHE_DIR after a plain pyopencl start-up: every program built from source
    and every kernel launched once."""

    def build() -> Path:
        d = ws.path / "pocl-primed"
        ws.log(f"priming PoCL's cache with {ws.opts.kernels} kernels")
        child("opencl", {"mode": "pyopencl", "workload": "kernels", "kernels": ws.opts.kernels},
              ws.env(POCL_CACHE_DIR=d))
        return d

    return ws.memo("pocl_source_primed", build)


def _copy(src: Path, ws: Workspace) -> Path:
    dst = ws.fresh("pocl-warm")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def pocl_primed(ws: Workspace) -> Path:
    """A POCL_CACHE_DIR in the steady state of repeated start-ups: primed by a source
    start-up, then by a start-up that loads the stored binaries (PoCL caches a program
    loaded from a binary under that binary's own hash: without this step the first arm to
    load binaries pays for PoCL writing them to its cache). Arms get copies, so every arm
    and run starts from the same state."""

    def build() -> Path:
        d = _pocl_source_primed(ws)
        bins = floor_bins(ws)
        ws.log("priming PoCL's cache with the stored binaries")
        child("opencl", {"mode": "floor", "workload": "kernels", "kernels": ws.opts.kernels,
                         "bin_dir": str(bins)}, ws.env(POCL_CACHE_DIR=d))
        return d

    return ws.memo("pocl_primed", build)


def pocl_copy(ws: Workspace) -> Path:
    """A fresh copy of the fully primed PoCL cache."""
    return _copy(pocl_primed(ws), ws)


@dataclass(frozen=True)
class Primed:
    cache_dir: Path  # KDB_CACHE_DIR
    user_file: Path
    arch: str


def kdb_primed(ws: Workspace) -> Primed:
    """A KDB_CACHE_DIR whose user tier holds every kernel (stored at the priming's exit)."""

    def build() -> Primed:
        cache = ws.path / "kdb-primed"
        ws.log(f"priming kdb's user tier with {ws.opts.kernels} kernels")
        child("opencl", {"mode": "kdb", "workload": "kernels", "kernels": ws.opts.kernels},
              ws.env(KDB_CACHE_DIR=cache, POCL_CACHE_DIR=_copy(_pocl_source_primed(ws), ws)))
        files = kdb_files(cache)
        if len(files) != 1:
            raise BenchError(f"priming kdb left {len(files)} user files in {cache}, expected 1")
        n = count_rows(files[0], "kernels")
        if n != ws.opts.kernels:
            raise BenchError(f"priming kdb stored {n} of {ws.opts.kernels} kernels in {files[0]}")
        return Primed(cache, files[0], files[0].stem)

    return ws.memo("kdb_primed", build)


def floor_bins(ws: Workspace) -> Path:
    """The binaries kdb stored, one plain file per kernel (``<name>.bin``)."""

    def build() -> Path:
        from kdb.file import codec

        primed = kdb_primed(ws)
        d = ws.path / "floor-bins"
        d.mkdir()
        conn = sqlite3.connect(f"file:{primed.user_file}?mode=ro", uri=True)
        try:
            rows = conn.execute(
                "SELECT name, codec, blob, raw_size, checksum FROM kernels").fetchall()
        finally:
            conn.close()
        for name, kind, blob, raw_size, digest in rows:
            raw = codec.decode(kind, blob, raw_size, digest)
            if raw is None:
                raise BenchError(f"stored binary of {name} does not decode")
            (d / f"{name}.bin").write_bytes(raw)
        missing = [f"k{i}" for i in range(ws.opts.kernels) if not (d / f"k{i}.bin").exists()]
        if missing:
            raise BenchError(f"no stored binary named {missing[:3]} in {primed.user_file}")
        return d

    return ws.memo("floor_bins", build)


def system_dir(ws: Workspace) -> Path:
    """A directory holding ``<arch>.kdb``, packed from the primed user file."""

    def build() -> Path:
        from kdb.pack import build as pack

        primed = kdb_primed(ws)
        d = ws.path / "system"
        res = pack.write_system_db(d / f"{primed.arch}.kdb", primed.arch, [primed.user_file])
        if res.entries != ws.opts.kernels:
            raise BenchError(f"system file holds {res.entries} entries, expected "
                             f"{ws.opts.kernels}")
        return d

    return ws.memo("system_dir", build)


def regular_install(ws: Workspace) -> tuple[Path | None, str]:
    """``(python, "")`` of a new virtual environment holding kdb installed from a wheel of
    this tree (what ``pip install kdb`` gives a user), or ``(None, why)`` when it cannot be
    built here. The benchmarks' own environment has kdb installed editable, and its finder
    imports pathlib and re at every start, bare ``python -c pass`` included."""

    def build() -> tuple[Path | None, str]:
        import subprocess
        import venv

        from _harness import PYTHON, REPO

        d = ws.path / "regular-install"
        ws.log("building a wheel of kdb and a virtual environment for it")
        try:
            subprocess.run([PYTHON, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w",
                            str(d / "dist"), str(REPO)], check=True, capture_output=True,
                           text=True, timeout=600)
            venv.EnvBuilder(with_pip=True).create(d / "venv")
            py = d / "venv" / "bin" / "python"
            wheels = sorted((d / "dist").glob("kdb-*.whl"))
            subprocess.run([str(py), "-m", "pip", "install", "--quiet", str(wheels[-1])],
                           check=True, capture_output=True, text=True, timeout=900)
        except (subprocess.SubprocessError, OSError, IndexError) as err:
            out = getattr(err, "stderr", "") or ""
            return None, f"{err} {out.strip().splitlines()[-1:] or ''}"
        return py, ""

    return ws.memo("regular_install", build)

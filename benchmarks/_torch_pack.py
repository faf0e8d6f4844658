"""A torch.compile pack and a second venv at another path to install it in, for
benchmarks/torch_compile.py and tests/test_torch_pack.py.

The second venv gets kdb's wheel (built from this tree) and the pack's wheel by pip; torch and
the other packages come from this interpreter's site-packages through symbolic links in a
folder of the new venv, named by a ``.pth`` line: nothing is downloaded, and torch is at
another path (its headers and libraries, which Inductor's C++ commands name, too).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def tree_copy(dest: Path) -> Path:
    """A copy of this tree to build kdb's wheel from: setuptools writes ``build/`` and
    ``kdb.egg-info`` into the tree it builds, and builds of one tree at once (the suite's
    processes) broke each other's."""
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "results", "carry", "work"))
    return dest


def kdb_wheel(out: Path) -> Path:
    """kdb's wheel built from a copy of this tree (no build isolation: no download)."""
    src = tree_copy(Path(out) / "src")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--quiet", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"building kdb's wheel failed:\n{proc.stdout}\n{proc.stderr}")
    shutil.rmtree(src, ignore_errors=True)
    [wheel] = Path(out).glob("kdb-*.whl")
    return wheel


def build_pack(cache_dir: Path, arch: str, out: Path, version: str = "1.0.0") -> Path:
    """``kdb pack --from-db`` of ``cache_dir``'s ``arch`` entries: the wheel."""
    kdb = Path(sys.executable).with_name("kdb")
    proc = subprocess.run([str(kdb), "pack", "--arch", arch, "--from-db", str(cache_dir),
                           "--version", version, "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"kdb pack failed:\n{proc.stdout}\n{proc.stderr}")
    [wheel] = Path(out).glob("*.whl")
    return wheel


def other_venv(where: Path, wheels: list[Path]) -> Path:
    """A new venv at ``where`` with ``wheels`` installed by pip, and this interpreter's
    packages but kdb linked in; its Python."""
    venv.EnvBuilder(with_pip=False).create(where)
    python = where / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "--quiet", *map(str, wheels)], check=True,
                   capture_output=True, timeout=600)
    linked = where / "linked"
    linked.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("kdb", "__editable__", "_kdb")) \
                and entry.suffix != ".pth":
            os.symlink(entry, linked / entry.name)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True,
                             text=True).stdout.strip()
    Path(purelib, "zz-linked.pth").write_text(f"{linked}\n")
    return python

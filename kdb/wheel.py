"""Wrapping a system database in a data-only wheel ``kdb-system-<arch>``.

The wheel is built by setuptools through ``pip wheel`` from a small generated project: one
package holding ``<arch>.kdb`` and an entry point in the group ``kdb.system`` that names it.
Installing the wheel is all a user does; kdb finds the file without importing the package.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import config
from .discovery import DEFAULT_PREFIX, dist_name
from .errors import InvalidArgumentError, KdbError


class WheelBuildError(KdbError):
    """The packaging tools could not build a system-database wheel."""


_VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?"
                         r"(\+[a-z0-9]+(\.[a-z0-9]+)*)?$")


def check_version(version: str) -> str:
    """``version`` if it is a package version (PEP 440, public part), else raise.

    >>> check_version("2026.11.1"), check_version("1.0.0rc1")
    ('2026.11.1', '1.0.0rc1')
    """
    if not isinstance(version, str) or not _VERSION_RE.match(version):
        raise InvalidArgumentError(f"version {version!r} is not a valid package version "
                                   "(for example 1.0.0, 2026.11.1 or 1.0.0rc1)")
    return version


def module_name(arch: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The importable package name that holds the file.

    >>> module_name("pocl-x86_64-znver3")
    'kdb_system_pocl_x86_64_znver3'
    """
    return re.sub(r"[^a-z0-9_]", "_", dist_name(arch, prefix).lower())


def build_wheel(kdb_file: Path, arch: str, version: str, out_dir: Path,
                dist_prefix: str = DEFAULT_PREFIX) -> Path:
    """Build ``<dist_prefix>-<arch>-<version>-py3-none-any.whl`` around ``kdb_file``."""
    import shutil  # here, not at import: the missing-system-db warning imports dist_name
    import subprocess
    import sys
    import tempfile

    check_version(version)
    kdb_file = Path(kdb_file)
    if kdb_file.name != f"{arch}.kdb":
        raise WheelBuildError(f"{kdb_file} must be named {arch}.kdb")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mod = module_name(arch, dist_prefix)
    with tempfile.TemporaryDirectory(prefix="kdb-wheel-") as tmp:
        proj = Path(tmp) / "project"
        pkg = proj / mod
        pkg.mkdir(parents=True)
        shutil.copyfile(kdb_file, pkg / kdb_file.name)
        (pkg / "__init__.py").write_text(
            f'"""System kernel database for arch {arch} (data only; kdb reads {arch}.kdb)."""\n',
            encoding="utf-8")
        text = _PYPROJECT.format(dist=dist_name(arch, dist_prefix), version=version, arch=arch,
                                 mod=mod)
        (proj / "pyproject.toml").write_text(text, encoding="utf-8")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--quiet", "--wheel-dir", str(Path(tmp) / "dist"), str(proj)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise WheelBuildError(
                f"building the wheel for {arch} failed (needs pip and setuptools>=70.1 in "
                f"this environment: pip install 'kdb[pack]'):\n{proc.stderr.strip()}")
        built = list((Path(tmp) / "dist").glob("*.whl"))
        if len(built) != 1:
            raise WheelBuildError(f"expected one wheel, found {[p.name for p in built]}")
        target = out_dir / built[0].name
        shutil.move(str(built[0]), target)
    return target


_PYPROJECT = """\
[build-system]
requires = ["setuptools>=70.1"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "{version}"
description = "kdb system kernel database for arch {arch} (prebuilt kernel binaries)"
requires-python = ">=3.8"

[project.entry-points."kdb.system"]
"{arch}" = "{mod}"

[tool.setuptools]
packages = ["{mod}"]
include-package-data = false

[tool.setuptools.package-data]
"{mod}" = ["*.kdb"]
"""

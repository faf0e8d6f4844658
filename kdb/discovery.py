"""Finding system databases: ``<arch>.kdb`` in ``KDB_SYSTEM_DB_PATH`` and in installed packages.

A package provides a system database by declaring an entry point in the group ``kdb.system``
whose name is the arch id and whose value is a top-level package; the file is
``<arch>.kdb`` in that package's directory::

    [project.entry-points."kdb.system"]
    sm_90 = "kdb_system_sm_90"

The file is found with :func:`importlib.util.find_spec`, without importing the package. The
entry points are read straight from ``*.dist-info/entry_points.txt`` on ``sys.path``:
importing :mod:`importlib.metadata` alone costs ~40 ms here, more than a whole warm start.
A broken entry (unparsable, package or file missing) is logged and skipped, never fatal.

Search order: ``KDB_SYSTEM_DB_PATH`` directories in the order given, then packages sorted
by distribution name. Every file found serves; the first that holds a key answers.
"""

from __future__ import annotations

import logging
import os
import sys

from pathlib import Path
from typing import NamedTuple

from . import config

log = logging.getLogger("kdb")
GROUP = "kdb.system"


class SystemSource(NamedTuple):
    """A system database file and where it came from."""

    arch: str
    path: Path
    origin: str  # "KDB_SYSTEM_DB_PATH" or "package <dist> <version>"
    problem: str = ""  # non-empty when the entry is broken (shown by `kdb info`)


class _EntryPoint(NamedTuple):
    dist: str
    version: str
    name: str
    value: str


def _dist_name_version(dirname: str) -> tuple[str, str]:
    stem = dirname[: -len(".dist-info")]
    name, _, version = stem.partition("-")
    return name, version


def _parse_group(text: str, group: str) -> list[tuple[str, str]]:
    out, current = [], None
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip()
        elif current == group and "=" in line:
            name, _, value = line.partition("=")
            out.append((name.strip(), value.strip()))
    return out


def entry_points(group: str = GROUP) -> list[_EntryPoint]:
    """Entry points of ``group`` of every distribution on ``sys.path`` (first one wins)."""
    seen: set[str] = set()
    found: list[_EntryPoint] = []
    for base in sys.path:
        try:
            names = os.listdir(base or ".")
        except OSError:
            continue
        for d in names:
            if not d.endswith(".dist-info"):
                continue
            dist, version = _dist_name_version(d)
            norm = dist.lower().replace("-", "_")
            if norm in seen:
                continue
            seen.add(norm)
            try:
                with open(os.path.join(base or ".", d, "entry_points.txt"), encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as err:  # a broken plugin is never fatal
                if not isinstance(err, FileNotFoundError):
                    log.warning("kdb: cannot read the entry points of %s (%s); skipped", d, err)
                continue
            for name, value in _parse_group(text, group):
                found.append(_EntryPoint(dist, version, name, value))
    found.sort(key=lambda ep: (ep.dist.lower(), ep.name))
    return found


def _resolve(ep: _EntryPoint) -> SystemSource:
    origin = f"package {ep.dist} {ep.version}"
    module = ep.value.strip()
    try:
        arch = config.check_arch(ep.name)
    except Exception as err:  # noqa: BLE001 - a broken plugin must never be fatal
        return SystemSource(ep.name, Path(), origin, f"bad arch id: {err}")
    if not module.isidentifier():
        return SystemSource(arch, Path(), origin,
                            f"entry point value {ep.value!r} is not a top-level package name")
    import importlib.util  # only when a package declares a system database

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as err:
        return SystemSource(arch, Path(), origin, f"cannot locate package {module!r}: {err}")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        return SystemSource(arch, Path(), origin, f"package {module!r} not found")
    path = Path(locations[0]) / f"{arch}.kdb"
    if not path.is_file():
        return SystemSource(arch, path, origin, "file missing")
    return SystemSource(arch, path, origin)


def all_sources(extra_dirs: list[Path] | None = None) -> list[SystemSource]:
    """Every system database visible: from the extra directories, then from packages."""
    dirs = config.system_dirs() if extra_dirs is None else extra_dirs
    out: list[SystemSource] = []
    for d in dirs:
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for n in names:
            if n.endswith(".kdb"):
                arch = n[: -len(".kdb")]
                try:
                    config.check_arch(arch)
                except Exception:  # noqa: BLE001 - not ours to judge; skip
                    continue
                out.append(SystemSource(arch, Path(d) / n, config.ENV_SYSTEM_DB_PATH))
    out.extend(_resolve(ep) for ep in entry_points())
    return out


def sources_for(arch: str, extra_dirs: list[Path] | None = None) -> list[SystemSource]:
    """Usable system databases for one arch, in search order; broken entries are logged."""
    dirs = config.system_dirs() if extra_dirs is None else extra_dirs
    out = [SystemSource(arch, Path(d) / f"{arch}.kdb", config.ENV_SYSTEM_DB_PATH)
           for d in dirs if (Path(d) / f"{arch}.kdb").is_file()]
    for ep in entry_points():
        if ep.name != arch:
            continue
        src = _resolve(ep)
        if src.problem:
            log.warning("kdb: system database entry point %s = %s (%s) skipped: %s",
                        ep.name, ep.value, src.origin, src.problem)
        else:
            out.append(src)
    return out

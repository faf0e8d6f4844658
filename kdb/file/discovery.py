"""Finding system databases: ``<arch>.kdb`` in ``KDB_SYSTEM_DB_PATH`` and in installed packages.

A package provides a system database by declaring an entry point in the group ``kdb.system``
whose name is the arch id and whose value is a top-level package; the file is
``<arch>.kdb`` in that package's directory::

    [project.entry-points."kdb.system"]
    sm_90 = "kdb_system_sm_90"

The file is found with :func:`importlib.util.find_spec`, without importing the package. The
entry points are read straight from ``*.dist-info/entry_points.txt`` on ``sys.path``, their
scan cached per directory (:mod:`kdb.file.entrypoints`). A broken entry (unparsable, package or
file missing) is logged and skipped, never fatal.

Search order: ``KDB_SYSTEM_DB_PATH`` directories in the order given, then packages sorted
by distribution name. Every file found serves; the first that holds a key answers.
"""

from __future__ import annotations

import os
from pathlib import Path
from collections import namedtuple

from .. import config, errors, logs
from . import entrypoints
from .kernelfile import KernelFile
from .entrypoints import _EntryPoint, _load, _memo, _parse_group, _read, flush  # noqa: F401

log = logs.get("kdb")
GROUP = "kdb.system"

#: Distribution name prefix of the wheels ``kdb pack`` builds (``kdb-system-<arch>``).
DEFAULT_PREFIX = "kdb-system"


def dist_name(arch: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The distribution name for an arch: ``<prefix>-<arch>``, with ``+``/``-`` feature
    flags spelled ``-on``/``-off`` so that the name is valid.

    A framework that ships its own system databases picks its own ``prefix`` (for example
    ``myfw-kernels``), so that its package and kdb's for the same arch install side by side.

    >>> dist_name("sm_90"), dist_name("gfx90a_sramecc+_xnack-")
    ('kdb-system-sm_90', 'kdb-system-gfx90a_sramecc-on_xnack-off')
    >>> dist_name("sm_90", "myfw-kernels")
    'myfw-kernels-sm_90'
    """
    config.check_arch(arch)
    if prefix != DEFAULT_PREFIX and not _valid_prefix(prefix):
        raise errors.InvalidArgumentError(
            f"package name prefix {prefix!r} is not valid: use lower-case letters, digits and "
            "'._-', starting with a letter (for example 'kdb-system' or 'myfw-kernels')")
    name = arch.replace("+", "-on").replace("-_", "-off_")  # a "-" flag before "_" or at the end
    if name.endswith("-"):
        name += "off"
    return f"{prefix}-{name}"


def _valid_prefix(prefix: object) -> bool:
    # re loads here only: the missing-system-db warning names the default prefix, on a hit
    import re

    return isinstance(prefix, str) and bool(re.match(r"^[a-z]([a-z0-9._-]*[a-z0-9])?$", prefix))


class SystemSource(namedtuple("SystemSource", "arch filename origin problem", defaults=("",))):
    """A system database file and where it came from: ``arch``, ``filename`` (a str; ``path``
    gives it as a Path), ``origin`` ("KDB_SYSTEM_DB_PATH" or "package <dist> <version>") and
    ``problem`` (non-empty when the entry is broken; shown by ``kdb info``)."""

    __slots__ = ()

    @property
    def path(self) -> Path:
        return Path(self.filename)


def entry_points(group: str = GROUP,
                 memo_dir: str | os.PathLike[str] | None = None) -> list[_EntryPoint]:
    """Entry points of ``group`` (by default, system databases') on ``sys.path``: see
    :func:`kdb.file.entrypoints.entry_points`."""
    return entrypoints.entry_points(group, memo_dir)


def _resolve(ep: _EntryPoint) -> SystemSource:
    origin = f"package {ep.dist} {ep.version}"
    module = ep.value.strip()
    try:
        arch = config.check_arch(ep.name)
    except Exception as err:  # noqa: BLE001 - a broken plugin must never be fatal
        return SystemSource(ep.name, ".", origin, f"bad arch id: {err}")
    if not module.isidentifier():
        return SystemSource(arch, ".", origin,
                            f"entry point value {ep.value!r} is not a top-level package name")
    import importlib.util  # only when a package declares a system database

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as err:
        return SystemSource(arch, ".", origin, f"cannot locate package {module!r}: {err}")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        return SystemSource(arch, ".", origin, f"package {module!r} not found")
    path = os.path.join(str(Path(locations[0])), f"{arch}.kdb")
    if not Path(path).is_file():
        return SystemSource(arch, path, origin, "file missing")
    return SystemSource(arch, path, origin)


def all_sources(extra_dirs: list[str | os.PathLike[str]] | None = None, *,
                memo_dir: str | os.PathLike[str] | None = None) -> list[SystemSource]:
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
                path = os.path.join(str(Path(d)), n)
                # Never open what is not a regular file: a FIFO blocks open() for good.
                problem = "" if Path(path).is_file() else "not a regular file (skipped)"
                out.append(_checked(SystemSource(arch, path, config.ENV_SYSTEM_DB_PATH,
                                                 problem)))
    out.extend(_checked(_resolve(ep)) for ep in entry_points(memo_dir=memo_dir))
    return out


#: How the problem of a system database refused for its owner or permissions begins.
REFUSED = "refused: "


def unsafe(filename: str) -> str | None:
    """Why a system database must not be loaded (:func:`kdb.file.fs.system_unsafe_reason` of the
    file, then of its directory), as a problem ``kdb info`` and ``kdb verify`` show; None
    when it may be."""
    from . import fs

    bad = fs.unsafe_chain([filename, os.path.dirname(filename) or "."], system=True)
    if bad is None:
        return None
    return (f"{REFUSED}{bad[0]}: {bad[1]}, so another user could swap in their own kernels; "
            f"make it owned by you or root and writable by its owner only (chmod go-w)")


def _checked(src: SystemSource) -> SystemSource:
    problem = "" if src.problem else unsafe(src.filename)
    return src._replace(problem=problem) if problem else src


def sources_for(arch: str, extra_dirs: list[str | os.PathLike[str]] | None = None, *,
                memo_dir: str | os.PathLike[str] | None = None,
                refused: list[str] | None = None) -> list[SystemSource]:
    """Usable system databases for one arch, in search order; broken entries are logged,
    and those refused added to ``refused`` (when given)."""
    dirs = config.system_dirs() if extra_dirs is None else extra_dirs
    files = (os.path.join(str(Path(d)), f"{arch}.kdb") for d in dirs)
    out = []
    for f in files:
        try:
            is_file = Path(f).is_file()
        except OSError as err:  # a name too long, a directory it may not search
            logs.warn_once(f"sysdir:{f}", "kdb: %s in %s cannot be read (%s); it is skipped",
                           f, config.ENV_SYSTEM_DB_PATH, err.strerror or err)
            continue
        if is_file:
            why = unsafe(f)
            if why is None:
                out.append(SystemSource(arch, f, config.ENV_SYSTEM_DB_PATH))
            else:
                _refuse(f, config.ENV_SYSTEM_DB_PATH, why, refused)
    for ep in entry_points(memo_dir=memo_dir):
        if ep.name != arch:
            continue
        src = _resolve(ep)
        why = src.problem or unsafe(src.filename)
        if not why:
            out.append(src)
        elif src.problem:
            log.warning("kdb: system database entry point %s = %s (%s) skipped: %s",
                        ep.name, ep.value, src.origin, src.problem)
        else:
            _refuse(src.filename, src.origin, why, refused)
    return out


def _refuse(filename: str, origin: str, why: str, refused: list[str] | None = None) -> None:
    from .. import faults

    if refused is not None:
        refused.append(filename)
    faults.fault(f"system database {filename} (from {origin}) is not loaded: {why}",
                 once="unsafe-system:" + filename)


def system_files(arch: str, dirs: list[str | os.PathLike[str]], memo_dir: str | os.PathLike[str],
                 user_dir: str | os.PathLike[str], use_system: bool = True,
                 refused: list[str] | None = None, warn: bool = True) -> list[KernelFile]:
    """The read-only system files for ``arch`` (:func:`sources_for`), opened lazily; none
    warns once per process and arch (unless ``warn`` is false: :func:`warn_no_system` then
    says it when the arch turns out to be used), saying what that costs and how to fix it.
    ``refused`` collects the files found and not loaded."""
    config.check_arch(arch)
    if not use_system:
        return []
    refused = [] if refused is None else refused  # the warning that none is usable names
    files = [KernelFile(s.filename, tier="system", readonly=True)  # them (it read as if
             for s in sources_for(arch, dirs, memo_dir=memo_dir, refused=refused)]  # none was)
    if not files and warn:
        warn_no_system(arch, dirs, user_dir, refused)
    return files


def warn_no_system(arch: str, dirs: list[str | os.PathLike[str]],
                   user_dir: str | os.PathLike[str], refused: list[str]) -> None:
    """The once-per-process warning that ``arch`` has no system database kdb may load."""
    none = f"no system kernel database for arch {arch!r}" + (
        f" that kdb may load ({', '.join(refused)} refused: the warning above says why)"
        if refused else "")
    logs.warn_once(
        f"nosys:{arch}",
        "kdb: %s: looked for %s in KDB_SYSTEM_DB_PATH "
        "(%s) and in installed packages (entry point group %r). Kernels for this device "
        "will be compiled at first use and stored in %s, so the first start-up will be "
        "slow. To fix it, install the system database package for this arch "
        "(pip install %s, if your framework publishes one), or build one from what a "
        "run compiled, `kdb pack --arch %s --from-db --out DIR`, and put DIR in "
        "KDB_SYSTEM_DB_PATH.",
        none, f"{arch}.kdb", ", ".join(str(d) for d in dirs) or "none set",
        GROUP, os.path.join(str(Path(user_dir)), f"{arch}.kdb"), dist_name(arch), arch,
    )

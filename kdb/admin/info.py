"""``kdb info``: this kdb's settings, every tier's files, and the devices and toolchains here.

Reads only. The OpenCL devices come from pyopencl, the CUDA toolchain from
:mod:`kdb.backends.cuda` and :mod:`kdb.backends.cuda.nvrtc` and the HIP one from
:mod:`kdb.backends.hip`, each imported when asked (all are optional); the files are described
by :func:`kdb.admin.report.describe_file`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..adopt import auto
from .. import config
from ..file import discovery
from ..file.fileformat import HEAD
from .report import FileReport, describe_file, shared_summary
from .tierfiles import odd_user_files, provider, user_files


def opencl_devices(memo_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """OpenCL devices with their arch ids and compiler identity, and a note if there are none.

    pyopencl is optional: without it (or without a platform) the list is empty and the note
    says why.
    """
    try:
        import pyopencl as cl

        from ..backends.opencl import arch_of, compiler_identity
    except ImportError as err:
        return [], f"pyopencl is not installed ({err}); pip install 'pyopencl[pocl]'"
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:
        return [], f"no OpenCL platform found ({err})"
    out: list[dict[str, Any]] = []
    for plat in platforms:
        try:
            devices = plat.get_devices()
        except cl.Error as err:
            out.append({"platform": plat.name, "device": "", "arch": None, "compiler": "",
                        "identity": {}, "problem": f"cannot list devices: {err}"})
            continue
        for dev in devices:
            rec: dict[str, Any] = {"platform": plat.name, "device": dev.name, "arch": None,
                                   "compiler": "", "identity": {}, "problem": ""}
            try:
                rec["arch"] = arch_of(dev)
                ident = dict(compiler_identity(dev, str(memo_dir)))
                rec["identity"] = ident
                rec["compiler"] = compiler_short(ident)
            except Exception as err:  # noqa: BLE001 - one odd device must not hide the rest
                rec["problem"] = f"{type(err).__name__}: {err}"
            out.append(rec)
    return out, "" if out else "no OpenCL devices found"


def compiler_short(identity: dict[str, str]) -> str:
    """One line naming a compiler: platform, driver version, library digest prefix.

    >>> compiler_short({"platform": "PoCL", "driver_version": "3.0", "library": "sha256:" + "ab" * 32})
    'PoCL 3.0, library sha256:abababababab'
    """
    text = " ".join(v for v in (identity.get("platform", ""),
                                identity.get("driver_version", "")) if v)
    lib = identity.get("library")
    if not lib:
        return text
    kind, _, digest = lib.partition(":")
    return f"{text}, library {kind}:{digest[:12]}"


def _host_compiler(ident, memo_dir: Path) -> dict[str, Any]:
    """The host compiler nvcc runs with no ``-ccbin`` option (``NVCC_CCBIN``, else ``gcc``
    on its ``PATH``), which the keys of its builds hold: where it is, and what it is."""
    import os

    from ..backends.cuda.keys import host_compiler

    try:
        cwd = os.getcwd()
    except OSError:  # a deleted working directory: a relative name names nothing
        cwd = "."
    found = host_compiler(ident, (), cwd, memo_dir)
    return {"named": found.named, "path": found.path, "version": found.label,
            "stdlib": found.stdlib, "missing": found.missing}


def cuda_toolchain(memo_dir: Path) -> dict[str, Any]:
    """The nvcc and the NVRTC ``kdb.cuda`` would run, their releases, and the arches they
    build cubins for (``arches``: either's; ``default``: what ``compiler=None`` runs).

    ``problem`` says why there is none (how to point kdb at one). ``pycuda`` tells whether
    the loading half (``kdb.cuda.SourceModule``) can be imported at all.
    """
    import importlib.util

    from ..backends import cuda
    from ..backends.cuda import nvrtc
    from ..errors import KdbError

    out: dict[str, Any] = {"nvcc": None, "found_by": None, "release": "", "toolkit": "",
                           "arches": [], "identity": {}, "problem": "",
                           "pycuda": importlib.util.find_spec("pycuda") is not None}
    try:
        tool = cuda.find_nvcc()
        out.update(nvcc=tool.path, found_by=tool.found_by)
        ident = cuda.identity(tool, memo_dir)
        out.update(release=ident.release, toolkit=ident.toolkit, identity=dict(ident.compiler),
                   arches=cuda.target_arches(tool))
        out["host_compiler"] = _host_compiler(ident, memo_dir)
    except KdbError as err:
        out["problem"] = str(err)
    nv: dict[str, Any] = {"path": None, "found_by": None, "version": "", "identity": {},
                          "arches": [], "problem": ""}
    try:
        lib = nvrtc.find_nvrtc()
        nv.update(path=lib.path, found_by=lib.found_by)
        ident = nvrtc.identity(lib, memo_dir)
        nv.update(version=ident.version, identity=dict(ident.compiler),
                  arches=nvrtc.supported_arches(lib.path))
    except KdbError as err:
        nv["problem"] = str(err)
    out["nvrtc"] = nv
    # What compile(..., compiler=None) runs: nvcc where found, else NVRTC, else stored builds.
    host_missing = (out.get("host_compiler") or {}).get("missing", False)
    out["default"] = "nvcc" if out["nvcc"] and not out["problem"] and not host_missing else \
        "nvrtc" if nv["path"] and not nv["problem"] else None
    out["nvcc_arches"] = list(out["arches"])  # each compiler's own: they differ
    out["arches"] = sorted(set(out["arches"]) | set(nv["arches"]),
                           key=lambda a: int("".join(c for c in a if c.isdigit()) or 0))
    return out


def hip_toolchain(memo_dir: Path) -> dict[str, Any]:
    """The hipcc and the HIPRTC ``kdb.hip`` would run, how each was found (``found_by``:
    ``KDB_HIPCC`` / ``KDB_HIPRTC``, ``ROCM_PATH``, ``PATH``...), their releases, and the
    processors they build (``default``: what ``compiler=None`` runs); ``problem`` says how
    to get one, or what is wrong with the one named."""
    from ..backends.hip import hipcc, hiprtc
    from ..errors import KdbError

    out: dict[str, Any] = {}
    named = config.read_variables((config.ENV_HIPCC, config.ENV_HIPRTC))
    for name, locate, identify, variable in (
            ("hipcc", hipcc.locate_hipcc, hipcc.identity, config.ENV_HIPCC),
            ("hiprtc", hiprtc.locate_hiprtc, hiprtc.identity, config.ENV_HIPRTC)):
        row: dict[str, Any] = {"path": None, "found_by": None, "release": "", "arches": [],
                               "problem": ""}
        try:
            row["path"], row["found_by"] = locate()
            ident = identify(row["path"], memo_dir)
            row.update(release=ident.release, arches=list(ident.built),
                       stdlib=getattr(ident, "stdlib", ""))
        except KdbError as err:
            row["problem"] = str(err)
            if row["found_by"] is None and (named[variable] or "").strip():
                row["found_by"] = variable  # it names one that is not there
        out[name] = row
    out["default"], out["blocked"] = _hip_default(out)
    return out


def _hip_default(rows: dict[str, Any]) -> tuple[str | None, str]:
    """What ``kdb.hip.compile(compiler=None)`` runs: the first of hipcc and HIPRTC that
    works; and, where a variable names one that does not (compile raises), which."""
    for name in ("hipcc", "hiprtc"):
        row = rows[name]
        if row["path"] and not row["problem"]:
            return name, ""
        if row["found_by"] in (config.ENV_HIPCC, config.ENV_HIPRTC):
            return None, row["found_by"]
    return None, ""


def _with_unpublished(shared: dict[str, Any] | None, user_dir: Path) -> dict[str, Any] | None:
    """The shared tier's summary, with what this node compiled while the server was away
    and has not published to it yet (``{arch: entries}``, :mod:`kdb.storing.backlog`):
    names whose entries the user file still holds (one evicted meanwhile is not sent)."""
    if shared is not None:
        from ..file.kernelfile import KernelFile
        from ..shared.tier import tier as shared_tier
        from ..storing import backlog

        tier = backlog.tier_id(shared_tier(config.shared_url()).describe())
        out = {}
        for arch, keys in backlog.names(user_dir, tier).items():
            f = KernelFile(user_dir / f"{arch}.kdb", tier="user", readonly=False)
            try:
                held = len(f.stored(keys)) if (user_dir / f"{arch}.kdb").is_file() else 0
            finally:
                f.close()
            if held:
                out[arch] = held
        shared["unpublished"] = out
    return shared


def info(user_dir: Path, cache_root: Path) -> dict[str, Any]:
    """Everything ``kdb info`` shows: settings, user files, system databases, devices."""
    users = [describe_file(p, "user", p.name[: -len(".kdb")], "user dir")
             for p in user_files(user_dir)]
    users += [FileReport(p.name[: -len(".kdb")], str(p), "user", "user dir", 0, 0, None,
                         f"{kind}, not a kdb file: skipped; remove it")
              for p, kind in odd_user_files(user_dir)]
    systems = []
    for src in discovery.all_sources():
        if src.problem:
            systems.append(FileReport(src.arch, str(src.path), "system", src.origin, 0, 0,
                                      None, src.problem))
        else:
            systems.append(describe_file(src.path, "system", src.arch, src.origin))
    devices, note = opencl_devices(cache_root)
    usable = {s.arch for s in systems if not s.problem}
    for d in devices:
        d["system_db"] = None if d["arch"] is None else d["arch"] in usable
    missing = sorted({d["arch"] for d in devices if d["arch"] and d["arch"] not in usable})
    cuda = cuda_toolchain(cache_root)
    cuda["system_db"] = [a for a in cuda["arches"] if a in usable]
    return {
        "version": _version(),
        "cache_root": str(cache_root),
        "user_dir": str(user_dir),
        "disabled": config.flag(config.ENV_DISABLE_CACHE),
        "schema_head": HEAD,
        "user_files": [asdict(f) for f in users],
        "system_path": [str(d) for d in config.system_dirs()],
        "system_databases": [{**asdict(s), **provider(s.origin),
                              "refused": s.problem.startswith(discovery.REFUSED)}
                             for s in systems],
        "devices": devices,
        "devices_note": note,
        "missing_system": missing,
        "cuda": cuda,
        "hip": hip_toolchain(cache_root),
        "backends": backends(),
        "shared": _with_unpublished(shared_summary(), user_dir),
        "auto": auto.status(),
        "trust": trust_status(),
        "settings": settings(),
    }


def backends() -> list[dict[str, Any]]:
    """Every back end of :mod:`kdb.registry`: its name and label, whether ``kdb pack``
    compiles it from a manifest, and whether what that needs can be imported here (found,
    not imported: a report loads no compiler)."""
    import importlib.util

    from .. import registry

    out = []
    for b in registry.backends():
        needs = b.requires[0] if b.requires else None
        try:
            found = needs is None or importlib.util.find_spec(needs) is not None
        except (ImportError, ValueError):
            found = False
        out.append({"name": b.name, "label": b.label, "packs": b.pack is not None,
                    "needs": needs, "extra": b.requires[1] if b.requires else None,
                    "available": found, "stores_jobs": b.stores_jobs})
    return out


def settings() -> list[dict[str, Any]]:
    """Every variable of :data:`kdb.config.SETTINGS`, in its order: its value here (None:
    unset; the shared tier's URL with its password masked) and its default as
    docs/configuration.md shows it."""
    import os

    out = []
    for row in config.SETTINGS.values():
        value = os.environ.get(row.name)
        if value is not None and row.name == config.ENV_SHARED_URL:
            from ..shared.server import mask

            value = mask(value)
        out.append({"name": row.name, "value": value, "default": row.shown})
    return out


def trust_status() -> dict[str, Any]:
    """The trust policy this environment sets (:mod:`kdb.signing.policy`): which tiers must
    verify, the trusted key ids, and the key this process signs with."""
    from ..signing import policy as signing

    p = signing.current()
    if p is None:
        return {"verify": [], "trusted": [], "signer": None}
    return {"verify": [t for t in ("system", "user", "shared") if p.covers(t)],
            "trusted": sorted(p.trusted), "signer": p.signer_id}


def _version() -> str:
    from .._version import __version__

    return __version__

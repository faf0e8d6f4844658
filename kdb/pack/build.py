"""``kdb pack``: build read-only system databases (``<arch>.kdb``) and wrap each in a wheel.

Kernels come from a TOML manifest (:mod:`kdb.pack.manifest`, compiled here by
:mod:`kdb.pack.compiling` through the same back end a framework uses at run time, so the keys
match), from a user database, or from the start-up latency log (:mod:`kdb.pack.inputs`:
exactly the kernels that were compiled at start-up). :mod:`kdb.pack.systemfile` writes each
arch's file reproducibly and proves it reads back; :mod:`kdb.pack.wheel` wraps it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from .. import config, logs
from ..errors import InvalidArgumentError, PackError
from .manifest import KernelSpec, applicable, load_manifest
from .compiling import Progress, check_manifest, compile_manifest, opencl_arches
from .inputs import (
    PENDING_WAIT_S,
    Step,
    check_source,
    log_keys,
    shown_source,
    user_db_file,
    wait_for_stores,
)
from .systemfile import PackResult, write_system_db

log = logs.get("kdb")

__all__ = ["PENDING_WAIT_S", "KernelSpec", "PackError", "PackResult", "Progress", "Step",
           "applicable", "compile_manifest", "load_manifest", "log_keys", "opencl_arches",
           "pack", "resolve_arches", "user_db_file", "write_system_db"]


def resolve_arches(arches: Iterable[str]) -> list[str]:
    """Arch ids to pack, each once; ``native`` stands for the arches of the OpenCL devices
    present.

    >>> resolve_arches(["sm_90", "sm_80", "sm_90"])
    ['sm_90', 'sm_80']
    """
    out: list[str] = []
    for a in arches:
        if a == "native":
            devices = opencl_arches()
            present = sorted(a for a, dev in devices.items() if _builds(a, dev))
            if not present:
                raise PackError("--arch native: no OpenCL device that builds kernels is "
                                f"present here (found: {', '.join(sorted(devices)) or 'none'})")
            out += present
        else:
            out.append(config.check_arch(a))
    if not out:
        raise InvalidArgumentError("give at least one --arch (or --arch native)")
    return list(dict.fromkeys(out))


def _builds(arch: str, device) -> bool:
    """Whether ``device`` builds a kernel at all: ``native`` skips, with a warning, one whose
    compiler does not (pip's PoCL on a CPU its LLVM does not know calls it ``generic``)."""
    import pyopencl as cl

    try:
        cl.Program(cl.Context([device]), "__kernel void k(__global int *a) { *a = 1; }").build()
        return True
    except cl.Error as err:
        said = [x for x in str(err).splitlines() if x.startswith("error:")] or [str(err)]
        log.warning("kdb pack --arch native: skipping %s (%s): its compiler builds no kernel "
                    "here (%s)", arch, device.platform.version.strip(), said[0].strip())
        return False


def pack(arches: Iterable[str], *, out_dir: str | os.PathLike[str], version: str | None = None,
         manifest: str | os.PathLike[str] | None = None,
         from_db: str | os.PathLike[str] | None = None, from_log: bool = False,
         keep_going: bool = False, dist_prefix: str = "kdb-system",
         progress: Progress | None = None, on_step: Step | None = None,
         sign: str | os.PathLike[str] | None = None) -> list[PackResult]:
    """Build ``<arch>.kdb`` for every arch from one input, and a wheel each if ``version``.

    Exactly one input: ``manifest`` (compiled here), ``from_db`` (copy a user database) or
    ``from_log`` (copy the kernels of the start-up latency log of ``from_db``'s database, by
    default the user tier's). A kernel that fails to compile raises :class:`PackError` with
    its build log, unless ``keep_going``: then the others are packed and the failures are in
    each result's ``failures``. Wheels are named ``<dist_prefix>-<arch>``.

    ``sign``: a private key file (:mod:`kdb.signing`); every entry of every file is signed
    with it. Entries copied from a database (not compiled here) are signed only when they
    verify under ``KDB_TRUSTED_KEYS`` where a trust policy is set (the others are left out
    and listed in the result's ``refused``): a signature vouches for the bytes.
    """
    if sum(x for x in (manifest is not None, from_log, from_db is not None and not from_log)) != 1:
        raise InvalidArgumentError("give exactly one input: --manifest FILE, --from-db [PATH] "
                                   "or --from-log")
    from .builtfor import built_for
    from .wheel import build_wheel, check_version, dist_name, source_date_epoch

    out = Path(out_dir)
    specs = load_manifest(manifest) if manifest is not None else None
    arch_list = resolve_arches(arches)
    if version is not None:  # a bad version or name fails before any compile
        check_version(version)
        for arch in arch_list:
            dist_name(arch, dist_prefix)
    source_date_epoch()  # as does a bad SOURCE_DATE_EPOCH

    def step(arch: str, what: str) -> None:
        if on_step:
            on_step(arch, what)

    signer, vouch = _signing(sign, copying=specs is None)
    if specs is None:
        wait_for_stores(from_db, on_step)
    else:
        check_manifest(specs, arch_list)
    _check_out(out)  # and an --out nothing can be written to
    results = []
    for arch in arch_list:
        start = time.perf_counter()
        failures: list[tuple[str, str]] = []
        with tempfile.TemporaryDirectory(prefix="kdb-pack-") as work:
            if specs is not None:
                step(arch, "compiling the manifest's kernels")
                src, failures = _compiled(specs, arch, Path(work), keep_going, progress)
                keys = None
            else:
                src, keys = _copied(from_db, arch, Path(work), from_log, step)
            step(arch, f"writing {out / f'{arch}.kdb'}")
            result = write_system_db(out / f"{arch}.kdb", arch, [src], keys,
                                     keep_compile_seconds=specs is None, sign=signer,
                                     vouch=vouch)
        result.failures = failures
        if version is not None:
            step(arch, f"building the wheel {dist_name(arch, dist_prefix)} {version}")
            result.wheel = build_wheel(result.path, arch, version, out, dist_prefix=dist_prefix,
                                       built=built_for(result.path))
        result.seconds = time.perf_counter() - start
        results.append(result)
    return results


def _check_out(out: Path) -> None:
    """``--out``, or the nearest directory above it that exists, one this user can write in,
    checked before anything compiles and without making it: a read-only one, or one under a
    file, failed only after every kernel had compiled."""
    there = out.absolute()
    while not there.exists() and there.parent != there:
        there = there.parent
    why = ("is not a directory" if not there.is_dir() else
           "is not writable" if not os.access(there, os.W_OK | os.X_OK) else None)
    if why is not None:
        shown = "" if there == out.absolute() else f" ({there} {why})"
        raise PackError(f"--out {out}: nothing can be written there{shown or ': it ' + why}; "
                        "give a directory you can write")


def _compiled(specs: list, arch: str, work: Path, keep_going: bool,
              progress: Progress | None) -> tuple[Path, list[tuple[str, str]]]:
    """The manifest's kernels for ``arch`` compiled into a file under ``work``; a failure
    stops the pack unless ``keep_going`` (and some kernel for ``arch`` was packed)."""
    src, failures = compile_manifest(specs, arch, work, keep_going=keep_going,
                                     progress=progress)
    if failures and not keep_going:
        name, why = failures[0]
        raise PackError(f"kernel {name!r} could not be packed for {arch} (fix it, "
                        f"or pass --keep-going to pack the others): {why}")
    if failures and len(failures) == len(applicable(specs, arch)):
        raise PackError(f"no kernel could be packed for {arch} ("
                        + ", ".join(n for n, _ in failures) + "); the first, "
                        f"{failures[0][0]!r}: {failures[0][1]}")
    return src, failures


def _copied(from_db, arch: str, work: Path, from_log: bool,
            step: Step) -> tuple[Path, set[str] | None]:
    """The user database (or the shared tier's copy under ``work``) to pack ``arch`` from,
    and with ``from_log`` the keys its start-up latency log names."""
    src = user_db_file(from_db, arch, work_dir=work,
                       option="--from-log" if from_log else "--from-db")
    shown = shown_source(from_db) or src  # the shared tier: its URL, password masked
    check_source(src, shown)
    keys = log_keys(src) if from_log else None
    if from_log and not keys:
        raise PackError(f"the start-up latency log of {shown} is empty for {arch} (builds "
                        "kdb does not cache, such as those using __TIME__, are left out)")
    step(arch, f"copying {'the logged kernels' if from_log else 'the entries'} of {shown}")
    return src, keys


def _signing(sign: str | os.PathLike[str] | None, copying: bool):
    """``(signer, vouch)`` policies for a pack: the key that signs (read and checked before
    any compile), and, for copied entries under a trust policy, the keys they must verify
    under first (the pack's own key counts)."""
    if sign is None:
        return None, None
    from ..signing import keyfiles, policy as signing

    key, key_id = keyfiles.load_private(os.path.abspath(os.fspath(sign)))
    signer = signing.Policy({}, False, key, key_id)
    current = signing.current()
    if not copying or current is None or not current.verify:
        return signer, None
    trusted = {k: list(v) for k, v in current.trusted.items()}
    trusted.setdefault(key_id, []).append(key.public_key().public_bytes_raw())
    return signer, signing.Policy(trusted, False)

"""Compiling a manifest's kernels for one arch into a scratch user file.

The kernels go through the very functions a framework calls at run time (the OpenCL and
CUDA back ends, a :class:`~kdb.db.KernelDB` storing into the user tier), so the keys of what
``kdb pack`` ships are the keys a framework will look up.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable
from pathlib import Path

from .. import bookkeeping, config, registry
from ..errors import BackendUnavailableError, CompileError, PackError
from .manifest import KernelSpec, applicable
from ..file.kernelfile import KernelFile

Progress = Callable[[int, int, str], None]  # (done, total, current kernel)

def opencl_arches() -> dict[str, object]:
    """``{arch id: device}`` of the OpenCL devices present (first device per arch)."""
    from ..backends.opencl import packing

    return packing.arches()


def compile_manifest(specs: list[KernelSpec], arch: str, work_dir: Path, *,
                     keep_going: bool = False, progress: Progress | None = None
                     ) -> tuple[Path, list[tuple[str, str]]]:
    """Compile the specs for ``arch`` into a user file under ``work_dir``; returns its path
    and the failures ``(kernel name, why, with the build log)``.

    Each kernel goes to its back end's ``pack`` module (:mod:`kdb.registry`): OpenCL kernels
    are built on a device of that arch, which must be present; CUDA kernels are
    cross-compiled by nvcc or NVRTC and Triton kernels by Triton, no GPU needed. All go
    through the functions a framework calls at run time (:func:`kdb.opencl.build`,
    :func:`kdb.backends.cuda.compile`), so the keys are those it will look up.
    """
    from ..db import KernelDB

    todo = applicable(specs, arch)
    if not todo:
        raise PackError(no_kernel_for(specs, arch))
    backends = {s.backend for s in todo}
    known = registry.packable()
    if backends - set(known):
        raise PackError(f"unknown back end(s) {sorted(backends - set(known))} in the manifest; "
                        f"kdb packs {', '.join(repr(k) for k in known)} kernels")
    packers = {}
    for backend in sorted(backends):
        entry = registry.get(backend)
        if entry.requires is not None:
            require(backend, [s.name for s in todo if s.backend == backend])
        packers[backend] = registry.load(entry.pack)
        if hasattr(packers[backend], "prepare"):
            packers[backend].prepare(arch)

    db = KernelDB(cache_dir=work_dir, system_path=[], use_system=False, disabled=False)
    failures: list[tuple[str, str]] = []
    compiled: dict[str, list[str]] = {}  # kernel name -> keys its build compiled
    with _stored_by_this_process():
        _compile_all(db, todo, packers, arch, progress=progress, keep_going=keep_going,
                     failures=failures, compiled=compiled)
    path = db.tiers.user_file(arch).path
    # The binaries are read back from the driver and stored in the background, where a
    # failure is only logged: a kernel that compiled but was not stored is a failure here.
    stored = _stored_keys(path)
    for name, keys in compiled.items():
        if any(k not in stored for k in keys):
            failures.append((name, "compiled, but its binary could not be read back and "
                                   "stored (see the kdb warnings above)"))
    if progress:
        progress(len(todo), len(todo), "")
    return path, failures


@contextlib.contextmanager
def _stored_by_this_process():
    """The pack's builds stored by this process before it reads them (``KDB_STORE_AT_EXIT
    =wait`` while it compiles). Handed to the store worker, the default, none was stored
    yet when the pack looked: every OpenCL kernel failed the pack, and the worker wrote
    into the pack's work directory after the pack had removed it."""
    before = os.environ.get(config.ENV_STORE_AT_EXIT)
    os.environ[config.ENV_STORE_AT_EXIT] = "wait"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(config.ENV_STORE_AT_EXIT, None)
        else:
            os.environ[config.ENV_STORE_AT_EXIT] = before


def _compile_all(db, todo, packers, arch: str, *, progress, keep_going: bool,
                 failures: list, compiled: dict) -> None:
    """Build each spec through its back end, noting failures and the keys each compiled;
    every store is written when this returns."""
    try:
        for i, spec in enumerate(todo):
            if progress:
                progress(i, len(todo), spec.name)
            seen = len(bookkeeping.records())
            try:
                packers[spec.backend].compile_spec(spec, arch, db)
            except CompileError as err:
                failures.append((spec.name, "the build failed; build log:\n"
                                 + (err.log or str(err)).rstrip()))
                if not keep_going:
                    break
            recs = bookkeeping.records()[seen:]
            if (why := _uncached(recs)) is not None:
                failures.append((spec.name, why))
                if not keep_going:
                    break
                continue
            compiled[spec.name] = [r.key for r in recs]
        if progress:
            progress(len(todo), len(todo), "storing the binaries")
    finally:
        db.close()
        # These compiles are the product, not a slow start-up: no exit summary for them.
        bookkeeping.forget_compiles()


def _uncached(recs) -> str | None:
    """Why a kernel whose build kdb does not cache (its log rows, ``recs``) cannot be packed
    (a pack would never serve it: not "could not be stored"); None if it was cached."""
    for r in recs:
        if r.reason.startswith(bookkeeping.UNCACHED):
            return "kdb cannot pack it: " + r.reason[len(bookkeeping.UNCACHED):]
    return None


def no_kernel_for(specs: list[KernelSpec], arch: str) -> str:
    """Why no kernel of the manifest goes to ``arch``: the arches its kernels name, and the
    back ends of those that name none (a CUDA kernel builds for CUDA arches only, a HIP
    kernel for gfx processors only)."""
    named = sorted({a for s in specs if s.arches for a in s.processors()})
    unnamed = sorted({s.backend for s in specs if not s.arches})
    return (f"the manifest lists no kernel for arch {arch!r}"
            + (f": its kernels name {', '.join(named)}" if named else "")
            + (f"{';' if named else ':'} its {', '.join(unnamed)} kernels that name no arches "
               f"do not build for {arch!r}" if unnamed else ""))


def check_manifest(specs: list[KernelSpec], arches: list[str]) -> None:
    """Each back end's ``check(specs, arches)`` (where its pack module has one) with its
    kernels and the arches they go to, before anything compiles: an arch its toolchain
    cannot build, or one no kernel goes to, fails the pack at once, not after the other
    arches are built."""
    for arch in arches:
        if not applicable(specs, arch):
            raise PackError(no_kernel_for(specs, arch))
    for backend in sorted({s.backend for s in specs}):
        entry = registry.get(backend)
        mine = [s for s in specs if s.backend == backend]
        to = [a for a in arches if applicable(mine, a)]
        if entry.pack is None or not to:
            continue
        if entry.requires is not None:
            require(backend, [s.name for s in mine])
        module = registry.load(entry.pack)
        if hasattr(module, "check"):
            module.check(mine, to)


def require(backend: str, kernels: list[str]) -> None:
    """Raise :class:`BackendUnavailableError`, in one line that names the extra to install,
    when the module ``backend``'s kernels are compiled with cannot be imported here; checked
    before anything compiles."""
    module, extra = registry.get(backend).requires
    try:
        importlib.import_module(module)
    except ImportError as err:
        shown = ", ".join(kernels[:3]) + (f" and {len(kernels) - 3} more" if len(kernels) > 3
                                          else "")
        raise BackendUnavailableError(
            f"the manifest's {backend} kernel(s) {shown} need {module}, which cannot be "
            f"imported here ({err}): pip install '{extra}'") from err


def _stored_keys(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    f = KernelFile(path, tier="user", readonly=False)
    try:
        return {r[0] for r in f.query("SELECT key FROM kernels")}
    finally:
        f.close()

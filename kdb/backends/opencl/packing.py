"""``kdb pack``'s OpenCL half: a manifest kernel built on a device of the arch, through
:func:`kdb.backends.opencl.build` (the very call a framework makes, so the keys match)."""

from __future__ import annotations

from ...errors import PackError

#: The context made for each arch by :func:`prepare` (one per pack run and arch).
_contexts: dict[str, object] = {}


def arches() -> dict[str, object]:
    """``{arch id: device}`` of the OpenCL devices present (first device per arch)."""
    try:
        import pyopencl as cl
    except ImportError:
        return {}
    from . import arch_of

    found: dict[str, object] = {}
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return {}
    for plat in platforms:
        for dev in plat.get_devices():
            found.setdefault(arch_of(dev), dev)
    return found


def check(specs: list, arches_packed: list[str]) -> None:
    """Before anything compiles: a device of each arch the manifest's OpenCL kernels go to
    (found only at its turn, the arches before it were compiled and written for nothing)."""
    devices = arches()
    for arch in arches_packed:
        if arch not in devices:
            present = ", ".join(sorted(devices)) or "none"
            raise PackError(f"no OpenCL device of arch {arch!r} is present, and OpenCL "
                            f"kernels compile on the device; OpenCL arches present here: "
                            f"{present}")


def prepare(arch: str) -> None:
    """A context on a device of ``arch``, before anything compiles; :class:`PackError`
    naming the arches present where there is none (OpenCL compiles on the device)."""
    import pyopencl as cl

    devices = arches()
    if arch not in devices:
        present = ", ".join(sorted(devices)) or "none"
        raise PackError(f"no OpenCL device of arch {arch!r} is present, and OpenCL kernels "
                        f"compile on the device; OpenCL arches present here: {present}")
    _contexts[arch] = cl.Context([devices[arch]])


def compile_spec(spec, arch: str, db) -> None:
    """Build one manifest kernel for ``arch`` into ``db`` (after :func:`prepare`)."""
    from . import build

    build(_contexts[arch], spec.source, spec.build_options(), db=db, name=spec.name)

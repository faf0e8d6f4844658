"""Which arch a Triton kernel is for, and the compiler identity in its key.

A kdb arch is the name its system database is installed under: ``sm_90`` for Triton's
``GPUTarget("cuda", 90, 32)``, ``gfx942`` for ``GPUTarget("hip", "gfx942", 64)``. Triton asks
its cache before it says the target, so the manager takes it from :func:`target` (set by
:func:`kdb.triton.compile` and ``kdb pack``) or else from the device Triton would compile
for; a process with neither (no GPU, a bare ``triton.compile(..., target=...)``) looks in
every Triton arch it has a user or system file for, and stores what it compiles under the
target Triton records in the kernel's metadata.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
from typing import Iterator

#: The ``backend`` hash attribute of every Triton entry.
BACKEND = "triton"

_target: contextvars.ContextVar = contextvars.ContextVar("kdb_triton_target", default=None)

_ARCH_FILE = re.compile(r"^(sm_\d+[a-z]?|gfx[0-9a-f]+)\.kdb$")


def arch_of(backend: str | None, arch: object) -> str:
    """The kdb arch of a Triton target (``("cuda", 90)`` is ``sm_90``, ``("hip", "gfx90a")``
    is ``gfx90a``).

    >>> arch_of("cuda", 90), arch_of("hip", "gfx942"), arch_of("cuda", "100a")
    ('sm_90', 'gfx942', 'sm_100a')
    """
    if backend == "cuda":
        return f"sm_{arch}"
    if backend == "hip":
        return str(arch)
    return f"{backend}_{arch}".lower()


def target_arch(target) -> str:
    """The kdb arch of a ``triton.backends.compiler.GPUTarget``."""
    return arch_of(target.backend, target.arch)


@contextlib.contextmanager
def target(gpu_target):
    """Within this block, Triton's cache lookups are for ``gpu_target`` (a ``GPUTarget``)."""
    token = _target.set(target_arch(gpu_target))
    try:
        yield
    finally:
        _target.reset(token)


#: The device files a GPU driver Triton can use needs (NVIDIA's, WSL's, AMD's, the DRM render
#: nodes of the rest): with none of them there is no active device to ask.
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg", "/dev/kfd", "/dev/dri")


def current_arch() -> str | None:
    """The arch Triton compiles for here: :func:`target`'s, else the active device's, else
    ``None`` (no GPU, or no driver). Where no GPU device file exists the driver is not asked:
    making Triton's driver probes every backend, and AMD's imports torch to do so (1.7 s
    where torch is installed and not imported, Triton 3.9), for an answer known already."""
    arch = _target.get()
    if arch is not None or _no_device:
        return arch
    if not any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        _no_device.append(True)
        return None
    try:
        from triton.runtime.driver import driver

        arch = target_arch(driver.active.get_current_target())
    except Exception:  # noqa: BLE001 - no GPU, no driver: Triton would say so itself
        _no_device.append(True)  # asked once per process: the answer costs a driver probe
        return None
    _seen[:] = [arch]
    return arch


def known_arch() -> str | None:
    """The arch of :func:`target`, else the device's arch once :func:`current_arch` has
    learned it, else ``None``; never asks the driver. Triton builds its host modules while
    its driver is being made, where asking the driver would make another."""
    arch = _target.get()
    return arch if arch is not None else (_seen[0] if _seen else None)


_no_device: list = []
#: The device's arch, once :func:`current_arch` has asked the driver.
_seen: list = []


def is_triton_arch(arch: str) -> bool:
    """Whether ``arch`` names a Triton target kdb keeps a file for (``sm_90``, ``gfx90a``).

    >>> is_triton_arch("sm_90a"), is_triton_arch("gfx942"), is_triton_arch("../x")
    (True, True, False)
    """
    return _ARCH_FILE.match(arch + ".kdb") is not None


def known_archs(tiers) -> list[str]:
    """The Triton arches (``sm_*``, ``gfx*``) this process could find entries for: its user
    files, the system files in ``KDB_SYSTEM_DB_PATH`` and the installed system packages."""
    from ...file import discovery

    found = set()
    for d in (tiers.user_dir, *tiers.system_dirs):
        try:
            found.update(m.group(1) for m in map(_ARCH_FILE.match, os.listdir(d)) if m)
        except OSError:
            continue
    found.update(ep.name for ep in discovery.entry_points(memo_dir=tiers.cache_root)
                 if _ARCH_FILE.match(ep.name + ".kdb"))
    return sorted(found)


def lookup_archs(tiers, name: str) -> Iterator[str]:
    """Where to look for ``name`` while the device's arch is unknown, in order: every Triton
    arch this node has a file for, then, once those missed, the other Triton arches the
    shared tier holds an entry of that name in, if one is set (asked only then: a node with
    an sm_90 file never looked there, and compiled every gfx942 kernel the cluster held). A
    row's arch is whatever a writer put there, so only Triton's forms are taken."""
    known = known_archs(tiers)
    yield from known
    yield from (a for a in tiers.shared_arches(BACKEND, name)
                if is_triton_arch(a) and a not in known)


def compiler_identity() -> tuple[tuple[str, str], ...]:
    """Triton's version and the Python it runs on. Triton's cache key already digests its
    code, the backend's tools and the target, and with them its compiled extension, which is
    built per Python version: the same Triton on CPython 3.11 and 3.12 gives every kernel
    another key. Named here, a pack built on the wrong Python is a miss that says why
    (``kdb explain``, the start-up log), not a silent one."""
    import sys

    import triton

    return (("triton", triton.__version__), ("python", sys.implementation.cache_tag))

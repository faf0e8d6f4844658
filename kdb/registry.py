"""The one table of back ends and of shared-tier schemes every front end reads.

Core modules never import a back end; the store worker, ``kdb pack``, ``kdb info`` and
``kdb explain`` find one here, by name, and import it only when they need it. Adding a back
end is its package under ``kdb/backends/`` and one :func:`register` line below (a test or a
plugin may register more at run time); adding a shared tier is its module and one line of
:data:`SHARED_TIERS`. docs/architecture.md ("Adding things") says what else each touches.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BackEnd:
    """What the front ends need to know of a back end, as module paths (imported when used).

    ``module``: its package. ``label``: its name in reports. ``stores_jobs``: the store
    worker redoes its deferred stores (``module.rebuild_and_store(db, data)``, and
    ``refresh_job(db, job)`` where it has one). ``pack``: the module ``kdb pack`` compiles a
    manifest kernel with (``compile_spec(spec, arch, db)``; ``check(specs, arches)``,
    called once with all its kernels and arches before anything compiles, and
    ``prepare(arch)``, called before each arch's compiles, where it has them); None where a
    manifest cannot name it.
    ``requires``: the module a pack needs and the extra that brings it. ``compiler_rank``:
    ``"module:function"`` ranking the compilers of builds that differ only in the compiler,
    for a back end whose binaries load where no compiler is installed (``kdb explain``).
    ``per_python``: its entries serve only the Python they name, so a pack of them is tagged
    for that Python (:mod:`kdb.pack.builtfor`).
    """

    name: str
    module: str
    label: str
    stores_jobs: bool = False
    pack: str | None = None
    requires: tuple[str, str] | None = None
    compiler_rank: str | None = None
    per_python: bool = False


_BACKENDS: dict[str, BackEnd] = {}


def register(backend: BackEnd) -> BackEnd:
    """Add ``backend`` (or replace the one of its name); returns it."""
    _BACKENDS[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    _BACKENDS.pop(name, None)


def backends() -> list[BackEnd]:
    """Every back end, in the order registered."""
    return list(_BACKENDS.values())


def get(name: str) -> BackEnd:
    """The back end ``name``; ``LookupError`` naming those that exist."""
    found = _BACKENDS.get(name)
    if found is None:
        raise LookupError(f"no back end {name!r} (kdb has {', '.join(_BACKENDS)})")
    return found


def packable() -> list[str]:
    """The names a manifest's ``backend`` may take."""
    return [b.name for b in _BACKENDS.values() if b.pack is not None]


def load(path: str) -> Any:
    """The module ``path`` names, or ``module:attribute``'s attribute."""
    module, _, attr = path.partition(":")
    got = importlib.import_module(module)
    return getattr(got, attr) if attr else got


register(BackEnd("opencl", "kdb.backends.opencl", "OpenCL", stores_jobs=True,
                 pack="kdb.backends.opencl.packing", requires=("pyopencl", "kdb[opencl]")))
register(BackEnd("cuda", "kdb.backends.cuda", "CUDA", pack="kdb.backends.cuda.packing",
                 compiler_rank="kdb.backends.cuda:compiler_rank"))
register(BackEnd("hip", "kdb.backends.hip", "HIP", pack="kdb.backends.hip.packing",
                 compiler_rank="kdb.backends.hip:compiler_rank"))
register(BackEnd("triton", "kdb.backends.triton", "Triton", per_python=True,
                 pack="kdb.backends.triton.packing", requires=("triton", "kdb[triton]")))
register(BackEnd("torch", "kdb.backends.torch", "torch.compile", per_python=True))


#: URL scheme (before any ``+driver``) -> the module whose ``tier(url)`` is the shared tier.
#: A scheme not listed goes to :data:`DEFAULT_SHARED`, whose check of the URL says what it
#: takes (the tier is then off, with one warning).
SHARED_TIERS = {"postgresql": "kdb.shared.tier", "postgres": "kdb.shared.tier"}
DEFAULT_SHARED = "kdb.shared.tier"


def shared_tier_module(url: str) -> str:
    """The module of the shared tier ``url`` names, by its scheme."""
    scheme = url.split(":", 1)[0].split("+", 1)[0].lower()
    return SHARED_TIERS.get(scheme, DEFAULT_SHARED)

"""zstd for the hit path: the ``zstandard`` package's C extension, loaded by itself.

``import zstandard`` runs the package's ``__init__``, which imports :mod:`typing` and
:mod:`platform` to choose a backend before it loads the extension ``zstandard.backend_c``
that does the work; on a fresh process serving one hit that choice costs more than the rest
of the hit. Where the package would choose that extension anyway (CPython, no other backend
asked for), :func:`load` finds it the way the import system does (``sys.meta_path``'s
finders, then the package's search locations), loads it with its
:class:`~importlib.machinery.ExtensionFileLoader` and registers it in :data:`sys.modules`
as ``zstandard.backend_c``, so a later ``import zstandard`` by anyone re-exports this very
module (same classes, same ``ZstdError``). Anywhere else it is ``import zstandard``.

The one difference a later ``import zstandard`` shows: the import system binds a submodule
as an attribute of its package only when it loads it, so ``zstandard.backend_c`` is reached
through ``import zstandard.backend_c`` / ``sys.modules`` rather than as an attribute.
"""

from __future__ import annotations

import os
import sys

PACKAGE = "zstandard"
EXTENSION = "zstandard.backend_c"
#: Values of zstandard's own ``PYTHON_ZSTANDARD_IMPORT_POLICY`` under which its package
#: imports ``backend_c`` on CPython (``cffi_fallback`` tries it first).
_CEXT_POLICIES = ("default", "cext", "cffi_fallback")


def load(fast: bool = True) -> object:
    """The module holding ``ZstdCompressor``, ``ZstdDecompressor`` and ``ZstdError``: the C
    extension loaded by itself when ``fast`` and possible, else the ``zstandard`` package."""
    if fast and PACKAGE not in sys.modules:
        module = sys.modules.get(EXTENSION) or (_extension() if _package_would_pick_cext()
                                                else None)
        if module is not None:
            return module
    import zstandard

    return zstandard


def _package_would_pick_cext() -> bool:
    """Whether ``import zstandard`` would load ``backend_c`` (its ``__init__``'s rule)."""
    policy = os.environ.get("PYTHON_ZSTANDARD_IMPORT_POLICY", "default").strip()
    return sys.implementation.name == "cpython" and policy in _CEXT_POLICIES


def _find_spec(name: str, path: list[str] | None) -> object:
    """The spec ``import`` would use for ``name`` (``path``: the package's locations)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, path) if find is not None else None
        if spec is not None:
            return spec
    return None


def _extension() -> object:
    """``zstandard.backend_c`` without running ``zstandard/__init__.py``, or ``None`` when it
    is not a C extension found beside that package (another build or layout)."""
    from importlib.machinery import ExtensionFileLoader

    package = _find_spec(PACKAGE, None)
    locations = getattr(package, "submodule_search_locations", None)
    if not locations:
        return None
    spec = _find_spec(EXTENSION, list(locations))
    loader = getattr(spec, "loader", None)
    if not isinstance(loader, ExtensionFileLoader):
        return None
    try:
        module = loader.create_module(spec)
        # The attributes importlib.util.module_from_spec sets (importing importlib.util
        # would import contextlib on the hit path).
        module.__spec__, module.__loader__, module.__package__ = spec, loader, PACKAGE
        if spec.has_location:
            module.__file__ = spec.origin
        sys.modules[EXTENSION] = module  # what zstandard's __init__ will import
        loader.exec_module(module)
    except ImportError:  # built for another interpreter, a missing library
        sys.modules.pop(EXTENSION, None)
        return None
    return module

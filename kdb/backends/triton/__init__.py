"""Triton through kdb: every compiled Triton kernel is a kdb entry, served from the system
tier of its arch, the user tier or the shared tier; a miss compiles once per node (other
processes wait for its entry) and is stored off the critical path.

``install()`` makes kdb Triton's cache manager in this process, through Triton's own setting
(``triton.knobs.cache.manager_class``), never the environment: ``TRITON_CACHE_MANAGER`` is
inherited by every child, and a child whose Python has no kdb (another venv, the system
``python3``) would die at its first compile. ``KDB_AUTO=1``, ``kdb run`` and ``pytest --kdb``
call it when the program imports Triton, in each process that has kdb (``KDB_AUTO`` is
inherited). A program that names its own cache manager keeps it, with one warning, whether
it names it before kdb is installed or later in ``TRITON_CACHE_MANAGER``. :func:`compile`
compiles for an explicit target (no GPU needed), as ``kdb pack`` does.

The rooms: :mod:`.cache` (the manager), :mod:`.chosen` (kdb's manager or the program's),
:mod:`.groups` (a kernel's files as one entry, and the private directory Triton reads them
from), :mod:`.hostmods` (the C extensions Triton builds with the host's compiler),
:mod:`.targets` (arch names, identity).
Imports the core and the policy, never a front end.
"""

from __future__ import annotations

import os
import sys

from ... import logs
from .targets import BACKEND, arch_of, target, target_arch

#: Triton's variable naming its cache manager class (``module:Class``).
ENV_MANAGER = "TRITON_CACHE_MANAGER"
#: kdb's manager, as that variable names it.
MANAGER = "kdb.triton:CacheManager"

__all__ = ["BACKEND", "ENV_MANAGER", "MANAGER", "arch_of", "compile", "install", "installed",
           "target", "target_arch", "uninstall"]


def install() -> bool:
    """Make kdb Triton's cache in this process (its children that have kdb adopt it through
    ``KDB_AUTO``); False (with one warning) when the program already names a cache manager of
    its own, in ``TRITON_CACHE_MANAGER`` or in Triton's setting, which it keeps."""
    current = os.environ.get(ENV_MANAGER)
    if current and current != MANAGER:
        return _kept(f"{ENV_MANAGER} is already set ({current})")
    from .chosen import CacheManagerUnlessTheirs

    knobs = _knobs()
    if knobs is None:  # a Triton before 3.4 reads only the variable (children inherit it)
        os.environ[ENV_MANAGER] = MANAGER
        return True
    theirs = knobs.__dict__.get("manager_class")
    if theirs is not None and not _ours(knobs):
        return _kept(f"triton.knobs.cache.manager_class is already set ({theirs!r})")
    knobs.manager_class = CacheManagerUnlessTheirs  # a TRITON_CACHE_MANAGER set later wins
    if current is None:
        os.environ.pop(ENV_MANAGER, None)  # set in this process only, never passed on
    return True


def _kept(what: str) -> bool:
    logs.warn_once("triton-manager", "kdb: %s, so Triton keeps that cache and kdb does not "
                   "cache Triton kernels in this process; unset it to use kdb", what)
    return False


def _knobs():
    """``triton.knobs.cache`` where Triton is imported and has it (3.4 on), else None."""
    cache = getattr(sys.modules.get("triton.knobs"), "cache", None)
    return cache if "manager_class" in dir(type(cache)) else None  # dir: no descriptor runs


def _ours(knobs) -> bool:
    module = sys.modules.get(__name__ + ".chosen")
    return module is not None and knobs.__dict__.get("manager_class") in (
        module.CacheManager, module.CacheManagerUnlessTheirs)


def uninstall() -> None:
    """Give Triton its own file cache back."""
    knobs = _knobs()
    if knobs is not None and _ours(knobs):
        del knobs.manager_class
    if os.environ.get(ENV_MANAGER) == MANAGER:
        del os.environ[ENV_MANAGER]


def installed() -> bool:
    """Whether Triton's cache is kdb in this process."""
    knobs = _knobs()
    return (knobs is not None and _ours(knobs)) or os.environ.get(ENV_MANAGER) == MANAGER


def compile(src, target_=None, options=None):  # noqa: A001 - triton.compile's name
    """``triton.compile(src, target=target_, options=options)`` with kdb as the cache, the
    lookup made for ``target_`` (a ``GPUTarget``; default: the active device's)."""
    import triton

    install()
    if target_ is None:
        return triton.compile(src, options=options)
    with target(target_):
        return triton.compile(src, target=target_, options=options)

"""Triton through kdb: every compiled Triton kernel is a kdb entry, served from the system
tier of its arch, the user tier or the shared tier; a miss compiles once per node (other
processes wait for its entry) and is stored off the critical path.

``install()`` makes kdb Triton's cache manager (``TRITON_CACHE_MANAGER``, inherited by child
processes); ``KDB_AUTO=1``, ``kdb run`` and ``pytest --kdb`` call it when the program imports
Triton. A program that names its own cache manager keeps it. :func:`compile` compiles for an
explicit target (no GPU needed), as ``kdb pack`` does.

The rooms: :mod:`.cache` (the manager), :mod:`.groups` (a kernel's files as one entry, and
the private directory Triton reads them from), :mod:`.targets` (arch names, identity).
Imports the core and the policy, never a front end.
"""

from __future__ import annotations

import os

from ... import logs
from .targets import BACKEND, arch_of, target, target_arch

#: Triton's variable naming its cache manager class (``module:Class``).
ENV_MANAGER = "TRITON_CACHE_MANAGER"
#: kdb's manager, as that variable names it.
MANAGER = "kdb.triton:CacheManager"

__all__ = ["BACKEND", "ENV_MANAGER", "MANAGER", "arch_of", "compile", "install", "installed",
           "target", "target_arch", "uninstall"]


def install() -> bool:
    """Make kdb Triton's cache for this process and the processes it starts; False (with one
    warning) when the program already names a cache manager of its own, which it keeps."""
    current = os.environ.get(ENV_MANAGER)
    if current and current != MANAGER:
        logs.warn_once(
            "triton-manager", "kdb: %s is already set (%s), so Triton keeps that cache and "
            "kdb does not cache Triton kernels in this process; unset it to use kdb",
            ENV_MANAGER, current)
        return False
    os.environ[ENV_MANAGER] = MANAGER
    return True


def uninstall() -> None:
    """Give Triton its own file cache back."""
    if os.environ.get(ENV_MANAGER) == MANAGER:
        del os.environ[ENV_MANAGER]


def installed() -> bool:
    """Whether Triton's cache is kdb in this process."""
    return os.environ.get(ENV_MANAGER) == MANAGER


def compile(src, target_=None, options=None):  # noqa: A001 - triton.compile's name
    """``triton.compile(src, target=target_, options=options)`` with kdb as the cache, the
    lookup made for ``target_`` (a ``GPUTarget``; default: the active device's)."""
    import triton

    install()
    if target_ is None:
        return triton.compile(src, options=options)
    with target(target_):
        return triton.compile(src, target=target_, options=options)

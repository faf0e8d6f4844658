"""The cache manager :func:`kdb.triton.install` gives Triton: kdb's, unless the program names
its own in ``TRITON_CACHE_MANAGER``.

``install()`` sets Triton's own setting (``triton.knobs.cache.manager_class``), which from then
on hides the variable from Triton: a program that sets ``TRITON_CACHE_MANAGER`` after
importing Triton (as Triton 3.4 on allows) would get kdb's manager, with no word said.
:class:`CacheManagerUnlessTheirs` reads the variable each time Triton makes a manager and
hands the program's own back, with one warning.
"""

from __future__ import annotations

import importlib
import os

from ... import logs
from .cache import CacheManager

#: :data:`kdb.backends.triton.ENV_MANAGER`, repeated: that package imports this module (and
#: with it Triton) only when it installs kdb, so this one cannot import it back.
ENV_MANAGER = "TRITON_CACHE_MANAGER"


class CacheManagerUnlessTheirs(CacheManager):
    """kdb's :class:`~kdb.backends.triton.cache.CacheManager`, or the program's own where
    ``TRITON_CACHE_MANAGER`` names one (see the module's docstring)."""

    def __new__(cls, key: str, override: bool = False, dump: bool = False):
        theirs = named()
        if theirs is None:
            return super().__new__(cls)
        return theirs(key, override=override, dump=dump)


def named() -> type | None:
    """The class ``TRITON_CACHE_MANAGER`` names (imported as Triton imports it) where that is
    not kdb's, after one warning; None where the variable is unset or names kdb's."""
    value = os.environ.get(ENV_MANAGER)
    if not value:
        return None
    module, _, name = value.partition(":")
    theirs = getattr(importlib.import_module(module), name)
    if isinstance(theirs, type) and issubclass(theirs, CacheManager):
        return None  # kdb's, by any of its names
    logs.warn_once("triton-manager", "kdb: %s is set (%s), so Triton keeps that cache and kdb "
                   "does not cache Triton kernels in this process; unset it to use kdb",
                   ENV_MANAGER, value)
    return theirs

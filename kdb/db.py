"""KernelDB: the public API of a kernel database, and the one place its caller's arguments
are checked.

A program (or a framework with its own compiler) asks for a binary with :meth:`KernelDB.get`,
:meth:`~KernelDB.get_or_compile` or :meth:`~KernelDB.lookup` and stores one with
:meth:`~KernelDB.put`; the members listed in ``docs/api.md`` are all there is. A wrong type is
refused here, at once, with :class:`~kdb.errors.InvalidArgumentError`, never inside a
background store where nobody would see it. The work is done by :class:`kdb.tiers.Tiers`
(``KernelDB.tiers``), the named interface back ends and the store worker use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import config
from .errors import InvalidArgumentError, UnsupportedTypeError
from .keys import HashAttributes
from .tiers import Hit, Tiers

if TYPE_CHECKING:  # annotations are strings here
    from pathlib import Path
    from typing import Any, Callable

__all__ = ["DEFAULT_DB_VARIABLES", "Hit", "KernelDB", "default_db"]


class KernelDB:
    """A kernel database: read-only system files per arch, then a writable user file per arch.

    ``cache_dir`` is the user tier's root (default ``KDB_CACHE_DIR`` or the platform's user
    cache; files live in ``<cache_dir>/v<format major>/<arch>.kdb``). ``system_path`` adds
    directories searched for ``<arch>.kdb`` before installed packages (default
    ``KDB_SYSTEM_DB_PATH``). ``disabled`` turns every tier off (default ``KDB_DISABLE_CACHE``);
    ``use_system=False`` consults the user tier only.
    """

    __slots__ = ("tiers",)

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None,
                 system_path: str | os.PathLike[str] | list | None = None, *,
                 disabled: bool | None = None, trace: bool | None = None,
                 use_system: bool = True) -> None:
        _check_db_arguments(cache_dir, system_path, disabled=disabled, trace=trace,
                            use_system=use_system)
        #: The tiers and the policy over them: what back ends and the store worker call.
        self.tiers = Tiers(cache_dir, system_path, disabled=disabled, trace=trace,
                           use_system=use_system)

    def __repr__(self) -> str:
        return f"KernelDB(cache_dir={str(self.tiers.cache_root)!r})"

    def __reduce__(self):
        raise UnsupportedTypeError(
            "a KernelDB cannot be pickled (it holds open files and threads): let each process "
            "open its own, kdb.KernelDB(cache_dir=...) or kdb.default_db(), from the same "
            "cache_dir")

    @property
    def cache_root(self) -> Path:
        """The user tier's root directory."""
        return self.tiers.cache_root

    @property
    def user_dir(self) -> Path:
        """The directory of the user tier's files (``<cache_root>/v<format major>``)."""
        return self.tiers.user_dir

    @property
    def system_dirs(self) -> list[Path]:
        """The directories searched for ``<arch>.kdb`` before installed packages."""
        return self.tiers.system_dirs

    @property
    def disabled(self) -> bool:
        """Whether every tier is off (``disabled=True`` or ``KDB_DISABLE_CACHE=1``)."""
        return self.tiers.disabled

    def lookup(self, attrs: HashAttributes) -> Hit | None:
        """The :class:`Hit` for ``attrs`` from the first tier that holds a sound copy, else
        ``None`` (a miss compiles nothing)."""
        if type(attrs) is not HashAttributes:
            _check_attrs(attrs)
        return self.tiers.lookup(attrs)

    def get(self, attrs: HashAttributes) -> bytes | None:
        """The stored binary for ``attrs``, or ``None`` on a miss."""
        hit = self.lookup(attrs)
        return hit.binary if hit else None

    def get_or_compile(self, attrs: HashAttributes, compile_fn: Callable[[], bytes], *,
                       details: dict[str, Any] | None = None,
                       recheck: Callable[[], tuple] | None = None) -> bytes:
        """The stored binary, or ``compile_fn()``'s result, stored in the background.

        Another process compiling the same key is waited for (``KDB_WAIT_TIMEOUT``) instead
        of compiled twice. ``details`` (JSON values) are stored beside the entry.
        ``recheck()`` returns ``attrs.headers`` as they are now: called after the compile,
        right before the store, a difference (a header saved while it compiled) stores
        nothing."""
        if type(attrs) is not HashAttributes:
            _check_attrs(attrs)
        if not callable(compile_fn):
            raise InvalidArgumentError(
                f"compile_fn must be a function returning bytes, not {type(compile_fn).__name__}")
        _check_details(details)
        if recheck is not None and not callable(recheck):
            raise InvalidArgumentError(
                f"recheck must be a function returning the headers, not {type(recheck).__name__}")
        return self.tiers.get_or_compile(attrs, compile_fn, details=details, recheck=recheck)

    def put(self, attrs: HashAttributes, binary: bytes, *, compile_seconds: float = 0.0,
            details: dict[str, Any] | None = None) -> bool:
        """Store ``binary`` for ``attrs`` in the user tier now; True if it was written."""
        if not isinstance(binary, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"binary must be bytes, not {type(binary).__name__}")
        if not len(binary):
            raise InvalidArgumentError("binary is empty: no compiler builds nothing")
        _check_attrs(attrs)
        _check_details(details)
        if isinstance(compile_seconds, bool) or not isinstance(compile_seconds, (int, float)):
            raise InvalidArgumentError(
                f"compile_seconds must be a number, not {type(compile_seconds).__name__}")
        if not 0 <= compile_seconds < float("inf"):  # NaN too: kdb stats adds them up
            raise InvalidArgumentError(f"compile_seconds must be a finite number of seconds "
                                       f">= 0, not {compile_seconds!r}")
        return self.tiers.storing.put(attrs, binary, compile_seconds=compile_seconds,
                                      details=details)

    def flush(self) -> None:
        """Finish background stores and write batched bookkeeping; strict mode re-raises."""
        self.tiers.flush()

    def close(self) -> None:
        """Flush, then close every open file."""
        self.tiers.close()


# -- the caller's arguments -------------------------------------------------------------------


def _check_db_arguments(cache_dir: object, system_path: object, **flags: object) -> None:
    paths = (str, os.PathLike)
    if cache_dir is not None and not isinstance(cache_dir, paths):
        raise InvalidArgumentError(
            f"cache_dir must be a path (str or os.PathLike), not {type(cache_dir).__name__}")
    if cache_dir is not None and "\0" in (where := os.fsdecode(cache_dir)):
        raise InvalidArgumentError(f"cache_dir {where!r} holds a NUL character, which no "
                                   "path can: pass the directory's real name")
    items = system_path if isinstance(system_path, (list, tuple)) else [system_path]
    if system_path is not None and not all(isinstance(p, paths) for p in items):
        raise InvalidArgumentError(
            "system_path must be a path, an os.pathsep-separated string, or a list of paths; "
            f"got {system_path!r}")
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be True, False or None, not {value!r}")


def _check_attrs(attrs: object) -> None:
    if not isinstance(attrs, HashAttributes):
        raise InvalidArgumentError(f"expected kdb.HashAttributes, got {type(attrs).__name__}")


def _check_details(details: object) -> None:
    """``details`` is stored as JSON: refuse what JSON cannot hold before anything runs."""
    if details is None:
        return
    if not isinstance(details, dict):
        raise InvalidArgumentError(
            f"details must be a dict of JSON values, not {type(details).__name__}")
    import json

    try:
        json.dumps(details, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise InvalidArgumentError(
            f"details must hold only JSON values (str, numbers, bools, lists, dicts with str "
            f"keys): {err}") from None


# -- the process's default database -----------------------------------------------------------

_default: KernelDB | None = None
_default_config: tuple | None = None


#: Every variable the default KernelDB's configuration depends on.
DEFAULT_DB_VARIABLES = (config.ENV_CACHE_DIR, config.ENV_SYSTEM_DB_PATH, config.ENV_DISABLE_CACHE,
                         config.ENV_TRACE, "XDG_CACHE_HOME", "HOME", "LOCALAPPDATA")


def default_db(variables: dict[str, str | None] | None = None) -> KernelDB:
    """The process's KernelDB for the current environment (rebuilt if the variables change).

    ``variables``: ``{name: value}`` for (at least) ``DEFAULT_DB_VARIABLES``, as
    :func:`config.read_variables` returns it, for a back end that reads them together with
    its own in one go.
    """
    global _default, _default_config
    # The raw variables, compared as strings: resolving paths on every build costs more.
    if variables is None:
        variables = config.read_variables(DEFAULT_DB_VARIABLES)
    cfg = tuple(variables.get(name) for name in DEFAULT_DB_VARIABLES)
    if _default is None or cfg != _default_config:
        # The old instance is not flushed here: that would make this build wait for every
        # pending store. Its queued jobs hold it alive; collecting it writes what is left.
        _default, _default_config = KernelDB(), cfg
    return _default

"""KernelDB: the lookup, compile and store policy over its tiers.

A hit is :meth:`KernelDB.lookup` read top to bottom: key, then one loop over the tiers
(:mod:`kdb.tiers`: system files, the user file, and the shared tier when ``KDB_SHARED_URL``
is set), each row checked by :func:`kdb.tiers.verified`, a counter bumped in memory
(:mod:`kdb.bookkeeping`). No lock, no write, no SQLAlchemy. A miss claims the key or waits
for the process that compiles it (:mod:`kdb.claims`) and compiles outside any transaction;
how the result reaches the writable tiers (the background writer, the store worker, the
shared tier) is the store side, :mod:`kdb.storing.stores`, which ``KernelDB`` inherits.
"""

from __future__ import annotations

import os
from pathlib import Path
import sys
import time
from collections import namedtuple

from . import arguments, config, latency, logs
from .bookkeeping import Book, add
from .keys import HashAttributes
from .file.kernelfile import CompileRecord, KernelFile
from .storing.stores import _BACKGROUND, Storing, _background
from .tiers import FileTier, system_files, verified

TYPE_CHECKING = False
if TYPE_CHECKING:  # annotations are strings here
    from typing import Any, Callable, Iterator

    from . import claims

log = logs.get("kdb")
trace_log = logs.get("kdb.trace")


class Hit(namedtuple("Hit", "binary tier path compile_seconds")):
    """A binary found in a tier: ``binary`` (bytes), ``tier`` ("memory", "system", "user" or
    "shared"), ``path`` (the file or server it came from) and ``compile_seconds`` (what
    compiling it cost when it was stored)."""

    __slots__ = ()


class KernelDB(Storing):
    """A kernel database: read-only system files per arch, then a writable user file per arch.

    ``cache_dir`` is the user tier's root (default ``KDB_CACHE_DIR`` or the platform's user
    cache; files live in ``<cache_dir>/v<format major>/<arch>.kdb``). ``system_path`` adds
    directories searched for ``<arch>.kdb`` before installed packages (default
    ``KDB_SYSTEM_DB_PATH``). ``disabled`` turns every tier off (default ``KDB_DISABLE_CACHE``);
    ``use_system=False`` consults the user tier only.
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None,
                 system_path: str | os.PathLike[str] | list | None = None, *,
                 disabled: bool | None = None, trace: bool | None = None,
                 use_system: bool = True) -> None:
        arguments.check_db_arguments(cache_dir, system_path, disabled=disabled, trace=trace,
                                     use_system=use_system)
        # Kept as str: a hit needs no pathlib (the properties below give Paths to callers).
        self._cache_root = config.cache_root_str(cache_dir)
        self._user_dir = os.path.join(self._cache_root, f"v{config.FORMAT_MAJOR}")
        self._system_dirs = config.system_dirs_str(system_path)
        self.disabled = config.flag(config.ENV_DISABLE_CACHE, disabled)
        self.trace = config.flag(config.ENV_TRACE, trace)
        self.use_system = use_system  # False: user tier only (``kdb pack`` builds this way)
        if self.trace:
            logs.enable_output(trace_log, "kdb.trace")
        self._system: dict[str, list[KernelFile]] = {}
        self._user: dict[str, KernelFile] = {}
        self._local: dict[str, tuple[FileTier, ...]] = {}
        self._inflight: dict[str, bytes] = {}
        # Batched hit counts, counters and log rows (kdb.bookkeeping): written by the
        # background store, a flush, the exit, or when this instance is collected.
        self._book = Book(self._user_dir, self._user, self._inflight, self.disabled)

    def __del__(self) -> None:
        # Collected without a flush: its batched bookkeeping is not lost.
        book = self.__dict__.get("_book")
        if book is not None:
            try:
                book.release()
            except Exception:  # noqa: BLE001, S110 - at collection or interpreter shutdown
                pass

    def __repr__(self) -> str:
        return f"KernelDB(cache_dir={self._cache_root!r})"

    @property
    def cache_root(self) -> Path:
        """The user tier's root directory."""
        from pathlib import Path

        return Path(self._cache_root)

    @property
    def user_dir(self) -> Path:
        """The directory of the user tier's files (``<cache_root>/v<format major>``)."""
        from pathlib import Path

        return Path(self._user_dir)

    @property
    def system_dirs(self) -> list[Path]:
        """The directories searched for ``<arch>.kdb`` before installed packages."""
        from pathlib import Path

        return [Path(d) for d in self._system_dirs]

    # -- tiers ----------------------------------------------------------------------------

    def user_file(self, arch: str) -> KernelFile:
        """The user tier's file for ``arch`` (it may not exist yet)."""
        f = self._user.get(arch)
        return f if f is not None else self._book.user_file(arch)

    def system_files(self, arch: str) -> list[KernelFile]:
        """The system files for ``arch``; the first call per arch warns if there are none."""
        files = self._system.get(arch)
        if files is None:
            files = self._system[arch] = system_files(
                arch, self._system_dirs, self._cache_root, self._user_dir, self.use_system)
        return files

    def _tiers(self, arch: str) -> Iterator:
        """The tiers in lookup order: system files, the user file, then the shared tier
        (only when ``KDB_SHARED_URL`` is set, and only once the local tiers missed)."""
        local = self._local.get(arch)
        if local is None:
            local = self._local[arch] = tuple(
                FileTier(f) for f in (*self.system_files(arch), self.user_file(arch)))
        yield from local
        if os.environ.get(config.ENV_SHARED_URL):
            shared = self._shared()
            if shared is not None:
                yield shared

    # -- the hot path ---------------------------------------------------------------------

    def lookup(self, attrs: HashAttributes) -> Hit | None:
        """The binary for ``attrs`` from the first tier that holds a sound copy, else None."""
        if type(attrs) is not HashAttributes:
            arguments.check_attrs(attrs)
        if self.disabled:
            return None
        if self.trace:
            trace_log.debug("lookup %s %s", attrs.key, attrs.encoded().decode("utf-8"))
        raw = self._inflight.get(attrs.key)
        if raw is not None:
            add("hits.memory", 1)  # this process's own counts only: not a file's statistics
            return Hit(raw, "memory", "", 0.0)
        hit = self._first_hit(attrs, self._tiers(attrs.arch))
        if hit is None:
            self._count(attrs.arch, "misses", 1)
            log.debug("kdb: miss %s %s", attrs.key[:16], attrs.name)
        return hit

    def _first_hit(self, attrs: HashAttributes, tiers) -> Hit | None:
        """The one loop over tiers: fetch, verify, count, answer (a bad row is dropped)."""
        key = attrs.key
        for tier in tiers:
            row = tier.fetch(key)
            if row is None:
                continue
            raw, problem = verified(row, attrs)
            if raw is None:
                self._bad_entry(tier, attrs, problem)
                continue
            name = tier.name
            self._count(attrs.arch, f"hits.{name}", 1, key=key if name == "user" else None,
                        saved=row.compile_seconds)
            where = tier.describe()
            log.debug("kdb: hit %s %s in %s", key[:16], attrs.name, where)
            if name == "shared":
                self._copy_to_user(tier, attrs, raw, row)
            return Hit(raw, name, where, row.compile_seconds)
        return None

    def claim_or_wait(self, attrs: HashAttributes) -> Hit | claims.Claim | None:
        """After a miss: claim the key for compiling, or wait while another process does.

        Returns the :class:`Hit` another process published meanwhile, a
        :class:`~kdb.claims.Claim` (this process compiles; pass it to :meth:`put_later`,
        which releases it once stored), or ``None`` when coordination is unavailable or the
        wait ran past ``KDB_WAIT_TIMEOUT`` (compile anyway). The waiting policy is
        :func:`kdb.claims.claim_or_wait`'s.
        """
        from . import claims  # a miss: the hit path never needs it

        if self.disabled or claims.held_here(attrs.key):
            return None  # this process compiled it and is storing it: never wait on oneself
        user = self.user_file(attrs.arch)
        if not self._user_trusted(user):
            return None  # claims live beside the user file: none in a directory others own
        shared = self._shared()  # shared tier: the cross-node lock and its hits (None: off)
        if shared is None and not user.usable:
            return None  # a refused user file: nothing to wait for, and no claims written there
        published = (FileTier(user),) if shared is None else (FileTier(user), shared)
        return claims.claim_or_wait(self.user_dir / "claims", attrs.key,
                                    attrs.name or attrs.key[:16],
                                    lambda: self._first_hit(attrs, published),
                                    config.wait_timeout(), shared)

    def get(self, attrs: HashAttributes) -> bytes | None:
        """The stored binary for ``attrs``, or ``None`` on a miss."""
        hit = self.lookup(attrs)
        return hit.binary if hit else None

    # -- misses ---------------------------------------------------------------------------

    def get_or_compile(self, attrs: HashAttributes, compile_fn: Callable[[], bytes], *,
                       details: dict[str, Any] | None = None) -> bytes:
        """The stored binary, or ``compile_fn()``'s result, stored in the background."""
        arguments.check_compile_fn(compile_fn)
        arguments.check_details(details)
        config.max_size()  # a bad KDB_CACHE_MAX_SIZE raises here, not in the background store
        hit = self.lookup(attrs)
        if hit is not None:
            return hit.binary
        got = self.claim_or_wait(attrs)
        if isinstance(got, Hit):
            return got.binary
        try:
            start = time.perf_counter()
            binary = compile_fn()
            seconds = time.perf_counter() - start
            arguments.check_binary(binary, "compile_fn must return bytes, returned")
        except BaseException:
            if got is not None:
                got.release()
            raise
        binary = bytes(binary)
        rec = self.record_compile(attrs, seconds)
        if not self.disabled:
            # The store waits for a quiet moment; until then this process answers a repeated
            # request from memory instead of waiting on its own claim.
            self._inflight[attrs.key] = binary
        self.put_later(attrs, lambda: binary, compile_seconds=seconds, details=details, log=rec,
                       claim=got)
        return binary

    def record_compile(self, attrs: HashAttributes, seconds: float,
                       reason: str | None = None) -> CompileRecord:
        """Log a compile in the start-up latency log (memory now, user file soon)."""
        missed = []
        if not self.disabled:
            missed.append("system" if self._system.get(attrs.arch) else "system(none)")
            missed.append("user")
            if self._shared() is not None:
                missed.append("shared")
        if reason is None:
            reason = ("cache disabled (KDB_DISABLE_CACHE)" if self.disabled
                      else f"no system database for {attrs.arch}"
                      if not self._system.get(attrs.arch) else "not in any tier")
        rec = latency.record(attrs.key, attrs.name, attrs.arch, attrs.backend, seconds,
                             ",".join(missed), reason)
        self._count(attrs.arch, "compiles", 1)
        self._count(attrs.arch, "compile_seconds", seconds)
        return rec

    # -- shared tier (kdb.shared.tier; only when KDB_SHARED_URL is set) ------------------------

    def _shared(self):
        """The shared tier, or ``None`` when ``KDB_SHARED_URL`` is unset (read when used)."""
        url = config.shared_url()
        if url is None or self.disabled or not self.use_system:
            return None
        from .shared import tier as shared  # SQLAlchemy loads here, never on a local hit

        return shared.tier(url)

    # -- bookkeeping ----------------------------------------------------------------------

    def _count(self, arch: str, counter: str, n: float, key: str | None = None,
               saved: float = 0.0) -> None:
        self._book.count(arch, counter, n, key, saved)

    def take_bookkeeping(self, archs) -> dict[str, dict]:
        """Remove and return the latency-log rows, hit counts and counters pending for
        ``archs``, as JSON data, for a process that writes them instead of this one."""
        return self._book.take_json(archs)

    def flush(self) -> None:
        """Finish background stores and write batched bookkeeping; strict mode re-raises."""
        # Never imported: nothing was submitted. (Imported, not taken from sys.modules: the
        # import waits for a thread that is halfway through it.)
        errors = _background().drain() if _BACKGROUND in sys.modules else []
        self._book.write_all()
        if errors and config.flag(config.ENV_STRICT):
            raise errors[0]

    def close(self) -> None:
        """Flush, then close every open file."""
        self.flush()
        for f in (*self._user.values(), *(f for fs in self._system.values() for f in fs)):
            f.close()


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

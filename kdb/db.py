"""KernelDB: the two-tier lookup (system, then user), compile on a miss, store off the hot path.

A hit is :meth:`KernelDB.lookup` read top to bottom: key, system files, user file, checksum
and collision check, a counter bumped in memory. No lock, no write, no SQLAlchemy. Misses
are compiled by the caller's function outside any transaction, and stored by the
background writer (:mod:`kdb.background`) in one short transaction together with the
batched access bookkeeping. With ``KDB_SHARED_URL`` set, a lookup that missed both local
tiers asks the shared tier (:mod:`kdb.shared`, a PostgreSQL server) before compiling; the
hooks are marked "shared tier".
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections import namedtuple

from . import config, discovery, faults, latency, logs, tally
from .codec import decode
from .errors import InvalidArgumentError
from .keys import HashAttributes
from .store import CompileRecord, Entry, KernelFile

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs ~2 ms to import; annotations are strings here
    from pathlib import Path
    from typing import Any, Callable

    from . import claims

log = logs.get("kdb")
trace_log = logs.get("kdb.trace")


class Hit(namedtuple("Hit", "binary tier path compile_seconds")):
    """A binary found in a tier: ``binary`` (bytes), ``tier`` ("memory", "system", "user" or
    "shared"), ``path`` (the file or server it came from) and ``compile_seconds`` (what
    compiling it cost when it was stored)."""

    __slots__ = ()


class _Pending:
    """What the background writer still has to write for one arch."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.logs: list[CompileRecord] = []
        self.hits: dict[str, tuple[int, float]] = {}
        self.counters: dict[str, float] = {}

    def empty(self) -> bool:
        return not (self.entries or self.logs or self.hits or self.counters)

    def worth_creating_a_file(self) -> bool:
        """Entries and log rows are; counters alone are not: creating a user file runs the
        alembic migrations (~0.5 s), which a process that only hit the system tier would
        otherwise pay at exit. Its counts go to the user file once one exists."""
        return bool(self.entries or self.logs)


_instances: "weakref.WeakSet[KernelDB]" = weakref.WeakSet()

#: Pids of claim holders this process waited for in vain (stopped, or stuck in a driver).
_given_up: set[int] = set()


class KernelDB:
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
        _check_arguments(cache_dir, system_path, disabled=disabled, trace=trace,
                         use_system=use_system)
        self.cache_root = config.cache_root(cache_dir)
        self.user_dir = config.user_dir(cache_dir)
        self.system_dirs = config.system_dirs(system_path)
        self.disabled = config.flag(config.ENV_DISABLE_CACHE, disabled)
        self.trace = config.flag(config.ENV_TRACE, trace)
        self.use_system = use_system  # False: user tier only (``kdb pack`` builds this way)
        if self.trace:
            _enable_trace_output()
        self._system: dict[str, list[KernelFile]] = {}
        self._user: dict[str, KernelFile] = {}
        self._pending: dict[str, _Pending] = {}
        self._inflight: dict[str, bytes] = {}
        self._spooled = False  # jobs handed to the store worker: its bookkeeping goes too
        self._lock = threading.Lock()
        _instances.add(self)
        # A KernelDB dropped without flush() must not lose its batched bookkeeping (hits,
        # counters): write it when the instance is collected. Holds no reference to self.
        # At exit _flush_all writes it instead (it knows about the store worker).
        weakref.finalize(self, _write_left_over, self._pending, self._lock, self._user,
                         self.user_dir, self.disabled).atexit = False

    def __repr__(self) -> str:
        return f"KernelDB(cache_dir={str(self.cache_root)!r})"

    # -- tiers ----------------------------------------------------------------------------

    def user_file(self, arch: str) -> KernelFile:
        """The user tier's file for ``arch`` (it may not exist yet)."""
        f = self._user.get(arch)
        if f is None:
            config.check_arch(arch)
            f = self._user[arch] = KernelFile(self.user_dir / f"{arch}.kdb", tier="user",
                                              readonly=False)
        return f

    def system_files(self, arch: str) -> list[KernelFile]:
        """The system files for ``arch``; the first call per arch warns if there are none."""
        files = self._system.get(arch)
        if files is None:
            config.check_arch(arch)
            if not self.use_system:
                files = self._system[arch] = []
                return files
            srcs = discovery.sources_for(arch, self.system_dirs, memo_dir=self.cache_root)
            files = self._system[arch] = [
                KernelFile(s.path, tier="system", readonly=True) for s in srcs]
            if not files:
                self._warn_no_system(arch)
        return files

    def _warn_no_system(self, arch: str) -> None:
        latency.note_missing_system(arch)
        dirs = ", ".join(str(d) for d in self.system_dirs) or "none set"
        faults.warn_once(
            f"nosys:{arch}",
            "kdb: no system kernel database for arch %r: looked for %s in KDB_SYSTEM_DB_PATH "
            "(%s) and in installed packages (entry point group %r). Kernels for this device "
            "will be compiled at first use and stored in %s, so the first start-up will be "
            "slow. To fix it, install the system database package for this arch "
            "(pip install %s, if your framework publishes one), or build one with "
            "`kdb pack --arch %s` and put its directory in KDB_SYSTEM_DB_PATH.",
            arch, f"{arch}.kdb", dirs, discovery.GROUP, self.user_dir / f"{arch}.kdb",
            discovery.dist_name(arch), arch,
        )

    # -- the hot path ---------------------------------------------------------------------

    def lookup(self, attrs: HashAttributes) -> Hit | None:
        """The binary for ``attrs`` from the first tier that holds a sound copy, else None."""
        if not isinstance(attrs, HashAttributes):
            raise InvalidArgumentError(
                f"expected kdb.HashAttributes, got {type(attrs).__name__}")
        if self.disabled:
            return None
        key = attrs.key
        if self.trace:
            trace_log.debug("lookup %s %s", key, attrs.encoded().decode("utf-8"))
        raw = self._inflight.get(key)
        if raw is not None:
            return Hit(raw, "memory", "", 0.0)
        hit = self._find(attrs, (*self.system_files(attrs.arch), self.user_file(attrs.arch)))
        if hit is None and os.environ.get(config.ENV_SHARED_URL):  # shared tier (kdb.shared)
            hit = self._shared_hit(attrs)
        if hit is None:
            self._count(attrs.arch, "misses", 1)
            log.debug("kdb: miss %s %s", key[:16], attrs.name)
        return hit

    def _find(self, attrs: HashAttributes, files) -> Hit | None:
        key = attrs.key
        for f in files:
            row = f.fetch(key)
            if row is None:
                continue
            raw = decode(row.codec, row.blob, row.raw_size, row.checksum)
            if raw is None or row.attributes != attrs.encoded().decode("utf-8"):
                self._bad_entry(f, attrs, "checksum mismatch" if raw is None
                                else "key collision (stored attributes differ)")
                continue
            self._count(attrs.arch, f"hits.{f.tier}", 1, key=key if f.tier == "user" else None,
                        saved=row.compile_seconds)
            log.debug("kdb: hit %s %s in %s", key[:16], attrs.name, f.path)
            return Hit(raw, f.tier, str(f.path), row.compile_seconds)
        return None

    def claim_or_wait(self, attrs: HashAttributes) -> Hit | claims.Claim | None:
        """After a miss: claim the key for compiling, or wait while another process does.

        Returns the :class:`Hit` another process published meanwhile, a
        :class:`~kdb.claims.Claim` (this process compiles; pass it to :meth:`put_later`,
        which releases it once stored), or ``None`` when coordination is unavailable or the
        wait ran past ``KDB_WAIT_TIMEOUT`` (compile anyway). With a shared tier the claim
        also holds the key's cross-node lock; a process that holds this node's claim while
        another node compiles the key waits for the shared entry, and past the bound
        compiles it with that claim.
        """
        from . import claims  # a miss: the hit path never needs it

        if self.disabled or claims.held_here(attrs.key):
            return None  # this process compiled it and is storing it: never wait on oneself
        directory = self.user_dir / "claims"
        user = (self.user_file(attrs.arch),)
        shared = self._shared()  # shared tier: the cross-node lock and its hits (None: off)
        if shared is None and not (user[0].usable and user[0]._trusted()):
            return None  # a refused user file: nothing to wait for, and no claims written there
        deadline = time.monotonic() + config.wait_timeout()
        try:
            return self._claim_loop(attrs, directory, user, shared, deadline)
        finally:
            if shared is not None:
                shared.unwant(attrs.key)

    def _claim_loop(self, attrs: HashAttributes, directory, user, shared, deadline):
        """Poll with bounded back-off: this node's claim first, then the cross-node lock.

        A waiter waits for a compile that is running, up to ``deadline``; for an entry whose
        compile is done and whose store is only queued (:mod:`kdb.spool`), at most as long
        as that compile took, since building the program itself costs about that. A holder
        that made no progress within the bound is given up on for the rest of the process.
        """
        from . import claims

        delay = 0.002
        claim = None
        while True:
            try:
                claim = claim or claims.try_claim(directory, attrs.key)
            except OSError as err:
                # Same once-key as the user file's write faults: a read-only cache warns once.
                faults.fault(f"cannot write to the kernel cache {self.user_dir} ({err}): kernels "
                             "are compiled but may not be stored, and processes may compile the "
                             "same kernel. Make it writable or set KDB_CACHE_DIR to a writable "
                             "directory.", once=str(self.user_dir))
                return None
            # Shared tier: with the local claim, take the cross-node lock too (None: no server).
            locked = shared.try_lock(attrs.key) if shared and claim else None
            # Even with the claim: the holder may have published just before releasing it.
            hit = self._find(attrs, user) or (self._shared_hit(attrs) if shared else None)
            if hit is not None:
                if locked:
                    shared.unlock(attrs.key)
                if claim is not None:
                    claim.release()
                return hit
            if claim is not None and locked is not False:
                return shared.adopt(claim) if locked else claim
            if claim is None:
                holder = claims.holder(directory, attrs.key)
                if holder.pid in _given_up:
                    return None  # it made no progress before: do not wait for it again
                claims.want(directory, attrs.key)
                if (holder.state == claims.PENDING
                        and time.time() - holder.since >= claims.pending_wait(holder.seconds)):
                    return None  # its store did not come: building it costs no more
            else:  # this node's claim is ours, another node compiles it: ask it to hurry
                shared.want(attrs.key)
            if time.monotonic() >= deadline:
                if claim is None and holder.pid:
                    _given_up.add(holder.pid)
                log.warning("kdb: waited %.0f s for another process (pid %s) to compile %s; "
                            "compiling it here, and not waiting for that process again "
                            "(KDB_WAIT_TIMEOUT)", config.wait_timeout(),
                            holder.pid if claim is None and holder.pid else "unknown",
                            attrs.name or attrs.key[:16])
                return claim  # ours if this node's claim is: its other processes wait for us
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def get(self, attrs: HashAttributes) -> bytes | None:
        """The stored binary for ``attrs``, or ``None`` on a miss."""
        hit = self.lookup(attrs)
        return hit.binary if hit else None

    # -- misses ---------------------------------------------------------------------------

    def get_or_compile(self, attrs: HashAttributes, compile_fn: Callable[[], bytes], *,
                       details: dict[str, Any] | None = None) -> bytes:
        """The stored binary, or ``compile_fn()``'s result, stored in the background."""
        if not callable(compile_fn):
            raise InvalidArgumentError(
                f"compile_fn must be a function returning bytes, not {type(compile_fn).__name__}")
        _check_details(details)
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
            if not isinstance(binary, (bytes, bytearray, memoryview)):
                raise InvalidArgumentError(
                    f"compile_fn must return bytes, returned {type(binary).__name__}")
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

    def put(self, attrs: HashAttributes, binary: bytes, *, compile_seconds: float = 0.0,
            details: dict[str, Any] | None = None) -> bool:
        """Store ``binary`` for ``attrs`` in the user tier now; True if it was written."""
        if not isinstance(binary, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"binary must be bytes, not {type(binary).__name__}")
        if not isinstance(attrs, HashAttributes):
            raise InvalidArgumentError(f"expected kdb.HashAttributes, got {type(attrs).__name__}")
        _check_details(details)
        if isinstance(compile_seconds, bool) or not isinstance(compile_seconds, (int, float)):
            raise InvalidArgumentError(
                f"compile_seconds must be a number, not {type(compile_seconds).__name__}")
        if self.disabled:
            return False
        self.flush()
        pending = _Pending()
        pending.entries.append(self._entry(attrs, bytes(binary), compile_seconds, details))
        with self._lock:
            mine = self._pending.pop(attrs.arch, None)
        if mine is not None:
            pending.logs, pending.hits, pending.counters = mine.logs, mine.hits, mine.counters
            pending.entries[:0] = mine.entries
        written = self.user_file(attrs.arch).write(pending.entries, pending.logs, pending.hits,
                                                   pending.counters)
        shared = self._shared()  # shared tier: a compile is published to both
        if shared is not None:
            shared.publish(pending.entries[-1:])
        return written

    def put_later(self, attrs: HashAttributes, produce: Callable[[], bytes | None], *,
                  compile_seconds: float = 0.0, details: dict[str, Any] | None = None,
                  log: CompileRecord | None = None, claim: claims.Claim | None = None,
                  publish: bool = True) -> None:
        """Store what ``produce()`` returns, on the background thread (None: store nothing).

        ``claim``, from :meth:`claim_or_wait`, is released once the entry is stored (in the
        user tier, and published to the shared tier unless ``publish`` is false).
        """
        _check_details(details)
        config.max_size()  # a bad KDB_CACHE_MAX_SIZE raises here, not in the background store
        if log is not None:
            with self._lock:
                self._pending.setdefault(attrs.arch, _Pending()).logs.append(log)
        if self.disabled:
            if claim is not None:
                claim.release()
            return

        def job() -> None:
            entry = None
            try:
                raw = produce()
                if raw is not None:
                    entry = self._entry(attrs, bytes(raw), compile_seconds, details)
                    self._inflight[entry.key] = entry.raw
                    with self._lock:
                        self._pending.setdefault(attrs.arch, _Pending()).entries.append(entry)
                self._write(attrs.arch)
                shared = self._shared() if publish and entry is not None else None
                if shared is not None:  # shared tier: published before the claim is released
                    shared.publish([entry], [log] if log is not None else [])
            finally:
                if claim is not None:
                    claim.release()

        _background().submit(job)

    def spool(self, job: dict, claims: list | None = None, store_now=None) -> bool:
        """Hand a back end's store job to the store worker (:mod:`kdb.spool`); False when it
        cannot be written (the caller stores in the background instead)."""
        from . import spool

        if self.disabled or not spool.can_spool():
            return False
        job = {**job, "cache_dir": str(self.cache_root),
               "claims_dir": str(self.user_dir / "claims")}
        try:
            spool.submit(self.user_dir, job, claims, store_now)
        except OSError as err:
            faults.fault(f"cannot hand stores to the store worker under {self.user_dir} ({err});"
                         " storing them in this process", once=str(self.user_dir))
            return False
        self._spooled = True
        return True

    def can_store(self, arch: str) -> bool:
        """Whether a store for ``arch`` could land anywhere: False when the user file was
        refused (another owner, newer than kdb, not a file) and no shared tier is set, so a
        back end need not read binaries, nor start a store worker, for nothing."""
        f = self.user_file(arch)
        return self._shared() is not None or (f.usable and f._trusted())

    def store(self, items: list, logs: list[CompileRecord] = ()) -> bool:
        """Store ``(attrs, binary, compile_seconds, details)`` items and latency rows now, in
        one transaction per arch (the store worker's write); True if written."""
        by_arch: dict[str, list[Entry]] = {}
        for attrs, binary, seconds, details in items:
            by_arch.setdefault(attrs.arch, []).append(
                self._entry(attrs, bytes(binary), seconds, details))
        rows: dict[str, list[CompileRecord]] = {}
        for rec in logs:
            rows.setdefault(rec.arch, []).append(rec)
        ok = True
        for arch in sorted(set(by_arch) | set(rows)):
            entries = by_arch.get(arch, [])
            ok = self.user_file(arch).write(entries, rows.get(arch, []), {}, {}) and ok
            shared = self._shared() if entries else None
            if shared is not None:
                shared.publish(entries, rows.get(arch, []))
        return ok

    def write_bookkeeping(self, archs: dict[str, dict]) -> None:
        """Write bookkeeping taken from another process (:meth:`take_bookkeeping`)."""
        for arch, book in archs.items():
            self.user_file(arch).write([], [CompileRecord(*row) for row in book["logs"]],
                                       {k: tuple(v) for k, v in book["hits"].items()},
                                       book["counters"])

    def discard(self, attrs: HashAttributes, reason: str, tier: str = "user") -> None:
        """Drop an entry that proved bad (e.g. the driver refused the binary) from the user
        tier, and from the shared tier too when it came from there."""
        faults.fault(f"entry {attrs.key[:16]} ({attrs.name or 'unnamed'}) dropped: {reason}",
                     once=f"discard:{self.user_dir}")
        self._inflight.pop(attrs.key, None)
        f = self.user_file(attrs.arch)
        _background().submit(lambda: f.delete([attrs.key]))
        shared = self._shared() if tier == "shared" else None
        if shared is not None:
            _background().submit(lambda: shared.drop(attrs.key))

    def _bad_entry(self, f: KernelFile, attrs: HashAttributes, reason: str) -> None:
        if f.tier == "user":
            self.discard(attrs, reason)
        else:
            faults.fault(f"entry {attrs.key[:16]} in {f.path} is unusable: {reason}; skipped",
                         once=f"bad:{f.path}")

    @staticmethod
    def _entry(attrs: HashAttributes, raw: bytes, seconds: float,
               details: dict[str, Any] | None) -> Entry:
        return Entry(key=attrs.key, arch=attrs.arch, backend=attrs.backend, name=attrs.name,
                     attributes=attrs.encoded().decode("utf-8"), raw=raw,
                     compile_seconds=seconds, details=details)

    # -- shared tier (kdb.shared; only when KDB_SHARED_URL is set) ------------------------

    def _shared(self):
        """The shared tier, or ``None`` when ``KDB_SHARED_URL`` is unset (read when used)."""
        url = config.shared_url()
        if url is None or self.disabled or not self.use_system:
            return None
        from . import shared  # SQLAlchemy loads here, never on a local hit

        return shared.tier(url)

    def _shared_hit(self, attrs: HashAttributes) -> Hit | None:
        """After the local tiers missed: the shared entry, copied into the user tier."""
        shared = self._shared()
        row = shared.fetch(attrs.key) if shared is not None else None
        if row is None:
            return None
        raw = decode(row.codec, row.blob, row.raw_size, row.checksum)
        if raw is None or row.attributes != attrs.encoded().decode("utf-8"):
            faults.fault(f"entry {attrs.key[:16]} in the shared tier {shared.shown} is "
                         "unusable: " + ("checksum mismatch" if raw is None else
                                         "key collision (stored attributes differ)")
                         + "; it is dropped and compiled again", once="bad:shared:" + attrs.key)
            _background().submit(lambda: shared.drop(attrs.key))
            return None
        self._count(attrs.arch, "hits.shared", 1, saved=row.compile_seconds)
        log.debug("kdb: hit %s %s in %s", attrs.key[:16], attrs.name, shared.shown)
        self._inflight[attrs.key] = raw  # served from memory until the copy is stored
        try:
            import json

            details = json.loads(row.details)
        except ValueError:
            details = None
        self.put_later(attrs, lambda: raw, compile_seconds=row.compile_seconds,
                       details=details, publish=False)
        _background().submit(lambda: shared.touch(attrs.key))
        return Hit(raw, "shared", shared.shown, row.compile_seconds)

    # -- bookkeeping ----------------------------------------------------------------------

    def _count(self, arch: str, counter: str, n: float, key: str | None = None,
               saved: float = 0.0) -> None:
        with self._lock:
            p = self._pending.get(arch)
            if p is None:
                p = self._pending[arch] = _Pending()
            p.counters[counter] = p.counters.get(counter, 0) + n
            if saved:
                p.counters["saved_seconds"] = p.counters.get("saved_seconds", 0) + saved
            if key is not None:
                count, _ = p.hits.get(key, (0, 0.0))
                p.hits[key] = (count + 1, time.time())
        tally.add(counter, n, saved)  # this process's counts, for `kdb run` and pytest --kdb

    def _write(self, arch: str) -> None:
        """Write what is pending for ``arch`` (runs on the background thread, or at flush)."""
        with self._lock:
            p = self._pending.pop(arch, None)
        if p is None or p.empty() or self.disabled:
            return
        f = self.user_file(arch)
        if not p.worth_creating_a_file() and not f.path.exists():
            return
        f.write(p.entries, p.logs, p.hits, p.counters)
        for e in p.entries:
            self._inflight.pop(e.key, None)

    def take_bookkeeping(self, archs) -> dict[str, dict]:
        """Remove and return the latency-log rows, hit counts and counters pending for
        ``archs``, as JSON data, for a process that writes them instead of this one
        (the store worker, :mod:`kdb.spool`): so that no exit creates and migrates a user file."""
        out = {}
        with self._lock:
            for arch in archs:
                p = self._pending.pop(arch, None)
                if p is not None:
                    out[arch] = {"logs": [list(rec) for rec in p.logs],
                                 "hits": {k: list(v) for k, v in p.hits.items()},
                                 "counters": p.counters}
        return out

    def flush(self) -> None:
        """Finish background stores and write batched bookkeeping; strict mode re-raises."""
        # Never imported: nothing was submitted. (Imported, not taken from sys.modules: the
        # import waits for a thread that is halfway through it.)
        errors = _background().drain() if _BACKGROUND in sys.modules else []
        for arch in list(self._pending):
            self._write(arch)
        if errors and config.flag(config.ENV_STRICT):
            raise errors[0]

    def close(self) -> None:
        """Flush, then close every open file."""
        self.flush()
        for f in (*self._user.values(), *(f for fs in self._system.values() for f in fs)):
            f.close()


def _check_arguments(cache_dir: object, system_path: object, **flags: object) -> None:
    """The caller's mistakes in ``KernelDB(...)`` as :class:`InvalidArgumentError`, at once."""
    paths = (str, os.PathLike)
    if cache_dir is not None and not isinstance(cache_dir, paths):
        raise InvalidArgumentError(
            f"cache_dir must be a path (str or os.PathLike), not {type(cache_dir).__name__}")
    items = system_path if isinstance(system_path, (list, tuple)) else [system_path]
    if system_path is not None and not all(isinstance(p, paths) for p in items):
        raise InvalidArgumentError(
            "system_path must be a path, an os.pathsep-separated string, or a list of paths; "
            f"got {system_path!r}")
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be True, False or None, not {value!r}")


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


def _enable_trace_output() -> None:
    import logging

    trace = trace_log.logger()
    trace.setLevel(logging.DEBUG)
    if not trace.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("kdb.trace: %(message)s"))
        trace.addHandler(handler)


_BACKGROUND = __name__.rpartition(".")[0] + ".background"


def _background():
    """:mod:`kdb.background`, imported by the first store (its queue costs ~1 ms to import)."""
    from . import background

    return background


_default: KernelDB | None = None
_default_config: tuple | None = None


#: Every variable the default KernelDB's configuration depends on.
DEFAULT_DB_VARIABLES = (config.ENV_CACHE_DIR, config.ENV_SYSTEM_DB_PATH, config.ENV_DISABLE_CACHE,
                         config.ENV_TRACE, "XDG_CACHE_HOME", "HOME", "LOCALAPPDATA")


def default_db(variables: tuple[str | None, ...] | None = None) -> KernelDB:
    """The process's KernelDB for the current environment (rebuilt if the variables change).

    ``variables``: the values of ``DEFAULT_DB_VARIABLES``, for a back end that reads them
    together with its own in one :func:`config.environ_values` call.
    """
    global _default, _default_config
    # The raw variables, compared as strings: resolving paths on every build cost ~50 us.
    cfg = config.environ_values(DEFAULT_DB_VARIABLES) if variables is None else variables
    if _default is None or cfg != _default_config:
        # The old instance is not flushed here: that would make this build wait for every
        # pending store. Its queued jobs hold it alive; its finalizer writes what is left.
        _default, _default_config = KernelDB(), cfg
    return _default


def _write_left_over(pending: dict[str, _Pending], lock: threading.Lock,
                     files: dict[str, KernelFile], user_dir: Path, disabled: bool) -> None:
    """Write what a collected (or, at exit, still live) KernelDB left pending."""
    with lock:
        left = list(pending.items())
        pending.clear()
    if disabled:
        return
    for arch, p in left:
        if p.empty():
            continue
        f = files.get(arch) or KernelFile(user_dir / f"{arch}.kdb", tier="user", readonly=False)
        if not p.worth_creating_a_file() and not f.path.exists():
            continue
        try:
            f.write(p.entries, p.logs, p.hits, p.counters)
        except Exception as err:  # noqa: BLE001 - runs at collection or exit: never raise
            log.warning("kdb: could not write bookkeeping: %s", err)


def _flush_all() -> None:
    """At exit: finish background stores within their budget, then write bookkeeping.

    Bookkeeping for a user file that does not exist yet, of a process whose stores went to
    the store worker, goes to the worker too: creating the file runs the migrations.
    """
    if _BACKGROUND in sys.modules:  # never imported: nothing was submitted
        _background().finish()
    for db in list(_instances):
        try:
            if db._spooled and not db.disabled:
                archs = [a for a in list(db._pending)
                         if not (db.user_dir / f"{a}.kdb").exists()]
                book = db.take_bookkeeping(archs)
                if book:
                    from . import spool

                    spool.submit(db.user_dir, {"kind": "bookkeeping",
                                               "cache_dir": str(db.cache_root), "archs": book})
        except Exception as err:  # noqa: BLE001 - never fail an exiting program
            log.warning("kdb: could not hand bookkeeping to the store worker: %s", err)
        for arch in list(db._pending):
            try:
                db._write(arch)
            except Exception as err:  # noqa: BLE001 - never fail an exiting program
                log.warning("kdb: could not write bookkeeping at exit: %s", err)


atexit.register(_flush_all)

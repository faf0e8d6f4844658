"""Tiers: the places a binary may be found, the one check of a hit, and the policy over them.

:class:`~kdb.file.rows.Tier` is what every tier does, whatever it is made of: :class:`FileTier`
adapts a system or user :class:`~kdb.file.kernelfile.KernelFile`;
:class:`kdb.shared.tier.SharedTier` is the shared one (imported only with ``KDB_SHARED_URL``).
Every row passes through :func:`verified`: a corrupt or colliding entry is refused the same
way wherever it came from.

:class:`Tiers` owns the tiers (the user files, the system files found, the binaries served from
memory until stored) and the hit policy: a hit is :meth:`Tiers.lookup` read top to bottom (one
loop over the tiers, each row verified, trusted, a lower tier's hit copied up, a counter bumped
in memory; no lock, no write, no SQLAlchemy). A miss claims the key or waits for its compiler
(:mod:`kdb.claims`), compiles, and hands the binary to the store side
(:class:`~kdb.storing.stores.Storing`, a part ``Tiers`` holds as ``tiers.storing``): the miss
policy, :meth:`Tiers.get_or_compile`, reads here beside the hit policy. Back ends and the
store worker reach it as ``KernelDB.tiers``; a program calls :class:`kdb.KernelDB`.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import bookkeeping, config, faults, logs
from .bookkeeping import Book, add
from .errors import InvalidArgumentError
from .file import discovery
from .file.codec import decode
from .file.kernelfile import KernelFile
from .file.rows import Hit, Tier  # noqa: F401 - kdb.tiers names both
from . import signing

if TYPE_CHECKING:  # annotations are strings here
    from typing import Any, Callable, Iterable, Iterator

    from . import claims
    from .storing.stores import Storing
    from .keys import HashAttributes
    from .file.kernelfile import CompileRecord, Entry, Row

log = logs.get("kdb")
trace_log = logs.get("kdb.trace")

#: Why :func:`verified` refused a row.
CHECKSUM = "checksum mismatch"
COLLISION = "key collision (stored attributes differ)"
#: What trusting a claims directory others can change would risk, and what happens instead.
_CLAIMS = ("a lock planted there as a link would have kdb write over the file it leads to",
           "kernels are compiled without waiting for other processes")


class FileTier:
    """A system or user file as a :class:`~kdb.file.rows.Tier` (a thin adapter: the file
    does the work)."""

    __slots__ = ("file", "name")

    def __init__(self, file: KernelFile) -> None:
        self.file = file
        self.name = file.tier

    def __repr__(self) -> str:
        return f"FileTier({self.file!r})"

    def fetch(self, key: str) -> Row | None:
        return self.file.fetch(key)

    def publish(self, entries: list[Entry], logs: list[CompileRecord] = ()) -> bool:
        return self.file.write(list(entries), list(logs), {}, {})

    def drop(self, keys: Iterable[str]) -> int:
        return self.file.delete(list(keys))

    def touch(self, key: str) -> None:
        """Nothing here: a file's hits are counted with its bookkeeping (:class:`Book`)."""

    def signature(self, key: str, row: Row) -> tuple[str | None, bytes | None]:
        return self.file.signature(key)

    def describe(self) -> str:
        return self.file.filename


def verified(row, attrs: HashAttributes) -> tuple[bytes | None, str | None]:
    """``(binary, None)`` for a sound row, ``(None, reason)`` for a corrupt or colliding one.

    The checksum is the codec's (:func:`kdb.file.codec.decode`). The collision check compares
    what was stored with what was requested: from revision 0006 the sha256 of the stored
    canonical attributes with the key (the requested ones' sha256), so a row whose attributes
    are not its key's input is never served (docs/tiers.md, "Compact files"); before, the text.
    """
    raw = decode(row.codec, row.blob, row.raw_size, row.checksum)
    if raw is None:
        return None, CHECKSUM
    digest = row.attributes_sha256
    if digest is not None:
        if digest != attrs.key:
            return None, COLLISION
    elif row.attributes != attrs.encoded().decode("utf-8"):
        return None, COLLISION
    return raw, None


class _UserFiles(dict):
    """The user tier's files by arch, each made on first use (it may not exist on disk yet).
    :class:`Tiers` owns them; its :class:`~kdb.bookkeeping.Book` gets ``__getitem__``, a
    callable that holds this map and not the ``Tiers`` (a book stays in a module list until
    its ``Tiers`` is collected, which a reference back would prevent)."""

    def __init__(self, user_dir: Path) -> None:
        super().__init__()
        self.user_dir = user_dir

    def __missing__(self, arch: str) -> KernelFile:
        config.check_arch(arch)
        f = self[arch] = KernelFile(os.path.join(self.user_dir, f"{arch}.kdb"), tier="user",
                                    readonly=False)
        return f


class Tiers:
    """The tiers behind one :class:`kdb.KernelDB`, what it owns (the user files, the system
    files found, the in-flight binaries) and the policy over them: lookup, claims, a miss's
    compile and its records; ``storing`` (a :class:`~kdb.storing.stores.Storing` made with
    what it writes to) stores. The arguments are :class:`kdb.KernelDB`'s, which checks them.

    This is the named interface back ends and the store worker use (``db.tiers``); a
    program uses :class:`kdb.KernelDB`.
    """

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None,
                 system_path: str | os.PathLike[str] | list | None = None, *,
                 disabled: bool | None = None, trace: bool | None = None,
                 use_system: bool = True) -> None:
        self.cache_root = config.cache_root(cache_dir)  # the user tier's root directory
        #: The directory of the user tier's files (``<cache_root>/v<format major>``).
        self.user_dir = self.cache_root / f"v{config.FORMAT_MAJOR}"
        #: The directories searched for ``<arch>.kdb`` before installed packages.
        self.system_dirs = config.system_dirs(system_path)
        self.disabled = config.flag(config.ENV_DISABLE_CACHE, disabled) or self._not_a_dir()
        self.trace = config.flag(config.ENV_TRACE, trace)
        self.use_system = use_system  # False: user tier only (``kdb pack`` builds this way)
        if self.trace:
            logs.enable_output(trace_log, "kdb.trace")
        self._system: dict[str, list[KernelFile]] = {}
        #: Arches found to have no system file while only probed (:meth:`lookup` with
        #: ``count_miss=False``), each with the files refused: warned of once used.
        self._unwarned: dict[str, list[str]] = {}
        self._user = _UserFiles(self.user_dir)
        self._local: dict[str, tuple[FileTier, ...]] = {}
        #: Binaries this process compiled or copied, served from memory until stored.
        self._inflight: dict[str, bytes] = {}
        # Batched hit counts, counters and log rows (kdb.bookkeeping): written by the
        # background store, a flush, the exit, or after this instance is collected.
        self._book = Book(self._user.__getitem__, self.disabled)
        bookkeeping.write_orphans()  # those of KernelDBs collected before this one

    def _not_a_dir(self) -> bool:
        """The cache root names something that is not a directory (a file): one warning
        naming it, and kdb builds without the cache. It said the kernels would be stored
        there, then that they could not be, then that later starts would load them."""
        for path, what in ((self.cache_root, f"the cache directory {self.cache_root} ("
                            f"{config.ENV_CACHE_DIR} or cache_dir=)"),
                           (self.user_dir, f"{self.user_dir}, the cache's user tier,")):
            try:
                if not os.path.exists(path) or os.path.isdir(path):
                    continue
            except (OSError, ValueError):
                continue
            faults.fault(f"{what} is not a directory: kernels are built without the cache; "
                         "name a directory" + ("" if path == self.cache_root else
                                               ", or move that file away"),
                         once=f"not-a-dir:{path}")
            return True
        return False

    @functools.cached_property
    def storing(self) -> Storing:
        """The store side: puts, spools, stores and drops entries, and flushes. Made at its
        first use: a process whose builds all hit never imports it."""
        from .storing.stores import Storing

        return Storing(user_dir=self.user_dir, cache_root=self.cache_root,
                       user_file=self.user_file, book=self._book, inflight=self._inflight,
                       shared=self._shared, disabled=self.disabled)

    def __del__(self) -> None:
        # Collected without a flush: its batched bookkeeping is not lost (written later:
        # nothing is written in a finalizer, bookkeeping.Book.release).
        book = self.__dict__.get("_book")
        if book is not None:
            try:
                book.release()
            except Exception:  # noqa: BLE001, S110 - at collection or interpreter shutdown
                pass

    def __repr__(self) -> str:
        return f"Tiers(cache_dir={str(self.cache_root)!r})"

    # -- tiers ----------------------------------------------------------------------------

    def user_file(self, arch: str) -> KernelFile:
        """The user tier's file for ``arch`` (it may not exist yet)."""
        return self._user[arch]

    def system_files(self, arch: str, warn: bool = True) -> list[KernelFile]:
        """The system files for ``arch``; the first call per arch warns if there are none
        (``warn=False``: a probe of an arch the process may never use; the first call that
        uses it warns)."""
        files = self._system.get(arch)
        if files is None:
            refused: list[str] = []
            files = self._system[arch] = discovery.system_files(
                arch, self.system_dirs, self.cache_root, self.user_dir, self.use_system,
                refused=refused, warn=warn)
            if not files and self.use_system:
                if warn:
                    bookkeeping.note_missing_system(arch)
                else:
                    self._unwarned[arch] = refused
        elif warn and arch in self._unwarned:
            discovery.warn_no_system(arch, self.system_dirs, self.user_dir,
                                     self._unwarned.pop(arch))
            bookkeeping.note_missing_system(arch)
        return files

    def _tiers(self, arch: str, warn: bool = True) -> Iterator:
        """The tiers in lookup order: system files, the user file, then the shared tier
        (only when ``KDB_SHARED_URL`` is set, and only once the local tiers missed)."""
        local = self._local.get(arch)
        if local is None:
            local = self._local[arch] = tuple(
                FileTier(f) for f in (*self.system_files(arch, warn), self.user_file(arch)))
        elif warn and arch in self._unwarned:
            self.system_files(arch)
        yield from local
        if os.environ.get(config.ENV_SHARED_URL):
            shared = self._shared()
            if shared is not None:
                yield shared

    # -- the hot path ---------------------------------------------------------------------

    def lookup(self, attrs: HashAttributes, count_miss: bool = True) -> Hit | None:
        """The binary for ``attrs`` from the first tier that holds a sound copy, else None.
        ``count_miss=False``: one of several arches a caller that cannot know its own looks
        in; it counts the one miss itself, under the arch it then compiles for."""
        if self.disabled:
            return None
        if self.trace:
            trace_log.debug("lookup %s %s", attrs.key, attrs.encoded().decode("utf-8"))
        raw = self._inflight.get(attrs.key)
        if raw is not None:
            add("hits.memory", 1)  # this process's own counts only: not a file's statistics
            return Hit(raw, "memory", "", 0.0)
        hit = self._first_hit(attrs, self._tiers(attrs.arch, warn=count_miss))
        if hit is None and count_miss:
            self.count(attrs.arch, "misses", 1)
            log.debug("kdb: miss %s %s", attrs.key[:16], attrs.name)
        return hit

    def _first_hit(self, attrs: HashAttributes, tiers, claim=None) -> Hit | None:
        """The one loop over tiers: fetch, verify, count, answer (a bad row is dropped).
        ``claim``: this process's claim on the key, released once a shared hit's copy is in
        the user tier (this node's other processes then read it there)."""
        key = attrs.key
        policy = signing.current()
        for tier in tiers:
            row = tier.fetch(key)
            if row is None:
                continue
            raw, problem = verified(row, attrs)
            if raw is None:
                self._bad_entry(tier, attrs, problem, row)
                continue
            if policy is not None and not self._vouched(policy, tier, attrs, row, raw):
                continue
            name = tier.name
            self.count(attrs.arch, f"hits.{name}", 1, key=key if name == "user" else None,
                        saved=row.compile_seconds)
            where = tier.describe()
            log.debug("kdb: hit %s %s in %s", key[:16], attrs.name, where)
            if name == "shared":
                self._copy_to_user(tier, attrs, raw, row, tier.signature(key, row), claim)
            return Hit(raw, name, where, row.compile_seconds)
        return None

    def _bad_entry(self, tier, attrs: HashAttributes, reason: str, row=None) -> None:
        """A row that failed :func:`verified`: the user's is dropped, the shared tier's
        dropped and published anew, a system file's (immutable) skipped."""
        if tier.name == "user":
            self.storing.discard(attrs, reason)
        elif tier.name == "shared":
            faults.fault(f"entry {attrs.key[:16]} in the shared tier {tier.describe()} is "
                         f"unusable: {reason}; it is dropped and compiled again",
                         once="bad:shared:" + attrs.key)
            stored = _stored_key(row, attrs.key)
            _submit(lambda: tier.drop([stored]))
        else:
            faults.fault(f"entry {attrs.key[:16]} in {tier.describe()} is unusable: {reason}; "
                         "skipped", once=f"bad:{tier.describe()}")

    def _vouched(self, policy, tier, attrs: HashAttributes, row, raw: bytes) -> bool:
        """Whether the trust policy lets ``raw`` from ``tier`` be served (a tier it does not
        cover: always). A refused entry is a miss with one warning per cause and signer
        (:meth:`kdb.signing.policy.Policy.refused`); a shared entry whose signature or binary
        was tampered with is dropped, while an unsigned one, or one by a key this node does
        not know, is left to the nodes that may trust it."""
        if not policy.covers(tier.name):
            return True
        key = attrs.key
        signer, signature = tier.signature(key, row)
        # Over the requested attributes: verified() found them to be the stored ones, and a
        # signature that covers them proves its signer vouched for exactly these.
        cause = policy.check(key, attrs.encoded().decode("utf-8"), raw, row.checksum, signer,
                             signature)
        if cause is None:
            return True
        policy.refused(tier.name, tier.describe(), key, attrs.name, cause, signer)
        from .signing.policy import BAD_DIGEST, BAD_SIGNATURE  # loaded: a policy is set

        if tier.name == "shared" and cause in (BAD_SIGNATURE, BAD_DIGEST):
            stored = _stored_key(row, key)
            _submit(lambda: tier.drop([stored]))
        return False

    def _copy_to_user(self, shared, attrs: HashAttributes, raw: bytes, row,
                      signed: tuple | None = None, claim: claims.Claim | None = None) -> None:
        """A shared hit: served from memory until copied into the user tier (with the
        signature it carries); counted there. ``claim`` (this node's, held while another
        node compiled the key) is released once the copy is written."""
        self._inflight[attrs.key] = raw
        try:
            import json

            details = json.loads(row.details)
        except ValueError:
            details = None
        user = self.user_file(attrs.arch)

        def produce() -> bytes | None:
            if claim is None and user.fetch(attrs.key) is not None:
                return None  # another process of this node copied it first
            return raw

        self.storing.put_later(attrs, produce, compile_seconds=row.compile_seconds,
                               details=details, publish=False, signed=signed, claim=claim)
        stored = _stored_key(row, attrs.key)
        _submit(lambda: shared.touch(stored))

    def claim_or_wait(self, attrs: HashAttributes, find: Callable[[], Any] | None = None
                      ) -> Hit | claims.Claim | None:
        """After a miss: claim the key for compiling, or wait while another process does.

        ``find`` looks for what the other process publishes and is returned when found
        (default: ``attrs``'s :class:`Hit` in the user tier and the shared tier), for a back
        end that cannot name its arch yet.

        Returns the :class:`Hit` another process published meanwhile, a
        :class:`~kdb.claims.Claim` (this process compiles; pass it to ``storing.put_later``,
        which releases it once stored), or ``None`` when coordination is unavailable or the
        wait ran past ``KDB_WAIT_TIMEOUT`` (compile anyway): :mod:`kdb.claims.waiting`'s
        policy, and :mod:`kdb.storing.queued`'s for a store an exited process queued."""
        got = self._claim_or_wait(attrs, find)
        if find is None and isinstance(got, Hit):  # served after all: one request, one count
            self.count(attrs.arch, "misses", -1)  # (its lookup's miss; the hit is counted)
        return got

    def _claim_or_wait(self, attrs: HashAttributes, find: Callable[[], Any] | None
                       ) -> Hit | claims.Claim | None:
        from . import claims  # a miss: the hit path never needs it
        from .claims import waiting
        from .storing import queued

        if self.disabled:
            return None
        mine = claims.held(attrs.key)
        if mine is not None:  # never wait on oneself, nor for an entry that may never come
            if mine.thread == threading.get_ident() or mine.state != claims.COMPILING:
                return None
            return self._wait_for_thread(attrs, mine, find)
        user = self.user_file(attrs.arch)
        if not self.storing.user_trusted(user):
            return None  # claims live beside the user file: none in a directory others own
        from .file import fs

        if fs.refused([self.user_dir / "claims"], _CLAIMS):
            return None  # nor in a claims directory others can write: a lock planted as a
            # link there had this process write its state over the file it led to
        shared = self._shared()  # shared tier: the cross-node lock and its hits (None: off)
        if shared is None and not user.usable:
            return None  # a refused user file: nothing to wait for, and no claims written there
        published = (FileTier(user),) if shared is None else (FileTier(user), shared)
        # A cold cache: while it waits, this process makes the user file the holder's
        # store needs (its creation was on every waiter's path, with nothing else to do).
        # Not for a back end that cannot name its arch yet (``find``): ``attrs.arch`` only
        # names the claim, and a file made for it would be an empty database of no arch.
        idle = None if find is not None or os.path.exists(user.filename) else user.ensure
        if find is None:
            def find() -> Hit | None:
                return self._first_hit(attrs, published, claims.held(attrs.key))
        return waiting.claim_or_wait(self.user_dir / "claims", attrs.key,
                                     attrs.name or attrs.key[:16], find, config.wait_timeout(),
                                     shared=shared, idle=idle,
                                     queued=lambda _: queued.plan(self.user_dir, attrs))

    def _wait_for_thread(self, attrs: HashAttributes, claim, find: Callable[[], Any] | None):
        """Another thread of this process compiles ``attrs`` (it holds ``claim``): its
        binary, once in memory or stored (``find``'s answer, for a back end that cannot name
        its arch), else None (compile) when that thread's compile ended without one or after
        ``KDB_WAIT_TIMEOUT``. Two threads building one program compiled it twice."""
        from . import claims

        deadline = time.monotonic() + config.wait_timeout()
        while True:
            raw = self._inflight.get(attrs.key)
            if raw is not None:
                add("hits.memory", 1)
                return Hit(raw, "memory", "", 0.0)
            got = find() if find is not None else None
            if got is not None:
                return got
            if claims.held(attrs.key) is not claim or claim.state != claims.COMPILING:
                return find() if find is not None else self._first_hit(
                    attrs, self._tiers(attrs.arch))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)

    # -- misses ---------------------------------------------------------------------------

    def get_or_compile(self, attrs: HashAttributes, compile_fn: Callable[[], bytes], *,
                       details: dict[str, Any] | None = None,
                       recheck: Callable[[], tuple] | None = None) -> bytes:
        """The miss policy: the stored binary (:meth:`lookup`), else the one another process
        published while this one waited (:meth:`claim_or_wait`), else ``compile_fn()``'s
        result, served from memory until ``storing`` has stored it in the background
        (unless ``recheck()``, the headers as they are after the compile, differ from the
        key's: :func:`kdb.storing.stores.headers_changed`)."""
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
            if not len(binary):  # stored, it was served to every later process
                raise InvalidArgumentError("compile_fn returned no bytes: a compiler that "
                                           "built nothing failed; raise its error instead")
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
        self.storing.put_later(attrs, lambda: binary, compile_seconds=seconds, details=details,
                               log=rec, claim=got, recheck=recheck)
        return binary

    def record_compile(self, attrs: HashAttributes, seconds: float,
                       reason: str | None = None, own: float | None = None) -> CompileRecord:
        """Log a compile in the start-up latency log (memory now, user file soon). ``own``:
        the part of ``seconds`` not spent in other compiles logged within it (what the
        process's compile seconds count), all of it by default."""
        missed = []
        if not self.disabled:
            missed.append("system" if self._system.get(attrs.arch) else "system(none)")
            missed.append("user")
            if self._shared() is not None:
                missed.append("shared")
        if reason is None:
            reason = (bookkeeping.DISABLED if self.disabled
                      else f"no system database for {attrs.arch}"
                      if not self._system.get(attrs.arch) else "not in any tier")
        from .storing import queued  # a compile: never on the hit path

        if (why := queued.why_compiled(attrs.key)) is not None:
            reason = f"{reason}; {why}"
        rec = bookkeeping.record(attrs.key, attrs.name, attrs.arch, attrs.backend, seconds,
                             ",".join(missed), reason)
        self.count_compile(attrs, seconds if own is None else own)
        return rec

    def count_compile(self, attrs: HashAttributes, seconds: float) -> None:
        """Count a compile (the process's counters, ``kdb stats``, ``kdb run``'s report);
        :meth:`record_compile` also logs it. A build kdb does not cache is logged once per
        key and process, and counted each time."""
        self.count(attrs.arch, "compiles", 1)
        self.count(attrs.arch, "compile_seconds", seconds)
        bookkeeping.report_compile()

    # -- shared tier (kdb.shared.tier; only when KDB_SHARED_URL is set) ------------------------

    def shared_arches(self, backend: str, name: str) -> list[str]:
        """The arches the shared tier holds an entry of ``backend`` named ``name`` in; none
        without a shared tier. For a lookup that cannot know its arch and finds none in this
        node's files (Triton's host modules on a fresh node)."""
        shared = self._shared()
        return [] if shared is None else shared.arches(backend, name)

    def _shared(self):
        """The shared tier, or ``None`` when ``KDB_SHARED_URL`` is unset (read when used)."""
        url = config.shared_url()
        if url is None or self.disabled or not self.use_system:
            return None
        from . import registry  # the tier its URL's scheme names (SQLAlchemy loads there)

        return registry.load(registry.shared_tier_module(url)).tier(url)

    # -- bookkeeping ----------------------------------------------------------------------

    def unserved(self, attrs: HashAttributes, hit: Hit | None) -> None:
        """A hit its caller could not use (an early entry the driver did not take, a binary
        it refused) and compiled instead: counted as a miss, not a hit, so that one build
        call is never both served and compiled (``kdb run`` said 10 programs requested of
        8 build calls)."""
        if hit is None:
            return
        if hit.tier == "memory":
            add("hits.memory", -1)
            return
        self.count(attrs.arch, f"hits.{hit.tier}", -1, saved=-hit.compile_seconds)
        self.count(attrs.arch, "misses", 1)

    def count(self, arch: str, counter: str, n: float, key: str | None = None,
              saved: float = 0.0) -> None:
        """Count ``n`` of ``counter`` for ``arch`` in memory (a hit on ``key``, the seconds it
        ``saved``); written with the rest of the bookkeeping."""
        self._book.count(arch, counter, n, key, saved)

    def flush(self) -> None:
        """Finish background stores and write batched bookkeeping; strict mode re-raises."""
        self.storing.flush()

    def close(self) -> None:
        """Flush, then close every open file."""
        self.flush()
        for f in (*self._user.values(), *(f for fs in self._system.values() for f in fs)):
            f.close()


def _stored_key(row, key: str) -> str:
    """The key column of a fetched row: ``key``, or a signer's own row for it (a shared
    row published beside another signer's, :func:`kdb.shared.writes.slot_key`)."""
    return getattr(row, "stored_key", "") or key


def _submit(job) -> None:
    """Run ``job`` on the background store thread (:func:`kdb.storing.stores.submit`)."""
    from .storing.stores import submit

    submit(job)

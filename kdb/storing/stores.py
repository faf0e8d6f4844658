"""How an entry reaches the writable tiers: the store side of a kernel database, a part
:class:`kdb.tiers.Tiers` holds (``tiers.storing``; the hit and miss policy is :mod:`kdb.tiers`).

A lookup never writes; a miss compiles (:meth:`kdb.tiers.Tiers.get_or_compile`), and what it
compiled is stored by one of these, off the caller's critical path where it can be: now
(:meth:`Storing.put`), on the background thread (:meth:`Storing.put_later`), by the store
worker (:meth:`Storing.spool`, :mod:`kdb.storing.spool`), as the worker's batch
(:meth:`Storing.store`), and a bad entry dropped (:meth:`Storing.discard`). With the shared
tier, each is also published there before the claim it holds is released. A ``Storing`` is
given what it writes to when it is made: the user files, the in-memory copies served until
stored, the batched bookkeeping, and the shared tier (a callable: read when used).

What is stored is what was keyed: a back end whose key holds headers hands each store a
``recheck`` (the headers as they are now, found as the key found them); right before an
entry is written they are compared with the key's (:func:`headers_changed`), and a binary
built while a header changed is not stored.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .. import bookkeeping, config, faults, logs
from ..bookkeeping import Pending
from ..file.kernelfile import CompileRecord, Entry
from ..file.rows import PROVISIONAL
from .. import signing

if TYPE_CHECKING:  # annotations are strings here
    from typing import Any, Callable

    from .. import claims
    from ..keys import HashAttributes
    from .jobs import StoreJob

    #: The headers of a build as they are now (``HashAttributes.headers``' form).
    Recheck = Callable[[], tuple[tuple[str, str], ...]]

log = logs.get("kdb")


class HeaderChangedError(LookupError):
    """A header a key was computed from is not what the build read: the binary would not
    match its key, so it is not stored."""


def headers_changed(keyed: list[HashAttributes], recheck: Recheck) -> str | None:
    """Why the binaries of ``keyed`` would not match their keys now that ``recheck()`` gives
    their headers as they are, or None when every header has the content its key holds.

    Called after the compile: a header saved between the digest and the compiler's read
    changes the binary, not the key. A ``recheck`` that fails (a header kdb can no longer
    read or be sure of) counts as a change: a spurious miss costs one compile.
    """
    try:
        now = dict(recheck())
    except Exception as err:  # noqa: BLE001 - whatever stops the check stops the store
        return f"what the build reads is no longer certain ({err})"
    for attrs in keyed:
        then = dict(attrs.headers)
        for name in sorted(set(then) | set(now)):
            if then.get(name) != now.get(name):
                state = ("is gone" if now.get(name, "missing") == "missing" else
                         "is new" if then.get(name, "missing") == "missing" else
                         "was edited")
                return (f"header {name!r} {state} since the build of "
                        f"{attrs.name or attrs.key[:12]}, so the binary would not match its key")
    return None


def _not_stored(attrs: HashAttributes, reason: str) -> None:
    """Say, once per process (and in the debug log each time), that a binary was dropped."""
    log.debug("kdb: %s %s not stored: %s", attrs.key[:16], attrs.name, reason)
    logs.warn_once("headers-changed", "kdb: %s; it is not stored (a header changed while it "
                   "was compiled: the next build stores it)", reason)


class Storing:
    """The store side of one kernel database: stores and drops entries in the user tier
    (and the shared tier), and flushes. Made by :class:`kdb.tiers.Tiers` with what it owns:

    ``user_dir`` and ``cache_root`` (where the user files, claims and spools live),
    ``user_file(arch)`` (the user tier's :class:`~kdb.file.kernelfile.KernelFile`), ``book``
    (the batched :class:`~kdb.bookkeeping.Book`), ``inflight`` (binaries served from memory
    until stored: this side adds and removes them), ``shared()`` (the shared tier or None)
    and ``disabled`` (``KDB_DISABLE_CACHE``: nothing is stored).
    """

    def __init__(self, *, user_dir, cache_root, user_file: Callable[[str], Any], book,
                 inflight: dict[str, bytes], shared: Callable[[], Any],
                 disabled: bool) -> None:
        self.user_dir, self.cache_root = user_dir, cache_root
        self.user_file, self._book, self._inflight = user_file, book, inflight
        self._shared, self.disabled = shared, disabled

    def __repr__(self) -> str:
        return f"Storing(user_dir={str(self.user_dir)!r})"

    def flush(self) -> None:
        """Finish background stores and write batched bookkeeping; strict mode re-raises."""
        errors = drain()
        self._book.write_all()
        bookkeeping.write_orphans()  # and those of KernelDBs collected meanwhile
        if errors and config.flag(config.ENV_STRICT):
            raise errors[0]

    def put(self, attrs: HashAttributes, binary: bytes, *, compile_seconds: float = 0.0,
            details: dict[str, Any] | None = None) -> bool:
        """Store ``binary`` for ``attrs`` in the user tier now; True if it was written."""
        if self.disabled or not self.user_trusted(self.user_file(attrs.arch)):
            return False
        self.flush()
        entry = make_entry(attrs, bytes(binary), compile_seconds, details)
        pending = self._book.take(attrs.arch) or Pending()  # written in the same transaction
        pending.entries.append(entry)
        written = self._book.write_pending(attrs.arch, pending)
        shared = self._shared()  # shared tier: a compile is published to both
        if shared is not None:
            self._publish(shared, [entry])
        return written

    def log_compile(self, rec: CompileRecord) -> None:
        """Write ``rec`` to the start-up latency log with the next batch: a compile that
        stores nothing (its entry is stored already, and could not be used here)."""
        self._book.add_log(rec.arch, rec)

    def put_later(self, attrs: HashAttributes, produce: Callable[[], bytes | None], *,
                  compile_seconds: float = 0.0, details: dict[str, Any] | None = None,
                  log: CompileRecord | None = None, claim: claims.Claim | None = None,
                  publish: bool = True, signed: tuple | None = None,
                  recheck: Recheck | None = None, costly: bool = False,
                  now: bool = False) -> None:
        """Store what ``produce()`` returns, on the background thread (None: store nothing),
        or (``now``) on this one before returning: a process whose end may come any moment.

        ``claim``, from :meth:`kdb.tiers.Tiers.claim_or_wait`, is released once the entry is
        stored (in the user tier, and published to the shared tier unless ``publish`` is
        false).
        ``signed``: the ``(signer, signature)`` the binary already carries (a copy of a
        shared entry). ``recheck``: the headers now (:func:`headers_changed`), compared with
        ``attrs``' right before the entry is written; a change stores nothing. ``costly``:
        ``produce`` costs about a compile (it reads a PoCL program's binaries), so the store
        also waits for idle CPU (:mod:`.background`).
        """
        config.max_size()  # a bad KDB_CACHE_MAX_SIZE raises here, not in the background store
        if log is not None:
            self._book.add_log(attrs.arch, log)
        if self.disabled or not self.user_trusted(self.user_file(attrs.arch)):
            if claim is not None:
                claim.release()
            return

        if claim is not None:  # compiled: waiters now judge the holder by its store
            claim.mark_pending(compile_seconds)
            claim.handed = True  # released by the store, not by whoever holds it now

        def job() -> None:
            entry = None
            if claim is not None:
                claim.mark_storing()
            try:
                raw = produce()
                why = None if raw is None or recheck is None else headers_changed([attrs], recheck)
                if why is not None:
                    raw = None
                    self._inflight.pop(attrs.key, None)  # nor served from memory any more
                    _not_stored(attrs, why)
                if raw is not None:
                    entry = make_entry(attrs, bytes(raw), compile_seconds, details, signed)
                    self._inflight[entry.key] = entry.raw
                    self._book.add_entry(attrs.arch, entry)
                if entry is not None or log is not None or claim is not None:
                    self._book.write(attrs.arch)  # else nothing of this job's to write
                if entry is not None:
                    self._inflight.pop(entry.key, None)  # stored: the user file serves it now
                shared = self._shared() if entry is not None else None
                if shared is not None and publish:  # published before the claim is released
                    self._publish(shared, [entry], [log] if log is not None else [])
                elif shared is not None:  # a shared hit copied here: the server answers
                    self._publish_kept(shared)
            finally:
                if claim is not None:
                    claim.release()

        if not now:
            submit(job, costly=costly)
            return
        try:
            job()
        except Exception as err:  # noqa: BLE001 - a failed store costs a compile, never a build
            log.warning("kdb: store failed: %s", err, exc_info=log.isEnabledFor(10))

    def spool(self, job: StoreJob, claims: list | None = None, store_now=None) -> bool:
        """Hand a back end's store job to the store worker (:mod:`kdb.storing.spool`); False
        when it cannot be written (the caller stores in the background instead)."""
        from . import spool
        from .jobs import StoreJob

        if self.disabled or not spool.can_spool():
            return False
        job.cache_dir, job.claims_dir = str(self.cache_root), str(self.user_dir / "claims")
        try:
            spool.submit(self.user_dir, job, claims, store_now)
        except spool.UntrustedSpool:
            return False  # warned: stored in this process, in the user file if it is trusted
        except OSError as err:
            full = faults.full_disk(err)
            faults.fault(f"cannot hand stores to the store worker under {self.user_dir} ({err})"
                         + ("" if full else "; storing them in this process"),
                         once=faults.full_disk_key(self.user_dir) if full else str(self.user_dir))
            return False
        if self._book.hand_over is None:  # at exit, bookkeeping without a user file goes too
            user_dir, cache_root = self.user_dir, str(self.cache_root)
            self._book.hand_over = lambda archs: spool.submit(
                user_dir, StoreJob.bookkeeping(cache_root, archs))
        return True

    def can_store(self, arch: str) -> bool:
        """Whether a store for ``arch`` could land anywhere, so a back end need not read
        binaries, nor start a store worker, for nothing. False when the user file, its
        directory or the cache root is not this user's alone, shared tier or not (stores,
        claims and spools live there); else False when the user file was refused (newer
        than kdb, not a file) and no shared tier is set."""
        f = self.user_file(arch)
        if not self.user_trusted(f):
            return False
        return self._shared() is not None or (f.usable and not self._disk_full())

    def _disk_full(self) -> bool:
        """The user file's disk keeps less than ``jobfiles.MIN_FREE``: nothing is stored
        (one warning), so kdb never fills it, and storing resumes once there is room."""
        from .jobfiles import low_space

        why = low_space(self.user_dir)
        if why is not None:
            faults.fault(f"{why}: kernels are compiled and not stored until there is room",
                         once=faults.full_disk_key(self.user_dir))
        return why is not None

    def user_trusted(self, f) -> bool:
        """The user file ``f``, its directory and the cache root are this user's alone (a
        warning, once, names the first that is not)."""
        from ..file import fs

        if fs.refused([self.cache_root], _USER_TIER):
            f.usable = False
            return False
        return f.trusted()

    def store(self, items: list, logs: list[CompileRecord] = (),
              recheck: Recheck | None = None) -> bool:
        """Store ``(attrs, binary, compile_seconds, details)`` items and latency rows now, in
        one transaction per arch (the store worker's write); True if written.

        ``recheck``: the headers now (:func:`headers_changed`), compared with every item's
        right before the write; on a change only the latency rows are written, then
        :class:`HeaderChangedError` says which header.
        """
        why = headers_changed([i[0] for i in items], recheck) if items and recheck else None
        if why is not None:
            items = []
        by_arch: dict[str, list[Entry]] = {}
        for attrs, binary, seconds, details in items:
            by_arch.setdefault(attrs.arch, []).append(
                make_entry(attrs, bytes(binary), seconds, details))
        rows: dict[str, list[CompileRecord]] = {}
        for rec in logs:
            rows.setdefault(rec.arch, []).append(rec)
        ok = True
        for arch in sorted(set(by_arch) | set(rows)):
            entries = by_arch.get(arch, [])
            ok = self.user_file(arch).write(entries, rows.get(arch, []), {}, {}) and ok
            shared = self._shared() if entries else None
            if shared is not None:
                self._publish(shared, entries, rows.get(arch, []))
        if why is not None:
            raise HeaderChangedError(why)
        return ok

    def publish_stored(self, attrs: list[HashAttributes]) -> None:
        """Publish to the shared tier the entries of ``attrs`` the user files hold (binaries,
        not stand-ins). A store can end between its write to the user file and its publish:
        the floor lane takes a starved lane's job over by ending the lane, a batch system
        kills it. The job's next store finds its entries stored and, before, dropped the job
        unpublished: a shared tier's keeper then let go of the claim, and another node
        compiled the kernel (beside a CPU hog). Publishing a key the shared tier holds keeps
        what it holds."""
        shared = self._shared() if attrs else None
        if shared is None:
            return
        by_arch: dict[str, list[str]] = {}
        for a in attrs:
            by_arch.setdefault(a.arch, []).append(a.key)
        entries = [e for arch, keys in by_arch.items() for e in self._stored_entries(arch, keys)]
        if entries:
            self._publish(shared, entries)

    def _stored_entries(self, arch: str, keys: list[str]) -> list[Entry]:
        return self.user_file(arch).entries(keys)

    def _publish(self, shared, entries: list[Entry], logs: list[CompileRecord] = ()) -> None:
        """Publish ``entries`` (and their latency rows): once the server takes them, what it
        did not take before goes too; what it does not take is kept to publish later
        (:mod:`.backlog`), unless the tier is off for good (a newer schema, no driver)."""
        from . import backlog

        if shared.publish(entries, logs):
            self._publish_kept(shared)
        elif shared.problem is None:
            backlog.keep(self.user_dir, backlog.tier_id(shared.describe()), entries, logs)

    def _publish_kept(self, shared) -> None:
        """The server answers: publish what was compiled here while it did not (for this
        server and namespace only)."""
        from . import backlog

        backlog.drain(self.user_dir, backlog.tier_id(shared.describe()), self._stored_entries,
                      shared.publish, lambda: shared.refused)

    def store_provisional(self, items: list) -> bool:
        """Store ``(attrs, binary, compile_seconds, details)`` items in the user files only,
        each where its key has no entry yet: what stands in for a binary until the store
        worker stores it (an early store, :mod:`kdb.backends.opencl.early`), never in place
        of one, never published to the shared tier. True if every item was written."""
        by_arch: dict[str, list[Entry]] = {}
        for attrs, binary, seconds, details in items:
            by_arch.setdefault(attrs.arch, []).append(make_entry(
                attrs, bytes(binary), seconds, {**(details or {}), PROVISIONAL: True}))
        ok = True
        for arch, entries in sorted(by_arch.items()):
            f = self.user_file(arch)
            ok = (self.user_trusted(f) and f.usable and not self._disk_full()
                  and f.write(entries, [], {}, {}) and ok)
        return ok

    def resume_stores(self, keys: list[str]) -> None:
        """See that the stores of ``keys``, served provisionally, are being done: the worker
        of each spool that still holds one is started if none runs."""
        from . import spool

        if not self.disabled and spool.can_spool():
            spool.resume(self.user_dir, keys)

    def write_bookkeeping(self, archs: dict[str, dict]) -> None:
        """Write bookkeeping taken from another process (a store job's ``archs``)."""
        self._book.write_json(archs)

    def discard(self, attrs: HashAttributes, reason: str, tier: str = "user") -> None:
        """Drop an entry that proved bad (e.g. the driver refused the binary) from the user
        tier, and from the shared tier too when it came from there."""
        f = self.user_file(attrs.arch)
        name = attrs.name or _stored_name(f, attrs.key) or "unnamed"  # a hit's key has none
        faults.fault(f"entry {attrs.key[:16]} ({name}) dropped: {reason}",
                     once=f"discard:{self.user_dir}")
        self._inflight.pop(attrs.key, None)
        submit(lambda: f.delete([attrs.key]))
        shared = self._shared() if tier == "shared" else None
        if shared is not None:
            submit(lambda: shared.drop([attrs.key]))


def _stored_name(file, key: str) -> str | None:
    """The name an entry was stored under, for the warning that drops it (a lookup's key
    carries none: naming a hit would scan its source)."""
    try:
        rows = file.query("SELECT name FROM kernels WHERE key = ?", (key,))
    except Exception:  # noqa: BLE001 - a damaged file: the warning goes without the name
        return None
    return rows[0][0] if rows and isinstance(rows[0][0], str) and rows[0][0] else None


def make_entry(attrs: HashAttributes, raw: bytes, seconds: float,
               details: dict[str, Any] | None, signed: tuple | None = None) -> Entry:
    """The entry to write, signed with ``KDB_SIGNING_KEY`` when one is set. ``signed``: the
    ``(signer, signature)`` a copy of a shared entry carries, kept as it is (never signed
    here: a node vouches only for what it compiled)."""
    attributes = attrs.encoded().decode("utf-8")
    signer = signature = None
    if signed is not None:
        signer, signature = signed
    else:
        policy = signing.current()
        if policy is not None and policy.signer is not None:
            from ..signing.policy import digest

            signer, signature = policy.sign(attrs.key, attributes, digest(raw))
    return Entry(key=attrs.key, arch=attrs.arch, backend=attrs.backend, name=attrs.name,
                 attributes=attributes, raw=raw, compile_seconds=seconds,
                 details=details, signer=signer, signature=signature)


_USER_TIER = ("loading a binary from it would run code someone else can change",
              "kernels are compiled meanwhile and not stored")

_BACKGROUND = __name__.rpartition(".")[0] + ".background"


def submit(job: Callable[[], None], *, costly: bool = False) -> None:
    """Run ``job`` on the background store thread (:mod:`kdb.storing.background`, imported
    by the first store: a hit never needs its thread); ``costly``: once there is idle CPU."""
    from . import background

    background.submit(job, costly=costly)


def drain() -> list[BaseException]:
    """Finish the background stores and return their errors; none when nothing was ever
    submitted (the thread's module is then not imported: a flush after hits stays cheap)."""
    if _BACKGROUND not in sys.modules:
        return []
    # Imported, not taken from sys.modules: the import waits for a thread halfway through it.
    from . import background

    return background.drain()

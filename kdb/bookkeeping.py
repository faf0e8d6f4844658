"""Bookkeeping: what a KernelDB counted and still has to write, its one writer, and the
start-up latency log.

A hit never writes: it bumps a counter (and a per-key hit count for the user tier) in
memory here. The rows are written later in one short transaction, together with entries
the background store adds, by :meth:`Book.write` (the background thread, ``flush()``, the
next KernelDB made after one is collected, the exit, and the store worker writing what a
process handed it all go through it). This process's own totals (:func:`process_counts`)
feed ``kdb run`` and ``pytest --kdb``: at exit a process leaves them in ``KDB_RUN_REPORT``
(:mod:`kdb.adopt.tally` adds the reports up).

The start-up latency log keeps every compile of this process in memory (:func:`record`; the
rows reach the user file's ``compile_log`` with the rest). At exit, a process that compiled
logs one summary warning: how many kernels, how many seconds, and the missing system
databases if that is why.
"""

from __future__ import annotations

import os
from pathlib import Path
import threading
import time
from typing import TYPE_CHECKING

from . import config, lifecycle, logs
from .file.kernelfile import CompileRecord

if TYPE_CHECKING:
    from typing import Callable

    from .file.kernelfile import Entry, KernelFile

log = logs.get("kdb")


class Pending:
    """What is still to be written for one arch."""

    __slots__ = ("entries", "logs", "hits", "counters")

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.logs: list[CompileRecord] = []
        self.hits: dict[str, tuple[int, float]] = {}
        self.counters: dict[str, float] = {}

    def empty(self) -> bool:
        return not (self.entries or self.logs or self.hits or self.counters)

    def worth_creating_a_file(self) -> bool:
        """Entries and log rows are; counters alone are not: creating a user file runs the
        alembic migrations, which a process that only hit the system tier would otherwise
        pay at exit. Its counts go to the user file once one exists. A shared hit's are:
        its copy makes the file anyway (a job served only by the shared tier on a new node
        counted nothing, and `kdb stats` there said "0 hits here")."""
        return bool(self.entries or self.logs or self.counters.get("hits.shared"))

    def to_json(self) -> dict:
        """The rows as JSON data (entries are not carried: a store job carries those)."""
        return {"logs": [list(rec) for rec in self.logs],
                "hits": {k: list(v) for k, v in self.hits.items()},
                "counters": self.counters}

    @classmethod
    def from_json(cls, data: dict) -> Pending:
        p = cls()
        p.logs = [CompileRecord(*row) for row in data["logs"]]
        p.hits = {k: tuple(v) for k, v in data["hits"].items()}
        p.counters = dict(data["counters"])
        return p


class Book:
    """One KernelDB's pending bookkeeping, per arch, and the one writer of it.

    ``user_file(arch)`` gives the user file to write to: the :class:`kdb.tiers.Tiers` that
    owns the files hands it over, a callable that holds no reference to the ``Tiers`` (a book
    lives in a module list until its ``Tiers`` is collected). ``hand_over``, once set (the
    KernelDB handed stores to the store worker), takes at exit the bookkeeping of archs
    whose user file does not exist yet, so that no exit creates and migrates one.
    """

    def __init__(self, user_file: Callable[[str], KernelFile], disabled: bool) -> None:
        self.user_file = user_file
        self.disabled = disabled
        self.hand_over: Callable[[dict[str, dict]], None] | None = None
        self.lock = threading.Lock()
        self.pending: dict[str, Pending] = {}
        _books.append(self)

    def release(self) -> None:
        """Its KernelDB is collected. Nothing is written or imported here: a finalizer runs
        inside whatever allocation set the collector off, on any thread, holding what that
        thread holds (a lock of kdb's; pytest's parse of a module it rewrites, which a
        nested import there breaks on CPython 3.11.7). What is left is written by the next
        KernelDB made, the next flush or the exit (:func:`write_orphans`). A book holds no
        reference to its KernelDB."""
        _orphans.append(self)

    # -- counting (the hit path) -------------------------------------------------------------

    def count(self, arch: str, counter: str, n: float, key: str | None = None,
              saved: float = 0.0) -> None:
        with self.lock:
            p = self.pending.get(arch)
            if p is None:
                p = self.pending[arch] = Pending()
            p.counters[counter] = p.counters.get(counter, 0) + n
            if saved:
                p.counters["saved_seconds"] = p.counters.get("saved_seconds", 0) + saved
            if key is not None:
                count, _ = p.hits.get(key, (0, 0.0))
                p.hits[key] = (count + 1, time.time())
        add(counter, n, saved)

    def add_log(self, arch: str, rec: CompileRecord) -> None:
        with self.lock:
            self.pending.setdefault(arch, Pending()).logs.append(rec)

    def add_entry(self, arch: str, entry: Entry) -> None:
        with self.lock:
            self.pending.setdefault(arch, Pending()).entries.append(entry)

    def take(self, arch: str) -> Pending | None:
        with self.lock:
            return self.pending.pop(arch, None)

    # -- the one writer ---------------------------------------------------------------------

    def write_pending(self, arch: str, p: Pending | None, create: bool = False) -> bool:
        """Write ``p`` to ``arch``'s user file in one transaction; False if nothing was.
        Counts alone do not create the file, unless ``create``."""
        if p is None or p.empty() or self.disabled:
            return False
        f = self.user_file(arch)
        if not (create or p.worth_creating_a_file()) and not Path(f.filename).exists():
            return False
        return f.write(p.entries, p.logs, p.hits, p.counters)

    def write(self, arch: str) -> bool:
        """Write what is pending for ``arch`` (the background thread, or a flush)."""
        return self.write_pending(arch, self.take(arch))

    def write_all(self, quiet: bool = False) -> None:
        """Write what is pending for every arch; ``quiet``: log a failure, never raise (a
        collected KernelDB, the exit)."""
        for arch in list(self.pending):
            try:
                self.write(arch)
            except Exception as err:  # noqa: BLE001 - runs at collection or exit
                if not quiet:
                    raise
                log.warning("kdb: could not write bookkeeping: %s", err)

    def take_json(self, archs) -> dict[str, dict]:
        """Remove and return what is pending for ``archs`` as JSON data, for a process that
        writes it instead of this one (the store worker): :meth:`write_json` there."""
        out = {}
        with self.lock:
            for arch in archs:
                p = self.pending.pop(arch, None)
                if p is not None:
                    out[arch] = p.to_json()
        return out

    def write_json(self, archs: dict[str, dict]) -> None:
        """Write bookkeeping another process took with :meth:`take_json`, creating the user
        file if need be: it was handed over because there was none, and a worker's lanes
        may run it before the store job that would have made one."""
        for arch, data in archs.items():
            self.write_pending(arch, Pending.from_json(data), create=True)

    def at_exit(self) -> None:
        """Hand the bookkeeping of archs without a user file to the store worker (when this
        KernelDB used it), and write the rest."""
        if self.hand_over is not None and not self.disabled:
            archs: list[str] = []
            try:
                archs = [a for a in list(self.pending)
                         if not Path(self.user_file(a).filename).exists()]
                book = self.take_json(archs)
                if book:
                    self.hand_over(book)
            except Exception as err:  # noqa: BLE001 - never fail an exiting program
                from . import faults  # one warning for a full disk, whichever write met it

                where = Path(self.user_file(archs[0]).filename).parent if archs else None
                key = (faults.full_disk_key(where) if where is not None
                       and faults.full_disk(err) else "bookkeeping-hand-over")
                (log.warning if logs.first_time(key) else log.debug)(
                    "kdb: could not hand bookkeeping to the store worker: %s", err)
        self.write_all(quiet=True)

    def forget(self) -> None:
        """After fork: the parent writes what it counted; the child starts afresh."""
        self.lock = threading.Lock()
        self.pending.clear()
        self.hand_over = None


#: Every live KernelDB's book, and those of collected ones until written, for the exit and fork.
_books: list[Book] = []
#: Books of collected KernelDBs (:meth:`Book.release`) still to be written.
_orphans: list[Book] = []


def write_orphans() -> None:
    """Write, and forget, the books of collected KernelDBs (a new KernelDB, a flush)."""
    while _orphans:
        try:
            book = _orphans.pop()
        except IndexError:  # another thread took the last one
            return
        try:
            _books.remove(book)
        except ValueError:
            pass
        book.write_all(quiet=True)


def _write_every_book() -> None:
    for book in list(_books):
        book.at_exit()


# -- the start-up latency log -----------------------------------------------------------

#: How the reason of a build kdb neither looked up nor stored begins (it compiles at every start).
UNCACHED = "not cached: "
#: The reason of a compile while the cache is off: nothing is looked up or stored.
DISABLED = "cache disabled (KDB_DISABLE_CACHE)"

_records: list[CompileRecord] = []
#: The once-key prefix of a build kdb does not cache that this process has logged: one row
#: each, however often it builds it (a loop would otherwise grow the log without end).
_UNCACHED_ONCE = "uncached-log:"
_missing_system: dict[str, str] = {}  # arch -> file name looked for
_records_lock = threading.Lock()


def record(key: str, name: str, arch: str, backend: str, seconds: float, missed: str,
           reason: str) -> CompileRecord:
    """Remember one compile of this process and return its log row."""
    rec = CompileRecord(key=key, name=name, arch=arch, backend=backend, seconds=seconds,
                        missed=missed, reason=reason, at=time.time(), pid=os.getpid())
    with _records_lock:
        _records.append(rec)
    return rec


def note_missing_system(arch: str) -> None:
    with _records_lock:
        _missing_system[arch] = f"{arch}.kdb"


def records() -> list[CompileRecord]:
    """This process's compiles so far."""
    with _records_lock:
        return list(_records)


def covered_seconds(spans) -> float:
    """Seconds covered by the union of ``(start, end)`` spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def compiling_seconds(recs: list[CompileRecord]) -> float:
    """The wall seconds in which at least one of ``recs`` was compiling. A compile's row
    counts its whole span, and compiles nest (torch.compile's AOTAutograd entry holds its
    graphs, a graph its C++ modules) or run side by side: their sum can be several times
    the process's life."""
    return covered_seconds((r.at - r.seconds, r.at) for r in recs)


def own_seconds(backend: str, seconds: float, end: float | None = None) -> float:
    """Of a ``backend`` compile of ``seconds`` that ends at ``end`` (epoch seconds, default
    now), the part not spent in the ``backend`` compiles logged within it (a torch.compile
    graph's C++ modules): what it costs on its own, so that a sum over entries counts each
    second once."""
    end = time.time() if end is None else end
    start = end - seconds
    # Those that ended within it, cut at its start: a row's time is taken a little after
    # its compile ends, so a compile begun with it may seem to begin a little before it.
    held = [(max(r.at - r.seconds, start), r.at) for r in records()
            if r.backend == backend and start < r.at < end]
    return max(0.0, seconds - covered_seconds(held))


def summary() -> str | None:
    """The one-line summary of this start-up's compiles, or ``None`` if it compiled nothing."""
    recs = records()
    if not recs:
        return None
    total = compiling_seconds(recs)
    arches = sorted({r.arch for r in recs})
    text = (f"kdb: this start-up compiled {len(recs)} kernel(s) in {total:.2f} s "
            f"(arch {', '.join(arches)})")
    missing = sorted(a for a in arches if a in _missing_system)
    if missing:
        text += ("; no system kernel database for " + ", ".join(missing)
                 + ": install its package or build one with `kdb pack`")
    off = sum(r.reason.startswith(DISABLED) for r in recs)
    if off == len(recs):  # nothing stored, nothing logged: no later start loads them
        return text + (". kdb's cache is off (KDB_DISABLE_CACHE, or disabled=True): later "
                       "starts compile them again.")
    uncached = sum(r.reason.startswith(UNCACHED) for r in recs) + off
    if not uncached:
        text += ". Later starts load them from the cache"
    elif uncached < len(recs):
        text += (f". Later starts load {len(recs) - uncached} of them from the cache; "
                 f"{uncached} cannot be cached")
    else:
        text += ". kdb cannot cache them: later starts compile them again"
    return text + "; `kdb log` shows the details."


def _summary_at_exit() -> None:
    text = summary()
    if text:
        log.warning("%s", text)


def first_uncached(key: str) -> bool:
    """Whether this process has not yet logged an uncached build of ``key`` (and now has)."""
    return logs.first_time(_UNCACHED_ONCE + key)


def forget_compiles() -> None:
    """Forget this process's compiles (tests, ``kdb pack`` between manifests)."""
    with _records_lock:
        _records.clear()
        _missing_system.clear()
    logs.forget_once(_UNCACHED_ONCE)


# -- this process's totals (``kdb run``, ``pytest --kdb``) ----------------------------------

_counts: dict[str, float] = {}
_counts_lock = threading.Lock()


def add(counter: str, n: float, saved: float = 0.0) -> None:
    """Count ``n`` of ``counter`` (and ``saved`` seconds) for this process."""
    with _counts_lock:
        _counts[counter] = _counts.get(counter, 0) + n
        if saved:
            _counts["saved_seconds"] = _counts.get("saved_seconds", 0) + saved
    if _each_hit is not False and counter.startswith("hits.") and _reports_each_hit():
        _report_at_exit()


#: Whether this process reports its counts at every hit (None: not known yet): a child of
#: :mod:`multiprocessing` under a run report, which never reaches its exit handlers.
_each_hit: bool | None = None


def _reports_each_hit() -> bool:
    """A pool worker served from kdb reported nothing: ``kdb run`` said "0 programs
    requested" of a run that served them all (compiles were reported at once already).
    Elsewhere the report is written at exit, and a hit costs nothing more."""
    global _each_hit
    if _each_hit is None:
        _each_hit = (bool(os.environ.get(config.ENV_RUN_REPORT))
                     and lifecycle.in_multiprocessing_child())
    return _each_hit


def process_counts() -> dict[str, float]:
    """This process's counts so far."""
    with _counts_lock:
        return dict(_counts)


#: What kdb warned of in this process (at most :data:`_KEPT_WARNINGS`, each once): the run
#: report carries them, and ``pytest --kdb`` repeats them in its summary, since pytest keeps
#: a passing test's log records to itself (a refused cache recompiled every kernel, silently).
_warnings: list[str] = []
_KEPT_WARNINGS = 20


class _KeepWarnings:
    """A filter on kdb's logger that notes each warning and lets it through (a filter, not a
    handler: a handler of kdb's own would stop Python's last-resort one from printing)."""

    @staticmethod
    def filter(record) -> bool:
        if record.levelno >= 30 and len(_warnings) < _KEPT_WARNINGS:  # logging.WARNING
            try:
                text = record.getMessage()
            except Exception:  # noqa: BLE001 - a record that cannot format is not ours to fix
                return True
            if not text.startswith("kdb: this start-up compiled") and text not in _warnings:
                _warnings.append(text)
        return True


log.addFilter(_KeepWarnings)


def process_warnings() -> list[str]:
    """What kdb warned of in this process so far."""
    return list(_warnings)


_report_name: str | None = None  # this process's report, "<pid>-<ns>", rewritten as it counts
_report_lock = threading.Lock()


def write_run_report(directory: str | os.PathLike[str] | None = None):
    """Leave this process's counts in ``directory`` (default ``KDB_RUN_REPORT``) as
    ``<pid>-<ns>.json``, one file a process, written again with the counts so far each
    time; the file, or None when there is nothing to say or nowhere to say it. One file per
    process is exact under concurrency with no lock."""
    global _report_name
    if directory is None:
        directory = os.environ.get(config.ENV_RUN_REPORT)
    if not directory:
        return None
    with _report_lock:
        got = process_counts()
        if not got:
            return None
        import json

        if _report_name is None:
            _report_name = f"{os.getpid()}-{time.time_ns()}"
        path = Path(directory) / f"{_report_name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "counts": got,
                                   "warnings": process_warnings()}), encoding="utf-8")
        os.replace(tmp, path)
        return path


def report_compile() -> None:
    """After a compile is counted: the report says so at once, for a process that never
    reaches its exit handlers (multiprocessing's pool workers end in ``os._exit``, or a
    pool's ``terminate()`` in SIGTERM). A compile costs a thousand times this write."""
    if os.environ.get(config.ENV_RUN_REPORT):
        _report_at_exit()


def _report_at_exit() -> None:
    try:
        write_run_report()
    except OSError:  # a report directory gone or full: the program's exit is what matters
        pass


def _after_fork() -> None:
    global _counts_lock, _records_lock, _report_lock, _report_name, _each_hit
    _each_hit = None  # a child may be multiprocessing's
    _counts_lock = threading.Lock()  # another thread of the parent may have held them
    _records_lock = threading.Lock()
    _report_lock = threading.Lock()
    _report_name = None  # the parent's is the parent's
    _counts.clear()
    forget_compiles()
    for book in list(_books):
        book.forget()


lifecycle.on_exit(lifecycle.BOOKKEEPING, _write_every_book)
lifecycle.on_exit(lifecycle.SUMMARY, _summary_at_exit)
lifecycle.on_exit(lifecycle.REPORT, _report_at_exit)
lifecycle.on_fork(_after_fork)

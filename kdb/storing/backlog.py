"""What the shared tier did not take, kept on the node until the server answers again.

A kernel compiled while the shared server is down, refusing or past its bounds is stored in
the user tier only. Nothing remembered it: once the server was back, the node that compiled
it never offered it again, and every other node compiled it once more. A publish that fails
now leaves each entry's key here, a small file ``<user dir>/unpublished/<tier>/<arch>/<key>``
holding the compile's latency rows (made and removed atomically, so the node's processes and
its store worker share the directory with no lock), and the next publish the server takes,
in any process of the node, sends those entries from the user files, with their rows (the
server's compile log and counts: ``kdb pack --from-log`` packs them), and removes their
names. Publishing a key twice is harmless: the tier keeps what it holds.

``<tier>`` names the server and namespace the publish was for (:func:`tier_id`): a name
kept for one tenant's schema is never sent to another's, nor to another server.

What is kept is a name, never a binary: the entry is read from the user file when it is
sent, so one evicted or cleared meanwhile is simply not sent.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Callable, Iterable

from .. import config, lifecycle, logs
from ..dirs import make_private_dir
from ..errors import UnsafeArchError
from ..file.rows import CompileRecord, Entry

log = logs.get("kdb")

#: The directory under the user tier's (``<cache dir>/v1``).
DIRNAME = "unpublished"
#: Keys kept per tier and arch at most: past it a compile is not kept (its node serves it).
MAX_KEPT = 10_000
#: Entries sent per publish.
BATCH = 64
#: Publishes of a kept key the server refuses (the row itself: not a server away, slow or
#: locked) before it is forgotten: such a row must not turn the tier off at every drain.
TRIES = 3

_draining = threading.Lock()
_counts: dict[str, int] = {}  # keys kept per directory, counted once a process


def tier_id(described: str) -> str:
    """The directory name of one shared tier: its URL (password masked) and namespace, as
    :meth:`kdb.shared.tier.SharedTier.describe` gives them, hashed."""
    return hashlib.sha256(described.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def keep(user_dir: Path, tier: str, entries: Iterable[Entry],
         rows: Iterable[CompileRecord] = ()) -> int:
    """Name ``entries`` (with their latency ``rows``) to be published to ``tier`` later; how
    many were kept. Never raises: a node that cannot write here (disk full) keeps its
    binaries, and only other nodes pay."""
    by_key: dict[str, list] = {}
    for r in rows:
        by_key.setdefault(r.key, []).append(list(r))
    kept = 0
    for entry in entries:
        where = Path(user_dir) / DIRNAME / tier / entry.arch
        try:
            if str(where) not in _counts:
                make_private_dir(where)
                _counts[str(where)] = sum(1 for _ in os.scandir(where))
            if _counts[str(where)] >= MAX_KEPT:  # drained meanwhile by another process?
                _counts[str(where)] = sum(1 for _ in os.scandir(where))
                if _counts[str(where)] >= MAX_KEPT:
                    continue
            _write_name(where, entry.key, by_key.get(entry.key, []))
        except (OSError, ValueError) as err:  # ValueError: a NUL in a name
            log.debug("kdb: cannot keep %s to publish later: %s", entry.key[:16], err)
            continue
        _counts[str(where)] += 1
        kept += 1
    return kept


def _write_name(where: Path, key: str, rows: list) -> None:
    """The name file of ``key``: its rows as one JSON line, written whole (a temporary name,
    then a rename); one kept before, with rows of an earlier compile, is kept as it is."""
    path = where / key
    if os.path.exists(path):
        return
    temp = where / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
    for attempt in (0, 1):
        try:
            fd = os.open(temp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            break
        except FileNotFoundError:  # the directory drained and removed meanwhile
            if attempt:
                raise
            make_private_dir(where)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(rows) + "\n")
    os.replace(temp, path)


def _read_name(path: Path) -> tuple[list[CompileRecord], int]:
    """A name file's latency rows and how many refused publishes it has had."""
    try:
        with open(path, encoding="utf-8") as f:
            first, *tries = f.read().split("\n")
        rows = [CompileRecord(*r) for r in json.loads(first or "[]")]
    except (OSError, ValueError, TypeError):
        return [], 0
    return rows, sum(1 for t in tries if t == ".")


def names(user_dir: Path, tier: str | None = None) -> dict[str, list[str]]:
    """``{arch: keys kept}`` under ``user_dir``, for ``tier`` (every tier when None)."""
    root = Path(user_dir) / DIRNAME
    try:
        tiers = [tier] if tier is not None else sorted(os.listdir(root))
    except OSError:
        return {}
    out: dict[str, list[str]] = {}
    for t in tiers:
        try:
            archs = sorted(os.listdir(root / t))
        except OSError:
            continue
        for arch in archs:
            try:
                keys = sorted(e.name for e in os.scandir(root / t / arch)
                              if not e.name.startswith("."))
            except OSError:
                continue
            if keys:
                out.setdefault(arch, []).extend(keys)
    return out


def waiting(user_dir: Path, tier: str | None = None) -> dict[str, int]:
    """``{arch: how many keys are kept}`` (:func:`names`)."""
    return {arch: len(keys) for arch, keys in names(user_dir, tier).items()}


def drain(user_dir: Path, tier: str, entries_of: Callable[[str, list[str]], list[Entry]],
          publish: Callable[[list[Entry], list[CompileRecord]], bool],
          refused: Callable[[], bool] = lambda: False) -> int:
    """Publish every key kept for ``tier`` (``entries_of(arch, keys)`` reads the entries
    from the user file) with its rows, and forget the keys sent; how many entries went.
    Stops at the first publish the server does not take (the rest stay kept); a publish
    ``refused()`` says the server refused (not a server away) is a try of its keys. One
    thread of a process drains at a time; cheap when nothing is kept (a failed ``listdir``)."""
    root = Path(user_dir) / DIRNAME / tier
    try:
        archs = os.listdir(root)
    except OSError:
        return 0
    if not _draining.acquire(blocking=False):
        return 0
    sent = 0
    try:
        for arch in archs:
            where = root / arch
            try:
                config.check_arch(arch)  # a name kdb made: anything else is left alone
                keys = sorted(n for n in os.listdir(where) if not n.startswith("."))
            except (OSError, UnsafeArchError):
                continue
            for i in range(0, len(keys), BATCH):
                batch = keys[i:i + BATCH]
                entries = entries_of(arch, batch)
                have = {e.key for e in entries}
                rows = [r for k in batch if k in have for r in _read_name(where / k)[0]]
                if entries and not publish(entries, rows):
                    if refused():
                        _tried(where, sorted(have))
                    return sent
                sent += len(entries)
                for key in batch:  # sent, or no longer stored here: nothing to send
                    try:
                        os.unlink(where / key)
                    except OSError:
                        pass
            _counts.pop(str(where), None)
            try:
                where.rmdir()
            except OSError:  # kept meanwhile by another process
                pass
        for gone in (root, root.parent):
            try:
                gone.rmdir()
            except OSError:
                pass
        if sent:
            log.debug("kdb: published %d entries kept while the shared tier was away", sent)
        return sent
    finally:
        _draining.release()


def _tried(where: Path, keys: list[str]) -> None:
    """One more refused publish of ``keys``: a line appended to each name's file; at
    :data:`TRIES` the name goes."""
    for key in keys:
        try:
            fd = os.open(where / key, os.O_WRONLY | os.O_APPEND)  # gone: sent by another
            try:
                os.write(fd, b".\n")
            finally:
                os.close(fd)
            if _read_name(where / key)[1] >= TRIES:
                os.unlink(where / key)
        except OSError:
            pass


def _after_fork() -> None:
    """A child drains on its own (a parent's thread may hold the lock at the fork)."""
    global _draining
    _draining = threading.Lock()


lifecycle.on_fork(_after_fork)

"""What the shared tier did not take, kept on the node until the server answers again.

A kernel compiled while the shared server is down, refusing or past its bounds is stored in
the user tier only. Nothing remembered it: once the server was back, the node that compiled
it never offered it again, and every other node compiled it once more. A publish that fails
now leaves each entry's key here, as an empty file ``<user dir>/unpublished/<arch>/<key>``
(made and removed atomically, so the node's processes and its store worker share the
directory with no lock), and the next publish the server takes, in any process of the node,
sends those entries from the user files and removes their names. Publishing a key twice is
harmless: the tier keeps what it holds.

What is kept is a name, never a binary: the entry is read from the user file when it is
sent, so one evicted or cleared meanwhile is simply not sent.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Iterable

from .. import config, lifecycle, logs
from ..dirs import make_private_dir
from ..errors import UnsafeArchError
from ..file.rows import Entry

log = logs.get("kdb")

#: The directory under the user tier's (``<cache dir>/v1``).
DIRNAME = "unpublished"
#: Keys kept per arch at most: past it a compile is not kept (its node still serves it).
MAX_KEPT = 10_000
#: Entries sent per publish.
BATCH = 64
#: Publishes of a kept key the server refuses before it is forgotten: a row it can never
#: take must not turn the tier off for every later drain.
TRIES = 3

_draining = threading.Lock()
_counts: dict[str, int] = {}  # keys kept per directory, counted once a process


def keep(user_dir: Path, entries: Iterable[Entry]) -> int:
    """Name ``entries`` to be published later; how many were kept. Never raises: a node
    that cannot write here (disk full) keeps its binaries, and only other nodes pay."""
    kept = 0
    for entry in entries:
        where = Path(user_dir) / DIRNAME / entry.arch
        try:
            if str(where) not in _counts:
                make_private_dir(where)
                _counts[str(where)] = sum(1 for _ in os.scandir(where))
            if _counts[str(where)] >= MAX_KEPT:  # drained meanwhile by another process?
                _counts[str(where)] = sum(1 for _ in os.scandir(where))
                if _counts[str(where)] >= MAX_KEPT:
                    continue
            try:
                os.close(os.open(where / entry.key, os.O_CREAT | os.O_WRONLY, 0o600))
            except FileNotFoundError:  # the directory drained and removed meanwhile
                make_private_dir(where)
                os.close(os.open(where / entry.key, os.O_CREAT | os.O_WRONLY, 0o600))
        except (OSError, ValueError) as err:  # ValueError: a NUL in a name
            log.debug("kdb: cannot keep %s to publish later: %s", entry.key[:16], err)
            continue
        _counts[str(where)] += 1
        kept += 1
    return kept


def waiting(user_dir: Path) -> dict[str, int]:
    """``{arch: keys kept}`` under ``user_dir`` (``kdb info``)."""
    root = Path(user_dir) / DIRNAME
    try:
        archs = sorted(os.listdir(root))
    except OSError:
        return {}
    out = {}
    for arch in archs:
        try:
            n = sum(1 for e in os.scandir(root / arch) if not e.name.startswith("."))
        except OSError:
            continue
        if n:
            out[arch] = n
    return out


def drain(user_dir: Path, entries_of: Callable[[str, list[str]], list[Entry]],
          publish: Callable[[list[Entry]], bool]) -> int:
    """Publish every kept key's entry (``entries_of(arch, keys)`` reads them from the user
    file) and forget the keys sent; how many entries went. Stops at the first publish the
    server does not take (the rest stay kept). One thread of a process drains at a time;
    cheap when nothing is kept (one failed ``listdir``)."""
    root = Path(user_dir) / DIRNAME
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
                if entries and not publish(entries):
                    _tried(where, batch)
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
        try:
            root.rmdir()
        except OSError:
            pass
        if sent:
            log.debug("kdb: published %d entries kept while the shared tier was away", sent)
        return sent
    finally:
        _draining.release()


def _tried(where: Path, keys: list[str]) -> None:
    """One more refused publish of ``keys``: a byte appended to each name's file; at
    :data:`TRIES` bytes the name goes."""
    for key in keys:
        try:
            fd = os.open(where / key, os.O_WRONLY | os.O_APPEND)  # gone: sent by another
            try:
                os.write(fd, b".")
                tries = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if tries >= TRIES:
                os.unlink(where / key)
        except OSError:
            pass


def _after_fork() -> None:
    """A child drains on its own (a parent's thread may hold the lock at the fork)."""
    global _draining
    _draining = threading.Lock()


lifecycle.on_fork(_after_fork)

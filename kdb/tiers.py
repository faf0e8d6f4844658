"""Tiers: the places a binary may be found, behind one protocol, and the one check of a hit.

A tier answers four questions, whatever it is made of:

- ``name``: ``"system"``, ``"user"`` or ``"shared"`` (what a :class:`kdb.Hit` and the
  counters call it);
- ``fetch(key)``: the stored row (:class:`kdb.file.kernelfile.Row`'s columns) or ``None``;
- ``publish(entries, logs)``: store entries and start-up latency rows;
- ``drop(keys)``: remove entries that proved bad;
- ``describe()``: where it is, for messages (a path, or a server with its password masked).

:class:`FileTier` adapts a system or user :class:`~kdb.file.kernelfile.KernelFile`;
:class:`kdb.shared.tier.SharedTier` is the shared one (imported only when ``KDB_SHARED_URL`` is
set). Every tier's rows pass through :func:`verified`, so a corrupt or colliding entry is
refused the same way wherever it came from.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import config, faults, latency
from .file import discovery
from .file.codec import decode
from .file.kernelfile import KernelFile

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .keys import HashAttributes
    from .file.kernelfile import CompileRecord, Entry, Row

#: Why :func:`verified` refused a row.
CHECKSUM = "checksum mismatch"
COLLISION = "key collision (stored attributes differ)"


class FileTier:
    """A system or user file as a tier (a thin adapter: the file does the work)."""

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

    def drop(self, keys) -> int:
        return self.file.delete(list(keys))

    def describe(self) -> str:
        return self.file.filename


def verified(row, attrs: HashAttributes) -> tuple[bytes | None, str | None]:
    """``(binary, None)`` for a sound row, ``(None, reason)`` for a corrupt or colliding one.

    The checksum is the codec's (:func:`kdb.file.codec.decode`); the collision check compares the
    stored canonical attributes with the requested ones, so two keys that hash alike never
    serve each other's binary.
    """
    raw = decode(row.codec, row.blob, row.raw_size, row.checksum)
    if raw is None:
        return None, CHECKSUM
    if row.attributes != attrs.encoded().decode("utf-8"):
        return None, COLLISION
    return raw, None


def system_files(arch: str, dirs: list[str | Path], memo_dir: str | Path, user_dir: str | Path,
                 use_system: bool = True) -> list[KernelFile]:
    """The read-only system files for ``arch`` (:mod:`kdb.file.discovery`); none warns once per
    process and arch, saying what that costs and how to fix it."""
    config.check_arch(arch)
    if not use_system:
        return []
    files = [KernelFile(s.filename, tier="system", readonly=True)
             for s in discovery.sources_for(arch, dirs, memo_dir=memo_dir)]
    if not files:
        latency.note_missing_system(arch)
        faults.warn_once(
            f"nosys:{arch}",
            "kdb: no system kernel database for arch %r: looked for %s in KDB_SYSTEM_DB_PATH "
            "(%s) and in installed packages (entry point group %r). Kernels for this device "
            "will be compiled at first use and stored in %s, so the first start-up will be "
            "slow. To fix it, install the system database package for this arch "
            "(pip install %s, if your framework publishes one), or build one with "
            "`kdb pack --arch %s` and put its directory in KDB_SYSTEM_DB_PATH.",
            arch, f"{arch}.kdb", ", ".join(str(d) for d in dirs) or "none set",
            discovery.GROUP, os.path.join(str(Path(user_dir)), f"{arch}.kdb"), discovery.dist_name(arch),
            arch,
        )
    return files

"""The shapes of what a tier holds and is given: a row a hit reads, an entry to write, a
start-up latency record, what a lookup answers (:class:`Hit`), all plain named tuples (the hit
path builds a :class:`Row` per hit); and :class:`Tier`, what every tier does with them."""

from __future__ import annotations

from collections import namedtuple
from typing import TYPE_CHECKING, Protocol, runtime_checkable  # a hit loads typing anyway

if TYPE_CHECKING:
    from typing import Iterable


class Row(namedtuple("Row", "codec blob raw_size checksum attributes compile_seconds "
                       "attributes_sha256", defaults=(None,))):
    """What a hit needs from a stored entry (the columns :class:`~kdb.file.kernelfile.KernelFile`
    reads on a hit). From schema revision 0006 a hit reads ``attributes_sha256`` (the sha256
    of the stored attributes) and ``attributes`` is None, unless the reader asked for the
    text (:meth:`~kdb.file.kernelfile.KernelFile.fetch_any_compiler`); before 0006 it reads
    the whole text in ``attributes``, and ``attributes_sha256`` is None."""

    __slots__ = ()


class Entry(namedtuple("Entry", "key arch backend name attributes raw compile_seconds details "
                       "signer signature", defaults=(0.0, None, None, None))):
    """A binary ready to be written, with its bookkeeping (``details``: a dict or None) and,
    when a key vouched for it, the signer's key id and signature (:mod:`kdb.signing`)."""

    __slots__ = ()


#: The ``details`` key of an entry that stands in for a binary not stored yet: it never
#: replaces a stored entry, and any store of its key replaces it.
PROVISIONAL = "provisional"


class CompileRecord(namedtuple("CompileRecord",
                               "key name arch backend seconds missed reason at pid")):
    """One row of the start-up latency log."""

    __slots__ = ()


class Hit(namedtuple("Hit", "binary tier path compile_seconds")):
    """A binary found in a tier: ``binary`` (bytes), ``tier`` ("memory", "system", "user" or
    "shared"), ``path`` (the file or server it came from) and ``compile_seconds`` (what
    compiling it cost when it was stored)."""

    __slots__ = ()


@runtime_checkable
class Tier(Protocol):
    """What :class:`kdb.tiers.Tiers` asks of a tier, whatever it is made of: one signature per
    operation. :class:`kdb.tiers.FileTier` adapts a system or user file,
    :class:`kdb.shared.tier.SharedTier` is the shared server; the lookup loop walks
    ``Tiers._tiers``, and every row it fetches passes :func:`kdb.tiers.verified`."""

    #: ``"system"``, ``"user"`` or ``"shared"``, as :class:`Hit` and the counters call it.
    name: str

    def describe(self) -> str:
        """Where it is, for messages (a path, or a masked server URL)."""

    def fetch(self, key: str) -> Row | None:
        """The stored row for ``key`` (:class:`Row`'s columns at least), or None."""

    def signature(self, key: str, row: Row) -> tuple[str | None, bytes | None]:
        """``(signer, signature)`` of a fetched row, asked only under a trust policy."""

    def publish(self, entries: list[Entry], logs: list[CompileRecord] = ()) -> bool:
        """Store entries and start-up latency rows; False when they could not be written."""

    def drop(self, keys: Iterable[str]) -> int:
        """Remove entries that proved bad; how many went."""

    def touch(self, key: str) -> None:
        """Count a hit served from this tier, where the tier keeps its own counts."""

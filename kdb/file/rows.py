"""The shapes of what a tier file holds and is given: a row a hit reads, an entry to write,
a start-up latency record, and what a lookup answers (:class:`Hit`). Plain named tuples (the
hit path builds a :class:`Row` per hit)."""

from __future__ import annotations

from collections import namedtuple


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


class CompileRecord(namedtuple("CompileRecord",
                               "key name arch backend seconds missed reason at pid")):
    """One row of the start-up latency log."""

    __slots__ = ()


class Hit(namedtuple("Hit", "binary tier path compile_seconds")):
    """A binary found in a tier: ``binary`` (bytes), ``tier`` ("memory", "system", "user" or
    "shared"), ``path`` (the file or server it came from) and ``compile_seconds`` (what
    compiling it cost when it was stored)."""

    __slots__ = ()

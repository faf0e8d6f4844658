"""How an entry's canonical attributes are stored from schema revision 0006: compressed, and
each source once.

The canonical attributes (:meth:`kdb.keys.HashAttributes.encoded`, the key's input and what a
signature covers) are mostly the program's source, and entries often share one (the same
program built with other options). So the source's JSON string literal is cut out of the
text and kept once per file in the ``sources`` table, keyed by its sha256 and
zstd-compressed; the rest (options, header digests, the compiler's identity) is compressed
in the entry's ``attrs`` column. Joining the two gives back the exact bytes that were hashed
and signed, whatever they are: text kdb cannot split is stored whole.

A hit reads neither: the entry keeps ``attributes_sha256``, the sha256 of the whole text
computed by the writer from what it stored, and :func:`kdb.tiers.verified` compares it with
the request's key (the sha256 of the request's own canonical attributes).

A stored body is a zstd frame (with its content size and checksum) or, where compressing
would not shrink it, the UTF-8 bytes as they are; the frame's magic number tells them apart
(JSON text never starts with it).
"""

from __future__ import annotations

from collections import namedtuple

from . import codec

#: The first bytes of every zstd frame.
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: Where the source's literal starts in canonical attributes (keys are sorted, so it is the
#: first occurrence: a string value's quotes are escaped).
_SOURCE = ',"source":'


class Packed(namedtuple("Packed", "attrs source body size sha256")):
    """Attributes as stored: ``attrs`` (the entry's column), ``source`` (the sha256 hex of
    the cut-out literal, or None when nothing was cut out), ``body`` and ``size`` (the
    literal as stored and its length in bytes, for the ``sources`` row), ``sha256`` (of the
    whole text: the entry's ``attributes_sha256``)."""

    __slots__ = ()


def split(text: str) -> tuple[str, str | None]:
    """``(rest, literal)``: the source's JSON string literal cut out of canonical attributes,
    or ``(text, None)`` for text that holds none.

    >>> split('{"a":1,"source":"k\\\\"x","z":[]}')
    ('{"a":1,"source":,"z":[]}', '"k\\\\"x"')
    >>> join(*split('{"a":1,"source":"k","z":[]}'))
    '{"a":1,"source":"k","z":[]}'
    >>> split('{"source":3}')
    ('{"source":3}', None)
    """
    at = text.find(_SOURCE)
    start = at + len(_SOURCE)
    if at < 0 or text[start:start + 1] != '"':
        return text, None
    from json.decoder import scanstring

    try:
        end = scanstring(text, start + 1)[1]
    except ValueError:
        return text, None
    return text[:start] + text[end:], text[start:end]


def join(rest: str, literal: str | None) -> str:
    """The text :func:`split` cut in two (``literal`` None: ``rest`` is the whole text)."""
    if literal is None:
        return rest
    at = rest.find(_SOURCE) + len(_SOURCE)
    return rest[:at] + literal + rest[at:]


def sha256_hex(text: str) -> str:
    """The sha256 hex of attributes text (a damaged row's lone surrogates kept as bytes)."""
    import hashlib

    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def pack(text: str) -> Packed:
    """Attributes text as stored (a write, never a hit: it compresses and hashes)."""
    rest, literal = split(text)
    if literal is None:
        return Packed(compress(rest), None, None, 0, sha256_hex(text))
    size = len(literal.encode("utf-8", "surrogateescape"))
    return Packed(compress(rest), sha256_hex(literal), compress(literal), size, sha256_hex(text))


def unpack(attrs: object, source: object = None, body: object = None) -> str | None:
    """The whole attributes text from an entry's ``attrs`` and ``source`` columns and its
    source's ``body``; None when either does not decode, or the source row is missing."""
    rest = decompress(attrs)
    if rest is None or source is None:
        return rest
    literal = decompress(body) if body is not None else None
    return None if literal is None else join(rest, literal)


def compress(text: str) -> bytes:
    """UTF-8 text as a zstd frame, or as it is where that is no smaller."""
    raw = text.encode("utf-8", "surrogateescape")
    frame = codec._compressor(codec.TEXT_LEVEL).compress(raw)
    return frame if len(frame) < len(raw) else raw


def decompress(stored: object) -> str | None:
    """Text from :func:`compress`'s bytes; None for bytes that do not decode (damage)."""
    if isinstance(stored, memoryview):
        stored = bytes(stored)
    if not isinstance(stored, bytes):
        return None
    if stored[:4] == _ZSTD_MAGIC:
        try:
            stored = codec._zstd.ZstdDecompressor().decompress(stored)
        except codec._zstd.ZstdError:
            return None
    return stored.decode("utf-8", "surrogateescape")


# -- reading whole attributes in SQL ----------------------------------------------------------

#: The SQL function that gives an entry's whole attributes text (see :func:`register`).
FUNCTION = "kdb_attributes"


def register(conn) -> None:
    """Let ``conn`` (sqlite3) compute whole attributes in SQL (:func:`columns`)."""
    conn.create_function(FUNCTION, 3, _unpack_in_sql, deterministic=True)


_interrupted = False


def _unpack_in_sql(attrs: object, source: object = None, body: object = None) -> str | None:
    """:func:`unpack` as SQLite calls it. A Ctrl-C that lands inside reaches the caller as
    sqlite3's ``OperationalError: user-defined function raised exception``: it is noted
    here, so :func:`reraise_interrupt` gives the caller its KeyboardInterrupt back (``kdb
    verify`` called a sound file unreadable, and ``--repair`` repaired it)."""
    global _interrupted
    try:
        return unpack(attrs, source, body)
    except KeyboardInterrupt:
        _interrupted = True
        raise


def reraise_interrupt(err: BaseException | None = None) -> None:
    """Raise KeyboardInterrupt if a Ctrl-C landed in this module's SQL function (``err``: the
    error it became, if known); else nothing."""
    global _interrupted
    if _interrupted:
        _interrupted = False
        raise KeyboardInterrupt from err


def columns(compact: bool, table: str = "kernels", schema: str = "") -> tuple[str, str]:
    """``(expression, join)``: the whole attributes of a row of ``table`` (the name or alias
    the query gives ``kernels``) in a SELECT, and the join it needs after ``FROM``; a file
    before revision 0006 has the ``attributes`` column. ``schema``: an attached database's
    name. Needs :func:`register` on the connection."""
    if not compact:
        return f"{table}.attributes", ""
    prefix = f"{schema}." if schema else ""
    return (f"{FUNCTION}({table}.attrs, {table}.source, kdb_src.body)",
            f" LEFT JOIN {prefix}sources AS kdb_src ON kdb_src.digest = {table}.source")

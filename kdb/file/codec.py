"""Binary blobs as stored: zstd-compressed, with a sha256 of the raw bytes.

A blob that does not decode, or whose content does not match, is reported as ``None`` (a
miss), never returned. zstd frames are written with their own content checksum (XXH64),
which zstd verifies while decompressing: on the hit path that check replaces the sha256,
which costs more than the decompression itself. The sha256 stays in every row, and
``thorough=True`` (``kdb verify``, ``kdb pack``) checks it. Compressor objects are not
thread-safe, so each thread gets its own.
"""

from __future__ import annotations

import threading

import zstandard as _zstd

ZSTD = "zstd"
RAW = "raw"
#: zstd levels: LEVEL compresses best for its cost; FAST_LEVEL (-1) leaves literals without
#: Huffman coding, so its frames decompress faster (table "zstd levels" of
#: ``benchmarks/run.py --only scale``). Data whose redundancy is in its byte statistics
#: rather than in repeats does not shrink at -1 at all, and cubins shrink less: a store keeps
#: the fast frame only when it is at most FAST_SLACK times the size of the LEVEL frame.
#: Frames of any level decode alike.
LEVEL = 3
FAST_LEVEL = -1
FAST_SLACK = 1.05
#: The level of stored attributes and sources (:mod:`kdb.file.compact`): text, written once
#: and read by reports only, so it is compressed harder than binaries.
TEXT_LEVEL = 9
_FRAME_CHECKSUM_FLAG = 0x04  # bit 2 of a zstd frame's header descriptor (byte 4)

_local = threading.local()


def checksum(raw: bytes) -> str:
    """sha256 hex of the raw binary (:mod:`hashlib` loads OpenSSL: on a store, not a hit)."""
    import hashlib

    return hashlib.sha256(raw).hexdigest()


def encode(raw: bytes) -> tuple[str, bytes]:
    """``(codec, stored bytes)``: zstd unless compression would not shrink the binary (on
    stores only: it compresses twice to choose the level, see :data:`FAST_SLACK`)."""
    fast, best = _compressor(FAST_LEVEL).compress(raw), _compressor(LEVEL).compress(raw)
    blob = fast if len(fast) <= len(best) * FAST_SLACK else best
    if len(blob) >= len(raw):
        return RAW, bytes(raw)
    return ZSTD, blob


def _compressor(level: int) -> object:
    """This thread's compressor for ``level`` (they are not thread-safe)."""
    comps = getattr(_local, "c", None)
    if comps is None:
        comps = _local.c = {}
    comp = comps.get(level)
    if comp is None:
        comp = comps[level] = _zstd.ZstdCompressor(level=level, write_content_size=True,
                                                   write_checksum=True)
    return comp


def decode(codec: str, blob: bytes, raw_size: int, digest: str,
           thorough: bool = False) -> bytes | None:
    """The raw binary, or ``None`` when the blob is damaged or its content differs."""
    if not (isinstance(blob, bytes) and isinstance(raw_size, int) and isinstance(digest, str)):
        return None  # a damaged row: SQLite's columns are typed by the record, not the schema
    try:
        if codec == ZSTD:
            dec = getattr(_local, "d", None)
            if dec is None:
                dec = _local.d = _zstd.ZstdDecompressor()
            raw = dec.decompress(blob, max_output_size=raw_size)
            verified = len(blob) > 4 and blob[4] & _FRAME_CHECKSUM_FLAG  # zstd checked it
        elif codec == RAW:
            raw = bytes(blob)
            verified = False
        else:
            return None
    except (_zstd.ZstdError, ValueError, OverflowError):  # a negative or huge raw_size
        return None
    if len(raw) != raw_size:
        return None
    if (thorough or not verified) and checksum(raw) != digest:
        return None
    return raw

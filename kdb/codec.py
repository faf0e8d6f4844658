"""Binary blobs as stored: zstd-compressed, with a sha256 of the raw bytes.

A blob whose checksum does not match is reported as ``None`` (a miss), never returned.
Compressor objects are not thread-safe, so each thread gets its own.
"""

from __future__ import annotations

import hashlib
import threading

import zstandard

ZSTD = "zstd"
RAW = "raw"
LEVEL = 3

_local = threading.local()


def checksum(raw: bytes) -> str:
    """sha256 hex of the raw binary."""
    return hashlib.sha256(raw).hexdigest()


def encode(raw: bytes) -> tuple[str, bytes]:
    """``(codec, stored bytes)``: zstd unless compression would not shrink the binary."""
    comp = getattr(_local, "c", None)
    if comp is None:
        comp = _local.c = zstandard.ZstdCompressor(level=LEVEL, write_content_size=True)
    blob = comp.compress(raw)
    if len(blob) >= len(raw):
        return RAW, bytes(raw)
    return ZSTD, blob


def decode(codec: str, blob: bytes, raw_size: int, digest: str) -> bytes | None:
    """The raw binary, or ``None`` when the blob is damaged or its checksum differs."""
    try:
        if codec == ZSTD:
            dec = getattr(_local, "d", None)
            if dec is None:
                dec = _local.d = zstandard.ZstdDecompressor()
            raw = dec.decompress(blob, max_output_size=raw_size)
        elif codec == RAW:
            raw = bytes(blob)
        else:
            return None
    except zstandard.ZstdError:
        return None
    if len(raw) != raw_size or hashlib.sha256(raw).hexdigest() != digest:
        return None
    return raw

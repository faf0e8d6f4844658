"""PoCL binaries loaded with ``POCL_KERNEL_CACHE=0``: a directory of their own for each load.

PoCL unpacks a program created from a binary into ``<its cache dir>/<build hash>``, the hash
taken from the binary's header, and with its kernel cache off it ``rm -rf``\\ s that directory
when the program is released (``pocl_cache_create_program_cachedir`` and
``pocl_cache_cleanup_cachedir`` in PoCL's ``lib/CL/pocl_cache.c``, 3.0 to 7.x). Every process
that loads the same binary shares that directory, so one process's release deletes what
another still uses: PoCL aborts (``Can't get stat() on .../uncached/...``, from
``pocl_rm_rf``) or fails to link a kernel at launch. A build from source never meets this: PoCL
gives it a fresh ``mkdtemp`` directory. So, when PoCL's kernel cache is off, each load gets a
copy of the binary whose header names a directory no other load uses; the hash only names
that directory (the files the binary holds are stored with relative paths). A binary of a
header layout this module does not know is not loaded at all.
"""

from __future__ import annotations

import itertools
import os
import struct

MAGIC = b"poclbin\0"
HASH_SIZE = 41  # SHA1_digest_t: 40 characters and a NUL (lib/CL/pocl_cl.h)

_loads = itertools.count()
_token: list[str] = []  # random, once: two processes of one pid (two PID namespaces, one home)


def kernel_cache_off() -> bool:
    """True when PoCL runs without its kernel cache: ``POCL_KERNEL_CACHE`` set to anything
    that does not start with ``1`` (``pocl_get_bool_option``: ``true`` is off too)."""
    value = os.environ.get("POCL_KERNEL_CACHE")
    return value is not None and not value.startswith("1")


def _hash_offset(binary: bytes) -> int | None:
    """Where the build hash sits in a PoCL binary's header (``read_header`` in PoCL's
    ``lib/CL/pocl_binary.c``): after magic, device id, version, kernel count and flags; from
    version 9 on, after a root entry count too. None for a version not known here."""
    if len(binary) < 40:
        return None
    (version,) = struct.unpack_from("<I", binary, 16)
    if version == 8:
        offset = 32
    elif 9 <= version <= 12:
        offset = 36
    else:
        return None
    return offset if len(binary) >= offset + HASH_SIZE else None


def private_copies(binaries: list[bytes]) -> list[bytes] | None:
    """``binaries`` ready for ``clCreateProgramWithBinary``: as they are unless PoCL's kernel
    cache is off, else each PoCL binary with a build hash no other load uses; None when a
    PoCL binary's header is one this module cannot rewrite (build from source instead)."""
    if not kernel_cache_off():
        return binaries
    if not _token:
        _token.append(os.urandom(4).hex())
    out = []
    for binary in binaries:
        if not binary.startswith(MAGIC):
            out.append(binary)
            continue
        offset = _hash_offset(binary)
        if offset is None:
            return None
        # PoCL's own uncached directories are "_UNCACHED_XXXXXX": a cleaner of those finds
        # these too. 40 characters at most: 13 + 8 + 8 (a pid) + 1 + 10.
        name = f"_UNCACHED_kdb{_token[0]}{os.getpid():x}_{next(_loads) % 16**10:x}".encode()
        out.append(binary[:offset] + name.ljust(HASH_SIZE, b"\0")
                   + binary[offset + HASH_SIZE:])
    return out

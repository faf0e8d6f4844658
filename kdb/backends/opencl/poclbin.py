"""PoCL's program binaries: a directory of their own for each load with ``POCL_KERNEL_CACHE=0``,
and the files a binary carries (:func:`layout`, :func:`with_files`, for
:mod:`.refresh`).

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
from typing import NamedTuple

MAGIC = b"poclbin\0"
#: What an early entry's binary starts with (:mod:`.early`: PoCL's files standing in for a
#: binary); no PoCL binary (:data:`MAGIC`) or other driver's binary does.
EARLY_MAGIC = b"kdb-pocl-dir\0\1"
HASH_SIZE = 41  # SHA1_digest_t: 40 characters and a NUL (lib/CL/pocl_cl.h)

_loads = itertools.count()
_token: list[str] = []  # random, once: two processes of one pid (two PID namespaces, one home)


def pocl_cache_dir() -> str:
    """PoCL's kernel cache directory as PoCL finds it (``pocl_cache_init_topdir``)."""
    if os.environ.get("POCL_CACHE_DIR"):
        return os.environ["POCL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.environ.get("HOME")
        base = os.path.join(home, ".cache") if home else "/tmp"
    return os.path.join(base, "pocl", "kcache")


def kernel_cache_off() -> bool:
    """True when PoCL runs without its kernel cache: ``POCL_KERNEL_CACHE`` set to anything
    that does not start with ``1`` (``pocl_get_bool_option``: ``true`` is off too)."""
    value = os.environ.get("POCL_KERNEL_CACHE")
    return value is not None and not value.startswith("1")


def is_early(binary: bytes) -> bool:
    """Whether a stored binary is an early entry (PoCL's files) rather than a binary: here,
    not in :mod:`.early`, as a hit asks it of every binary and needs nothing else of that."""
    return binary[:len(EARLY_MAGIC)] == EARLY_MAGIC


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


# -- the files a binary carries (version 8: PoCL 3.0) ------------------------------------------

#: The one layout :func:`layout` reads: ``POCLCC_VERSION`` 8, PoCL 3.0's. Versions 9 to 12
#: (PoCL 3.1 and later) lay the root files and kernel records out otherwise.
FILES_VERSION = 8
_VERSION_8 = struct.pack("<I", FILES_VERSION)
#: magic, device id, version, kernel count, flags, build hash (``read_header``).
_HEADER_8 = 32 + HASH_SIZE
#: Version 9 (PoCL 3.1): the header has 4 more bytes, and the root files come as one record
#: of a ``uint64`` size (0 where PoCL found none to read) holding the file records.
_VERSION_9 = struct.pack("<I", 9)
_HEADER_9 = 36 + HASH_SIZE
#: PoCL's largest serialized binary (``MAX_BINARY_SIZE`` in ``lib/CL/pocl_binary.c``).
MAX_BINARY = 256 << 20
_HASH_CHARS = frozenset("ABCDEFGHIJKLMNOP")


class Kernel(NamedTuple):
    """One kernel's record in a PoCL binary: its name, where the record starts, its size,
    and the files it carries (paths relative to the program's cache directory, such as
    ``/k/16-1-1-goffs0-smallgrid/k.so``)."""

    name: str
    offset: int
    size: int
    files: tuple[str, ...]


class Layout(NamedTuple):
    """What :func:`layout` reads from a binary: the build hash that names the program's
    directory in PoCL's cache (``AB/CDE...``), and its kernels in order."""

    build_hash: str
    kernels: tuple[Kernel, ...]


def version_8(binary: bytes) -> bool:
    """Whether ``binary`` is a PoCL binary of the one layout :func:`layout` reads."""
    return binary[16:20] == _VERSION_8 and binary.startswith(MAGIC)


def layout(binary: bytes) -> Layout | None:
    """The build hash and each kernel's files of a version-8 PoCL binary, walked as PoCL's
    ``pocl_binary_deserialize`` walks it: the header, ``/program.bc``, then one record per
    kernel whose last ``binaries_size`` bytes are files (a ``uint32`` length and the path,
    a ``uint32`` length and the content). None for any other binary, or one whose sizes do
    not add up."""
    if len(binary) < _HEADER_8 or not version_8(binary):
        return None
    build_hash = build_hash_of(binary[32:_HEADER_8])
    if build_hash is None:
        return None
    kernels = _kernels(binary)
    return Layout(build_hash, kernels) if kernels is not None else None


def torn(binary: bytes) -> bool:
    """Whether ``binary`` is a PoCL binary whose program file is missing or empty, or, in
    version 8, whose records do not add up: PoCL serialises a program from the files in its
    cache directory, and where they went meanwhile (a cleaner, ``rm -rf`` of the cache
    between runs) PoCL 3.0 writes an empty ``/program.bc`` and PoCL 3.1 none. Loaded, such a
    binary crashed every process PoCL's cache did not hold the program for (SIGSEGV at the
    first launch; PoCL 3.1: an assertion). In version 9 the first root file is checked;
    versions after 9 are not read (False)."""
    if not binary.startswith(MAGIC):
        return False
    if version_8(binary):
        return len(binary) < _HEADER_8 or _kernels(binary) is None
    if binary[16:20] != _VERSION_9:
        return False
    try:
        (size,) = struct.unpack_from("<Q", binary, _HEADER_9)
        start = _HEADER_9 + 8
        return size == 0 or not _file(binary, start, start + size)[0]
    except (struct.error, UnicodeDecodeError, ValueError):
        return True


def _kernels(binary: bytes) -> tuple[Kernel, ...] | None:
    """The kernel records of a version-8 binary (:func:`layout`), None where they do not
    add up."""
    (count,) = struct.unpack_from("<I", binary, 20)
    try:
        _, pos = _file(binary, _HEADER_8, len(binary))
        kernels = []
        for _ in range(count):
            size, files_size = struct.unpack_from("<QQ", binary, pos)
            (name_size,) = struct.unpack_from("<I", binary, pos + 20)
            end = pos + size
            if files_size > size - 24 - name_size or end > len(binary):
                return None
            name = binary[pos + 24:pos + 24 + name_size].decode("ascii")
            files, at = [], end - files_size
            while at < end:
                path, at = _file(binary, at, end)
                files.append(path)
            kernels.append(Kernel(name, pos, size, tuple(files)))
            pos = end
    except (struct.error, UnicodeDecodeError, ValueError):
        return None
    return tuple(kernels) if pos == len(binary) else None


def build_hash_of(field: bytes) -> str | None:
    """The build hash a version-8 header's 41-byte field holds, as the directory it names
    in PoCL's cache (``AB/CDEF...``: 40 characters ``A`` to ``P``, ``/`` third, from
    ``build_program_compute_hash``); None for anything else (a load's private directory with
    the kernel cache off, or not PoCL's hash)."""
    text = field.split(b"\0", 1)[0].decode("latin-1")
    if len(text) == 40 and text[2] == "/" and _HASH_CHARS.issuperset(text[:2] + text[3:]):
        return text
    return None


def _file(binary: bytes, at: int, end: int) -> tuple[str, int]:
    """The path of the file record at ``at`` and where the next record starts."""
    (n,) = struct.unpack_from("<I", binary, at)
    path = binary[at + 4:at + 4 + n].decode("utf-8")
    (size,) = struct.unpack_from("<I", binary, at + 4 + n)
    nxt = at + 8 + n + size
    if n == 0 or size == 0 or nxt > end:  # PoCL asserts both lengths > 0 when it unpacks
        raise ValueError("a file record past its end")
    return path, nxt


def with_files(binary: bytes, found: Layout, added: dict[str, list[tuple[str, bytes]]]) -> bytes:
    """``binary`` (whose :func:`layout` is ``found``) with ``added`` files appended to the
    records of the kernels they belong to: the header, ``program.bc`` and every file it
    carried stay byte for byte. PoCL unpacks a file only where none is (``deserialize_file``),
    so what it has already is never overwritten."""
    out = [binary[:found.kernels[0].offset] if found.kernels else binary]
    for k in found.kernels:
        record = binary[k.offset:k.offset + k.size]
        extra = b"".join(struct.pack("<I", len(p)) + p + struct.pack("<I", len(c)) + c
                         for p, c in ((path.encode("utf-8"), content)
                                      for path, content in added.get(k.name, ())))
        if extra:
            size, files_size = struct.unpack_from("<QQ", record)
            record = struct.pack("<QQ", size + len(extra), files_size + len(extra)) \
                + record[16:] + extra
        out.append(record)
    return b"".join(out)

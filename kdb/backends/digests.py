"""Content digests of files, memoized per path and :func:`stamp` (device, inode, size, mtime,
ctime).

Headers are digested once per process and version of the file. Compiler libraries (large,
slow to hash) are digested once per machine: the digest is kept in
``<cache root>/digests.json`` keyed by path and stamp, so a key never depends on an mtime
while a warm start never re-reads the library. Size and mtime alone are not enough: a
header replaced by one of the same size whose mtime was set back (``os.utime``, ``cp -p``,
``tar``, ``rsync -t``) or a symlink swapped between two such files would keep the old
digest. A replaced file has another inode, and any change sets the ctime, which only a
change of the system clock could set back. A memo someone else could write is
neither read nor written: its values would be kernels' keys.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import private_dir

if TYPE_CHECKING:  # annotations are strings here
    from typing import Any, Callable

# hashlib (OpenSSL), json and tempfile load where a file is digested or a memo read or
# written: a warm start whose sources include no header needs none of them.

_memo: dict[tuple, str] = {}
_lock = threading.Lock()
_SETTLED_S = 2.0


def stamp(st: os.stat_result) -> tuple[int, int, int, int, int]:
    """What tells two versions of a file apart without reading it: ``(device, inode, size,
    mtime, ctime)``, all in ns where there are ns."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _settled(st: os.stat_result) -> bool:
    """Whether ``st``'s file last changed long enough ago that a change now would show in its
    stamp: a file changed moments ago may change again within the file system's timestamp
    granularity (1-2 s on some) with nothing in its stamp to say so."""
    return time.time() - max(st.st_mtime, st.st_ctime) > _SETTLED_S


def _tag(path: str, st: os.stat_result) -> str:
    """A machine memo's key: ``path|dev|ino|size|mtime|ctime``."""
    return "|".join((path, *map(str, stamp(st))))


_TAG_FIELDS = 5
#: The values a machine memo keeps for one version of a file, one per variant (the
#: environment a compiler was probed in): a few, so environments that alternate between
#: processes (two projects' HIPCC_COMPILE_FLAGS_APPEND) each probe once, not at every switch.
_VARIANTS = 8


def _tag_path(tag: str) -> str:
    """The path a memo's key names (``path|dev|ino|size|mtime|ctime[|v=variant]``)."""
    head, _, last = tag.rpartition("|")
    return (head if last.startswith("v=") else tag).rsplit("|", _TAG_FIELDS)[0]


def _hash_file(path: str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's content, computed once per process per path and :func:`stamp`."""
    p = os.fspath(path)
    st = os.stat(p)
    memo = (p, *stamp(st))
    digest = _memo.get(memo)
    if digest is None:
        digest = _hash_file(p)
        if _settled(st):
            _memo[memo] = digest
    return digest


def machine_digest(path: str | os.PathLike[str], memo_dir: Path) -> str:
    """Like :func:`file_digest`, but remembered across processes in ``memo_dir``."""
    p = os.path.realpath(os.fspath(path))
    st = os.stat(p)
    memo = (p, *stamp(st))
    digest = _memo.get(memo)
    if digest is not None:
        return digest
    store = memo_dir / "digests.json"
    tag = _tag(p, st)
    import json

    with _lock:
        trusted = _trusted(store)
        try:
            known = json.loads(store.read_text(encoding="utf-8")) if trusted else {}
        except (OSError, ValueError):
            known = {}
        digest = known.get(tag) if isinstance(known, dict) else None
        if not isinstance(digest, str):
            digest = _hash_file(p)
            known = known if isinstance(known, dict) else {}
            # Older digests of the same file are stale: keep the memo from growing with them.
            known = {k: v for k, v in known.items() if _tag_path(k) != p}
            known[tag] = digest
            if trusted:
                _write_atomic(store, json.dumps(known, sort_keys=True, indent=0))
    _memo[memo] = digest
    return digest


def file_stamp(path: str) -> str:
    """``<real path>|dev|ino|size|mtime|ctime``: what a machine memo's value records of each
    file it depends on beyond the one it is kept under (:func:`stamps_hold`). Size and mtime
    alone held for a device library replaced by its same-size twin with the old mtime
    (``oclc_finite_only_on.bc`` over ``_off.bc``, then ``touch -d``): the identity stayed,
    and the code object built with the old library was served."""
    return _tag(os.path.realpath(path), os.stat(path))


def stamps_hold(stamps) -> bool:
    """Whether every file of ``stamps`` (:func:`file_stamp`) is still the version it was;
    False for a file gone or a malformed stamp (one of an older, shorter form too)."""
    try:
        for one in stamps:
            p, *numbers = one.rsplit("|", 5)
            if tuple(map(int, numbers)) != stamp(os.stat(p)):
                return False
    except (OSError, TypeError, ValueError, AttributeError):
        return False
    return True


def machine_memo(memo_dir: Path, name: str, path: str | os.PathLike[str],
                 compute: Callable[[], Any],
                 valid: Callable[[Any], bool] = lambda value: True,
                 variant: str = "") -> Any:
    """A JSON value about a file, computed once per machine, kept in ``<memo_dir>/<name>.json``.

    For facts that cost a subprocess (a compiler's ``--version`` output): the value is
    remembered under the file's path and :func:`stamp`, so a changed or replaced file
    recomputes it; ``valid`` may reject a remembered value whose other inputs changed since.
    ``variant`` (hex, no ``|``): what else the value depends on, such as a digest of the
    environment it was probed in; each version of the file keeps up to :data:`_VARIANTS`.
    """
    p = os.path.realpath(os.fspath(path))
    st = os.stat(p)
    base = _tag(p, st)
    tag = f"{base}|v={variant}" if variant else base
    store = memo_dir / f"{name}.json"
    import json

    trusted = _trusted(store)
    try:
        known = json.loads(store.read_text(encoding="utf-8")) if trusted else {}
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if tag in known and valid(known[tag]):
        return known[tag]
    value = compute()
    if not trusted:
        return value
    with _lock:
        # Values for older versions of the file are stale, and its variants are bounded:
        # keep the memo from growing with them.
        kept = [k for k in known if k != tag
                and (k == base or k.startswith(base + "|v="))][:_VARIANTS - 1]
        known = {k: v for k, v in known.items() if _tag_path(k) != p or k in kept}
        known[tag] = value
        _write_atomic(store, json.dumps(known, sort_keys=True, indent=0))
    return value


def _trusted(store: Path) -> bool:
    """A memo's values enter kernels' keys: one that someone else could write (the file, its
    directory or one above) is neither read nor written, after one warning."""
    from ..file import fs

    return not fs.refused([store, store.parent], (
        "the compiler identities read from it enter kernels' keys",
        "they are computed afresh in each process"))


def _write_atomic(path: Path, text: str) -> None:
    try:
        private_dir(path.parent)
        import tempfile

        fd, tmp = tempfile.mkstemp(prefix=".digests-", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time


def elf_build_id(path: str | os.PathLike[str]) -> str | None:
    """The GNU build ID of an ELF file (a hash of its content the linker stored), or None.

    Reading it costs a few small reads, where hashing a compiler library reads all of it on
    a machine's first start; the linker's hash identifies the same build just as well.
    """
    import struct

    try:
        with open(path, "rb") as f:
            ident = f.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2:  # ELF64 only
                return None
            end = "<" if ident[5] == 1 else ">"
            phoff, = struct.unpack_from(end + "Q", ident, 0x20)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 0x36)
            f.seek(phoff)
            headers = f.read(phentsize * phnum)
            for i in range(phnum):
                p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(
                    end + "IIQQQQ", headers, i * phentsize)
                if p_type != 4 or p_filesz > 1 << 16:  # PT_NOTE, of a sane size
                    continue
                f.seek(p_offset)
                notes = f.read(p_filesz)
                pos = 0
                while pos + 12 <= len(notes):
                    namesz, descsz, n_type = struct.unpack_from(end + "III", notes, pos)
                    name_at = pos + 12
                    desc_at = name_at + ((namesz + 3) & ~3)
                    if n_type == 3 and notes[name_at:name_at + namesz] == b"GNU\x00":
                        return notes[desc_at:desc_at + descsz].hex() or None
                    pos = desc_at + ((descsz + 3) & ~3)
    except (OSError, struct.error):
        return None
    return None


def library_id(path: str | os.PathLike[str], memo_dir: Path) -> str:
    """A portable identity of a compiler library: its GNU build ID, else its content sha256."""
    build_id = elf_build_id(path)
    if build_id:
        return f"gnu-build-id:{build_id}"
    return f"sha256:{machine_digest(path, memo_dir)}"

"""A Triton kernel's artifact group as one kdb entry, and the files Triton reads it from.

Triton compiles a kernel into a group of files (its metadata JSON, the IR of each stage, the
cubin or hsaco) and later reads them by path. kdb stores the whole group as one binary
(:func:`pack`: deterministic, so a system pack is byte-reproducible) and, on a hit, writes
only that kernel's files into a directory private to this process (:func:`materialize`),
removed at exit. A thousand cached kernels are one SQLite file per arch, not a thousand
directories.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from ... import lifecycle

#: First line of a packed group; a blob without it is not a group (a miss, and dropped).
MAGIC = b"kdb-triton-group 1\n"


def pack(files: dict[str, bytes]) -> bytes:
    """One blob for ``{file name: bytes}``: the names and sizes in a JSON line, then the bytes
    in name order."""
    names = sorted(files)
    header = json.dumps([[n, len(files[n])] for n in names], separators=(",", ":"))
    return b"".join([MAGIC, header.encode("utf-8"), b"\n", *(files[n] for n in names)])


def unpack(blob: bytes) -> dict[str, bytes] | None:
    """The files of a packed group, or ``None`` when ``blob`` is not one."""
    if not blob.startswith(MAGIC):
        return None
    end = blob.find(b"\n", len(MAGIC))
    try:
        sizes = json.loads(blob[len(MAGIC):end].decode("utf-8"))
        files, at = {}, end + 1
        for name, size in sizes:
            if not _plain_name(name):
                return None
            files[name] = blob[at:at + size]
            at += size
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    return files if at == len(blob) else None


def _plain_name(name: object) -> bool:
    """A file name Triton makes: no directory part, nothing hidden."""
    return (isinstance(name, str) and bool(name) and os.sep not in name and "/" not in name
            and not name.startswith(".") and "\0" not in name)


# -- this process's files ---------------------------------------------------------------------

_root: list = []  # [pid, path] of this process's private directory, made on first use


def private_dir(key: str) -> str:
    """``<tmp>/kdb-triton-<uid>-XXXX/<key>``: made 0700 by ``mkdtemp`` (a name nobody can
    plant in advance), per process, removed at exit."""
    if not _root or _root[0] != os.getpid():
        uid = os.getuid() if hasattr(os, "getuid") else 0
        _root[:] = [os.getpid(), tempfile.mkdtemp(prefix=f"kdb-triton-{uid}-")]
    path = os.path.join(_root[1], key)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def write(directory: str, name: str, data: bytes) -> str:
    """Write ``data`` as ``directory/name`` (whole or not at all); its path."""
    path = os.path.join(directory, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def materialize(key: str, files: dict[str, bytes]) -> dict[str, str]:
    """Write a group's files for Triton to read; ``{file name: path}``."""
    directory = private_dir(key)
    return {name: write(directory, name, data) for name, data in files.items()}


def _remove_at_exit() -> None:
    if _root and _root[0] == os.getpid():
        shutil.rmtree(_root[1], ignore_errors=True)


lifecycle.on_exit(lifecycle.REPORT, _remove_at_exit)

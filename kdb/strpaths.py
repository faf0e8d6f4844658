"""Paths as str, spelled as :mod:`pathlib` would spell them, without importing it.

Every hit resolves the cache root, the user directory and the system directories, and
opens files under them; ``pathlib`` (with ``re``, ``fnmatch`` and ``urllib.parse`` behind
it) would be the largest import of a hit. So the hit path keeps its paths as str, and the
modules that hand paths to callers build a ``Path`` from them when asked.
"""

from __future__ import annotations

import errno
import os
import stat


def spelled(path: str | os.PathLike[str]) -> str:
    """``str(pathlib.Path(path))``: no empty or ``.`` parts, no trailing slash (``..`` is
    kept).

    >>> spelled("a//./b/"), spelled(""), spelled("//x/"), spelled("/../a")
    ('a/b', '.', '//x', '/../a')
    """
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError("argument should be a str or an os.PathLike object where __fspath__ "
                        f"returns a str, not {type(text).__name__!r}")
    if os.sep != "/" or os.altsep:  # Windows: drives, UNC, two separators; pathlib knows them
        from pathlib import Path

        return str(Path(text))
    root = "/" if text[:1] == "/" else ""
    if text[:2] == "//" and text[2:3] != "/":
        root = "//"  # POSIX leaves the meaning of exactly two leading slashes open
    return root + "/".join(p for p in text.split("/") if p and p != ".") or "."


def join(directory: str, name: str) -> str:
    """``str(Path(directory) / name)`` for a spelled ``directory`` and a plain file name.

    >>> join(".", "v1"), join("/", "kdb"), join("a/b", "c.kdb")
    ('v1', '/kdb', 'a/b/c.kdb')
    """
    return name if directory == "." else os.path.join(directory, name)


def parent(path: str) -> str:
    """``str(Path(path).parent)`` for a spelled ``path``.

    >>> parent("a/b.kdb"), parent("b.kdb"), parent("/b.kdb"), parent("/")
    ('a', '.', '/', '/')
    """
    return os.path.dirname(path) or "."


def home() -> str:
    """``str(Path.home())``: the home directory; RuntimeError when there is none."""
    found = os.path.expanduser("~")
    if found[:1] == "~":
        raise RuntimeError("Could not determine home directory.")
    return found


def expanded(path: str | os.PathLike[str]) -> str:
    """``str(Path(path).expanduser())``."""
    text = spelled(path)
    if text[:1] == "~":
        first, sep, rest = text.partition("/")
        found = os.path.expanduser(first)
        if found[:1] == "~":
            raise RuntimeError("Could not determine home directory.")
        text = spelled(os.path.join(found, rest) if sep else found)
    return text


def _mode(path: str | os.PathLike[str]) -> int | None:
    """``path``'s st_mode; None where nothing is there, an error (no permission) raised, as
    ``Path.exists`` and ``Path.is_file`` do."""
    try:
        return os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    except OSError as err:
        if err.errno in (errno.EBADF, errno.ELOOP):
            return None
        raise


def exists(path: str | os.PathLike[str]) -> bool:
    """``Path(path).exists()``."""
    return _mode(path) is not None


def is_file(path: str | os.PathLike[str]) -> bool:
    """``Path(path).is_file()``."""
    mode = _mode(path)
    return mode is not None and stat.S_ISREG(mode)


def make_private_dir(path: str | os.PathLike[str]) -> None:
    """Create ``path`` and any missing parents with mode 0700 (a cache holds code to run)."""
    missing = []
    p = spelled(path)
    while not exists(p):
        missing.append(p)
        up = parent(p)
        if up == p:
            break
        p = up
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass

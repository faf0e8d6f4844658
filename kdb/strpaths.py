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
    """The home directory the default cache lives under: ``HOME`` (else the password entry's).

    ``HOME`` empty, relative or ``/`` (a service account, a scrubbed environment) would put
    the cache at ``.cache/kdb`` in whatever directory a process runs in, or at
    ``/.cache/kdb``: a private directory under the temporary directory stands in, with one
    warning (:func:`stand_in_home`)."""
    found = os.environ.get("HOME")
    if found is None:
        found = os.path.expanduser("~")  # the password entry (``~`` where there is none)
    if found[:1] == os.sep and spelled(found) != os.sep:
        return found
    return stand_in_home(found)


def stand_in_home(found: str | None) -> str:
    """``<tmp>/kdb-<uid>``, created 0700 and checked to be this user's own directory (else a
    new private one, ``mkdtemp``); warns once, naming ``HOME`` and the fix."""
    got = _stand_ins.get(found)
    if got is not None:
        return got
    import tempfile

    from . import logs

    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = os.path.join(tempfile.gettempdir(), f"kdb-{uid}")
    try:
        os.mkdir(path, 0o700)
    except OSError:
        pass
    try:
        st = os.lstat(path)
        ours = stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022
    except OSError:
        ours = False
    if not ours:  # planted by someone else, or not a directory: never use it
        path = tempfile.mkdtemp(prefix=f"kdb-{uid}-")
    logs.warn_once("home", "kdb: HOME is %s, so there is no home directory for the kernel "
                   "cache; using the private directory %s instead. Set HOME to your home "
                   "directory, or KDB_CACHE_DIR to a directory of your own.",
                   "unset" if found in (None, "~") else repr(found), path)
    _stand_ins[found] = path
    return path


_stand_ins: dict[str | None, str] = {}


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

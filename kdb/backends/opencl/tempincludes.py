"""Temporary include directories, built from a copy named by its content.

A program built with ``-I`` naming a temporary directory (a test's ``tmp_path``, a script's
``mkdtemp``) names another directory in every process. kdb's key holds the headers by
content, so the key is the same; but PoCL's build hash holds the option text and the
headers' paths, so every process compiles again, PoCL's cache never answers, an early entry
(:mod:`.early`) never stands in, and the store worker's rebuild fails once the directory is
gone. Only a full store would serve it, which a machine that is never idle does not afford.

So such a build is given, in the directory's place, a copy of it in kdb's cache named by
the digest of its files' names and bytes (``<user dir>/includes/<digest>/``): the compiler
finds the same names with the same bytes in the same order of the search, and every process
with those headers builds with the same option text. Only where the copy is faithful:

- the directory is small (:data:`MAX_FILES`, :data:`MAX_BYTES`) and holds only directories
  and regular files, no two names of one file (``#pragma once`` goes by the file), no link;
- no include name of the build climbs out of a directory (``..``: the copy's parent is not
  the directory's);
- neither the source nor a file of the directory names ``__FILE__`` or ``__BASE_FILE__``
  (the path would show in the kernel);
- no option token is quoted.

Otherwise the build runs as asked. The copy is made whole or not at all (a temporary name,
then a rename) in this user's cache, and checked against its name before each use: a copy
changed since is replaced. Build logs name the copy's path.
"""

from __future__ import annotations

import os
import stat

#: Files a temporary include directory may hold to be copied.
MAX_FILES = 256
#: Bytes its files may hold in all.
MAX_BYTES = 4 << 20
#: Where a program's temporary files go (besides ``TMPDIR``, ``TEMP``, ``TMP``): what
#: :mod:`tempfile` would choose, without importing it.
TEMPORARY_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
#: Copies kept in a cache at most: each edit of a header makes another, and the oldest
#: (least recently used) beyond these go when one is made (``kdb clear`` removes them all).
MAX_COPIES = 32
#: A copy used this recently is never removed (a build may be reading it).
PRUNE_AFTER_S = 600.0
#: What would show a header's path in the kernel.
PATH_MACROS = (b"__FILE__", b"__BASE_FILE__")
_FLAGS = ("-I", "-isystem", "-iquote")


_roots: dict[tuple, list[str]] = {}


def _temporary_roots() -> list[str]:
    """The temporary directories, resolved, each ending in ``/`` (memoized by the
    variables that name them)."""
    names = (*TEMPORARY_DIRS, *(os.environ.get(v, "") for v in ("TMPDIR", "TEMP", "TMP")))
    got = _roots.get(names)
    if got is None:
        got = _roots[names] = [os.path.realpath(d).rstrip("/") + "/"
                               for d in dict.fromkeys(names) if d]
    return got


_installed: list[str] = []


def _installation() -> list[str]:
    """This Python's own trees (its prefixes: the venv and the base installation), resolved,
    each ending in ``/``: a package's include directory there (pyopencl's ``cl/``) stays
    put between processes, even in a venv made under ``/tmp``."""
    if not _installed:
        import sys

        names = dict.fromkeys((sys.prefix, sys.base_prefix, sys.exec_prefix))
        _installed.extend(os.path.realpath(d).rstrip("/") + "/" for d in names if d)
    return _installed


def temporary(path: str) -> bool:
    """Whether ``path`` lies in a temporary directory (below it, not the directory itself),
    and not in this Python's installation.

    >>> temporary("/tmp/pytest-1/inc"), temporary("/opt/x/include"), temporary("/tmp")
    (True, False, False)
    >>> import sys; temporary(sys.prefix + "/lib/site-packages/pyopencl/cl")
    False
    """
    try:
        real = os.path.realpath(path)
    except OSError:  # relative, and the working directory is gone: nothing to copy
        return False
    return (any(real.startswith(root) for root in _temporary_roots())
            and not any((real + "/").startswith(own) for own in _installation()))


def temporary_dirs(search, forced: bool = False) -> list[str]:
    """The include directories of ``search`` (a :class:`kdb.backends.includes.IncludeSearch`)
    that lie in a temporary directory, as written; with ``forced``, ``-include`` files too."""
    found = (*search.quote, *search.dirs, *(search.forced if forced else ()))
    return [r[0] for r in found if r and temporary(r[0])]


def files_of(top: str) -> list[tuple[str, bytes]] | None:
    """``(relative path, content)`` of every file below ``top``, sorted; None where a copy
    would not be faithful (a link, a special file, two names of one file, too many or too
    large, a path macro) or ``top`` cannot be read."""
    out: list[tuple[str, bytes]] = []
    seen: set[tuple[int, int]] = set()
    total = 0
    for here, dirs, names in os.walk(top, onerror=_raise):
        for name in dirs:
            if os.path.islink(os.path.join(here, name)):
                return None
        for name in names:
            path = os.path.join(here, name)
            st = os.lstat(path)
            ident = (st.st_dev, st.st_ino)
            if not stat.S_ISREG(st.st_mode) or ident in seen or len(out) >= MAX_FILES:
                return None
            seen.add(ident)
            with open(path, "rb") as f:
                content = f.read(MAX_BYTES + 1 - total)
            total += len(content)
            if total > MAX_BYTES or any(m in content for m in PATH_MACROS):
                return None
            out.append((os.path.relpath(path, top), content))
    return sorted(out)


def _raise(err: OSError) -> None:
    raise err


def digest_of(files: list[tuple[str, bytes]]) -> str:
    """The copy's name: a digest of the files' names and bytes."""
    import hashlib

    h = hashlib.sha256(b"kdb-includes-1\0")
    for rel, content in files:
        h.update(rel.encode("utf-8", "surrogateescape") + b"\0")
        h.update(hashlib.sha256(content).digest())
    return h.hexdigest()[:40]


#: (directory, root) -> (the directory's stamps, its copy, the copy's stamps) as last
#: checked by this process: a build whose files have the same stamps reads nothing again.
_checked: dict[tuple[str, str], tuple[tuple, str, tuple]] = {}


def copy_of(top: str, root: str) -> str | None:
    """The path of the content-named copy of the directory ``top`` in ``root``, made if
    missing or changed since; None where no faithful copy can be made."""
    memo = (os.path.abspath(top), root)
    try:
        before = _stamps(top)  # before the reads: a change after them shows next time
        if before is None:
            return None
        known = _checked.get(memo)
        if known is not None and known[0] == before and _stamps(known[1]) == known[2]:
            return known[1]
        files = files_of(top)
        if files is None:
            return None
        target = os.path.join(root, digest_of(files))
        if not _intact(target, files):
            _write(root, target, files)
            _prune(root, target)
        elif target not in _used:  # its use, once a process: the copies least used go first
            _used.add(target)
            os.utime(target)
        copied = _stamps(target)
        if not _intact(target, files):
            return None
    except OSError:
        return None
    _checked[memo] = (before, target, copied)
    return target


#: Copies this process has marked used.
_used: set[str] = set()


def _prune(root: str, made: str) -> None:
    """Remove the copies in ``root`` beyond :data:`MAX_COPIES`, least recently used first,
    none used in the last :data:`PRUNE_AFTER_S` (another process may build from it now)."""
    import shutil
    import time

    _used.add(made)
    try:
        copies = [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)
                  and "." not in e.name]
    except OSError:
        return
    if len(copies) <= MAX_COPIES:
        return
    copies.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime, reverse=True)
    old = time.time() - PRUNE_AFTER_S
    for entry in copies[MAX_COPIES:]:
        if entry.path != made and entry.stat(follow_symlinks=False).st_mtime < old:
            stale = f"{entry.path}.{os.getpid()}.stale"  # out of the way first: whole or not
            try:
                os.rename(entry.path, stale)
            except OSError:
                continue
            shutil.rmtree(stale, ignore_errors=True)


def _stamps(top: str) -> tuple | None:
    """``(relative path, (device, inode, size, mtime, ctime))`` of everything below ``top``:
    what tells a changed file or directory from the one read before, without reading it;
    None for a tree too large to copy (it is not walked further)."""
    from ..digests import stamp

    out = []
    for here, dirs, names in os.walk(top, onerror=_raise):
        for name in dirs + names:
            path = os.path.join(here, name)
            out.append((os.path.relpath(path, top), stamp(os.lstat(path))))
        if len(out) > 2 * MAX_FILES:
            return None
    return tuple(sorted(out))


def _intact(target: str, files: list[tuple[str, bytes]]) -> bool:
    try:
        return files_of(target) == files
    except OSError:
        return False


def _write(root: str, target: str, files: list[tuple[str, bytes]]) -> None:
    """Write ``files`` under a temporary name in ``root``, then rename it to ``target``.
    Where ``target`` exists (another process made it meanwhile, as processes starting
    together do: kept, since its builds read it), it is replaced only when it is not
    intact (a copy changed since: moved aside, then removed)."""
    import shutil

    from ...dirs import make_private_dir

    make_private_dir(root)  # and the cache's own directories, 0700 whatever the umask
    temp = f"{target}.{os.getpid()}.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    os.mkdir(temp, 0o700)
    try:
        for rel, content in files:
            path = os.path.join(temp, rel)
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(path, "xb") as f:
                f.write(content)
        try:
            os.rename(temp, target)
            return
        except OSError:
            if _intact(target, files):
                return  # made by another process: the same files
        stale = f"{target}.{os.getpid()}.stale"
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
        os.rename(temp, target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def rewritten(options: bytes, dirs: list[str], root: str, headers, source: str) -> bytes | None:
    """``options`` with each of ``dirs`` (temporary include directories, as written) given
    as its copy in ``root``; None where a faithful rewrite cannot be made (then the build
    runs as asked)."""
    from ..cloptions import compiler_tokens

    if any(m.decode() in source for m in PATH_MACROS):
        return None
    if any(".." in label or label.lstrip("+").startswith("/") for label, _ in headers):
        return None
    tokens = compiler_tokens(options.decode("utf-8", "surrogateescape"))
    if any(alt is not None for _, alt in tokens):
        return None
    copies: dict[str, str | None] = {}
    out, i = [], 0
    while i < len(tokens):
        tok = tokens[i][0]
        flag = next((f for f in _FLAGS if tok.startswith(f)), None)
        apart = tok == flag and i + 1 < len(tokens)  # "-I dir", else "-Idir"
        value = tokens[i + 1][0] if apart else tok[len(flag):] if flag else None
        if value and value in dirs:
            if value not in copies:
                copies[value] = copy_of(value, root)
            if copies[value] is None:
                return None
            out += [flag, copies[value]]
            i += 2 if apart else 1
            continue
        out.append(tok)
        i += 1
    return " ".join(out).encode("utf-8", "surrogateescape")

"""A Triton kernel's artifact group as one kdb entry, and the files Triton reads it from.

Triton compiles a kernel into a group of files (its metadata JSON, the IR of each stage, the
cubin or hsaco) and later reads them by path. kdb stores the whole group as one binary
(:func:`pack`: deterministic, so a system pack is byte-reproducible) and, on a hit, writes
only that kernel's files into a directory private to this process (:func:`write_files`), on
a memory file system where there is one, removed at exit; it is made only where nobody else
can change it, or rename it away between kdb's write and Triton's read. A thousand cached
kernels are one SQLite file per arch, not a thousand directories.
"""

from __future__ import annotations

import errno
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
        # Triton loads a group's metadata as JSON with no check of its own: a group whose
        # metadata is not JSON crashed every later process it was served to.
        if any(not isinstance(json.loads(data), dict) for name, data in files.items()
               if name.endswith(".json")):
            return None
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    return files if at == len(blob) else None


def _plain_name(name: object) -> bool:
    """A file name Triton makes: no directory part, nothing hidden."""
    return (isinstance(name, str) and bool(name) and os.sep not in name and "/" not in name
            and not name.startswith(".") and "\0" not in name)


# -- this process's files ---------------------------------------------------------------------

#: [pid, path, descriptor, on the temporary directory] of this process's private directory.
_root: list = []
#: The same, for host modules, where :data:`_root`'s file system is mounted ``noexec``.
_exec_root: list = []
#: (pid, path) of every private directory made, removed at exit by the process that made it.
_made: list = []


def private_dir(key: str, root: list | None = None) -> str:
    """``<runtime dir>/kdb-triton-<uid>-<pid>-XXXX/<key>``: made 0700 by ``mkdtemp`` (a name
    nobody can plant in advance) in a directory nobody else can change, per process,
    removed at exit. ``root``: :data:`_root` (the default) or :data:`_exec_root`."""
    root = _root if root is None else root
    if not _plain_name(key):
        raise OSError(errno.EINVAL, f"not a Triton cache key: {key!r}")
    if not root or root[0] != os.getpid():
        _new_root(runtime_dirs() if root is _root else _exec_bases(), root)
    try:
        os.mkdir(key, 0o700, dir_fd=root[2])
    except FileExistsError:
        pass
    return os.path.join(root[1], key)


def _noexec(path: str) -> bool:
    """Whether the file system of ``path`` is mounted ``noexec`` (a container's ``/dev/shm``
    usually is): a C extension written there cannot be loaded."""
    try:
        return bool(os.statvfs(path).f_flag & getattr(os, "ST_NOEXEC", 0))
    except OSError:
        return True


def _exec_bases() -> list[str]:
    return [d for d in runtime_dirs() if not _noexec(d)]


def _loadable_root() -> list:
    """The private directory for files the process will load as code (Triton's host
    modules): :data:`_root` unless its file system is ``noexec``, else one of its own."""
    if not _root or _root[0] != os.getpid():
        _new_root(runtime_dirs(), _root)
    if not _noexec(_root[1]):
        return _root
    return _exec_root


def _new_root(bases: list[str], root: list | None = None) -> None:
    """A private directory in the first of ``bases`` that nobody else can change (a refused
    one warns once), checked on its descriptor: this user's and private, not a link; its
    ``[pid, path, descriptor, on the temporary directory]`` into ``root`` (:data:`_root`)."""
    from ...file import fs

    root = _root if root is None else root
    uid = os.getuid() if hasattr(os, "getuid") else 0
    if root:
        os.close(root[2])  # a full one's, or the parent's (inherited by this forked child)
    root[:] = []
    failed: OSError | None = None
    for base in bases:
        bad = fs.unsafe_above(os.path.join(base, "kdb-triton"))  # the base and those above
        if bad is not None:
            _refuse(base, *bad)
            continue
        remove_stale(base, uid)
        try:
            path = tempfile.mkdtemp(prefix=f"kdb-triton-{uid}-{os.getpid()}-", dir=base)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:  # a read-only or full one: the next
            failed = err
            continue
        why = fs.stat_problem(os.fstat(fd))
        if why is None:
            _hold(fd)
            root[:] = [os.getpid(), path, fd, base == tempfile.gettempdir()]
            _made.append((os.getpid(), path))
            return
        os.close(fd)
        _refuse(path, path, why)
    raise OSError(errno.EACCES, "no directory nobody else can change for Triton's files in "
                  f"{', '.join(bases)}" + (f" ({failed})" if failed else ""))


def _hold(fd: int) -> None:
    """A shared ``flock`` on the private directory, held while this process (or a child it
    forked) lives: a sweeper that cannot see our pid (another PID namespace sharing
    ``/dev/shm``: a container run with ``--ipc=host``) still sees the directory in use."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        pass  # a file system without flock: the pid alone says whether it is in use


def _in_use(path: str) -> bool:
    """Whether a live process holds ``path``'s lock (:func:`_hold`), in any PID namespace."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True  # gone, or not ours to judge: left alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _refuse(base: str, where: str, why: str) -> None:
    from ... import faults

    where = "" if where == base else where + ": "
    faults.fault(f"{base} is refused for Triton's files: {where}{why}, so another user could "
                 "swap the kernels this process loads; another directory is used. Set "
                 "XDG_RUNTIME_DIR to a directory of your own (after su or sudo -E it is still "
                 "the other user's)", once="triton-runtime:" + base)


def write_files(key: str, files: dict[str, bytes], loadable: bool = False) -> dict[str, str]:
    """Write ``files`` for Triton to read; ``{file name: path}``. A memory file system that is
    full (a container's 64 MB ``/dev/shm``) moves this process's files to the temporary
    directory, with one warning; a second failure raises :class:`OSError`. ``loadable``:
    the files are C extensions Triton will load, written where the file system allows it."""
    root = _loadable_root() if loadable else _root
    try:
        return _write(private_dir(key, root), files)
    except OSError as err:
        if root and root[0] == os.getpid() and not root[3]:
            from ... import faults

            faults.fault(f"cannot write Triton's files under {os.path.dirname(root[1])} "
                         f"({err}); using {tempfile.gettempdir()} instead",
                         once="triton-runtime-dir")
            _new_root([tempfile.gettempdir()], root)
            return _write(private_dir(key, root), files)
        raise


def runtime_dirs() -> list[str]:
    """Where the files may go, best first: a memory file system when there is one
    (``XDG_RUNTIME_DIR``, else ``/dev/shm``), then the temporary directory. On this machine
    writing a kernel's seven files took 0.25 ms each in ``/tmp`` and 0.014 ms in
    ``/dev/shm``. Which of them nobody else can change is :func:`_new_root`'s to judge."""
    found = [d for d in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm")
             if d and os.path.isabs(d) and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK)]
    return [*dict.fromkeys([*found, tempfile.gettempdir()])]


def remove_stale(base: str, uid: int) -> None:
    """Remove this user's directories left by processes that died without their exit hooks
    (a kill): their names carry the pid, and no process holds their lock (:func:`_hold`; a
    pid this process cannot see may live in another PID namespace)."""
    prefix = f"kdb-triton-{uid}-"
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].partition("-")[0]
        if not pid.isdigit() or lifecycle.alive(pid):
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == uid and os.path.isdir(path) and not os.path.islink(path) \
                and not _in_use(path):
            shutil.rmtree(path, ignore_errors=True)


def _write(directory: str, files: dict[str, bytes]) -> dict[str, str]:
    """Written in place (the directory is this process's alone: a write and a rename each
    cost ~30% more), through a descriptor of the directory checked to be this user's and
    private, so no name on the way can lead the files elsewhere."""
    from ...file import fs

    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        why = fs.stat_problem(os.fstat(dfd))
        if why is not None:
            raise OSError(errno.EPERM, f"{directory} is not this process's own: {why}")
        paths = {}
        for name, data in files.items():
            paths[name] = os.path.join(directory, name)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    return paths


def _remove_at_exit() -> None:
    for pid, path in _made:
        if pid == os.getpid():
            shutil.rmtree(path, ignore_errors=True)


lifecycle.on_exit(lifecycle.REPORT, _remove_at_exit)

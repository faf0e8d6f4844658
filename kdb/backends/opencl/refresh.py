"""Stored PoCL binaries that carry the work-group code their programs generated after the store.

A PoCL binary holds the program's ``program.bc`` and, per kernel, every file of the kernel's
directory in PoCL's cache when it was read: the work-group functions of the launches made so
far, one ``<kernel>/<local size>[-goffs0][-smallgrid]/<kernel>.so`` each (PoCL 3.0,
``pocl_binary_serialize``). A launch with a local size no stored function has generates one
(``pocl_check_kernel_disk_cache`` -> ``llvm_codegen``), on every fresh machine. The store
worker reads a program's binaries about a second after its build, before most launches, so
this module tops the stored binaries up later, off the critical path:

- a process notes the PoCL programs it built (:func:`compiled`) or loaded from a writable
  tier (:func:`loaded`: a few microseconds on a hit), and at exit sends the store worker one
  *refresh* job naming those that may have generated code since: every program it compiled,
  and every loaded one whose kernel directories changed after its load (a ``scandir`` and a
  ``stat`` per kernel);
- the worker (:func:`refresh_job`, after every job queued before it is stored) compares, per
  entry, the files its binary carries with the work-group functions in PoCL's cache
  directory named by the binary's own build hash, and appends those it lacks
  (:func:`kdb.backends.opencl.poclbin.with_files`): no rebuild, no OpenCL.

Bounded: a refreshed binary is the old one byte for byte plus files, so never smaller and
never missing what the old one carried; an entry is refreshed at most :data:`MAX_REFRESHES`
times (its ``details`` count them); the files come only from the directory of the stored
binary's build hash (the same source, options, device and PoCL), and the entry is replaced
only while it is still the binary that was read (a compare on its checksum), so a binary of
another key, or a newer store, is never replaced. Signed entries, system files and the
shared tier are left as they are; binaries of other PoCL versions (layouts other than 8) and
of other drivers are final code and never change.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from ... import config, lifecycle
from .poclbin import (  # noqa: F401 - pocl_cache_dir: named here too
    MAX_BINARY, build_hash_of, kernel_cache_off, layout, pocl_cache_dir, version_8, with_files)

#: An entry is refreshed at most this many times (later launches generate, as without kdb).
MAX_REFRESHES = 3
#: A kernel directory whose mtime is this close to, or after, a program's load counts as
#: changed since: directory times come from a coarse clock, and a false alarm costs the
#: worker one comparison, a missed one a refresh.
MARGIN_NS = 2_000_000_000
#: What a refresh may cost the worker's lane per entry before the job is set aside as slow.
SECONDS_PER_ENTRY = 0.05

_loaded: dict[tuple, tuple] = {}  # (tiers, key) -> (arch, build hash as in the binary, ns)
_compiled: dict[tuple, str] = {}  # (tiers, key) -> arch


def loaded(tiers, attrs, hits) -> None:
    """Note the programs a hit loaded from PoCL binaries of a tier kdb may write (on the
    hit path: a compare or two per device)."""
    for a, h in zip(attrs, hits):
        b = h.binary
        if h.tier != "system" and version_8(b):
            _loaded.setdefault((tiers, a.key), (a.arch, b[32:73], time.time_ns()))


def compiled(tiers, attrs) -> None:
    """Note PoCL programs this process compiled and handed to the store worker."""
    for a in attrs:
        if a.arch.startswith("pocl-"):
            _compiled[(tiers, a.key)] = a.arch


def trusted_top(top: str) -> bool:
    """Whether PoCL's cache directory ``top`` is this user's alone, as is every directory
    above it: files read from it are served, files put back there are loaded."""
    from ...file import fs

    return _ours(Path(top), os.getuid(), stat.S_ISDIR) and fs.unsafe_above(top) is None


def _changed_since(directory: str, since_ns: int) -> bool:
    """Whether a kernel directory of the program directory ``directory`` changed (a work-group
    function was added) at or after ``since_ns``."""
    try:
        entries = os.scandir(directory)
    except OSError:
        return False
    with entries:
        for e in entries:
            try:
                if (e.is_dir(follow_symlinks=False)
                        and e.stat(follow_symlinks=False).st_mtime_ns >= since_ns):
                    return True
            except OSError:
                continue
    return False


def _at_exit() -> None:
    """Send the store worker one refresh job per cache with what may have grown."""
    if (not (_loaded or _compiled) or kernel_cache_off() or config.store_at_exit() != "detach"
            or config.flag(config.ENV_DISABLE_REFRESH)):
        return
    top = os.path.abspath(pocl_cache_dir())  # the worker runs in /
    wanted: dict[object, dict[str, str]] = {}
    for (tiers, key), (arch, field, ns) in _loaded.items():
        name = build_hash_of(field)
        if name is not None and _changed_since(os.path.join(top, name), ns - MARGIN_NS):
            wanted.setdefault(tiers, {})[key] = arch
    for (tiers, key), arch in _compiled.items():
        wanted.setdefault(tiers, {})[key] = arch
    if not wanted:
        return
    from ...storing.jobs import REFRESH, StoreJob
    from .keys import BACKEND

    for tiers, entries in wanted.items():
        rows = sorted([arch, key] for key, arch in entries.items())
        tiers.storing.spool(StoreJob(kind=REFRESH, backend=BACKEND,
                                     seconds=SECONDS_PER_ENTRY * len(rows),
                                     extra={"refresh": {"pocl_cache": top, "entries": rows}}))


def _forget() -> None:
    _loaded.clear()
    _compiled.clear()


lifecycle.on_exit(lifecycle.REPORT, _at_exit)
lifecycle.on_fork(_forget)


# -- the store worker's half -------------------------------------------------------------------

def refresh_job(db, job) -> list[str]:
    """Refresh the entries a refresh job names; one line for the worker's log per entry
    refreshed or refused."""
    spec = job.extra.get("refresh")
    if not (isinstance(spec, dict) and isinstance(spec.get("pocl_cache"), str)
            and isinstance(spec.get("entries"), list)):
        raise ValueError("a refresh job needs 'refresh': {'pocl_cache': str, 'entries': list}")
    top = Path(spec["pocl_cache"])
    lines = []
    for row in spec["entries"]:
        if not (isinstance(row, list) and len(row) == 2 and all(isinstance(x, str) for x in row)):
            raise ValueError(f"a refresh job's entry is [arch, key], not {row!r:.60}")
        arch, key = row
        line = refresh_entry(db.tiers.user_file(arch), top, key)
        if line:
            lines.append(line)
    return lines


def refresh_entry(f, top: Path, key: str) -> str | None:
    """Append to ``key``'s binary in the user file ``f`` the work-group functions PoCL's cache
    ``top`` holds for its program and it lacks; what was done, or None when nothing was."""
    import json
    import sqlite3

    from ...file import codec
    from ...file.filewriter import replace_binary

    try:
        rows = f.query("SELECT codec, blob, raw_size, checksum, details, signature, name "
                       "FROM kernels WHERE key = ?", (key,))
    except sqlite3.Error:
        return None
    if not rows or rows[0][5] is not None:  # not stored (dropped), or signed
        return None
    kind, blob, raw_size, checksum, details_text, _, name = rows[0]
    try:
        details = json.loads(details_text) if isinstance(details_text, str) else {}
    except ValueError:
        details = {}
    done = details.get("refreshes", 0) if isinstance(details, dict) else MAX_REFRESHES
    if not isinstance(done, int) or done >= MAX_REFRESHES:
        return None
    raw = codec.decode(kind, blob, raw_size, checksum)
    found = layout(raw) if raw is not None else None
    if found is None:
        return None
    added = new_functions(top / found.build_hash, found)
    if not added:
        return None
    new = with_files(raw, found, added)
    if len(new) > MAX_BINARY or not _superset(raw, found, new):
        return f"{name or key[:16]}: not refreshed: the binary would not hold what it held"
    details["refreshes"] = done + 1
    if not replace_binary(f, key, checksum, new, details):
        return None  # stored again or refreshed by another process meanwhile
    count = sum(len(v) for v in added.values())
    return (f"refreshed {name or 'kernel'} {key[:16]}: {count} work-group function(s) its "
            f"program generated after the store ({len(raw)} -> {len(new)} bytes, refresh "
            f"{done + 1} of {MAX_REFRESHES})")


def _superset(old: bytes, found, new: bytes) -> bool:
    """The refreshed binary keeps the old one's header, program and every file, and grew."""
    again = layout(new)
    start = found.kernels[0].offset if found.kernels else len(old)
    return (again is not None and len(new) > len(old) and new[:start] == old[:start]
            and [k.name for k in again.kernels] == [k.name for k in found.kernels]
            and all(set(a.files) <= set(b.files) for a, b in zip(found.kernels, again.kernels)))


def new_functions(program_dir: Path, found) -> dict[str, list[tuple[str, bytes]]]:
    """Per kernel, the work-group functions in ``program_dir`` (PoCL's directory of the
    binary's build hash) that the binary does not carry: ``(path as PoCL stores it,
    content)``. Only files this user alone can write, of PoCL's own names."""
    from ...file import fs

    me = os.getuid()
    out: dict[str, list[tuple[str, bytes]]] = {}
    if not _ours(program_dir, me, stat.S_ISDIR) or fs.unsafe_above(program_dir) is not None:
        return out
    for k in found.kernels:
        if not (k.name.isascii() and k.name.isidentifier()):
            continue
        kernel_dir = program_dir / k.name
        if not _ours(kernel_dir, me, stat.S_ISDIR):
            continue
        try:
            variants = sorted(os.listdir(kernel_dir))
        except OSError:
            continue
        have = set(k.files)
        for v in variants:
            path = f"/{k.name}/{v}/{k.name}.so"
            if path in have or not variant(v):
                continue
            content = read_owned(kernel_dir / v, f"{k.name}.so", me)
            if content:
                out.setdefault(k.name, []).append((path, content))
    return out


def variant(name: str) -> bool:
    """A work-group function's directory name as PoCL 3.0 makes it
    (``pocl_cache_kernel_cachedir_path``): ``X-Y-Z``, then ``-goffs0``, then ``-smallgrid``.

    >>> [variant(n) for n in ("16-1-1-goffs0-smallgrid", "0-0-0", "16-1", "a-1-1", "1-1-1-x")]
    [True, True, False, False, False]
    """
    parts = name.split("-")
    if len(parts) < 3 or not all(p.isdigit() and p.isascii() for p in parts[:3]):
        return False
    rest = parts[3:]
    return rest in ([], ["goffs0"], ["smallgrid"], ["goffs0", "smallgrid"])


def _ours(path: Path, me: int, kind) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return kind(st.st_mode) and st.st_uid == me and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def read_owned(directory: Path, name: str, me: int) -> bytes | None:
    """The file ``name`` of ``directory`` when both are this user's alone and it is a regular
    file (PoCL renames a finished function into place: never a half-written one)."""
    if not _ours(directory, me, stat.S_ISDIR):
        return None
    try:
        fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not (stat.S_ISREG(st.st_mode) and st.st_uid == me
                and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)) or st.st_size > MAX_BINARY:
            return None
        return fh.read()

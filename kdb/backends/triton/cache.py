"""Triton's compiled-kernel cache, backed by kdb: ``TRITON_CACHE_MANAGER=kdb.triton:CacheManager``.

Triton makes one manager per compile, keyed by its own cache key (a digest of the kernel's
source, its specialization, the options, the target, Triton's own code and the environment
variables that change the output), and asks it for the kernel's group of files
(:meth:`CacheManager.get_group`). Here that is one kdb lookup: the system tiers of the
target's arch, the user tier, the shared tier when set. A miss claims the key (so that of many
processes compiling the same kernel one compiles and the others wait for its entry), Triton
compiles and writes its files through :meth:`~CacheManager.put`, and
:meth:`~CacheManager.put_group` stores the group as one zstd-compressed entry, off the
critical path.

A manager whose first call is ``get_file`` of a C extension is for one of Triton's host
modules (its driver's utilities, a launcher: :mod:`.hostmods`), one kdb entry too. Anything
else Triton caches outside a kernel's group (autotuning results) goes to Triton's own file
cache, as Triton would.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time

from triton.runtime.cache import CacheManager as _TritonCacheManager
from triton.runtime.cache import FileCacheManager

from ... import faults, logs
from ...claims import Claim
from ...db import default_db
from ...keys import HashAttributes
from ...tiers import Hit
from ..common import inductor_caches_off
from . import groups, hostmods
from .targets import BACKEND, arch_of, compiler_identity, current_arch, lookup_archs

log = logs.get("kdb")

#: The arch of a claim made before the target is known (its key is Triton's, all the same).
ANY_ARCH = "triton"

#: Claims this process holds for kernels it is compiling: key -> (claim, start time, thread).
_compiling: dict[str, tuple] = {}
#: The arches that served this process's kernels while the target was unknown, looked in first:
#: a warm start of a program that compiles for one target lists no directory per kernel.
_served_from: list[str] = []


def _release_failed() -> None:
    """Triton compiles on the thread that asked for the group, from ``get_group`` to
    ``put_group``; a claim of this thread still here when it asks again is a compile that
    raised: release it, or other processes would wait ``KDB_WAIT_TIMEOUT`` for nothing."""
    me = threading.get_ident()
    for key in [k for k, v in list(_compiling.items()) if v[2] == me]:
        claim = _compiling.pop(key, (None,))[0]
        if claim is not None:
            claim.release()


def _unknown_arch_order(tiers, name: str):
    """The arches to look in while the target is unknown: those that served this process
    first, then the others (listed only if those missed)."""
    tried = tuple(_served_from)
    yield from tried
    yield from (a for a in lookup_archs(tiers, name) if a not in tried)


_db: contextvars.ContextVar = contextvars.ContextVar("kdb_triton_db", default=None)


@contextlib.contextmanager
def storing_into(db):
    """Within this block Triton's kernels are looked up in and stored into ``db`` (a
    :class:`kdb.KernelDB`; ``kdb pack``'s scratch database) instead of the default one."""
    token = _db.set(db)
    try:
        yield
    finally:
        _db.reset(token)


def _tiers():
    db = _db.get()
    return (db if db is not None else default_db()).tiers


class CacheManager(_TritonCacheManager):
    """kdb as Triton's cache manager (see the module's docstring)."""

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self.key = key
        self._files = FileCacheManager(key, override=True) if override else None
        self._dump = FileCacheManager(key, dump=True) if dump else None
        self._kernel: bool | None = None  # None until the first call says which kind
        if self._files is None and inductor_caches_off():  # Inductor's fresh directory
            self._files, self._kernel = FileCacheManager(key), False
        self._written: dict[str, tuple[str, bytes]] = {}  # name -> (path, bytes) written
        self._arch: str | None = None
        self._host: hostmods.HostModule | None = None

    # -- Triton's file cache, for what is not a kernel's group ------------------------------

    def _triton_files(self) -> FileCacheManager:
        if self._files is None:
            self._files = FileCacheManager(self.key)
        return self._files

    def _plain(self) -> FileCacheManager | None:
        """Triton's own cache for this manager, if it is not a kernel's (or a dump, override)."""
        if self._dump is not None:
            return self._dump
        if self._kernel is None:
            self._kernel = False
        return None if self._kernel else self._triton_files()

    def get_file(self, filename: str) -> str | None:
        if self._kernel is None and self._dump is None and self._files is None \
                and hostmods.module_name(filename) is not None:
            self._kernel = False
            self._host = hostmods.HostModule(self.key, filename, _tiers())
            return self._host.get()
        if self._host is not None and filename == self._host.filename:
            return None  # asked again: Triton builds it
        plain = self._plain()
        if plain is not None:
            return plain.get_file(filename)
        return self._written.get(filename, (None,))[0]

    def put(self, data, filename: str, binary: bool = True) -> str:
        if self._host is not None and filename == self._host.filename:
            raw = data if isinstance(data, bytes) else str(data).encode("utf-8")
            try:
                return self._host.put(raw)
            except OSError as err:  # nowhere to write it: Triton's own cache, as without kdb
                faults.fault(f"cannot write Triton's host module {filename} ({err}); it goes "
                             "to Triton's cache", once="triton-host-files")
                return self._triton_files().put(data, filename, binary)
        plain = self._plain()
        if plain is not None:
            return plain.put(data, filename, binary)
        raw = data if isinstance(data, bytes) else str(data).encode("utf-8")
        path = groups.write_files(self.key, {filename: raw})[filename]
        self._written[filename] = (path, raw)
        return path

    # -- a kernel's group: one kdb entry ----------------------------------------------------

    def get_group(self, filename: str) -> dict[str, str] | None:
        if self._dump is not None:
            return self._dump.get_group(filename)
        if self._kernel is False:
            return self._triton_files().get_group(filename)
        self._kernel = True
        name = filename.rpartition(".")[0] or filename
        _release_failed()
        tiers = _tiers()
        arch = self._arch = current_arch()
        if arch is not None:
            hostmods.flush(arch)
        got = self._find(tiers, name, arch)
        if got is not None:
            return got
        old = _compiling.pop(self.key, None)
        if old is not None:  # another thread's compile of this key failed
            old[0].release()
        if arch is not None:
            attrs = self._attrs(arch, name)
            claimed = tiers.claim_or_wait(attrs)
            if isinstance(claimed, Hit):
                return self._served(tiers, attrs, claimed)
        else:
            # No target known before the compile: the claim is Triton's key under a name of
            # its own, and a waiter looks for the kernel's files in every arch it can find.
            claimed = tiers.claim_or_wait(self._attrs(ANY_ARCH, name),
                                          find=lambda: self._find(tiers, name, None))
            if isinstance(claimed, dict):
                return claimed
        if isinstance(claimed, Claim):
            _compiling[self.key] = (claimed, time.perf_counter(), threading.get_ident())
        return None

    def _find(self, tiers, name: str, arch: str | None) -> dict[str, str] | None:
        """The kernel's files from the first tier that holds them, for ``arch`` (else for
        the arches that served this process before, then every other arch
        :func:`~.targets.lookup_archs` names). The key holds Triton's, which holds the target,
        so a kernel looked up under another arch is a miss, never another target's files."""
        for a in [arch] if arch is not None else _unknown_arch_order(tiers, name):
            attrs = self._attrs(a, name)
            hit = tiers.lookup(attrs, count_miss=arch is not None)
            if hit is not None:
                got = self._served(tiers, attrs, hit)
                if got is not None:
                    if arch is None and a not in _served_from:
                        _served_from.append(a)
                        tiers.system_files(a)  # an arch it uses: none there is said now
                    return got
        return None

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        if self._dump is not None:
            return self._dump.put_group(filename, group)
        if self._kernel is False:
            return self._triton_files().put_group(filename, group)
        name = filename.rpartition(".")[0] or filename
        claim, start, _ = _compiling.pop(self.key, (None, None, None))
        if _overriding():  # a stage may come from TRITON_OVERRIDE_DIR, which no key holds:
            if claim is not None:  # Triton's own cache keeps it, as without kdb; kdb's
                claim.release()    # tiers would serve it on, to processes without it
            log.info("kdb: Triton kernel %s not stored: TRITON_KERNEL_OVERRIDE is on", name)
            return self._triton_files().put_group(filename, group)
        try:
            files = {n: _read(p) for n, p in group.items()}
            changed = [n for n, p in group.items() if self._written.get(n) != (p, files[n])]
            target = json.loads(files[filename]).get("target") or {}
            arch = arch_of(target.get("backend"), target.get("arch"))
        except (OSError, KeyError, ValueError, TypeError, AttributeError) as err:
            log.warning("kdb: Triton kernel %s not stored: its files cannot be read (%s)",
                        name, err)
            changed = None
        if changed:  # read back, they must be what this compile wrote
            faults.fault(f"Triton kernel {name} not stored: {', '.join(sorted(changed))} in "
                         f"{os.path.dirname(group[changed[0]])} changed after kdb wrote it "
                         "(someone else can write there?)", once="triton-changed")
        if changed or changed is None:
            if claim is not None:
                claim.release()
            return filename
        tiers = _tiers()
        hostmods.flush(self._arch or arch)
        attrs = self._attrs(arch, name)
        if claim is not None and self._arch is not None and arch != self._arch:
            claim.release()  # the device's arch is not the target's: nobody waits on this
            claim = None
        seconds = time.perf_counter() - start if start is not None else 0.0
        blob = groups.pack(files)
        if self._arch is None:  # looked up in every arch, each uncounted: one miss, here
            tiers.count(arch, "misses", 1)
            tiers.system_files(arch)  # and none there is said for the arch it compiled for
        rec = tiers.record_compile(attrs, seconds)
        tiers.storing.put_later(attrs, lambda: blob, compile_seconds=seconds,
                                details={"target": target, "files": sorted(files)}, log=rec,
                                claim=claim)
        return filename

    # -- helpers --------------------------------------------------------------------------

    def _attrs(self, arch: str, name: str) -> HashAttributes:
        return HashAttributes(backend=BACKEND, source=self.key, arch=arch,
                              compiler=compiler_identity(), name=name)

    def _served(self, tiers, attrs: HashAttributes, hit: Hit) -> dict[str, str] | None:
        files = groups.unpack(hit.binary)
        if files is None:
            tiers.storing.discard(attrs, "not a Triton artifact group", hit.tier)
            return None
        try:
            return groups.write_files(self.key, files)
        except OSError as err:  # no room anywhere: Triton compiles, as without kdb
            faults.fault(f"cannot write Triton's files for {attrs.name} ({err}); compiling it",
                         once="triton-files")
            return None


def _overriding() -> bool:
    """Whether Triton builds this process's kernels with ``TRITON_KERNEL_OVERRIDE`` on."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "compilation"):
        return bool(getattr(knobs.compilation, "override", False))
    return os.environ.get("TRITON_KERNEL_OVERRIDE", "0") not in ("", "0")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()

"""Triton's host modules in kdb: the C extensions Triton builds with the host's C compiler.

Triton builds its driver's utilities (``cuda_utils``, ``hip_utils``) at start-up and, up to
3.6, a launcher (``__triton_launcher``) per kernel signature, each through a cache manager
keyed by a digest of the C source (and, from 3.3, the platform; from 3.8, the build's
options): the manager's first call is ``get_file("<name><EXT_SUFFIX>")`` (``<name>.so``
before 3.4), then ``put`` of the module Triton built. Triton loads the file by path.

kdb keys a module by Triton's key and the file name, with what makes a C extension loadable
in the compiler identity: Triton's version, the Python (``cache_tag``, ``EXT_SUFFIX``, which
names the ABI), the platform and the C library. A module built by another Python is a miss
that ``kdb explain`` names. A module is stored under the device's arch, so a pack of that
arch carries it; Triton builds ``cuda_utils`` while it makes its driver, before kdb may ask
the device, so a module built then is looked up in every Triton arch kdb has a file for and
stored once the arch is known (the process's first kernel). A served module is written to
the process's private directory under the file name Triton asked for, after the tier's
checksum and this module's own check of the packed bytes; one that fails either is dropped,
and Triton builds it again.
"""

from __future__ import annotations

import os
import sysconfig
import time

from ... import faults, logs
from ...keys import HashAttributes
from .. import stdlibs
from . import groups
from .targets import BACKEND, compiler_identity, known_arch, lookup_archs

log = logs.get("kdb")

#: The first bytes of a shared object Triton loads (Linux, the platform Triton ships for).
ELF = b"\x7fELF"


def module_name(filename: str) -> str | None:
    """The module a host-module file name is for (``cuda_utils`` for
    ``cuda_utils.cpython-312-x86_64-linux-gnu.so`` or ``cuda_utils.so``), else None.

    >>> module_name("__triton_launcher.so"), module_name("add.json")
    ('__triton_launcher', None)
    """
    for suffix in (sysconfig.get_config_var("EXT_SUFFIX") or ".so", ".so"):
        if filename.endswith(suffix) and len(filename) > len(suffix):
            name = filename[:-len(suffix)]
            return name if "/" not in name and os.sep not in name else None
    return None


def whole_elf(data: bytes) -> bool:
    """Whether ``data`` is a shared object that holds all it says it holds: an ELF header
    whose section header table (written last by the linker) ends within the bytes, so a
    module cut short anywhere is refused before anything loads it.

    >>> empty = b"\\x7fELF\\x02\\x01" + bytes(58)  # 64-bit, no section headers
    >>> whole_elf(empty), whole_elf(empty[:40]), whole_elf(b"MZ" + bytes(62))
    (True, False, False)
    """
    if len(data) < 64 or not data.startswith(ELF) or data[4] not in (1, 2):
        return False
    order = "little" if data[5] == 1 else "big"
    if data[4] == 2:  # 64-bit
        shoff, entsize, count = data[0x28:0x30], data[0x3A:0x3C], data[0x3C:0x3E]
    else:
        shoff, entsize, count = data[0x20:0x24], data[0x2E:0x30], data[0x30:0x32]
    end = int.from_bytes(shoff, order) + int.from_bytes(entsize, order) * int.from_bytes(
        count, order)
    return end <= len(data)


_identity: list = []


def host_identity() -> tuple[tuple[str, str], ...]:
    """What makes a C extension loadable here, beside the Python's ``cache_tag``: the
    extension suffix (the ABI tag: a debug or free-threaded build has its own), the platform
    and the C library it links against (a module built on a newer glibc may not load on an
    older one). Nothing machine-local: no path."""
    if not _identity:
        _identity.append((("ext_suffix", sysconfig.get_config_var("EXT_SUFFIX") or ""),
                          ("libc", stdlibs.libc()), ("platform", sysconfig.get_platform())))
    return _identity[0]


#: Modules built before the device's arch was known: stored by :func:`flush`.
_pending: list = []


class HostModule:
    """One host module, as one cache manager of Triton's sees it: :meth:`get` then, on a
    miss (or a served file Triton could not load), :meth:`put`."""

    def __init__(self, key: str, filename: str, tiers) -> None:
        self.key, self.filename, self.tiers = key, filename, tiers
        self.name = module_name(filename) or filename
        self._served = None  # (attrs, tier) of the entry a get served
        self._asked = time.perf_counter()
        self._uncounted = False  # a get's miss not counted yet (the arch was unknown)

    def attrs(self, arch: str) -> HashAttributes:
        return HashAttributes(backend=BACKEND, source=self.key, arch=arch,
                              internal_options=("host-module", self.filename),
                              compiler=compiler_identity() + host_identity(), name=self.name)

    def get(self) -> str | None:
        """The path of the module from the first tier that holds a sound copy, else None
        (Triton builds it)."""
        tiers = self.tiers
        arch = known_arch()
        self._uncounted = arch is None  # looked up in every arch: one miss, when stored
        for a in [arch] if arch is not None else lookup_archs(tiers, self.name):
            attrs = self.attrs(a)
            hit = tiers.lookup(attrs, count_miss=arch is not None)
            if hit is None:
                continue
            files = groups.unpack(hit.binary)
            data = files.get(self.filename) if files is not None and len(files) == 1 else None
            if data is None or not whole_elf(data):
                tiers.storing.discard(attrs, "not a whole Triton host module", hit.tier)
                continue
            try:
                path = groups.write_files(self.key, files, loadable=True)[self.filename]
            except OSError as err:
                faults.fault(f"cannot write Triton's host module {self.name} ({err}); Triton "
                             "builds it", once="triton-host-files")
                return None
            self._served = (attrs, hit.tier)
            return path
        self._asked = time.perf_counter()
        return None

    def put(self, data: bytes) -> str:
        """Store the module Triton built (under the device's arch, now or once it is known)
        and write it where Triton loads it; its path."""
        seconds = time.perf_counter() - self._asked
        if self._served is not None:  # Triton could not load what kdb served: rebuilt
            attrs, tier = self._served
            self.tiers.storing.discard(attrs, "Triton could not load the host module", tier)
            self._served = None
        path = groups.write_files(self.key, {self.filename: data}, loadable=True)[self.filename]
        if whole_elf(data):
            _pending.append((self, groups.pack({self.filename: data}), seconds))
            arch = known_arch()
            if arch is not None:
                flush(arch)
        return path


def flush(arch: str) -> None:
    """Store the host modules this process built, under ``arch`` (the device's)."""
    while _pending:
        module, blob, seconds = _pending.pop(0)
        tiers = module.tiers
        attrs = module.attrs(arch)
        if module._uncounted:
            tiers.count(arch, "misses", 1)
        rec = tiers.record_compile(attrs, seconds)
        tiers.storing.put_later(attrs, lambda blob=blob: blob, compile_seconds=seconds,
                                details={"host_module": module.filename}, log=rec)
        log.debug("kdb: Triton host module %s built in %.2f s, stored for %s", module.name,
                  seconds, arch)

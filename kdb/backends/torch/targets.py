"""What a torch.compile entry is for: the arch (the file it lives in) and the identity every
key carries (torch's version, the Python), read once per process."""

from __future__ import annotations

import functools
import platform
import sys

from ...keys import sha256

#: The ``backend`` of every torch.compile entry.
BACKEND = "torch"


@functools.lru_cache(maxsize=None)
def identity() -> tuple[tuple[str, str], ...]:
    """The compiler identity of every entry: torch's full version (``2.13.0+cpu``) and the
    Python's cache tag (``cpython-311``). Inductor's keys hold a digest of torch's own code
    already; the version is here so that ``kdb explain`` can say "another torch"."""
    import torch

    return (("torch", str(torch.__version__)), ("python", sys.implementation.cache_tag))


@functools.lru_cache(maxsize=None)
def host_arch() -> str:
    """The host CPU's class: what Inductor's ``-march=native`` builds for. The vendor, family
    and model, and a digest of the feature flags the kernel reports (a VM that hides AVX-512
    is another class), e.g. ``cpu-x86_64-authenticamd-25.17-1a2b3c4d``."""
    machine = (platform.machine() or "unknown").lower()
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                name, _, value = line.partition(":")
                fields[name.strip()] = value.strip()
    except OSError:
        pass
    vendor = fields.get("vendor_id") or fields.get("CPU implementer") or "unknown"
    model = ".".join(fields.get(k, "") for k in ("cpu family", "model", "CPU part")).strip(".")
    flags = fields.get("flags") or fields.get("Features") or ""
    digest = sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:8]
    return _clean(f"cpu-{machine}-{vendor}-{model or 'unknown'}-{digest}")


@functools.lru_cache(maxsize=None)
def device_arch() -> str:
    """The arch of this process's entries that are not host code (graphs, autotuning): the
    current GPU's (``sm_90``, ``gfx942``) where torch has one, else :func:`host_arch`."""
    import torch

    try:
        if torch.cuda.is_available():
            if getattr(torch.version, "hip", None):
                name = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName
                return _clean(name.split(":")[0])
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:  # noqa: BLE001 - no usable GPU: the host's class
        pass
    return host_arch()


@functools.lru_cache(maxsize=None)
def cxx_identity(compiler: str) -> str:
    """The C++ compiler Inductor runs (a name on ``PATH`` or a path): its kind and version,
    the C and C++ libraries it reads (which libstdc++ clang takes depends on the GCC
    installations there) and a digest of every macro it defines with them, worked out once
    per machine (:func:`kdb.backends.stdlibs.facts`); "" if it cannot be found."""
    import os
    import shutil

    from ... import config
    from .. import stdlibs

    found = shutil.which(compiler, path=_path())
    if found is None:
        return ""
    rec = stdlibs.facts(os.path.realpath(found), config.cache_root())
    return "; ".join((rec.get("version", ""), rec.get("stdlib", ""),
                      f"macros sha256:{rec.get('macros', '')}"))


def _path() -> str:
    import os

    return os.environ.get("PATH", "")


def _clean(arch: str) -> str:
    """A safe arch id: lower case, other characters as ``-``."""
    ok = "abcdefghijklmnopqrstuvwxyz0123456789_.+-"
    return "".join(c if c in ok else "-" for c in arch.lower())

"""OpenCL arch ids: the class of devices that can run one another's binaries.

An arch id names the user file and the system file a device reads (``<arch>.kdb``), so two
devices share an id only where a binary built on one runs on the other. For a CPU that is
the instruction set the compiler generated code for, which each implementation chooses its
own way (docs/tiers.md, "Arch ids"):

* PoCL says it in its device version (``HSTR: <device>-<triple>-<LLVM CPU>``): the id is
  the triple's architecture and the LLVM target CPU whole (``pocl-x86_64-skylake-avx512``).
* Intel's CPU runtime compiles for the CPU it runs on (its LLVM's host CPU and features)
  unless ``CL_CONFIG_CPU_TARGET_ARCH`` (variable, else ``cl.cfg`` beside its library) names
  a target; it says neither, so the id is that target, else the host's instruction-set
  features as the kernel reports them (``intel-cpu-x86_64-v4-<digest>``).
* Any other CPU OpenCL: the host's instruction-set features too, under its vendor's name.
"""

from __future__ import annotations

import functools
import platform as _platform
import re
from pathlib import Path

from ... import config

_SAFE_RE = re.compile(r"[^a-z0-9_.+-]+")
_HSTR_RE = re.compile(r"HSTR:\s*(\S+)")
# <device type>-<arch>-<vendor>-<os>[-<environment>]-<LLVM CPU>. The device type and the CPU
# may hold hyphens ("cpu-minimal", "skylake-avx512", "x86-64-v3"); the OS anchors the split.
_POCL_HSTR_RE = re.compile(
    r"^(?P<device>.+?)-(?P<arch>[a-z0-9_]+)-(?P<vendor>[a-z0-9_]+)-"
    r"(?:linux|darwin[\w.]*|macos[\w.]*|windows|freebsd[\w.]*|netbsd[\w.]*|openbsd[\w.]*)"
    r"(?:-(?:gnu\w*|musl\w*|android\w*|msvc|eabi\w*|elf|mingw\w*|cygnus))?-(?P<cpu>.+)$")

#: The ``/proc/cpuinfo`` flags that name instructions a compiler may emit (the rest are
#: about the machine: caches, virtualisation, power). Compiled at its first use (0.75 ms): a
#: PoCL device's id never needs it.
_ISA_FLAGS = (
    r"^(?:mmx\w*|sse\w*|ssse3|pni|avx\w*|amx\w*|fma4?|f16c|bmi[12]|abm|lzcnt|popcnt|movbe"
    r"|adx|aes|vaes|pclmulqdq|vpclmulqdq|gfni|sha\w*|sm[34]\w*|rdrand|rdseed|xsave\w*|cx8"
    r"|cx16|lahf_lm|cmov|fxsr|clflushopt|clwb|movdiri|movdir64b|serialize|prefetchw"
    r"|3dnowprefetch|rdpid|tbm|xop|cmpccxadd|apx\w*|waitpkg|wbnoinvd|cldemote|ptwrite"
    r"|fp|asimd\w*|sve\w*|atomics|crc32|pmull|sha[123]|sha512|dcpop|dcpodp|i8mm|bf16"
    r"|dotprod|fphp|jscvt|fcma|lrcpc|ilrcpc|flagm\w*|frint|rng|sb|ssbs|paca|pacg|mte\w*)$")
#: The x86-64 micro-architecture levels (the psABI's), as ``/proc/cpuinfo`` spells them.
_X86_LEVELS = (
    ("v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    ("v3", {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
    ("v2", {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"}),
)
_INTEL_TARGET = "CL_CONFIG_CPU_TARGET_ARCH"


def slug(text: str) -> str:
    """``text`` as arch-id characters.

    >>> slug("Intel(R) Corporation")
    'intel-r-corporation'
    """
    return _SAFE_RE.sub("-", text.lower()).strip("-._+") or "unknown"


def pocl_arch(hstr: str) -> str:
    """The arch id of a PoCL device from its ``HSTR``: the triple's architecture and the
    LLVM target CPU whole; the whole string where it does not parse (a finer class: a miss
    at worst, never another CPU's binary).

    >>> pocl_arch("pthread-x86_64-unknown-linux-gnu-znver3")
    'pocl-x86_64-znver3'
    >>> pocl_arch("pthread-x86_64-pc-linux-gnu-skylake-avx512")
    'pocl-x86_64-skylake-avx512'
    >>> pocl_arch("cpu-minimal-aarch64-unknown-linux-gnu-cortex-a72")
    'pocl-aarch64-cortex-a72'
    >>> pocl_arch("pthread-weird")
    'pocl-pthread-weird'
    """
    m = _POCL_HSTR_RE.match(hstr.lower())
    if m is None:
        return config.check_arch(slug("pocl-" + hstr))
    return config.check_arch(slug(f"pocl-{m['arch']}-{m['cpu']}"))


def isa_class(flags: set[str], machine: str) -> str:
    """``<machine>[-<x86-64 level>]-<digest>``: the instruction sets a compiler targeting
    this host may use. The level is for people; the digest of the flags is the class.

    >>> isa_class({"sse2", "avx", "avx2", "constant_tsc"}, "x86_64")
    'x86_64-v1-b9c3012b'
    """
    import hashlib  # not PoCL's id: `import kdb.opencl` does not load it (docs/figures.md)

    isa_flag = re.compile(_ISA_FLAGS).match  # re's own cache keeps it after the first call
    isa = sorted(f for f in flags if isa_flag(f))
    digest = hashlib.sha256(" ".join(isa).encode()).hexdigest()[:8]
    if machine in ("x86_64", "amd64"):
        level = next((name for name, need in _X86_LEVELS
                      if need <= flags and _lower_levels_met(name, flags)), "v1")
        return f"x86_64-{level}-{digest}"
    return f"{slug(machine)}-{digest}"


def _lower_levels_met(name: str, flags: set[str]) -> bool:
    below = [need for level, need in _X86_LEVELS if level < name]
    return all(need <= flags for need in below)


#: PoCL's "distro" kernel libraries for x86-64 (its ``kernel-<triple>-<variant>.bc``) and
#: the CPU features each needs, as ``/proc/cpuinfo`` spells LLVM's names (``lzcnt`` is
#: ``abm``, ``bmi`` is ``bmi1``), in PoCL's order: the last one the host has is linked.
_POCL_KERNELLIBS = (
    ("sse2", {"sse2"}),
    ("ssse3", {"sse2", "ssse3", "cx16"}),
    ("sse41", {"sse2", "sse4_1", "cx16"}),
    ("avx", {"sse2", "avx", "cx16", "popcnt"}),
    ("avx_f16c", {"sse2", "avx", "cx16", "popcnt", "f16c"}),
    ("avx_fma4", {"sse2", "avx", "cx16", "popcnt", "xop", "fma4"}),
    ("avx2", {"sse2", "avx", "avx2", "cx16", "popcnt", "abm", "f16c", "fma", "bmi1", "bmi2"}),
    ("avx512", {"sse2", "avx512f"}),
)


def pocl_kernellib(flags: set[str]) -> str:
    """The built-in library a "distro" PoCL links into every x86-64 kernel, chosen by the
    host's features. PoCL 3.0 says only the host's LLVM CPU in its ``HSTR``, and LLVM 14
    calls Zen 3 and Zen 4 both ``znver3``: a binary built on one held AVX-512 code the other
    lacks. (PoCL 3.1 names the library's CPU in the ``HSTR`` instead, and reads
    ``POCL_KERNELLIB_NAME``, a variable the key holds.)

    >>> pocl_kernellib({"sse2", "avx", "avx2", "cx16", "popcnt", "abm", "f16c", "fma",
    ...                 "bmi1", "bmi2"})
    'avx2'
    >>> pocl_kernellib(set())
    'none'
    """
    best = "none"
    for name, needs in _POCL_KERNELLIBS:
        if needs <= flags:
            best = name
    return best


@functools.lru_cache(maxsize=1)
def host_flags() -> frozenset[str]:
    """The first processor's ``flags`` (x86) or ``Features`` (Arm) in ``/proc/cpuinfo``;
    empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=1)
def host_isa() -> str:
    """:func:`isa_class` of this host, from the first processor's flags in
    ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm); ``<machine>-unknown`` where
    they cannot be read."""
    machine = _platform.machine().lower() or "unknown"
    flags = host_flags()
    return isa_class(set(flags), machine) if flags else f"{slug(machine)}-unknown"


def intel_target(library: str | None) -> str | None:
    """The target Intel's CPU runtime compiles for when one is set: ``CL_CONFIG_CPU_TARGET_ARCH``
    from the environment, else from ``cl.cfg`` beside its library (the runtime reads both,
    the variable first); None for ``auto``, the host CPU."""
    value = config.read_variables((_INTEL_TARGET,))[_INTEL_TARGET]
    if value is None:
        value = intel_cfg(library).get(_INTEL_TARGET)
    if not value or value.strip().lower() == "auto":
        return None
    return slug(value)


def intel_cfg(library: str | None) -> dict[str, str]:
    """The ``NAME = value`` settings of ``cl.cfg`` beside Intel's CPU runtime library (the
    last line of a name; comments are lines without ``=`` or names of no setting); empty
    where there is no such file."""
    if not library:
        return {}
    try:
        text = (Path(library).parent / "cl.cfg").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        name, sep, value = line.partition("=")
        if sep:
            found[name.strip()] = value.strip()
    return found


def cpu_arch(vendor: str, library: str | None) -> str:
    """The arch id of a CPU device that is not PoCL's (Intel's runtime, others)."""
    if "intel" in vendor.lower():
        target = intel_target(library)
        return config.check_arch(f"intel-cpu-{target or host_isa()}")
    first = vendor.replace("(R)", "").replace("(TM)", "").split()
    return config.check_arch(slug(f"{first[0] if first else 'unknown'}-cpu-{host_isa()}"))


def hstr(version: str) -> str | None:
    """The ``HSTR`` of a PoCL device version, None for other implementations."""
    m = _HSTR_RE.search(version)
    return m.group(1) if m else None


def implementation(platform_name: str, platform_vendor: str) -> str:
    """A name for the OpenCL implementation, for messages: ``PoCL``, else the platform's.

    >>> implementation("Portable Computing Language", "The pocl project")
    'PoCL'
    >>> implementation("Intel(R) OpenCL", "Intel(R) Corporation")
    'Intel(R) OpenCL'
    """
    if "Portable Computing Language" in platform_name:
        return "PoCL"
    return platform_name or platform_vendor or "the OpenCL driver"


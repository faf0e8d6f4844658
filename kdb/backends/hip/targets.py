"""AMD GPU targets: target IDs (``gfx90a:sramecc+:xnack-``), the processors a toolchain
builds for, and the target a code object was built for, read from its ELF header.

A target ID is a processor and the features it is built with (``sramecc``, ``xnack``: on
``+``, off ``-``, unnamed for code that runs either way); each setting makes another code
object (`LLVM's AMDGPU target IDs <https://llvm.org/docs/AMDGPUUsage.html#target-id>`_).
HIPRTC 5.2 aborts the whole process on a target it does not know, so a target is checked
here before any compiler sees it.
"""

from __future__ import annotations

import re
import struct

from ...errors import InvalidArgumentError

#: ``EF_AMDGPU_MACH`` values of the ELF header (LLVM's ``BinaryFormat/ELF.h``); the LLVM 15
#: ones checked against hipcc 5.2's code objects for every processor it builds.
MACH = {
    0x20: "gfx600", 0x21: "gfx601", 0x22: "gfx700", 0x23: "gfx701", 0x24: "gfx702",
    0x25: "gfx703", 0x26: "gfx704", 0x28: "gfx801", 0x29: "gfx802", 0x2a: "gfx803",
    0x2b: "gfx810", 0x2c: "gfx900", 0x2d: "gfx902", 0x2e: "gfx904", 0x2f: "gfx906",
    0x30: "gfx908", 0x31: "gfx909", 0x32: "gfx90c", 0x33: "gfx1010", 0x34: "gfx1011",
    0x35: "gfx1012", 0x36: "gfx1030", 0x37: "gfx1031", 0x38: "gfx1032", 0x39: "gfx1033",
    0x3a: "gfx602", 0x3b: "gfx705", 0x3c: "gfx805", 0x3d: "gfx1035", 0x3e: "gfx1034",
    0x3f: "gfx90a", 0x40: "gfx940", 0x41: "gfx1100", 0x42: "gfx1013", 0x43: "gfx1150",
    0x44: "gfx1103", 0x45: "gfx1036", 0x46: "gfx1101", 0x47: "gfx1102", 0x48: "gfx1200",
    0x4a: "gfx1151", 0x4b: "gfx941", 0x4c: "gfx942", 0x4e: "gfx1201", 0x4f: "gfx950",
}
#: The processors with an ``xnack`` / ``sramecc`` setting (LLVM's processor table).
XNACK = frozenset({"gfx801", "gfx810", "gfx900", "gfx902", "gfx904", "gfx906", "gfx908",
                   "gfx909", "gfx90a", "gfx90c", "gfx940", "gfx941", "gfx942", "gfx950",
                   "gfx1010", "gfx1011", "gfx1012", "gfx1013"})
SRAMECC = frozenset({"gfx906", "gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"})
#: The processors ROCm 5.2's device libraries (Debian's rocm-device-libs) hold bitcode for:
#: what its HIPRTC builds where no LLVM tool is installed to ask.
ROCM52 = ("gfx600", "gfx601", "gfx602", "gfx700", "gfx701", "gfx702", "gfx703", "gfx704",
          "gfx705", "gfx801", "gfx802", "gfx803", "gfx805", "gfx810", "gfx900", "gfx902",
          "gfx904", "gfx906", "gfx908", "gfx909", "gfx90a", "gfx90c", "gfx940", "gfx1010",
          "gfx1011", "gfx1012", "gfx1013", "gfx1030", "gfx1031", "gfx1032", "gfx1033",
          "gfx1034", "gfx1035", "gfx1036")

_TARGET_RE = re.compile(r"(gfx[0-9a-f]{3,4})((?::[a-z]+[+-])*)\Z")
_EM_AMDGPU = 224
# e_flags of code object v4 and later (ELF ABI version 2 on): two bits per feature.
_SETTINGS = {0x000: None, 0x100: "any", 0x200: "-", 0x300: "+"}


def parse_target(target: object) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``(processor, ((feature, "+" or "-"), ...))`` of a target ID, features sorted as LLVM
    writes them; :class:`kdb.InvalidArgumentError` for one that is not well formed.

    >>> parse_target("gfx90a:xnack-:sramecc+")
    ('gfx90a', (('sramecc', '+'), ('xnack', '-')))
    """
    m = _TARGET_RE.match(target) if isinstance(target, str) else None
    if m is None:
        raise InvalidArgumentError(
            f"HIP arch {target!r} is not a target ID: use a processor such as 'gfx90a', "
            "'gfx1030', optionally with features ('gfx90a:sramecc+:xnack-')")
    processor, rest = m.groups()
    features: dict[str, str] = {}
    for item in filter(None, rest.split(":")):
        name, setting = item[:-1], item[-1]
        if name not in ("sramecc", "xnack") or name in features:
            raise InvalidArgumentError(
                f"HIP arch {target!r}: {item!r} is not a feature or is given twice; a target "
                "ID takes 'sramecc+'/'sramecc-' and 'xnack+'/'xnack-', each once")
        supported = SRAMECC if name == "sramecc" else XNACK
        if processor not in supported:
            raise InvalidArgumentError(
                f"HIP arch {target!r}: {processor} has no {name} setting; drop ':{item}' "
                f"({name} applies to {', '.join(sorted(supported, key=_order))})")
        features[name] = setting
    return processor, tuple(sorted(features.items()))


def canonical(target: object) -> str:
    """The target ID as LLVM writes it (features in order).

    >>> canonical("gfx90a:xnack-:sramecc+")
    'gfx90a:sramecc+:xnack-'
    """
    processor, features = parse_target(target)
    return processor + "".join(f":{n}{s}" for n, s in features)


def _order(processor: str) -> tuple[int, str]:
    digits = processor[3:]
    return (len(digits), digits)


def sort_processors(names) -> list[str]:
    """Processors in LLVM's order (gfx9 before gfx10).

    >>> sort_processors(["gfx1030", "gfx90a", "gfx906"])
    ['gfx906', 'gfx90a', 'gfx1030']
    """
    return sorted(set(names), key=_order)


def code_object_target(binary: bytes) -> str | None:
    """The target a code object was built for, from its ELF header (``gfx90a:sramecc+:xnack-``;
    a feature built to run either way is left out); None for bytes that are not an AMDGPU
    code object of a known processor."""
    data = bytes(binary[:64])
    if len(data) < 52 or data[:4] != b"\x7fELF" or data[4] != 2:
        return None
    if struct.unpack_from("<H", data, 18)[0] != _EM_AMDGPU:
        return None
    flags = struct.unpack_from("<I", data, 48)[0]
    processor = MACH.get(flags & 0xFF)
    if processor is None:
        return None
    if data[8] < 2:  # code object v3: other feature bits; the processor alone
        return processor
    out = processor
    for name, shift in (("sramecc", 2), ("xnack", 0)):
        setting = _SETTINGS[(flags >> shift) & 0x300]
        if setting in ("+", "-"):
            out += f":{name}{setting}"
    return canonical(out)


def serves(binary: bytes, target: str) -> bool:
    """Whether ``binary`` is a code object for exactly ``target`` (a canonical target ID)."""
    return code_object_target(binary) == target


def check_known(target: str, llvm: list[str], built: list[str], compiler: str) -> None:
    """:class:`kdb.InvalidArgumentError` unless ``target``'s processor is one the toolchain
    builds: ``llvm`` the processors its LLVM knows, ``built`` those it has device libraries for."""
    processor = parse_target(target)[0]
    if processor in built:
        return
    can = ", ".join(built)
    if processor in llvm:
        raise InvalidArgumentError(
            f"{compiler}'s LLVM knows {processor}, but its ROCm device libraries have no "
            f"bitcode for it (oclc_isa_version_{processor[3:]}.bc): it needs a newer ROCm. "
            f"This toolchain builds: {can}")
    known = f"; its LLVM knows {', '.join(llvm)}" if list(llvm) != list(built) else ""
    raise InvalidArgumentError(
        f"{compiler} does not know the AMD GPU {processor!r}: it builds {can}{known}. Newer "
        "GPUs (gfx942, gfx950, gfx1100 on) need a newer ROCm than this one")

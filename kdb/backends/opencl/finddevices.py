"""The platform and devices a store job names, found again in another process (the store
worker's lanes, the helper that reads binaries): by name, version and library, each
device checked against the compiler its key names."""

from __future__ import annotations

import pyopencl as cl

from ...keys import HashAttributes
from .binaries import library_of
from .keys import compiler_identity

#: What a dropped job's message ends with.
NEXT_RUN = "the next run that builds it stores it"


def _platform_of(prog: dict):
    """The platform a job names: name, version and library all equal (a job from before
    they were written names one by name, taken only where no other has that name)."""
    named = [p for p in cl.get_platforms() if p.name == prog["platform"]]
    if "platform_version" in prog:
        named = [p for p in named if p.version == prog["platform_version"]
                 and (library_of(p.int_ptr) or "") == prog.get("library", "")]
    if len(named) == 1:
        return named[0]
    what = " ".join(filter(None, (repr(prog["platform"]), prog.get("platform_version"),
                                  prog.get("library") and f"({prog['library']})")))
    raise LookupError(f"job dropped: {'no' if not named else 'more than one'} OpenCL platform "
                      f"{what} in the store worker (its OCL_ICD_VENDORS or installed ICDs "
                      f"differ from the process that built it; {NEXT_RUN})")


def job_devices(prog: dict, entries: list[tuple[int, HashAttributes]]) -> list:
    """The devices a job names, each checked against the keys of its ``entries`` (``(device
    index, attributes)``: the compiler identity): a job is stored for the device that
    built it or not at all."""
    plat = _platform_of(prog)
    plat_devs = plat.get_devices()
    devs = []
    for name, index in prog["devices"]:
        if index >= len(plat_devs) or plat_devs[index].name != name:
            raise LookupError(f"job dropped: no device {name!r} at index {index} of "
                              f"{prog['platform']!r} ({NEXT_RUN})")
        devs.append(plat_devs[index])
    for index, attrs in entries:  # the device's compiler: platform and device versions, library
        if tuple(map(tuple, attrs.compiler)) != compiler_identity(devs[index]):
            raise LookupError(f"job dropped: device {devs[index].name!r} of {prog['platform']!r} "
                              f"has not the compiler {attrs.name or attrs.key[:12]}'s key names "
                              f"({NEXT_RUN})")
    return devs

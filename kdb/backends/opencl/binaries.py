"""Reading ``CL_PROGRAM_BINARIES`` without holding the GIL.

pyopencl's ``get_info`` keeps the GIL while the driver serialises a program, and PoCL can take
seconds to do so (it generates code for every kernel). The same call made through
:mod:`ctypes` releases the GIL, so the background writer can read binaries while the
program that built them runs. Falls back to pyopencl when no OpenCL library is found.
"""

from __future__ import annotations

import ctypes
import functools
import os

from ... import logs

log = logs.get("kdb")

CL_PROGRAM_NUM_DEVICES = 0x1162
CL_PROGRAM_DEVICES = 0x1163
CL_PROGRAM_BINARY_SIZES = 0x1165
CL_PROGRAM_BINARIES = 0x1166


@functools.lru_cache(maxsize=1)
def source_program(ctx, text: str):
    """``clCreateProgramWithSource`` of ``text`` as the caller's bytes (each lone surrogate
    back to the byte it stands for). pyopencl before 2026.1 takes a source as ``str`` only:
    there the text is given as it is (every store of the store worker failed with a
    TypeError, and the next start's first served program crashed the process)."""
    import pyopencl as cl

    try:
        return cl._Program(ctx, text.encode("utf-8", "surrogateescape"))
    except TypeError:
        return cl._Program(ctx, text)


_loader: list[ctypes.CDLL | None] = []


def _libopencl() -> ctypes.CDLL | None:
    """The OpenCL loader this process already uses (pyopencl's bundled copy, usually), found
    once: reading ``/proc/self/maps`` at every store took 1.4 ms a program (Intel's runtime,
    whose binaries the building process stores)."""
    if not _loader:
        _loader.append(_find_libopencl())
    return _loader[0]


def _find_libopencl() -> ctypes.CDLL | None:
    path = None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                if "libOpenCL" in line:
                    path = line.split(None, 5)[-1].strip()
                    break
    except OSError:
        pass
    if not path:
        from ctypes.util import find_library  # spawns ldconfig: only if the maps gave nothing

        path = find_library("OpenCL")
    if not path:
        return None
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    lib.clGetProgramInfo.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t,
                                     ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.clGetProgramInfo.restype = ctypes.c_int
    return lib


def _info(lib: ctypes.CDLL, prog: int, param: int, buf, size: int) -> int:
    """Fill ``buf``; the number of ``size_t`` the driver says it wrote."""
    written = ctypes.c_size_t()
    err = lib.clGetProgramInfo(ctypes.c_void_p(prog), param, size, buf, ctypes.byref(written))
    if err != 0:
        raise OSError(f"clGetProgramInfo({param:#x}) failed with OpenCL error {err}")
    return written.value // ctypes.sizeof(ctypes.c_size_t)


def program_binaries(program, built_for=None) -> dict[int, bytes]:
    """``{device int_ptr: binary}`` of a built pyopencl program (empty binaries left out);
    empty where which binary is whose cannot be told. ``built_for``: the devices the build
    named, in its order. PoCL 3.0 hands the binaries back in that order while it lists the
    program's devices in the context's: a build for a context's two devices named the other
    way round had each device's binary stored under the other's key (PoCL refused them at
    the next start; a driver that takes another device's binary would have run it)."""
    lib = _libopencl() if os.name == "posix" else None
    if lib is None:
        import pyopencl as cl

        devs = program.get_info(cl.program_info.DEVICES)
        bins = program.get_info(cl.program_info.BINARIES)
        if len(bins) != len(devs) or not _same_order([d.int_ptr for d in devs], built_for):
            return {}  # which binary is whose cannot be told (see below)
        return _whole({d.int_ptr: bytes(b) for d, b in zip(devs, bins) if b})
    prog = program.int_ptr
    n = ctypes.c_uint()
    _info(lib, prog, CL_PROGRAM_NUM_DEVICES, ctypes.byref(n), ctypes.sizeof(n))
    count = n.value
    devs = (ctypes.c_void_p * count)()
    _info(lib, prog, CL_PROGRAM_DEVICES, devs, ctypes.sizeof(devs))
    if not _same_order([d or 0 for d in devs], built_for):
        return {}
    sizes = (ctypes.c_size_t * count)()
    if _info(lib, prog, CL_PROGRAM_BINARY_SIZES, sizes, ctypes.sizeof(sizes)) != count:
        # PoCL 3.0 lists one size per device it built for, not per device of the program:
        # built for the second of two devices, its one binary would be taken as the first's.
        return {}
    bufs = [ctypes.create_string_buffer(max(s, 1)) for s in sizes]
    ptrs = (ctypes.c_void_p * count)(*[ctypes.addressof(b) for b in bufs])
    _info(lib, prog, CL_PROGRAM_BINARIES, ptrs, ctypes.sizeof(ptrs))
    return _whole({devs[i] or 0: bufs[i].raw[: sizes[i]] for i in range(count) if sizes[i]})


def _whole(binaries: dict[int, bytes]) -> dict[int, bytes]:
    """``binaries`` without PoCL's torn ones (:func:`.poclbin.torn`: its cache files went
    while it read them), as the driver's empty ones: never stored."""
    from .poclbin import torn

    bad = [ptr for ptr, b in binaries.items() if torn(b)]
    for ptr in bad:
        log.debug("kdb: PoCL returned a torn binary (an empty program.bc: its cache files "
                  "went while it read them); not stored")
        del binaries[ptr]
    return binaries


def _same_order(program_devices: list[int], built_for) -> bool:
    """Whether the build named its devices in the order the program lists them (those it
    did not name left out), so that each binary's place says whose it is.

    >>> from types import SimpleNamespace as Device
    >>> _same_order([1, 2, 3], None), _same_order([1, 2, 3], [Device(int_ptr=1), Device(int_ptr=3)])
    (True, True)
    >>> _same_order([1, 2], [Device(int_ptr=2), Device(int_ptr=1)])
    False
    """
    if built_for is None:
        return True
    named = [d.int_ptr for d in built_for]
    wanted = set(named)
    return [p for p in program_devices if p in wanted] == named


@functools.lru_cache(maxsize=None)
def library_of(handle: int) -> str | None:
    """Path of the shared library that implements an ICD object (platform or device).

    An ICD object starts with a pointer to its vendor's dispatch table; ``dladdr`` names the
    library that holds it. This finds libpocl.so, libnvidia-opencl.so... without guessing.
    """
    if os.name != "posix" or not handle:
        return None
    try:
        # The process's global symbols, through the handle ctypes made at import: a CDLL of
        # its own, a Structure class and argtypes would weigh on a warm start's first build.
        dladdr = ctypes.pythonapi.dladdr
    except AttributeError:
        return None
    info = (ctypes.c_void_p * 4)()  # Dl_info: dli_fname, dli_fbase, dli_sname, dli_saddr
    dispatch = ctypes.c_void_p.from_address(handle).value
    for addr in (dispatch, _first_entry(dispatch)):
        if addr and dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) and info[0]:
            path = os.fsdecode(ctypes.string_at(info[0]))
            if os.path.isfile(path) and "libOpenCL" not in os.path.basename(path):
                return os.path.realpath(path)
    return None


def _first_entry(table: int | None) -> int | None:
    if not table:
        return None
    try:
        return ctypes.c_void_p.from_address(table).value
    except (ValueError, OSError):
        return None

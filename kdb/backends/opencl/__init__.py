"""OpenCL through pyopencl: builds served from kdb, and the drop-in :func:`install`.

``build(ctx, source, options)`` returns a built :class:`pyopencl.Program`. On a hit in every
device's tier it is created from the stored binaries (``clCreateProgramWithBinary``);
otherwise it is built from source and returned at once, and a job describing the build goes
to the store worker (:mod:`kdb.storing.spool`): :mod:`.stores`. The keys come from :mod:`.keys`.

``install()`` routes every ``pyopencl.Program(ctx, source).build()`` through the same path;
programs from binaries or IL, programs of no text, ``compile()`` and ``link_program()`` pass
through untouched.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Sequence

import pyopencl as cl

from ... import config, lifecycle, logs
from ...bookkeeping import add as _count
from ...db import KernelDB, default_db
from ...errors import CompileError, InvalidArgumentError
from ..includes import UncertainIncludes
from ...keys import HashAttributes
from .keys import (
    BACKEND,
    BUILD_VARIABLES,
    ENV_VARS,
    _label,
    _Plan,
    arch_of,
    attributes_for,
    compiler_identity,
    device_details,
    environment,
    headers_of,
    internal_options,
    kernel_names,
    plan_for,
    split_options,
)
from . import tempincludes
from .binaries import source_program
from .poclbin import is_early, private_copies, torn
from .refresh import loaded as _refresh_loaded
from .refresh import refresh_job  # noqa: F401 - the store worker finds it here
from ..common import log_uncached, names_label, source_text

if TYPE_CHECKING:
    from ...claims import Claim

log = logs.get("kdb")
trace_log = logs.get("kdb.trace")

#: The store side (:mod:`.stores`), imported by this process's first miss: a process whose
#: builds all hit never loads it, nor the claims and early entries a miss needs.
_stores = None

# -- build --------------------------------------------------------------------------------

def build(ctx: cl.Context, source: str | bytes, options: str | Sequence[str] | None = None,
          devices: Sequence[cl.Device] | None = None, *, db: KernelDB | None = None,
          name: str | None = None, arch: str | None = None) -> cl.Program:
    """A built :class:`pyopencl.Program` for ``source``, from kdb when it holds the binaries.

    Raises :class:`kdb.CompileError` (with the build log) when the source does not compile.
    """
    if not isinstance(ctx, cl.Context):
        raise InvalidArgumentError(f"ctx must be a pyopencl.Context, not {type(ctx).__name__}")
    if db is not None and not isinstance(db, KernelDB):
        raise InvalidArgumentError(f"db must be a kdb.KernelDB, not {type(db).__name__}")
    if devices is not None:
        try:
            given = list(devices)
        except TypeError:
            given = []
        if not given or not all(isinstance(d, cl.Device) for d in given):
            raise InvalidArgumentError("devices must be a non-empty list of pyopencl.Device "
                                       "of ctx, or None for all of ctx's devices")
    try:
        return _build(ctx, source, options, devices, db, name, arch, pyopencl_errors=False)
    except cl.RuntimeError as err:
        raise CompileError(
            f"OpenCL build of {name or _label(_text(source))} failed; {_remedy(str(err))}",
            log=str(err), options=tuple(split_options(options)),
        ) from err


def _remedy(log: str) -> str:
    """What to do about a failed build: fix the kernel, unless the OpenCL's compiler cannot
    build anything on this CPU (pip's PoCL 3.0, LLVM 14, calls a CPU newer than it knows
    ``generic`` and then refuses it: AMD's Zen 4 and 5, for example)."""
    if "unknown target CPU" in log:
        return ("the OpenCL's compiler does not know this CPU (\"unknown target CPU\"), "
                "so it builds no kernel at all. Use an OpenCL built with a newer LLVM: "
                "Debian's or Ubuntu's PoCL (apt-get install pocl-opencl-icd), Intel's CPU "
                "runtime (pip install intel-opencl-rt), or a newer PoCL")
    return "fix the kernel source or options shown below"



def _text(source: str | bytes) -> str:
    """The program text as ``str``; bytes that are not UTF-8 (a Latin-1 comment) keep their
    bytes as lone surrogates (``surrogateescape``): pyopencl builds them, so kdb does too."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source).decode("utf-8", "surrogateescape")
    return source_text(source, "OpenCL")


def _keyed(source: str | bytes, text: str) -> tuple[str, tuple[str, ...]]:
    """The key's source text and extra internal options. Bytes that are not UTF-8 are keyed
    by their sha256 (an internal option no compiler option can equal) beside their text with
    U+FFFD for each undecodable byte: every key stays valid Unicode, and keys of UTF-8
    sources stay as they were."""
    if not isinstance(source, (bytes, bytearray)) or text.isascii():
        return text, ()
    raw = bytes(source)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        import hashlib

        return (raw.decode("utf-8", "replace"),
                (f"kdb:source-sha256={hashlib.sha256(raw).hexdigest()}",))
    return text, ()


def _program_source(source: str | bytes, text: str) -> str | bytes:
    """What ``clCreateProgramWithSource`` gets: the caller's bytes as they are."""
    return bytes(source) if isinstance(source, (bytes, bytearray)) else text


def _uncached(ctx, source, text: str, plan: _Plan, err: UncertainIncludes, *,
              db: KernelDB, name: str | None, pyopencl_errors: bool, wrapper) -> cl.Program:
    """A plain build, neither looked up nor stored: kdb cannot be sure what it reads, or it
    is never the same twice. Logged with why, as it compiles at every start."""
    if not db.tiers.disabled:
        logs.warn_once(f"includes:{err.kind}", "kdb: %s; such programs are built without "
                       "the cache (KDB_TRACE=1 names each one)", err)
    if db.tiers.trace:
        trace_log.debug("%s not cached: %s", _label(text), err)
    start = time.perf_counter()
    raw = _compile(ctx, _program_source(source, text), plan.opt_bytes, plan.devs,
                   pyopencl_errors, wrapper)
    seconds = time.perf_counter() - start
    keys = {(a, c): HashAttributes(BACKEND, text, a, build_options=plan.user_rest,
                                   internal_options=plan.added_rest,
                                   headers=(("?", err.kind),), compiler=c,
                                   environment=plan.environment,
                                   name=name or _label(text))
            for a, c in zip(plan.archs, plan.compilers)}
    log_uncached(db, list(keys.values()), seconds, str(err))
    return _wrap(raw, wrapper)


def _compile(ctx, src, opt_bytes: bytes, devs, pyopencl_errors: bool, wrapper) -> cl._Program:
    raw = cl._Program(ctx, src)
    try:
        if pyopencl_errors and wrapper is not None:
            # As pyopencl's own uncached build does: the options appended to the message.
            wrapper._build_and_catch_errors(lambda: raw.build(opt_bytes, devs),
                                            options_bytes=opt_bytes)
        else:
            raw.build(opt_bytes, devs)
    except BaseException:
        if wrapper is not None:  # as pyopencl's: the failed program answers for its build
            wrapper._prg = raw  # (its log, its status); else a new, unbuilt one did
        raise
    return raw


def _build(ctx, source, options, devices, db, name, arch, *, pyopencl_errors: bool,
           wrapper: cl.Program | None = None) -> cl.Program:
    variables = config.read_variables(BUILD_VARIABLES)
    db = db or default_db(variables)
    text = _text(source)
    plan = plan_for(ctx, devices, options, arch, str(db.cache_root), variables)
    try:  # per build: the headers and the working directory may change
        if plan.temporal is not None:
            raise UncertainIncludes("time", str(plan.temporal))
        headers = headers_of(text, plan.opt_bytes, search=plan.search)
    except UncertainIncludes as err:
        return _uncached(ctx, source, text, plan, err, db=db, name=name,
                         pyopencl_errors=pyopencl_errors, wrapper=wrapper)
    # Unlabelled until a miss: a hit never shows the label, and finding it scans the source.
    key_text, extra = _keyed(source, text)
    attrs = [HashAttributes(BACKEND, key_text, a, build_options=plan.user_rest,
                            internal_options=plan.added_rest + extra if extra
                            else plan.added_rest,
                            headers=headers, compiler=c, environment=plan.environment,
                            name=name or "")
             for a, c in zip(plan.archs, plan.compilers)]
    memory_key = (ctx.int_ptr, plan.dev_ptrs, tuple(a.key for a in attrs))
    # Compiled by this process, its binaries not read back yet: only after a miss.
    built = None if _stores is None else _stores.held(memory_key, plan.devs)
    if built is not None:
        _count("hits.memory", len({a.key for a in attrs}))
        return _wrap(built, wrapper)
    if plan.temporary and not db.tiers.disabled:  # built from a copy of each: one hash
        plan = _with_copies(plan, db, headers, text)
    hits: list = [None] * len(attrs)
    held: dict[str, Claim] = {}
    built = None
    if not db.tiers.disabled:
        raw, hits, held, built = _served(db, ctx, plan, attrs, text, name)
        if raw is not None:
            return _wrap(raw, wrapper)
    return _compile_and_store(ctx, source, text, plan, db, attrs=attrs, hits=hits, held=held,
                              name=name, memory_key=memory_key,
                              pyopencl_errors=pyopencl_errors, wrapper=wrapper, built=built)


def _with_copies(plan: _Plan, db: KernelDB, headers, text: str) -> _Plan:
    """``plan`` building with its temporary include directories given as their copies in
    kdb's cache (:mod:`.tempincludes`), where faithful copies can be made and the build
    finds through them the headers the key holds; else as it is. A directory the search
    also reaches another way (``-I .``, the working directory searched anyway; ``-I d/sub``
    beside ``-I d``) is one file twice there, and a copy plus the original once copied:
    such a build never matched its key, so nothing it compiled was ever stored."""
    if not _copies_trusted(db.user_dir / "includes"):
        return plan  # copies others could change between their check and the build
    options = tempincludes.rewritten(plan.opt_bytes, plan.temporary,
                                     str(db.user_dir / "includes"), headers, text)
    if options is None:
        return plan
    copied = plan.with_options(options)
    try:
        memo = (options, os.getcwd(), headers, text)
    except OSError:
        return plan
    same = _same_through_copies.get(memo)
    if same is None:
        try:
            same = headers_of(text, options, search=copied.search) == headers
        except UncertainIncludes:
            same = False
        if len(_same_through_copies) >= 256:
            _same_through_copies.clear()
        _same_through_copies[memo] = same
    return copied if same else plan


#: What building from copies in an ``includes`` directory others can change would risk.
_COPIES = ("a build could read a header swapped in after kdb checked the copy",
           "builds read the original include directories")
#: The ``includes`` directories found this user's alone, checked once per process (the
#: check walks the path to the root: 60 us, on every build of such a program, hits too).
_trusted_copies: set = set()


def _copies_trusted(where) -> bool:
    """Whether copies may be made and read in ``where`` (one warning where not)."""
    if where in _trusted_copies:
        return True
    from ...file import fs

    if fs.refused([where], _COPIES):
        return False
    _trusted_copies.add(where)
    return True


#: (options with the copies, working directory, the key's headers, source) -> whether that
#: build finds the key's headers (:func:`_with_copies`): checked once per process.
_same_through_copies: dict[tuple, bool] = {}


def _served(db: KernelDB, ctx, plan: _Plan, attrs: list[HashAttributes], text: str,
            name: str | None) -> tuple[cl._Program | None, list, dict[str, Claim], tuple | None]:
    """The program loaded from the tiers' binaries when every device's key hits (after
    waiting for another process that compiles it); else the hits there are, the claims
    this process now holds, and a program already compiled on the way (an early entry PoCL
    did not take: :func:`_from_early`). A binary the driver refuses is discarded."""
    found: dict[str, Any] = {}  # one lookup, and one count, a key: two devices of one
    for a in attrs:             # kind share it (a miss counted one compile, a hit two)
        if a.key not in found:
            found[a.key] = db.tiers.lookup(a)
    hits = [found[a.key] for a in attrs]
    held: dict[str, Claim] = {}
    if not all(hits):  # single flight: claim what missed, or wait for its compiler
        hits, held = _claim_or_wait(db, attrs, hits)
    if all(hits) and any(is_early(h.binary) for h in hits):
        raw, used, built = _from_early(db, ctx, plan, attrs, hits, text, name)
        if used:
            return raw, hits, held, None
        for a, h in zip(attrs, hits):
            db.tiers.unserved(a, h)
        return None, [None] * len(attrs), held, built
    if all(hits) and any(torn(h.binary) for h in hits):  # stored by a kdb before 2026-12
        for a, h in zip(attrs, hits):
            db.tiers.unserved(a, h)
            if h.tier in ("user", "shared", "memory") and torn(h.binary):
                db.tiers.storing.discard(a.with_(name=name or _label(text)),
                                         "a torn PoCL binary (an empty program.bc)", h.tier)
        hits = [None] * len(attrs)  # rebuilt from source and stored again
    if all(hits):
        try:
            raw = _load(ctx, plan.devs, [h.binary for h in hits], text, plan.opt_bytes)
            if raw is not None:  # else built from source; nothing missed to store
                _refresh_loaded(db.tiers, attrs, hits)
                return raw, hits, held, None
        except (cl.RuntimeError, cl.LogicError) as err:
            for a, h in zip(attrs, hits):
                db.tiers.unserved(a, h)
                if h.tier in ("user", "shared", "memory") and _says_binary_is_bad(err):
                    db.tiers.storing.discard(
                        a.with_(name=name or _label(text)),
                        f"the driver refused the stored binary ({err})", h.tier)
            hits = [None] * len(attrs)  # rebuilt from source and stored again
    return None, hits, held, None


#: What a driver answers for a binary it cannot use. Any other error of a load (a device,
#: the context, memory) says nothing of the binary: the program is built from source and
#: the entry kept (dropping it cost every node sharing it a compile).
_BAD_BINARY = frozenset(getattr(cl.status_code, n) for n in (
    "INVALID_BINARY", "BUILD_PROGRAM_FAILURE", "INVALID_PROGRAM",
    "INVALID_PROGRAM_EXECUTABLE", "LINK_PROGRAM_FAILURE", "COMPILE_PROGRAM_FAILURE")
    if hasattr(cl.status_code, n))


def _says_binary_is_bad(err: Exception) -> bool:
    code = getattr(err, "code", None)
    return not isinstance(code, int) or code in _BAD_BINARY


def _compile_and_store(ctx, source, text: str, plan: _Plan, db: KernelDB, *,
                       attrs: list[HashAttributes], hits: list, held: dict[str, Claim],
                       name: str | None, memory_key: tuple, pyopencl_errors: bool,
                       wrapper, built: tuple | None = None) -> cl.Program:
    """Build from source (or take ``built``: ``(program, seconds, start ns, end ns)``
    compiled on the way), then hand what missed (once per key) to the store worker; the
    claims of what another way served are let go."""
    global _stores
    devs, opt_bytes = plan.devs, plan.opt_bytes
    if built is not None:
        raw, seconds, start_ns, end_ns = built
    else:
        start, start_ns = time.perf_counter(), time.time_ns()
        try:
            try:
                raw = _compile(ctx, _program_source(source, text), opt_bytes, devs,
                               pyopencl_errors, wrapper)
            except Exception:
                if plan.asked is None:
                    raise
                # Built from copies of its include directories, which went meanwhile (the
                # cache removed under the build): built as asked, it reads the originals.
                plan = plan.asked
                devs, opt_bytes = plan.devs, plan.opt_bytes
                raw = _compile(ctx, _program_source(source, text), opt_bytes, devs,
                               pyopencl_errors, wrapper)
        except BaseException:
            for claim in held.values():
                claim.release()
            raise
        seconds, end_ns = time.perf_counter() - start, time.time_ns()
    prg = _wrap(raw, wrapper)
    names = _built_names(raw, text)
    label = name or names_label(names, "program")
    attrs = [a if a.name == label else a.with_(name=label) for a in attrs]
    missed: dict[str, tuple] = {}  # devices of one class share a key
    for d, a, h in zip(devs, attrs, hits):
        if h is None:
            missed.setdefault(a.key, (d, a))
    for key in set(held) - set(missed):  # claimed, then served another way: let go
        held.pop(key).release()
    if not missed and all(hits) and _wants_arg_info(opt_bytes) \
            and tuple(d.int_ptr for d in devs) in _no_arg_info:  # found, not loadable: a compile
        for a in {a.key: a for a in attrs}.values():
            db.tiers.storing.log_compile(db.tiers.record_compile(
                a, seconds / max(len(devs), 1), reason=_ARG_INFO_REASON))
    from . import early, stores  # this process's first miss loads the store side

    _stores = stores
    recheck = stores.recheck_for(text, opt_bytes, plan.search)
    if missed and not db.tiers.disabled:
        stores.compiled[memory_key] = (raw, stores.build_stamp(raw, devs))
        kept = early.compiled(db.tiers, [a for _, a in missed.values()], start_ns, end_ns,
                              names, recheck)
    else:
        kept = None
    # An early entry PoCL did not take (``built``) or none: the next process compiles too.
    first = kept is None or built is not None or not early.stands_in(plan.search)
    stores.store_later(db, raw, [d for d, _ in missed.values()],
                       [a for _, a in missed.values()], seconds, held, forget=memory_key,
                       program=stores.program_spec(text, opt_bytes, devs),
                       recheck=recheck, early_build=kept, first=first)
    return prg


def _built_names(raw: cl._Program, text: str) -> list[str]:
    """The kernels of a program built from ``text``: those :func:`kernel_names` finds, in
    the source's order, that the driver lists, then the rest the driver lists. A kernel
    declared through a macro (pyopencl's scans write ``KERNEL REQD_WG_SIZE(...) void``) is
    found only there; it names the entry and tells :mod:`.early` which directory is its."""
    found = kernel_names(text)
    try:
        listed = _listed_kernels(raw)
    except (cl.Error, UnicodeDecodeError):
        return found
    if not listed:
        return found
    return [n for n in found if n in listed] + [n for n in listed if n not in found]


def _listed_kernels(raw: cl._Program) -> list[str]:
    """The kernels the driver lists for a built program (``CL_PROGRAM_KERNEL_NAMES``)."""
    return [n for n in raw.get_info(cl.program_info.KERNEL_NAMES).split(";") if n]


def _from_early(db: KernelDB, ctx, plan: _Plan, attrs: list[HashAttributes], hits: list,
                text: str, name: str | None) -> tuple[cl._Program | None, bool, tuple | None]:
    """The program built from source with PoCL's files of its early entries put back where
    PoCL's cache looks (:mod:`.early`): a PoCL cache hit, not a compile; ``(program, True,
    None)``. Where they cannot be put back, or PoCL did not use them (its build hash differs:
    it compiled, e.g. an ``-I`` directory of another name), the result is ``(None, False,
    (program, seconds, start ns, end ns))``: that build is this process's compile, stored as
    on a miss, and its files, kept at exit, replace the early entries (``None`` for the
    program where none was built)."""
    from . import early

    top = early.can_put_back()
    unpacked = [early.unpack(h.binary) if is_early(h.binary) else None for h in hits]
    built = None
    if top is not None and all(u is not None or not is_early(h.binary)
                               for u, h in zip(unpacked, hits)):
        start, start_ns = time.perf_counter(), time.time_ns()
        try:
            for u in filter(None, unpacked):
                early.put_back(top, *u)
            raw = source_program(ctx, text)  # the caller's bytes
            raw.build(plan.opt_bytes, plan.devs)
        except Exception as err:  # noqa: BLE001 - whatever it was, built from source instead
            why = f"PoCL's files could not be put back and built ({err})"
        else:
            if all(early.used(top, u[0], start_ns) for u in filter(None, unpacked)):
                db.tiers.storing.resume_stores([a.key for a in attrs])  # full binaries still due
                return raw, True, None
            built = (raw, time.perf_counter() - start, start_ns, time.time_ns())
            why = "PoCL did not use the files put back (its build hash differs)"
    else:
        why = "PoCL's kernel cache is off, or its directory is not this user's alone"
    log.debug("kdb: %s: early entries not used: %s", name or _label(text), why)
    return None, False, built


def _claim_or_wait(db: KernelDB, attrs: list[HashAttributes], hits: list):
    """For each missed key: a hit published by another process meanwhile, or our claim."""
    from ... import claims  # a miss: a hit never imports the claims

    hits = list(hits)
    held: dict[str, Claim] = {}
    for i, (a, h) in enumerate(zip(attrs, hits)):
        if h is not None or a.key in held:
            continue
        got = db.tiers.claim_or_wait(a)
        if isinstance(got, claims.Claim):
            held[a.key] = got
        elif got is not None:
            hits = [got if b.key == a.key else x for b, x in zip(attrs, hits)]
    return hits, held


class _StoredProgram(cl._Program):
    """A program created from stored binaries that still answers ``get_info(SOURCE)``.

    OpenCL keeps no source for a program created from binaries; pyopencl users read
    ``prg.source`` (code generators log it, tests compare it). The caller's object stays a
    plain :class:`pyopencl.Program`; only the handle it wraps knows the text.
    """

    #: The context's devices where the program was built for some of them, else None:
    #: a program from source belongs to all of its context's devices, built or not.
    _kdb_devices: list | None = None

    def get_info(self, arg):
        if arg == cl.program_info.SOURCE:
            return self._kdb_source
        if self._kdb_devices is not None and arg == cl.program_info.DEVICES:
            return list(self._kdb_devices)
        if self._kdb_devices is not None and arg == cl.program_info.NUM_DEVICES:
            return len(self._kdb_devices)
        return super().get_info(arg)

    def get_build_info(self, device, param):
        if self._kdb_devices is not None and device not in self._kdb_built:
            # What a program from source answers for a device it was not built for: as one
            # never built, but for its log, which PoCL refuses for that (INVALID_PROGRAM)
            # and gives for a program built for other devices: none.
            unbuilt = cl._Program(self.get_info(cl.program_info.CONTEXT), self._kdb_source)
            try:
                return unbuilt.get_build_info(device, param)
            except cl.Error:
                if param == cl.program_build_info.LOG:
                    return ""
                raise
        return super().get_build_info(device, param)


#: Devices (their handles) whose OpenCL gave no kernel argument information for a program
#: created from binaries and built with ``-cl-kernel-arg-info``: such builds compile there.
_no_arg_info: set[tuple[int, ...]] = set()


_ARG_INFO_REASON = ("stored, but built with -cl-kernel-arg-info, which this OpenCL drops from "
                    "a program created from binaries")


def _wants_arg_info(opt_bytes: bytes) -> bool:
    """Whether the build asks for kernel argument information (``-cl-kernel-arg-info``)."""
    return b"-cl-kernel-arg-info" in opt_bytes and b"-cl-kernel-arg-info" in opt_bytes.split()


def _keeps_arg_info(raw: cl._Program) -> bool:
    """Whether ``raw`` answers ``clGetKernelArgInfo``: the OpenCL standard promises it only
    for a program created from source, and Intel's CPU runtime gives none for one created
    from binaries (nor for pyopencl's own cache's), where PoCL keeps it. A program whose
    kernels take no argument has nothing to lose."""
    try:
        for name in _listed_kernels(raw):
            kernel = cl.Kernel(raw, name)
            if kernel.get_info(cl.kernel_info.NUM_ARGS):
                kernel.get_arg_info(0, cl.kernel_arg_info.NAME)
                return True
    except (cl.RuntimeError, cl.LogicError):
        return False
    return True


def _load(ctx, devs, binaries: list[bytes], text: str, opt_bytes: bytes) -> cl._Program | None:
    """The program from stored binaries; None when PoCL cannot load them safely, or when
    the build asks for kernel argument information that this OpenCL drops from a program
    created from binaries (:func:`_keeps_arg_info`): such a program is built from source."""
    wants_arg_info = _wants_arg_info(opt_bytes)
    if wants_arg_info and tuple(d.int_ptr for d in devs) in _no_arg_info:
        return None
    private = private_copies(binaries)
    if private is None:
        logs.warn_once("pocl-uncached-layout", "kdb: PoCL's kernel cache is off "
                       "(POCL_KERNEL_CACHE) and kdb does not know this PoCL's binary format: "
                       "programs are built from source, not loaded from kdb (processes "
                       "loading one binary at once would share and delete one directory)")
        return None
    raw = _StoredProgram(ctx, devs, private)
    raw._kdb_source = text
    if len(devs) < len(ctx.devices):
        raw._kdb_devices, raw._kdb_built = ctx.devices, list(devs)
    raw.build(opt_bytes, devs)
    if wants_arg_info and not _keeps_arg_info(raw):
        dev_ptrs = tuple(d.int_ptr for d in devs)
        _no_arg_info.add(dev_ptrs)
        logs.warn_once(f"no-arg-info:{dev_ptrs}", "kdb: %s gives no kernel argument "
                       "information for a program created from binaries: programs built "
                       "with -cl-kernel-arg-info are compiled from source on it, not loaded "
                       "from kdb", devs[0].platform.name)
        return None
    return raw


def _wrap(raw, wrapper: cl.Program | None) -> cl.Program:
    if wrapper is None:
        return cl.Program(raw)
    wrapper._prg = raw
    wrapper._build_duration_info = None
    return wrapper



# -- install ------------------------------------------------------------------------------

_original_build = None


def install(db: KernelDB | None = None) -> None:
    """Route every ``pyopencl.Program(ctx, source).build()`` through kdb (idempotent)."""
    global _original_build
    if _original_build is not None:
        return
    _original_build = cl.Program.build

    def build(self, options=None, devices=None, cache_dir=None):  # noqa: ARG001 - pyopencl's signature
        # __dict__, not getattr: pyopencl's __getattr__ would try a kernel named "_source".
        # A program from source built before is built again through kdb, as a new build of
        # its source with these options: the cl_program kdb handed out stays as its key
        # says (pyopencl would rebuild that very cl_program).
        source = self.__dict__.get("_source")
        if source is None or "_context" not in self.__dict__:
            return _original_build(self, options, devices, cache_dir)
        from pyopencl.tools import is_spirv

        if isinstance(source, bytes) and is_spirv(source):
            return _original_build(self, options, devices, cache_dir)
        if not source.strip():  # no kernel to keep: pyopencl builds it, as without kdb
            return _original_build(self, options, devices, cache_dir)
        ctx = self._context
        return _build(ctx, source, options, devices, db, None, None, pyopencl_errors=True,
                      wrapper=self)

    build.__doc__ = _original_build.__doc__
    build.__wrapped__ = _original_build
    cl.Program.build = build


def uninstall() -> None:
    """Undo :func:`install`."""
    global _original_build
    if _original_build is not None:
        cl.Program.build = _original_build
        _original_build = None


def installed() -> bool:
    return _original_build is not None


def _keep_early_at_exit() -> None:
    """:func:`.early.at_exit` where a miss noted builds (``_stores`` set; :mod:`.early` is
    imported by that miss), registered with this module, before any hook a miss registers."""
    if _stores is not None:
        from . import early

        early.at_exit()


lifecycle.on_exit(lifecycle.STORES, _keep_early_at_exit)


def __getattr__(name: str):
    """``rebuild_and_store``, which the store worker finds here (:mod:`kdb.registry`):
    imported from :mod:`.stores` when asked for, as a hit never needs it."""
    if name == "rebuild_and_store":
        from .stores import rebuild_and_store

        return rebuild_and_store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# KDB_AUTO's hook saw pyopencl imported by this very module, before install() existed
# (kdb.adopt.auto.adopt_pyopencl): install now that it does.
if globals().pop("_install_when_imported", False):
    install()

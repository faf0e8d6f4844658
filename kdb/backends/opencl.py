"""OpenCL through pyopencl: arch ids, compiler identity, and builds served from kdb.

``build(ctx, source, options)`` returns a built :class:`pyopencl.Program`. On a hit in every
device's tier it is created from the stored binaries (``clCreateProgramWithBinary``, ~1 ms
on PoCL); otherwise it is built from source and returned at once, and a job describing the
build goes to the store worker (:mod:`kdb.spool`), which builds it again, reads
``CL_PROGRAM_BINARIES`` (seconds on PoCL) and stores them: :func:`store_job`.

``install()`` routes every ``pyopencl.Program(ctx, source).build()`` through the same path;
programs from binaries or IL, ``compile()`` and ``link_program()`` pass through untouched.
"""

from __future__ import annotations

import functools
import os
import platform as _platform
import re
import shlex
import time
import weakref
from pathlib import Path
from typing import Any, Sequence

import pyopencl as cl

from .. import config, logs
from ..claims import Claim
from ..db import DEFAULT_DB_VARIABLES, KernelDB, default_db
from ..digests import library_id
from ..errors import CompileError, InvalidArgumentError, UnsupportedTypeError
from ..includes import header_digests, split_include_options
from ..keys import HashAttributes
from .clbinaries import library_of, program_binaries
from .common import label, source_text

log = logs.get("kdb")
BACKEND = "opencl"

#: Variables that change what OpenCL compilers produce; their values enter the key. Sorted,
#: as the key wants its pairs.
ENV_VARS = tuple(sorted((
    "POCL_EXTRA_BUILD_FLAGS", "POCL_WORK_GROUP_METHOD", "POCL_WORK_GROUP_SPECIALIZATION",
    "POCL_MAX_WORK_GROUP_SIZE", "POCL_VECTORIZER_PREFER_SCALAR", "POCL_FORCE_FLOAT_DENORMALS",
    "AMD_OCL_BUILD_OPTIONS", "AMD_OCL_BUILD_OPTIONS_APPEND", "CL_CONFIG_CPU_TARGET_ARCH",
    "IGC_ExtraOCLOptions", "IGC_ExtraOCLInternalOptions",
)))

_KERNEL_RE = re.compile(r"\b(?:__kernel|kernel)\s+(?:__attribute__\s*\(\(.*?\)\)\s*)*void\s+(\w+)")
_HSTR_RE = re.compile(r"HSTR:\s*(\S+)")
_SAFE_RE = re.compile(r"[^a-z0-9_.+-]+")
# shlex.split lexes in Python one character at a time (16 s for a 1 MB option string); with
# no quote or escape in the string its answer is a split on its four whitespace characters.
_QUOTING_RE = re.compile(r"[\"'\\]")
_SPACE_RE = re.compile(r"[ \t\r\n]+")


# -- device identity ----------------------------------------------------------------------

def _slug(text: str) -> str:
    return _SAFE_RE.sub("-", text.lower()).strip("-._+") or "unknown"


@functools.lru_cache(maxsize=None)
def _arch_of_ptr(ptr: int, device: cl.Device) -> str:
    version = device.version
    m = _HSTR_RE.search(version)
    if m:  # PoCL: "HSTR: pthread-x86_64-unknown-linux-gnu-znver3"
        parts = m.group(1).split("-")
        if len(parts) >= 5:
            return config.check_arch(_slug(f"pocl-{parts[-5]}-{parts[-1]}"))
        return config.check_arch(_slug("pocl-" + m.group(1)))
    try:
        major = device.compute_capability_major_nv
        minor = device.compute_capability_minor_nv
        return f"sm_{major}{minor}"
    except (cl.LogicError, AttributeError, cl.RuntimeError):
        pass
    name = device.name
    if name.startswith("gfx"):  # AMD: "gfx90a:sramecc+:xnack-"
        return config.check_arch(_slug(name.replace(":", "_")))
    return config.check_arch(_slug(f"{device.platform.vendor.split()[0]}-{name}"))


def arch_of(device: cl.Device) -> str:
    """The arch id of a device: its binary-compatibility class (DESIGN section 2)."""
    return _arch_of_ptr(device.int_ptr, device)


@functools.lru_cache(maxsize=None)
def _identity_of_ptr(ptr: int, device: cl.Device, memo_dir: str) -> tuple:
    plat = device.platform
    ident = [
        ("platform", plat.name),
        ("platform_version", plat.version),
        ("device_version", device.version),
        ("driver_version", device.driver_version),
        ("opencl_c_version", getattr(device, "opencl_c_version", "")),
    ]
    lib = library_of(plat.int_ptr) or library_of(device.int_ptr)
    if lib:
        try:
            ident.append(("library", library_id(lib, Path(memo_dir))))
        except OSError as err:
            log.debug("kdb: cannot digest %s: %s", lib, err)
    return tuple(sorted(ident))  # the key's order: HashAttributes.normalized takes it as is


def compiler_identity(device: cl.Device, memo_dir: str | None = None) -> tuple:
    """Compiler identity: platform, versions, and the ICD library's build ID (or sha256)."""
    memo = memo_dir or str(config.cache_root())
    return _identity_of_ptr(device.int_ptr, device, memo)


def device_details(device: cl.Device) -> dict[str, Any]:
    """Machine-local facts kept beside an entry for ``kdb explain``, never in the key."""
    return {
        "device": device.name,
        "vendor": device.vendor,
        "platform": device.platform.name,
        "driver_version": device.driver_version,
        "library": library_of(device.platform.int_ptr) or "",
        "host": _platform.node(),
    }


def environment(values: tuple[str | None, ...] | None = None) -> tuple[tuple[str, str], ...]:
    """The compiler-relevant environment variables that are set, sorted by name
    (``values``: theirs in ENV_VARS order, when the caller has read them already)."""
    # Named lookups only: iterating os.environ costs ~0.15 ms, per build, on the hit path.
    if values is None:
        values = config.environ_values(ENV_VARS)
    return tuple((k, v) for k, v in zip(ENV_VARS, values) if v is not None)


def kernel_names(source: str) -> list[str]:
    """Kernel function names in OpenCL C source (for labels).

    >>> kernel_names("__kernel void add(int a) {} kernel void mul() {}")
    ['add', 'mul']
    """
    return _KERNEL_RE.findall(source)


def _label(source: str) -> str:
    return label(_KERNEL_RE, source, "program")


# -- options ------------------------------------------------------------------------------

def split_options(options: str | Sequence[str] | None) -> list[str]:
    """Options as a list, the way pyopencl splits them."""
    if options is None:
        return []
    if isinstance(options, str):
        if not _QUOTING_RE.search(options):  # shlex's answer, without its per-character lexer
            stripped = options.strip(" \t\r\n")
            return _SPACE_RE.split(stripped) if stripped else []
        try:
            return shlex.split(options)
        except ValueError as err:  # "No closing quotation": a KdbError, still a ValueError
            raise InvalidArgumentError(
                f"build options {options[:80]!r} cannot be split like a shell line ({err}); "
                "close the quote or pass the options as a list") from None
    out = []
    for opt in _items(options, "build options"):
        if not isinstance(opt, str):
            raise UnsupportedTypeError(
                f"build options must be strings; got {type(opt).__name__} ({opt!r})")
        out.append(opt)
    return out


def _items(values: Any, what: str) -> list:
    try:
        return list(values)
    except TypeError:
        raise UnsupportedTypeError(
            f"{what} must be a string or a list of strings, not {type(values).__name__}"
        ) from None


def internal_options(ctx: cl.Context) -> list[str]:
    """The options pyopencl adds to every build (its include dir, per-platform, env)."""
    return _internal_options(ctx.devices[0])


@functools.lru_cache(maxsize=None)
def _platform_name_of_ptr(ptr: int, device: cl.Device) -> str:
    return device.platform.name


def _internal_options(device: cl.Device, forced: str | None = None) -> list[str]:
    opts: list[str] = []
    opts += list(getattr(cl, "_DEFAULT_BUILD_OPTIONS", []))
    opts += list(getattr(cl, "_DEFAULT_INCLUDE_OPTIONS", []))
    platform = _platform_name_of_ptr(device.int_ptr, device)
    opts += list(getattr(cl, "_PLAT_BUILD_OPTIONS", {}).get(platform, []))
    if forced is None:
        forced = os.environ.get("PYOPENCL_BUILD_OPTIONS")
    if forced:
        opts += forced.split()
    return opts


def _options_bytes(options: list[str]) -> bytes:
    """The option string exactly as pyopencl would hand it to ``clBuildProgram``."""
    to_bytes = getattr(cl, "_options_to_bytestring", None)
    if to_bytes is not None:
        return to_bytes(options)
    return " ".join(options).encode("utf-8")


def attributes_for(device: cl.Device, source: str, user_options: list[str],
                   added_options: list[str], name: str = "", arch: str | None = None,
                   memo_dir: str | None = None) -> HashAttributes:
    """The hash attributes of building ``source`` for ``device`` with these options."""
    user_rest, added_rest, include_dirs = _split_options(user_options, added_options)
    dirs = [os.path.abspath(d) for d in include_dirs]
    return HashAttributes.normalized(
        backend=BACKEND,
        source=source,
        arch=arch or arch_of(device),
        build_options=user_rest,
        internal_options=added_rest,
        headers=header_digests(source, dirs),
        compiler=compiler_identity(device, memo_dir),
        environment=environment(),
        name=name,
    )


def _split_options(user: list[str], added: list[str]) -> tuple[tuple, tuple, tuple]:
    """``(user options, added options, include dirs)``: ``-I`` options enter the key as the
    headers they find, never as paths (the dirs are relative to the cwd of the build)."""
    user_rest, user_dirs = split_include_options(user)
    added_rest, added_dirs = split_include_options(added)
    return tuple(user_rest), tuple(added_rest), (*user_dirs, *added_dirs)


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
            f"OpenCL build of {name or _label(_text(source))} failed; fix the kernel source "
            "or options shown below", log=str(err), options=tuple(split_options(options)),
        ) from err


def _text(source: str | bytes) -> str:
    return source_text(source, "OpenCL")


class _Plan:
    """What the builds on one context share while their options and environment do not
    change: devices, split options, arch ids, compiler identities.

    On a warm start each build is ~0.6 ms of PoCL, after which the Python around it runs
    with cold caches: working these out on every build cost ~35 us of the ~160 us kdb adds
    to one. Plans live as long as their context object (an ``int_ptr`` can be reused).
    """

    __slots__ = ("devs", "dev_ptrs", "user_rest", "include_dirs", "added_rest", "opt_bytes",
                 "archs", "compilers", "environment")

    def __init__(self, ctx, devices, options, arch, memo: str, env: tuple) -> None:
        self.devs = list(devices) if devices is not None else list(ctx.devices)
        self.dev_ptrs = tuple(d.int_ptr for d in self.devs)
        user = split_options(options)
        added = _internal_options(self.devs[0], env[-1])
        self.opt_bytes = _options_bytes(user + added)
        self.user_rest, self.added_rest, self.include_dirs = _split_options(user, added)
        self.archs = [arch or arch_of(d) for d in self.devs]
        self.compilers = [compiler_identity(d, memo) for d in self.devs]
        self.environment = environment(env)  # zip stops at PYOPENCL_BUILD_OPTIONS


#: Per context object: plans by (devices, options, arch, cache root, environment).
_plans: "weakref.WeakKeyDictionary[cl.Context, dict[tuple, _Plan]]" = weakref.WeakKeyDictionary()

#: The variables a build reads, in one config.environ_values call.
_BUILD_VARIABLES = DEFAULT_DB_VARIABLES + ENV_VARS + ("PYOPENCL_BUILD_OPTIONS",)
_N_DB = len(DEFAULT_DB_VARIABLES)


def _plan_for(ctx, devices, options, arch, memo: str, env: tuple) -> _Plan:
    try:
        key = (None if devices is None else tuple(d.int_ptr for d in devices),
               options if options is None or isinstance(options, str) else tuple(options),
               arch, memo, env)
        per_ctx = _plans.get(ctx)
        plan = per_ctx.get(key) if per_ctx is not None else None
    except TypeError:  # unhashable options or devices: no plan kept; the checks below say why
        return _Plan(ctx, devices, options, arch, memo, env)
    if plan is None:
        plan = _Plan(ctx, devices, options, arch, memo, env)
        if per_ctx is None:
            per_ctx = _plans[ctx] = {}
        if len(per_ctx) > 256:  # options generated per build: keep the memory bounded
            per_ctx.clear()
        per_ctx[key] = plan
    return plan


def _build(ctx, source, options, devices, db, name, arch, *, pyopencl_errors: bool,
           wrapper: cl.Program | None = None) -> cl.Program:
    values = config.environ_values(_BUILD_VARIABLES)
    db = db or default_db(values[:_N_DB])
    text = _text(source)
    plan = _plan_for(ctx, devices, options, arch, str(db.cache_root), values[_N_DB:])
    devs, opt_bytes = plan.devs, plan.opt_bytes
    dirs = [os.path.abspath(d) for d in plan.include_dirs]  # per build: the cwd may change
    headers = header_digests(text, dirs)
    # Unlabelled until a miss: a hit never shows the label, and finding it scans the source.
    attrs = [HashAttributes.normalized(BACKEND, text, a, plan.user_rest, plan.added_rest,
                                       headers, c, plan.environment, name or "")
             for a, c in zip(plan.archs, plan.compilers)]
    memory_key = (ctx.int_ptr, plan.dev_ptrs, tuple(a.key for a in attrs))
    built = _compiled.get(memory_key)
    if built is not None:  # compiled by this process, its binaries not read back yet
        return _wrap(built, wrapper)

    hits: list = [None] * len(attrs)
    held: dict[str, Claim] = {}
    if not db.disabled:
        hits = [db.lookup(a) for a in attrs]
        if not all(hits):  # single flight: claim what missed, or wait for its compiler
            hits, held = _claim_or_wait(db, attrs, hits)
        if all(hits):
            try:
                raw = _load(ctx, devs, [h.binary for h in hits], text, opt_bytes)
                return _wrap(raw, wrapper)
            except (cl.RuntimeError, cl.LogicError) as err:
                for a, h in zip(attrs, hits):
                    if h.tier in ("user", "shared", "memory"):
                        db.discard(a.with_(name=name or _label(text)),
                                   f"the driver refused the stored binary ({err})", h.tier)
                hits = [None] * len(attrs)  # rebuilt from source and stored again

    start = time.perf_counter()
    try:
        raw = cl._Program(ctx, text)
        if pyopencl_errors and wrapper is not None:
            # As pyopencl's own uncached build does: the options appended to the message.
            wrapper._build_and_catch_errors(lambda: raw.build(opt_bytes, devs),
                                            options_bytes=opt_bytes)
        else:
            raw.build(opt_bytes, devs)
    except BaseException:
        for claim in held.values():
            claim.release()
        raise
    seconds = time.perf_counter() - start
    prg = _wrap(raw, wrapper)
    label = name or _label(text)
    attrs = [a if a.name == label else a.with_(name=label) for a in attrs]
    # Store only what missed, once per key (devices of one class share a key).
    missed: dict[str, tuple] = {}
    for d, a, h in zip(devs, attrs, hits):
        if h is None:
            missed.setdefault(a.key, (d, a))
    for key in set(held) - set(missed):  # claimed, then served another way: let go
        held.pop(key).release()
    if missed and not db.disabled:
        _compiled[memory_key] = raw
    _store_later(db, raw, [d for d, _ in missed.values()], [a for _, a in missed.values()],
                 seconds, held, forget=memory_key, program=_program_spec(text, opt_bytes, devs))
    return prg


def _program_spec(text: str, opt_bytes: bytes, devs: list) -> dict | None:
    """How the store worker can build this program again (:mod:`kdb.spool`): ``devices``
    in the build's order, as ``(name, index among the platform's devices)``; None when it
    cannot (sub-devices, which it could not find again)."""
    try:
        platform = devs[0].platform
        roots = [d.int_ptr for d in platform.get_devices()]
        where = [(d.name, roots.index(d.int_ptr)) for d in devs]
        options = bytes(opt_bytes).decode("latin-1")
        cwd = os.getcwd()
    except (ValueError, TypeError, OSError, cl.Error):  # OSError: a deleted working directory
        return None
    return {"source": text, "options": options, "platform": platform.name,
            "devices": where, "cwd": cwd, "ptrs": [d.int_ptr for d in devs]}


def _claim_or_wait(db: KernelDB, attrs: list[HashAttributes], hits: list):
    """For each missed key: a hit published by another process meanwhile, or our claim."""
    hits = list(hits)
    held: dict[str, Claim] = {}
    for i, (a, h) in enumerate(zip(attrs, hits)):
        if h is not None or a.key in held:
            continue
        got = db.claim_or_wait(a)
        if isinstance(got, Claim):
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

    def get_info(self, arg):
        if arg == cl.program_info.SOURCE:
            return self._kdb_source
        return super().get_info(arg)


def _load(ctx, devs, binaries: list[bytes], text: str, opt_bytes: bytes) -> cl._Program:
    raw = _StoredProgram(ctx, devs, binaries)
    raw._kdb_source = text
    raw.build(opt_bytes, devs)
    return raw


def _wrap(raw, wrapper: cl.Program | None) -> cl.Program:
    if wrapper is None:
        return cl.Program(raw)
    wrapper._prg = raw
    wrapper._build_duration_info = None
    return wrapper


#: The memory tier: programs this process built from source, keyed by (context, devices,
#: keys). A repeated build is served at once instead of compiling again or waiting on this
#: process's own claim; their binaries are stored by the store worker.
_compiled: dict[tuple, object] = {}


def _store_later(db: KernelDB, raw, devs, attrs: list[HashAttributes], seconds: float,
                 held: dict[str, Claim], forget: tuple = (), program: dict | None = None) -> None:
    """Record the compile now; hand the store to the store worker (:mod:`kdb.spool`), or, with
    ``KDB_STORE_AT_EXIT=wait`` or no worker possible, to the background thread."""
    per_device = seconds / max(len(devs), 1)
    ptrs = program.pop("ptrs") if program is not None else []
    recs = [db.record_compile(a, per_device) for a in attrs]
    if not attrs or db.disabled or not db.can_store(attrs[0].arch):
        for claim in held.values():
            claim.release()
        return
    if program is not None and all(d.int_ptr in ptrs for d in devs) and _detach():
        job = {"kind": "store", "backend": BACKEND, "seconds": seconds, "program": program,
               "entries": [{"device": ptrs.index(d.int_ptr), "key": a.key, "name": a.name,
                            "attributes": a.encoded().decode("utf-8"), "seconds": per_device,
                            "details": device_details(d)} for d, a in zip(devs, attrs)],
               "logs": [list(rec) for rec in recs]}
        claims = [held.pop(a.key) for a in attrs if a.key in held]

        def store_now() -> None:
            """Another process waits for one of these keys while this one still holds the
            program (ranks starting together): store it from here, no rebuild, no worker."""
            binaries = program_binaries(raw)
            db.store([(a, binaries[d.int_ptr], per_device, device_details(d))
                      for d, a in zip(devs, attrs) if binaries.get(d.int_ptr)], recs)

        if db.spool(job, claims, store_now):
            return
        held.update((c.key, c) for c in claims)
    binaries: dict[int, bytes] | None = None

    def produce_for(ptr: int):
        def produce() -> bytes | None:
            nonlocal binaries
            if binaries is None:
                try:
                    binaries = program_binaries(raw)
                except Exception as err:  # noqa: BLE001 - storing is best effort
                    log.warning("kdb: could not read program binaries: %s", err)
                    binaries = {}
                finally:
                    # From here the bytes are in KernelDB's in-flight map, then the user file.
                    _compiled.pop(forget, None)
            return binaries.get(ptr) or None
        return produce

    for d, a, rec in zip(devs, attrs, recs):
        db.put_later(a, produce_for(d.int_ptr), compile_seconds=per_device,
                     details=device_details(d), log=rec, claim=held.pop(a.key, None))


def _detach() -> bool:
    """Whether stores go to the store worker (``KDB_STORE_AT_EXIT=detach``, the default)."""
    return config.store_at_exit() == "detach"


def store_job(db: KernelDB, job: dict) -> None:
    """The store worker's half (:mod:`kdb.spool`): build the program again (PoCL's cache
    answers), read its binaries and store each entry with its latency rows."""
    from ..store import CompileRecord

    prog = job["program"]
    plats = [p for p in cl.get_platforms() if p.name == prog["platform"]]
    if not plats:
        raise LookupError(f"no OpenCL platform named {prog['platform']!r}")
    plat_devs = plats[0].get_devices()
    devs = []
    for name, index in prog["devices"]:
        if index >= len(plat_devs) or plat_devs[index].name != name:
            raise LookupError(f"no device {name!r} at index {index} of {prog['platform']!r}")
        devs.append(plat_devs[index])
    if prog.get("cwd"):
        os.chdir(prog["cwd"])  # relative -I paths
    ctx = cl.Context(devs)
    raw = cl._Program(ctx, prog["source"])
    raw.build(prog["options"].encode("latin-1"), devs)
    binaries = program_binaries(raw)
    items = []
    for e in job["entries"]:
        binary = binaries.get(devs[e["device"]].int_ptr)
        if binary:
            attrs = HashAttributes.from_canonical(e["attributes"], name=e["name"])
            items.append((attrs, binary, e["seconds"], e["details"]))
    db.store(items, [CompileRecord(*row) for row in job.get("logs", [])])
    if len(items) < len(job["entries"]):
        raise LookupError(f"the driver returned no binary for {len(job['entries']) - len(items)}"
                          " device(s)")


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
        source = self.__dict__.get("_source")
        if self.__dict__.get("_prg") is not None or source is None:
            return _original_build(self, options, devices, cache_dir)
        from pyopencl.tools import is_spirv

        if isinstance(source, bytes) and is_spirv(source):
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

"""OpenCL keys: a device's arch id and compiler identity, a build's options, and the plan
that holds them for the builds on one context.

Everything here is what a lookup needs before it touches a database; :mod:`.opencl` builds,
:mod:`.stores` stores.
"""

from __future__ import annotations

import functools
import os
import platform as _platform
import re
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyopencl as cl

from ... import config, logs
from ...db import DEFAULT_DB_VARIABLES
from ..digests import library_id
from ...errors import InvalidArgumentError, UnsupportedTypeError
from ..cloptions import key_options, parse_search
from ..includes import IncludeSearch, read_headers, temporal_options
from ...keys import HashAttributes
from . import archs
from .binaries import library_of
from .poclbin import pocl_cache_dir
from .tempincludes import temporary_dirs
from ..common import LazyPattern, label

log = logs.get("kdb")
BACKEND = "opencl"

#: Intel's CPU runtime's settings that change what its compiler produces (read from the
#: environment, else from ``cl.cfg`` beside its library: :func:`intel_settings`).
#: ``CL_CONFIG_USE_FAST_RELAXED_MATH=True`` builds every program as ``-cl-fast-relaxed-math``
#: does (the same binary): ``x * 0.0f`` is 0 there for an infinite ``x``, not NaN.
#: ``CL_CONFIG_USE_VECTORIZER=False`` gives another binary too.
INTEL_CODEGEN_VARS = (
    "CL_CONFIG_USE_FAST_RELAXED_MATH", "CL_CONFIG_USE_VECTORIZER", "CL_CONFIG_CPU_VECTORIZER_MODE",
    "CL_CONFIG_CPU_RT_LOOP_UNROLL_FACTOR", "CL_CONFIG_CPU_STREAMING_ALWAYS",
    "CL_CONFIG_CPU_EXPENSIVE_MEM_OPT", "CL_CONFIG_LLVM_OPTIONS", "CL_CONFIG_LTO_PM",
    "CL_CONFIG_CPU_REQD_SUB_GROUP_SIZE", "CL_CONFIG_CPU_SUB_GROUP_CONSTRUCTION",
    "CL_CONFIG_CPU_FORCE_LOCAL_MEM_SIZE", "CL_CONFIG_CPU_FORCE_MAX_WORK_GROUP_SIZE",
    "CL_CONFIG_REPLACE_IR_BEFORE_OPTIMIZER", "CL_CONFIG_REPLACE_IR_AFTER_OPTIMIZER",
    "CL_CONFIG_USE_TRAPPING", "CL_CONFIG_USE_VTUNE",
    # Vectorizes -cl-opt-disable builds (another binary; the runtime's strings name it).
    "CL_CONFIG_CPU_O0_VECTORIZATION",
)

#: Variables that change what OpenCL compilers produce; their values enter the key. Sorted,
#: as the key wants its pairs.
ENV_VARS = tuple(sorted((
    "POCL_EXTRA_BUILD_FLAGS", "POCL_WORK_GROUP_METHOD", "POCL_WORK_GROUP_SPECIALIZATION",
    "POCL_MAX_WORK_GROUP_SIZE", "POCL_VECTORIZER_PREFER_SCALAR", "POCL_FORCE_FLOAT_DENORMALS",
    # How PoCL makes a kernel's work-group function (in a binary read after launches), and
    # the builtin library it links: libpocl's own strings name them (PoCL 3.1).
    "POCL_FORCE_PARALLEL_OUTER_LOOP", "POCL_FULL_REPLICATION_THRESHOLD",
    "POCL_WILOOPS_MAX_UNROLL_COUNT", "POCL_KERNELLIB_NAME", "POCL_ENABLE_UNINIT",
    "AMD_OCL_BUILD_OPTIONS", "AMD_OCL_BUILD_OPTIONS_APPEND", "CL_CONFIG_CPU_TARGET_ARCH",
    "IGC_ExtraOCLOptions", "IGC_ExtraOCLInternalOptions", *INTEL_CODEGEN_VARS,
    # Oclgrind adds it to every build, as PoCL does POCL_EXTRA_BUILD_FLAGS: a binary built
    # with -DX=2 in it was served to a process without it (liboclgrind names it).
    "OCLGRIND_BUILD_OPTIONS",
)))

# Attribute arguments nest two deep ((reqd_work_group_size(WG(1), 1, 1))), each written as
# "runs of [^()] between groups": one way to match any text, so a miss backtracks linearly.
_KERNEL_RE = LazyPattern(r"\b(?:__kernel|kernel)\s+(?:__attribute__\s*\(\([^()]*(?:\([^()]*"
                          r"(?:\([^()]*\)[^()]*)*\)[^()]*)*\)\)\s*)*void\s+(\w+)")
# shlex.split lexes in Python one character at a time (slow on long option strings); with
# no quote or escape in the string its answer is a split on its four whitespace characters.
_QUOTING_RE = re.compile(r"[\"'\\]")
_SPACE_RE = re.compile(r"[ \t\r\n]+")


# -- device identity ----------------------------------------------------------------------

_slug = archs.slug


@functools.lru_cache(maxsize=None)
def _arch_of_ptr(ptr: int, device: cl.Device) -> str:
    hstr = archs.hstr(device.version)
    if hstr:  # PoCL: "HSTR: pthread-x86_64-unknown-linux-gnu-znver3"
        return archs.pocl_arch(hstr)
    try:
        major = device.compute_capability_major_nv
        minor = device.compute_capability_minor_nv
        return f"sm_{major}{minor}"
    except (cl.LogicError, AttributeError, cl.RuntimeError):
        pass
    name = device.name
    if name.startswith("gfx"):  # AMD: "gfx90a:sramecc+:xnack-"
        return config.check_arch(_slug(name.replace(":", "_")))
    plat = device.platform
    if device.type & cl.device_type.CPU:  # the instruction set its compiler targets
        return archs.cpu_arch(plat.vendor, library_of(plat.int_ptr))
    return config.check_arch(_slug(f"{plat.vendor.split()[0]}-{name}"))


def arch_of(device: cl.Device) -> str:
    """The arch id of a device: its binary-compatibility class (docs/design.md section 1)."""
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
        settings = intel_settings(lib)
        if settings:
            ident.append(("cl.cfg", settings))
    kernellib = _pocl_kernellib(plat.version, device.version)
    if kernellib:
        ident.append(("pocl_kernellib", kernellib))
    return tuple(sorted(ident))


def _pocl_kernellib(platform_version: str, device_version: str) -> str | None:
    """The built-in library a "distro" PoCL links for an x86-64 CPU device
    (:func:`archs.pocl_kernellib`); None for any other device."""
    hstr = archs.hstr(device_version)
    if not hstr or "DISTRO" not in platform_version or "-x86_64-" not in hstr:
        return None
    return archs.pocl_kernellib(set(archs.host_flags()))  # sorted, as the key wants its pairs


def intel_settings(library: str) -> str:
    """What ``cl.cfg`` beside Intel's CPU runtime (``libintelocl``) sets of
    :data:`INTEL_CODEGEN_VARS`, as ``name=value`` lines sorted by name: the runtime reads the
    file at start and lets the environment (which the key holds already) override it, so an
    edited ``cl.cfg`` (relaxed math switched on for every program) is another compiler.
    Empty for any other library, or where the file cannot be read.

    >>> intel_settings("/opt/pocl/libpocl.so.2")
    ''
    """
    if not os.path.basename(library).startswith("libintelocl"):
        return ""
    found = archs.intel_cfg(library)
    return "\n".join(f"{k}={found[k]}" for k in sorted(found) if k in INTEL_CODEGEN_VARS)


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


def environment(variables: Mapping[str, str | None] | None = None
                ) -> tuple[tuple[str, str], ...]:
    """The compiler-relevant environment variables that are set, sorted by name
    (``variables``: a mapping holding at least :data:`ENV_VARS`, when the caller has read
    them already through :func:`kdb.config.read_variables`)."""
    # Named lookups only: iterating the whole environment would cost more than a hit.
    if variables is None:
        variables = config.read_variables(ENV_VARS)
    return tuple((k, v) for k in ENV_VARS if (v := variables[k]) is not None)


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
            import shlex  # quoted options only: most builds never load it

            return shlex.split(options)
        except ValueError as err:  # "No closing quotation": a KdbError, still a ValueError
            raise InvalidArgumentError(
                f"build options {options[:80]!r} cannot be split like a shell line ({err}); "
                "close the quote or pass the options as a list") from None
    if isinstance(options, (bytes, bytearray)):  # iterated, they would be numbers
        raise UnsupportedTypeError(
            f"build options must be a str or a list of str; got {type(options).__name__} "
            f"({bytes(options)[:80]!r}): decode them first")
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
        forced = config.read_variables(_FORCED)[_FORCED[0]]
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
    """The hash attributes of building ``source`` for ``device`` with these options.

    Raises :class:`kdb.backends.includes.UncertainIncludes` where kdb cannot be sure which headers
    the build reads (such a build is not cached).
    """
    user_rest, added_rest = _split_options(user_options, added_options)
    env = environment()
    return HashAttributes(
        backend=BACKEND,
        source=source,
        arch=arch or arch_of(device),
        build_options=user_rest,
        internal_options=added_rest,
        headers=headers_of(source, _options_bytes([*user_options, *added_options]),
                           environment=env),
        compiler=compiler_identity(device, memo_dir),
        environment=env,
        name=name,
    )


#: Variables whose value an OpenCL runtime adds to every build's options (PoCL appends
#: ``POCL_EXTRA_BUILD_FLAGS``): the include options in them find headers too.
_OPTION_VARIABLES = ("AMD_OCL_BUILD_OPTIONS", "AMD_OCL_BUILD_OPTIONS_APPEND",
                     "IGC_ExtraOCLOptions", "OCLGRIND_BUILD_OPTIONS", "POCL_EXTRA_BUILD_FLAGS")


def search_of(opt_bytes: bytes, env: Sequence[tuple[str, str]] = ()) -> IncludeSearch:
    """Where a build with ``opt_bytes`` and the key's environment ``env`` finds headers:
    the options as handed to ``clBuildProgram``, then those the runtime adds from ``env``."""
    extra = [value.encode("utf-8", "surrogateescape") for name, value in env
             if name in _OPTION_VARIABLES and value.strip()]
    return parse_search(b" ".join([opt_bytes, *extra]) if extra else opt_bytes)


def headers_of(source: str, opt_bytes: bytes, cwd: str | None = None,
               search: IncludeSearch | None = None,
               environment: Sequence[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    """The key's ``headers`` of building ``source`` with ``opt_bytes`` (the options as
    handed to ``clBuildProgram``) and the key's ``environment`` in ``cwd``: what the build
    reads, by content. The store worker checks a job's headers with this too. Raises
    :class:`kdb.backends.includes.UncertainIncludes` where kdb cannot be sure.

    PoCL compiles the program as a file in its cache directory, so its quoted includes are
    looked up there first (a header kept there was served to a process whose own was
    another); other OpenCLs find nothing there."""
    return read_headers(source, search or search_of(opt_bytes, environment), cwd,
                        main_dirs=(pocl_cache_dir(),))


def _split_options(user: list[str], added: list[str]) -> tuple[tuple, tuple]:
    """``(user options, added options)`` for the key, ``-I`` options left out as the driver
    reads the joined string: include paths enter the key as the headers they find
    (:func:`headers_of`), never as paths."""
    return tuple(key_options(user)), tuple(key_options(added))


class _Plan:
    """What the builds on one context share while their options and environment do not
    change: devices, split options, the include search, arch ids, compiler identities.

    Worked out once, not on every build: a warm build is short, and this work was a large
    part of what kdb adds to one. Plans live as long as their context object (an
    ``int_ptr`` can be reused).
    """

    __slots__ = ("devs", "dev_ptrs", "user_rest", "added_rest", "opt_bytes", "search",
                 "archs", "compilers", "environment", "temporary", "temporal", "asked")

    def __init__(self, ctx, devices, options, arch, memo: str, forced: str | None,
                 env: tuple[tuple[str, str], ...]) -> None:
        self.devs = _devices(ctx, devices)
        self.dev_ptrs = tuple(d.int_ptr for d in self.devs)
        user = split_options(options)
        added = _internal_options(self.devs[0], forced)
        self.opt_bytes = _options_bytes(user + added)
        self.search = search_of(self.opt_bytes, env)  # where the compiler finds headers
        self.user_rest, self.added_rest = _split_options(user, added)
        self.archs = [arch or arch_of(d) for d in self.devs]
        self.compilers = [compiler_identity(d, memo) for d in self.devs]
        self.environment = env
        self.temporary = temporary_dirs(self.search)  # include dirs to build from a copy
        # an option that expands to the time of the build (-DSTAMP=__TIME__): not cached
        self.temporal = temporal_options(
            " ".join((self.opt_bytes.decode("utf-8", "replace"), *(v for _, v in env))).split())
        self.asked: _Plan | None = None  # the plan as the caller asked, where copies stand in

    def with_options(self, opt_bytes: bytes) -> "_Plan":
        """This plan, building with ``opt_bytes`` (the same options for the key: include
        directories given as their copies, :mod:`.tempincludes`)."""
        other = object.__new__(_Plan)
        for name in self.__slots__:
            setattr(other, name, getattr(self, name))
        other.opt_bytes = opt_bytes
        other.search = search_of(opt_bytes, self.environment)
        other.temporary = temporary_dirs(other.search)
        other.asked = self.asked or self
        return other


#: Per context object: plans by (devices, options, arch, cache root, environment, pyopencl's
#: own options).
_plans: "weakref.WeakKeyDictionary[cl.Context, dict[tuple, _Plan]]" = weakref.WeakKeyDictionary()

#: pyopencl's own variable: options it adds to every build (they enter the key as options).
_FORCED = ("PYOPENCL_BUILD_OPTIONS",)

#: The variables a build reads, in one :func:`kdb.config.read_variables` call: the default
#: database's, the compiler's (:data:`ENV_VARS`) and pyopencl's.
BUILD_VARIABLES = DEFAULT_DB_VARIABLES + ENV_VARS + _FORCED


def _devices(ctx, devices) -> list:
    """The devices a build is for, each once: ``clBuildProgram`` builds for the program's
    every device when given none (``devices=[]``), and once for a device named twice,
    while ``clCreateProgramWithBinary`` refuses a device named twice (``INVALID_DEVICE``:
    the stored binary was dropped at every start)."""
    devs = list(ctx.devices) if devices is None else list(devices)
    if not devs:
        return list(ctx.devices)
    seen: set = set()
    return [d for d in devs if getattr(d, "int_ptr", d) not in seen
            and not seen.add(getattr(d, "int_ptr", d))]


def _pyopencl_added() -> tuple:
    """pyopencl's module-level options as they stand: a program may change them between
    builds (``cl.enable_debugging()`` adds ``-g -O0`` for AMD's platform), and a plan kept
    from before built without them."""
    plat = getattr(cl, "_PLAT_BUILD_OPTIONS", None) or {}
    return (tuple(getattr(cl, "_DEFAULT_BUILD_OPTIONS", ())),
            tuple(getattr(cl, "_DEFAULT_INCLUDE_OPTIONS", ())),
            tuple((name, tuple(opts)) for name, opts in plat.items()))


def plan_for(ctx, devices, options, arch, memo: str,
             variables: Mapping[str, str | None]) -> _Plan:
    """The plan of a build on ``ctx``, ``variables`` holding :data:`BUILD_VARIABLES`."""
    if devices is not None and not isinstance(devices, (list, tuple)):
        devices = list(devices)  # an iterator is read once: by the plan's key, then gone
    forced = variables[_FORCED[0]]
    env = environment(variables)
    try:
        key = (None if devices is None else tuple(d.int_ptr for d in devices),
               options if options is None or isinstance(options, str) else tuple(options),
               arch, memo, forced, env, _pyopencl_added())
        per_ctx = _plans.get(ctx)
        plan = per_ctx.get(key) if per_ctx is not None else None
    except TypeError:  # unhashable options or devices: no plan kept; the checks below say why
        return _Plan(ctx, devices, options, arch, memo, forced, env)
    if plan is None:
        plan = _Plan(ctx, devices, options, arch, memo, forced, env)
        if per_ctx is None:
            per_ctx = _plans[ctx] = {}
        if len(per_ctx) > 256:  # options generated per build: keep the memory bounded
            per_ctx.clear()
        per_ctx[key] = plan
    return plan



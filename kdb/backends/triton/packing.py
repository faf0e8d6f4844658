"""``kdb pack`` for Triton kernels: a manifest's kernel compiled for an explicit target, with
no GPU, into the pack's scratch database.

The kernel goes through Triton's own ``triton.compile`` with kdb as its cache manager, so the
key stored is the one Triton computes for the same source, signature, constexprs and target
at run time. A kernel launched from Python is also keyed by the specialization Triton's JIT
derives from the arguments (a pointer 16-byte aligned, an integer divisible by 16: ``"D"``);
:func:`launch_source` runs Triton's own binder on arguments that specialize as the
manifest's ``specialization`` says (default: every pointer ``"D"``, as tensors' allocations
are; every other argument ``""``), so a packed kernel is the one ``kernel[grid](...)`` looks
up, in every Triton from 3.3.
"""

from __future__ import annotations

import importlib.util
import re
import sys

from ...errors import BackendUnavailableError, CompileError, InvalidArgumentError
from . import install
from .cache import storing_into
from .targets import target

_SM = re.compile(r"sm_(\d{2,3})")
_GFX = re.compile(r"gfx[0-9a-f]{3,4}")


def gpu_target(arch: str):
    """Triton's ``GPUTarget`` for a kdb arch: ``sm_90`` (NVIDIA, 32 lanes), ``gfx942`` (AMD;
    64 lanes on gfx9, 32 on the RDNA parts)."""
    from triton.backends.compiler import GPUTarget

    m = _SM.fullmatch(arch)
    if m:
        return GPUTarget("cuda", int(m.group(1)), 32)
    if _GFX.fullmatch(arch):
        return GPUTarget("hip", arch, 64 if arch.startswith("gfx9") else 32)
    raise InvalidArgumentError(f"arch {arch!r} is not a Triton target: use sm_XX (NVIDIA, e.g. "
                               "sm_90) or gfxNNN (AMD, e.g. gfx942)")


def kernel_of(module_path: str, function: str):
    """The ``@triton.jit`` function ``function`` of the module file ``module_path``, run as
    ``python module.py`` would run it: its own directory first on the path (a helper module
    beside it is imported). A module that fails to run is a :class:`kdb.CompileError` of
    that kernel (``--keep-going`` packs the others), not a traceback of ``kdb pack``."""
    import os

    name = "_kdb_pack_" + re.sub(r"\W", "_", module_path)
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, module_path)
        if spec is None or spec.loader is None:
            raise InvalidArgumentError(f"{module_path} is not a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # Triton reads the source of the function's module
        here = os.path.dirname(os.path.abspath(module_path))
        sys.path.insert(0, here)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # noqa: BLE001 - whatever the module raises
            del sys.modules[name]
            import traceback

            raise CompileError(f"{module_path} could not be run ({type(err).__name__}: {err})",
                               log="".join(traceback.format_exception_only(err))) from err
        finally:
            if here in sys.path:
                sys.path.remove(here)
    fn = getattr(module, function, None)
    if fn is None:
        raise InvalidArgumentError(f"{module_path} defines no {function!r}")
    return fn


def launch_source(fn, signature: dict[str, str], constexprs: dict, specialization:
                  dict[str, str], gpu) -> tuple:
    """``(ASTSource, options)`` exactly as Triton's JIT makes them for ``fn[grid](...)`` with
    arguments of the manifest's types that specialize as given: Triton's own binder and
    argument packing run on stand-ins for the arguments (a pointer is an object with a
    ``data_ptr`` aligned to 16 bytes for ``"D"``, an integer is 16 or 17). What enters the
    key (which arguments carry an attribute, the options) changes from one Triton to the
    next; Triton's own code knows, a copy of it would not."""
    import triton
    from triton.compiler import ASTSource, make_backend

    backend = make_backend(gpu)
    if not hasattr(backend, "parse_attr"):  # Triton 3.2 keys a launch by AttrsDescriptor
        raise BackendUnavailableError(
            f"kdb pack compiles a manifest's Triton kernels with Triton 3.3 or newer, as a "
            f"launch keys them; this is Triton {triton.__version__}. Upgrade Triton (pip "
            f"install 'triton>=3.3'), or pack the kernels a run compiled: kdb pack --from-log "
            f"(or --from-db)")
    from triton.runtime.jit import create_function_from_signature

    defaults = {p.name for p in fn.params if p.is_constexpr and p.has_default}
    args = [_stand_in(name, signature.get(name, ""), specialization.get(name))
            for name in fn.arg_names if name not in constexprs
            and not (name in defaults and signature.get(name, "constexpr") == "constexpr")]
    kwargs = _run_options()
    try:
        bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(
            *args, **constexprs, **kwargs)
    except ImportError as err:  # Triton 3.6's AMD backend asks torch about every tensor
        raise BackendUnavailableError(
            f"Triton {triton.__version__} keys a launch for {gpu.arch} by asking torch whether "
            f"each tensor is within 2 GB ({err}): install torch (a CPU wheel does) where you "
            f"pack for it, or pack what a run compiled: kdb pack --from-log") from err
    if hasattr(fn, "_pack_args"):  # Triton 3.5 on: what JITFunction.run calls
        options, sig, consts, attrs = fn._pack_args(backend, {**kwargs, **constexprs}, bound,
                                                    spec, opts)
    else:
        options, sig, consts, attrs = _pack_args_3_3(fn, backend, {**kwargs, **constexprs},
                                                     bound, spec)
    return ASTSource(fn, sig, consts, attrs), options.__dict__


def _pack_args_3_3(fn, backend, kwargs: dict, bound, spec) -> tuple:
    """Triton 3.3's and 3.4's JITFunction.run do inline what 3.5 moved into ``_pack_args``."""
    from triton._utils import find_paths_if, get_iterable_path

    options = backend.parse_options(kwargs)
    sigvals = [x[0] for x in spec]
    sig = dict(zip([p.name for p in fn.params], sigvals))
    consts = {path: get_iterable_path(list(bound.values()), path)
              for path in find_paths_if(sigvals, lambda _, v: v == "constexpr")}
    attrvals = [x[1] for x in spec]
    attrs = {k: backend.parse_attr(get_iterable_path(attrvals, k))
             for k in find_paths_if(attrvals, lambda _, x: isinstance(x, str))}
    return options, sig, consts, attrs


def _run_options() -> dict:
    """The options JITFunction.run adds to a launch's keyword arguments, in this Triton."""
    import os

    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # Triton 3.3
        return {"debug": os.environ.get("TRITON_DEBUG", "0") == "1"}
    got = {"debug": knobs.runtime.debug}  # 3.4 and 3.5: debug alone
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):  # 3.6 passes the first, 3.9 both
            got[name] = getattr(knobs.compilation, name)
    return got


class _Tensor:
    """What Triton's binder reads of a tensor: its address, its element type and, for AMD's
    buffer operations, the bytes it spans (a tensor within 2 GB, as most are)."""

    def __init__(self, ptr: int, dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr

    def ptr_range(self) -> int:
        return 1 << 20


#: A Python launch passes these types; an integer's value picks i32, i64 or u64.
_INTS = {"i32": 16, "i64": 1 << 36, "u64": 1 << 63}
#: A signature's element types as triton.language names them (the rest are the same).
_ELEMENTS = {"i1": "int1", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64",
             "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64"}


def _stand_in(name: str, kind: str, special: str | None):
    """An argument a launch from Python could pass for ``kind``, divisible by 16 (``"D"``;
    a pointer's default, as tensors' allocations are) or not (``""``)."""
    import triton.language as tl

    if kind.startswith("*"):
        divisible = special != ""
        return _Tensor((1 << 24) + (0 if divisible else 8),
                       tl.dtype(_ELEMENTS.get(kind[1:], kind[1:])))
    if kind in _INTS:
        return _INTS[kind] + (0 if special == "D" else 1)
    if kind == "fp32":
        return 0.5
    if kind == "i1":
        return True
    if kind == "constexpr":
        raise InvalidArgumentError(
            f"argument {name!r} is a constexpr with no default: give its value in the "
            "kernel's constexprs")
    raise InvalidArgumentError(
        f"argument {name!r} is of type {kind!r}, which no launch from Python passes (an "
        "integer is i32, i64 or u64, a float fp32, a bool i1, a tensor *<type>); declare "
        "it so, or as a constexpr")


def compile_spec(spec, arch: str, db) -> None:
    """Compile one manifest kernel for ``arch`` into ``db`` (a :class:`kdb.KernelDB`)."""
    import triton

    gpu = gpu_target(arch)
    fn = kernel_of(spec.module, spec.function)
    src, options = launch_source(fn, dict(spec.signature), dict(spec.constexprs),
                                 dict(spec.specialization), gpu)
    install()
    with target(gpu), storing_into(db):
        try:
            triton.compile(src, target=gpu, options=options)
        except Exception as err:  # noqa: BLE001 - Triton raises its own kinds for bad kernels
            if "is not defined for option 'gpu-name'" in str(err):
                known = _ptxas_arches()
                raise InvalidArgumentError(
                    f"Triton {triton.__version__}'s ptxas does not build {arch}"
                    + (f"; it builds {', '.join(known)}" if known else "")) from None
            raise CompileError(f"Triton could not compile {spec.name} for {arch}",
                               log=f"{type(err).__name__}: {err}") from err


def _ptxas_arches() -> list[str]:
    """The ``sm_XX`` the ptxas Triton bundles builds (its ``--help``), or none found."""
    import os
    import subprocess

    try:
        import triton.backends.nvidia as nvidia

        said = subprocess.run([os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas"),
                               "--help"], capture_output=True, text=True, timeout=60).stdout
    except (ImportError, OSError, subprocess.SubprocessError):
        return []
    found = set(re.findall(r"'(sm_\d+)'", said.partition("--gpu-name")[2].partition("\n--")[0]))
    return sorted(found, key=lambda a: int(a[3:]))

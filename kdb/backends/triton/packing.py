"""``kdb pack`` for Triton kernels: a manifest's kernel compiled for an explicit target, with
no GPU, into the pack's scratch database.

The kernel goes through Triton's own ``triton.compile`` with kdb as its cache manager, so the
key stored is the one Triton computes for the same source, signature, constexprs and target
at run time. A kernel launched from Python is also keyed by the specialization Triton's JIT
derives from the arguments (a pointer 16-byte aligned, an integer divisible by 16: ``"D"``);
:func:`attrs_for` states it as the JIT would for the manifest's ``specialization`` (default:
every pointer ``"D"``, as tensors' allocations are; every other argument ``""``), so a packed
kernel is the one ``kernel[grid](...)`` looks up.
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
    """The ``@triton.jit`` function ``function`` of the module file ``module_path``."""
    name = "_kdb_pack_" + re.sub(r"\W", "_", module_path)
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, module_path)
        if spec is None or spec.loader is None:
            raise InvalidArgumentError(f"{module_path} is not a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # Triton reads the source of the function's module
        spec.loader.exec_module(module)
    fn = getattr(module, function, None)
    if fn is None:
        raise InvalidArgumentError(f"{module_path} defines no {function!r}")
    return fn


def attrs_for(fn, signature: dict[str, str], specialization: dict[str, str], gpu) -> dict:
    """The ``attrs`` Triton's JIT passes for a launch whose arguments specialize as given:
    every argument by position, its attribute key parsed by the target's backend."""
    import triton
    from triton.compiler import make_backend

    backend = make_backend(gpu)
    if not hasattr(backend, "parse_attr"):  # Triton 3.2 keys a launch by AttrsDescriptor
        raise BackendUnavailableError(
            f"kdb pack compiles a manifest's Triton kernels with Triton 3.3 or newer, as a "
            f"launch keys them; this is Triton {triton.__version__}. Upgrade Triton (pip "
            f"install 'triton>=3.3'), or pack the kernels a run compiled: kdb pack --from-log "
            f"(or --from-db)")
    return {(i,): backend.parse_attr(specialization.get(
                name, "D" if signature.get(name, "").startswith("*") else ""))
            for i, name in enumerate(fn.arg_names)}


def compile_spec(spec, arch: str, db) -> None:
    """Compile one manifest kernel for ``arch`` into ``db`` (a :class:`kdb.KernelDB`)."""
    import triton
    from triton.compiler import ASTSource

    gpu = gpu_target(arch)
    fn = kernel_of(spec.module, spec.function)
    signature = dict(spec.signature)
    src = ASTSource(fn=fn, signature=signature, constexprs=dict(spec.constexprs),
                    attrs=attrs_for(fn, signature, dict(spec.specialization), gpu))
    install()
    with target(gpu), storing_into(db):
        try:
            triton.compile(src, target=gpu)
        except Exception as err:  # noqa: BLE001 - Triton raises its own kinds for bad kernels
            raise CompileError(f"Triton could not compile {spec.name} for {arch}",
                               log=f"{type(err).__name__}: {err}") from err

"""The TOML manifest ``kdb pack`` compiles: which kernels, with which options, for which arches.

Each kernel's option list is the one a framework passes at run time, so that the keys
``kdb pack`` stores are the keys the framework will look up.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .. import config, registry
from ..errors import InvalidArgumentError


#: The compilers a kernel of each back end may name (``compiler = ...``).
COMPILERS = {"cuda": ("nvcc", "nvrtc"), "hip": ("hipcc", "hiprtc")}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of a manifest: what to compile, with which options, for which arches."""

    name: str
    source: str
    options: tuple[str, ...] = ()
    include_dirs: tuple[str, ...] = ()
    backend: str = "opencl"
    arches: tuple[str, ...] = ()  # empty: every arch being packed
    compiler: str | None = None  # CUDA: "nvcc", "nvrtc"; HIP: "hipcc", "hiprtc"; None: the
    # first of those found
    # Triton: the module file holding the @triton.jit function, its name, the argument types
    # and the constexpr values, as Triton's ASTSource takes them.
    module: str = ""
    function: str = ""
    signature: tuple[tuple[str, str], ...] = ()
    constexprs: tuple[tuple[str, object], ...] = ()
    specialization: tuple[tuple[str, str], ...] = ()

    def processors(self) -> list[str]:
        """The arches (system files) this kernel names: a HIP target ID's is its processor."""
        return [processor(a) for a in self.arches] if self.backend == "hip" else list(self.arches)

    def build_options(self) -> list[str]:
        """Options as passed to the back end: the manifest's options, then ``-I`` dirs."""
        opts = list(self.options)
        for d in self.include_dirs:
            opts += ["-I", d]
        return opts


def load_manifest(path: str | os.PathLike[str]) -> list[KernelSpec]:
    """Read a manifest. Relative ``file`` and ``include_dirs`` are relative to the manifest.

    Format::

        [defaults]                     # optional, applies to every kernel
        options = ["-cl-mad-enable"]   # put before each kernel's own options
        include_dirs = ["include"]     # passed as -I <dir> after the options
        backend = "opencl"             # or "cuda" (cross-compiled with nvcc or NVRTC), or
                                       # "hip" (hipcc or HIPRTC; code objects, no GPU needed)
        compiler = "nvrtc"             # CUDA: "nvcc" or "nvrtc" (default: nvcc where one is
                                       # found, else NVRTC); HIP: "hipcc" or "hiprtc"

        [[kernel]]
        name = "axpy"
        file = "kernels/axpy.cl"       # or: source = "..."
        options = ["-DT=float"]
        defines = { N = 64 }           # appended as -DN=64
        arches = ["pocl-x86_64-znver3"]  # optional subset; a HIP kernel's may be target
                                       # IDs ("gfx90a:sramecc+:xnack-"), each its own
                                       # code object in its processor's file (gfx90a.kdb)

        [[kernel]]                     # a Triton kernel, compiled for each arch listed
        name = "add_64"
        backend = "triton"
        file = "kernels.py"            # the module that defines the @triton.jit function
        function = "add"
        signature = { x_ptr = "*fp32", y_ptr = "*fp32", out_ptr = "*fp32", n = "i32", BLOCK = "constexpr" }
        constexprs = { BLOCK = 64 }
        specialization = { n = "D" }   # optional: what Triton's JIT sees at run time; "D":
                                       # divisible by 16 (default: pointers "D", others "")
        arches = ["sm_90", "gfx942"]   # sm_XX: NVIDIA; gfxNNN: AMD (no GPU needed)

    A kernel is built with exactly the option list a framework passes at run time
    (``options``, then ``defines``, then ``-I`` dirs), so that the keys match its lookups.
    """
    path = Path(path)
    data = _read_toml(path)
    base = path.resolve().parent
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict) or set(defaults) - {"options", "include_dirs", "backend",
                                                          "compiler"}:
        raise InvalidArgumentError(f"manifest {path}: [defaults] may hold only 'options', "
                                   "'include_dirs', 'backend' and 'compiler'")
    if "compiler" in defaults and not any(defaults["compiler"] in c for c in COMPILERS.values()):
        raise InvalidArgumentError(f"manifest {path}: [defaults] compiler "
                                   f"{defaults['compiler']!r} is none kdb runs: 'nvcc' or "
                                   "'nvrtc' (CUDA), 'hipcc' or 'hiprtc' (HIP)")
    kernels = data.get("kernel", [])
    if not isinstance(kernels, list) or not kernels:
        raise InvalidArgumentError(f"manifest {path} lists no [[kernel]] tables")
    specs, names = [], set()
    for i, k in enumerate(kernels):
        where = f"manifest {path}, kernel #{i + 1}"
        if not isinstance(k, dict):
            raise InvalidArgumentError(f"{where}: expected a table")
        unknown = set(k) - {"name", "file", "source", "options", "defines", "include_dirs",
                            "backend", "arches", "compiler", "function", "signature",
                            "constexprs", "specialization"}
        if unknown:
            raise InvalidArgumentError(f"{where}: unknown keys {sorted(unknown)}")
        name = k.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"{where}: 'name' (a string) is required")
        if name in names:
            raise InvalidArgumentError(f"{where}: duplicate kernel name {name!r}")
        names.add(name)
        specs.append(_spec(k, name, base, defaults, where))
    return specs


def _read_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidArgumentError(f"manifest {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(f"manifest {path} is not valid TOML: {err}") from err


def _spec(k: dict, name: str, base: Path, defaults: dict, where: str) -> KernelSpec:
    """One ``[[kernel]]`` table, checked, with the defaults applied."""
    backend = k.get("backend", defaults.get("backend", "opencl"))
    if backend not in registry.packable():
        if backend in {b.name for b in registry.backends()}:  # torch: kept from a run only
            raise InvalidArgumentError(
                f"{where} ({name}): {backend!r} entries are not built from a manifest: run "
                "the program once with kdb, then pack what it stored, `kdb pack --arch ARCH "
                "--from-db` (or --from-log); see docs/torch.md")
        raise InvalidArgumentError(f"{where} ({name}): backend {backend!r} is not one kdb "
                                   "packs; use "
                                   + " or ".join(repr(b) for b in registry.packable()))
    if ("file" in k) == ("source" in k):
        raise InvalidArgumentError(f"{where} ({name}): give exactly one of 'file' or 'source'")
    if "file" in k:
        src_path = base / k["file"]
        try:
            source = src_path.read_text(encoding="utf-8")
        except OSError as err:
            raise InvalidArgumentError(
                f"{where} ({name}): cannot read {src_path}: {err}") from err
    else:
        source = k["source"]
    options = [*_strings(defaults.get("options", []), where, "defaults.options"),
               *_strings(k.get("options", []), where, "options")]
    defines = k.get("defines", {})
    if not isinstance(defines, dict):
        raise InvalidArgumentError(f"{where} ({name}): 'defines' must be a table")
    options += [f"-D{key}={_define(v)}" for key, v in defines.items()]
    dirs = [str((base / d).resolve()) for d in
            (*_strings(defaults.get("include_dirs", []), where, "defaults.include_dirs"),
             *_strings(k.get("include_dirs", []), where, "include_dirs"))]
    try:  # a HIP kernel's arches may be target IDs: the processor names the file
        arches = tuple(a for a in _strings(k.get("arches", []), where, "arches")
                       if config.check_arch(processor(a) if backend == "hip" else a))
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{where} ({name}): {err}") from err
    if backend == "triton":
        return _triton_spec(k, name, source, base, arches, where)
    if set(k) & {"function", "signature", "constexprs", "specialization"}:
        raise InvalidArgumentError(f"{where} ({name}): 'function', 'signature', "
                                   "'constexprs' and 'specialization' are for Triton "
                                   "kernels only")
    takes = COMPILERS.get(backend, ())
    compiler = k.get("compiler", defaults.get("compiler") if defaults.get("compiler") in takes
                     else None)
    if compiler is not None and compiler not in takes:
        raise InvalidArgumentError(f"{where} ({name}): compiler {compiler!r}: CUDA kernels "
                                   "take 'nvcc' or 'nvrtc', HIP kernels 'hipcc' or 'hiprtc'; "
                                   "other back ends none")
    return KernelSpec(name, source, tuple(options), tuple(dirs), backend, arches, compiler)


def _triton_spec(k: dict, name: str, source: str, base: Path, arches: tuple[str, ...],
                 where: str) -> KernelSpec:
    """A Triton kernel: its module file, function, signature and constexprs."""
    if "file" not in k:
        raise InvalidArgumentError(f"{where} ({name}): a Triton kernel needs 'file', the module "
                                   "that defines its @triton.jit function")
    function, signature = k.get("function"), k.get("signature")
    if not isinstance(function, str) or not function.isidentifier():
        raise InvalidArgumentError(f"{where} ({name}): 'function' (the kernel's name in its "
                                   "module) is required")
    if not isinstance(signature, dict) or not signature or not all(
            isinstance(v, str) for v in signature.values()):
        raise InvalidArgumentError(f"{where} ({name}): 'signature' must be a table of argument "
                                   'types, e.g. { x_ptr = "*fp32", n = "i32", BLOCK = "constexpr" }')
    constexprs = k.get("constexprs", {})
    if not isinstance(constexprs, dict):
        raise InvalidArgumentError(f"{where} ({name}): 'constexprs' must be a table")
    special = k.get("specialization", {})
    if not isinstance(special, dict) or not all(v in ("D", "") for v in special.values()) \
            or set(special) - set(signature):
        raise InvalidArgumentError(f"{where} ({name}): 'specialization' maps arguments of the "
                                   'signature to "D" (divisible by 16 at run time) or ""')
    if set(k) & {"options", "defines", "include_dirs", "compiler"}:
        raise InvalidArgumentError(f"{where} ({name}): a Triton kernel takes 'function', "
                                   "'signature' and 'constexprs', not compiler options")
    if not arches:
        raise InvalidArgumentError(f"{where} ({name}): a Triton kernel needs 'arches' (e.g. "
                                   '["sm_90", "gfx942"])')
    return KernelSpec(name, source, backend="triton", arches=arches,
                      module=str((base / k["file"]).resolve()), function=function,
                      signature=tuple(signature.items()), constexprs=tuple(constexprs.items()),
                      specialization=tuple(special.items()))


def _strings(value: object, where: str, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgumentError(f"{where}: '{what}' must be a list of strings")
    return value


def _define(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def applicable(specs: list[KernelSpec], arch: str) -> list[KernelSpec]:
    """The specs to build for ``arch``: those naming it, else every spec of a back end that
    can target it (CUDA kernels go to CUDA arches only, HIP kernels to gfx processors only,
    OpenCL kernels to every arch; Triton kernels always name theirs). A HIP kernel naming a
    target ID (``gfx90a:xnack-``) is built for its processor's file."""
    return [s for s in specs if (arch in s.processors() if s.arches else _may_target(s, arch))]


def _may_target(spec: KernelSpec, arch: str) -> bool:
    if spec.backend == "cuda":
        return _is_cuda_arch(arch)
    if spec.backend == "hip":
        return re.fullmatch(r"gfx[0-9a-f]{3,4}", arch) is not None
    return True


def processor(arch: str) -> str:
    """The processor of a HIP target ID, the arch of its file.

    >>> processor("gfx90a:sramecc+:xnack-"), processor("gfx1030")
    ('gfx90a', 'gfx1030')
    """
    return arch.split(":", 1)[0]


def _is_cuda_arch(arch: str) -> bool:
    """``sm_90``, ``sm_90a``, ``compute_80``: what nvcc targets.

    >>> _is_cuda_arch("sm_90a"), _is_cuda_arch("pocl-x86_64-znver3")
    (True, False)
    """
    return re.fullmatch(r"(sm|compute)_\d{2,3}[af]?", arch) is not None

"""``kdb pack``'s CUDA half: a manifest kernel cross-compiled by nvcc or NVRTC (no GPU
needed), through :func:`kdb.backends.cuda.compile`, the call a framework makes."""

from __future__ import annotations

from ...errors import BackendUnavailableError


def check(specs: list, arches: list[str]) -> None:
    """Before anything compiles: each compiler the manifest's CUDA kernels name (nvcc or NVRTC,
    or either) installed here; else the error names what to install. Found only at the first
    kernel, the run-time error told the packager to install the system package being built."""
    from .keys import find_compiler

    for compiler in sorted({s.compiler for s in specs} or {None}, key=str):
        kind, ident, why = find_compiler(compiler)
        if ident is None:
            wants = {"nvcc": "nvcc (the CUDA toolkit, or pip install nvidia-cuda-nvcc-cu12)",
                     "nvrtc": "NVRTC (pip install 'kdb[cuda]')"}.get(
                         compiler or "", "nvcc or NVRTC (pip install 'kdb[cuda]')")
            raise BackendUnavailableError(
                f"the manifest's CUDA kernels need {wants} to be packed for "
                f"{', '.join(arches)}, and it is not installed here ({why})")


def compile_spec(spec, arch: str, db) -> None:
    """Compile one manifest kernel for ``arch`` into ``db``."""
    from . import compile

    compile(spec.source, arch=arch, options=list(spec.options),
            include_dirs=list(spec.include_dirs), db=db, name=spec.name,
            compiler=spec.compiler)

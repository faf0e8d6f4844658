"""``kdb pack``'s CUDA half: a manifest kernel cross-compiled by nvcc or NVRTC (no GPU
needed), through :func:`kdb.backends.cuda.compile`, the call a framework makes."""

from __future__ import annotations


def compile_spec(spec, arch: str, db) -> None:
    """Compile one manifest kernel for ``arch`` into ``db``."""
    from . import compile

    compile(spec.source, arch=arch, options=list(spec.options),
            include_dirs=list(spec.include_dirs), db=db, name=spec.name,
            compiler=spec.compiler)

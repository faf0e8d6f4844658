"""``kdb pack``'s HIP half: a manifest kernel cross-compiled by hipcc or HIPRTC (no GPU
needed), through :func:`kdb.backends.hip.compile`, the call a framework makes, so the pack's
keys are those it looks up.

The pack's arch is a processor (``gfx90a``), which names the file (``gfx90a.kdb``), as the
key's arch does; a kernel whose ``arches`` name target IDs (``gfx90a:sramecc+:xnack-``) is
built once for each of them that is of that processor, else for the processor alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...errors import BackendUnavailableError, InvalidArgumentError


def check(specs: list, arches: list[str]) -> None:
    """Before anything compiles: every target ID well formed, a compiler installed, and each
    processor one it builds; else the error names the package, or the processors it builds."""
    from .hipcc import HipccIdentity
    from .keys import find_compiler
    from .targets import canonical, check_known

    for spec in specs:
        for target in spec.arches:
            try:
                canonical(target)
            except InvalidArgumentError as err:
                raise InvalidArgumentError(f"manifest kernel {spec.name!r}: {err}") from None
    for compiler in sorted({s.compiler for s in specs} or {None}, key=str):
        kind, ident, why = find_compiler(compiler)
        if ident is None:
            raise BackendUnavailableError(
                f"the manifest's HIP kernels need {compiler or 'hipcc or HIPRTC'}, and none "
                f"is installed here ({why})")
        llvm = ident.llvm if isinstance(ident, HipccIdentity) else ident.built
        for arch in arches:
            try:
                check_known(arch, list(llvm), list(ident.built), kind or "")
            except InvalidArgumentError as err:
                raise InvalidArgumentError(f"kdb pack --arch {arch}: {err}") from None


def prepare(arch: str) -> None:
    """The toolchain and ``arch`` checked once more where ``kdb pack``'s
    :func:`check` was not run (a caller of :func:`kdb.pack.compile_manifest`)."""
    check([], [arch])


def targets(arches: Sequence[str], arch: str) -> list[str]:
    """The target IDs of a kernel naming ``arches`` to build into ``arch``'s file.

    >>> targets(("gfx90a:xnack-", "gfx1030"), "gfx90a"), targets((), "gfx1030")
    (['gfx90a:xnack-'], ['gfx1030'])
    """
    return [a for a in arches if a.split(":", 1)[0] == arch] or [arch]


def compile_spec(spec, arch: str, db) -> None:
    """Compile one manifest kernel for each of its target IDs of ``arch`` into ``db``."""
    from . import compile

    for target in targets(spec.arches, arch):
        compile(spec.source, arch=target, options=list(spec.options),
                include_dirs=list(spec.include_dirs), db=db, name=spec.name,
                compiler=spec.compiler)

"""CUDA builds: a request compiled by nvcc or NVRTC, served from kdb, or from the stored
builds of another compiler where none is installed (:mod:`kdb.backends.fallback`).

nvcc cross-compiles, so this half needs no GPU and never imports pycuda.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from ... import config, logs
from ...db import KernelDB, default_db
from ...errors import BackendUnavailableError, CompileError, InvalidArgumentError
from . import nvrtc as _nvrtc
from .keys import _Request, _request, compiler_kind, compiler_rank
from .nvrtc import NvrtcIdentity
from ..common import compile_and_store, uncached_build
from ..common import cached_build as _cached_build
from ..includes import run_compiler

log = logs.get("kdb")


def _run_nvcc(req: _Request) -> bytes:
    """nvcc in a temporary directory (:func:`run_compiler`): a file it read that the key
    does not hold raises :class:`UnkeyedRead` with the binary, then served and not stored."""
    def unavailable(path: str, err: OSError) -> Exception:
        return BackendUnavailableError(f"cannot run {path}: {err}; set {config.ENV_NVCC} or "
                                       "CUDA_HOME to a working nvcc")

    return run_compiler("nvcc", req.command, req.text, "kernel.cu", f"kernel.{req.output}",
                        building=f"{req.attrs.name} for {req.arch}", options=req.options,
                        system_dirs=(*req.nvcc.system_dirs, *req.host_dirs),
                        header_files=req.header_files, unavailable=unavailable)


#: What nvcc and NVRTC say of an arch they do not build.
_UNKNOWN_ARCH = ("Unsupported gpu architecture", "invalid value for --gpu-architecture")


def _build(req: _Request) -> bytes:
    """Run the request's compiler (nvcc or NVRTC); its failure is a :class:`kdb.CompileError`,
    an arch it does not build :class:`kdb.InvalidArgumentError` naming those it does."""
    try:
        return _run(req)
    except CompileError as err:
        if not any(said in (err.log or "") for said in _UNKNOWN_ARCH):
            raise
        nvrtc = isinstance(req.tool, NvrtcIdentity)
        try:
            from . import nvcc as _nvcc

            known = (_nvrtc.supported_arches(req.tool.path) if nvrtc
                     else _nvcc.target_arches(req.tool.path))
        except Exception:  # noqa: BLE001 - the compiler's own message says enough then
            raise err from None
        raise InvalidArgumentError(
            f"{'NVRTC' if nvrtc else 'nvcc'} does not build for {req.arch}; it builds "
            f"{', '.join(known)} (`kdb info` lists them)") from None


def _run(req: _Request) -> bytes:
    if isinstance(req.tool, NvrtcIdentity):
        data, said = _nvrtc.run(req.tool.path, req.text, req.arch, req.output, req.options,
                                req.include_args, req.attrs.name)
        if said.strip():
            log.debug("kdb: NVRTC said, building %s: %s", req.attrs.name, said.strip())
        return data
    return _run_nvcc(req)


def _uncached(db: KernelDB, req: _Request, why: str) -> bytes:
    """A build neither looked up nor stored: kdb cannot be sure what it reads, or it is
    never the same twice."""
    if req.tool is None:
        raise BackendUnavailableError(
            f"no CUDA compiler is installed, and {req.attrs.name} cannot be served from kdb: "
            f"{why}. Install a compiler: pip install 'kdb[cuda]' (NVRTC) or the CUDA toolkit")
    return uncached_build(db, req.attrs, lambda: _build(req), why, "CUDA")


def cached_build(db: KernelDB, req: _Request, build=None) -> bytes:
    """The request's binary from kdb, or built now and stored; a build kdb cannot be sure
    of (:attr:`_Request.uncertain`, or a compiler that read a file the key does not hold)
    is built and not stored. ``build``: what compiles (default: the request's compiler)."""
    if req.uncertain:
        return _uncached(db, req, req.uncertain)
    return _cached_build(db, req.attrs, build or (lambda: _build(req)), req.details(),
                         req.headers_now, "CUDA")


def _stored_builds(db: KernelDB, req: _Request) -> list:
    """With no compiler here: the stored builds that match on all but the compiler, newest
    compiler first (:mod:`kdb.backends.fallback`); none raises, naming the arch and what to install."""
    from .. import fallback
    from ...file.discovery import dist_name

    accept = None if req.wanted is None else (lambda c: compiler_kind(c) == req.wanted)
    found = fallback.candidates(db, req.attrs, compiler_rank, accept)
    if found:
        return found
    which = f"{req.wanted} " if req.wanted else ""
    raise BackendUnavailableError(
        f"no {which}compiler is installed and no stored binary of {req.attrs.name} for "
        f"{req.arch} matches this request ({req.output}, these options and headers). Install "
        f"the system database for {req.arch} (pip install {dist_name(req.arch)}, or the "
        f"package your framework publishes; KDB_SYSTEM_DB_PATH for a directory), or a "
        f"compiler: pip install 'kdb[cuda]' (NVRTC, no toolkit needed), or the CUDA toolkit "
        f"({config.ENV_NVCC} or CUDA_HOME). Looked for: {req.missing}")


def _compile_and_store(db: KernelDB, req) -> bytes:
    """A miss: compile now, log the compile, store the result in the background."""
    return compile_and_store(db, req.attrs, lambda: _build(req), req.details(), req.headers_now,
                             "CUDA")


def compile(source: str | bytes, arch: str = "sm_90",  # noqa: A001 - the natural name
            options: str | Sequence[str] | None = (),
            include_dirs: Iterable[str | os.PathLike[str]] | None = (),
            output: str = "cubin", *, db: KernelDB | None = None, name: str | None = None,
            nvcc: str | os.PathLike[str] | None = None, compiler: str | None = None) -> bytes:
    """The cubin (or PTX, or fatbin) of ``source`` for ``arch``, from kdb when it holds it.

    ``compiler``: ``"nvcc"``, ``"nvrtc"``, or ``None`` (nvcc where one is found, else
    NVRTC); NVRTC builds no fatbins. ``-I`` directories (in ``include_dirs`` or
    ``options``) are passed to the compiler; the headers they bring in enter the key by
    content. With no compiler installed, the stored build of the newest compiler that
    matches on everything else answers (:mod:`kdb.backends.fallback`). Raises
    :class:`kdb.CompileError` with the compiler's message when it fails,
    :class:`kdb.BackendUnavailableError` when there is no compiler and no stored build.
    """
    db = db or default_db()
    req = _request(source, arch, options, include_dirs, output, nvcc=nvcc,
                   memo_dir=db.cache_root, name=name, compiler=compiler)
    if req.tool is None and not req.uncertain:
        from ..fallback import served

        best = _stored_builds(db, req)[0]
        served(db, req.attrs, best)
        return best.binary
    return cached_build(db, req)


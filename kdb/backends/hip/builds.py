"""HIP builds: a request compiled by hipcc or HIPRTC, served from kdb, or from the stored
builds of another compiler where none is installed (:mod:`kdb.backends.fallback`).

Every code object served is checked against the request's target (its ELF header names the
processor and features): one for another target is dropped, never served.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

from ... import config, logs
from ...db import KernelDB, default_db
from ...errors import BackendUnavailableError, CompileError
from . import hipcc as _hipcc
from . import hiprtc as _hiprtc
from .hiprtc import HiprtcIdentity
from .keys import Request, compiler_kind, compiler_rank, request
from .targets import code_object_target
from ..common import cached_build, compile_and_store, uncached_build
from ..includes import run_compiler

log = logs.get("kdb")


def _run_hipcc(req: Request) -> bytes:
    """hipcc in a temporary directory (:func:`run_compiler`); its ``-MD`` list of what it
    read is checked against the key (:class:`UnkeyedRead`)."""
    def unavailable(path: str, err: OSError) -> Exception:
        return BackendUnavailableError(f"cannot run {path}: {err}; {_hipcc.POINT} of a "
                                       f"working hipcc, or install one: {_hipcc.INSTALL}")

    return run_compiler("hipcc", req.command, req.text, "kernel.hip", "kernel.co",
                        building=f"{req.attrs.name} for {req.target}", options=req.options,
                        system_dirs=req.system_dirs,
                        header_files=req.header_files, unavailable=unavailable,
                        env=lambda tmp: _hipcc.run_env(tmp=tmp),
                        where="run in a temporary directory, HIP_PLATFORM=amd")


def _build(req: Request) -> bytes:
    """Run the request's compiler; a code object for another target is a CompileError."""
    if isinstance(req.tool, HiprtcIdentity):
        data, said = _hiprtc.run(req.tool.path, req.text, req.target,
                                 (*req.options, *req.include_args), req.attrs.name)
        if said.strip():
            log.debug("kdb: HIPRTC said, building %s: %s", req.attrs.name, said.strip())
    else:
        data = _run_hipcc(req)
    got = code_object_target(data)
    if got != req.target:
        raise CompileError(f"{req.tool.release if req.tool else 'the compiler'} built a code "
                           f"object for {got or 'an unknown target'} when asked for "
                           f"{req.target}; kdb stores nothing for it")
    return data


def _uncached(db: KernelDB, req: Request, why: str) -> bytes:
    """A build neither looked up nor stored: kdb cannot be sure what it reads, or it is
    never the same twice."""
    if req.tool is None:
        raise BackendUnavailableError(
            f"no HIP compiler is installed, and {req.attrs.name} cannot be served from kdb: "
            f"{why}. Install one: {_hipcc.INSTALL}; or point kdb at one "
            f"({config.ENV_HIPCC}, {config.ENV_HIPRTC})")
    return uncached_build(db, req.attrs, lambda: _build(req), why, "HIP")


def _cached(db: KernelDB, req: Request) -> bytes:
    """The code object from kdb, or built now and stored; one stored for another target is
    dropped and built again."""
    if req.uncertain:
        return _uncached(db, req, req.uncertain)
    data = cached_build(db, req.attrs, lambda: _build(req), req.details(), req.headers_now,
                        "HIP")
    got = code_object_target(data)
    if got == req.target:
        return data
    what = got or "no known target"
    db.tiers.storing.discard(req.attrs, f"the stored code object is for {what}, not {req.target}")
    return _compile_and_store(db, req)


def _compile_and_store(db: KernelDB, req) -> bytes:
    """A miss: compile now, log the compile, store the result in the background."""
    return compile_and_store(db, req.attrs, lambda: _build(req), req.details(), req.headers_now,
                             "HIP")


def _stored(db: KernelDB, req: Request) -> bytes:
    """With no compiler here: the newest compiler's stored build that matches on all but
    the compiler and is for this exact target; none raises, naming what to install."""
    from ..fallback import candidates, served

    accept = None if req.wanted is None else (lambda c: compiler_kind(c) == req.wanted)
    for cand in candidates(db, req.attrs, compiler_rank, accept):
        if code_object_target(cand.binary) == req.target:
            served(db, req.attrs, cand)
            return cand.binary
        db.tiers.storing.discard(cand.attrs, f"the stored code object is not for {req.target}")
    raise BackendUnavailableError(
        f"no HIP compiler is installed and no stored code object of {req.attrs.name} for "
        f"{req.target} matches this request (these options and headers). Install a "
        f"compiler: {_hipcc.INSTALL} (or point kdb at one: {config.ENV_HIPCC}, "
        f"{config.ENV_HIPRTC}); or the system database for {req.attrs.arch} "
        f"(KDB_SYSTEM_DB_PATH for a directory). Looked for: {req.missing}")


def compile(source: str | bytes, arch: str = "gfx90a",  # noqa: A001 - the natural name
            options: str | Sequence[str] | None = (),
            include_dirs: Iterable[str | os.PathLike[str]] | None = (), *,
            db: KernelDB | None = None, name: str | None = None,
            hipcc: str | os.PathLike[str] | None = None, compiler: str | None = None) -> bytes:
    """The code object (ELF) of ``source`` for ``arch``, a target ID such as ``"gfx90a"`` or
    ``"gfx90a:sramecc+:xnack-"``, from kdb when it holds it.

    ``compiler``: ``"hipcc"``, ``"hiprtc"``, or ``None`` (hipcc where found, else HIPRTC).
    Include directories (``include_dirs``, ``-I`` in ``options``) go to the compiler; the
    headers they bring in enter the key by content. With no compiler installed, the newest
    stored build that matches on everything else answers. Raises
    :class:`kdb.InvalidArgumentError` for an arch the compiler does not build,
    :class:`kdb.CompileError` with the compiler's message when it fails,
    :class:`kdb.BackendUnavailableError` when there is no compiler and no stored build.
    """
    db = db or default_db()
    req = request(source, arch, options, include_dirs, hipcc=hipcc, memo_dir=db.cache_root,
                  name=name, compiler=compiler)
    if req.tool is None and not req.uncertain:
        return _stored(db, req)
    return _cached(db, req)

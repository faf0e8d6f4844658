"""CUDA builds: a request compiled by nvcc or NVRTC, served from kdb, or from the stored
builds of another compiler where none is installed (:mod:`kdb.backends.fallback`).

nvcc cross-compiles, so this half needs no GPU and never imports pycuda.
"""

from __future__ import annotations

import os
import shlex
from typing import Iterable, Sequence

from ... import config, logs
from ...db import KernelDB, default_db
from ...errors import BackendUnavailableError, CompileError
from . import nvrtc as _nvrtc
from .keys import _Request, _request, compiler_kind, compiler_rank
from .nvrtc import NvrtcIdentity
from ..common import UnkeyedRead, compile_and_store, uncached_build
from ..common import cached_build as _cached_build
from ..includes import unkeyed_read

log = logs.get("kdb")


def _run_nvcc(req: _Request) -> bytes:
    """nvcc in a temporary directory; its failure is a :class:`kdb.CompileError`. nvcc also
    writes the files it read (``-MD``): one it read that the key does not hold raises
    :class:`UnkeyedRead` with the binary, which is then served and not stored."""
    import subprocess
    import tempfile

    out_name = f"kernel.{req.output}"
    with tempfile.TemporaryDirectory(prefix="kdb-nvcc-") as tmp:
        with open(os.path.join(tmp, "kernel.cu"), "w", encoding="utf-8") as f:
            f.write(req.text)
        cmd = req.command("kernel.cu", out_name)
        try:
            proc = subprocess.run([*cmd, "-MD", "-MF", "kernel.d"], cwd=tmp,
                                  capture_output=True)
        except OSError as err:
            raise BackendUnavailableError(
                f"cannot run {req.nvcc.path}: {err}; set {config.ENV_NVCC} or CUDA_HOME "
                "to a working nvcc") from err
        said = (proc.stderr + proc.stdout).decode("utf-8", "replace")
        out_path = os.path.join(tmp, out_name)
        if proc.returncode != 0 or not os.path.isfile(out_path):
            why = f"exit status {proc.returncode}" if proc.returncode else "no output file"
            err = CompileError(
                f"nvcc failed ({why}) building {req.attrs.name} for {req.arch}; fix the "
                f"source or options. Command (run in a temporary directory): "
                f"{shlex.join(cmd)}", log=said, options=req.options)
            err.command = cmd  # type: ignore[attr-defined]
            raise err
        with open(out_path, "rb") as f:
            data = f.read()
        unkeyed = _unkeyed_reads(req, tmp)
    if said.strip():
        log.debug("kdb: nvcc said, building %s: %s", req.attrs.name, said.strip())
    if unkeyed:
        raise UnkeyedRead(data, f"nvcc read {unkeyed!r}, a file kdb's include model did not "
                                "find, so the key would not see its edits")
    return data


def _unkeyed_reads(req: _Request, tmp: str) -> str | None:
    """The first file nvcc read (its ``-MD`` list) that is neither the program, nor under
    the directories it or its host compiler search by default, nor a header the key holds."""
    return unkeyed_read(os.path.join(tmp, "kernel.d"), (*req.nvcc.system_dirs, *req.host_dirs),
                        req.header_files, "nvcc")


def _build(req: _Request) -> bytes:
    """Run the request's compiler (nvcc or NVRTC); its failure is a :class:`kdb.CompileError`."""
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


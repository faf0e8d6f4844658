"""CUDA loading through pycuda: :class:`SourceModule`, a drop-in for pycuda's, whose cubin
comes from kdb for the current context's device (``pycuda.driver.module_from_buffer``)."""

from __future__ import annotations

from typing import Any, Sequence

from ... import config, logs
from ...db import KernelDB, default_db
from ...errors import BackendUnavailableError, InvalidArgumentError
from ..common import source_text
from .builds import _build, _compile_and_store, _stored_builds, cached_build
from .keys import _Request, _request

log = logs.get("kdb")

#: pycuda's own variable: the options ``options=None`` stands for, as in pycuda.
_PYCUDA_FLAGS = ("PYCUDA_DEFAULT_NVCC_FLAGS",)

_INSTALL_HINT = "pip install 'kdb[pycuda]'"


def pycuda_driver() -> Any:
    """``pycuda.driver``, or a :class:`kdb.BackendUnavailableError` saying what is missing."""
    try:
        import pycuda  # noqa: F401
    except ImportError as err:
        raise BackendUnavailableError(
            f"kdb.cuda.SourceModule needs pycuda, which is not installed: {_INSTALL_HINT} "
            "(pycuda builds against the CUDA toolkit, and loading a module needs a GPU and "
            "its driver). kdb.cuda.compile() works without it.") from err
    try:
        import pycuda.driver as drv
    except ImportError as err:
        raise BackendUnavailableError(
            f"pycuda is installed but pycuda.driver does not load ({err}): it needs the NVIDIA "
            "driver's libcuda.so.1, which exists only where a GPU and its driver are "
            "installed. kdb.cuda.compile() works without it.") from err
    return drv


def context_arch(drv: Any) -> str:
    """The ``sm_XX`` of the current CUDA context's device (``drv``: ``pycuda.driver``)."""
    error = getattr(drv, "Error", Exception)
    try:
        major, minor = drv.Context.get_device().compute_capability()
    except error as err:
        raise BackendUnavailableError(
            f"no current CUDA context ({err}): create one first (import pycuda.autoinit, or "
            "pycuda.driver.Device(0).make_context()); loading a module needs a GPU") from err
    return f"sm_{major}{minor}"


def pycuda_include_dirs() -> list[str]:
    """pycuda's include directory, as pycuda's own compile adds it (none where not found)."""
    try:
        from pycuda.compiler import _find_pycuda_include_path

        return [_find_pycuda_include_path()]
    except Exception as err:  # noqa: BLE001 - pycuda's private helper; its headers are optional
        log.debug("kdb: pycuda's include directory not found: %s", err)
        return []


class SourceModule:
    """A drop-in for ``pycuda.compiler.SourceModule`` whose cubin comes from kdb.

    Same arguments and behaviour as pycuda's (the source wrapped in ``extern "C"`` unless
    ``no_extern_c``; ``options=None`` means ``PYCUDA_DEFAULT_NVCC_FLAGS``; pycuda's include
    directory added), built for ``arch`` or the current context's device and loaded with
    ``pycuda.driver.module_from_buffer``. ``keep`` and ``cache_dir`` are accepted and
    ignored: kdb is the cache. A stored cubin the driver refuses is dropped and rebuilt.
    """

    def __init__(self, source: str | bytes, nvcc: str = "nvcc",
                 options: str | Sequence[str] | None = None, keep: bool = False,
                 no_extern_c: bool = False, arch: str | None = None, code: str | None = None,
                 cache_dir: Any = None, include_dirs: Sequence[str] = (), *,
                 db: KernelDB | None = None, name: str | None = None,
                 compiler: str | None = None) -> None:  # mirrors pycuda's SourceModule
        del keep, cache_dir
        if code is not None:
            raise InvalidArgumentError(
                "kdb.cuda.SourceModule builds one cubin for arch=; code= is not supported")
        drv = pycuda_driver()
        device_arch = context_arch(drv)
        arch = arch or device_arch
        text = source_text(source, "CUDA")
        if not no_extern_c:
            text = 'extern "C" {\n%s\n}\n' % text
        if options is None:
            options = (config.read_variables(_PYCUDA_FLAGS)[_PYCUDA_FLAGS[0]] or "").split()
        db = db or default_db()
        req = _request(text, arch, options, [*include_dirs, *pycuda_include_dirs()],
                       "cubin", nvcc=None if nvcc == "nvcc" else nvcc,
                       memo_dir=db.cache_root, name=name,
                       compiler=compiler)
        self.arch = arch
        if req.tool is None:
            self.module = self._load_stored_build(drv, db, req)
            self._bind_module()
            return
        compiled = []

        def build() -> bytes:
            compiled.append(True)
            return _build(req)

        binary = cached_build(db, req, build)
        try:
            self.module = drv.module_from_buffer(binary)
        except getattr(drv, "Error", Exception) as err:
            if compiled:
                raise  # nvcc's own fresh output: not a cache fault
            db.tiers.storing.discard(req.attrs, f"the driver refused the stored cubin ({err})")
            self.module = drv.module_from_buffer(_compile_and_store(db, req))
        self._bind_module()

    @staticmethod
    def _load_stored_build(drv: Any, db: KernelDB, req: _Request) -> Any:
        """No compiler here: load the best stored build the driver accepts, dropping those
        it refuses."""
        from ..fallback import served

        error = getattr(drv, "Error", Exception)
        builds = _stored_builds(db, req)
        for i, cand in enumerate(builds):
            try:
                module = drv.module_from_buffer(cand.binary)
            except error as err:
                db.tiers.storing.discard(cand.attrs, f"the driver refused the stored cubin ({err})")
                if i == len(builds) - 1:
                    raise
                continue
            served(db, req.attrs, cand)
            return module
        raise AssertionError("unreachable: _stored_builds returns at least one build")

    def _bind_module(self) -> None:
        self.get_global = self.module.get_global
        self.get_texref = self.module.get_texref
        if hasattr(self.module, "get_surfref"):
            self.get_surfref = self.module.get_surfref

    def get_function(self, name: str) -> Any:
        return self.module.get_function(name)

"""Zero-code adoption: what ``KDB_AUTO=1``, ``kdb run`` and ``pytest --kdb`` do to a process.

The start-up hook (``_kdb_auto``, run by ``kdb-auto.pth``) calls :func:`adopt_pyopencl` right
after the program has imported pyopencl, :func:`adopt_pycuda` after ``pycuda.compiler`` and
:func:`adopt_triton` after ``triton`` and :func:`adopt_torch` after Inductor's code cache
(``torch._inductor.codecache``, which torch imports at a program's first compile).
Each first checks that kdb can work here (its settings parse, its cache directory can be
created): a process whose cache is unusable gets one warning and plain pyopencl or pycuda,
never a cache fault per build. :func:`switch_on` does the same for the current process and,
through the environment, for every process it starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import config, logs
from ..errors import ConfigError, KdbError

log = logs.get("kdb")


def check_usable() -> Path:
    """The user tier's directory, created if missing; raises :class:`KdbError` when kdb
    cannot work in this process: a setting that does not parse, or a cache directory that
    cannot be created. (A directory that exists read-only is usable: kdb reads it.)"""
    for name in (config.ENV_DISABLE_CACHE, config.ENV_TRACE, config.ENV_STRICT):
        config.flag(name)
    config.max_size()
    config.store_at_exit()
    config.wait_timeout()
    config.store_timeout()
    user_dir = config.user_dir()
    try:
        config.private_dir(user_dir)
    except OSError as err:
        raise ConfigError(
            f"the kernel cache {user_dir} cannot be created ({err}); set {config.ENV_CACHE_DIR} "
            "to a writable directory") from err
    if not os.access(user_dir, os.R_OK | os.X_OK):
        raise ConfigError(f"the kernel cache {user_dir} cannot be read; set "
                          f"{config.ENV_CACHE_DIR} to a directory of yours")
    return user_dir


def adopt_pyopencl(module: Any = None) -> None:
    """Route every ``pyopencl.Program(ctx, source).build()`` of this process through kdb.

    The hook runs right after pyopencl's import, whoever imported it. When that was kdb's
    own OpenCL back end, still half-imported (``import kdb.backends.opencl``, or a module
    that imports it, before pyopencl), it installs itself once its import completes.
    """
    check_usable()
    import sys

    backend = sys.modules.get(_BACKEND)
    if backend is not None and getattr(backend.__spec__, "_initializing", False):
        backend._install_when_imported = True  # read at the end of kdb.backends.opencl
        return
    from ..backends.opencl import install  # not kdb.opencl: that facade may be half-imported

    install()


_BACKEND = "kdb.backends.opencl"


def adopt_pycuda(module: Any = None) -> None:
    """Route ``pycuda.compiler.compile`` (and with it pycuda's ``SourceModule``, which calls
    it) through :func:`kdb.cuda.compile`; what kdb cannot serve goes to pycuda's own."""
    check_usable()
    if module is None:
        import pycuda.compiler as module
    if getattr(module.compile, "__wrapped__", None) is not None:
        return
    module.compile = _pycuda_compile(module, module.compile)


def _pycuda_compile(module: Any, original: Any) -> Any:
    def compile(source, nvcc="nvcc", options=None, keep=False,  # noqa: A001 - pycuda's name
                no_extern_c=False, arch=None, code=None, cache_dir=None, include_dirs=(),
                target="cubin"):  # mirrors pycuda.compiler.compile, for which it stands in
        args = (source, nvcc, options, keep, no_extern_c, arch, code, cache_dir,
                list(include_dirs), target)
        from .. import cuda

        if keep or code is not None or target not in cuda.OUTPUTS:
            return original(*args)  # nvcc's intermediate files or several arches: pycuda's
        text = source if no_extern_c else 'extern "C" {\n%s\n}\n' % source
        opts = getattr(module, "DEFAULT_NVCC_FLAGS", []) if options is None else options
        try:
            if arch is None:
                from ..backends.cuda.loading import context_arch, pycuda_driver

                arch = context_arch(pycuda_driver())
            from ..backends.cuda.loading import pycuda_include_dirs

            return cuda.compile(text, arch=arch, options=list(opts),
                                include_dirs=[*include_dirs, *pycuda_include_dirs()],
                                output=target, nvcc=None if nvcc == "nvcc" else nvcc)
        except KdbError as err:
            # A compile error, or a request kdb refuses: pycuda's own compile raises what
            # pycuda would (its CompileError, with nvcc's output), or succeeds without kdb.
            log.debug("kdb: pycuda compile left to pycuda: %s", err)
            return original(*args)

    compile.__doc__ = original.__doc__
    compile.__wrapped__ = original  # type: ignore[attr-defined]
    return compile


def adopt_triton(module: Any = None) -> None:
    """Make kdb Triton's cache manager (a program that names its own keeps it, with one
    warning)."""
    check_usable()
    from ..backends.triton import install  # not kdb.triton: it may be half-imported

    install()


def adopt_torch(module: Any = None) -> None:
    """Make kdb the store behind Inductor's caches (settings the program made are kept)."""
    check_usable()
    from ..backends.torch import install  # not kdb.torch: it may be half-imported

    install()


PTH_NAME = "kdb-auto.pth"


def status() -> dict[str, Any]:
    """What ``kdb info`` says about zero-code adoption: ``KDB_AUTO``'s value and meaning, and
    where the start-up hook (``kdb-auto.pth``) is installed, or None where it is missing."""
    import site
    import sysconfig

    raw = os.environ.get(config.ENV_AUTO)
    try:
        import _kdb_auto

        on = _kdb_auto.parse(raw)
    except ImportError:
        on = None
    dirs = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    hook = next((str(Path(d) / PTH_NAME) for d in dirs if (Path(d) / PTH_NAME).is_file()),
                None)
    return {"variable": raw, "on": on, "hook": hook}


def switch_on(cache_dir: str | os.PathLike[str] | None = None,
              report_dir: str | os.PathLike[str] | None = None) -> None:
    """kdb on for this process and every process it starts from now: ``KDB_AUTO=1`` (and
    ``KDB_CACHE_DIR``, ``KDB_RUN_REPORT`` when given) in ``os.environ``, pyopencl and pycuda
    adopted now if imported, else when they are."""
    os.environ[config.ENV_AUTO] = "1"
    if cache_dir is not None:
        os.environ[config.ENV_CACHE_DIR] = os.fspath(cache_dir)
    if report_dir is not None:
        os.environ[config.ENV_RUN_REPORT] = os.fspath(report_dir)
    try:
        import _kdb_auto
    except ImportError as err:  # kdb installed without its start-up hook (a vendored copy)
        log.warning("kdb: the start-up hook _kdb_auto is missing (%s): reinstall kdb; this "
                    "process builds without kdb", err)
        return
    _kdb_auto.enable()

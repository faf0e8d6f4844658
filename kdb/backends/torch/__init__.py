"""torch.compile through kdb: what Inductor caches, served from kdb's tiers.

``install()`` makes kdb the store behind Inductor's per-key caches in this process: the FX
graph cache, the AOTAutograd cache and the autotuning caches (:mod:`.entries`, through
Inductor's remote-cache settings), and its compiled C++ modules (:mod:`.cpp`); Triton's
kernels come through kdb's Triton cache manager as before (:mod:`kdb.backends.triton`).
Inductor's own local directory stays as it is: kdb is the tier behind it, so a fresh node
(an empty ``TORCHINDUCTOR_CACHE_DIR``) gets what another process of the same torch, Python
and device compiled. ``KDB_AUTO=1``, ``kdb run`` and ``pytest --kdb`` call it when the
program imports Inductor's code cache, never importing torch otherwise.

A setting the program made itself is kept: a remote cache switched on or off
(``TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE``, ``torch._inductor.config.fx_graph_remote_cache``,
...; on means the program's own Redis) is not taken over, and precompiled headers
(``TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS``) stay as set. Every private name of torch this
touches is listed in docs/torch.md.
"""

from __future__ import annotations

import os

from ... import logs
from .targets import BACKEND

__all__ = ["BACKEND", "CACHES", "install", "installed", "uninstall"]

log = logs.get("kdb")

#: Inductor's cache classes kdb backs (``torch._inductor.remote_cache``), each with the
#: setting that switches it on: (config module, attribute, environment variable).
CACHES = {
    "RemoteFxGraphCache": ("torch._inductor.config", "fx_graph_remote_cache",
                           "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE"),
    "RemoteAOTAutogradCache": ("torch._functorch.config", "enable_remote_autograd_cache",
                               "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE"),
    "RemoteAutotuneCache": ("torch._inductor.config", "autotune_remote_cache",
                            "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE"),
    "RemoteBundledAutotuneCache": ("torch._inductor.config", "bundled_autotune_remote_cache",
                                   "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE"),
}
#: Autotuning caches hold Triton's configurations: a GPU's only (on a CPU the bundled one
#: fails an assertion of Inductor's, which wants Triton's backend hash).
GPU_ONLY = ("RemoteAutotuneCache", "RemoteBundledAutotuneCache")
#: Inductor's setting for precompiled headers, which kdb turns off unless it is set.
ENV_PCH = "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"

_installed: list[str] = []


def install() -> bool:
    """Make kdb the store behind Inductor's caches in this process; False (with one
    warning) where the program has switched every one of them itself."""
    import importlib

    # torch 2.7's remote_cache, imported before torch._dynamo, imports itself in a circle
    # (through torch.compiler._cache); torch.compile imports torch._dynamo anyway.
    import torch._dynamo  # noqa: F401
    from torch._inductor import remote_cache

    from . import cpp, entries

    taken, kept = [], []
    for name, (module, setting, variable) in CACHES.items():
        if name in GPU_ONLY and not _gpu():
            continue
        cls = getattr(remote_cache, name, None)
        config = importlib.import_module(module)
        if cls is None or not hasattr(config, setting):
            continue  # a torch without this cache
        if cls.__dict__.get("backend_override_cls") is entries.Backend:
            taken.append(name)
            continue
        if getattr(config, setting) is not None or os.environ.get(variable) is not None:
            kept.append(variable)  # the program's choice: its own remote cache, or none
            continue
        cls.backend_override_cls = entries.Backend
        setattr(config, setting, True)
        taken.append(name)
    if kept:
        logs.warn_once("torch-kept", "kdb: %s set by the program: those caches stay as set, "
                       "not in kdb", ", ".join(kept))
    cpp.install()
    _precompiled_headers_off()
    _on_compile_start_and_end(entries.backward_begins, entries.release_unstored)
    _installed[:] = taken
    return bool(taken)


def _gpu() -> bool:
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver: no GPU caches
        return False


def _precompiled_headers_off() -> None:
    """A precompiled header is built in every process before its first C++ module, whether
    or not the module is then served, and its path enters the compile command: with kdb
    serving the modules it costs seconds and saves none. Kept where the program set it."""
    if os.environ.get(ENV_PCH) is None:
        from torch._inductor import config

        if hasattr(config, "cpp_cache_precompile_headers"):
            config.cpp_cache_precompile_headers = False


def _on_compile_start_and_end(start, end) -> None:
    """Dynamo's start- and end-of-compile callbacks (``torch._dynamo.callback``: private),
    once each."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without it: claims end with the process
        return
    if end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(end)
    starts = getattr(callback_handler, "start_callbacks", None)
    if starts is not None and start not in starts:
        callback_handler.register_start_callback(start)


def uninstall() -> None:
    """Give Inductor its own caches back (the settings kdb switched on, off again)."""
    import importlib

    from torch._inductor import remote_cache

    from . import cpp, entries

    for name in _installed:
        cls = getattr(remote_cache, name)
        if cls.__dict__.get("backend_override_cls") is entries.Backend:
            del cls.backend_override_cls
            module, setting, _ = CACHES[name]
            setattr(importlib.import_module(module), setting, None)
    _installed.clear()
    cpp.uninstall()


def installed() -> bool:
    """Whether kdb backs Inductor's caches in this process."""
    return bool(_installed)

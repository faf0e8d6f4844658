"""Switches kdb on in a process started with ``KDB_AUTO=1``, without a line of its code changed.

``kdb-auto.pth`` (installed with kdb, beside it in site-packages) runs at every interpreter
start: with ``KDB_AUTO`` unset or empty it costs one environment lookup and imports
nothing; otherwise it imports this module and calls :func:`start`, which puts an import hook
on ``sys.meta_path``. The hook imports none of pyopencl, pycuda, Triton or torch: when the program
imports one of them, right after that module has finished executing, it calls
:mod:`kdb.adopt.auto` (``kdb.opencl.install()``, pycuda's ``compile`` through ``kdb.cuda``,
kdb as Triton's cache manager, or behind Inductor's caches).

A top-level module, not ``kdb.something``: importing anything under ``kdb`` runs
``kdb/__init__.py``, which a process that never builds a kernel should not pay.
Whatever goes wrong here costs one warning on stderr and a program that runs as without kdb.
"""

import os
import sys

ENV_AUTO = "KDB_AUTO"  # kdb.config.ENV_AUTO; repeated here so that kdb is not imported
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

#: Module name -> the function that adopts it once imported, named as an entry point names
#: one (``module:function``): this hook sits below kdb and reaches up by name, not by import.
_HOOKS = {"pyopencl": "kdb.adopt.auto:adopt_pyopencl",
          "pycuda.compiler": "kdb.adopt.auto:adopt_pycuda",
          "triton": "kdb.adopt.auto:adopt_triton",
          "torch._inductor.codecache": "kdb.adopt.auto:adopt_torch"}
_pending = dict(_HOOKS)
_finder = None
_warned = set()


def _warn(message):
    """One line on stderr, once (``logging`` is not imported, so nobody can have configured
    it; and some Pythons read a site directory's ``.pth`` files twice)."""
    if message in _warned:
        return
    _warned.add(message)
    try:
        sys.stderr.write("kdb: " + message + "\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # no stderr (pythonw, a closed stream)
        pass


def parse(raw):
    """True (on), False (off) or None (not understood) for a ``KDB_AUTO`` value.

    >>> parse("1"), parse(" ON "), parse("0"), parse(""), parse("off"), parse("maybe")
    (True, True, False, False, False, None)
    """
    value = (raw or "").strip().lower()
    if value in _TRUE:
        return True
    return False if value in _FALSE else None


def wanted(raw=None):
    """Whether ``KDB_AUTO`` (or ``raw``) asks for kdb; a value not understood warns once and
    counts as off."""
    if raw is None:
        raw = os.environ.get(ENV_AUTO, "")
    on = parse(raw)
    if on is None:
        _warn(f"{ENV_AUTO}={raw!r} is not understood: set it to 1 to switch kdb on, 0 or "
              "unset for off; kdb stays off")
    return bool(on)


def start():
    """What ``kdb-auto.pth`` calls: :func:`enable` when ``KDB_AUTO`` asks for it."""
    if wanted():
        enable()


def enable():
    """Adopt pyopencl and pycuda in this process: those already imported now, the others
    when they are imported (idempotent)."""
    global _finder
    for name in [n for n in _pending if n in sys.modules]:
        _adopt(name, sys.modules[name])
    if _finder is None and _pending:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)


def disable():
    """Adopt nothing in this process from now on (kdb's own store worker: it builds through
    kdb's API, and a hook firing inside its imports would only get in the way)."""
    global _finder
    _pending.clear()
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None


def _adopt(name, module):
    hook = _pending.pop(name, None)
    if hook is None:
        return
    if not _pending and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    try:
        import importlib

        where, _, function = hook.partition(":")
        getattr(importlib.import_module(where), function)(module)
    except Exception as err:  # noqa: BLE001 - the program must run, with or without kdb
        _warn(f"{ENV_AUTO} is set but kdb could not switch on for {name} "
              f"({type(err).__name__}: {err}); {name} builds as it would without kdb")


class _Finder:
    """A meta-path finder that only watches :data:`_HOOKS`' names: it finds their spec
    with the finders after it and has the loader call :func:`_adopt` once the module has
    executed."""

    def find_spec(self, name, path, target=None):
        if name not in _pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        execute = getattr(loader, "exec_module", None)
        if execute is None:
            return spec

        def exec_module(module):
            execute(module)
            _adopt(name, module)

        try:
            loader.exec_module = exec_module  # this spec's own loader instance
        except (AttributeError, TypeError):
            return spec  # a loader that cannot take it: the module loads without kdb
        return spec

    def invalidate_caches(self):
        pass

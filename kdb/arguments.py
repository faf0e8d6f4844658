"""The caller's mistakes in KernelDB's API, refused at once with a message that says what to do.

The cache fails soft on its own faults (:mod:`kdb.faults`) and loud on a caller's: a wrong
type raises :class:`~kdb.errors.InvalidArgumentError` before anything runs, never inside a
background store where nobody would see it.
"""

from __future__ import annotations

import os

from .errors import InvalidArgumentError
from .keys import HashAttributes


def check_db_arguments(cache_dir: object, system_path: object, **flags: object) -> None:
    """``KernelDB(...)``'s arguments."""
    paths = (str, os.PathLike)
    if cache_dir is not None and not isinstance(cache_dir, paths):
        raise InvalidArgumentError(
            f"cache_dir must be a path (str or os.PathLike), not {type(cache_dir).__name__}")
    items = system_path if isinstance(system_path, (list, tuple)) else [system_path]
    if system_path is not None and not all(isinstance(p, paths) for p in items):
        raise InvalidArgumentError(
            "system_path must be a path, an os.pathsep-separated string, or a list of paths; "
            f"got {system_path!r}")
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be True, False or None, not {value!r}")


def check_attrs(attrs: object) -> None:
    if not isinstance(attrs, HashAttributes):
        raise InvalidArgumentError(f"expected kdb.HashAttributes, got {type(attrs).__name__}")


def check_binary(binary: object, what: str = "binary must be bytes, not") -> None:
    if not isinstance(binary, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"{what} {type(binary).__name__}")


def check_compile_fn(compile_fn: object) -> None:
    if not callable(compile_fn):
        raise InvalidArgumentError(
            f"compile_fn must be a function returning bytes, not {type(compile_fn).__name__}")


def check_seconds(compile_seconds: object) -> None:
    if isinstance(compile_seconds, bool) or not isinstance(compile_seconds, (int, float)):
        raise InvalidArgumentError(
            f"compile_seconds must be a number, not {type(compile_seconds).__name__}")


def check_details(details: object) -> None:
    """``details`` is stored as JSON: refuse what JSON cannot hold before anything runs."""
    if details is None:
        return
    if not isinstance(details, dict):
        raise InvalidArgumentError(
            f"details must be a dict of JSON values, not {type(details).__name__}")
    import json

    try:
        json.dumps(details, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise InvalidArgumentError(
            f"details must hold only JSON values (str, numbers, bools, lists, dicts with str "
            f"keys): {err}") from None

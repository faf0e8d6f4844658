"""What every back end does the same way: source text in, a label for listings out, a
compiler back end's miss (compile, log, store later), and regular expressions compiled at
their first use (:class:`LazyPattern`: ``re.compile`` costs 50-300 us a pattern, and
``import kdb.opencl`` is paid by every process a framework starts, most of which never
read an ``#include`` or label a kernel)."""

from __future__ import annotations

import itertools
import re
import time
from typing import Callable

from .. import logs
from ..bookkeeping import UNCACHED, first_uncached
from ..errors import InvalidArgumentError, UnsupportedTypeError


#: What a compiled pattern answers; the first use copies them onto the instance, so later
#: calls are plain attribute reads.
_ATTRIBUTES = ("match", "fullmatch", "search", "sub", "subn", "split", "findall", "finditer",
               "pattern", "flags", "groups", "groupindex")


class LazyPattern:
    """``re.compile(pattern, flags)``, done on the first attribute asked for.

    >>> p = LazyPattern(r"a(\\d+)")
    >>> p.search("xa12").group(1), p.sub("-", "a1a2"), p.pattern
    ('12', '--', 'a(\\\\d+)')
    """

    def __init__(self, pattern: str, flags: int = 0) -> None:
        self._args = (pattern, flags)

    def __getattr__(self, name: str):
        if name not in _ATTRIBUTES:
            raise AttributeError(name)
        compiled = re.compile(*self._args)
        for attribute in _ATTRIBUTES:
            setattr(self, attribute, getattr(compiled, attribute))
        return getattr(compiled, name)

    def __repr__(self) -> str:
        return f"LazyPattern({self._args[0]!r})"


def inductor_caches_off() -> bool:
    """Whether torch.compile's user told Inductor to cache nothing
    (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``, or ``torch._inductor.config``'s
    ``force_disable_caches``, which the documentation says overrides every other caching
    setting: one debugs a compiler so). kdb then serves Inductor nothing either, its C++
    modules and Triton kernels included, and stores nothing of it. False where Inductor's
    configuration was never imported."""
    import sys

    settings = sys.modules.get("torch._inductor.config")
    return bool(getattr(settings, "force_disable_caches", False)) if settings else False


def source_text(source: str | bytes, language: str) -> str:
    """The program text as ``str``; bytes must be UTF-8.

    >>> source_text(b"__kernel void f() {}", "OpenCL")
    '__kernel void f() {}'
    """
    if isinstance(source, (bytes, bytearray)):
        try:
            return bytes(source).decode("utf-8")
        except UnicodeDecodeError as err:
            raise InvalidArgumentError(f"{language} source is not valid UTF-8") from err
    if not isinstance(source, str):
        raise UnsupportedTypeError(f"source must be str or bytes, not {type(source).__name__}")
    return source


def label(kernel_re: re.Pattern[str], source: str, fallback: str) -> str:
    """A listing label: the first kernel names found by ``kernel_re``, else ``fallback``.

    >>> label(re.compile(r"void (\\w+)"), "void a() void b()", "program")
    'a,b'
    """
    # The first five: a source of many kernels is not scanned to its end for a label.
    names = [m.group(1) for m in itertools.islice(kernel_re.finditer(source), 5)]
    return names_label(names, fallback)


def names_label(names: list[str], fallback: str) -> str:
    """A listing label from kernel names: the first four, else ``fallback``.

    >>> names_label(["a", "b", "c", "d", "e"], "program"), names_label([], "program")
    ('a,b,c,d,...', 'program')
    """
    return ",".join(names[:4]) + (",..." if len(names) > 4 else "") if names else fallback


class UnkeyedRead(Exception):
    """The compiler read a file the key does not hold (its dependency list names one the
    include model did not find): the binary is served, not stored."""

    def __init__(self, binary: bytes, why: str) -> None:
        super().__init__(why)
        self.binary = binary


def uncached_build(db, attrs, build: Callable[[], bytes], why: str, language: str) -> bytes:
    """A build of a compiler back end (CUDA, HIP) neither looked up nor stored, ``why``: kdb
    cannot be sure what it reads, or it is never the same twice. Warned once per cause and
    logged with ``why`` in the start-up latency log, as it compiles at every start."""
    if not db.tiers.disabled:
        logs.warn_once(f"{language}-uncached:{why[:40]}", "kdb: %s; such %s programs are "
                       "built without the cache", why, language)
    start = time.perf_counter()
    try:
        binary = build()
    except UnkeyedRead as err:
        binary = err.binary
    log_uncached(db, [attrs], time.perf_counter() - start, why)
    return binary


def log_uncached(db, attrs: list, seconds: float, why: str) -> None:
    """An uncached build of ``attrs`` (its seconds shared among them) in the start-up
    latency log, with why it was not cached, once per key and process; counted as a compile
    each time (a build repeated five times was counted once)."""
    for a in attrs:
        if first_uncached(a.key):
            db.tiers.storing.log_compile(db.tiers.record_compile(
                a, seconds / len(attrs), reason=UNCACHED + why))
        else:
            db.tiers.count_compile(a, seconds / len(attrs))


def served_unkeyed(db, attrs, err: UnkeyedRead, seconds: float, language: str) -> bytes:
    """A build that read a file its key does not hold: served, not stored, warned once per
    process, and logged like any build kdb does not cache (it compiles at every start)."""
    logs.warn_once(f"{language}-includes:unkeyed", "kdb: %s; such %s programs are built "
                   "without the cache", err, language)
    log_uncached(db, [attrs], seconds, str(err))
    return err.binary


def cached_build(db, attrs, build: Callable[[], bytes], details: dict,
                 recheck: Callable[[], tuple] | None, language: str) -> bytes:
    """A compiler back end's binary from kdb, or built now and stored (its headers checked
    again first with ``recheck``: a header saved while the compiler ran is not stored under
    the key of the one before, :func:`kdb.storing.stores.headers_changed`)."""
    start = time.perf_counter()
    try:
        return db.tiers.get_or_compile(attrs, build, details=details, recheck=recheck)
    except UnkeyedRead as err:
        return served_unkeyed(db, attrs, err, time.perf_counter() - start, language)


def compile_and_store(db, attrs, build: Callable[[], bytes], details: dict,
                      recheck: Callable[[], tuple] | None, language: str) -> bytes:
    """A miss of a compiler back end (CUDA, HIP): compile now, log the compile, store the
    result in the background (its headers checked again first with ``recheck``); a build
    that read a file the key does not hold is served and not stored."""
    start = time.perf_counter()
    try:
        binary = build()
    except UnkeyedRead as err:
        return served_unkeyed(db, attrs, err, time.perf_counter() - start, language)
    seconds = time.perf_counter() - start
    rec = db.tiers.record_compile(attrs, seconds)
    db.tiers.storing.put_later(attrs, lambda: binary, compile_seconds=seconds,
                               details=details, log=rec, recheck=recheck)
    return binary

"""Inductor's per-key caches in kdb: the FX graph cache, the AOTAutograd cache and the
autotuning caches, through Inductor's remote-cache interface.

Inductor asks a "remote" cache for an entry by its own key after its local directory missed
(``torch._inductor.remote_cache.RemoteCacheBackend``: ``get(key)``, ``put(key, bytes)``), and
each cache class takes a backend class in ``backend_override_cls``. :class:`Backend` is that
backend: a get is one kdb lookup (system tiers, user tier, shared tier); a miss claims the key
so that of many processes compiling one graph one compiles and the others wait for its entry;
a put stores the entry off the critical path and releases the claim. A compile that ends
without a put (Inductor decided not to cache it, or it raised) releases its claims when
Dynamo's compile of the frame ends, except an AOTAutograd entry's: AOTAutograd puts it only
once the backward graph is compiled, which torch defers to the first backward call (its lazy
backward), after the frame's compile has ended; that claim is released when the backward's
compile ends (:func:`release_unstored`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from torch._inductor.remote_cache import RemoteCacheBackend

from ... import logs
from ...bookkeeping import own_seconds
from ...claims import COMPILING, Claim
from ...db import default_db
from ...keys import HashAttributes
from ...tiers import Hit
from .targets import BACKEND, device_arch, identity

log = logs.get("kdb")

#: How Inductor's AOTAutograd cache names its keys (``pt2:autograd-experimental::<key>``).
AOT_PREFIX = "pt2:autograd-"


@dataclass
class _Compiling:
    """A claim this process holds for an entry it is compiling, and whose compile it is."""

    claim: Claim
    start: float
    thread: int
    aot: bool
    #: The frame's compile id once its compile ended before AOTAutograd put the entry: the
    #: entry comes with that frame's lazy backward.
    backward_of: str | None = None


#: Claims this process holds for entries it is compiling, by kdb key.
_compiling: dict[str, _Compiling] = {}
_lock = threading.Lock()


def attrs_for(key: str) -> HashAttributes:
    """The kdb attributes of Inductor's key (``pt2:fx-graph-v1::<key>:c1``): the key itself,
    the process's device arch, torch's version and the Python."""
    cache_id, _, rest = key.partition("::")
    name = f"{cache_id.removeprefix('pt2:')}:{rest[:12]}" if rest else key[:40]
    return HashAttributes(backend=BACKEND, source=key, arch=device_arch(),
                          compiler=identity(), name=name)


class Backend(RemoteCacheBackend[bytes]):
    """kdb as the store behind Inductor's remote caches (see the module's docstring)."""

    def _get(self, key: str) -> bytes | None:
        attrs = attrs_for(key)
        tiers = default_db().tiers
        hit = tiers.lookup(attrs)
        if hit is None:
            claimed = tiers.claim_or_wait(attrs)
            if isinstance(claimed, Claim):
                with _lock:
                    _compiling[attrs.key] = _Compiling(claimed, time.perf_counter(),
                                                       threading.get_ident(),
                                                       key.startswith(AOT_PREFIX))
                return None
            hit = claimed if isinstance(claimed, Hit) else None
        return None if hit is None else _served(tiers, attrs, hit)

    def _put(self, key: str, data: bytes) -> None:
        attrs = attrs_for(key)
        with _lock:
            held = _compiling.pop(attrs.key, None)
        claim = held.claim if held is not None else None
        seconds = time.perf_counter() - held.start if held is not None else 0.0
        blob = bytes(data)
        tiers = default_db().tiers
        own = own_seconds(BACKEND, seconds)  # less its graphs and C++ modules
        rec = tiers.record_compile(attrs, seconds, own=own)
        tiers.storing.put_later(attrs, lambda: blob, compile_seconds=own,
                                details={"inductor_key": key}, log=rec, claim=claim)


def _served(tiers, attrs: HashAttributes, hit: Hit) -> bytes | None:
    """The entry's bytes if they are what Inductor stores (one JSON object), else the entry
    is dropped and Inductor compiles (kdb's checksum caught corruption already: this catches
    an entry that was never Inductor's)."""
    raw = bytes(hit.binary)
    try:
        ok = isinstance(json.loads(raw), dict)
    except ValueError:
        ok = False
    if not ok:
        tiers.storing.discard(attrs, "not an Inductor cache entry", hit.tier)
        return None
    return raw


#: How long a process waits for an AOTAutograd entry whose frame has compiled and whose
#: backward has not begun to: the holder may spend this share of its compile's time (and at
#: least 2 s) of CPU before the backward's compile begins (a training step's loss, in
#: practice ms); then the waiter traces the graph itself, every graph served from kdb. A
#: program that never runs the backward (inference with parameters that require grad) puts
#: no entry, and three such processes started together waited 21 s for it (one traced and
#: compiled in 9.2 s, the others' first output came at 29-30 s; 13 s each without kdb).
AWAIT_BACKWARD = 0.2


def backward_begins(args=None) -> None:
    """Dynamo's compile of a lazy backward begins (``args``: torch's ``CallbackArgs``): the
    AOTAutograd entry its frame holds a claim for is being compiled again, and its waiters
    judge the holder as a compile (by its progress) until the entry is put."""
    trigger = getattr(getattr(args, "callback_trigger", None), "name", None)
    compile_id = getattr(args, "compile_id", None)
    if trigger != "LAZY_BACKWARD" or compile_id is None:
        return
    with _lock:
        held = [v for v in _compiling.values() if v.backward_of == compile_id]
    for h in held:
        h.claim.mark(COMPILING)


def release_unstored(args=None) -> None:
    """Dynamo's compile of a frame, or of its lazy backward, ended (``args``: torch's
    ``CallbackArgs``): a claim this thread still holds is a compile that stored nothing;
    release it, or other processes would wait for an entry that never comes.

    Not an AOTAutograd entry's at a frame's end: AOTAutograd puts it once the backward graph
    is compiled, at the first backward call. Its claim says pending until that backward's
    compile begins (a waiter waits while the holder spends :data:`AWAIT_BACKWARD` of the
    compile's time, at least 2 s, of CPU), compiling from then (:func:`backward_begins`), and
    is released when it ends: both carry the frame's compile id."""
    trigger = getattr(getattr(args, "callback_trigger", None), "name", None)
    compile_id = getattr(args, "compile_id", None)
    me, now = threading.get_ident(), time.perf_counter()

    def ends(held: _Compiling) -> bool:
        if held.backward_of is not None:
            return trigger == "LAZY_BACKWARD" and held.backward_of == compile_id
        return held.thread == me

    with _lock:
        ending = [k for k, v in _compiling.items() if ends(v)]
        later = [k for k in ending if _compiling[k].aot and trigger == "DYNAMO"
                 and compile_id is not None]
        for key in later:
            _compiling[key].backward_of = compile_id
        pending = [_compiling[k] for k in later]
        claims = [_compiling.pop(k).claim for k in ending if k not in later]
    for held in pending:
        seconds = now - held.start
        held.claim.mark_pending(seconds, budget=max(AWAIT_BACKWARD * seconds, 2.0))
    for claim in claims:
        claim.release()

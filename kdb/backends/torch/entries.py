"""Inductor's per-key caches in kdb: the FX graph cache, the AOTAutograd cache and the
autotuning caches, through Inductor's remote-cache interface.

Inductor asks a "remote" cache for an entry by its own key after its local directory missed
(``torch._inductor.remote_cache.RemoteCacheBackend``: ``get(key)``, ``put(key, bytes)``), and
each cache class takes a backend class in ``backend_override_cls``. :class:`Backend` is that
backend: a get is one kdb lookup (system tiers, user tier, shared tier); a miss claims the key
so that of many processes compiling one graph one compiles and the others wait for its entry;
a put stores the entry off the critical path and releases the claim. A compile that ends
without a put (Inductor decided not to cache it, or it raised) releases its claims when
Dynamo's compile of the frame ends.
"""

from __future__ import annotations

import json
import threading
import time

from torch._inductor.remote_cache import RemoteCacheBackend

from ... import logs
from ...claims import Claim
from ...db import default_db
from ...keys import HashAttributes
from ...tiers import Hit
from .targets import BACKEND, device_arch, identity

log = logs.get("kdb")

#: Claims this process holds for entries it is compiling: kdb key -> (claim, start, thread).
_compiling: dict[str, tuple[Claim, float, int]] = {}
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
                    _compiling[attrs.key] = (claimed, time.perf_counter(),
                                             threading.get_ident())
                return None
            hit = claimed if isinstance(claimed, Hit) else None
        return None if hit is None else _served(tiers, attrs, hit)

    def _put(self, key: str, data: bytes) -> None:
        attrs = attrs_for(key)
        with _lock:
            claim, start, _ = _compiling.pop(attrs.key, (None, None, None))
        seconds = time.perf_counter() - start if start is not None else 0.0
        blob = bytes(data)
        tiers = default_db().tiers
        rec = tiers.record_compile(attrs, seconds)
        tiers.storing.put_later(attrs, lambda: blob, compile_seconds=seconds,
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


def release_unstored(*_args) -> None:
    """Dynamo's compile of a frame ended: a claim this thread still holds is a compile that
    stored nothing; release it, or other processes would wait for an entry that never comes."""
    me = threading.get_ident()
    with _lock:
        mine = [k for k, v in _compiling.items() if v[2] == me]
        claims = [_compiling.pop(k)[0] for k in mine]
    for claim in claims:
        claim.release()

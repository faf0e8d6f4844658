"""Serving a lookup where no compiler is installed (the compiler-free key).

A key holds the compiler's identity, which a back end works out from the compiler itself; a
machine with the driver but no compiler cannot, so its exact key is unknowable and nothing
stored would ever be served there. Every entry therefore also stores its *compiler-free
key*: the key of its attributes with the compiler identity left out (revision 0004). A back
end that finds no compiler looks up by that key (its attributes have an empty compiler),
keeps the entries whose stored attributes equal its own on every other attribute, and
ranks them by the compiler that built them, newest first (system files before the user file
at equal rank). The caller takes the first; a binary the driver refuses is dropped and the
next one tried.

What it trades: where a compiler is present, the key pins the exact compiler and a new
compiler misses; without one, any compiler's build of the same source, options, headers,
arch and environment is accepted, as it would be if that compiler were installed and had
built it. That is safe because nothing better exists on such a machine (it cannot compile),
the arch id already names the binary-compatibility class, and the driver checks what it
loads. A file written before revision 0004 simply gives no candidates.
"""

from __future__ import annotations

import json
from collections import namedtuple
from typing import TYPE_CHECKING

from .. import logs
from ..file.codec import decode
from ..keys import HashAttributes

if TYPE_CHECKING:
    from typing import Any, Callable, Iterable

    from ..db import KernelDB

log = logs.get("kdb")
trace_log = logs.get("kdb.trace")

_TIER_ORDER = {"system": 0, "user": 1}


class Candidate(namedtuple("Candidate", "binary attrs tier path compile_seconds")):
    """A stored binary built by some compiler for everything else the lookup asked:
    ``attrs`` are the stored attributes (with that compiler), as
    :meth:`kdb.tiers.Tiers.discard` takes them."""

    __slots__ = ()

    @property
    def compiler(self) -> tuple[tuple[str, str], ...]:
        return self.attrs.compiler


def candidates(db: KernelDB, attrs: HashAttributes,
               rank: Callable[[tuple[tuple[str, str], ...]], Any],
               accept: Callable[[tuple[tuple[str, str], ...]], bool] | None = None
               ) -> list[Candidate]:
    """Entries of every local tier that match ``attrs`` on all but the compiler, best first.

    ``rank(compiler pairs)`` gives a sortable value, larger for a newer compiler;
    ``accept(compiler pairs)`` may restrict the compilers (e.g. only nvcc's builds).
    """
    if db.tiers.disabled:
        return []
    free_key = attrs.compiler_free_key
    want = _without_compiler(attrs.encoded())
    found: dict[str, tuple[Any, Candidate]] = {}
    files = (*db.tiers.system_files(attrs.arch), db.tiers.user_file(attrs.arch))
    for f in files:
        for key, row in f.fetch_any_compiler(free_key):
            if key in found:
                continue
            try:
                data = json.loads(row.attributes)
            except (TypeError, ValueError):
                continue
            compiler = data.get("compiler") if isinstance(data, dict) else None
            if not isinstance(compiler, list) or _without_compiler(data) != want:
                continue  # another attribute differs: a digest collision, never served
            try:
                stored = HashAttributes.from_canonical(data, name=attrs.name)
            except Exception:  # noqa: BLE001 - a foreign row is skipped, never fatal
                continue
            if stored.key != key or (accept is not None and not accept(stored.compiler)):
                continue
            raw = decode(row.codec, row.blob, row.raw_size, row.checksum)
            if raw is None or not _vouched(f, key, attrs.name, row, raw):
                continue
            found[key] = ((rank(stored.compiler), -_TIER_ORDER.get(f.tier, 2), key),
                          Candidate(raw, stored, f.tier, str(f.path), row.compile_seconds))
    ranked = [c for _, c in sorted(found.values(), key=lambda rc: rc[0], reverse=True)]
    if db.tiers.trace:
        trace_log.debug("no compiler here: lookup %s by compiler-free key, %d candidate(s)%s",
                        attrs.name or free_key[:16], len(ranked), "".join(
                            f"\n  {c.attrs.key[:16]} {c.tier} built by {describe(c.compiler)}"
                            for c in ranked))
    return ranked


def served(db: KernelDB, attrs: HashAttributes, cand: Candidate) -> None:
    """Report (trace, debug log, hit counters) that ``cand`` answered ``attrs``."""
    msg = ("no compiler here; %s served from the %s tier (%s), entry %s built by %s "
           "(the newest compiler of the stored builds)")
    args = (attrs.name or attrs.key[:16], cand.tier, cand.path, cand.attrs.key[:16],
            describe(cand.compiler))
    log.debug("kdb: " + msg, *args)
    if db.tiers.trace:
        trace_log.debug(msg, *args)
    db.tiers.count(attrs.arch, f"hits.{cand.tier}", 1,  # the hit counters
                   key=cand.attrs.key if cand.tier == "user" else None, saved=cand.compile_seconds)


def describe(compiler: Iterable[Iterable[str]]) -> str:
    """A compiler identity in one line: its version attributes.

    >>> describe([("nvrtc_version", "13.5"), ("libnvrtc", "gnu-build-id:ab")])
    'nvrtc 13.5'
    >>> describe([("nvcc_version", "nvcc: NVIDIA\\nCuda compilation tools, release 13.0, V13.0.88")])
    'nvcc release 13.0, V13.0.88'

    hipcc's ``--version`` names HIP's release on its first line, clang's after it:

    >>> describe([("hipcc_version", "HIP version: 5.2.21153-0\\nDebian clang version 15.0.6"
    ...            "\\nTarget: x86_64-pc-linux-gnu\\nThread model: posix")])
    'hipcc 5.2.21153-0'
    """
    parts = []
    for name, value in compiler:
        if name.endswith("_version"):
            parts.append(f"{name[:-len('_version')]} {_release(value)}")
    return ", ".join(parts) or "an unnamed compiler"


def _release(version: str) -> str:
    """The line of a ``--version`` text that names the release: nvcc's ``release``, hipcc's
    ``HIP version:``, else the first line (clang's later lines name the host and threads)."""
    lines = [line.strip() for line in version.strip().splitlines() if line.strip()]
    for line in lines:
        if "release" in line:
            return line[line.index("release"):]
        if line.startswith("HIP version:"):
            return line[len("HIP version:"):].strip()
    return lines[0] if lines else ""


def _without_compiler(attributes: Any) -> dict:
    data = json.loads(attributes) if isinstance(attributes, (str, bytes)) else dict(attributes)
    data.pop("compiler", None)
    return data


def _vouched(f, key: str, name: str, row, raw: bytes) -> bool:
    """Under a trust policy covering ``f``'s tier, a candidate is one a trusted key signed
    (:mod:`kdb.signing`), as for any hit."""
    from ..signing import policy as signing

    policy = signing.current()
    if policy is None or not policy.covers(f.tier):
        return True
    signer, signature = f.signature(key)
    cause = policy.check(key, row.attributes, raw, row.checksum, signer, signature)
    if cause is not None:
        policy.refused(f.tier, f.filename, key, name, cause, signer)
    return cause is None

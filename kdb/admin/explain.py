"""``kdb explain``: why a kernel missed, and how it differs from the nearest stored entries.

Reads only (:mod:`kdb.admin.tierfiles`). Nearest entries share the kernel's name, or its back end
and arch, and are ranked by how few canonical attributes differ (:func:`kdb.keys.differences`).
"""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

from .. import registry
from ..bookkeeping import UNCACHED
from ..errors import InvalidArgumentError
from ..file import compact
from ..file.fileformat import DAMAGE
from ..keys import differences
from .report import log_record
from .tierfiles import has_column, read_rows, reading, tier_files

log = logging.getLogger("kdb")

_HEX_RE = re.compile(r"[0-9a-f]{4,64}\Z")
_ENTRY_COLS = "key, name, arch, backend, {attributes}, {details}, created, last_access, hits"


def _match_sql(query: str) -> tuple[str, tuple]:
    """A WHERE clause matching a key prefix or a kernel name (one of a program's names)."""
    by_name = "(name = ? OR instr(',' || name || ',', ',' || ? || ',') > 0)"
    q = query.lower()
    if _HEX_RE.match(q):
        return f"((key >= ? AND key < ?) OR {by_name})", (q, q + "g", query, query)
    return by_name, (query, query)


def _entry_rows(conn: sqlite3.Connection, where: str, params: tuple, tier: str, path: Path,
                limit: int | None = None) -> list[dict]:
    details = "details" if has_column(conn, "kernels", "details") else "'{}'"
    attributes, join = compact.columns(has_column(conn, "kernels", "attrs"))
    sql = f"SELECT {_ENTRY_COLS.format(attributes=attributes, details=details)} " \
          f"FROM kernels{join} WHERE {where} ORDER BY last_access DESC"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    out = []
    for r in read_rows(conn, sql, params):
        out.append({"key": r[0], "name": r[1], "arch": r[2], "backend": r[3],
                    "attributes": r[4], "details": _json_or_text(r[5]), "created": r[6],
                    "last_access": r[7], "hits": r[8], "tier": tier, "path": str(path)})
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def explain(user_dir: Path, query: str, nearest: int = 5) -> dict[str, Any]:
    """Why a kernel missed: its entry and compile records, and the nearest stored entries.

    ``query`` is a key prefix (4+ hex digits) or a kernel name. Nearest entries share the
    name, or the back end and arch, and are ranked by how few canonical attributes differ.
    """
    query = query.strip()
    if not query:
        raise InvalidArgumentError("give a key prefix or a kernel name (see `kdb ls`)")
    where, params = _match_sql(query)
    files = tier_files(user_dir, None, None)
    found, logs = _matches(files, where, params)
    keys = {e["key"] for e in found} | {r["key"] for r in logs}
    key = _chosen_key(query, keys, found, logs)
    mine = [e for e in found if e["key"] == key]
    records = sorted((r for r in logs if r["key"] == key), key=lambda r: r["at"], reverse=True)
    entry = mine[0] if mine else None
    name = entry["name"] if entry else records[0]["name"]
    arch = entry["arch"] if entry else records[0]["arch"]
    backend = entry["backend"] if entry else records[0]["backend"]
    target = _json_or_text(entry["attributes"]) if entry else None
    if not isinstance(target, dict):
        target = None  # attributes that do not decode (a lost source): nothing to compare
    ranked, builds = _nearest(files, (key, name, backend, arch), target,
                              mine[0]["tier"] if mine else "")
    if entry is not None:
        entry = dict(entry)
        entry["attributes"] = _json_or_text(entry["attributes"])
    return {
        "why": _why(records, mine, ranked, name, backend, arch),
        "query": query,
        "key": key,
        "name": name,
        "arch": arch,
        "backend": backend,
        "entries": [{k: v for k, v in e.items() if k != "attributes"} for e in mine],
        "entry": entry,
        "compiles": records,
        "nearest": ranked[:nearest],
        "candidates": len(ranked),
        "without_compiler": _without_compiler(backend, builds),
        "other_matches": sorted(keys - {key}),
    }


def _matches(files: list, where: str, params: tuple) -> tuple[list[dict], list[dict]]:
    """The stored entries the query matches in every tier, and the user tier's compile
    records of them; a damaged file is skipped with a warning."""
    found: list[dict] = []
    logs: list[dict] = []
    for t, path, _ in files:
        try:
            with reading(path, t) as conn:
                found += _entry_rows(conn, where, params, t, path)
                if t == "user":
                    logs += [log_record(r) for r in read_rows(
                        conn, "SELECT at, key, name, arch, backend, seconds, missed, reason, "
                        f"pid FROM compile_log WHERE {where} ORDER BY at DESC", params)]
        except DAMAGE as err:
            log.warning("kdb: %s skipped: %s", path, err)
    return found, logs


def _chosen_key(query: str, keys: set[str], found: list[dict], logs: list[dict]) -> str:
    """The one key the query names: a unique key prefix, else the name's latest compile,
    else its latest stored entry."""
    if not keys:
        raise InvalidArgumentError(
            f"no stored entry or compile record matches {query!r}; `kdb ls` lists the keys "
            "and names, `kdb log` the compiles")
    by_key = [k for k in keys if k.startswith(query.lower())]
    if len(by_key) > 1:
        raise InvalidArgumentError(
            f"key prefix {query!r} is ambiguous ({len(by_key)} keys: "
            + ", ".join(sorted(k[:16] for k in by_key)[:5]) + "); give more digits")
    if by_key:
        return by_key[0]
    logs.sort(key=lambda r: r["at"], reverse=True)
    return logs[0]["key"] if logs else max(found, key=lambda e: e["created"])["key"]


def _nearest(files: list, kernel: tuple[str, str, str, str], target: dict | None,
             tier: str) -> tuple[list[dict], list[tuple[str, str, list]]]:
    """The entries sharing the kernel's name, or its back end and arch, ranked by how few
    attributes differ; and the builds that differ from it only in the compiler."""
    key, name, backend, arch = kernel
    candidates: dict[str, dict] = {}
    # Those of its name first, each kind up to a limit: one query of both, cut at the 1000
    # most recently used, lost the older entries of its name (past 1000 entries, the
    # nearest entry, and so the why, was another kernel's).
    near = (("key != ? AND name = ?", (key, name)),
            ("key != ? AND name != ? AND backend = ? AND arch = ?", (key, name, backend, arch)))
    for t, path, _ in files:
        try:
            with reading(path, t) as conn:
                for where, params in near:
                    for e in _entry_rows(conn, where, params, t, path, limit=1000):
                        candidates.setdefault(e["key"], e)
        except DAMAGE:
            continue  # reported by _matches
    ranked = []
    builds = [] if target is None else [(key, tier, target.get("compiler") or [])]
    for e in candidates.values():
        attrs = _json_or_text(e.pop("attributes"))
        if target is not None and isinstance(attrs, dict):
            diff = differences(target, attrs)
            if diff == ["compiler"]:
                builds.append((e["key"], e["tier"], attrs.get("compiler") or []))
            e["differs"] = {k: describe_difference(k, target.get(k), attrs.get(k))
                            for k in diff}
            if "compiler" in diff:
                e["another"] = another(target.get("compiler"), attrs.get("compiler"))
        else:
            e["differs"] = None
        ranked.append(e)
    ranked.sort(key=lambda e: (len(e["differs"]) if e["differs"] is not None else 10**6,
                               e["name"] != name, -e["created"]))
    return ranked, builds


def _without_compiler(backend: str, builds: list[tuple[str, str, list]]) -> dict | None:
    """Which of the builds that differ only in the compiler a process with no compiler
    installed is served (:mod:`kdb.backends.fallback`): the newest compiler's, system tier first."""
    try:
        rank_path = registry.get(backend).compiler_rank
    except LookupError:
        rank_path = None
    if rank_path is None or not builds:
        return None  # only some back ends' compilers can be absent where binaries load
    compiler_rank = registry.load(rank_path)
    from ..backends.fallback import describe

    order = {"system": 0, "user": 1}
    ranked = sorted(builds, key=lambda b: (compiler_rank([tuple(p) for p in b[2]]),
                                           -order.get(b[1], 2), b[0]), reverse=True)
    return {"served": ranked[0][0], "built_by": describe(ranked[0][2]),
            "builds": [{"key": k, "tier": t, "compiler": describe(c)} for k, t, c in ranked]}


def _why(records: list[dict], stored: list[dict], ranked: list[dict], name: str,
         backend: str, arch: str) -> str:
    """One sentence: why this key was compiled (or why it was not)."""
    if not records:
        tiers = ", ".join(sorted({e["tier"] for e in stored}))
        return f"no compile of this key is recorded; it is stored in the {tiers} tier"
    reason = records[0]["reason"] or "not in any tier"
    if reason.startswith(UNCACHED):  # built at every start: no entry to compare with
        return f"kdb does not cache this build, so every start compiles it ({reason})"
    if gone := _left_since(records):
        return f"{reason}; {gone}"
    if not ranked:
        return (f"{reason}; no other entry is named {name!r} or built for {backend} on "
                f"{arch}: it had never been compiled before")
    best = ranked[0]
    if best["differs"] is None:
        return f"{reason}; its attributes were not stored, so no comparison is possible"
    parts = [f"{k} (another {', another '.join(best['another'])})"
             if k == "compiler" and best.get("another") else k for k in best["differs"]]
    said = f"{reason}; the nearest stored entry ({best['key'][:12]}) differs in " + \
        ", ".join(parts)
    if "compiler" in best["differs"]:
        return said
    # Where a compiler's version is in the key's source too (Inductor's keys hold torch's),
    # no entry of another compiler is nearer than one of this compiler's other kernels.
    other = [e for e in ranked if e.get("another")]
    if not other:
        return said
    made_by = sorted({part for e in other for part in e["another"]})
    return (f"{said}; {len(other)} stored {backend} entr{'y' if len(other) == 1 else 'ies'} "
            f"for {arch} {'was' if len(other) == 1 else 'were'} made by another "
            + ", another ".join(made_by))


def _left_since(records: list[dict]) -> str | None:
    """Where this key's last compile began after an earlier one had ended, and nothing
    else explains it (a store another process had queued): the earlier one's entry has
    left the user tier since (its attributes may equal the nearest entry's, and say
    nothing)."""
    if len(records) < 2 or "; " in (records[0]["reason"] or ""):
        return None
    last, before = records[0], records[1]
    if last["at"] - last["seconds"] <= before["at"]:
        return None  # two compiles at once: single flight's miss, not a lost entry
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(before["at"]))
    return (f"it was compiled before, at {when} (pid {before['pid']}), and its entry left "
            "the user tier since: evicted (`kdb stats` counts evictions), dropped as "
            "damaged, or its store never landed")


def another(mine: Any, other: Any) -> list[str]:
    """The parts of a compiler identity (``[[name, value], ...]``) that differ, so that a
    miss reads "another torch" rather than a list of versions.

    >>> another([["torch", "2.13.0"], ["python", "cpython-311"]],
    ...         [["torch", "2.12.1"], ["python", "cpython-311"]])
    ['torch']
    """
    def pairs(value: Any) -> dict:
        ok = isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value)
        return {str(p[0]): p[1] for p in value} if ok else {}

    a, b = pairs(mine), pairs(other)
    return [name for name in dict.fromkeys([*a, *b]) if a.get(name) != b.get(name)]


def describe_difference(name: str, mine: Any, other: Any) -> str:
    """A short human account of how one canonical attribute differs.

    >>> describe_difference("build_options", ["-DN=64"], ["-DN=32"])
    'this: -DN=64; other: -DN=32'
    >>> describe_difference("arch", "sm_90", "sm_80")
    "this: 'sm_90'; other: 'sm_80'"
    >>> a, b = "a = b; " * 10, " d = e;" * 10
    >>> describe_difference("source", a + "c = 1;" + b, a + "c = 2;" + b)[:60]
    "line 1: this '...; a = b; a = b; c = 1; d = e; d = e; d = e;"
    """
    if isinstance(mine, list) and isinstance(other, list):
        a = [_short(x) for x in mine]
        b = [_short(x) for x in other]
        only_a = [x for x in a if x not in b]
        only_b = [x for x in b if x not in a]
        if not only_a and not only_b:
            return "same items, different order"
        return f"this: {', '.join(only_a) or '-'}; other: {', '.join(only_b) or '-'}"
    if isinstance(mine, str) and isinstance(other, str) and ("\n" in mine or "\n" in other
                                                             or len(mine) > 60):
        la, lb = mine.splitlines(), other.splitlines()
        for i, (x, y) in enumerate(zip(la, lb)):
            if x != y:
                return f"line {i + 1}: this {_around(x, y)!r}; other {_around(y, x)!r}"
        return f"this has {len(la)} lines, other {len(lb)}"
    return f"this: {_short(mine)!r}; other: {_short(other)!r}" if not isinstance(mine, list) \
        else f"this: {_short(mine)}; other: {_short(other)}"


def _around(line: str, other: str, width: int = 50) -> str:
    """``width`` characters of ``line`` from a little before where it first differs from
    ``other`` (a long line's start is the same in both: showing it says nothing)."""
    line, other = line.strip(), other.strip()
    at = next((i for i, (a, b) in enumerate(zip(line, other)) if a != b),
              min(len(line), len(other)))
    start = max(0, min(at - 20, len(line) - width))
    return ("..." if start else "") + line[start:start + width]


def _short(value: Any, width: int = 60) -> str:
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        text = f"{value[0]}={value[1]}"  # a (name, value) pair
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."

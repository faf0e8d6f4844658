"""``kdb verify``'s checks: integrity, schema revision and every entry of every tier's files.

Reads only (:mod:`kdb.admin.tierfiles`); :func:`verify` takes the repair as a function, which
:mod:`kdb.admin.maintenance` passes for ``kdb verify --repair``.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from .. import config
from ..file import discovery
from ..file import compact
from ..file.fileformat import (
    COMPACT_FROM,
    DAMAGE,
    HEAD,
    SIGNED_FROM,
    TOTALS_FROM,
    at_least,
    has_no_tables,
    journal_of,
    missing_tables,
    revision_of,
    status_of,
)
from .tierfiles import file_size, odd_user_files, provider, read_rows, reading, user_files

_VERIFY_SQL = ("SELECT kernels.key, name, arch, codec, blob, raw_size, stored_size, checksum, "
               "{attributes}, {signed}, {digest} FROM kernels{join}")
#: Sources no entry names (revision 0006): left by a writer's bug or a hand edit; a repair
#: drops them.
UNUSED_SOURCES = ("FROM sources WHERE NOT EXISTS "
                  "(SELECT 1 FROM kernels WHERE kernels.source = sources.digest)")


def verify(user_dir: Path, arch: str | None = None, fix=None) -> dict[str, Any]:
    """Check every tier's files: integrity, schema revision, and every entry.

    An entry is sound when its blob decodes to bytes whose sha256 is its checksum, its
    attributes are JSON, its key is the sha256 of those attributes, and its arch is the
    file's. A file's running totals in ``meta`` must equal its entries. Nothing is changed
    here; ``fix(path, result)`` (:func:`kdb.admin.maintenance.repair`, for ``kdb verify
    --repair``) is called for each user file that is not sound and returns what it did.

    Returns ``{"ok": bool, "files": [...], "entries": n, "bad_entries": n}``; each file has
    ``problems`` (what is wrong), ``bad_entries`` (key, name, problem), ``notes`` and, after
    a repair, ``repaired`` (what was done).
    """
    if arch is not None:
        config.check_arch(arch)
    files: list[dict[str, Any]] = []
    for src in discovery.all_sources():
        if arch is not None and src.arch != arch:
            continue
        if src.problem:
            files.append(file_result(src.path, "system", src.arch, [src.problem]))
            files[-1]["unsafe"] = src.problem.startswith(discovery.REFUSED)
        else:
            result = verify_file(Path(src.path), "system", src.arch)
            _check_installed(result, Path(src.path), src.origin)
            files.append(result)
    for path, kind in odd_user_files(user_dir, arch):
        files.append(file_result(path, "user", path.name[: -len(".kdb")],
                                  [f"{kind}, not a kdb file: kdb skips it and stores nothing "
                                   "for this arch; remove it"]))
    for path in user_files(user_dir, arch):
        a = path.name[: -len(".kdb")]
        result = verify_file(path, "user", a)
        if fix is not None and (not result["ok"] or result.get("reclaimable")):
            done = fix(path, result)
            if done:
                result = verify_file(path, "user", a) if path.exists() else file_result(
                    path, "user", a, [])
                result["repaired"] = done
        files.append(result)
    return {"ok": all(f["ok"] for f in files), "files": files,
            "entries": sum(f["entries"] for f in files),
            "bad_entries": sum(len(f["bad_entries"]) for f in files)}


def _check_installed(result: dict[str, Any], path: Path, origin: str) -> None:
    """An installed system package's file against the sha256 its wheel recorded (RECORD):
    a packed file is reproducible, so a mismatch means it changed after installation."""
    from ..pack.wheel import installed_match

    prov = provider(origin)
    if prov["package"] is None or prov["version"] is None:
        return
    same, what = installed_match(path, prov["package"], prov["version"])
    result["matches_wheel"] = same
    if same:
        result["notes"].append(f"matches its wheel: {what}")
    elif same is None:
        result["notes"].append(f"not compared with its wheel: {what}")
    else:
        result["problems"].append(
            f"differs from the sha256 its wheel recorded ({what}): the file changed after it "
            f"was installed; reinstall it (pip install --force-reinstall "
            f"{prov['package']}=={prov['version']})")
        result["ok"] = False


def file_result(path: Path, tier: str, arch: str, problems: list[str]) -> dict[str, Any]:
    return {"path": str(path), "tier": tier, "arch": arch, "revision": None, "entries": 0,
            "problems": problems, "bad_entries": [], "notes": [], "repaired": [],
            "ok": not problems, "fatal": bool(problems), "unsafe": False}


def verify_file(path: Path, tier: str, arch: str) -> dict[str, Any]:
    from ..file import fs

    out = file_result(path, tier, arch, [])
    problems: list[str] = out["problems"]
    if tier == "user":
        bad = fs.unsafe_chain([path, path.parent])
        if bad:
            where = "" if bad[0] == str(path) else f"{bad[0]}: "
            problems.append(f"refused at run time: {where}{bad[1]} (chmod 600 the file, 700 "
                            "its directory, go-w the directories above it)")
            out["unsafe"] = True
    else:
        problems += _wal_problem(path)
    if file_size(path) == 0:
        out["notes"].append("empty (created, not yet written)")
        out["ok"] = not problems
        return out
    try:
        with reading(path, tier) as conn:
            # One read transaction: every check below sees one snapshot (WAL), not the
            # entries of one moment and the totals of the next while others store.
            conn.execute("BEGIN")
            check = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
            if check != ["ok"]:
                problems.append("integrity check failed: " + "; ".join(check[:3]))
                out["fatal"] = out["integrity"] = True
            rev = revision_of(conn)
            out["revision"] = rev
            status = status_of(rev, tier == "user" and rev is None and has_no_tables(conn))
            if status.kind == "empty":
                out["notes"].append("created, its tables not yet (a first write is under way, "
                                    "or was killed: the next write creates them)")
            elif status.kind == "foreign":
                problems.append(status.what)
                out["fatal"] = True
            elif status.kind == "newer":
                held = _count_newer(conn)
                problems.append(f"{status.what}: written by a newer kdb"
                                + (f", holding {held} entries this kdb cannot check"
                                   if held is not None else "")
                                + f"; {status.remedy} (pip install -U kdb) to check it")
                out["entries"] = held or 0
                out["future"] = True
            else:
                if status.kind != "current":
                    out["notes"].append(f"at revision {rev} (head {HEAD})")
                _verify_entries(conn, arch, out)
                if tier == "user":
                    _free_pages(conn, out)
    except sqlite3.OperationalError as err:  # I/O, locked, cannot open: not damage
        compact.reraise_interrupt(err)  # Ctrl-C, not the file
        problems.append(f"cannot be read now: {err}")
    except DAMAGE as err:
        problems.append(f"unreadable: {err}")
        out["fatal"] = True
    out["ok"] = not problems and not out["bad_entries"]
    return out


#: Free pages worth giving back: more than this share of the file, and this many bytes.
RECLAIM_SHARE, RECLAIM_BYTES = 0.25, 1 << 20


def _free_pages(conn: sqlite3.Connection, out: dict[str, Any]) -> None:
    """Note a user file whose free pages are a large part of it (an upgrade's VACUUM killed
    halfway left one at twice its size, for good), for ``--repair`` to give back."""
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    total = conn.execute("PRAGMA page_count").fetchone()[0]
    size = conn.execute("PRAGMA page_size").fetchone()[0]
    if free * size >= RECLAIM_BYTES and free > total * RECLAIM_SHARE:
        out["reclaimable"] = free * size
        out["notes"].append(f"{free * size / 2**20:.1f} MiB in free pages ({free} of {total}): "
                            "`kdb verify --repair` gives them back (VACUUM)")


def _count_newer(conn: sqlite3.Connection) -> int | None:
    """How many entries a file of a newer revision holds, where its ``kernels`` table still
    answers a count; None where it does not."""
    try:
        return int(conn.execute("SELECT count(*) FROM kernels").fetchone()[0])
    except (sqlite3.Error, TypeError, ValueError):
        return None


def _wal_problem(path: Path) -> list[str]:
    if journal_of(path) != "wal":
        return []
    return ["system file in WAL mode (kdb reads it immutable, ignoring any -wal); rebuild it "
            "with `kdb pack`, which writes journal_mode=DELETE"]


def _verify_entries(conn: sqlite3.Connection, arch: str, out: dict[str, Any]) -> None:
    """Decode every entry and compare the running totals with what the file holds."""
    missing = missing_tables(conn, out["revision"])
    if missing:
        out["problems"].append("missing table(s): " + ", ".join(missing))
        out["fatal"] = True
        return
    from ..signing import policy as signing

    policy = signing.current()
    if policy is None or not policy.covers(out["tier"]):
        policy = None
    signed_cols = ("signer, signature" if at_least(out["revision"], SIGNED_FROM)
                   else "NULL, NULL")
    packed = at_least(out["revision"], COMPACT_FROM)
    attributes, join = compact.columns(packed)
    compact.register(conn)
    signers: dict[str, int] = {}
    count = raw_total = stored_total = 0
    for row in conn.execute(_VERIFY_SQL.format(
            signed=signed_cols, attributes=attributes, join=join,
            digest="kernels.attributes_sha256" if packed else "NULL")):
        key, name, _, _, _, raw_size, stored_size, _, _, signer, signature, _ = row
        count += 1
        raw_total += raw_size if isinstance(raw_size, int) else 0
        stored_total += stored_size if isinstance(stored_size, int) else 0
        why = _entry_problem(row, arch, packed, policy)
        if isinstance(signer, str) and signature:
            signers[signer] = signers.get(signer, 0) + 1
        if why:
            out["bad_entries"].append({"key": key, "name": name, "problem": why})
    out["entries"] = count
    out["signers"] = signers
    if count:
        unsigned = count - sum(signers.values())
        out["notes"].append(
            "signatures: " + (", ".join(f"{n} by key {k}" for k, n in sorted(signers.items()))
                              or "none") + (f"; {unsigned} unsigned" if unsigned and signers else "")
            + ("; checked against " + signing.ENV_TRUSTED_KEYS if policy is not None else
               "; not checked (no trust policy covers this tier)"))
    if at_least(out["revision"], TOTALS_FROM):
        meta = {k: v for k, v in read_rows(conn, "SELECT name, value FROM meta WHERE name IN "
                                             "('entries', 'raw_bytes', 'stored_bytes')")}
        want = {"entries": count, "raw_bytes": raw_total, "stored_bytes": stored_total}
        wrong = [f"{k} {meta.get(k)} (holds {v})" for k, v in want.items()
                 if str(meta.get(k)) != str(v)]
        if wrong:
            out["problems"].append("running totals in meta are wrong: " + ", ".join(wrong))
    if packed:
        unused = int(conn.execute("SELECT count(*) " + UNUSED_SOURCES).fetchone()[0])
        if unused:
            out["problems"].append(f"{unused} source{'s' * (unused != 1)} no entry uses")


def _entry_problem(row: tuple, arch: str, packed: bool, policy) -> str:
    """What is wrong with one entry (its blob, attributes, key, arch, signature under
    ``policy`` where one covers the tier), or ``""``."""
    import hashlib

    from ..file.codec import decode

    key, name, row_arch, kind, blob, raw_size, stored_size, digest, attributes, signer, \
        signature, attributes_sha256 = row
    if attributes is None and packed:
        return "attributes do not decode (damaged, or their source is missing)"
    if not all(isinstance(v, t) for v, t in ((key, str), (name, str), (row_arch, str),
                                              (attributes, str), (stored_size, int))):
        return "damaged row (a column holds a value of the wrong type)"
    if (raw := decode(kind, blob, raw_size, digest, thorough=True)) is None:
        return "checksum mismatch (the blob does not decode to its checksum)"
    if not _is_json(attributes):
        return "attributes are not JSON"
    if hashlib.sha256(attributes.encode("utf-8", "surrogateescape")).hexdigest() != key:
        return "key is not the sha256 of the stored attributes"
    if packed and attributes_sha256 != key:
        return "attributes_sha256 is not the sha256 of the stored attributes"
    if row_arch != arch:
        return f"built for arch {row_arch!r}, found in the file of {arch!r}"
    if stored_size != len(blob):
        return f"stored_size {stored_size} but the blob has {len(blob)} bytes"
    if policy is not None and (cause := policy.check(
            key, attributes, raw, digest, signer if isinstance(signer, str) else None,
            signature if isinstance(signature, bytes) else None)) is not None:
        return (f"not served under the trust policy: {cause}"
                + (f" (signer {signer})" if signer else ""))
    return ""


def _is_json(text: Any) -> bool:
    try:
        json.loads(text)
    except (TypeError, ValueError):
        return False
    return True

"""What the ``kdb`` command line reports: files, entries, counters, the compile log, explain.

Each function reads the tier files with plain :mod:`sqlite3` and returns plain data (lists and
dicts of JSON-ready values); :mod:`kdb.cli` only formats and prints them. User files are
opened ``mode=ro`` (a WAL file's recent commits are visible; nothing is migrated or
written), system files ``mode=ro&immutable=1`` as on the hot path. Only :func:`migrate_files`
and :func:`clear` change anything, and never a system file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from . import auto, config, discovery, migrate
from .errors import InvalidArgumentError
from .keys import differences
from .store import sqlite_uri

log = logging.getLogger("kdb")

#: Counters kept in each user file's ``counters`` table (written by :mod:`kdb.db`).
COUNTERS = ("hits.system", "hits.user", "hits.shared", "misses", "compiles", "compile_seconds",
            "saved_seconds", "evicted")
_HEX_RE = re.compile(r"[0-9a-f]{4,64}\Z")
_SIDE_FILES = ("-wal", "-shm", ".lock")
#: What reading a damaged file raises (a damaged schema's error message is not UTF-8).
_DAMAGED = (sqlite3.DatabaseError, UnicodeDecodeError)


@dataclass(frozen=True)
class FileReport:
    """One tier file as ``kdb info`` shows it."""

    arch: str
    path: str
    tier: str  # "user" or "system"
    origin: str  # "user dir", "KDB_SYSTEM_DB_PATH" or "package <dist> <version>"
    size: int  # bytes on disk, the WAL included
    entries: int
    revision: str | None
    problem: str = ""


# -- opening files --------------------------------------------------------------------------

@contextlib.contextmanager
def _reading(path: Path, tier: str) -> Iterator[sqlite3.Connection]:
    """A read-only connection; system files are immutable, user files may be in use.

    A user file in WAL mode that cannot be opened ``mode=ro`` (a read-only cache directory
    or mount, a full disk: SQLite cannot create its ``-shm``) is read immutable, as the run
    time reads a read-only cache, when its ``-wal`` holds nothing (the main file is whole)
    or nobody can write there.
    """
    mode = "ro&immutable=1" if tier == "system" else "ro"
    conn = sqlite3.connect(sqlite_uri(path, "mode=" + mode), uri=True,
                           timeout=config.BUSY_TIMEOUT_S)
    if tier != "system":
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
        except sqlite3.OperationalError as err:
            conn.close()
            if _can_write_beside(path) and _wal_size(path):
                raise  # commits in the -wal: reading around them could mislead
            conn = sqlite3.connect(sqlite_uri(path, "mode=ro&immutable=1"), uri=True)
        except BaseException:
            conn.close()
            raise
    # A damaged row's text may not be UTF-8: read it as it is, so that the row (not the file)
    # is reported, and a repair drops it.
    conn.text_factory = _lenient_text
    try:
        yield conn
    finally:
        conn.close()


def _lenient_text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _wal_size(path: Path) -> int:
    try:
        return os.stat(str(path) + "-wal").st_size
    except OSError:
        return 0


def _can_write_beside(path: Path) -> bool:
    """Whether this process may write ``path`` and create files beside it (``-wal``,
    ``-shm``, ``.corrupt-*``): false in a read-only directory or on a read-only mount."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK)


def _scalar(conn: sqlite3.Connection, sql: str, default: Any = 0) -> Any:
    """The first column of the first row, or ``default`` (a table not created yet)."""
    rows = _rows(conn, sql)
    return rows[0][0] if rows and rows[0][0] is not None else default


def _number(value: Any, kind: type) -> Any:
    """A counter or total as ``kind``; 0 for a damaged value (a report never fails on one)."""
    try:
        return kind(value) if value is not None else kind(0)
    except (TypeError, ValueError, OverflowError):
        return kind(0)


def _no_tables_yet(conn: sqlite3.Connection) -> bool:
    """A file created by a first write that has not created its tables yet (its writer
    holds the upgrade lock): run time treats it as not migrated, never as damaged."""
    return conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0


def _rows(conn: sqlite3.Connection, sql: str, params: tuple = ()) -> list[tuple]:
    """Rows of a read-only query; a table an older revision lacks yields none."""
    try:
        return conn.execute(sql, params).fetchall()
    except sqlite3.OperationalError as err:
        if "no such table" in str(err) or "no such column" in str(err):
            return []
        raise


def _has_column(conn: sqlite3.Connection, table: str, column: str) -> bool:
    return any(r[1] == column for r in conn.execute(f"PRAGMA table_info({table})"))


def _size(path: Path) -> int:
    total = 0
    for suffix in ("", "-wal"):
        try:
            total += os.stat(str(path) + suffix).st_size
        except OSError:
            pass
    return total


def user_files(user_dir: Path, arch: str | None = None) -> list[Path]:
    """The user tier's ``<arch>.kdb`` files, sorted (only ``arch``'s when given)."""
    if arch is not None:
        config.check_arch(arch)
        path = user_dir / f"{arch}.kdb"
        return [path] if path.is_file() else []
    try:
        names = sorted(os.listdir(user_dir))
    except OSError:
        return []
    out = []
    for n in names:
        if n.endswith(".kdb") and (user_dir / n).is_file():
            try:
                config.check_arch(n[: -len(".kdb")])
            except InvalidArgumentError:
                continue
            out.append(user_dir / n)
    return out


def odd_user_files(user_dir: Path, arch: str | None = None) -> list[tuple[Path, str]]:
    """``<arch>.kdb`` names in the user tier that are not regular files (a directory, a
    FIFO: opening one would block), with what each is; :func:`user_files` leaves them out."""
    import stat

    out = []
    try:
        names = sorted(os.listdir(user_dir))
    except OSError:
        return []
    for n in names:
        if not n.endswith(".kdb") or (arch is not None and n != f"{arch}.kdb"):
            continue
        try:
            config.check_arch(n[: -len(".kdb")])
            mode = os.stat(user_dir / n).st_mode
        except (InvalidArgumentError, OSError):
            continue
        if not stat.S_ISREG(mode):
            out.append((user_dir / n, "a directory" if stat.S_ISDIR(mode) else
                        "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"))
    return out


def _tier_files(user_dir: Path, arch: str | None,
                tier: str | None) -> list[tuple[str, Path, str]]:
    """(tier, path, arch) of every usable file: system files first, as a lookup reads them."""
    if arch is not None:
        config.check_arch(arch)
    out: list[tuple[str, Path, str]] = []
    if tier in (None, "system"):
        for src in discovery.all_sources():
            if not src.problem and (arch is None or src.arch == arch):
                out.append(("system", src.path, src.arch))
    if tier in (None, "user"):
        out += [("user", p, p.name[: -len(".kdb")]) for p in user_files(user_dir, arch)]
    return out


def describe_file(path: Path, tier: str, arch: str, origin: str) -> FileReport:
    """Size, entry count and revision of one file; ``problem`` says why it is unusable."""
    size = _size(path)
    try:
        with _reading(path, tier) as conn:
            rev = migrate.revision_of(conn)
            entries = _rows(conn, "SELECT count(*) FROM kernels")
            fresh = rev is None and _no_tables_yet(conn)
    except _DAMAGED as err:
        return FileReport(arch, str(path), tier, origin, size, 0, None, f"unreadable: {err}")
    count = entries[0][0] if entries else 0
    problem = ""
    if rev is None:
        problem = "empty (created, not yet written)" if fresh \
            else "not a kdb database (no schema revision)"
    elif rev not in migrate.REVISIONS:
        problem = f"schema revision {rev} is newer than this kdb ({migrate.HEAD}); upgrade kdb"
    elif rev != migrate.HEAD and tier == "user":
        problem = f"at revision {rev}; upgraded on next write or by `kdb migrate`"
    return FileReport(arch, str(path), tier, origin, size, count, rev, problem)


# -- info -----------------------------------------------------------------------------------

def opencl_devices(memo_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """OpenCL devices with their arch ids and compiler identity, and a note if there are none.

    pyopencl is optional: without it (or without a platform) the list is empty and the note
    says why.
    """
    try:
        import pyopencl as cl

        from .backends.opencl import arch_of, compiler_identity
    except ImportError as err:
        return [], f"pyopencl is not installed ({err}); pip install 'pyopencl[pocl]'"
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:
        return [], f"no OpenCL platform found ({err})"
    out: list[dict[str, Any]] = []
    for plat in platforms:
        try:
            devices = plat.get_devices()
        except cl.Error as err:
            out.append({"platform": plat.name, "device": "", "arch": None, "compiler": "",
                        "identity": {}, "problem": f"cannot list devices: {err}"})
            continue
        for dev in devices:
            rec: dict[str, Any] = {"platform": plat.name, "device": dev.name, "arch": None,
                                   "compiler": "", "identity": {}, "problem": ""}
            try:
                rec["arch"] = arch_of(dev)
                ident = dict(compiler_identity(dev, str(memo_dir)))
                rec["identity"] = ident
                rec["compiler"] = compiler_short(ident)
            except Exception as err:  # noqa: BLE001 - one odd device must not hide the rest
                rec["problem"] = f"{type(err).__name__}: {err}"
            out.append(rec)
    return out, "" if out else "no OpenCL devices found"


def compiler_short(identity: dict[str, str]) -> str:
    """One line naming a compiler: platform, driver version, library digest prefix.

    >>> compiler_short({"platform": "PoCL", "driver_version": "3.0", "library": "sha256:" + "ab" * 32})
    'PoCL 3.0, library sha256:abababababab'
    """
    text = " ".join(v for v in (identity.get("platform", ""),
                                identity.get("driver_version", "")) if v)
    lib = identity.get("library")
    if not lib:
        return text
    kind, _, digest = lib.partition(":")
    return f"{text}, library {kind}:{digest[:12]}"


def cuda_toolchain(memo_dir: Path) -> dict[str, Any]:
    """The nvcc and the NVRTC ``kdb.cuda`` would run, their releases, and the arches they
    build cubins for (``arches``: either's; ``default``: what ``compiler=None`` runs).

    ``problem`` says why there is none (how to point kdb at one). ``pycuda`` tells whether
    the loading half (``kdb.cuda.SourceModule``) can be imported at all.
    """
    import importlib.util

    from .backends import cuda, nvrtc
    from .errors import KdbError

    out: dict[str, Any] = {"nvcc": None, "found_by": None, "release": "", "toolkit": "",
                           "arches": [], "identity": {}, "problem": "",
                           "pycuda": importlib.util.find_spec("pycuda") is not None}
    try:
        tool = cuda.find_nvcc()
        out.update(nvcc=tool.path, found_by=tool.found_by)
        ident = cuda.identity(tool, memo_dir)
        out.update(release=ident.release, toolkit=ident.toolkit, identity=dict(ident.compiler),
                   arches=cuda.target_arches(tool))
    except KdbError as err:
        out["problem"] = str(err)
    nv: dict[str, Any] = {"path": None, "found_by": None, "version": "", "identity": {},
                          "arches": [], "problem": ""}
    try:
        lib = nvrtc.find_nvrtc()
        nv.update(path=lib.path, found_by=lib.found_by)
        ident = nvrtc.identity(lib, memo_dir)
        nv.update(version=ident.version, identity=dict(ident.compiler),
                  arches=nvrtc.supported_arches(lib.path))
    except KdbError as err:
        nv["problem"] = str(err)
    out["nvrtc"] = nv
    # What compile(..., compiler=None) runs: nvcc where found, else NVRTC, else stored builds.
    out["default"] = "nvcc" if out["nvcc"] and not out["problem"] else \
        "nvrtc" if nv["path"] and not nv["problem"] else None
    out["arches"] = sorted(set(out["arches"]) | set(nv["arches"]),
                           key=lambda a: int("".join(c for c in a if c.isdigit()) or 0))
    return out


def info(user_dir: Path, cache_root: Path) -> dict[str, Any]:
    """Everything ``kdb info`` shows: settings, user files, system databases, devices."""
    users = [describe_file(p, "user", p.name[: -len(".kdb")], "user dir")
             for p in user_files(user_dir)]
    users += [FileReport(p.name[: -len(".kdb")], str(p), "user", "user dir", 0, 0, None,
                         f"{kind}, not a kdb file: skipped; remove it")
              for p, kind in odd_user_files(user_dir)]
    systems = []
    for src in discovery.all_sources():
        if src.problem:
            systems.append(FileReport(src.arch, str(src.path), "system", src.origin, 0, 0,
                                      None, src.problem))
        else:
            systems.append(describe_file(src.path, "system", src.arch, src.origin))
    devices, note = opencl_devices(cache_root)
    usable = {s.arch for s in systems if not s.problem}
    for d in devices:
        d["system_db"] = None if d["arch"] is None else d["arch"] in usable
    missing = sorted({d["arch"] for d in devices if d["arch"] and d["arch"] not in usable})
    cuda = cuda_toolchain(cache_root)
    cuda["system_db"] = [a for a in cuda["arches"] if a in usable]
    return {
        "version": _version(),
        "cache_root": str(cache_root),
        "user_dir": str(user_dir),
        "disabled": config.flag(config.ENV_DISABLE_CACHE),
        "schema_head": migrate.HEAD,
        "user_files": [asdict(f) for f in users],
        "system_path": [str(d) for d in config.system_dirs()],
        "system_databases": [{**asdict(s), **_provider(s.origin)} for s in systems],
        "devices": devices,
        "devices_note": note,
        "missing_system": missing,
        "cuda": cuda,
        "shared": shared_summary(),
        "auto": auto.status(),
    }


def shared_summary() -> dict[str, Any] | None:
    """The shared tier (``KDB_SHARED_URL``) as ``kdb info`` and ``kdb stats`` show it: URL
    with its password masked, reachable, revision, entries, bytes, server-wide hits and
    compiles, entries per arch; ``None`` when no URL is set."""
    url = config.shared_url()
    if url is None:
        return None
    from . import shared

    return shared.tier(url).summary()


def _provider(origin: str) -> dict[str, str | None]:
    """The providing package and version of a system database, from its origin.

    >>> _provider("package kdb_system_sm_90 1.0.0")
    {'package': 'kdb_system_sm_90', 'version': '1.0.0'}
    >>> _provider("KDB_SYSTEM_DB_PATH")
    {'package': None, 'version': None}
    """
    kind, _, rest = origin.partition(" ")
    if kind != "package":
        return {"package": None, "version": None}
    name, _, version = rest.partition(" ")
    return {"package": name, "version": version or None}


def _version() -> str:
    from .version import __version__

    return __version__


# -- ls -------------------------------------------------------------------------------------

def entries(user_dir: Path, arch: str | None = None, tier: str | None = None) -> list[dict]:
    """Every stored entry (system files first), most recently used first within a file."""
    out = []
    for t, path, _ in _tier_files(user_dir, arch, tier):
        try:
            with _reading(path, t) as conn:
                rows = _rows(conn, "SELECT key, name, arch, backend, raw_size, stored_size, "
                             "hits, last_access, created, compile_seconds FROM kernels "
                             "ORDER BY last_access DESC")
        except _DAMAGED as err:
            log.warning("kdb: %s skipped: %s", path, err)
            continue
        for r in rows:
            out.append({"key": r[0], "name": r[1], "arch": r[2], "backend": r[3],
                        "raw_size": r[4], "stored_size": r[5], "hits": r[6],
                        "last_access": r[7], "created": r[8], "compile_seconds": r[9],
                        "tier": t, "path": str(path)})
    return out


# -- stats ----------------------------------------------------------------------------------

def _empty_stats() -> dict[str, Any]:
    return {"hits": {"system": 0, "user": 0}, "misses": 0, "compiles": 0,
            "compile_seconds": 0.0, "saved_seconds": 0.0, "entries": 0, "stored_bytes": 0,
            "raw_bytes": 0, "system_entries": 0, "evicted": 0}


def _add(total: dict[str, Any], part: dict[str, Any]) -> None:
    for k, v in part.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                total[k][kk] += vv
        else:
            total[k] += v


def stats(user_dir: Path, arch: str | None = None) -> dict[str, Any]:
    """Counters and sizes per arch and in total; the totals are at the top level.

    Hits of both tiers, misses and compiles are counted in the user file (system files are
    never written). Stored bytes come from the file's running total, not from a scan.
    ``cap`` is ``KDB_CACHE_MAX_SIZE`` in bytes (per user file, 0 = none); ``evicted`` counts
    the entries the cap (or ``kdb evict``) removed.
    """
    per: dict[str, dict[str, Any]] = {}
    shared_hits = 0  # hits this node's user files counted from the shared tier
    for t, path, a in _tier_files(user_dir, arch, None):
        try:
            with _reading(path, t) as conn:
                totals = {k: _number(v, int) for k, v in _rows(
                    conn, "SELECT name, value FROM meta WHERE name IN "
                          "('entries', 'raw_bytes', 'stored_bytes')")}
                if "entries" not in totals:  # a file older than revision 0003, or one
                    # whose tables do not exist yet: count once (no table, no rows)
                    totals["entries"] = _scalar(conn, "SELECT count(*) FROM kernels")
                    totals["raw_bytes"] = _scalar(
                        conn, "SELECT coalesce(sum(raw_size), 0) FROM kernels")
                counters = {}
                if t == "user":
                    counters = dict(_rows(conn, "SELECT name, value FROM counters"))
        except _DAMAGED as err:
            log.warning("kdb: %s skipped: %s", path, err)
            continue
        s = per.setdefault(a, _empty_stats())
        count = totals["entries"]
        if t == "system":
            s["system_entries"] += count
            continue
        s["entries"] += count
        s["hits"]["system"] += _number(counters.get("hits.system"), int)
        s["hits"]["user"] += _number(counters.get("hits.user"), int)
        shared_hits += _number(counters.get("hits.shared"), int)
        s["misses"] += _number(counters.get("misses"), int)
        s["compiles"] += _number(counters.get("compiles"), int)
        s["evicted"] += _number(counters.get("evicted"), int)
        s["compile_seconds"] += _number(counters.get("compile_seconds"), float)
        s["saved_seconds"] += _number(counters.get("saved_seconds"), float)
        s["stored_bytes"] += totals.get("stored_bytes", 0)
        s["raw_bytes"] += totals.get("raw_bytes", 0)
    total = _empty_stats()
    for s in per.values():
        _add(total, s)
    total["arches"] = dict(sorted(per.items()))
    total["cap"] = config.max_size()  # bytes per user file; 0 = no cap
    total["shared"] = shared_summary()  # None without KDB_SHARED_URL
    if total["shared"] is not None:
        total["shared"]["hits_here"] = shared_hits
    return total


# -- log ------------------------------------------------------------------------------------

def compile_log(user_dir: Path, limit: int | None = 50, arch: str | None = None) -> list[dict]:
    """The start-up latency log of every user file, newest first (``limit`` rows at most)."""
    if limit is not None and limit < 0:
        raise InvalidArgumentError(f"limit must be 0 or more, not {limit}")
    out = []
    for path in user_files(user_dir, arch):
        sql = ("SELECT at, key, name, arch, backend, seconds, missed, reason, pid "
               "FROM compile_log ORDER BY at DESC")
        params: tuple = ()
        if limit is not None:
            sql += " LIMIT ?"
            params = (limit,)
        try:
            with _reading(path, "user") as conn:
                rows = _rows(conn, sql, params)
        except _DAMAGED as err:
            log.warning("kdb: %s skipped: %s", path, err)
            continue
        out += [_log_record(r) for r in rows]
    out += _pending_log(user_dir, arch)
    out.sort(key=lambda r: r["at"], reverse=True)
    return out if limit is None else out[:limit]


def _pending_log(user_dir: Path, arch: str | None) -> list[dict]:
    """Compiles whose binaries the store worker has not stored yet (:mod:`kdb.spool`): shown
    at once, marked ``pending``."""
    from . import spool
    from .store import CompileRecord

    out = []
    for row in spool.pending_log_rows(user_dir):
        try:
            rec = CompileRecord(*row)
        except TypeError:
            continue
        if arch is None or rec.arch == arch:
            out.append({**_log_record((rec.at, rec.key, rec.name, rec.arch, rec.backend,
                                       rec.seconds, rec.missed, rec.reason, rec.pid)),
                        "pending": True})
    return out


def _log_record(r: tuple) -> dict[str, Any]:
    return {"at": r[0], "key": r[1], "name": r[2], "arch": r[3], "backend": r[4],
            "seconds": r[5], "missed": [m for m in r[6].split(",") if m], "reason": r[7],
            "pid": r[8], "pending": False}


# -- explain --------------------------------------------------------------------------------

_ENTRY_COLS = "key, name, arch, backend, attributes, {details}, created, last_access, hits"


def _match_sql(query: str) -> tuple[str, tuple]:
    """A WHERE clause matching a key prefix or a kernel name (one of a program's names)."""
    by_name = "(name = ? OR instr(',' || name || ',', ',' || ? || ',') > 0)"
    q = query.lower()
    if _HEX_RE.match(q):
        return f"((key >= ? AND key < ?) OR {by_name})", (q, q + "g", query, query)
    return by_name, (query, query)


def _entry_rows(conn: sqlite3.Connection, where: str, params: tuple, tier: str, path: Path,
                limit: int | None = None) -> list[dict]:
    details = "details" if _has_column(conn, "kernels", "details") else "'{}'"
    sql = f"SELECT {_ENTRY_COLS.format(details=details)} FROM kernels WHERE {where} " \
          "ORDER BY last_access DESC"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    out = []
    for r in _rows(conn, sql, params):
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
    files = _tier_files(user_dir, None, None)
    found: list[dict] = []
    logs: list[dict] = []
    for t, path, _ in files:
        try:
            with _reading(path, t) as conn:
                found += _entry_rows(conn, where, params, t, path)
                if t == "user":
                    logs += [_log_record(r) for r in _rows(
                        conn, "SELECT at, key, name, arch, backend, seconds, missed, reason, "
                        f"pid FROM compile_log WHERE {where} ORDER BY at DESC", params)]
        except _DAMAGED as err:
            log.warning("kdb: %s skipped: %s", path, err)
    keys = {e["key"] for e in found} | {r["key"] for r in logs}
    if not keys:
        raise InvalidArgumentError(
            f"no stored entry or compile record matches {query!r}; `kdb ls` lists the keys "
            "and names, `kdb log` the compiles")
    by_key = [k for k in keys if k.startswith(query.lower())]
    if by_key:
        if len(by_key) > 1:
            raise InvalidArgumentError(
                f"key prefix {query!r} is ambiguous ({len(by_key)} keys: "
                + ", ".join(sorted(k[:16] for k in by_key)[:5]) + "); give more digits")
        key = by_key[0]
    else:  # a name: the latest compile of it, else the latest stored entry
        logs.sort(key=lambda r: r["at"], reverse=True)
        key = logs[0]["key"] if logs else max(found, key=lambda e: e["created"])["key"]
    mine = [e for e in found if e["key"] == key]
    records = sorted((r for r in logs if r["key"] == key), key=lambda r: r["at"], reverse=True)
    entry = mine[0] if mine else None
    name = entry["name"] if entry else records[0]["name"]
    arch = entry["arch"] if entry else records[0]["arch"]
    backend = entry["backend"] if entry else records[0]["backend"]
    target = json.loads(entry["attributes"]) if entry else None

    candidates: dict[str, dict] = {}
    near_where = "key != ? AND (name = ? OR (backend = ? AND arch = ?))"
    for t, path, _ in files:
        try:
            with _reading(path, t) as conn:
                for e in _entry_rows(conn, near_where, (key, name, backend, arch), t, path,
                                     limit=1000):
                    candidates.setdefault(e["key"], e)
        except _DAMAGED:
            continue  # reported above
    ranked = []
    builds = [] if target is None else [(key, mine[0]["tier"], target.get("compiler") or [])]
    for e in candidates.values():
        attrs = _json_or_text(e.pop("attributes"))
        if target is not None and isinstance(attrs, dict):
            diff = differences(target, attrs)
            if diff == ["compiler"]:
                builds.append((e["key"], e["tier"], attrs.get("compiler") or []))
            e["differs"] = {k: describe_difference(k, target.get(k), attrs.get(k))
                            for k in diff}
        else:
            e["differs"] = None
        ranked.append(e)
    ranked.sort(key=lambda e: (len(e["differs"]) if e["differs"] is not None else 10**6,
                               e["name"] != name, -e["created"]))
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


def _without_compiler(backend: str, builds: list[tuple[str, str, list]]) -> dict | None:
    """Which of the builds that differ only in the compiler a process with no compiler
    installed is served (:mod:`kdb.fallback`): the newest compiler's, system tier first."""
    if backend != "cuda" or not builds:
        return None  # only CUDA's compiler can be absent where its binaries load
    from .backends.cuda import compiler_rank
    from .fallback import describe

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
    if not ranked:
        return (f"{reason}; no other entry is named {name!r} or built for {backend} on "
                f"{arch}: it had never been compiled before")
    best = ranked[0]
    if best["differs"] is None:
        return f"{reason}; its attributes were not stored, so no comparison is possible"
    return (f"{reason}; the nearest stored entry ({best['key'][:12]}) differs in "
            + ", ".join(best["differs"]))


def describe_difference(name: str, mine: Any, other: Any) -> str:
    """A short human account of how one canonical attribute differs.

    >>> describe_difference("build_options", ["-DN=64"], ["-DN=32"])
    'this: -DN=64; other: -DN=32'
    >>> describe_difference("arch", "sm_90", "sm_80")
    "this: 'sm_90'; other: 'sm_80'"
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
                return f"line {i + 1}: this {x.strip()[:50]!r}; other {y.strip()[:50]!r}"
        return f"this has {len(la)} lines, other {len(lb)}"
    return f"this: {_short(mine)!r}; other: {_short(other)!r}" if not isinstance(mine, list) \
        else f"this: {_short(mine)}; other: {_short(other)}"


def _short(value: Any, width: int = 60) -> str:
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        text = f"{value[0]}={value[1]}"  # a (name, value) pair
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


# -- clear ----------------------------------------------------------------------------------

def clearable(user_dir: Path, arch: str | None = None) -> list[Path]:
    """The user tier's files for ``arch`` (or all): the database, its WAL, lock and quarantined
    copies. A system file is never listed, even where a system directory is the user dir."""
    protected = {os.path.realpath(s.path) for s in discovery.all_sources() if not s.problem}
    out: list[Path] = []
    for db in user_files(user_dir, arch) or ([user_dir / f"{arch}.kdb"] if arch else []):
        names = [db] + [Path(str(db) + s) for s in _SIDE_FILES]
        names += sorted(user_dir.glob(db.name + ".corrupt-*"))
        for p in names:
            if (p.is_file() or p.is_symlink()) and os.path.realpath(p) not in protected:
                out.append(p)
    if arch is None:  # leftovers whose database is already gone
        # .handoff-*.json: left by kdb before its store worker; spool/: stores not done yet
        for pattern in ("*.kdb-wal", "*.kdb-shm", "*.kdb.lock", "*.kdb.corrupt-*",
                        ".handoff-*.json", "spool/*/*.job", "spool/*/*.slow"):
            for p in sorted(user_dir.glob(pattern)):
                if p not in out and os.path.realpath(p) not in protected:
                    out.append(p)
    return out


def clear(paths: list[Path]) -> tuple[list[str], list[tuple[str, str]]]:
    """Remove the files :func:`clearable` listed; returns the paths removed, and those that
    could not be (a read-only cache) with why."""
    removed, failed = [], []
    for p in paths:
        try:
            p.unlink()
            removed.append(str(p))
        except FileNotFoundError:
            pass
        except OSError as err:
            failed.append((str(p), err.strerror or str(err)))
    return removed, failed


# -- migrate --------------------------------------------------------------------------------

def migrate_files(user_dir: Path, check: bool = False) -> list[dict[str, Any]]:
    """Upgrade every user file to the head revision (``check``: only say which would be).

    Each result has ``path``, ``arch``, ``from``, ``to`` and ``action``: ``current``,
    ``upgraded``, ``needs upgrade``, ``empty``, or ``skipped`` with a ``problem``.
    """
    out = []
    for path in user_files(user_dir):
        rec: dict[str, Any] = {"path": str(path), "arch": path.name[: -len(".kdb")],
                               "from": None, "to": migrate.HEAD, "action": "", "problem": ""}
        try:
            with _reading(path, "user") as conn:
                rev = migrate.revision_of(conn)
                fresh = rev is None and _no_tables_yet(conn)
            if fresh:
                rec.update(action="empty", to=None)
            elif rev is None:
                rec.update(action="skipped", to=None,
                           problem="not a kdb database (no schema revision)")
            elif rev not in migrate.REVISIONS:
                rec.update(**{"from": rev, "to": rev, "action": "skipped",
                              "problem": f"revision {rev} is newer than this kdb "
                                         f"({migrate.HEAD}); upgrade kdb"})
            elif rev == migrate.HEAD:
                rec.update(**{"from": rev, "action": "current"})
            elif check:
                rec.update(**{"from": rev, "action": "needs upgrade"})
            else:
                rec["from"] = rev
                with migrate.file_lock(path):
                    if _revision(path) != migrate.HEAD:  # another process may have done it
                        migrate.upgrade_sqlite(path, create=False)
                rec["to"] = _revision(path)
                rec["action"] = "upgraded"
        except _DAMAGED as err:
            rec.update(action="skipped", to=None, problem=f"unreadable: {err}")
        except OSError as err:  # a stuck upgrader (TimeoutError), a read-only cache
            rec.update(action="skipped", problem=f"cannot upgrade it now: {err}")
        except Exception as err:  # noqa: BLE001 - alembic's and SQLAlchemy's errors
            rec.update(action="skipped", problem=f"upgrade failed: {type(err).__name__}: {err}")
        out.append(rec)
    return out


def _revision(path: Path) -> str | None:
    with _reading(path, "user") as conn:
        return migrate.revision_of(conn)


# -- verify ---------------------------------------------------------------------------------

_VERIFY_SQL = ("SELECT key, name, arch, codec, blob, raw_size, stored_size, checksum, attributes "
               "FROM kernels")


def verify(user_dir: Path, arch: str | None = None, repair: bool = False) -> dict[str, Any]:
    """Check every tier's files: integrity, schema revision, and every entry.

    An entry is sound when its blob decodes to bytes whose sha256 is its checksum, its
    attributes are JSON, its key is the sha256 of those attributes, and its arch is the
    file's. A file's running totals in ``meta`` must equal its entries. With ``repair``,
    user files (never system files) are fixed: bad entries are deleted and the totals
    recomputed; a file that fails SQLite's integrity check (after a ``REINDEX``), or is not
    a kdb database, is moved aside (``*.corrupt-<time>``; kdb creates a new one). A file
    from a newer kdb, or one another user could change, is left alone.

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
            files.append(_file_result(src.path, "system", src.arch, [src.problem]))
        else:
            result = _verify_file(Path(src.path), "system", src.arch)
            _check_installed(result, Path(src.path), src.origin)
            files.append(result)
    for path, kind in odd_user_files(user_dir, arch):
        files.append(_file_result(path, "user", path.name[: -len(".kdb")],
                                  [f"{kind}, not a kdb file: kdb skips it and stores nothing "
                                   "for this arch; remove it"]))
    for path in user_files(user_dir, arch):
        a = path.name[: -len(".kdb")]
        result = _verify_file(path, "user", a)
        if repair and not result["ok"]:
            done = _repair(path, result)
            if done:
                result = _verify_file(path, "user", a) if path.exists() else _file_result(
                    path, "user", a, [])
                result["repaired"] = done
        files.append(result)
    return {"ok": all(f["ok"] for f in files), "files": files,
            "entries": sum(f["entries"] for f in files),
            "bad_entries": sum(len(f["bad_entries"]) for f in files)}


def _check_installed(result: dict[str, Any], path: Path, origin: str) -> None:
    """An installed system package's file against the sha256 its wheel recorded (RECORD):
    a packed file is reproducible, so a mismatch means it changed after installation."""
    from .wheel import installed_match

    provider = _provider(origin)
    if provider["package"] is None or provider["version"] is None:
        return
    same, what = installed_match(path, provider["package"], provider["version"])
    result["matches_wheel"] = same
    if same:
        result["notes"].append(f"matches its wheel: {what}")
    elif same is None:
        result["notes"].append(f"not compared with its wheel: {what}")
    else:
        result["problems"].append(
            f"differs from the sha256 its wheel recorded ({what}): the file changed after it "
            f"was installed; reinstall it (pip install --force-reinstall "
            f"{provider['package']}=={provider['version']})")
        result["ok"] = False


def _file_result(path: Path, tier: str, arch: str, problems: list[str]) -> dict[str, Any]:
    return {"path": str(path), "tier": tier, "arch": arch, "revision": None, "entries": 0,
            "problems": problems, "bad_entries": [], "notes": [], "repaired": [],
            "ok": not problems, "fatal": bool(problems), "unsafe": False}


def _verify_file(path: Path, tier: str, arch: str) -> dict[str, Any]:
    from . import fs

    out = _file_result(path, tier, arch, [])
    problems: list[str] = out["problems"]
    if tier == "user":
        why = fs.unsafe_reason(path) or fs.unsafe_reason(path.parent)
        if why:
            problems.append(f"refused at run time: {why} (chmod 600 the file, 700 its directory)")
            out["unsafe"] = True
    else:
        problems += _wal_problem(path)
    if _size(path) == 0:
        out["notes"].append("empty (created, not yet written)")
        out["ok"] = not problems
        return out
    try:
        with _reading(path, tier) as conn:
            check = [r[0] for r in conn.execute("PRAGMA integrity_check").fetchall()]
            if check != ["ok"]:
                problems.append("integrity check failed: " + "; ".join(check[:3]))
                out["fatal"] = out["integrity"] = True
            rev = migrate.revision_of(conn)
            out["revision"] = rev
            if rev is None and tier == "user" and _no_tables_yet(conn):
                out["notes"].append("created, its tables not yet (a first write is under way, "
                                    "or was killed: the next write creates them)")
            elif rev is None:
                problems.append("not a kdb database (no schema revision)")
                out["fatal"] = True
            elif rev not in migrate.REVISIONS:
                problems.append(f"schema revision {rev} is newer than this kdb "
                                f"({migrate.HEAD}); upgrade kdb to check it")
                out["future"] = True
            else:
                if rev != migrate.HEAD:
                    out["notes"].append(f"at revision {rev} (head {migrate.HEAD})")
                _verify_entries(conn, arch, out)
    except sqlite3.OperationalError as err:  # I/O, locked, cannot open: not damage
        problems.append(f"cannot be read now: {err}")
    except _DAMAGED as err:
        problems.append(f"unreadable: {err}")
        out["fatal"] = True
    out["ok"] = not problems and not out["bad_entries"]
    return out


def _wal_problem(path: Path) -> list[str]:
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return []
    if header[18:20] != b"\x02\x02":
        return []
    return ["system file in WAL mode (kdb reads it immutable, ignoring any -wal); rebuild it "
            "with `kdb pack`, which writes journal_mode=DELETE"]


def _verify_entries(conn: sqlite3.Connection, arch: str, out: dict[str, Any]) -> None:
    """Decode every entry and compare the running totals with what the file holds."""
    import hashlib

    from .codec import decode
    from .store import _missing_tables

    missing = _missing_tables(conn, out["revision"])
    if missing:
        out["problems"].append("missing table(s): " + ", ".join(missing))
        out["fatal"] = True
        return
    count = raw_total = stored_total = 0
    for key, name, row_arch, kind, blob, raw_size, stored_size, digest, attributes in \
            conn.execute(_VERIFY_SQL):
        count += 1
        raw_total += raw_size if isinstance(raw_size, int) else 0
        stored_total += stored_size if isinstance(stored_size, int) else 0
        why = ""
        if not all(isinstance(v, t) for v, t in ((key, str), (name, str), (row_arch, str),
                                                  (attributes, str), (stored_size, int))):
            why = "damaged row (a column holds a value of the wrong type)"
        elif decode(kind, blob, raw_size, digest, thorough=True) is None:
            why = "checksum mismatch (the blob does not decode to its checksum)"
        elif not _is_json(attributes):
            why = "attributes are not JSON"
        elif hashlib.sha256(attributes.encode("utf-8", "surrogateescape")).hexdigest() != key:
            why = "key is not the sha256 of the stored attributes"
        elif row_arch != arch:
            why = f"built for arch {row_arch!r}, found in the file of {arch!r}"
        elif stored_size != len(blob):
            why = f"stored_size {stored_size} but the blob has {len(blob)} bytes"
        if why:
            out["bad_entries"].append({"key": key, "name": name, "problem": why})
    out["entries"] = count
    if out["revision"] in migrate.REVISIONS[2:]:  # running totals since revision 0003
        meta = {k: v for k, v in _rows(conn, "SELECT name, value FROM meta WHERE name IN "
                                             "('entries', 'raw_bytes', 'stored_bytes')")}
        want = {"entries": count, "raw_bytes": raw_total, "stored_bytes": stored_total}
        wrong = [f"{k} {meta.get(k)} (holds {v})" for k, v in want.items()
                 if str(meta.get(k)) != str(v)]
        if wrong:
            out["problems"].append("running totals in meta are wrong: " + ", ".join(wrong))


def _is_json(text: Any) -> bool:
    try:
        json.loads(text)
    except (TypeError, ValueError):
        return False
    return True


def _repair(path: Path, result: dict[str, Any]) -> list[str]:
    """Fix one user file as :func:`verify` describes; returns what was done."""
    from .store import KernelFile, _bump_meta

    if result.get("unsafe") or result.get("future"):
        return []
    if not _can_write_beside(path):
        result["problems"].append("cannot repair: the file or its directory is read-only")
        return []
    if result.get("integrity") and _reindexed(path):
        result = _verify_file(path, "user", result["arch"])
        if result["ok"]:
            return ["indexes rebuilt (REINDEX)"]
    if result["fatal"]:
        # Under the upgrade lock: a first write that holds it is creating this file's tables.
        try:
            with migrate.file_lock(path):
                again = _verify_file(path, "user", result["arch"])
                if again["ok"] or not again["fatal"]:
                    return []  # its writer finished meanwhile: nothing to move
                moved = KernelFile(path, tier="user", readonly=False)._quarantine()
        except OSError as err:
            result["problems"].append(f"cannot repair it now: {err}")
            return []
        if not moved:
            result["problems"].append("cannot repair: it could not be moved aside")
            return []
        return ["moved aside as *.corrupt-<time>; kdb creates a new file on its next write"]
    done = []
    bad = [b["key"] for b in result["bad_entries"]]
    conn = sqlite3.connect(path, timeout=config.BUSY_TIMEOUT_S, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for key in bad:
            conn.execute("DELETE FROM kernels WHERE key = ?", (key,))
        if bad:
            done.append(f"dropped {len(bad)} bad entr{'y' if len(bad) == 1 else 'ies'}")
        if result["revision"] in migrate.REVISIONS[2:]:
            count, raw, stored = conn.execute(
                "SELECT count(*), coalesce(sum(raw_size), 0), coalesce(sum(stored_size), 0) "
                "FROM kernels").fetchone()
            conn.execute("DELETE FROM meta WHERE name IN ('entries', 'raw_bytes', "
                         "'stored_bytes')")
            for name, value in (("entries", count), ("raw_bytes", raw),
                                ("stored_bytes", stored)):
                _bump_meta(conn, name, value)
            done.append("running totals recomputed")
        conn.execute("COMMIT")
    finally:
        conn.close()
    return done


def _reindexed(path: Path) -> bool:
    """Try ``REINDEX`` on a file whose integrity check failed; True (and committed) if the
    file then passes, else rolled back: damaged indexes are rebuilt, damaged tables are not."""
    try:
        conn = sqlite3.connect(path, timeout=config.BUSY_TIMEOUT_S, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("REINDEX")
            ok = conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            conn.execute("COMMIT" if ok else "ROLLBACK")
            return ok
        finally:
            conn.close()
    except _DAMAGED:
        return False


# -- evict ----------------------------------------------------------------------------------

def evict(user_dir: Path, target: int, arch: str | None = None) -> list[dict[str, Any]]:
    """Remove least recently used entries until each user file stores at most ``target``
    bytes (the cap applies per file); returns, per file, what was removed and what is left.
    """
    from .store import KernelFile

    if isinstance(target, bool) or not isinstance(target, int) or target < 0:
        raise InvalidArgumentError(f"eviction target must be a size in bytes >= 0, not "
                                   f"{target!r}")
    out = []
    for path in user_files(user_dir, arch):
        f = KernelFile(path, tier="user", readonly=False)
        problem = ""
        try:
            done = f.evict_to(target)
            if done is None:
                problem = _unusable_why(path, f)
            removed, freed = done or (0, 0)
            try:
                left = dict(f.query("SELECT name, value FROM meta WHERE name IN "
                                    "('entries', 'stored_bytes')"))
            except _DAMAGED:
                left = {}
        finally:
            f.close()
        out.append({"path": str(path), "arch": path.name[: -len(".kdb")], "removed": removed,
                    "freed": freed, "entries": _number(left.get("entries"), int),
                    "stored_bytes": _number(left.get("stored_bytes"), int),
                    "problem": problem})
    return out


def _unusable_why(path: Path, f: Any) -> str:
    """Why a user file could not be changed (for ``kdb evict``): the best guess from it."""
    from . import fs

    why = fs.unsafe_reason(path) or fs.unsafe_reason(path.parent)
    if why:
        return f"refused: {why}"
    if not _can_write_beside(path):
        return "read-only: nothing evicted"
    if f.readonly or not f.usable:
        return "unusable (see the warning above): nothing evicted"
    return "could not be changed (see the warning above)"

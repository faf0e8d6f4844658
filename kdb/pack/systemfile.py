"""Writing a system file: a read-only ``<arch>.kdb`` that is the same bytes for the same entries.

The file is written at the head schema revision with ``journal_mode=DELETE`` (a WAL file
cannot be opened read-only), vacuumed, renamed into place, and then opened read-only, as kdb
will at run time, to prove every entry decodes.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..file import codec, compact, fileformat, migrate
from .. import config
from ..errors import PackError
from ..file.fileformat import sqlite_uri
from ..file.kernelfile import KernelFile
from ..file.rows import PROVISIONAL


#: Columns copied from a user file into a system file (every column of ``kernels``; a source
#: from before revision 0005 gives NULL for the signature's two).
_COLUMNS = ("key, arch, backend, name, attributes, details, codec, dict_id, blob, raw_size, "
            "stored_size, checksum, compile_seconds, created, last_access, hits, signer, "
            "signature")
#: The entries read from the sources, each with its whole attributes text (a file at
#: revision 0006 or later stores them compressed: kdb.file.compact).
_INCOMING = ("CREATE TEMP TABLE incoming (key TEXT, arch TEXT, backend TEXT, name TEXT, "
             "attributes TEXT, details TEXT, codec TEXT, dict_id INTEGER, blob BLOB, "
             "raw_size INTEGER, stored_size INTEGER, checksum TEXT, compile_seconds REAL, "
             "created REAL, last_access REAL, hits INTEGER, signer TEXT, signature BLOB)")


def _source_columns(conn: sqlite3.Connection, schema: str) -> tuple[str, str]:
    """``(columns, join)`` that read :data:`_COLUMNS` from the attached ``schema``'s kernels
    (aliased ``s``) at whatever revision it is: NULL for a signature before 0005, the whole
    attributes text from 0006's compressed columns."""
    have = {r[1] for r in conn.execute(f"PRAGMA {schema}.table_info(kernels)")}
    cols = _COLUMNS if "signature" in have else _COLUMNS.replace("signer, signature",
                                                                 "NULL, NULL")
    attributes, join = compact.columns("attrs" in have, "s", schema)
    return cols.replace("attributes", attributes), join


@dataclass
class PackResult:
    """What one arch's pack produced."""

    arch: str
    path: Path
    entries: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)  # (kernel, why + build log)
    missing: list[str] = field(default_factory=list)  # keys asked for but not in the input
    signed_by: str | None = None  # the key id that signed every entry (``kdb pack --sign``)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (kernel, why) not vouched for
    wheel: Path | None = None

    @property
    def file_size(self) -> int:
        """Bytes of the ``.kdb`` file on disk."""
        return self.path.stat().st_size


def write_system_db(dest: Path, arch: str, sources: Iterable[Path],
                    keys: set[str] | None = None, *,
                    keep_compile_seconds: bool = True, sign=None,
                    vouch=None) -> PackResult:
    """Copy the ``arch`` entries of ``sources`` (only ``keys`` if given) into ``dest``.

    Reproducible: the same entries give the same bytes. Rows go in sorted by key (the first
    source that holds a key gives it); times are ``SOURCE_DATE_EPOCH`` (0 when unset), hits
    0; the packing host's name and absolute paths are dropped from each entry's details; with
    ``keep_compile_seconds=False`` (entries compiled for this pack, whose timings vary
    from run to run) compile seconds are 0.

    ``sign``: a :class:`kdb.signing.policy.Policy` holding a signer; every entry is signed
    with it (Ed25519 signatures are deterministic: the file stays reproducible). ``vouch``:
    a policy entries copied from elsewhere must verify under first; one that does not is
    left out and listed in the result's ``refused``.
    """
    from .wheel import source_date_epoch

    config.check_arch(arch)
    stamp = float(source_date_epoch() or 0)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{arch}-", suffix=".kdb", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        migrate.upgrade_sqlite(tmp)
        # URIs on (not every SQLite build enables them by default), for ATTACH's mode=ro.
        conn = sqlite3.connect(sqlite_uri(tmp), uri=True, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=DELETE")
            compact.register(conn)
            conn.execute(_INCOMING)
            conn.execute("CREATE INDEX temp.ix_incoming_key ON incoming (key)")
            with fileformat.transaction(conn):
                _gather(conn, arch, sources, keys)
                refused = _copy_entries(conn, stamp, keep_compile_seconds, sign, vouch)
                missing, count, raw, stored = _totals(conn, arch, keys, stamp)
            conn.execute("DROP TABLE temp.incoming")
            for n, _ in enumerate(sources):
                conn.execute(f"DETACH DATABASE src{n}")
            conn.execute("VACUUM")
        finally:
            conn.close()
        if count == 0:
            if refused:
                raise PackError(f"no kernel for arch {arch!r} could be vouched for: "
                                f"{len(refused)} entries refused, the first "
                                f"({refused[0][0]}) because {refused[0][1]}")
            raise PackError(f"no kernels for arch {arch!r} in the given input; nothing to pack")
        tmp.chmod(0o644)  # mkstemp made it private; an installed system file is for everyone
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _verify(dest, count)
    return PackResult(arch, dest, entries=count, raw_bytes=raw, stored_bytes=stored,
                      missing=missing, refused=refused,
                      signed_by=sign.signer_id if sign is not None else None)


def _gather(conn: sqlite3.Connection, arch: str, sources: Iterable[Path],
            keys: set[str] | None) -> None:
    """Each source's ``arch`` entries (only ``keys`` if given) into the temporary
    ``incoming`` table; the first source that holds a key gives it."""
    for n, src in enumerate(sources):
        if not Path(src).is_file():
            raise PackError(f"source database {src} does not exist")
        conn.execute(f"ATTACH DATABASE ? AS src{n}", (sqlite_uri(src, "mode=ro"),))
        cols, join = _source_columns(conn, f"src{n}")
        # A provisional entry (PoCL's cache files, kdb.backends.opencl.early) stands in for
        # a binary on the machine that kept it; a pack ships binaries only.
        new = (f"INSERT INTO incoming SELECT {cols} FROM src{n}.kernels AS s{join} "
               "WHERE arch = ? AND NOT EXISTS (SELECT 1 FROM incoming i "
               "WHERE i.key = s.key) AND instr(coalesce(s.details, ''), ?) = 0")
        stand_in = f'"{PROVISIONAL}"'
        if keys is None:
            conn.execute(new, (arch, stand_in))
        else:
            for key in sorted(keys):
                conn.execute(new + " AND key = ?", (arch, stand_in, key))


def _copy_entries(conn: sqlite3.Connection, stamp: float, keep_compile_seconds: bool,
                  sign, vouch) -> list[tuple[str, str]]:
    """The incoming entries, sorted by key, made portable (times, hits, host) and signed,
    into the pack; returns the ones ``vouch`` refused, with why."""
    from ..keys import compiler_free_key

    rows = conn.execute(f"SELECT {_COLUMNS} FROM incoming ORDER BY key").fetchall()
    at = _COLUMNS.replace(" ", "").split(",")
    refused: list[tuple[str, str]] = []
    for row in rows:
        entry = dict(zip(at, row))
        entry.update(created=stamp, last_access=stamp, hits=0,
                     details=_portable_details(entry["details"]),
                     compiler_free_key=compiler_free_key(entry["attributes"]))
        if not keep_compile_seconds:
            entry["compile_seconds"] = 0.0
        if sign is not None or vouch is not None:
            why = _sign(entry, sign, vouch)
            if why is not None:
                refused.append((entry["name"] or entry["key"][:16], why))
                continue
        _insert(conn, entry)
    return refused


def _totals(conn: sqlite3.Connection, arch: str, keys: set[str] | None,
            stamp: float) -> tuple[list[str], int, int, int]:
    """The keys asked for and not found (a found one refused is named as such, not here),
    the entry count and byte totals, also written to the file's metadata (sorted: a
    reproducible pack depends on the rows' order)."""
    missing = [] if keys is None else sorted(
        set(keys) - {r[0] for r in conn.execute("SELECT key FROM temp.incoming")})
    count, raw, stored = conn.execute(
        "SELECT count(*), coalesce(sum(raw_size), 0), coalesce(sum(stored_size), 0) "
        "FROM kernels").fetchone()
    fileformat.set_meta(conn, sorted([
        ("arch", arch), ("stored_bytes", str(stored)), ("raw_bytes", str(raw)),
        ("entries", str(count)), *fileformat.file_facts(created=int(stamp))]))
    return missing, count, raw, stored


def _insert(conn: sqlite3.Connection, entry: dict) -> None:
    """Write one entry, its attributes stored as revision 0006 does, each source once."""
    packed = compact.pack(entry.pop("attributes"))
    if packed.source is not None:
        conn.execute("INSERT OR IGNORE INTO sources (digest, body, size) VALUES (?, ?, ?)",
                     (packed.source, packed.body, packed.size))
    entry.update(attrs=packed.attrs, source=packed.source, attributes_sha256=packed.sha256)
    conn.execute(f"INSERT INTO kernels ({', '.join(entry)}) VALUES "
                 f"({', '.join('?' * len(entry))})", tuple(entry.values()))


def _sign(entry: dict, sign, vouch) -> str | None:
    """Check a copied entry under ``vouch`` and sign it with ``sign`` (in place); the reason
    it cannot be packed, or None."""
    from ..signing import policy as signing

    raw = codec.decode(entry["codec"], entry["blob"], entry["raw_size"], entry["checksum"],
                       thorough=True)
    if raw is None:
        return "its binary does not match its checksum"
    if vouch is not None:
        cause = vouch.check(entry["key"], entry["attributes"], raw, entry["checksum"],
                            entry["signer"], entry["signature"])
        if cause is not None:
            return (f"{cause} (signer {entry['signer']})" if entry["signer"] else cause) + \
                f"; no key in {signing.ENV_TRUSTED_KEYS} vouches for it"
    if sign is not None:
        entry["signer"], entry["signature"] = sign.sign(entry["key"], entry["attributes"],
                                                        entry["checksum"])
    return None


def _portable_details(text: object) -> str:
    """An entry's details without what belongs to the packing machine: its host name and
    absolute paths (the compiler's, the toolkit's, the include directories', which a
    manifest names relative to itself): a pack must not depend on where it was built.

    >>> _portable_details('{"host": "build7", "nvcc": "/usr/bin/nvcc", "release": "13.0", '
    ...                   '"include_dirs": ["/tmp/b1/inc"], "defines": ["N=1"]}')
    '{"defines": ["N=1"], "release": "13.0"}'
    """
    import json

    try:
        details = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return "{}"
    if not isinstance(details, dict):
        return "{}"
    details.pop("host", None)
    return json.dumps({k: v for k, v in details.items() if not _local_path(v)}, sort_keys=True)


def _local_path(value: object) -> bool:
    """Whether ``value`` is an absolute path, or a non-empty list of them."""
    if isinstance(value, str):
        return os.path.isabs(value)
    return (isinstance(value, list) and bool(value)
            and all(isinstance(v, str) and os.path.isabs(v) for v in value))


def _verify(path: Path, expected: int) -> None:
    """Open the file read-only, as kdb will at run time, and decode every entry."""
    if fileformat.journal_of(path) != "rollback":
        raise PackError(f"{path} is not in rollback-journal mode; a system file must not be WAL")
    f = KernelFile(path, tier="system", readonly=True)
    try:
        rows = f.query("SELECT key, codec, blob, raw_size, checksum FROM kernels")
        if len(rows) != expected:
            raise PackError(f"{path}: wrote {expected} entries but read back {len(rows)}")
        for key, kind, blob, raw_size, digest in rows:
            if codec.decode(kind, blob, raw_size, digest, thorough=True) is None:
                raise PackError(f"{path}: entry {key[:16]} does not decode; the file is bad")
    finally:
        f.close()

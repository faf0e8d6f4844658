"""Where ``kdb pack`` copies from: a user database (a file, a cache directory, a URL, the
shared tier) and its start-up latency log.

A run may have compiled kernels whose binaries the store worker has not stored yet, so a
pack from a local user tier first stores them, at its own priority (:func:`wait_for_stores`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .. import config
from ..bookkeeping import UNCACHED
from ..errors import InvalidArgumentError, KdbError, PackError
from ..file.kernelfile import KernelFile

Step = Callable[[str, str], None]  # (arch, what is being done now)


def user_db_file(source: str | os.PathLike[str] | None, arch: str,
                 work_dir: Path | None = None, option: str = "--from-db") -> Path:
    """The user file of ``arch`` named by ``--from-db``: a file, a cache dir, or the default.

    ``source`` may also be a URL of a local SQLite file or directory: ``sqlite:///path`` (the
    SQLAlchemy spelling) or ``file:///path``; or the shared tier's URL
    (``postgresql+psycopg://...``), whose ``arch`` entries and compile log are exported into
    a SQLite file in ``work_dir`` first. ``option``: the one a missing file is reported
    under (``--from-log`` reads the same files).
    """
    if source is None:
        return config.user_dir() / f"{arch}.kdb"
    if _is_server_url(os.fspath(source)):  # the shared tier (kdb.shared.tier)
        return _export_shared(os.fspath(source), arch, work_dir)
    p = Path(_url_path(os.fspath(source))).expanduser()
    if p.is_file():
        return p
    for candidate in (p / f"v{config.FORMAT_MAJOR}" / f"{arch}.kdb", p / f"{arch}.kdb"):
        if candidate.is_file():
            return candidate
    raise PackError(f"{option} {source}: no database for arch {arch!r} there (looked for "
                    f"{p / f'v{config.FORMAT_MAJOR}' / f'{arch}.kdb'} and {p / f'{arch}.kdb'})")


def check_source(src: Path, shown: object) -> None:
    """Refuse a source database this kdb cannot read as it is: one from a newer kdb (packing
    it would rewrite its entries as an older revision, dropping what that one added), or
    not a kdb database. :class:`PackError` says what was found and what to do."""
    from ..file.fileformat import DAMAGE, classify
    from ..admin.tierfiles import reading

    try:
        with reading(src, "user") as conn:
            status = classify(conn)
    except DAMAGE as err:
        raise PackError(f"--from-db {shown}: cannot read it ({err}): it is damaged or not "
                        "a kdb database; give the user database a run wrote (a cache "
                        "directory, or its v1/<arch>.kdb), which `kdb --cache-dir DIR "
                        "verify` checks") from None
    if status.kind == "newer":
        raise PackError(f"{shown} was written by a newer kdb: {status.what}, and this kdb "
                        "cannot read it or rewrite it as an older revision. Upgrade kdb "
                        "(pip install -U kdb) and pack again.")
    if status.kind == "foreign":
        raise PackError(f"{shown} is {status.what}; give a kdb user database")
    if status.kind == "empty":  # was "OperationalError: no such table: src0.kernels"
        raise PackError(f"{shown} is empty: no kernel was ever stored in it; run the workload "
                        "first, or give the database it wrote")


def log_keys(user_file: Path, since: float | None = None) -> set[str]:
    """Keys of the start-up latency log of a user file (optionally since a time), less the
    builds kdb does not cache (they have no entry to pack)."""
    f = KernelFile(user_file, tier="user", readonly=False)  # immutable=1 would skip the WAL
    uncached = f"reason NOT LIKE '{UNCACHED}%'"
    try:
        if since is None:
            rows = f.query(f"SELECT DISTINCT key FROM compile_log WHERE {uncached}")
        else:
            rows = f.query(f"SELECT DISTINCT key FROM compile_log WHERE at >= ? AND {uncached}",
                           (since,))
    finally:
        f.close()
    return {r[0] for r in rows}


#: Seconds ``kdb pack`` waits for the store worker to store what a run compiled.
PENDING_WAIT_S = 900.0


def wait_for_stores(source: str | os.PathLike[str] | None, on_step: Step | None) -> None:
    """Before copying from a local user tier: store the entries a run just compiled whose
    binaries are not stored yet, saying so on the way. Not by waiting for the store worker:
    it runs at the lowest priority, and on a busy machine that took minutes."""
    from ..storing import spool

    if source is None:
        user_dir = config.user_dir()
    elif _is_server_url(os.fspath(source)):
        return
    else:
        p = Path(_url_path(os.fspath(source))).expanduser()
        p = p.parent if p.is_file() else p
        user_dir = p / f"v{config.FORMAT_MAJOR}" if (p / f"v{config.FORMAT_MAJOR}").is_dir() else p
    if not spool.jobs(user_dir):
        return

    def say(left: int) -> None:
        if on_step and left:
            on_step("*", f"storing {left} job(s) the store worker has not run yet (here, at "
                         "this command's priority, not the worker's idle one)")

    left = spool.wait(user_dir, PENDING_WAIT_S, say, hurry=True)
    if left and on_step:
        on_step("*", f"{left} program(s) still not stored after {PENDING_WAIT_S:.0f} s: packing "
                     "without them")


def shown_source(source: str | os.PathLike[str] | None) -> str | None:
    """A server URL as it may be shown (password masked); ``None`` for a local source."""
    if source is None or not _is_server_url(os.fspath(source)):
        return None
    from ..shared.tier import mask

    return mask(os.fspath(source))


def _is_server_url(source: str) -> bool:
    """Whether ``source`` is a database server's SQLAlchemy URL (not a local file).

    >>> _is_server_url("postgresql+psycopg://u@db/k"), _is_server_url("sqlite:///x.kdb")
    (True, False)
    """
    scheme, sep, _ = source.partition("://")
    return (bool(sep) and len(scheme) > 1 and scheme.split("+")[0] not in ("sqlite", "file")
            and scheme.replace("+", "").isalnum())


def _export_shared(url: str, arch: str, work_dir: Path | None) -> Path:
    """Export the shared tier's ``arch`` entries into ``<work_dir>/shared-<arch>.kdb``."""
    from ..shared.tier import SharedTier, mask

    if work_dir is None:
        raise InvalidArgumentError("exporting from a database server needs a work_dir")
    tier = SharedTier(url, config.shared_namespace())  # a tenant packs its own namespace
    dest = Path(work_dir) / f"shared-{arch}.kdb"
    try:
        count = tier.export(arch, dest)
    except KdbError as err:
        raise PackError(f"--from-db {mask(url)}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a server fault, reported without the URL's secrets
        raise PackError(f"--from-db {mask(url)}: could not read the shared tier "
                        f"({tier.reason(err)})") from None
    if count == 0:
        raise PackError(f"--from-db {tier.describe()}: the shared tier holds no kernels for "
                        f"arch {arch!r}")
    return dest


def _url_path(source: str) -> str:
    """The local path of ``sqlite:///p`` or ``file:///p``; a plain path is returned as is.

    >>> _url_path("sqlite:////tmp/c/v1/sm_90.kdb"), _url_path("file:///tmp/c"), _url_path("c")
    ('/tmp/c/v1/sm_90.kdb', '/tmp/c', 'c')
    """
    import urllib.parse

    scheme, sep, rest = source.partition(":")
    if not sep or len(scheme) < 2 or not scheme.replace("+", "").isalpha():
        return source  # no scheme (or a Windows drive letter)
    if scheme in ("sqlite", "file"):
        parsed = urllib.parse.urlsplit(source)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidArgumentError(f"--from-db {source}: only local files can be read")
        path = urllib.parse.unquote(parsed.path)
        # sqlite:///rel is relative and sqlite:////abs absolute (SQLAlchemy's rule)
        return path[1:] if scheme == "sqlite" and path.startswith("/") else path
    raise InvalidArgumentError(
        f"--from-db {source}: {scheme!r} URLs are not supported; give a user database file, a "
        "cache directory, or a sqlite:/// or file:/// URL of one")

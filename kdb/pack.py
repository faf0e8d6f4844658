"""``kdb pack``: build read-only system databases (``<arch>.kdb``) and wrap each in a wheel.

Kernels come from a TOML manifest (compiled here, through the same back end a framework
uses at run time, so the keys match), from a user database, or from the start-up latency
log (exactly the kernels that were compiled at start-up). The output file is written at the
head schema revision with ``journal_mode=DELETE`` (a WAL file cannot be opened read-only),
vacuumed, renamed into place, and then opened read-only to prove every entry decodes.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from . import codec, config, latency, migrate
from .errors import CompileError, InvalidArgumentError, KdbError, PackError
from .store import KernelFile, sqlite_uri

#: Columns copied from a user file into a system file (every column of ``kernels``).
_COLUMNS = ("key, arch, backend, name, attributes, details, codec, dict_id, blob, raw_size, "
            "stored_size, checksum, compile_seconds, created, last_access, hits")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of a manifest: what to compile, with which options, for which arches."""

    name: str
    source: str
    options: tuple[str, ...] = ()
    include_dirs: tuple[str, ...] = ()
    backend: str = "opencl"
    arches: tuple[str, ...] = ()  # empty: every arch being packed
    compiler: str | None = None  # CUDA: "nvcc", "nvrtc", or None (nvcc where found, else NVRTC)

    def build_options(self) -> list[str]:
        """Options as passed to the back end: the manifest's options, then ``-I`` dirs."""
        opts = list(self.options)
        for d in self.include_dirs:
            opts += ["-I", d]
        return opts


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
    wheel: Path | None = None

    @property
    def file_size(self) -> int:
        """Bytes of the ``.kdb`` file on disk."""
        return self.path.stat().st_size


Progress = Callable[[int, int, str], None]  # (done, total, current kernel)
Step = Callable[[str, str], None]  # (arch, what is being done now)


# -- manifests ----------------------------------------------------------------------------

def load_manifest(path: str | os.PathLike[str]) -> list[KernelSpec]:
    """Read a manifest. Relative ``file`` and ``include_dirs`` are relative to the manifest.

    Format::

        [defaults]                     # optional, applies to every kernel
        options = ["-cl-mad-enable"]   # put before each kernel's own options
        include_dirs = ["include"]     # passed as -I <dir> after the options
        backend = "opencl"             # or "cuda" (cross-compiled with nvcc or NVRTC)
        compiler = "nvrtc"             # CUDA only: "nvcc" or "nvrtc" (default: nvcc where
                                       # one is found, else NVRTC)

        [[kernel]]
        name = "axpy"
        file = "kernels/axpy.cl"       # or: source = "..."
        options = ["-DT=float"]
        defines = { N = 64 }           # appended as -DN=64
        arches = ["pocl-x86_64-znver3"]  # optional subset

    A kernel is built with exactly the option list a framework passes at run time
    (``options``, then ``defines``, then ``-I`` dirs), so that the keys match its lookups.
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidArgumentError(f"manifest {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(f"manifest {path} is not valid TOML: {err}") from err
    base = path.resolve().parent
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict) or set(defaults) - {"options", "include_dirs", "backend",
                                                          "compiler"}:
        raise InvalidArgumentError(f"manifest {path}: [defaults] may hold only 'options', "
                                   "'include_dirs', 'backend' and 'compiler'")
    kernels = data.get("kernel", [])
    if not isinstance(kernels, list) or not kernels:
        raise InvalidArgumentError(f"manifest {path} lists no [[kernel]] tables")
    specs, names = [], set()
    for i, k in enumerate(kernels):
        where = f"manifest {path}, kernel #{i + 1}"
        if not isinstance(k, dict):
            raise InvalidArgumentError(f"{where}: expected a table")
        unknown = set(k) - {"name", "file", "source", "options", "defines", "include_dirs",
                            "backend", "arches", "compiler"}
        if unknown:
            raise InvalidArgumentError(f"{where}: unknown keys {sorted(unknown)}")
        name = k.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(f"{where}: 'name' (a string) is required")
        if name in names:
            raise InvalidArgumentError(f"{where}: duplicate kernel name {name!r}")
        names.add(name)
        if ("file" in k) == ("source" in k):
            raise InvalidArgumentError(f"{where} ({name}): give exactly one of 'file' or 'source'")
        if "file" in k:
            src_path = base / k["file"]
            try:
                source = src_path.read_text(encoding="utf-8")
            except OSError as err:
                raise InvalidArgumentError(
                    f"{where} ({name}): cannot read {src_path}: {err}") from err
        else:
            source = k["source"]
        options = [*_strings(defaults.get("options", []), where, "defaults.options"),
                   *_strings(k.get("options", []), where, "options")]
        defines = k.get("defines", {})
        if not isinstance(defines, dict):
            raise InvalidArgumentError(f"{where} ({name}): 'defines' must be a table")
        options += [f"-D{key}={_define(v)}" for key, v in defines.items()]
        dirs = [str((base / d).resolve()) for d in
                (*_strings(defaults.get("include_dirs", []), where, "defaults.include_dirs"),
                 *_strings(k.get("include_dirs", []), where, "include_dirs"))]
        try:
            arches = tuple(config.check_arch(a)
                           for a in _strings(k.get("arches", []), where, "arches"))
        except InvalidArgumentError as err:
            raise InvalidArgumentError(f"{where} ({name}): {err}") from err
        backend = k.get("backend", defaults.get("backend", "opencl"))
        if backend not in ("opencl", "cuda"):
            raise InvalidArgumentError(f"{where} ({name}): backend {backend!r} is not one kdb "
                                       "packs; use 'opencl' or 'cuda'")
        compiler = k.get("compiler", defaults.get("compiler") if backend == "cuda" else None)
        if compiler is not None and (backend != "cuda" or compiler not in ("nvcc", "nvrtc")):
            raise InvalidArgumentError(f"{where} ({name}): compiler {compiler!r}: CUDA kernels "
                                       "take 'nvcc' or 'nvrtc'; other back ends none")
        specs.append(KernelSpec(name, source, tuple(options), tuple(dirs), backend, arches,
                                compiler))
    return specs


def _strings(value: object, where: str, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgumentError(f"{where}: '{what}' must be a list of strings")
    return value


def _define(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


# -- compiling a manifest -----------------------------------------------------------------

def opencl_arches() -> dict[str, object]:
    """``{arch id: device}`` of the OpenCL devices present (first device per arch)."""
    try:
        import pyopencl as cl
    except ImportError:
        return {}
    from .backends.opencl import arch_of

    found: dict[str, object] = {}
    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return {}
    for plat in platforms:
        for dev in plat.get_devices():
            found.setdefault(arch_of(dev), dev)
    return found


def applicable(specs: list[KernelSpec], arch: str) -> list[KernelSpec]:
    """The specs to build for ``arch``: those naming it, else every spec of a back end that
    can target it (CUDA kernels go to CUDA arches only, OpenCL kernels to every arch)."""
    return [s for s in specs
            if (arch in s.arches if s.arches else s.backend != "cuda" or _is_cuda_arch(arch))]


def _is_cuda_arch(arch: str) -> bool:
    """``sm_90``, ``sm_90a``, ``compute_80``: what nvcc targets.

    >>> _is_cuda_arch("sm_90a"), _is_cuda_arch("pocl-x86_64-znver3")
    (True, False)
    """
    import re

    return re.fullmatch(r"(sm|compute)_\d{2,3}[af]?", arch) is not None


def compile_manifest(specs: list[KernelSpec], arch: str, work_dir: Path, *,
                     keep_going: bool = False, progress: Progress | None = None
                     ) -> tuple[Path, list[tuple[str, str]]]:
    """Compile the specs for ``arch`` into a user file under ``work_dir``; returns its path
    and the failures ``(kernel name, why, with the build log)``.

    OpenCL kernels are built on a device of that arch, which must be present; CUDA kernels
    are cross-compiled by nvcc, no GPU needed. Both go through the same functions a framework
    calls at run time (:func:`kdb.opencl.build`, :func:`kdb.backends.cuda.compile`), so the
    keys are those it will look up.
    """
    from .db import KernelDB

    todo = applicable(specs, arch)
    if not todo:
        raise PackError(f"the manifest lists no kernel for arch {arch!r} (each names other "
                        "'arches', or is a CUDA kernel and this is not a CUDA arch)")
    backends = {s.backend for s in todo}
    if backends - {"opencl", "cuda"}:
        raise PackError(f"unknown back end(s) {sorted(backends - {'opencl', 'cuda'})} in the "
                        "manifest; kdb packs 'opencl' and 'cuda' kernels")
    ctx = None
    if "opencl" in backends:
        devices = opencl_arches()
        if arch not in devices:
            present = ", ".join(sorted(devices)) or "none"
            raise PackError(f"no OpenCL device of arch {arch!r} is present, and OpenCL kernels "
                            f"compile on the device; OpenCL arches present here: {present}")
        import pyopencl as cl

        ctx = cl.Context([devices[arch]])

    db = KernelDB(cache_dir=work_dir, system_path=[], use_system=False, disabled=False)
    failures: list[tuple[str, str]] = []
    compiled: dict[str, list[str]] = {}  # kernel name -> keys its build compiled
    try:
        for i, spec in enumerate(todo):
            if progress:
                progress(i, len(todo), spec.name)
            seen = len(latency.records())
            try:
                _compile_one(spec, arch, ctx, db)
            except CompileError as err:
                failures.append((spec.name, "the build failed; build log:\n"
                                 + (err.log or str(err)).rstrip()))
                if not keep_going:
                    break
            compiled[spec.name] = [r.key for r in latency.records()[seen:]]
        if progress:
            progress(len(todo), len(todo), "storing the binaries")
    finally:
        db.close()
        # These compiles are the product, not a slow start-up: no exit summary for them.
        latency.reset()
    path = db.user_file(arch).path
    # The binaries are read back from the driver and stored in the background, where a
    # failure is only logged: a kernel that compiled but was not stored is a failure here.
    stored = _stored_keys(path)
    for name, keys in compiled.items():
        if any(k not in stored for k in keys):
            failures.append((name, "compiled, but its binary could not be read back and "
                                   "stored (see the kdb warnings above)"))
    if progress:
        progress(len(todo), len(todo), "")
    return path, failures


def _compile_one(spec: KernelSpec, arch: str, ctx: object, db: object) -> None:
    if spec.backend == "opencl":
        from .backends.opencl import build

        build(ctx, spec.source, spec.build_options(), db=db, name=spec.name)
    else:
        from .backends import cuda

        cuda.compile(spec.source, arch=arch, options=list(spec.options),
                     include_dirs=list(spec.include_dirs), db=db, name=spec.name,
                     compiler=spec.compiler)


def _stored_keys(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    f = KernelFile(path, tier="user", readonly=False)
    try:
        return {r[0] for r in f.query("SELECT key FROM kernels")}
    finally:
        f.close()


# -- writing a system file ----------------------------------------------------------------

def write_system_db(dest: Path, arch: str, sources: Iterable[Path],
                    keys: set[str] | None = None, *,
                    keep_compile_seconds: bool = True) -> PackResult:
    """Copy the ``arch`` entries of ``sources`` (only ``keys`` if given) into ``dest``.

    Reproducible: the same entries give the same bytes. Rows go in sorted by key (the first
    source that holds a key gives it); times are ``SOURCE_DATE_EPOCH`` (0 when unset), hits
    0; the packing host's name is dropped from each entry's details; with
    ``keep_compile_seconds=False`` (entries compiled for this pack, whose timings vary
    from run to run) compile seconds are 0.
    """
    from .version import __version__
    from .keys import compiler_free_key
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
            conn.execute(f"CREATE TEMP TABLE incoming AS SELECT {_COLUMNS} FROM main.kernels "
                         "WHERE 0")
            conn.execute("CREATE INDEX temp.ix_incoming_key ON incoming (key)")
            conn.execute("BEGIN")
            for n, src in enumerate(sources):
                if not Path(src).is_file():
                    raise PackError(f"source database {src} does not exist")
                conn.execute(f"ATTACH DATABASE ? AS src{n}", (sqlite_uri(src, "mode=ro"),))
                new = (f"INSERT INTO incoming SELECT {_COLUMNS} FROM src{n}.kernels AS s "
                       "WHERE arch = ? AND NOT EXISTS (SELECT 1 FROM incoming i "
                       "WHERE i.key = s.key)")
                if keys is None:
                    conn.execute(new, (arch,))
                else:
                    for key in sorted(keys):
                        conn.execute(new + " AND key = ?", (arch, key))
            rows = conn.execute(f"SELECT {_COLUMNS} FROM incoming ORDER BY key").fetchall()
            at = _COLUMNS.replace(" ", "").split(",")
            for row in rows:
                entry = dict(zip(at, row))
                entry.update(created=stamp, last_access=stamp, hits=0,
                             details=_portable_details(entry["details"]),
                             compiler_free_key=compiler_free_key(entry["attributes"]))
                if not keep_compile_seconds:
                    entry["compile_seconds"] = 0.0
                conn.execute(f"INSERT INTO kernels ({', '.join(entry)}) VALUES "
                             f"({', '.join('?' * len(entry))})", tuple(entry.values()))
            missing = [] if keys is None else sorted(
                set(keys) - {r[0] for r in conn.execute("SELECT key FROM kernels")})
            count, raw, stored = conn.execute(
                "SELECT count(*), coalesce(sum(raw_size), 0), coalesce(sum(stored_size), 0) "
                "FROM kernels").fetchone()
            for name, value in sorted((("arch", arch), ("format", str(config.FORMAT_MAJOR)),
                                       ("kdb_version", __version__), ("stored_bytes", str(stored)),
                                       ("raw_bytes", str(raw)), ("entries", str(count)),
                                       ("created", str(int(stamp))))):
                conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES (?, ?)",
                             (name, value))
            conn.execute("COMMIT")
            conn.execute("DROP TABLE temp.incoming")
            for n, _ in enumerate(sources):
                conn.execute(f"DETACH DATABASE src{n}")
            conn.execute("VACUUM")
        finally:
            conn.close()
        if count == 0:
            raise PackError(f"no kernels for arch {arch!r} in the given input; nothing to pack")
        tmp.chmod(0o644)  # mkstemp made it private; an installed system file is for everyone
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _verify(dest, count)
    return PackResult(arch, dest, entries=count, raw_bytes=raw, stored_bytes=stored,
                      missing=missing)


def _portable_details(text: object) -> str:
    """An entry's details without the packing host's name (a pack must not depend on it).

    >>> _portable_details('{"host": "build7", "nvcc": "/usr/bin/nvcc"}')
    '{"nvcc": "/usr/bin/nvcc"}'
    """
    import json

    try:
        details = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return "{}"
    if not isinstance(details, dict):
        return "{}"
    details.pop("host", None)
    return json.dumps(details, sort_keys=True)


def _verify(path: Path, expected: int) -> None:
    """Open the file read-only, as kdb will at run time, and decode every entry."""
    # Bytes 18-19 of the header are 1 for a rollback journal, 2 for WAL; an immutable
    # connection's PRAGMA journal_mode does not look (sqlite.org/fileformat2.html#database_header).
    with open(path, "rb") as fh:
        header = fh.read(20)
    if len(header) < 20 or header[18:20] != b"\x01\x01":
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


def log_keys(user_file: Path, since: float | None = None) -> set[str]:
    """Keys of the start-up latency log of a user file (optionally since a time)."""
    f = KernelFile(user_file, tier="user", readonly=False)  # immutable=1 would skip the WAL
    try:
        if since is None:
            rows = f.query("SELECT DISTINCT key FROM compile_log")
        else:
            rows = f.query("SELECT DISTINCT key FROM compile_log WHERE at >= ?", (since,))
    finally:
        f.close()
    return {r[0] for r in rows}


# -- the whole job ------------------------------------------------------------------------

def resolve_arches(arches: Iterable[str]) -> list[str]:
    """Arch ids to pack; ``native`` stands for the arches of the OpenCL devices present."""
    out: list[str] = []
    for a in arches:
        if a == "native":
            present = sorted(opencl_arches())
            if not present:
                raise PackError("--arch native: no OpenCL device is present here")
            out += present
        else:
            out.append(config.check_arch(a))
    if not out:
        raise InvalidArgumentError("give at least one --arch (or --arch native)")
    return list(dict.fromkeys(out))


def user_db_file(source: str | os.PathLike[str] | None, arch: str,
                 work_dir: Path | None = None) -> Path:
    """The user file of ``arch`` named by ``--from-db``: a file, a cache dir, or the default.

    ``source`` may also be a URL of a local SQLite file or directory: ``sqlite:///path`` (the
    SQLAlchemy spelling) or ``file:///path``; or the shared tier's URL
    (``postgresql+psycopg://...``), whose ``arch`` entries and compile log are exported into
    a SQLite file in ``work_dir`` first.
    """
    if source is None:
        return config.user_dir() / f"{arch}.kdb"
    if _is_server_url(os.fspath(source)):  # the shared tier (kdb.shared)
        return _export_shared(os.fspath(source), arch, work_dir)
    p = Path(_url_path(os.fspath(source))).expanduser()
    if p.is_file():
        return p
    for candidate in (p / f"v{config.FORMAT_MAJOR}" / f"{arch}.kdb", p / f"{arch}.kdb"):
        if candidate.is_file():
            return candidate
    raise PackError(f"--from-db {source}: no database for arch {arch!r} there (looked for "
                    f"{p / f'v{config.FORMAT_MAJOR}' / f'{arch}.kdb'} and {p / f'{arch}.kdb'})")


#: Seconds ``kdb pack`` waits for the store worker to store what a run compiled.
PENDING_WAIT_S = 900.0


def _wait_for_stores(source, on_step: Step | None) -> None:
    """Before copying from a local user tier: let the store worker finish the entries a
    run just compiled (their binaries may not be stored yet), saying so on the way."""
    from . import spool

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
            on_step("*", f"waiting for the store worker: {left} compiled program(s) not stored "
                         "yet")

    left = spool.wait(user_dir, PENDING_WAIT_S, say)
    if left and on_step:
        on_step("*", f"{left} program(s) still not stored after {PENDING_WAIT_S:.0f} s: packing "
                     "without them")


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
    from .shared import SharedTier, mask

    if work_dir is None:
        raise InvalidArgumentError("exporting from a database server needs a work_dir")
    tier = SharedTier(url)
    dest = Path(work_dir) / f"shared-{arch}.kdb"
    try:
        count = tier.export(arch, dest)
    except KdbError as err:
        raise PackError(f"--from-db {mask(url)}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a server fault, reported without the URL's secrets
        raise PackError(f"--from-db {mask(url)}: could not read the shared tier "
                        f"({tier.reason(err)})") from None
    if count == 0:
        raise PackError(f"--from-db {mask(url)}: the shared tier holds no kernels for arch "
                        f"{arch!r}")
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


def _shown(source: str | os.PathLike[str] | None) -> str | None:
    """A server URL as it may be shown (password masked); ``None`` for a local source."""
    if source is None or not _is_server_url(os.fspath(source)):
        return None
    from .shared import mask

    return mask(os.fspath(source))


def pack(arches: Iterable[str], *, out_dir: str | os.PathLike[str], version: str | None = None,
         manifest: str | os.PathLike[str] | None = None,
         from_db: str | os.PathLike[str] | None = None, from_log: bool = False,
         keep_going: bool = False, dist_prefix: str = "kdb-system",
         progress: Progress | None = None, on_step: Step | None = None) -> list[PackResult]:
    """Build ``<arch>.kdb`` for every arch from one input, and a wheel each if ``version``.

    Exactly one input: ``manifest`` (compiled here), ``from_db`` (copy a user database) or
    ``from_log`` (copy the kernels of the start-up latency log of ``from_db``'s database, by
    default the user tier's). A kernel that fails to compile raises :class:`PackError` with
    its build log, unless ``keep_going``: then the others are packed and the failures are in
    each result's ``failures``. Wheels are named ``<dist_prefix>-<arch>``.
    """
    if sum(x for x in (manifest is not None, from_log, from_db is not None and not from_log)) != 1:
        raise InvalidArgumentError("give exactly one input: --manifest FILE, --from-db [PATH] "
                                   "or --from-log")
    from .wheel import build_wheel, check_version, dist_name

    out = Path(out_dir)
    specs = load_manifest(manifest) if manifest is not None else None
    arch_list = resolve_arches(arches)
    if version is not None:  # a bad version or name fails before any compile
        check_version(version)
        for arch in arch_list:
            dist_name(arch, dist_prefix)

    def step(arch: str, what: str) -> None:
        if on_step:
            on_step(arch, what)

    if specs is None:
        _wait_for_stores(from_db, on_step)
    results = []
    for arch in arch_list:
        start = time.perf_counter()
        failures: list[tuple[str, str]] = []
        with tempfile.TemporaryDirectory(prefix="kdb-pack-") as work:
            if specs is not None:
                step(arch, "compiling the manifest's kernels")
                src, failures = compile_manifest(specs, arch, Path(work), keep_going=keep_going,
                                                 progress=progress)
                if failures and not keep_going:
                    name, why = failures[0]
                    raise PackError(f"kernel {name!r} could not be packed for {arch} (fix it, "
                                    f"or pass --keep-going to pack the others): {why}")
                if failures and len(failures) == len(applicable(specs, arch)):
                    raise PackError(f"no kernel could be packed for {arch} ("
                                    + ", ".join(n for n, _ in failures) + "); the first, "
                                    f"{failures[0][0]!r}: {failures[0][1]}")
                keys = None
            else:
                src = user_db_file(from_db, arch, work_dir=Path(work))
                shown = _shown(from_db) or src  # the shared tier: its URL, password masked
                keys = log_keys(src) if from_log else None
                if from_log and not keys:
                    raise PackError(f"the start-up latency log of {shown} is empty for {arch}")
                step(arch, f"copying {'the logged kernels' if from_log else 'the entries'} "
                           f"of {shown}")
            step(arch, f"writing {out / f'{arch}.kdb'}")
            result = write_system_db(out / f"{arch}.kdb", arch, [src], keys,
                                     keep_compile_seconds=specs is None)
        result.failures = failures
        if version is not None:
            step(arch, f"building the wheel {dist_name(arch, dist_prefix)} {version}")
            result.wheel = build_wheel(result.path, arch, version, out, dist_prefix=dist_prefix)
        result.seconds = time.perf_counter() - start
        results.append(result)
    return results

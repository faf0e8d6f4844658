"""Every setting kdb reads: explicit argument, then environment variable, then default.

Values are read when used, never at import, so a test's ``monkeypatch.setenv`` or a
framework's ``os.environ[...] = ...`` before the first lookup takes effect.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .errors import ConfigError, UnsafeArchError
from .dirs import home, make_private_dir

#: Major version of the on-disk format: user files live in ``<cache dir>/v<major>/``, so an
#: incompatible release never opens a file written by another.
FORMAT_MAJOR = 1

ENV_CACHE_DIR = "KDB_CACHE_DIR"
ENV_SYSTEM_DB_PATH = "KDB_SYSTEM_DB_PATH"
ENV_DISABLE_CACHE, ENV_DISABLE_REFRESH = "KDB_DISABLE_CACHE", "KDB_DISABLE_REFRESH"
ENV_CACHE_MAX_SIZE = "KDB_CACHE_MAX_SIZE"
ENV_SHARED_URL = "KDB_SHARED_URL"
ENV_SHARED_CONNECT_TIMEOUT = "KDB_SHARED_CONNECT_TIMEOUT"
ENV_SHARED_STATEMENT_TIMEOUT = "KDB_SHARED_STATEMENT_TIMEOUT"
ENV_SHARED_RETRY = "KDB_SHARED_RETRY"
ENV_SHARED_MAX_SIZE = "KDB_SHARED_MAX_SIZE"
ENV_SHARED_NAMESPACE = "KDB_SHARED_NAMESPACE"
ENV_STRICT = "KDB_STRICT"
# Signed entries (kdb.signing.policy): keys trusted, user tier covered too, key to sign with.
ENV_TRUSTED_KEYS = "KDB_TRUSTED_KEYS"
ENV_REQUIRE_SIGNED = "KDB_REQUIRE_SIGNED"
ENV_SIGNING_KEY = "KDB_SIGNING_KEY"
ENV_TRACE = "KDB_TRACE"
ENV_STORE_TIMEOUT = "KDB_STORE_TIMEOUT"
ENV_STORE_AT_EXIT = "KDB_STORE_AT_EXIT"
ENV_WAIT_TIMEOUT = "KDB_WAIT_TIMEOUT"
ENV_LOCK_TIMEOUT = "KDB_LOCK_TIMEOUT"
ENV_NVCC = "KDB_NVCC"  # the nvcc kdb.cuda runs (else CUDA_HOME/bin/nvcc, else PATH)
ENV_NVRTC = "KDB_NVRTC"  # the libnvrtc.so kdb.cuda loads (else the nvidia-cuda-nvrtc wheel)
#: ``1``: every Python process started with it adopts pyopencl and pycuda (``kdb-auto.pth``
#: reads it at start-up through ``_kdb_auto``, which repeats the name to stay off kdb).
ENV_AUTO = "KDB_AUTO"
#: Directory where each process that used kdb leaves its counts at exit (``kdb run``, pytest).
ENV_RUN_REPORT = "KDB_RUN_REPORT"

#: Seconds a writer waits on a locked user database before giving up (and warning).
BUSY_TIMEOUT_S = 5.0
STORE_TIMEOUT_S = 120.0  # an exiting process finishing its background stores
WAIT_TIMEOUT_S = 60.0  # a process waiting for another that compiles the same kernel

#: Seconds a process waits for another's upgrade lock on a user file before going on without it.
LOCK_TIMEOUT_S = 10.0

#: The shared tier's bounds: seconds to connect, seconds a statement may run, and seconds
#: between attempts to reach a server that failed (kdb uses its local tiers meanwhile).
SHARED_CONNECT_TIMEOUT_S, SHARED_STATEMENT_TIMEOUT_S, SHARED_RETRY_S = 3.0, 5.0, 30.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
#: An arch id: a letter or digit, then letters, digits and ``_.+-`` (a safe file name).
_ARCH_FIRST = frozenset("abcdefghijklmnopqrstuvwxyz0123456789")
_ARCH_CHARS = _ARCH_FIRST | frozenset("_.+-")


def read_variables(names: tuple[str, ...]) -> dict[str, str | None]:
    """``{name: value}`` for ``names`` (``None`` where unset), read in one go.

    >>> import os; os.environ["KDB_DOCTEST_VAR"] = "1"
    >>> read_variables(("KDB_DOCTEST_VAR", "KDB_DOCTEST_UNSET"))
    {'KDB_DOCTEST_VAR': '1', 'KDB_DOCTEST_UNSET': None}
    >>> del os.environ["KDB_DOCTEST_VAR"]
    """
    get = os.environ.get
    return {n: get(n) for n in names}


#: Longest duration any ``*_TIMEOUT`` / ``*_RETRY`` setting may ask for: a day.
MAX_SECONDS = 86400.0

#: Largest cap ``KDB_CACHE_MAX_SIZE`` may name (SQLite's largest integer is 2**63 - 1).
MAX_SIZE_LIMIT = 1 << 62


def _bad_setting(name: str, raw: str, problem: str, used: str) -> None:
    """One warning per bad ``KDB_*`` variable and value, naming what is used instead (the
    command line refuses them: :func:`problems`)."""
    from . import logs

    logs.warn_once(f"config:{name}={raw}", "kdb: %s=%s %s; using %s instead", name,
                     _short(raw), problem, used)


def parse_flag(name: str, raw: str) -> bool:
    """A boolean variable's value; :class:`ConfigError` if it is not one.

    >>> parse_flag("KDB_TRACE", " Yes "), parse_flag("KDB_TRACE", "0")
    (True, False)
    """
    value = raw.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ConfigError(f"{name}={raw!r} is not a boolean; set it to 1 or 0")


#: A bad boolean's fallback where the default is not safe, and what the warning says of it.
_FLAG_FALLBACK = {ENV_DISABLE_CACHE: (True, "1 (the cache is turned off)"),
                  ENV_REQUIRE_SIGNED: (True, "1 (every tier must verify: the safe side)")}


def flag(name: str, explicit: bool | None = None) -> bool:
    """A boolean setting: ``explicit`` if given, else the variable ``name`` (``1``/``0``...)."""
    if explicit is not None:
        return bool(explicit)
    raw = os.environ.get(name, "")
    try:
        return parse_flag(name, raw)
    except ConfigError:
        used, shown = _FLAG_FALLBACK.get(name, (False, "0 (the default)"))
        _bad_setting(name, raw, "is not a boolean (1 or 0)", shown)
        return used


def parse_seconds(name: str, raw: str) -> float:
    """A duration in seconds, finite, from 0 to :data:`MAX_SECONDS`; else :class:`ConfigError`.

    >>> parse_seconds("KDB_WAIT_TIMEOUT", "2.5")
    2.5
    """
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not 0 <= value <= MAX_SECONDS:  # NaN fails both comparisons
        raise ConfigError(f"{name}={raw!r} must be a number of seconds from 0 to "
                          f"{MAX_SECONDS:g}")
    return value


def seconds(name: str, default: float, explicit: float | None = None) -> float:
    """A duration setting in seconds: ``explicit``, else the variable ``name``, else default."""
    if explicit is not None:
        return float(explicit)
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse_seconds(name, raw)
    except ConfigError:
        _bad_setting(name, raw, f"is not a number of seconds from 0 to {MAX_SECONDS:g}",
                     f"{default:g} s (the default)")
        return default


#: Default cap of the user tier, per file (like Intel's and CUDA's caches).
MAX_SIZE_DEFAULT = 1 << 30
_SIZE_PATTERN = r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b?)\s*\Z"


def _short(raw: str, width: int = 40) -> str:
    """``raw`` as a message shows it: repr'd, cut to ``width`` characters."""
    text = repr(raw)
    return text if len(text) <= width else text[: width - 4] + "...'"


def _size_or_reason(text: str) -> int | str:
    import re

    m = re.match(_SIZE_PATTERN, str(text), re.IGNORECASE)
    if not m:
        return "is not understood"
    digits, unit = m.group(1), m.group(2).lower()
    if len(digits) > 30:  # float() would round it, or give inf
        return f"is absurdly large (the largest is {MAX_SIZE_LIMIT} bytes)"
    exact = float(digits) * (1 << (10 * " kmgt".index(unit or " ")))
    if exact != int(exact) and not unit:
        return "is a fraction of a byte"
    if exact > MAX_SIZE_LIMIT:
        return f"is absurdly large (the largest is {MAX_SIZE_LIMIT} bytes)"
    return int(exact)


def parse_size(text: str) -> int:
    """Bytes from ``"500M"``, ``"2G"``, ``"1.5GiB"`` or a plain number (1024-based units).

    A fraction of a byte (``0.5``) and sizes past :data:`MAX_SIZE_LIMIT` are refused.

    >>> parse_size("500M"), parse_size("2g"), parse_size("0"), parse_size("4096")
    (524288000, 2147483648, 0, 4096)
    """
    got = _size_or_reason(text)
    if isinstance(got, str):
        raise ConfigError(f"size {_short(str(text))} {got}; use whole bytes or a suffix: "
                          "500M, 2G")
    return got


def max_size(explicit: int | str | None = None) -> int:
    """The user tier's cap in bytes (``KDB_CACHE_MAX_SIZE``); 0 means no cap."""
    if explicit is not None:
        return explicit if isinstance(explicit, int) else parse_size(explicit)
    raw = os.environ.get(ENV_CACHE_MAX_SIZE, "").strip()
    if not raw:
        return MAX_SIZE_DEFAULT
    got = _size_or_reason(raw)
    if isinstance(got, str):
        _bad_setting(ENV_CACHE_MAX_SIZE, raw, f"{got} (use bytes or a suffix such as 500M "
                     "or 2G; 0 = no cap)", "1G (the default)")
        return MAX_SIZE_DEFAULT
    return got


def shared_max_size() -> int:
    """The shared tier's cap in stored bytes (``KDB_SHARED_MAX_SIZE``); 0 (the default): none."""
    raw = os.environ.get(ENV_SHARED_MAX_SIZE, "").strip()
    if not raw:
        return 0
    got = _size_or_reason(raw)
    if isinstance(got, str):
        _bad_setting(ENV_SHARED_MAX_SIZE, raw, f"{got} (use bytes or a suffix such as 50G; "
                     "0 = no cap)", "0 (no cap)")
        return 0
    return got


def parse_namespace(raw: str) -> str | None:
    """A tenant's namespace (``KDB_SHARED_NAMESPACE``, schema ``kdb_<name>``); None: blank.

    >>> parse_namespace(" team_a "), parse_namespace("")
    ('team_a', None)
    """
    import re

    value = raw.strip()
    if value and not re.match(r"[a-z][a-z0-9_]{0,39}\Z", value):  # a bare identifier, < 64 bytes
        raise ConfigError(f"{ENV_SHARED_NAMESPACE}={_short(raw)} is not a namespace name: use a "
                          "lower-case letter, then at most 39 lower-case letters, digits or '_' "
                          "(an administrator creates it with kdb shared init --tenant NAME)")
    return value or None


def shared_namespace() -> str | None:
    """``KDB_SHARED_NAMESPACE``, checked where the tier connects: a bad name turns it off."""
    return os.environ.get(ENV_SHARED_NAMESPACE, "").strip() or None


def store_timeout(explicit: float | None = None) -> float:
    """Seconds an exiting process spends finishing background stores (``KDB_STORE_TIMEOUT``)."""
    return seconds(ENV_STORE_TIMEOUT, STORE_TIMEOUT_S, explicit)


#: What an exiting process does with stores it has not started (``KDB_STORE_AT_EXIT``).
STORE_AT_EXIT = ("detach", "wait")


def parse_store_at_exit(raw: str) -> str:
    value = raw.strip().lower() or STORE_AT_EXIT[0]
    if value not in STORE_AT_EXIT:
        raise ConfigError(f"{ENV_STORE_AT_EXIT}={raw!r} is not one of {', '.join(STORE_AT_EXIT)}:"
                          " 'detach' (the default) hands stores to the store worker, "
                          "'wait' stores before the process exits")
    return value


def store_at_exit(explicit: str | None = None) -> str:
    """``detach``: OpenCL stores go to the store worker (:mod:`kdb.storing.spool`) as they happen;
    ``wait``: the process stores them itself, before exit within ``KDB_STORE_TIMEOUT``.
    A bad value falls back to ``wait``, which needs nothing but this process."""
    if explicit is not None:
        return parse_store_at_exit(explicit)
    raw = os.environ.get(ENV_STORE_AT_EXIT, "")
    try:
        return parse_store_at_exit(raw)
    except ConfigError:
        _bad_setting(ENV_STORE_AT_EXIT, raw, f"is not one of {', '.join(STORE_AT_EXIT)}",
                     "'wait' (storing before exit)")
        return "wait"


def wait_timeout(explicit: float | None = None) -> float:
    """Seconds a process waits for another that compiles the same kernel (``KDB_WAIT_TIMEOUT``)."""
    return seconds(ENV_WAIT_TIMEOUT, WAIT_TIMEOUT_S, explicit)


def lock_timeout(explicit: float | None = None) -> float:
    """Seconds a process waits for another's schema upgrade of a file (``KDB_LOCK_TIMEOUT``)."""
    return seconds(ENV_LOCK_TIMEOUT, LOCK_TIMEOUT_S, explicit)


def check_settings() -> None:
    """Read every setting the store worker will read, so a bad value warns here, in the
    program that set it, as the others do: the worker's log is where nobody looks."""
    max_size(), store_at_exit(), store_timeout(), wait_timeout(), lock_timeout()
    flag(ENV_DISABLE_CACHE), flag(ENV_STRICT), flag(ENV_TRACE)
    seconds(ENV_SHARED_CONNECT_TIMEOUT, SHARED_CONNECT_TIMEOUT_S)
    seconds(ENV_SHARED_STATEMENT_TIMEOUT, SHARED_STATEMENT_TIMEOUT_S)
    seconds(ENV_SHARED_RETRY, SHARED_RETRY_S)


def problems(environ: dict[str, str] | None = None) -> list[str]:
    """Every ``KDB_*`` variable set to a value kdb cannot use, one message each: the command
    line refuses to run with any (exit status 2); a program warns once per variable.

    >>> problems({"KDB_WAIT_TIMEOUT": "nan", "KDB_TRACE": "1"})
    ["KDB_WAIT_TIMEOUT='nan' must be a number of seconds from 0 to 86400"]
    """
    env = os.environ if environ is None else environ
    out = []
    checks = [(n, lambda n, v: parse_flag(n, v)) for n in (
        ENV_DISABLE_CACHE, ENV_STRICT, ENV_TRACE, ENV_REQUIRE_SIGNED, ENV_DISABLE_REFRESH)]
    checks += [(n, parse_seconds) for n in (ENV_WAIT_TIMEOUT, ENV_STORE_TIMEOUT, ENV_LOCK_TIMEOUT,
                                             ENV_SHARED_CONNECT_TIMEOUT,
                                             ENV_SHARED_STATEMENT_TIMEOUT, ENV_SHARED_RETRY)]
    checks += [(ENV_STORE_AT_EXIT, lambda n, v: parse_store_at_exit(v)),
               (ENV_CACHE_MAX_SIZE, lambda n, v: parse_size(v)),
               (ENV_SHARED_MAX_SIZE, lambda n, v: parse_size(v)),
               (ENV_SHARED_NAMESPACE, lambda n, v: parse_namespace(v))]
    for name, check in checks:
        raw = env.get(name)
        if raw is None or (not raw.strip() and name != ENV_STORE_AT_EXIT):
            continue
        try:
            check(name, raw.strip() if check is parse_seconds else raw)
        except ConfigError as err:
            text = str(err)
            out.append(text if name in text else f"{name}: {text}")
    return out


def shared_url(explicit: str | None = None) -> str | None:
    """The shared tier's SQLAlchemy URL (``KDB_SHARED_URL``); ``None`` when it is off."""
    url = explicit if explicit is not None else os.environ.get(ENV_SHARED_URL, "")
    return url.strip() or None


def cache_root_str(explicit: str | os.PathLike[str] | None = None) -> str:
    """:func:`cache_root` as a str (the hit path's), absolute: the store worker runs in ``/``."""
    env = os.environ.get(ENV_CACHE_DIR)
    if explicit is not None or env:
        root = str(Path(env if explicit is None else explicit).expanduser())
    elif sys.platform == "darwin":
        root = os.path.join(home(), "Library", "Caches", "kdb")
    elif sys.platform == "win32":
        fallback = os.path.join(home(), "AppData", "Local")
        root = str(Path(os.environ.get("LOCALAPPDATA", fallback), "kdb"))
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(home(), ".cache")
        root = str(Path(base, "kdb"))
    try:  # a deleted working directory leaves a relative root as it is
        return root if os.path.isabs(root) else str(Path(os.getcwd(), root))
    except OSError:
        return root


def user_dir_str(explicit: str | os.PathLike[str] | None = None) -> str:
    """:func:`user_dir` as a str (what the hit path uses)."""
    return os.path.join(cache_root_str(explicit), f"v{FORMAT_MAJOR}")


def system_dirs_str(explicit: str | os.PathLike[str] | list | tuple | None = None) -> list[str]:
    """:func:`system_dirs` as strs (what the hit path uses)."""
    if explicit is None:
        explicit = os.environ.get(ENV_SYSTEM_DB_PATH, "")
    parts = ([p for p in str(explicit).split(os.pathsep) if p]
             if isinstance(explicit, (str, os.PathLike)) else [str(p) for p in explicit])
    return [str(Path(p).expanduser()) for p in parts]


def cache_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The user tier's root directory (``KDB_CACHE_DIR``, else the platform's user cache)."""
    return Path(cache_root_str(explicit))


def user_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Directory of the user tier's files, versioned by the on-disk format's major version."""
    return Path(user_dir_str(explicit))


def system_dirs(explicit: str | os.PathLike[str] | list | tuple | None = None) -> list[Path]:
    """Extra directories searched for ``<arch>.kdb`` (``KDB_SYSTEM_DB_PATH``, os.pathsep list)."""
    return [Path(p) for p in system_dirs_str(explicit)]


#: Create a directory and any missing parents with mode 0700 (:func:`kdb.dirs.make_private_dir`).
private_dir = make_private_dir


def check_arch(arch: object) -> str:
    """Return ``arch`` if it is a safe arch id, else raise :class:`UnsafeArchError`.

    >>> check_arch("sm_90")
    'sm_90'
    """
    if (not isinstance(arch, str) or not arch or arch[0] not in _ARCH_FIRST
            or not _ARCH_CHARS.issuperset(arch)):
        raise UnsafeArchError(f"arch id {arch!r} is not valid: use lower-case letters, digits "
                              "and '_.+-', starting with a letter or digit (for example 'sm_90' "
                              "or 'gfx90a')")
    return arch

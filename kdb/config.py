"""Every setting kdb reads: explicit argument, then environment variable, then default.

:data:`SETTINGS` is the one table of them (name, default, parser, what a bad value does);
the readers, :func:`check_settings`, :func:`problems`, ``kdb info`` and
docs/configuration.md come from it. Values are read when used, never at import, so a test's
``monkeypatch.setenv`` or a framework's ``os.environ[...] = ...`` before the first lookup
takes effect.
"""

from __future__ import annotations

import functools
import os
import sys
from collections import namedtuple
from pathlib import Path

from .errors import ConfigError, UnsafeArchError
from .dirs import home, make_private_dir

#: Major version of the on-disk format: user files live in ``<cache dir>/v<major>/``, so an
#: incompatible release never opens a file written by another.
FORMAT_MAJOR = 1

ENV_CACHE_DIR = "KDB_CACHE_DIR"
ENV_SYSTEM_DB_PATH = "KDB_SYSTEM_DB_PATH"
ENV_DISABLE_CACHE, ENV_DISABLE_REFRESH = "KDB_DISABLE_CACHE", "KDB_DISABLE_REFRESH"
ENV_DISABLE_EARLY_STORE = "KDB_DISABLE_EARLY_STORE"
ENV_CACHE_MAX_SIZE = "KDB_CACHE_MAX_SIZE"
ENV_SHARED_URL = "KDB_SHARED_URL"
ENV_SHARED_CONNECT_TIMEOUT = "KDB_SHARED_CONNECT_TIMEOUT"
ENV_SHARED_STATEMENT_TIMEOUT = "KDB_SHARED_STATEMENT_TIMEOUT"
ENV_SHARED_RETRY = "KDB_SHARED_RETRY"
ENV_SHARED_MAX_SIZE = "KDB_SHARED_MAX_SIZE"
ENV_SHARED_NAMESPACE = "KDB_SHARED_NAMESPACE"
ENV_STRICT = "KDB_STRICT"
ENV_TRUSTED_KEYS = "KDB_TRUSTED_KEYS"
ENV_REQUIRE_SIGNED = "KDB_REQUIRE_SIGNED"
ENV_SIGNING_KEY = "KDB_SIGNING_KEY"
ENV_TRACE = "KDB_TRACE"
ENV_STORE_TIMEOUT = "KDB_STORE_TIMEOUT"
ENV_STORE_AT_EXIT = "KDB_STORE_AT_EXIT"
ENV_STORE_SHARE = "KDB_STORE_SHARE"
ENV_WAIT_TIMEOUT = "KDB_WAIT_TIMEOUT"
ENV_LOCK_TIMEOUT = "KDB_LOCK_TIMEOUT"
ENV_NVCC = "KDB_NVCC"  # the nvcc kdb.cuda runs (else CUDA_HOME/bin/nvcc, else PATH)
ENV_NVRTC = "KDB_NVRTC"  # the libnvrtc.so kdb.cuda loads (else the nvidia-cuda-nvrtc wheel)
ENV_HIPCC = "KDB_HIPCC"  # the hipcc kdb.hip runs (else ROCM_PATH/bin/hipcc, else PATH)
ENV_HIPRTC = "KDB_HIPRTC"  # the HIPRTC library kdb.hip loads (else libamdhip64 in the lib dirs)
ENV_AUTO = "KDB_AUTO"  # read at start-up by _kdb_auto, which repeats the name to stay off kdb
ENV_RUN_REPORT = "KDB_RUN_REPORT"

#: Seconds a writer waits on a locked user database before giving up (and warning).
BUSY_TIMEOUT_S = 5.0

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
    environ = os.environ
    if len(environ) > 5 * len(names) or os.name == "nt":  # Windows: names fold case
        get = environ.get
        return {n: get(n) for n in names}
    # Most of the names a build reads are unset, and an unset name costs os.environ two
    # raised KeyErrors (0.7 us; a build reads 40 names): one pass over the environment's
    # names (0.13 us each) finds the few that are set, and only those are read.
    variables = dict.fromkeys(names)
    for name in _wanted(names).intersection(environ):
        variables[name] = environ.get(name)
    return variables


@functools.lru_cache(maxsize=64)
def _wanted(names: tuple[str, ...]) -> frozenset[str]:
    """``names`` as a set, made once per tuple (each back end asks for a fixed one)."""
    return frozenset(names)


#: Longest duration any ``*_TIMEOUT`` / ``*_RETRY`` setting may ask for: a day.
MAX_SECONDS = 86400.0

#: Largest cap ``KDB_CACHE_MAX_SIZE`` may name (SQLite's largest integer is 2**63 - 1).
MAX_SIZE_LIMIT = 1 << 62


def parse_flag(name: str, raw: str) -> bool:
    """A boolean variable's value; :class:`ConfigError` if it is not one.

    >>> parse_flag("KDB_TRACE", " Yes "), parse_flag("KDB_TRACE", "0")
    (True, False)
    """
    value = raw.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ConfigError(f"{name}={_short(raw)} is not a boolean; set it to 1 or 0")


def parse_seconds(name: str, raw: str) -> float:
    """A duration in seconds, finite, from 0 to :data:`MAX_SECONDS`; else :class:`ConfigError`.

    >>> parse_seconds("KDB_WAIT_TIMEOUT", "2.5")
    2.5
    """
    return _ranged(name, raw, MAX_SECONDS, "a number of seconds")


def _ranged(name: str, raw: str, high: float, what: str) -> float:
    """A finite number from 0 to ``high`` (``what`` it is, for the error); else ConfigError."""
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={_short(raw)} is not {what}") from None
    if not 0 <= value <= high:  # NaN fails both comparisons
        raise ConfigError(f"{name}={_short(raw)} must be {what} from 0 to {high:g}")
    return value


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


def parse_size_setting(name: str, raw: str) -> int:
    """:func:`parse_size` of the variable ``name``, whose messages name it."""
    got = _size_or_reason(raw)
    if isinstance(got, str):
        raise ConfigError(f"{name}={_short(raw)} {got}; use bytes or a suffix such as 500M or "
                          "2G (0 = no cap)")
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


#: What an exiting process does with stores it has not started (``KDB_STORE_AT_EXIT``).
STORE_AT_EXIT = ("detach", "wait")


def parse_share(name: str, raw: str) -> float:
    """A fraction of one core, from 0 to 1; else :class:`ConfigError`.

    >>> parse_share("KDB_STORE_SHARE", "0.25")
    0.25
    """
    return _ranged(name, raw, 1.0, "a fraction of one core (0: no floor)")


def parse_store_at_exit(raw: str) -> str:
    value = raw.strip().lower() or STORE_AT_EXIT[0]
    if value not in STORE_AT_EXIT:
        raise ConfigError(f"{ENV_STORE_AT_EXIT}={raw!r} is not one of {', '.join(STORE_AT_EXIT)}:"
                          " 'detach' (the default) hands stores to the store worker, "
                          "'wait' stores before the process exits")
    return value


# -- the table ---------------------------------------------------------------------------------

class Setting(namedtuple("Setting", "name default shown parse fallback bad")):
    """A row of :data:`SETTINGS`: the variable, its ``default`` (unset or blank) and how the
    docs and ``kdb info`` show it (``shown``), ``parse(name, text)`` (raises ConfigError;
    None: the text as written), the value a bad one reads as (``fallback``) and what a bad
    value does, in words (``bad``)."""

    __slots__ = ()


#: A bad value's fallback where no value is safe: :func:`read` returns the text unparsed and
#: the code that uses it refuses it (a bad namespace turns the shared tier off).
CHECKED_WHERE_USED = object()


def _flag(name: str, *, bad_means: bool = False, said: str = "0 (the default)") -> Setting:
    return Setting(name, False, "off", parse_flag, bad_means, said)


def _duration(name: str, default: float) -> Setting:
    return Setting(name, default, f"{default:g}", parse_seconds, default,
                   f"{default:g} s (the default)")


def _text(name: str, shown: str, bad: str = "") -> Setting:
    return Setting(name, None, shown, None, None, bad)


#: Every variable kdb reads, in the order docs/configuration.md lists them (a test holds the
#: page to it): the readers, :func:`check_settings`, :func:`problems` and ``kdb info`` use it.
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    _text(ENV_AUTO, "unset (off)", "off, with one warning"),  # _kdb_auto checks it
    _text(ENV_CACHE_DIR, "$XDG_CACHE_HOME/kdb"),
    _text(ENV_SYSTEM_DB_PATH, "none"),
    _flag(ENV_DISABLE_CACHE, bad_means=True, said="1 (the cache is turned off)"),
    _flag(ENV_DISABLE_REFRESH),
    _flag(ENV_DISABLE_EARLY_STORE),
    Setting(ENV_CACHE_MAX_SIZE, MAX_SIZE_DEFAULT, "1G", parse_size_setting, MAX_SIZE_DEFAULT,
            "1G (the default)"),
    _flag(ENV_STRICT),
    _flag(ENV_TRACE),
    _text(ENV_NVCC, "$CUDA_HOME/bin/nvcc, else nvcc on PATH"),
    _text(ENV_NVRTC, "the nvidia-cuda-nvrtc wheel, else $CUDA_HOME/lib64"),
    _text(ENV_HIPCC, "$ROCM_PATH/bin/hipcc, else hipcc on PATH"),
    _text(ENV_HIPRTC, "libamdhip64.so in $ROCM_PATH/lib, /opt/rocm/lib or the system's "
          "library directories"),
    _text("SOURCE_DATE_EPOCH", "0 (1980-01-01 in zips)", "kdb pack refuses it"),
    _duration(ENV_WAIT_TIMEOUT, 60.0),  # waiting for another that compiles the same kernel
    _duration(ENV_LOCK_TIMEOUT, 10.0),  # waiting for another's upgrade lock on a user file
    Setting(ENV_STORE_AT_EXIT, STORE_AT_EXIT[0], STORE_AT_EXIT[0],
            lambda _, raw: parse_store_at_exit(raw), "wait", "'wait' (storing before exit)"),
    _duration(ENV_STORE_TIMEOUT, 120.0),  # an exiting process finishing its background stores
    Setting(ENV_STORE_SHARE, 0.1, "0.1", parse_share, 0.1, "0.1 (the default)"),
    _text(ENV_SHARED_URL, "none (off)", "the shared tier is off, with one warning"),
    _duration(ENV_SHARED_CONNECT_TIMEOUT, 3.0),
    _duration(ENV_SHARED_STATEMENT_TIMEOUT, 5.0),  # one statement, or a lock wait
    _duration(ENV_SHARED_RETRY, 30.0),  # between attempts to reach a server that failed
    Setting(ENV_SHARED_MAX_SIZE, 0, "0 (no cap)", parse_size_setting, 0, "0 (no cap)"),
    Setting(ENV_SHARED_NAMESPACE, None, "unset (one namespace for every node)",
            lambda _, raw: parse_namespace(raw), CHECKED_WHERE_USED,
            "the shared tier is off, with one warning"),
    _text(ENV_TRUSTED_KEYS, "unset (nothing checked)", "a key file others can write is "
          "refused, with one warning"),
    _flag(ENV_REQUIRE_SIGNED, bad_means=True, said="1 (every tier must verify: the safe side)"),
    _text(ENV_SIGNING_KEY, "unset", "a key others can read is refused: nothing is signed"),
    _text(ENV_RUN_REPORT, "unset"),
)}


def read(name: str):
    """The value of the setting ``name`` (a row of :data:`SETTINGS`) from the environment:
    its default when unset or blank; a value kdb cannot use warns once (the command line
    refuses it: :func:`problems`) and reads as the row's fallback."""
    row = SETTINGS[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return row.default
    if row.parse is None or row.fallback is CHECKED_WHERE_USED:
        return raw
    try:
        return row.parse(name, raw)
    except ConfigError as err:
        from . import logs

        logs.warn_once(f"config:{name}={raw}", "kdb: %s; using %s instead", err, row.bad)
        return row.fallback


def flag(name: str, explicit: bool | None = None) -> bool:
    """A boolean setting: ``explicit`` if given, else the variable ``name`` (``1``/``0``...)."""
    return read(name) if explicit is None else bool(explicit)


def max_size(explicit: int | str | None = None) -> int:
    """The user tier's cap in bytes (``KDB_CACHE_MAX_SIZE``); 0 means no cap."""
    if explicit is not None:
        return explicit if isinstance(explicit, int) else parse_size(explicit)
    return read(ENV_CACHE_MAX_SIZE)


def shared_max_size() -> int:
    """The shared tier's cap in stored bytes (``KDB_SHARED_MAX_SIZE``); 0 (the default): none."""
    return read(ENV_SHARED_MAX_SIZE)


def shared_namespace() -> str | None:
    """``KDB_SHARED_NAMESPACE``, checked where the tier connects: a bad name turns it off."""
    return read(ENV_SHARED_NAMESPACE)


def store_timeout(explicit: float | None = None) -> float:
    """Seconds an exiting process spends finishing background stores (``KDB_STORE_TIMEOUT``)."""
    return read(ENV_STORE_TIMEOUT) if explicit is None else float(explicit)


def store_at_exit(explicit: str | None = None) -> str:
    """``detach``: OpenCL stores go to the store worker (:mod:`kdb.storing.spool`) as they happen;
    ``wait``: the process stores them itself, before exit within ``KDB_STORE_TIMEOUT``.
    A bad value falls back to ``wait``, which needs nothing but this process."""
    return read(ENV_STORE_AT_EXIT) if explicit is None else parse_store_at_exit(explicit)


def store_share(explicit: float | None = None) -> float:
    """The share of one core the store worker's floor lane is held to while jobs are queued
    (``KDB_STORE_SHARE``); 0: no floor, its lanes take only idle CPU."""
    return read(ENV_STORE_SHARE) if explicit is None else parse_share(ENV_STORE_SHARE,
                                                                       str(explicit))


def wait_timeout(explicit: float | None = None) -> float:
    """Seconds a process waits for another that compiles the same kernel (``KDB_WAIT_TIMEOUT``)."""
    return read(ENV_WAIT_TIMEOUT) if explicit is None else float(explicit)


def lock_timeout(explicit: float | None = None) -> float:
    """Seconds a process waits for another's schema upgrade of a file (``KDB_LOCK_TIMEOUT``)."""
    return read(ENV_LOCK_TIMEOUT) if explicit is None else float(explicit)


def child_environment(drop: tuple[str, ...] = (), **overrides: str) -> dict[str, str]:
    """The environment a tool kdb runs gets: this process's, less the variables ``drop``
    names, with ``overrides`` set."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(overrides)
    return env


def check_settings() -> None:
    """Read every setting that falls back on a bad value, so that one the store worker will
    read warns here, in the program that set it: the worker's log is where nobody looks."""
    for row in SETTINGS.values():
        if row.parse is not None and row.fallback is not CHECKED_WHERE_USED:
            read(row.name)


def problems(environ: dict[str, str] | None = None) -> list[str]:
    """Every ``KDB_*`` variable set to a value kdb cannot use, one message each: the command
    line refuses to run with any (exit status 2); a program warns once per variable.

    >>> problems({"KDB_WAIT_TIMEOUT": "nan", "KDB_TRACE": "1"})
    ["KDB_WAIT_TIMEOUT='nan' must be a number of seconds from 0 to 86400"]
    """
    env = os.environ if environ is None else environ
    out = []
    for row in SETTINGS.values():
        raw = (env.get(row.name) or "").strip()
        if raw and row.parse is not None:
            try:
                row.parse(row.name, raw)
            except ConfigError as err:
                out.append(str(err))
    return out


def shared_url(explicit: str | None = None) -> str | None:
    """The shared tier's SQLAlchemy URL (``KDB_SHARED_URL``); ``None`` when it is off."""
    url = explicit if explicit is not None else os.environ.get(ENV_SHARED_URL, "")
    return url.strip() or None


def cache_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The user tier's root directory (``KDB_CACHE_DIR``, else the platform's user cache),
    absolute: the store worker runs in ``/``."""
    env = os.environ.get(ENV_CACHE_DIR)
    if explicit is not None or env:
        root = Path(env if explicit is None else explicit).expanduser()
    elif sys.platform == "darwin":
        root = Path(home(), "Library", "Caches", "kdb")
    elif sys.platform == "win32":
        root = Path(os.environ.get("LOCALAPPDATA", os.path.join(home(), "AppData", "Local")),
                    "kdb")
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(home(), ".cache"), "kdb")
    try:  # a deleted working directory leaves a relative root as it is
        return root if root.is_absolute() else Path(os.getcwd(), root)
    except OSError:
        return root


def user_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Directory of the user tier's files, versioned by the on-disk format's major version."""
    return cache_root(explicit) / f"v{FORMAT_MAJOR}"


def system_dirs(explicit: str | os.PathLike[str] | list | tuple | None = None) -> list[Path]:
    """Extra directories searched for ``<arch>.kdb`` (``KDB_SYSTEM_DB_PATH``, os.pathsep list)."""
    if explicit is None:
        explicit = os.environ.get(ENV_SYSTEM_DB_PATH, "")
    parts = ([p for p in str(explicit).split(os.pathsep) if p]
             if isinstance(explicit, (str, os.PathLike)) else [str(p) for p in explicit])
    return [Path(p).expanduser() for p in parts]


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

"""Wrapping a system database in a data-only wheel ``kdb-system-<arch>``.

The wheel holds one package with ``<arch>.kdb`` and an entry point in the group
``kdb.system`` that names it. Installing the wheel is all a user does; kdb finds the file
without importing the package. kdb writes the zip itself, with fixed metadata, so that the
same inputs give the same bytes (``SOURCE_DATE_EPOCH``); ``kdb verify`` compares an
installed file with the digest its wheel's ``RECORD`` holds.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..file.discovery import DEFAULT_PREFIX, GROUP, dist_name
from ..errors import InvalidArgumentError, WheelBuildError

if TYPE_CHECKING:
    from .builtfor import BuiltFor


_VERSION_RE = re.compile(r"^[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?"
                         r"(\+[a-z0-9]+(\.[a-z0-9]+)*)?$")


def check_version(version: str) -> str:
    """``version`` if it is a package version (PEP 440, public part), else raise.

    >>> check_version("2026.11.1"), check_version("1.0.0rc1")
    ('2026.11.1', '1.0.0rc1')
    """
    if not isinstance(version, str) or not _VERSION_RE.match(version):
        raise InvalidArgumentError(f"version {version!r} is not a valid package version "
                                   "(for example 1.0.0, 2026.11.1 or 1.0.0rc1)")
    return version


def module_name(arch: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The importable package name that holds the file.

    >>> module_name("pocl-x86_64-znver3")
    'kdb_system_pocl_x86_64_znver3'
    """
    return re.sub(r"[^a-z0-9_]", "_", dist_name(arch, prefix).lower())


def build_wheel(kdb_file: Path, arch: str, version: str, out_dir: Path,
                dist_prefix: str = DEFAULT_PREFIX, built: BuiltFor | None = None) -> Path:
    """Write ``<module>-<version>-<python>-none-any.whl`` around ``kdb_file``, reproducibly.

    ``built``: what the entries are built for (:mod:`kdb.pack.builtfor`), named in the
    metadata; the Python tag is ``py3`` unless they load into one Python only (``cp311``).

    The same file, arch, version and prefix give the same bytes: entries in a fixed order
    (the package, then ``*.dist-info`` with ``RECORD`` last), every timestamp
    ``SOURCE_DATE_EPOCH`` (1980-01-01, the earliest a zip can hold, when unset), fixed
    permissions and compression. Written here rather than by setuptools through pip, whose
    output carries the build's time and takes seconds to start.
    """
    import zipfile

    from .builtfor import BuiltFor

    built = built or BuiltFor()
    check_version(version)
    kdb_file = Path(kdb_file)
    if kdb_file.name != f"{arch}.kdb":
        raise WheelBuildError(f"{kdb_file} must be named {arch}.kdb")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mod = module_name(arch, dist_prefix)
    info = f"{mod}-{version}.dist-info"
    dist = dist_name(arch, dist_prefix)
    try:
        data = kdb_file.read_bytes()
    except OSError as err:
        raise WheelBuildError(f"cannot read {kdb_file}: {err}") from err
    files = [
        (f"{mod}/__init__.py", f'"""System kernel database for arch {arch} (data only; kdb '
                               f'reads {arch}.kdb)."""\n'.encode()),
        (f"{mod}/{arch}.kdb", data),
        (f"{info}/METADATA", _metadata(dist, version, arch, built).encode()),
        (f"{info}/WHEEL", _WHEEL.format(generator=_generator(),
                                        tag=built.python_tag()).encode()),
        (f"{info}/entry_points.txt", f"[{GROUP}]\n{arch} = {mod}\n".encode()),
        (f"{info}/top_level.txt", f"{mod}\n".encode()),
    ]
    record = "".join(f"{name},sha256={_b64_sha256(body)},{len(body)}\n" for name, body in files)
    files.append((f"{info}/RECORD", (record + f"{info}/RECORD,,\n").encode()))
    stamp = zip_timestamp()
    target = out_dir / f"{mod}-{version}-{built.python_tag()}-none-any.whl"
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        with zipfile.ZipFile(tmp, "w") as z:
            for name, body in files:
                zi = zipfile.ZipInfo(name, date_time=stamp)
                zi.create_system = 3  # Unix, so external_attr holds the mode on every OS
                zi.external_attr = 0o100644 << 16
                zi.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(zi, body, compresslevel=6)
        tmp.replace(target)
    except OSError as err:
        raise WheelBuildError(f"cannot write {target}: {err}") from err
    finally:
        tmp.unlink(missing_ok=True)
    return target


def source_date_epoch() -> int | None:
    """``SOURCE_DATE_EPOCH`` (reproducible-builds.org/specs/source-date-epoch), or None.

    >>> import os; os.environ["SOURCE_DATE_EPOCH"] = "1700000000"; source_date_epoch()
    1700000000
    >>> del os.environ["SOURCE_DATE_EPOCH"]; source_date_epoch() is None
    True
    """
    import os

    text = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"SOURCE_DATE_EPOCH={text!r} is not a whole number of "
                                   "seconds since 1970 (unset it, or set e.g. "
                                   "$(git log -1 --format=%ct))") from None
    if value < 0:
        raise InvalidArgumentError(f"SOURCE_DATE_EPOCH={text!r} is negative")
    if value > LAST_ZIP_TIME:
        raise InvalidArgumentError(f"SOURCE_DATE_EPOCH={text!r} is after 2107-12-31, the last "
                                   "time a zip file (a wheel) can hold")
    return value


#: 2107-12-31 23:59:59 UTC: the last time a zip entry's DOS date and time can hold.
LAST_ZIP_TIME = 4354819199


def zip_timestamp() -> tuple[int, int, int, int, int, int]:
    """The zip entries' time: ``SOURCE_DATE_EPOCH`` in UTC, no earlier than 1980 (zip's
    epoch), as wheel and setuptools clamp it; 1980-01-01 00:00 when unset.

    >>> import os; os.environ["SOURCE_DATE_EPOCH"] = "1700000000"; zip_timestamp()
    (2023, 11, 14, 22, 13, 20)
    >>> os.environ["SOURCE_DATE_EPOCH"] = "0"; zip_timestamp()
    (1980, 1, 1, 0, 0, 0)
    >>> del os.environ["SOURCE_DATE_EPOCH"]
    """
    import time

    epoch = max(source_date_epoch() or 0, 315532800)
    return time.gmtime(epoch)[:6]


def read_record(dist_info: Path) -> dict[str, str]:
    """``{path: "sha256=<urlsafe base64>"}`` from an installed distribution's ``RECORD``."""
    import csv

    out = {}
    with open(Path(dist_info) / "RECORD", encoding="utf-8", newline="") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[1]:
                out[row[0]] = row[1]
    return out


def installed_match(path: Path, dist: str, version: str) -> tuple[bool | None, str]:
    """Whether an installed system file still has the digest its wheel's ``RECORD`` holds:
    ``(True | False, what was compared)``, or ``(None, why it cannot tell)``."""
    path = Path(path)
    site = path.parent.parent
    info = site / f"{dist}-{version}.dist-info"
    try:
        record = read_record(info)
    except OSError as err:
        return None, f"cannot read the RECORD of {dist} {version} ({err})"
    rel = path.relative_to(site).as_posix()
    want = record.get(rel)
    if want is None:
        return None, f"the RECORD of {dist} {version} does not list {rel}"
    try:
        have = record_digest(path)
    except OSError as err:
        return None, f"cannot read {path} ({err})"
    return have == want, f"{rel} against the RECORD of {dist} {version} ({want[:19]}...)"


def record_digest(path: Path) -> str:
    """A file's digest as a wheel's ``RECORD`` spells it."""
    import base64
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode("ascii")


def _b64_sha256(data: bytes) -> str:
    import base64
    import hashlib

    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")


def _generator() -> str:
    from .._version import __version__

    return f"kdb ({__version__})"


def _metadata(dist: str, version: str, arch: str, built: BuiltFor) -> str:
    """The wheel's METADATA: its name, version, arch, and what its entries are for."""
    summary = f"kdb system kernel database for arch {arch} (prebuilt kernel binaries)"
    if built.describe():
        summary += f"; built for {built.describe()}"
    return (f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\nSummary: {summary}\n"
            f"Requires-Python: {built.requires_python()}\n")


_WHEEL = """\
Wheel-Version: 1.0
Generator: {generator}
Root-Is-Purelib: true
Tag: {tag}-none-any
"""

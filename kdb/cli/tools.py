"""What every ``kdb`` command shares: its settings, and printing tables, sizes, times and JSON.

Only the command line prints (:mod:`kdb.cli` and its command modules); the library returns
plain data, formatted here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import click


#: The largest count an option takes (SQLite's largest integer): a larger one is a usage
#: error, not an overflow deep in a query.
MAX_COUNT = 2**63 - 1


@dataclass(frozen=True)
class Settings:
    cache_root: Path
    user_dir: Path
    explicit: bool  # --cache-dir given


def checked_by(check):
    """An option callback: ``check(value)`` passes (its value), or raises an error kdb's
    library raises, made a usage error of the option (status 2, as docs/cli.md says of a
    bad argument; it was status 1, as for a failure)."""
    def callback(ctx: click.Context, param: click.Parameter, value):
        from ..errors import KdbError

        if value is None:
            return None
        try:
            check(value)
        except KdbError as err:
            raise click.BadParameter(str(err)) from None
        return value

    return callback


def checked_arch(ctx: click.Context, param: click.Parameter, value):
    """An ``--arch`` option's value(s), each a valid arch id, else a usage error (status 2)."""
    from .. import config
    from ..errors import UnsafeArchError

    try:
        if isinstance(value, tuple):  # kdb pack's: it resolves 'native' itself
            return tuple(config.check_arch(v) for v in value)
        if value == "native":
            return _native_arch()
        return None if value is None else config.check_arch(value)
    except UnsafeArchError as err:
        raise click.BadParameter(str(err)) from None


def _native_arch() -> str:
    """``--arch native`` of a command that takes one arch: the arch of this machine's OpenCL
    device, when there is exactly one."""
    from ..pack.compiling import opencl_arches

    found = sorted(opencl_arches())
    if len(found) == 1:
        return found[0]
    raise click.BadParameter(
        "'native' stands for the arch of this machine's OpenCL device, and "
        + (f"there are {len(found)}: {', '.join(found)}; give one of them" if found else
           "none is present here; give an arch id (`kdb ls` lists those in the cache)"))


def json_option(func):
    return click.option("--json", "as_json", is_flag=True,
                        help="Print JSON instead of a table.")(func)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def json_or_empty(rows: list, as_json: bool, empty: str) -> bool:
    """Show ``rows`` as JSON, or say ``empty`` when there are none; True when that was all
    (the caller prints its table otherwise)."""
    if as_json:
        emit_json(rows)
        return True
    if not rows:
        click.echo(empty)
        return True
    return False


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def table(headers: Sequence[str], rows: list[Sequence[Any]]) -> None:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for r in [list(headers)] + cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())

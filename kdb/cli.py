"""The ``kdb`` command line: thin commands over :mod:`kdb.report` (open, call, print).

Every command reads the user tier from ``--cache-dir``, else ``KDB_CACHE_DIR``, else the
platform's user cache; system databases from ``KDB_SYSTEM_DB_PATH`` and installed packages.
Library errors (:class:`kdb.KdbError`) become one clean line and a non-zero exit, mapped in
:class:`_Group` and nowhere else.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import click

from . import config, report
from .version import __version__
from .errors import CommandError, KdbError


class _Group(click.Group):
    """Maps library errors to clean messages (exit code 1, no traceback), in one place."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KdbError as err:
            raise click.ClickException(str(err)) from err
        except BrokenPipeError:
            raise
        except (sqlite3.Error, OSError) as err:
            raise click.ClickException(f"{type(err).__name__}: {err}") from err


class _ConfigProblem(click.ClickException):
    """A ``KDB_*`` variable kdb cannot use: a usage error of the command line (status 2)."""

    exit_code = 2


@dataclass(frozen=True)
class _Settings:
    cache_root: Path
    user_dir: Path
    explicit: bool  # --cache-dir given


def _json_option(func):
    return click.option("--json", "as_json", is_flag=True,
                        help="Print JSON instead of a table.")(func)


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _json_or_empty(rows: list, as_json: bool, empty: str) -> bool:
    """Show ``rows`` as JSON, or say ``empty`` when there are none; True when that was all
    (the caller prints its table otherwise)."""
    if as_json:
        _emit_json(rows)
        return True
    if not rows:
        click.echo(empty)
        return True
    return False


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="User tier root (overrides KDB_CACHE_DIR).")
@click.version_option(__version__, prog_name="kdb")
@click.pass_context
def cli(ctx: click.Context, cache_dir: Path | None) -> None:
    """kdb: a database of compiled GPU kernel binaries.

    The user tier lives in <cache dir>/v1/<arch>.kdb (--cache-dir, else KDB_CACHE_DIR);
    read-only system databases come from KDB_SYSTEM_DB_PATH and installed packages.

    \b
    Example:
        kdb info
    """
    bad = config.problems()
    if bad:  # a program warns and goes on; a command says so and does nothing (status 2)
        raise _ConfigProblem("\n".join(bad) + "\nfix or unset the variable(s) and run the "
                             "command again")
    ctx.obj = _Settings(config.cache_root(cache_dir), config.user_dir(cache_dir),
                        cache_dir is not None)


# -- formatting -----------------------------------------------------------------------------

def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _table(headers: Sequence[str], rows: list[Sequence[Any]]) -> None:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for r in [list(headers)] + cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


# -- commands -------------------------------------------------------------------------------

@cli.command()
@_json_option
@click.pass_obj
def info(obj: _Settings, as_json: bool) -> None:
    """Devices, arch ids, and every tier's files with their size and entry count.

    Lists the OpenCL devices (when pyopencl is installed) with their arch ids and compiler,
    the user tier's files, the system databases found, and which device has none.

    \b
    Example:
        kdb info --json
    """
    data = report.info(obj.user_dir, obj.cache_root)
    if as_json:
        _emit_json(data)
        return
    click.echo(f"kdb {data['version']} (schema {data['schema_head']})")
    source = "--cache-dir" if obj.explicit else (
        config.ENV_CACHE_DIR if os.environ.get(config.ENV_CACHE_DIR) else "default")
    click.echo(f"cache root: {data['cache_root']} ({source})"
               + ("  [disabled: KDB_DISABLE_CACHE]" if data["disabled"] else ""))
    click.echo(f"user tier:  {data['user_dir']}")
    if not data["user_files"]:
        click.echo("  (no files yet)")
    for f in data["user_files"]:
        click.echo(f"  {Path(f['path']).name}  rev {f['revision'] or '-'}  "
                   f"{f['entries']} entries  {_bytes(f['size'])}"
                   + (f"  [{f['problem']}]" if f["problem"] else ""))
    _echo_shared(data["shared"])
    _echo_auto(data["auto"])
    click.echo(f"system path ({config.ENV_SYSTEM_DB_PATH}): "
               + (os.pathsep.join(data["system_path"]) or "not set"))
    click.echo("system databases:")
    if not data["system_databases"]:
        click.echo("  (none found)")
    for s in data["system_databases"]:
        size = f"{s['entries']} entries  {_bytes(s['size'])}  " if not s["problem"] else ""
        click.echo(f"  {s['arch']}  {s['path']}  {size}({s['origin']})"
                   + (f"  [BROKEN: {s['problem']}]" if s["problem"] else ""))
    click.echo("OpenCL devices:")
    if data["devices_note"]:
        click.echo(f"  ({data['devices_note']})")
    for d in data["devices"]:
        click.echo(f"  {d['platform']} / {d['device']}")
        if d["problem"]:
            click.echo(f"    problem:   {d['problem']}")
            continue
        click.echo(f"    arch:      {d['arch']}")
        click.echo(f"    compiler:  {d['compiler']}")
        click.echo("    system db: " + ("found" if d["system_db"] else
                                         f"MISSING ({d['arch']}.kdb): kernels compile at "
                                         "first use"))
    _echo_cuda(data["cuda"])


def _echo_shared(shared: dict[str, Any] | None) -> None:
    """The shared tier's lines of ``kdb info`` (its URL comes masked from the library)."""
    if shared is None:
        click.echo(f"shared tier: off ({config.ENV_SHARED_URL} not set)")
        return
    click.echo(f"shared tier: {shared['url']} ({config.ENV_SHARED_URL})")
    if shared["problem"]:
        click.echo(f"  [{shared['problem']}]")
        return
    click.echo(f"  rev {shared['revision'] or '-'}  {shared['entries']} entries  "
               f"{_bytes(shared['stored_bytes'])}  "
               + (", ".join(f"{a}: {v['entries']}" for a, v in shared["arches"].items())
                  or "no arches yet"))


def _echo_auto(auto: dict[str, Any]) -> None:
    raw = auto["variable"]
    meaning = {True: "on", False: "off", None: "not understood: off"}[auto["on"]]
    click.echo(f"{config.ENV_AUTO}: " + ("unset (off)" if raw is None else f"{raw!r} ({meaning})")
               + "; start-up hook: " + (auto["hook"] or "MISSING (reinstall kdb: "
                                        "KDB_AUTO=1 does nothing without it)"))


def _echo_cuda(cuda: dict[str, Any]) -> None:
    click.echo("CUDA toolchain (kdb.cuda):")
    if cuda["nvcc"] is None or cuda["problem"]:
        click.echo(f"  nvcc:      ({cuda['problem']})")
    else:
        click.echo(f"  nvcc:      {cuda['nvcc']} (from {cuda['found_by']})")
        click.echo(f"             {cuda['release']}, toolkit {cuda['toolkit']}")
    nv = cuda.get("nvrtc") or {}
    if nv.get("path") and not nv.get("problem"):
        click.echo(f"  nvrtc:     {nv['path']} (from {nv['found_by']})")
        click.echo(f"             NVRTC {nv['version']}")
    else:
        click.echo(f"  nvrtc:     ({nv.get('problem', 'not checked')})")
    default = cuda.get("default")
    click.echo("  compiles:  " + (f"with {default} (compiler=None)" if default else
                                  "nothing: no compiler; stored builds are served (newest "
                                  "compiler first)"))
    click.echo(f"  arches:    {' '.join(cuda['arches']) or '(none listed)'}")
    click.echo(f"  system db: {' '.join(cuda['system_db']) or 'none for these arches'}")
    click.echo("  pycuda:    " + ("installed" if cuda["pycuda"] else
                                  "not installed (loading needs pip install 'kdb[pycuda]')"))


@cli.command("ls")
@click.option("--arch", default=None, help="Only this arch id.")
@click.option("--tier", type=click.Choice(["user", "system"]), default=None,
              help="Only this tier.")
@_json_option
@click.pass_obj
def ls_(obj: _Settings, arch: str | None, tier: str | None, as_json: bool) -> None:
    """List stored kernels: key, name, arch, back end, sizes, hits, last access, created.

    \b
    Example:
        kdb ls --arch pocl-x86_64-znver3 --tier user
    """
    rows = report.entries(obj.user_dir, arch, tier)
    if _json_or_empty(rows, as_json, "no entries"):
        return
    _table(["KEY", "NAME", "ARCH", "BACKEND", "TIER", "RAW", "STORED", "HITS",
            "LAST ACCESS", "CREATED"],
           [[r["key"][:12], _cut(r["name"] or "-", 32), r["arch"], r["backend"], r["tier"],
             _bytes(r["raw_size"]), _bytes(r["stored_size"]), r["hits"],
             _when(r["last_access"]), _when(r["created"])] for r in rows])


@cli.command()
@click.option("--arch", default=None, help="Only this arch id.")
@_json_option
@click.pass_obj
def stats(obj: _Settings, arch: str | None, as_json: bool) -> None:
    """Hits per tier, misses, compiles, seconds compiling and saved, sizes; per arch and total.

    \b
    Example:
        kdb stats --json
    """
    data = report.stats(obj.user_dir, arch)
    if as_json:
        _emit_json(data)
        return

    def row(name: str, s: dict[str, Any]) -> list[Any]:
        return [name, s["hits"]["system"], s["hits"]["user"], s["misses"], s["compiles"],
                f"{s['compile_seconds']:.2f}", f"{s['saved_seconds']:.2f}", s["entries"],
                s["system_entries"], _bytes(s["stored_bytes"]), _bytes(s["raw_bytes"]),
                s["evicted"]]

    _table(["ARCH", "HITS SYSTEM", "HITS USER", "MISSES", "COMPILES", "COMPILE S", "SAVED S",
            "ENTRIES", "SYSTEM ENTRIES", "STORED", "RAW", "EVICTED"],
           [row(a, s) for a, s in data["arches"].items()] + [row("total", data)])
    click.echo(f"cap: {_bytes(data['cap'])} per user file ({config.ENV_CACHE_MAX_SIZE}); "
               "least recently used entries are evicted past it" if data["cap"] else
               f"cap: none ({config.ENV_CACHE_MAX_SIZE}=0)")
    shared = data.get("shared")
    if shared is not None:
        click.echo(f"shared tier {shared['url']}: " + (
            f"{shared['entries']} entries, {_bytes(shared['stored_bytes'])} stored, "
            f"{shared['hits']} hits and {shared['compiles']} compiles by every node, "
            f"{shared['hits_here']} hits here" if not shared["problem"]
            else shared["problem"]))


@cli.command("log")
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True,
              help="Most recent compiles to show.")
@click.option("--arch", default=None, help="Only this arch id.")
@_json_option
@click.pass_obj
def log_(obj: _Settings, limit: int, arch: str | None, as_json: bool) -> None:
    """The start-up latency log: every compile kdb performed, newest first.

    \b
    Example:
        kdb log --limit 20 --json
    """
    rows = report.compile_log(obj.user_dir, limit, arch)
    if _json_or_empty(rows, as_json, "no compiles recorded"):
        return
    _table(["WHEN", "NAME", "ARCH", "SECONDS", "MISSED", "REASON", "PID", "KEY"],
           [[_when(r["at"]), _cut(r["name"] or "-", 32), r["arch"], f"{r['seconds']:.3f}",
             ",".join(r["missed"]) or "-",
             (r["reason"] or "-") + (" (binary not stored yet)" if r.get("pending") else ""),
             r["pid"], r["key"][:12]]
            for r in rows])


@cli.command()
@click.argument("key_or_name")
@click.option("--nearest", type=click.IntRange(min=1), default=5, show_default=True,
              help="How many nearest stored entries to show.")
@_json_option
@click.pass_obj
def explain(obj: _Settings, key_or_name: str, nearest: int, as_json: bool) -> None:
    """Why a kernel missed: its compiles, and the nearest stored entries with what differs.

    KEY_OR_NAME is a key prefix (from `kdb ls` or `kdb log`) or a kernel name.

    \b
    Example:
        kdb explain 3f2a9c41
    """
    data = report.explain(obj.user_dir, key_or_name, nearest)
    if as_json:
        _emit_json(data)
        return
    click.echo(f"kernel:   {data['name'] or '-'}  (key {data['key'][:16]}, arch {data['arch']}, "
               f"back end {data['backend']})")
    for e in data["entries"]:
        click.echo(f"stored:   {e['tier']} tier, {e['path']}, created {_when(e['created'])}, "
                   f"{e['hits']} hits")
    if not data["entries"]:
        click.echo("stored:   no (the compile's binary was not stored)")
    recs = data["compiles"]
    if recs:
        r = recs[0]
        click.echo(f"compiled: {len(recs)} time(s); latest {_when(r['at'])}, {r['seconds']:.3f} s "
                   f"by pid {r['pid']}, missed {','.join(r['missed']) or '-'}: "
                   f"{r['reason'] or '-'}")
    else:
        click.echo("compiled: no compile recorded for this key (it was stored by a put or "
                   "a package)")
    details = data["entry"]["details"] if data["entry"] else None
    if details:
        click.echo("details:  " + "\n          ".join(
            f"{k}: {v}" for k, v in (details.items() if isinstance(details, dict)
                                     else [("", details)])))
    click.echo(f"why:      {data['why']}")
    free = data.get("without_compiler")
    if free:
        click.echo(f"no compiler: a process with no CUDA compiler installed is served "
                   f"{free['served'][:16]}, built by {free['built_by']} (newest of "
                   f"{len(free['builds'])} build(s) that differ only in the compiler)")
    near = data["nearest"]
    if not near:
        click.echo(f"nearest:  none: no other entry named {data['name']!r} or for "
                   f"{data['backend']} on {data['arch']} (it was never compiled before)")
    else:
        click.echo(f"nearest stored entries ({len(near)} of {data['candidates']}):")
        for e in near:
            head = (f"  {e['key'][:12]}  {e['name'] or '-'}  {e['tier']}  "
                    f"created {_when(e['created'])}")
            if e["differs"] is None:
                click.echo(head + "  (attributes of this compile unknown)")
                continue
            click.echo(head + f"  differs in {len(e['differs'])}: "
                       + ", ".join(e["differs"]))
            for k, how in e["differs"].items():
                click.echo(f"      {k}: {how}")
    if data["other_matches"]:
        click.echo(f"also matching {key_or_name!r}: "
                   + ", ".join(k[:12] for k in data["other_matches"][:8])
                   + (" ..." if len(data["other_matches"]) > 8 else ""))


@cli.command()
@click.option("--arch", default=None, help="Only this arch id's files.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@_json_option
@click.pass_obj
def clear(obj: _Settings, arch: str | None, yes: bool, as_json: bool) -> None:
    """Delete the user tier's files (all, or one arch's). System databases are never touched.

    \b
    Example:
        kdb clear --arch pocl-x86_64-znver3 --yes
    """
    paths = report.clearable(obj.user_dir, arch)
    if not paths:
        if as_json:
            _emit_json({"user_dir": str(obj.user_dir), "removed": [], "failed": []})
        else:
            click.echo(f"nothing to clear in {obj.user_dir}")
        return
    for p in paths:
        click.echo(f"  {p}", err=as_json)
    if not yes:  # with --json the listing and the question go to stderr
        click.confirm(f"Delete these {len(paths)} file(s)?", abort=True, err=as_json)
    removed, failed = report.clear(paths)
    if as_json:
        _emit_json({"user_dir": str(obj.user_dir), "removed": removed,
                    "failed": [{"path": p, "error": e} for p, e in failed]})
    else:
        click.echo(f"removed {len(removed)} file(s) from {obj.user_dir}")
        for p, e in failed:
            click.echo(f"could not remove {p}: {e}", err=True)
    if failed:
        click.get_current_context().exit(1)


@cli.command()
@click.option("--repair", is_flag=True,
              help="Drop bad entries from user files, recompute their totals, move aside a "
                   "user file that cannot be repaired. System files are never changed.")
@click.option("--arch", default=None, help="Only this arch id's files.")
@_json_option
@click.pass_context
def verify(ctx: click.Context, repair: bool, arch: str | None, as_json: bool) -> None:
    """Check every tier's files: integrity, schema revision, and every entry's checksum.

    Each entry must decode to its checksum, hold JSON attributes whose sha256 is its key,
    and belong to its file's arch; each file's running totals must match its entries.
    Exits with status 1 when anything is wrong (after --repair: when anything is left).

    \b
    Example:
        kdb verify --repair
    """
    obj: _Settings = ctx.obj
    data = report.verify(obj.user_dir, arch, repair=repair)
    if as_json:
        _emit_json(data)
    else:
        for f in data["files"]:
            state = "ok" if f["ok"] else "BAD"
            click.echo(f"{state:3}  {f['path']}  ({f['tier']}, {f['entries']} entries"
                       + (f", rev {f['revision']}" if f["revision"] else "") + ")")
            for text in f["problems"]:
                click.echo(f"     problem: {text}")
            for b in f["bad_entries"][:20]:
                click.echo(f"     bad entry {b['key'][:16]} ({b['name'] or '-'}): "
                           f"{b['problem']}")
            if len(f["bad_entries"]) > 20:
                click.echo(f"     ... and {len(f['bad_entries']) - 20} more bad entries")
            for text in f["notes"]:
                click.echo(f"     note: {text}")
            for text in f["repaired"]:
                click.echo(f"     repaired: {text}")
        if not data["files"]:
            click.echo(f"no kdb files found (user tier {obj.user_dir})")
        bad = sum(1 for f in data["files"] if not f["ok"])
        click.echo(f"{len(data['files'])} file(s), {data['entries']} entries: "
                   + ("all sound" if data["ok"] else
                      f"{bad} file(s) with problems, {data['bad_entries']} bad entries"
                      + ("" if repair else "; `kdb verify --repair` fixes user files")))
    if not data["ok"]:
        ctx.exit(1)


@cli.command()
@click.option("--to", "size", required=True, metavar="SIZE",
              help="Stored bytes to keep per user file: bytes or a suffix (500M, 2G); 0 "
                   "empties the files.")
@click.option("--arch", default=None, help="Only this arch id's file.")
@_json_option
@click.pass_context
def evict(ctx: click.Context, size: str, arch: str | None, as_json: bool) -> None:
    """Remove least recently used entries until each user file stores at most SIZE.

    The cap KDB_CACHE_MAX_SIZE does this on every insert that would pass it; this command
    does it now, to any size. Recency is the entries' last access, kept in the database.

    \b
    Example:
        kdb evict --to 200M
    """
    obj: _Settings = ctx.obj
    try:
        target = config.parse_size(size)
    except KdbError as err:
        raise click.BadParameter(str(err), param_hint="'--to'") from err
    rows = report.evict(obj.user_dir, target, arch)
    if as_json:
        _emit_json(rows)
    elif not rows:
        click.echo(f"no user files in {obj.user_dir}")
    else:
        _table(["FILE", "REMOVED", "FREED", "ENTRIES LEFT", "STORED LEFT"],
               [[r["path"], r["removed"], _bytes(r["freed"]), r["entries"],
                 _bytes(r["stored_bytes"])] for r in rows])
        for r in rows:
            if r["problem"]:
                click.echo(f"{r['path']}: {r['problem']}", err=True)
    if any(r["problem"] for r in rows):
        ctx.exit(1)  # a file that could not be brought under SIZE


@cli.command("migrate")
@click.option("--check", is_flag=True,
              help="Only report; exit with status 1 if a file needs an upgrade.")
@_json_option
@click.pass_context
def migrate_(ctx: click.Context, check: bool, as_json: bool) -> None:
    """Upgrade every user file to this kdb's schema revision (alembic).

    Files are also upgraded on their next write; this does it now, for all of them.
    Exits with status 1 when a file was skipped (unreadable, from a newer kdb, or locked
    by a stuck upgrader), and with --check when one needs an upgrade.

    \b
    Example:
        kdb migrate --check
    """
    obj: _Settings = ctx.obj
    rows = report.migrate_files(obj.user_dir, check)
    if as_json:
        _emit_json(rows)
    elif not rows:
        click.echo(f"no user files in {obj.user_dir}")
    else:
        for r in rows:
            change = (f"{r['from']} -> {r['to']}" if r["from"] != r["to"]
                      else f"{r['from'] or '-'}")
            click.echo(f"{r['path']}: {change} {r['action']}"
                       + (f" ({r['problem']})" if r["problem"] else ""))
    if any(r["action"] == "skipped" for r in rows):
        ctx.exit(1)  # a file this kdb could not bring to its revision
    if check and any(r["action"] == "needs upgrade" for r in rows):
        ctx.exit(1)


@cli.command()
@click.option("--kernels", type=click.IntRange(min=1), default=None,
              help="How many programs to build (default: the demo's full set).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Also write the results as JSON to this file.")
@click.option("--keep", is_flag=True, help="Keep the demo's temporary kdb cache.")
@click.pass_context
def demo(ctx: click.Context, kernels: int | None, json_out: str | None, keep: bool) -> None:
    """Run real OpenCL kernels in fresh processes, cold then warm, and print the speed-up.

    The cache is --cache-dir, else KDB_CACHE_DIR, else a temporary directory.

    \b
    Example:
        kdb demo --json demo.json
    """
    try:
        from .demo import main as demo_main
    except ImportError as err:
        raise click.ClickException(f"kdb demo is not available here: {err}") from err
    obj: _Settings = ctx.obj
    extra: dict[str, Any] = {}
    if obj.explicit:
        extra["cache_dir"] = str(obj.cache_root)
    if keep:
        extra["keep"] = True
    ctx.exit(demo_main(kernels=kernels, json_out=json_out, **extra) or 0)


# -- pack -----------------------------------------------------------------------------------

class _PackProgress:
    """Progress of ``kdb pack`` on stderr: a bar on a terminal, plain lines elsewhere."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.arch = ""
        self.start = time.perf_counter()
        self.bar: Any = None

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.render_finish()
            self.bar = None

    def step(self, arch: str, what: str) -> None:
        self._close_bar()
        if arch != self.arch:
            self.arch, self.start = arch, time.perf_counter()
        click.echo(f"{arch}: {what}", err=True)

    def kernels(self, done: int, total: int, name: str) -> None:
        """``done`` of ``total`` kernels built; ``name`` is being built now ('' at the end)."""
        elapsed = time.perf_counter() - self.start
        if not self.tty:
            if done < total:
                click.echo(f"  [{done + 1}/{total}] {name}  ({elapsed:.1f} s elapsed)", err=True)
            elif name:
                click.echo(f"  {total}/{total} built; {name}  ({elapsed:.1f} s elapsed)",
                           err=True)
            else:
                click.echo(f"  {total}/{total} kernels done in {elapsed:.1f} s", err=True)
            return
        if self.bar is None:
            self.bar = click.progressbar(length=total, label=f"  {self.arch}", file=sys.stderr,
                                         show_pos=True, show_eta=False,
                                         item_show_func=lambda item: item)
            self.bar.__enter__()
        item = f"{name or 'done'}  {elapsed:.1f} s"
        if done > self.bar.pos:
            self.bar.update(done - self.bar.pos, item)
        else:  # update() does not redraw for zero steps
            self.bar.current_item = item
            self.bar.render_progress()
        if done >= total and not name:
            self._close_bar()

    def close(self) -> None:
        self._close_bar()


@cli.command("pack")
@click.option("--arch", "arches", multiple=True, required=True, metavar="ARCH",
              help="Arch id to pack for (repeatable); 'native' = the arches of the OpenCL "
                   "devices present.")
@click.option("--manifest", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="TOML manifest of the kernels to compile (see prebuilt/demo.toml).")
@click.option("--from-db", "from_db", is_flag=False, flag_value="", default=None,
              metavar="[PATH_OR_URL]",
              help="Copy every entry of a user database: a .kdb file, a cache directory, "
                   "a sqlite:/// or file:/// URL, or the shared tier's URL "
                   "(postgresql+psycopg://...); with no value, the user tier.")
@click.option("--from-log", is_flag=True,
              help="Copy exactly the kernels of the start-up latency log (`kdb log`) of the "
                   "user tier, or of the --from-db database.")
@click.option("--version", "pkg_version", default=None, metavar="VERSION",
              help="Version of the wheels (e.g. 1.0.0). Without it only the .kdb files are "
                   "written (for KDB_SYSTEM_DB_PATH).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the <arch>.kdb files and the wheels.")
@click.option("--name", "dist_prefix", default="kdb-system", show_default=True,
              metavar="PREFIX", help="Wheel name prefix: wheels are <prefix>-<arch>. A framework shipping its "
                   "own kernels picks its own, so its wheel installs beside kdb's.")
@click.option("--keep-going", is_flag=True,
              help="Pack the other kernels when one fails to compile (the exit status is "
                   "still 1).")
@_json_option
@click.pass_context
def pack_(ctx: click.Context, arches: tuple[str, ...], manifest: Path | None,
          from_db: str | None, from_log: bool, pkg_version: str | None, out_dir: Path,
          dist_prefix: str, keep_going: bool, as_json: bool) -> None:
    """Build read-only system databases <arch>.kdb and their wheels <prefix>-<arch>.

    Kernels come from exactly one of: a manifest (compiled here: OpenCL kernels on the
    device, so the arch must be present; CUDA kernels by nvcc or NVRTC for any sm_XX, no GPU
    needed), a user database (--from-db), or the start-up latency log (--from-log).
    Files are written at the head schema revision with journal_mode=DELETE, vacuumed, and
    read back read-only. Installing a wheel is all a user does; kdb finds its file through
    the entry point group kdb.system. Every system database found for an arch serves:
    KDB_SYSTEM_DB_PATH directories in order, then packages by name; the first that holds a
    key answers. Progress goes to stderr, the summary to stdout. Two packs of the same
    inputs write byte-identical files and wheels; SOURCE_DATE_EPOCH sets their time stamps
    (0 when unset).

    A kernel that fails to compile is reported by name with its build log and stops the
    pack (exit status 1). With --keep-going the others are packed, the files and wheels
    written, the failures listed, and the exit status is still 1, so that a build script
    cannot ship an incomplete set unnoticed. Exit status 0 means every kernel was packed.

    \b
    Example:
        kdb pack --arch native --manifest prebuilt/demo.toml --version 1.0.0 --out dist
        kdb pack --arch pocl-x86_64-znver3 --from-log --out sysdb
    """
    from . import pack as packing

    obj: _Settings = ctx.obj
    if manifest is not None and (from_db is not None or from_log):
        raise click.UsageError("give --manifest, or --from-db / --from-log, not both")
    if manifest is None and from_db is None and not from_log:
        raise click.UsageError("give one input: --manifest FILE, --from-db [PATH_OR_URL] or "
                               "--from-log")
    source: str | None = None
    if from_db is not None or from_log:
        source = from_db or str(obj.cache_root)  # no value: this command's user tier
    progress = _PackProgress()
    try:
        results = packing.pack(list(arches), out_dir=out_dir, version=pkg_version,
                               manifest=manifest, from_db=source, from_log=from_log,
                               keep_going=keep_going, dist_prefix=dist_prefix,
                               progress=progress.kernels, on_step=progress.step)
    finally:
        progress.close()
    failed = [(r.arch, name, log) for r in results for name, log in r.failures]
    if as_json:
        _emit_json([{"arch": r.arch, "file": str(r.path), "entries": r.entries,
                     "raw_bytes": r.raw_bytes, "stored_bytes": r.stored_bytes,
                     "file_size": r.file_size, "wheel": str(r.wheel) if r.wheel else None,
                     "wheel_size": r.wheel.stat().st_size if r.wheel else None,
                     "seconds": r.seconds, "missing_keys": r.missing,
                     "failures": [{"kernel": n, "reason": why} for n, why in r.failures]}
                    for r in results])
    else:
        _table(["ARCH", "FILE", "ENTRIES", "RAW", "STORED", "FILE SIZE", "WHEEL", "WHEEL SIZE",
                "SECONDS"],
               [[r.arch, r.path.name, r.entries, _bytes(r.raw_bytes), _bytes(r.stored_bytes),
                 _bytes(r.file_size), r.wheel.name if r.wheel else "-",
                 _bytes(r.wheel.stat().st_size) if r.wheel else "-", f"{r.seconds:.1f}"]
                for r in results])
        click.echo(f"written to {out_dir}")
        if pkg_version is None:
            click.echo("no --version given: no wheels built; put the directory in "
                       f"{config.ENV_SYSTEM_DB_PATH} to use the files")
    for r in results:
        if r.missing:
            click.echo(f"warning: {r.arch}: {len(r.missing)} logged kernel(s) have no stored "
                       "binary and were left out: " + ", ".join(k[:12] for k in r.missing),
                       err=True)
    for arch, name, why in failed:
        click.echo(f"FAILED: kernel {name!r} ({arch}): "
                   + "\n  | ".join(why.rstrip().splitlines()), err=True)
    if failed:
        click.echo(f"error: {len(failed)} kernel(s) could not be packed and were left out: "
                   + ", ".join(f"{n} ({a})" for a, n, _ in failed), err=True)
        ctx.exit(1)


@cli.command("run", context_settings={"ignore_unknown_options": True,
                                      "allow_interspersed_args": False})
@click.option("--cache-dir", "run_cache_dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="User tier root for the command (sets KDB_CACHE_DIR for it).")
@click.option("--json", "as_json", is_flag=True,
              help="End with one JSON line on stderr instead of the summary line.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_context
def run_command(ctx: click.Context, run_cache_dir: Path | None, as_json: bool,
                command: tuple[str, ...]) -> None:
    """Run COMMAND with kdb on for it and every process it starts (KDB_AUTO=1).

    Stdin, stdout, stderr and the exit status are the command's; signals sent to kdb run
    are passed on. At the end, one line on stderr: kernels requested, compiled, served per
    tier, seconds compiling and seconds saved, added up over every process that used kdb.

    \b
    Example:
        kdb run -- mpirun -n 8 python app.py
    """
    from . import run as running
    from . import tally

    obj: _Settings = ctx.obj
    cache_dir = run_cache_dir or (obj.cache_root if obj.explicit else None)
    try:
        status, summary = running.run(command, cache_dir)
    except CommandError as err:  # a shell's status (127, 126), not the usual 1
        click.echo(f"Error: {err}", err=True)
        ctx.exit(err.exit_status)
    if as_json:
        click.echo(json.dumps({"exit_status": status, **summary}), err=True)
    else:
        click.echo(f"kdb run: {tally.describe(summary)}; {summary['processes']} process(es) "
                   f"used kdb; exit status {status}", err=True)
    ctx.exit(status)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``kdb`` script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="kdb")


if __name__ == "__main__":  # pragma: no cover
    main()

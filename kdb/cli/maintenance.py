"""The ``kdb`` commands that change the user tier: ``clear``, ``verify [--repair]``, ``evict``,
``migrate`` (over :mod:`kdb.admin.maintenance`; ``verify`` without ``--repair`` only reads)."""

from __future__ import annotations

import click

from .. import config
from ..admin import maintenance
from .tools import Settings, checked_arch, emit_json, human_bytes, json_option, table
from ..errors import KdbError




@click.command()
@click.option("--arch", default=None, callback=checked_arch, help="Only this arch id's files.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_obj
def clear(obj: Settings, arch: str | None, yes: bool, as_json: bool) -> None:
    """Delete the user tier's files (all, or one arch's). System databases are never touched.

    Without --arch it also removes what running kdb leaves behind: every queued store and
    its marks (a program's next run compiles it again), spool directories no store worker
    uses, claim files of processes that have exited, and the store times recorded per
    device. Programs running meanwhile go on: each makes a new file on its next write.

    \b
    Example:
        kdb clear --arch pocl-x86_64-znver3 --yes
    """
    paths = maintenance.clearable(obj.user_dir, arch)
    if not paths:
        if as_json:
            emit_json({"user_dir": str(obj.user_dir), "removed": [], "failed": []})
        else:
            click.echo(f"nothing to clear in {obj.user_dir}")
        return
    for p in paths:
        click.echo(f"  {p}", err=as_json)
    if not yes:  # with --json the listing and the question go to stderr
        try:
            confirmed = click.confirm(f"Delete these {len(paths)} file(s)?", err=as_json)
        except click.Abort:  # no answer: stdin closed (no terminal), or Ctrl-C
            confirmed = False
        if not confirmed:
            if as_json:  # stdout is JSON also when nothing was done
                emit_json({"user_dir": str(obj.user_dir), "removed": [], "failed": [],
                           "aborted": True})
            raise click.Abort()
    removed, failed = maintenance.clear(paths)
    if as_json:
        emit_json({"user_dir": str(obj.user_dir), "removed": removed,
                    "failed": [{"path": p, "error": e} for p, e in failed]})
    else:
        click.echo(f"removed {len(removed)} file(s) from {obj.user_dir}")
        for p, e in failed:
            click.echo(f"could not remove {p}: {e}", err=True)
    if failed:
        click.get_current_context().exit(1)


@click.command()
@click.option("--repair", is_flag=True,
              help="Drop bad entries from user files, recompute their totals, move aside a "
                   "user file that cannot be repaired. System files are never changed.")
@click.option("--arch", default=None, callback=checked_arch, help="Only this arch id's files.")
@json_option
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
    obj: Settings = ctx.obj
    data = maintenance.verify(obj.user_dir, arch, repair=repair)
    if as_json:
        emit_json(data)
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
                      + _next_step(data["files"], repair)))
    if not data["ok"]:
        ctx.exit(1)


def _next_step(files: list[dict], repaired: bool) -> str:
    """What to do about the files ``kdb verify`` found wrong: a repair where one helps, an
    upgrade of kdb for a file a newer kdb wrote (a repair leaves those alone)."""
    bad = [f for f in files if not f["ok"]]
    out = ""
    if not repaired and any(f["tier"] == "user" and not f.get("future") and not f.get("unsafe")
                            for f in bad):
        out += "; `kdb verify --repair` fixes user files"
    if any(f.get("future") for f in bad):
        out += "; files from a newer kdb: upgrade kdb (pip install -U kdb)"
    return out


@click.command()
@click.option("--to", "size", required=True, metavar="SIZE",
              help="Stored bytes to keep per user file: bytes or a suffix (500M, 2G); 0 "
                   "empties the files.")
@click.option("--arch", default=None, callback=checked_arch, help="Only this arch id's file.")
@json_option
@click.pass_context
def evict(ctx: click.Context, size: str, arch: str | None, as_json: bool) -> None:
    """Remove least recently used entries until each user file stores at most SIZE.

    The cap KDB_CACHE_MAX_SIZE does this on every insert that would pass it; this command
    does it now, to any size. Recency is the entries' last access, kept in the database.

    \b
    Example:
        kdb evict --to 200M
    """
    obj: Settings = ctx.obj
    try:
        target = config.parse_size(size)
    except KdbError as err:
        raise click.BadParameter(str(err), param_hint="'--to'") from err
    rows = maintenance.evict(obj.user_dir, target, arch)
    if as_json:
        emit_json(rows)
    elif not rows:
        click.echo(f"no user files in {obj.user_dir}")
    else:
        table(["FILE", "REMOVED", "FREED", "ENTRIES LEFT", "STORED LEFT"],
               [[r["path"], r["removed"], human_bytes(r["freed"]), r["entries"],
                 human_bytes(r["stored_bytes"])] for r in rows])
        for r in rows:
            if r["problem"]:
                click.echo(f"{r['path']}: {r['problem']}", err=True)
    if any(r["problem"] for r in rows):
        ctx.exit(1)  # a file that could not be brought under SIZE


@click.command("migrate")
@click.option("--check", is_flag=True,
              help="Only report; exit with status 1 if a file needs an upgrade.")
@json_option
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
    obj: Settings = ctx.obj
    rows = maintenance.migrate_files(obj.user_dir, check)
    if as_json:
        emit_json(rows)
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

"""The ``kdb`` commands that read what is stored: ``ls``, ``stats``, ``log``, ``explain``."""

from __future__ import annotations

from typing import Any

import click

from .. import config
from ..bookkeeping import UNCACHED
from ..admin import report
from .tools import MAX_COUNT, Settings, checked_arch, cut, emit_json, human_bytes, json_option, json_or_empty, table, when
from ..admin.explain import explain as explain_of




@click.command("ls")
@click.option("--arch", default=None, callback=checked_arch, help="Only this arch id.")
@click.option("--tier", type=click.Choice(["user", "system"]), default=None,
              help="Only this tier.")
@json_option
@click.pass_obj
def ls_(obj: Settings, arch: str | None, tier: str | None, as_json: bool) -> None:
    """List stored kernels: key, name, arch, back end, sizes, hits, last access, created.

    \b
    Example:
        kdb ls --arch pocl-x86_64-znver3 --tier user
    """
    rows = report.entries(obj.user_dir, arch, tier)
    if json_or_empty(rows, as_json, _nothing_stored(obj, arch, tier) if not rows else ""):
        return
    table(["KEY", "NAME", "ARCH", "BACKEND", "TIER", "RAW", "STORED", "HITS",
            "LAST ACCESS", "CREATED"],
           [[r["key"][:12], cut(r["name"] or "-", 32), r["arch"], r["backend"], r["tier"],
             human_bytes(r["raw_size"]), human_bytes(r["stored_size"]), r["hits"],
             when(r["last_access"]), when(r["created"])] for r in rows])


def _nothing_stored(obj: Settings, arch: str | None, tier: str | None) -> str:
    """What ``kdb ls`` says when nothing matched: where it looked, and (for an arch with
    nothing stored) the arches that have entries, since a mistyped arch id looks the same."""
    where = {"user": f"the user tier ({obj.user_dir})", "system": "the system databases"}.get(
        tier or "", f"the user tier ({obj.user_dir}) or the system databases")
    if arch is None:
        return f"no entries in {where}"
    stored = sorted({r["arch"] for r in report.entries(obj.user_dir, None, tier)})
    return (f"no entries for arch {arch!r} in {where}; "
            + (f"entries are stored for: {', '.join(stored)}" if stored else "none for any arch")
            + " (`kdb info` shows each device's arch id)")


@click.command()
@click.option("--arch", default=None, callback=checked_arch, help="Only this arch id.")
@json_option
@click.pass_obj
def stats(obj: Settings, arch: str | None, as_json: bool) -> None:
    """Hits per tier, misses, compiles, seconds compiling and saved, sizes; per arch and total.

    A compile counts once it happened, its binary stored or not; stores still queued for
    the store worker are shown as pending (programs, entries, the oldest's age).

    \b
    Example:
        kdb stats --json
    """
    data = report.stats(obj.user_dir, arch)
    if as_json:
        emit_json(data)
        return

    def row(name: str, s: dict[str, Any]) -> list[Any]:
        return [name, s["hits"]["system"], s["hits"]["user"], s["misses"], s["compiles"],
                f"{s['compile_seconds']:.2f}", f"{s['saved_seconds']:.2f}", s["entries"],
                s["system_entries"], human_bytes(s["stored_bytes"]), human_bytes(s["raw_bytes"]),
                s["evicted"]]

    table(["ARCH", "HITS SYSTEM", "HITS USER", "MISSES", "COMPILES", "COMPILE S", "SAVED S",
            "ENTRIES", "SYSTEM ENTRIES", "STORED", "RAW", "EVICTED"],
           [row(a, s) for a, s in data["arches"].items()] + [row("total", data)])
    pending = data["pending"]
    click.echo(f"pending stores: {pending['programs']} programs ({pending['entries']} entries) "
               f"queued in the spool, oldest {pending['oldest_seconds']:.0f} s"
               if pending["programs"] else "pending stores: none")
    click.echo(f"cap: {human_bytes(data['cap'])} per user file ({config.ENV_CACHE_MAX_SIZE}); "
               "least recently used entries are evicted past it" if data["cap"] else
               f"cap: none ({config.ENV_CACHE_MAX_SIZE}=0)")
    shared = data.get("shared")
    if shared is not None:
        where = shared["url"] + (f" (namespace {shared['namespace']})"
                                 if shared.get("namespace") else "")
        click.echo(f"shared tier {where}: " + (
            f"{shared['entries']} entries, {human_bytes(shared['stored_bytes'])} stored, "
            f"{shared['hits']} hits and {shared['compiles']} compiles by every node, "
            f"{shared['hits_here']} hits here"
            + (f", {shared['evicted']} evicted" if shared.get("evicted") else "")
            if not shared["problem"]
            else shared["problem"]))


@click.command("log")
@click.option("--limit", type=click.IntRange(min=0, max=MAX_COUNT), default=50, show_default=True,
              help="Most recent compiles to show (0: all).")
@click.option("--arch", default=None, callback=checked_arch, help="Only this arch id.")
@json_option
@click.pass_obj
def log_(obj: Settings, limit: int, arch: str | None, as_json: bool) -> None:
    """The start-up latency log: every compile kdb performed, newest first.

    A compile is shown once its process has exited; one whose store is still queued for
    the store worker is marked "binary not stored yet".

    \b
    Example:
        kdb log --limit 20 --json
    """
    rows = report.compile_log(obj.user_dir, limit or None, arch)  # 0 showed none
    if json_or_empty(rows, as_json, "no compiles recorded"):
        return
    table(["WHEN", "NAME", "ARCH", "SECONDS", "MISSED", "REASON", "PID", "KEY"],
           [[when(r["at"]), cut(r["name"] or "-", 32), r["arch"], f"{r['seconds']:.3f}",
             ",".join(r["missed"]) or "-",
             (r["reason"] or "-") + (" (binary not stored yet)" if r.get("pending") else ""),
             r["pid"], r["key"][:12]]
            for r in rows])


@click.command()
@click.argument("key_or_name")
@click.option("--nearest", type=click.IntRange(min=1, max=MAX_COUNT), default=5, show_default=True,
              help="How many nearest stored entries to show.")
@json_option
@click.pass_obj
def explain(obj: Settings, key_or_name: str, nearest: int, as_json: bool) -> None:
    """Why a kernel missed: its compiles, and the nearest stored entries with what differs.

    KEY_OR_NAME is a key prefix (from `kdb ls` or `kdb log`) or a kernel name.

    \b
    Example:
        kdb explain 3f2a9c41
    """
    data = explain_of(obj.user_dir, key_or_name, nearest)
    if as_json:
        emit_json(data)
        return
    click.echo(f"kernel:   {data['name'] or '-'}  (key {data['key'][:16]}, arch {data['arch']}, "
               f"back end {data['backend']})")
    for e in data["entries"]:
        click.echo(f"stored:   {e['tier']} tier, {e['path']}, created {when(e['created'])}, "
                   f"{e['hits']} hits")
    if not data["entries"]:
        uncached = data["compiles"] and data["compiles"][0]["reason"].startswith(UNCACHED)
        click.echo("stored:   no (kdb does not cache this build)" if uncached
                   else "stored:   no (the compile's binary was not stored)")
    recs = data["compiles"]
    if recs:
        r = recs[0]
        click.echo(f"compiled: {len(recs)} time(s); latest {when(r['at'])}, {r['seconds']:.3f} s "
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
                    f"created {when(e['created'])}")
            if e["differs"] is None:
                click.echo(head + "  (attributes of this compile unknown)")
                continue
            click.echo(head + f"  differs in {len(e['differs'])}: "
                       + ", ".join(e["differs"]))
            for k, how in e["differs"].items():  # a value's newline (Intel's cl.cfg) kept
                click.echo(f"      {k}: " + str(how).replace("\n", "\\n"))  # on its line
    if data["other_matches"]:
        click.echo(f"also matching {key_or_name!r}: "
                   + ", ".join(k[:12] for k in data["other_matches"][:8])
                   + (" ..." if len(data["other_matches"]) > 8 else ""))

"""The ``kdb`` commands that build or run: ``demo``, ``pack`` (system databases and their
wheels) and ``run`` (a command with kdb on for every process it starts)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from .. import config
from .tools import (Settings, checked_arch, checked_by, emit_json, human_bytes, json_option,
                    table)
from ..errors import CommandError




def _version_ok(version: str) -> None:
    from ..pack.wheel import check_version

    check_version(version)


def _prefix_ok(prefix: str) -> None:
    from ..file.discovery import dist_name

    dist_name("sm_90", prefix)  # the prefix is checked; any arch would do


@click.command()
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
        from ..demo.runs import main as demo_main
    except ImportError as err:
        raise click.ClickException(f"kdb demo is not available here: {err}") from err
    obj: Settings = ctx.obj
    extra: dict[str, Any] = {}
    if obj.explicit:
        extra["cache_dir"] = str(obj.cache_root)
    if keep:
        extra["keep"] = True
    if json_out is not None:  # said before the demo runs, not after
        parent = Path(json_out).resolve().parent
        if not parent.is_dir():
            raise click.BadParameter(f"{parent} is not a directory", param_hint="--json")
    from ..errors import InvalidArgumentError

    try:
        code = demo_main(kernels=kernels, json_out=json_out, **extra)
    except InvalidArgumentError as err:  # a count larger than the demo's programs
        raise click.BadParameter(str(err), param_hint="--kernels") from None
    ctx.exit(code or 0)


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


@click.command("pack")
@click.option("--arch", "arches", multiple=True, required=True, metavar="ARCH",
              callback=checked_arch,
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
              callback=checked_by(lambda v: _version_ok(v)),
              help="Version of the wheels (e.g. 1.0.0). Without it only the .kdb files are "
                   "written (for KDB_SYSTEM_DB_PATH).")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the <arch>.kdb files and the wheels.")
@click.option("--name", "dist_prefix", default="kdb-system", show_default=True,
              callback=checked_by(lambda v: _prefix_ok(v)),
              metavar="PREFIX", help="Wheel name prefix: wheels are <prefix>-<arch>. A framework shipping its "
                   "own kernels picks its own, so its wheel installs beside kdb's.")
@click.option("--keep-going", is_flag=True,
              help="Pack the other kernels when one fails to compile (the exit status is "
                   "still 1).")
@click.option("--sign", "sign_key", default=None, metavar="KEY",
              type=click.Path(dir_okay=False, path_type=Path),
              help="Sign every entry with this Ed25519 private key (PEM; `kdb key gen`). "
                   "Copied entries are signed only if they verify under KDB_TRUSTED_KEYS "
                   "when it is set.")
@json_option
@click.pass_context
def pack_(ctx: click.Context, *, arches: tuple[str, ...], manifest: Path | None,
          from_db: str | None, from_log: bool, pkg_version: str | None, out_dir: Path,
          dist_prefix: str, keep_going: bool, sign_key: Path | None, as_json: bool) -> None:
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
        kdb pack --arch sm_90 --manifest kernels.toml --sign ci-key.pem --out sysdb
    """
    from ..pack import build as packing

    obj: Settings = ctx.obj
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
                               progress=progress.kernels, on_step=progress.step,
                               sign=sign_key)
    finally:
        progress.close()
    failed = [(r.arch, name, log) for r in results for name, log in r.failures]
    if as_json:
        emit_json([_pack_json(r) for r in results])
    else:
        _pack_table(results, out_dir, pkg_version)
    _pack_warnings(results, as_json)
    for arch, name, why in failed:
        click.echo(f"FAILED: kernel {name!r} ({arch}): "
                   + "\n  | ".join(why.rstrip().splitlines()), err=True)
    if failed:
        click.echo(f"error: {len(failed)} kernel(s) could not be packed and were left out: "
                   + ", ".join(f"{n} ({a})" for a, n, _ in failed), err=True)
        ctx.exit(1)


def _pack_json(r) -> dict:
    return {"arch": r.arch, "file": str(r.path), "entries": r.entries,
            "raw_bytes": r.raw_bytes, "stored_bytes": r.stored_bytes,
            "file_size": r.file_size, "wheel": str(r.wheel) if r.wheel else None,
            "wheel_size": r.wheel.stat().st_size if r.wheel else None,
            "seconds": r.seconds, "missing_keys": r.missing,
            "signed_by": r.signed_by,
            "refused": [{"kernel": n, "reason": why} for n, why in r.refused],
            "failures": [{"kernel": n, "reason": why} for n, why in r.failures]}


def _pack_table(results: list, out_dir: Path, pkg_version: str | None) -> None:
    table(["ARCH", "FILE", "ENTRIES", "RAW", "STORED", "FILE SIZE", "WHEEL", "WHEEL SIZE",
            "SECONDS"],
          [[r.arch, r.path.name, r.entries, human_bytes(r.raw_bytes), human_bytes(r.stored_bytes),
            human_bytes(r.file_size), r.wheel.name if r.wheel else "-",
            human_bytes(r.wheel.stat().st_size) if r.wheel else "-", f"{r.seconds:.1f}"]
           for r in results])
    click.echo(f"written to {out_dir}")
    if pkg_version is None:
        click.echo("no --version given: no wheels built; put the directory in "
                   f"{config.ENV_SYSTEM_DB_PATH} to use the files")


def _pack_warnings(results: list, as_json: bool) -> None:
    """Who signed, and the entries left out: refused by the trust policy, or logged with
    no stored binary."""
    for r in results:
        if r.signed_by and not as_json:
            click.echo(f"{r.arch}: {r.entries} entries signed by key {r.signed_by}")
        if r.refused:
            click.echo(f"warning: {r.arch}: {len(r.refused)} copied entries were left out, "
                       "since no trusted key vouches for them: "
                       + "; ".join(f"{n}: {why}" for n, why in r.refused[:5]), err=True)
        if r.missing:
            click.echo(f"warning: {r.arch}: {len(r.missing)} logged kernel(s) have no stored "
                       "binary and were left out: " + ", ".join(k[:12] for k in r.missing),
                       err=True)


@click.command("run", context_settings={"ignore_unknown_options": True,
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

    Stdin, stdout, stderr, every other inherited file descriptor and the exit status are
    the command's; signals sent to kdb run are passed on. At the end, one line on stderr: programs requested, compiled (and how
    many of those compiles are still pending store), served per tier and from memory,
    seconds compiling, and the compile time the served programs took when first built (an
    estimate, not wall time), over every process that used kdb.

    \b
    Example:
        kdb run -- mpirun -n 8 python app.py
    """
    from ..adopt import run as running
    from ..adopt import tally

    obj: Settings = ctx.obj
    if not command[0].strip():
        raise click.BadParameter("the command's name is empty", param_hint="COMMAND")
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

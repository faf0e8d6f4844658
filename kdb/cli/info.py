"""``kdb info``: the settings, every tier's files, the shared tier, devices and toolchains."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from .. import config
from ..file import discovery
from .tools import Settings, emit_json, human_bytes, json_option
from ..admin.info import info as info_of




@click.command()
@json_option
@click.pass_obj
def info(obj: Settings, as_json: bool) -> None:
    """Devices, arch ids, and every tier's files with their size and entry count.

    Lists the OpenCL devices (when pyopencl is installed) with their arch ids and compiler,
    the user tier's files, the system databases found, and which device has none.

    \b
    Example:
        kdb info --json
    """
    data = info_of(obj.user_dir, obj.cache_root)
    if as_json:
        emit_json(data)
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
                   f"{f['entries']} entries  {human_bytes(f['size'])}"
                   + (f"  [{f['problem']}]" if f["problem"] else ""))
    _echo_shared(data["shared"])
    _echo_trust(data["trust"])
    _echo_auto(data["auto"])
    click.echo(f"system path ({config.ENV_SYSTEM_DB_PATH}): "
               + (os.pathsep.join(data["system_path"]) or "not set"))
    click.echo("system databases:")
    if not data["system_databases"]:
        click.echo("  (none found)")
    for s in data["system_databases"]:
        size = f"{s['entries']} entries  {human_bytes(s['size'])}  " if not s["problem"] else ""
        click.echo(f"  {s['arch']}  {s['path']}  {size}({s['origin']})"
                   + (f"  [{_problem(s)}]" if s["problem"] else ""))
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
    _echo_hip(data["hip"])
    _echo_backends(data["backends"])
    _echo_settings(data["settings"])


def _echo_backends(rows: list[dict[str, Any]]) -> None:
    """One line per back end of kdb.registry: what packs it, what it needs."""
    click.echo("back ends:")
    for b in rows:
        need = ("" if b["needs"] is None else f"  needs {b['needs']}" + (
            "" if b["available"] else f" (not installed: pip install '{b['extra']}')"))
        click.echo(f"  {b['name']:<8} {b['label']}" + ("  [kdb pack: manifest]" if b["packs"]
                                                        else "") + need)


def _echo_settings(rows: list[dict[str, Any]]) -> None:
    """The variables set here, each with its default (docs/configuration.md lists them all)."""
    set_here = [r for r in rows if r["value"] is not None]
    click.echo("settings:" + ("" if set_here else " none set (every default holds)"))
    for r in set_here:
        click.echo(f"  {r['name']}={r['value']!r}  (default: {r['default']})")


def _echo_trust(trust: dict[str, Any]) -> None:
    """The trust policy's line of ``kdb info`` (docs/security.md)."""
    if not trust["verify"] and not trust["signer"]:
        click.echo("signed entries: no trust policy (KDB_TRUSTED_KEYS not set): nothing is "
                   "checked")
        return
    if trust["verify"]:
        click.echo(f"signed entries: {', '.join(trust['verify'])} tier(s) must verify; trusted "
                   f"keys: {', '.join(trust['trusted']) or 'NONE (nothing can be served)'}")
    if trust["signer"]:
        click.echo(f"  this process signs with key {trust['signer']} (KDB_SIGNING_KEY)")


def _echo_shared(shared: dict[str, Any] | None) -> None:
    """The shared tier's lines of ``kdb info`` (its URL comes masked from the library)."""
    if shared is None:
        click.echo(f"shared tier: off ({config.ENV_SHARED_URL} not set)")
        return
    click.echo(f"shared tier: {shared['url']} ({config.ENV_SHARED_URL})"
               + (f", namespace {shared['namespace']} ({config.ENV_SHARED_NAMESPACE})"
                  if shared.get("namespace") else ""))
    kept = sum(shared.get("unpublished", {}).values())
    if kept:
        click.echo(f"  {kept} entries compiled here while the server was away, to publish "
                   "with this node's next publish the server takes")
    if shared["problem"]:
        click.echo(f"  [{shared['problem']}]")
        return
    click.echo(f"  rev {shared['revision'] or '-'}  {shared['entries']} entries  "
               f"{human_bytes(shared['stored_bytes'])}  "
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
        host = cuda.get("host_compiler") or {}
        if host:
            libs = f", {host['stdlib']}" if host.get("stdlib") else ""
            click.echo(f"  host cc:   {host['path'] or '(not found)'} ({host['version']}{libs}; "
                       f"nvcc runs {host['named']!r}: in the key of its builds)")
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
    nvcc_arches, nvrtc_arches = cuda.get("nvcc_arches") or [], nv.get("arches") or []
    if nvcc_arches and nvrtc_arches and nvcc_arches != nvrtc_arches:  # compiler= decides
        click.echo(f"  arches:    nvcc: {' '.join(nvcc_arches)}")
        click.echo(f"             NVRTC: {' '.join(nvrtc_arches)}")
    else:
        click.echo(f"  arches:    {' '.join(cuda['arches']) or '(none listed)'}")
    click.echo(f"  system db: {' '.join(cuda['system_db']) or 'none for these arches'}")
    click.echo("  pycuda:    " + ("installed" if cuda["pycuda"] else
                                  "not installed (loading needs pip install 'kdb[pycuda]')"))


def _echo_hip(hip: dict[str, Any]) -> None:
    """hipcc's and HIPRTC's lines: path and release, or why there is none."""
    click.echo("HIP toolchain (kdb.hip):")
    for name in ("hipcc", "hiprtc"):
        row = hip[name]
        if row["path"] and not row["problem"]:
            click.echo(f"  {name + ':':<10} {row['path']} (from {row['found_by']})")
            libs = f" (reads {row['stdlib']})" if row.get("stdlib") else ""
            click.echo(f"             {row['release']}{libs}")
        elif row["path"] or row["found_by"]:  # found, or named, but not one that works
            click.echo(f"  {name + ':':<10} (unusable: {row['problem']})")
        else:
            click.echo(f"  {name + ':':<10} (not installed: {row['problem']})")
    default, blocked = hip["default"], hip.get("blocked")
    click.echo("  compiles:  " + (f"with {default} (compiler=None)" if default else
                                  f"nothing: {blocked} names no working compiler (kdb.hip "
                                  "raises; fix it or unset it)" if blocked else
                                  "nothing: no compiler; stored builds are served (newest "
                                  "compiler first)"))
    built = hip["hipcc"]["arches"] or hip["hiprtc"]["arches"]
    click.echo(f"  arches:    {' '.join(built) or '(none listed)'}")


def _problem(system: dict) -> str:
    """A system database's problem as ``kdb info`` shows it: refused (not loaded: others
    could change it) or broken."""
    if system.get("refused"):
        return "REFUSED: " + system["problem"][len(discovery.REFUSED):]
    return "BROKEN: " + system["problem"]

"""Stores an exiting process leaves to a detached process (``KDB_STORE_AT_EXIT=detach``).

Reading a program's binaries back from PoCL costs 2-3x its build, and for pyopencl's scan
kernels 40-190x (DESIGN section 11): done before exit it kept a first run's process alive
1.5x (20 small kernels) to 10x (a scan kernel) longer than the same run without kdb. So at
exit the OpenCL stores not started yet are written down (source, options, platform and
devices, the attributes of each entry, the start-up latency log) and a detached process at
the lowest CPU priority builds the program again (PoCL's own cache answers, and its
binaries then hold the work-group functions the exiting process JIT-compiled), reads the
binaries and stores them. It inherits the exiting process's claims (``flock`` lives as long
as a descriptor of it), so another process that starts meanwhile waits for the entry
instead of compiling it; the claims are released even when storing fails.

    python -m kdb.handoff SPEC.json    # what the exiting process starts
"""

from __future__ import annotations

import os
import sys

from . import logs

log = logs.get("kdb")

#: The detached process's log, beside the user files (what it could not store, and why).
LOG_NAME = "store-worker.log"


class Redo:
    """One entry of an OpenCL program a detached process can store instead of this one.

    ``program`` is shared by the entries of one build: ``source``, ``options`` (the bytes
    given to ``clBuildProgram``), ``platform`` (its name) and ``devices`` (``(name, index
    among the platform's devices)``), and ``cwd`` (relative ``-I`` paths).
    """

    __slots__ = ("db", "program", "device", "attrs", "seconds", "details", "claim")

    def __init__(self, db, program: dict, device: int, attrs, seconds: float,
                 details: dict | None, claim) -> None:
        self.db, self.program, self.device, self.attrs = db, program, device, attrs
        self.seconds, self.details, self.claim = seconds, details, claim


def can_detach() -> bool:
    """Whether ``sys.executable -m kdb.handoff`` would start Python: not in an application
    that embeds Python or is frozen (its executable is the application itself)."""
    exe = sys.executable
    if not exe or getattr(sys, "frozen", False):
        return False
    return os.path.basename(exe).lower().startswith(("python", "pypy"))


def start(redos: list[Redo]) -> None:
    """Write the spec and start the detached process (at exit; never raises)."""
    try:
        _start(redos)
    except Exception as err:  # noqa: BLE001 - never fail an exiting program
        from . import faults

        # Once-key of the cache directory's own faults: an unwritable cache warns once.
        faults.warn_once(str(redos[0].db.user_dir) if redos else "handoff",
                         "kdb: could not hand %d store(s) to a detached process (%s); they "
                         "compile again next run", len(redos), err)
        for r in redos:
            if r.claim is not None:
                r.claim.release()


def _start(redos: list[Redo]) -> None:
    import json
    import subprocess

    from .config import private_dir

    by_db: dict[int, list[Redo]] = {}
    for r in redos:
        by_db.setdefault(id(r.db), []).append(r)
    for group in by_db.values():
        db = group[0].db
        programs: dict[int, dict] = {}
        fds: list[int] = []
        for r in group:
            prog = programs.get(id(r.program))
            if prog is None:
                prog = programs[id(r.program)] = {**r.program, "entries": []}
            fd = r.claim.hand_over() if r.claim is not None else None
            if fd is not None:
                fds.append(fd)
            prog["entries"].append({
                "device": r.device, "key": r.attrs.key, "name": r.attrs.name,
                "attributes": r.attrs.encoded().decode("utf-8"), "seconds": r.seconds,
                "details": r.details, "claim_fd": fd,
                "claim_dir": None if fd is None else str(r.claim.directory)})
        archs = {r.attrs.arch for r in group}
        spec = {"cache_dir": str(db.cache_root), "programs": list(programs.values()),
                "bookkeeping": db.take_bookkeeping(archs)}
        user_dir = private_dir(db.user_dir)
        path = user_dir / f".handoff-{os.getpid()}-{id(group)}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(spec, f)
        except BaseException:  # a full disk: leave no empty spec behind
            path.unlink(missing_ok=True)
            raise
        try:
            out_fd = os.open(user_dir / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(out_fd, "ab") as out:
                subprocess.Popen(
                    [sys.executable, "-m", "kdb.handoff", str(path)], stdin=subprocess.DEVNULL,
                    stdout=out, stderr=out, pass_fds=fds, start_new_session=True,
                    close_fds=True)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            for fd in fds:
                os.close(fd)  # the detached process holds them now (or nobody: released)


# -- the detached process -------------------------------------------------------------------

def main(argv: list[str]) -> int:
    import json
    import time

    try:
        os.nice(19)
    except OSError:
        pass
    path = argv[0]
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    os.unlink(path)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    from .db import KernelDB
    from .store import CompileRecord

    db = KernelDB(cache_dir=spec["cache_dir"])  # with the shared tier, if one is set
    for arch, book in spec["bookkeeping"].items():
        try:
            db.user_file(arch).write([], [CompileRecord(*row) for row in book["logs"]],
                                     {k: tuple(v) for k, v in book["hits"].items()},
                                     book["counters"])
        except Exception as err:  # noqa: BLE001 - the binaries matter more: go on
            print(f"{stamp} kdb store worker {os.getpid()}: could not write the latency log "
                  f"of {arch}: {err}", flush=True)
    failed = 0
    for prog in spec["programs"]:
        try:
            failed += _store_program(db, prog)
        except Exception as err:  # noqa: BLE001 - report, release, go on
            failed += len(prog["entries"])
            print(f"{stamp} kdb store worker {os.getpid()}: could not store "
                  f"{len(prog['entries'])} entr(ies) of {_names(prog)}: {err}", flush=True)
        finally:
            _release(prog)
    db.close()
    return 1 if failed else 0


def _names(prog: dict) -> str:
    return ", ".join(sorted({e["name"] or e["attributes"][:16] for e in prog["entries"]}))


def _store_program(db, prog: dict) -> int:
    """Build the program again, read its binaries, store each entry; returns how many failed."""
    import pyopencl as cl

    from .backends.clbinaries import program_binaries
    from .keys import HashAttributes

    plats = [p for p in cl.get_platforms() if p.name == prog["platform"]]
    if not plats:
        raise LookupError(f"no OpenCL platform named {prog['platform']!r}")
    plat_devs = plats[0].get_devices()
    devs = []
    for name, index in prog["devices"]:
        if index >= len(plat_devs) or plat_devs[index].name != name:
            raise LookupError(f"no device {name!r} at index {index} of {prog['platform']!r}")
        devs.append(plat_devs[index])
    if prog.get("cwd"):
        os.chdir(prog["cwd"])
    ctx = cl.Context(devs)
    raw = cl._Program(ctx, prog["source"])
    raw.build(prog["options"].encode("latin-1"), devs)
    binaries = program_binaries(raw)
    failed = 0
    for e in prog["entries"]:
        binary = binaries.get(devs[e["device"]].int_ptr)
        if not binary:
            failed += 1
            continue
        attrs = HashAttributes.from_canonical(e["attributes"], name=e["name"])
        if not db.put(attrs, binary, compile_seconds=e["seconds"], details=e["details"]):
            failed += 1
    return failed


def _release(prog: dict) -> None:
    """Release the claims inherited for ``prog``'s entries (stored or not)."""
    from pathlib import Path

    from . import claims

    for e in prog["entries"]:
        if e["claim_fd"] is not None:
            claims.adopt(Path(e["claim_dir"]), e["key"], e["claim_fd"]).release()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

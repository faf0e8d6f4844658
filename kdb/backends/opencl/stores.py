"""OpenCL stores: what a build from source leaves to store, and the store worker's half.

A program built from source is returned at once; reading its binaries back
(``CL_PROGRAM_BINARIES``) is slow on PoCL, so a job describing the build goes to the store
worker (:mod:`kdb.storing.spool`), which builds it again and stores the binaries (:func:`rebuild_and_store`).
Until then the program itself serves repeats in this process (:data:`compiled`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable

import pyopencl as cl

from ... import config, lifecycle, logs
from ...db import KernelDB
from ...file.rows import PROVISIONAL
from ...keys import HashAttributes
from ...storing.jobs import StoreJob
from ...storing.stores import HeaderChangedError, headers_changed
from . import early, refresh
from .binaries import library_of, program_binaries, source_program
from .finddevices import NEXT_RUN as _NEXT_RUN, job_devices
from .keys import BACKEND, ENV_VARS, device_details, environment, headers_of

if TYPE_CHECKING:
    from ...claims import Claim

log = logs.get("kdb")

def program_spec(text: str, opt_bytes: bytes, devs: list) -> dict | None:
    """How the store worker can build this program again (:mod:`kdb.storing.spool`): the
    platform by name, version and the library that implements it (two PoCLs on one machine
    share a name: pip's and the system's), and ``devices`` in the build's order, as ``(name,
    index among the platform's devices)``; None when it cannot (sub-devices, which it could
    not find again)."""
    try:
        platform = devs[0].platform
        roots = [d.int_ptr for d in platform.get_devices()]
        where = [(d.name, roots.index(d.int_ptr)) for d in devs]
        options = bytes(opt_bytes).decode("latin-1")
        cwd = os.getcwd()
        version = platform.version
    except (ValueError, TypeError, OSError, cl.Error):  # OSError: a deleted working directory
        return None
    return {"source": text, "options": options, "platform": platform.name,
            "platform_version": version, "library": library_of(platform.int_ptr) or "",
            "devices": where, "cwd": cwd, "ptrs": [d.int_ptr for d in devs]}


class _Recent(dict):
    """A dict that keeps only the ``LIMIT`` entries set last: what was handed to the store
    worker is not held for the process's life. ``get`` stays dict's own; a hit sets its
    entry again (:func:`held`), so a program built over and over stays held."""

    LIMIT = 32

    def __setitem__(self, key, value) -> None:
        self.pop(key, None)
        super().__setitem__(key, value)
        while len(self) > self.LIMIT:
            del self[next(iter(self))]


#: The memory tier: programs this process built from source, keyed by (context, devices,
#: keys), the few built or served last, each with its :func:`build_stamp`. A repeated build
#: is served at once instead of compiling again or waiting on this process's own claim;
#: their binaries are stored by the store worker.
compiled: dict[tuple, tuple] = _Recent()


def build_stamp(raw, devs) -> tuple | None:
    """The options each device's program was last built with, as the driver reports them.

    kdb holds programs the caller can reach (``kdb.opencl.build`` returns one; its
    ``build()`` rebuilds the same ``cl_program``). A program rebuilt since with other
    options is no longer the one its key names: neither served nor stored when its stamp
    differs from the one taken at kdb's build. None where the driver does not say.
    """
    try:
        return tuple(raw.get_build_info(d, cl.program_build_info.OPTIONS) for d in devs)
    except (cl.Error, UnicodeDecodeError):
        return None


def held(memory_key: tuple, devs):
    """The memory tier's program for ``memory_key``, unless it was rebuilt since (then
    it is forgotten: a compile, never the other options' kernel)."""
    got = compiled.get(memory_key)
    if got is None:
        return None
    raw, stamp = got
    if stamp is not None and build_stamp(raw, devs) == stamp:
        compiled[memory_key] = got  # the newest again: evicted last
        return raw
    compiled.pop(memory_key, None)
    log.debug("kdb: a program this process built was rebuilt with other options since; "
              "not served from memory")
    return None


#: The build variables of this process's first stored build: PoCL reads some of them
#: (``POCL_EXTRA_BUILD_FLAGS``) once, at its first build, so a program built after they
#: changed was built with the first values, whatever its key says.
_first_environment: list[tuple] = []


def _built_as_keyed(attrs: HashAttributes) -> bool:
    """Whether this process's driver built with the variables ``attrs`` holds: true unless
    they changed since its first stored build (the store worker rebuilds such a job in the
    key's own variables; this process stores nothing of it)."""
    if not _first_environment:
        _first_environment.append(attrs.environment)
    return _first_environment[0] == attrs.environment


def store_later(db: KernelDB, raw, devs, attrs: list[HashAttributes], seconds: float,
                held: dict[str, Claim], *, forget: tuple = (), program: dict | None = None,
                recheck: Callable[[], tuple] | None = None, early_build=None,
                first: bool = False) -> None:
    """Record the compile now; hand the store to the store worker (:mod:`kdb.storing.spool`), or, with
    ``KDB_STORE_AT_EXIT=wait`` or no worker possible, to the background thread. ``recheck``
    gives the build's headers as they are now (:func:`recheck_for`): what this process
    stores itself is checked against the key with it first. ``early_build``: the build as
    :mod:`.early` noted it, kept for a process that waits for it before any binary is read;
    ``first``: nothing stands in for it, the store worker takes its job first."""
    per_device = seconds / max(len(devs), 1)
    stamp = build_stamp(raw, devs)
    ptrs = program.pop("ptrs") if program is not None else []
    recs = [db.tiers.record_compile(a, per_device) for a in attrs]
    if not attrs or db.tiers.disabled or not db.tiers.storing.can_store(attrs[0].arch):
        for claim in held.values():
            claim.release()
        return
    in_process = _built_as_keyed(attrs[0])
    binaries = _read_now(raw, devs, attrs, seconds) if in_process else None
    if binaries is not None:  # in hand: stored by this process, no rebuild anywhere
        now = lifecycle.in_multiprocessing_child()  # its end skips every wait
        for d, a, rec in zip(devs, attrs, recs):
            db.tiers.storing.put_later(a, _handed(binaries[d.int_ptr], forget),
                                       compile_seconds=per_device, details=device_details(d),
                                       log=rec, claim=held.pop(a.key, None), recheck=recheck,
                                       now=now)
        return
    if program is not None and all(d.int_ptr in ptrs for d in devs) and _detach():
        job = _job(devs, attrs, recs, seconds, program, ptrs)
        job.first = first
        claims = [held.pop(a.key) for a in attrs if a.key in held]
        store_now = _storer(db, devs, attrs, recs, per_device=per_device, forget=forget,
                            in_process=in_process, recheck=recheck, build=early_build,
                            program=program, ptrs=ptrs)
        if db.tiers.storing.spool(job, claims, store_now):
            refresh.compiled(db.tiers, attrs)  # launches may outrun the store: see at exit
            return
        held.update((c.key, c) for c in claims)
    read = _reader(raw, devs, stamp, forget, in_process, program=program, ptrs=ptrs,
                   build=_build_variables(attrs[0]))
    for d, a, rec in zip(devs, attrs, recs):
        db.tiers.storing.put_later(a, lambda ptr=d.int_ptr: read(ptr),
                                   compile_seconds=per_device, details=device_details(d),
                                   log=rec, claim=held.pop(a.key, None), recheck=recheck,
                                   costly=True)


#: Seconds a read of a program's binaries may take (and no longer than its build) before
#: this process stops reading them right after builds for that arch (:func:`_read_now`).
SLOW_READ_S = 0.05
#: Arch ids whose binaries proved slow to read in this process: the store worker stores them.
_slow_to_read: set[str] = set()


def _read_now(raw, devs, attrs: list[HashAttributes], seconds: float) -> dict[int, bytes] | None:
    """Each device's binary, read right after the build where that costs next to nothing:
    every OpenCL but PoCL, whose serialisation generates code for every kernel (seconds for
    a scan). Intel's CPU runtime hands back what it built (42 of pyopencl's programs: 5.2 s
    to build, under 10 ms to read), as pyopencl's own cache, which reads them at every
    build, relies on. None where the store worker should store it instead: PoCL, an arch
    whose reads proved slow here (one longer than ``SLOW_READ_S`` and than its build), a
    read that failed, or a device the driver gave no binary for."""
    if any(a.arch.startswith("pocl-") or a.arch in _slow_to_read for a in attrs):
        return None
    start = time.perf_counter()
    try:
        binaries = program_binaries(raw, devs)
    except (OSError, cl.Error) as err:
        log.debug("kdb: reading the binaries right after the build failed (%s); the store "
                  "worker stores them", err)
        return None
    took = time.perf_counter() - start
    if took > max(SLOW_READ_S, seconds):
        _slow_to_read.update(a.arch for a in attrs)
        log.debug("kdb: reading %s's binaries took %.3f s, more than its build: its next "
                  "stores go to the store worker", attrs[0].arch, took)
    return binaries if all(binaries.get(d.int_ptr) for d in devs) else None


def _handed(binary: bytes, forget: tuple) -> Callable[[], bytes]:
    """The background store's ``produce`` for a binary in hand: from the store on, the
    in-flight map (then the user file) serves repeats, not the program held in memory."""
    def produce() -> bytes:
        compiled.pop(forget, None)
        return binary
    return produce


def _job(devs, attrs: list[HashAttributes], recs: list, seconds: float, program: dict,
         ptrs: list[int]) -> StoreJob:
    """The store worker's job for one build: the program, each device's entry, the latency
    rows, and the build variables the keys hold (one build: one environment for all)."""
    per_device = seconds / max(len(devs), 1)
    return StoreJob(backend=BACKEND, seconds=seconds, extra={"program": program},
                    entries=[{"device": ptrs.index(d.int_ptr), "key": a.key, "name": a.name,
                              "attributes": a.encoded().decode("utf-8"),
                              "seconds": per_device, "details": device_details(d)}
                             for d, a in zip(devs, attrs)],
                    logs=[list(rec) for rec in recs],
                    environment=dict(_build_variables(attrs[0])))


def _build_variables(attrs: HashAttributes) -> tuple[tuple[str, str | None], ...]:
    """The build variables (:data:`.keys.ENV_VARS`) as the key holds them, None for unset:
    what a rebuild elsewhere must run with."""
    keyed = dict(attrs.environment)
    return tuple((k, keyed.get(k)) for k in ENV_VARS)


def _storer(db: KernelDB, devs, attrs: list[HashAttributes], recs: list, *,
            per_device: float, forget: tuple, in_process: bool,
            recheck, build=None, program: dict | None = None,
            ptrs: list[int] = ()) -> Callable[[], str | None]:
    """What stores a spooled job's entries from this process when another process waits
    for one of them while this one still holds the program (ranks starting together): no
    rebuild, no worker. First what PoCL's cache holds of it (:func:`.early.keep_now`: a
    scan, no binary read; the job stays queued for its full store, and the result says
    :data:`~kdb.file.rows.PROVISIONAL`); else the binaries, read from the program. The
    program is looked up, not kept: a job's program is held only while new. ``remote``: a
    process on another node waits (the shared tier): PoCL's files kept here serve this node
    only, so the binaries are read and the entry published."""
    def store_now(remote: bool = False) -> str | None:
        if build is not None and not remote and early.keep_now(build):
            return PROVISIONAL
        held_raw = held(forget, devs)
        if held_raw is None:
            raise LookupError("the program is no longer held as built; the store worker "
                              "stores it")
        if not in_process:
            raise LookupError("the program was built under this process's first build "
                              "variables, not its key's; the store worker stores it")
        binaries = _binaries(held_raw, devs, program, list(ptrs), _build_variables(attrs[0]))
        db.tiers.storing.store([(a, binaries[d.int_ptr], per_device, device_details(d))
                                for d, a in zip(devs, attrs) if binaries.get(d.int_ptr)], recs,
                               recheck)
    return store_now


def _binaries(raw, devs, program: dict | None, ptrs: list[int],
              build: tuple = ()) -> dict[int, bytes]:
    """``raw``'s binaries by device. Where reading them here could abort this process
    (:func:`.readback.at_risk`), the helper's, built again there under the key's build
    variables ``build``. Where the driver does not say whose binary is whose (PoCL 3.0, a
    program built for some of its context's devices, or for all of them named in another
    order: :mod:`.binaries`), those of the same build made again in a context of just
    ``devs``, PoCL's cache answering."""
    from . import readback  # the store path only: a hit imports nothing of it (3 ms)

    if readback.at_risk(raw, devs):
        if program is None:
            raise LookupError("a PoCL before 6.0 could abort this process reading them, and "
                              "the build cannot be made again elsewhere (sub-devices)")
        return readback.read_elsewhere(program, ptrs, build)
    binaries = program_binaries(raw, devs)
    if binaries or program is None:
        return binaries
    try:
        if os.getcwd() != program.get("cwd"):
            return {}  # relative -I paths would name other headers
    except OSError:
        return {}
    again = source_program(cl.Context(devs), program["source"])
    again.build(program["options"].encode("latin-1"), devs)
    return program_binaries(again, devs)


def _reader(raw, devs, stamp: tuple | None, forget: tuple, in_process: bool, *,
            program: dict | None = None, ptrs: list[int] = (),
            build: tuple = ()) -> Callable[[int], bytes | None]:
    """One device's binary of ``raw``, the program's binaries read once for all of them
    (on the first call, in the background store); none when ``raw`` was rebuilt since
    with other options (:func:`build_stamp`)."""
    binaries: dict[int, bytes] | None = None

    def read(ptr: int) -> bytes | None:
        nonlocal binaries
        if not in_process:
            log.debug("kdb: not stored: built under the process's first build variables")
            return None
        if binaries is None and (stamp is None or build_stamp(raw, devs) != stamp):
            log.debug("kdb: not stored: the program was rebuilt with other options since")
            compiled.pop(forget, None)
            binaries = {}
        if binaries is None:
            try:
                binaries = _binaries(raw, devs, program, list(ptrs), build)
            except Exception as err:  # noqa: BLE001 - storing is best effort
                log.warning("kdb: could not read program binaries: %s", err)
                binaries = {}
            finally:
                # From here the bytes are in KernelDB's in-flight map, then the user file.
                compiled.pop(forget, None)
        return binaries.get(ptr) or None
    return read


def recheck_for(text: str, opt_bytes: bytes, search) -> Callable[[], tuple]:
    """The build's headers as they will be found later, by the code its key used
    (:func:`.keys.headers_of`) and in this working directory (the store may run after a
    ``chdir``)."""
    try:
        cwd = os.getcwd()
    except OSError:  # a deleted working directory: "." is what the compiler searched
        cwd = "."
    return lambda: headers_of(text, opt_bytes, cwd, search)


def _detach() -> bool:
    """Whether stores go to the store worker: ``KDB_STORE_AT_EXIT=detach``, the default, and
    under ``wait`` in a child of :mod:`multiprocessing`, whose end is its parent's: a pool
    leaving ``with`` terminates its workers (SIGTERM), and what one kept to store before its
    exit was lost, run after run."""
    return config.store_at_exit() == "detach" or lifecycle.in_multiprocessing_child()


def rebuild_and_store(db: KernelDB, job: StoreJob) -> dict[str, float]:
    """The store worker's half (:mod:`kdb.storing.spool`): build the program again (PoCL's cache
    answers), read its binaries and store each entry with its latency rows. Returns the
    rebuild's CPU seconds as ``{"build": s}`` (:mod:`kdb.storing.storetimes`).

    The rebuild runs in the environment the keys were computed in: the supervisor starts
    this process with the job's ``environment`` (:mod:`kdb.worker`), and a job whose
    keys name other values than this process has is dropped, never stored.

    The rebuild reads the headers as they are now; the key was computed from them as they
    were at the build. Their digests are taken again, before the rebuild and right before
    the store (:meth:`kdb.tiers.Tiers.store`'s ``recheck``), with the code the key used
    (:func:`.keys.headers_of`): when they differ from an entry's, the job is dropped with a
    :class:`HeaderChangedError` that names the header (the worker logs it).
    """
    from ...file.kernelfile import CompileRecord

    prog = job.extra["program"]
    keyed = [HashAttributes.from_canonical(e["attributes"], name=e["name"])
             for e in job.entries]
    devs = job_devices(prog, [(e["device"], a) for e, a in zip(job.entries, keyed)])
    if prog.get("cwd"):
        os.chdir(prog["cwd"])  # relative -I paths
    opt_bytes = prog["options"].encode("latin-1")
    _same_environment(keyed)

    def recheck():
        return headers_of(prog["source"], opt_bytes, prog.get("cwd") or None,
                          environment=keyed[0].environment if keyed else ())

    why = headers_changed(keyed, recheck)
    if why is not None:
        raise HeaderChangedError(f"job dropped: {why} ({_NEXT_RUN})")
    start = time.process_time()
    ctx = cl.Context(devs)
    raw = source_program(ctx, prog["source"])
    raw.build(opt_bytes, devs)
    build_s = time.process_time() - start
    binaries = program_binaries(raw, devs)
    items = []
    for e, attrs in zip(job.entries, keyed):
        binary = binaries.get(devs[e["device"]].int_ptr)
        if binary:
            items.append((attrs, binary, e["seconds"], e["details"]))
    try:  # not edited while it built, either
        db.tiers.storing.store(items, [CompileRecord(*row) for row in job.logs], recheck)
    except HeaderChangedError as err:
        raise HeaderChangedError(f"job dropped: {err} ({_NEXT_RUN})") from None
    if len(items) < len(job.entries):
        raise LookupError(f"the driver returned no binary (or a torn one) for "
                          f"{len(job.entries) - len(items)} device(s)")
    return {"build": build_s}



def _same_environment(keyed: list[HashAttributes]) -> None:
    """Raise unless this process has the values of :data:`.keys.ENV_VARS` the keys hold: a
    rebuild under others would store a binary its key does not describe."""
    here = dict(environment())
    for attrs in keyed:
        then = dict(attrs.environment)
        for name in ENV_VARS:
            if then.get(name) != here.get(name):
                raise LookupError(
                    f"job dropped: {attrs.name or attrs.key[:12]} was built with {name}="
                    f"{then.get(name)!r}, the store worker has {here.get(name)!r}, so its "
                    f"binary would not match its key ({_NEXT_RUN})")

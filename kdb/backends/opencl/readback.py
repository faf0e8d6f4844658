"""Reading a program's binaries in a helper process where reading them here could abort.

PoCL before 6.0 makes every kernel's generic work-group function when a program's binaries
are read (``CL_PROGRAM_BINARIES``) and enters it, unreferenced, at the head of the list its
launches use. A launch releases the first entry with its build hash and local size: for a
kernel with ``reqd_work_group_size`` (pyopencl's scans and reductions), one running while
the binaries are read releases the new entry instead of its own, and PoCL aborts the
process (``pocl_release_dlhandle_cache: Assertion `found->ref_count > 0' failed``; builds
without assertions leak both entries instead). PoCL 6.0 releases the launch's own entry.

The store worker never runs the caller's kernels, so it is safe. What the caller's process
stores itself (``KDB_STORE_AT_EXIT=wait``, a store another process waits for) is read here
only where no such kernel exists; otherwise a helper process (one per process, started at
the first such read) builds the program again, PoCL's cache answering as it does for the
store worker, and sends back its binaries.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import threading

import pyopencl as cl

from ... import lifecycle

#: The first PoCL that releases a launch's own work-group function.
FIXED_POCL = (6, 0)
#: Which of a job's program fields the helper needs (no device pointers: not its process's).
_FIELDS = ("source", "options", "platform", "platform_version", "library", "devices", "cwd")


@functools.lru_cache(maxsize=None)
def _pocl_before_fix(platform_version: str) -> bool:
    found = re.search(r"\bPoCL (\d+)\.(\d+)", platform_version)
    return found is not None and (int(found[1]), int(found[2])) < FIXED_POCL


def at_risk(raw, devs) -> bool:
    """Whether reading ``raw``'s binaries in this process could abort it: a PoCL CPU device
    before 6.0, and a kernel with a fixed work-group size (or PoCL told to make specialized
    work-group functions for binaries, ``POCL_BINARY_SPECIALIZE_WG``)."""
    try:
        if not any(d.type & cl.device_type.CPU and _pocl_before_fix(d.platform.version)
                   for d in devs):
            return False
        if os.environ.get("POCL_BINARY_SPECIALIZE_WG"):
            return True
        fixed = cl.kernel_work_group_info.COMPILE_WORK_GROUP_SIZE
        return any(any(k.get_work_group_info(fixed, d)) for k in raw.all_kernels()
                   for d in devs)
    except cl.Error:
        return True  # cannot tell: read it where nothing else runs


class HelperError(OSError):
    """The helper could not read the binaries (it says why, or it ended)."""


class _Helper:
    """One helper process and the pipe to it; requests are one JSON line each, replies a
    JSON line (``{"sizes": [...]}`` or ``{"error": ...}``) and then the binaries' bytes."""

    def __init__(self, env: dict[str, str]) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()  # one request at a time
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kdb.backends.opencl", "--read-binaries"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            cwd="/", close_fds=True)

    def read(self, program: dict) -> list[bytes]:
        request = json.dumps({k: program.get(k) for k in _FIELDS}).encode("utf-8",
                                                                          "surrogateescape")
        try:
            self.proc.stdin.write(request + b"\n")
            self.proc.stdin.flush()
            header = json.loads(self.proc.stdout.readline() or b"null")
        except (OSError, ValueError):
            header = None
        if not isinstance(header, dict):
            self.close()
            raise HelperError(f"the helper that reads PoCL's binaries ended "
                              f"(exit status {self.proc.poll()})")
        if "error" in header:
            raise HelperError(f"the helper could not read the binaries: {header['error']}")
        return [self.proc.stdout.read(size) for size in header["sizes"]]

    def close(self) -> None:
        """Never waits for a request in flight: at exit, one the stores' timeout gave up on
        (the reader then gets :class:`HelperError`)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_lock = threading.Lock()  # the table below; each helper has its own for requests
_helpers: dict[tuple, _Helper] = {}


def read_elsewhere(program: dict, ptrs: list[int], build=()) -> dict[int, bytes]:
    """The binaries of ``program`` (a job's program, :func:`.stores.program_spec`) built
    again in a helper, by device pointer (``ptrs``: its devices here, in its order), under
    the build variables ``build`` (``(name, value)`` pairs, None for unset)."""
    from ...storing.spool import job_environment

    key = tuple(build)
    with _lock:
        helper = _helpers.get(key)
        if helper is None or helper.proc.poll() is not None:
            helper = _helpers[key] = _Helper(job_environment(None, build=build))
    with helper.lock:
        binaries = helper.read(program)
    return {ptr: b for ptr, b in zip(ptrs, binaries) if b}


def _close_all() -> None:
    for helper in list(_helpers.values()):
        if helper.pid == os.getpid():
            helper.close()
    _helpers.clear()


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    _helpers.clear()  # the parent's pipes: the child starts its own helper


lifecycle.on_fork(_after_fork)
lifecycle.on_exit(lifecycle.SUMMARY, _close_all)  # after the stores (lifecycle.STORES)


# -- the helper ------------------------------------------------------------------------------

def _build_and_read(program: dict) -> list[bytes]:
    from .binaries import program_binaries, source_program
    from .finddevices import job_devices

    devs = job_devices(program, [])
    os.chdir(program.get("cwd") or "/")  # relative -I paths
    raw = source_program(cl.Context(devs), program["source"])
    raw.build(program["options"].encode("latin-1"), devs)
    binaries = program_binaries(raw, devs)
    return [binaries.get(d.int_ptr, b"") for d in devs]


def serve(requests, replies) -> int:
    """Answer requests until the parent closes the pipe."""
    for line in requests:
        try:
            binaries = _build_and_read(json.loads(line))
            header = {"sizes": [len(b) for b in binaries]}
        except Exception as err:  # noqa: BLE001 - every failure is the parent's to report
            binaries, header = [], {"error": f"{type(err).__name__}: {err}"}
        replies.write(json.dumps(header).encode("utf-8") + b"\n")
        for binary in binaries:
            replies.write(binary)
        replies.flush()
    return 0

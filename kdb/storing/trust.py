"""Whether a spool may be trusted: its store worker applies ``environment.json``'s variables
(``LD_PRELOAD`` among them) and rebuilds what its jobs name, as this user. So the cache root,
the user dir, the spool root, the spool and every file read from it must be this user's and
written by nobody else (:func:`kdb.file.fs.unsafe_reason`); else they are refused with one warning
naming the path and the fix, and no worker starts, no job is written or read there.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..file import fs
from .. import logs

log = logs.get("kdb")

#: The file naming the Python and the variables a spool's jobs were written with.
ENVIRONMENT = "environment.json"

#: What trusting a spool someone else can write would risk, and what kdb does instead.
RISK = ("a store worker started from it would run code someone else chose",
        "kernels are compiled and not handed to a store worker there")


class UntrustedSpool(PermissionError):
    """A spool (or a directory above it) that another user owns or can write: refused."""


def trusted(spool: Path, *names: str) -> bool:
    """Whether the cache root, the user dir, the spool root, ``spool`` (``<cache root>/v1/
    spool/<digest>``) and its files ``names`` are this user's alone (missing ones are fine);
    else one warning naming the first that is not, and the fix."""
    spool = Path(spool)
    chain = [spool.parent.parent.parent, spool.parent.parent, spool.parent, spool,
             *(spool / n for n in names)]
    return not fs.refused(chain, RISK)


def accepted(path: Path, fd: int) -> bool:
    """Whether the job (or ``environment.json``) open as ``fd`` may be read: the file as
    opened, and its directory, are this user's alone. One warning per spool, however many
    files were planted there."""
    why = fs.stat_problem(os.fstat(fd)) or fs.unsafe_reason(Path(path).parent)
    if why is None:
        return True
    fs.refuse(str(path), why, RISK, once=str(Path(path).parent))
    return False


def runnable(spool: Path) -> bool:
    """Whether this process may start ``spool``'s worker: :func:`trusted`, and its jobs are
    this Python's (rebuilt with another's pyopencl they could store a different binary)."""
    if not trusted(spool, ENVIRONMENT):
        return False
    try:
        with open(Path(spool) / ENVIRONMENT, encoding="utf-8") as f:
            if not accepted(Path(spool) / ENVIRONMENT, f.fileno()):
                return False
            exe = json.load(f).get("executable", sys.executable)
    except (OSError, ValueError, AttributeError):
        exe = sys.executable  # none yet (the worker then keeps the caller's variables)
    same = exe == sys.executable or isinstance(exe, str) and (  # python, python3: one venv
        os.path.split(exe)[0], os.path.realpath(exe)) == (
        os.path.split(sys.executable)[0], os.path.realpath(sys.executable))
    if not same:
        log.debug("kdb: spool %s is another Python's (%s); left to it", spool, exe)
    return same

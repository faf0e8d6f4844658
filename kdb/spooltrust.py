"""Whether a spool may be trusted: its store worker applies ``environment.json``'s variables
(``LD_PRELOAD`` among them) and rebuilds what its jobs name, as this user. So the cache root,
the user dir, the spool root, the spool and every file read from it must be this user's and
written by nobody else (:func:`kdb.fs.unsafe_reason`); else they are refused with one warning
naming the path and the fix, and no worker starts, no job is written or read there.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import fs

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

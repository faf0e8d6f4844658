"""What waiting for other nodes has cost this node in vain: one budget, not one per kernel.

A node of the shared tier that holds compile locks and never publishes (stuck in a way its
heartbeat does not show, or hostile: a heartbeat says whatever its sender writes) would
otherwise be waited for once per kernel, ``NODE_WALL x KDB_WAIT_TIMEOUT`` each time, in
turn. Here every wait for another node that ended without its entry adds its wall seconds
to ``<claims dir>/nodes-in-vain`` (one appended line each, shared by this node's processes),
and together the waits of the last :func:`window` may not pass the budget: once spent, this
node compiles what another node holds without waiting (and publishes it as usual), so a
rogue costs a bounded delay whatever the number of kernels. A wait that ends with the other
node's entry clears the account: that node was only slow.

A damaged or unwritable file costs at most a wait the budget would have cut short.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from ..dirs import open_regular

#: A node is waited for, per kernel and in all, at most this many times ``KDB_WAIT_TIMEOUT``.
NODE_WALL = 10
#: The account forgets a wait after this many budgets (an hour at the default timeout).
FORGET = 6
#: The most of the account read (its newest lines).
TAIL_BYTES = 8192

NAME = "nodes-in-vain"
_CLEARED = -1.0

#: Holders (their heartbeat's pid and start) this process gave up on: not waited for again.
given_up: set[tuple] = set()


def budget(timeout: float) -> float:
    """The wall seconds this node may wait in vain for other nodes, per kernel and in all."""
    return NODE_WALL * timeout


def window(timeout: float) -> float:
    """How long a wait in vain counts against the budget."""
    return FORGET * budget(timeout)


def spent(directory: Path, timeout: float) -> float:
    """The wall seconds this node's processes waited in vain for other nodes lately."""
    try:
        with os.fdopen(open_regular(directory / NAME), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return 0.0
    since, total = time.time() - window(timeout), 0.0
    for line in lines:
        try:
            at, seconds = (float(x) for x in line.split())
        except ValueError:
            continue  # a torn first line of the tail, or damage
        if seconds == _CLEARED:
            total = 0.0
        elif at >= since and 0.0 <= seconds < 1e9:
            total += seconds
    return total


def left(directory: Path, timeout: float) -> float:
    """What is left of the budget (0 once it is spent)."""
    return max(0.0, budget(timeout) - spent(directory, timeout))


def add(directory: Path, seconds: float) -> None:
    """Count a wait of ``seconds`` that ended without the other node's entry."""
    _append(directory, seconds)


def clear(directory: Path) -> None:
    """A wait for another node ended with its entry: the waits before it no longer count."""
    _append(directory, _CLEARED)


def _append(directory: Path, seconds: float) -> None:
    line = f"{time.time():.3f} {seconds:.3f}\n".encode()
    try:
        fd = os.open(directory / NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return  # a FIFO or a device in its place: no account (waits stay bounded per kernel)
        os.write(fd, line)  # one short write with O_APPEND: lines never interleave
        if os.fstat(fd).st_size > 16 * TAIL_BYTES:
            os.ftruncate(fd, 0)  # only the tail is read; a new account starts empty
            os.write(fd, line)
    except OSError:
        pass
    finally:
        os.close(fd)

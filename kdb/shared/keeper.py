"""Cross-node claims that outlive the process that compiled (the shared tier).

A process holds its key's compile lock on the shared tier (``pg_advisory_lock``) until the
entry is published. Its binaries are published by the store worker (:mod:`kdb.storing.spool`),
often after the process has exited, and the lock ends with the process's session: a node
starting in between would compile the kernel again. So an exiting process whose stores are
still queued starts a *keeper*: a small process that queues for those locks on a session of
its own (PostgreSQL grants a released lock to the session waiting for it) and holds each
until its job is stored and published, at most ``LIFETIME_S``, and no longer than the spool
goes without a store worker (:data:`WORKER_GONE_S`). Other nodes then wait for the
entry, bounded by ``KDB_WAIT_TIMEOUT``, as they would for a compile.

    python -m kdb.shared.keeper     # stdin: {"url", "namespace", "items": [[key, job path], ...]}
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

#: Seconds a keeper holds its locks at most (a waiting node gives up after KDB_WAIT_TIMEOUT).
LIFETIME_S = 900.0
#: Seconds an exiting process waits for its keeper to queue for the locks.
QUEUE_WAIT_S = 5.0
#: Seconds a spool may go without a store worker before its jobs' locks are let go: nothing
#: stores them now (its worker was killed, as by the OOM killer), and other nodes waited up
#: to KDB_WAIT_TIMEOUT for an entry that was not coming.
WORKER_GONE_S = 5.0


def hand_over(tier, items: list[tuple[str, str]]) -> bool:
    """Start a keeper for ``items`` (key, job path) and wait until it queues for their locks
    on the server; True once it has. Never raises (it runs at exit)."""
    import subprocess

    try:
        proc = subprocess.Popen([sys.executable, "-m", "kdb.shared.keeper"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True, cwd="/")
        proc.stdin.write(json.dumps({"url": tier.url, "namespace": tier.namespace,
                                     "items": items}).encode())
        proc.stdin.close()
        backend = _read_pid(proc, QUEUE_WAIT_S)
        if backend is None:
            return False
        deadline = time.monotonic() + QUEUE_WAIT_S
        while time.monotonic() < deadline:
            waiting = tier._on_locker(
                "handing claims over", "SELECT count(*) FROM pg_locks WHERE pid = :p AND "
                "locktype = 'advisory' AND NOT granted", {"p": backend})
            if waiting:
                return True
            if waiting is None or proc.poll() is not None:
                return False
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - at exit: the claims simply end with this process
        return False
    return False


def _read_pid(proc, timeout: float) -> int | None:
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else b""
    try:
        return int(line)
    except ValueError:
        return None


def main() -> int:
    from sqlalchemy import func, select

    from ..storing.jobfiles import exists as job_pending, worker_running
    from .locks import compile_id
    from .server import create_engine

    spec = json.load(sys.stdin)
    held = {key: path for key, path in spec["items"]}
    namespace = spec.get("namespace")
    engine = create_engine(spec["url"], namespace)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(f"SET statement_timeout = {int(QUEUE_WAIT_S * 4000)}")
        conn.exec_driver_sql(f"SET lock_timeout = {int(QUEUE_WAIT_S * 4000)}")
        print(conn.execute(select(func.pg_backend_pid())).scalar(), flush=True)
        # Granted when the exiting process's session ends, one after the other.
        conn.execute(select(*(func.pg_advisory_lock(compile_id(k, namespace)) for k in held)))
        deadline = time.monotonic() + LIFETIME_S
        unattended: dict[Path, float] = {}  # spool -> since when no worker runs there
        checked = 0.0
        while held and time.monotonic() < deadline:
            now = time.monotonic()
            if now - checked >= 1.0:
                checked = now
                for spool in {Path(p).parent for p in held.values()}:
                    if worker_running(spool):
                        unattended.pop(spool, None)
                    else:
                        unattended.setdefault(spool, now)
            for key, path in list(held.items()):
                gone = now - unattended.get(Path(path).parent, now) >= WORKER_GONE_S
                if gone or not job_pending(Path(path)):  # stored, dropped, or unattended
                    conn.execute(select(func.pg_advisory_unlock(compile_id(key, namespace))))
                    del held[key]
            time.sleep(0.2)
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())

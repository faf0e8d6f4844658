"""The fault matrix: every cache state a user, a crash or a running kdb can leave behind,
against every ``kdb`` command (with and without ``--json``) and a small OpenCL workload run
through ``kdb.opencl.install()``.

For each state: no traceback anywhere, no hang (every process runs under a timeout), the
workload's kernels give correct results in a first and a second process, exit statuses tell
the truth (``kdb verify`` fails exactly on the states that are wrong; a repair or a clear
that says it worked did), and the workload logs at most one warning per cause.

The states are built for the workload's real arch, so the workload meets them. Each state
costs 3-5 s (three or four fresh processes). KDB_LONG_TESTS=1 runs a second workload
process against every state and also starts four workloads at once against each.

Some states are about the store worker (issue 19): the first process hands its stores to
the worker, the test waits for the worker, and the second process shows what it stored.
Others are attacks: code planted by another user must never run, a system database others
can write must never be served, and the one warning a refusal gives names the path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from kdb.file import migrate

LONG = os.environ.get("KDB_LONG_TESTS") == "1"
TESTS_DIR = Path(__file__).resolve().parent

#: Seconds any one child may run: a hang fails the test instead of stopping the suite.
CHILD_TIMEOUT = 60

#: Warnings that inform rather than report a fault (one per process, by design).
INFORMATIONAL = ("no system kernel database", "this start-up compiled")

KERNELS = [
    "__kernel void scale%d(__global int *a) { a[get_global_id(0)] = get_global_id(0) * %d; }"
    % (k, k + 2) for k in range(2)
]

#: A small workload through install(): build both kernels, run them, check the results.
#: ``replace`` (a state): clear the user tier between the two builds, as `kdb clear` from
#: another process would.
WORKLOAD = r"""
import json, logging, os, sys
class Catch(logging.Handler):
    def emit(self, record):
        sys.stderr.write("KDBWARN " + record.getMessage().replace("\n", " ") + "\n")
logging.getLogger("kdb").addHandler(Catch(logging.WARNING))
logging.getLogger("kdb").propagate = False
import numpy as np
import pyopencl as cl
import kdb, kdb.opencl
from kdb import bookkeeping; from kdb.admin import maintenance
kdb.opencl.install()
plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
ctx = cl.Context(plat.get_devices()[:1])
queue = cl.CommandQueue(ctx)
ok = []
for k, src in enumerate(KERNELS):
    if k == 1 and REPLACE:
        kdb.default_db().flush()
        user_dir = kdb.default_db().user_dir
        removed, failed = maintenance.clear(maintenance.clearable(user_dir))
        assert removed and not failed, (removed, failed)
    prg = cl.Program(ctx, src).build()
    a = np.zeros(16, np.int32)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, a.nbytes)
    getattr(prg, f"scale{k}")(queue, a.shape, None, buf)
    cl.enqueue_copy(queue, a, buf)
    ok.append(a.tolist() == [i * (k + 2) for i in range(16)])
if HEADER:  # a kernel that includes a header: its result is the header's K
    want = int(open(HEADER).read().split()[-1])
    real_build = cl._Program.build
    if EDIT == "during":  # saved after kdb read it, before the compiler does
        want += 1  # what the compiler reads
        def build(self, *args, saved="#define K %d\n" % want, **kwargs):
            with open(HEADER, "w") as f:
                f.write(saved)
            return real_build(self, *args, **kwargs)
        cl._Program.build = build
    prg = cl.Program(ctx, '#include "mx.h"\n__kernel void hk(__global int *a) '
                          '{ a[get_global_id(0)] = K; }').build(
        options=["-I", os.path.dirname(HEADER)])
    cl._Program.build = real_build
    a = np.zeros(16, np.int32)
    buf = cl.Buffer(ctx, cl.mem_flags.WRITE_ONLY, a.nbytes)
    prg.hk(queue, a.shape, None, buf)
    cl.enqueue_copy(queue, a, buf)
    ok.append(a.tolist() == [want] * 16)
    if EDIT == "after":  # edited after the build, before the store worker stores it
        with open(HEADER, "w") as f:
            f.write("#define K %d\n" % (want + 1))
print(json.dumps({"ok": ok, "compiles": len(bookkeeping.records())}))
"""

#: Every command, and the args of each; ``{arch}`` is the workload's arch.
READING = [["info"], ["ls"], ["stats"], ["log"], ["explain", "scale0"], ["verify"],
           ["migrate", "--check"]]
CHANGING = [["verify", "--repair"], ["verify"], ["migrate"], ["evict", "--to", "1G"],
            ["clear", "--yes"], ["ls", "--tier", "user"]]
COMMANDS = len({" ".join(c) for c in READING + CHANGING}) * 2

#: Runs kdb commands in one process through click's CliRunner; prints what each did.
CLI_CHILD = r"""
import json, logging, sys, traceback
from click.testing import CliRunner
from kdb.cli import cli
seen = []
class Catch(logging.Handler):
    def emit(self, record):
        seen.append(record.getMessage())
logging.getLogger("kdb").addHandler(Catch(logging.WARNING))
logging.getLogger("kdb").propagate = False
out = []
for args in json.loads(sys.argv[1]):
    del seen[:]
    r = CliRunner().invoke(cli, args, catch_exceptions=True)
    tb = None
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        tb = "".join(traceback.format_exception(*r.exc_info))
    try:
        json.loads(r.stdout)
        is_json = True
    except ValueError:
        is_json = False
    out.append({"args": args, "code": r.exit_code, "json": is_json, "stdout": r.stdout[-4000:],
                "stderr": r.stderr[-2000:], "traceback": tb, "warnings": list(seen)})
print("RESULTS " + json.dumps(out))
"""


# -- states ----------------------------------------------------------------------------------

@dataclass
class Case:
    """A built state: the environment the commands and the workload run in."""

    root: Path
    arch: str
    env: dict[str, str] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # e.g. setpriv: root's override dropped
    facts: dict = field(default_factory=dict)  # what the state's check looks at
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    @property
    def cache(self) -> Path:
        path = Path(self.env["KDB_CACHE_DIR"])
        return path if path.is_absolute() else self.root / path  # as the children see it

    @property
    def user_file(self) -> Path:
        return self.cache / "v1" / f"{self.arch}.kdb"

    def close(self) -> None:
        for undo in reversed(self.cleanups):
            try:
                undo()
            except Exception:  # noqa: BLE001 - tear down the rest
                pass
        self.cleanups.clear()


@dataclass(frozen=True)
class State:
    build: Callable[[Case, Path], None]  # (case, good template file)
    verify: int | None  # exit status `kdb verify` must give: 0 sound (or nothing there),
    # 1 wrong; None: either, as long as plain and --json agree (a spool's state, which the
    # store worker, not verify, is answerable for)
    cli: int | None = None  # every command's exit status, when the state fixes it (settings)
    replace: bool = False  # the workload clears the user tier between its builds
    needs: str = ""  # "setpriv", "mount", "runuser": skipped where this machine does not
    # allow it
    #: The first process hands its stores to the store worker (KDB_STORE_AT_EXIT=detach);
    #: the test waits for the worker before the second process, which must then compile
    #: nothing when ``stored`` is set.
    detach: bool = False
    stored: bool = False
    header: bool = False  # the workload builds a kernel that includes root/inc/mx.h
    #: When the first process edits that header: "after" its build, or "during" it (after
    #: kdb digested it, before the compiler reads it).
    edit: str = "after"
    #: Checks after the workload's processes (the case still open): what the state is about.
    check: Callable[[Case, list[str]], None] | None = None


def _copy_good(case: Case, good: Path, dest: Path | None = None) -> Path:
    dest = dest or case.user_file
    dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(dest.parent, 0o700)
    os.chmod(dest.parent.parent, 0o700)
    shutil.copy(good, dest)
    os.chmod(dest, 0o600)
    return dest


def _user_dir(case: Case) -> Path:
    d = case.cache / "v1"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(case.cache, 0o700)
    return d


def _sql(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for s in statements:
            conn.execute(s)
    finally:
        conn.close()


def _stopped(case: Case, code: str) -> None:
    """Start a child that sets something up, then stops itself (SIGSTOP) holding it."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            env={**os.environ, **case.env}, stdout=subprocess.DEVNULL)
    case.cleanups.append(lambda: (proc.kill(), proc.wait(10)))
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"holder exited ({status}) before stopping"


HOLD_LOCK = """
    import fcntl, os, signal, sqlite3, sys
    path = sys.argv[1] if len(sys.argv) > 1 else {path!r}
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    {more}
    os.kill(os.getpid(), signal.SIGSTOP)
"""


def _missing(case, good):
    pass


def _empty_dir(case, good):
    _user_dir(case)


def _good(case, good):
    _copy_good(case, good)


def _zero_byte(case, good):
    _user_dir(case)
    case.user_file.touch(mode=0o600)


def _tableless(case, good):
    """What a first write leaves for a moment: WAL mode set, no tables yet."""
    _zero_byte(case, good)
    _sql(case.user_file, "PRAGMA journal_mode=WAL")


def _random_bytes(case, good):
    _copy_good(case, good).write_bytes(os.urandom(16384))


def _truncated(case, good):
    p = _copy_good(case, good)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _directory(case, good):
    _user_dir(case)
    case.user_file.mkdir(mode=0o700)


def _fifo_user(case, good):
    _user_dir(case)
    os.mkfifo(case.user_file, 0o600)


def _fifo_system(case, good):
    _copy_good(case, good)
    sysdir = case.root / "system"
    sysdir.mkdir()
    os.mkfifo(sysdir / f"{case.arch}.kdb", 0o600)
    case.env["KDB_SYSTEM_DB_PATH"] = str(sysdir)


def _future(case, good):
    _sql(_copy_good(case, good), "UPDATE alembic_version SET version_num = '9999'")


def _foreign(case, good):
    _user_dir(case)
    _sql(case.user_file, "CREATE TABLE photos (id INTEGER PRIMARY KEY, jpeg BLOB)")
    os.chmod(case.user_file, 0o600)


def _other_owner(case, good):
    os.chown(_copy_good(case, good), 65534, 65534)


def _world_writable(case, good):
    os.chmod(_copy_good(case, good), 0o666)


def _group_writable_dir(case, good):
    _copy_good(case, good)
    os.chmod(case.user_file.parent, 0o770)


def _wal_system(case, good):
    sysdir = case.root / "system"
    _copy_good(case, good, sysdir / f"{case.arch}.kdb")  # the template is in WAL mode
    case.env["KDB_SYSTEM_DB_PATH"] = str(sysdir)


def _old_revision(case, good):
    _user_dir(case)
    migrate.upgrade_sqlite(case.user_file, migrate.REVISIONS[1])
    os.chmod(case.user_file, 0o600)
    _sql(case.user_file, "PRAGMA journal_mode=WAL")


def _entries_at_0005(case, good):
    """The sound file as kdb at revision 0005 left it, entries and all (whole attributes
    text): read as it is, upgraded in place (compact attributes) by its next write."""
    from test_compact import _downgrade

    _downgrade(_copy_good(case, good), "0005")


def _full_disk_at_0005(case, good):
    """A file at revision 0005 on a disk with less free space than the file (room for its
    journal, not for its copy): its upgrade, every entry rewritten in one transaction,
    cannot be written (issue 37 item 13)."""
    from test_compact import _downgrade

    old = _copy_good(case, good, case.root / "old" / "v1" / "a.kdb")
    _downgrade(old, "0005")  # made off the small disk: the downgrade needs room too
    size = old.stat().st_size
    _mount(case, "-t", "tmpfs", "-o", f"size={3 * size + (256 << 10)},mode=0700", "tmpfs")
    case.env["KDB_CACHE_DIR"] = str(case.root / "mnt")
    _copy_good(case, old)
    free = os.statvfs(case.root / "mnt").f_bavail * os.statvfs(case.root / "mnt").f_frsize
    with open(case.root / "mnt" / "filler", "wb") as f:
        f.write(b"\0" * max(free - size // 2, 0))


def _upgrade_room_named(case: Case, warnings: list[str]) -> None:
    """The warning says the disk is full and how much room the upgrade needs; the file is
    left as it was."""
    from conftest import sql

    said = [w for w in warnings if "could not be upgraded" in w]
    assert said and all("file system is full" in w and "MiB free beside the file" in w
                        for w in said), warnings
    assert sql(case.user_file, "SELECT version_num FROM alembic_version") == [("0005",)]


def _upgraded_in_place(case: Case, warnings: list[str]) -> None:
    from conftest import sql

    assert sql(case.user_file, "SELECT version_num FROM alembic_version") == [(migrate.HEAD,)]
    assert sql(case.user_file, "SELECT count(*) FROM sources")[0][0] > 0


def _lost_sources(case, good):
    """A file whose entries name sources its table lacks (a hand edit): a hit reads a digest
    and goes on; `kdb verify` names the entries and `--repair` drops them."""
    _sql(_copy_good(case, good), "DELETE FROM sources")


def _cache_is_file(case, good):
    (case.root / "file").write_text("not a directory")
    case.env["KDB_CACHE_DIR"] = str(case.root / "file")


def _cache_is_devnull(case, good):
    case.env["KDB_CACHE_DIR"] = "/dev/null"


def _read_only_dir(case, good):
    _copy_good(case, good)
    os.chmod(case.user_file.parent, 0o500)
    case.cleanups.append(lambda: os.chmod(case.user_file.parent, 0o700))
    case.prefix = _without_dac_override(case.root / "probe")


def _mount(case: Case, *args: str) -> None:
    target = case.root / "mnt"
    target.mkdir(exist_ok=True)
    subprocess.run(["mount", *args, str(target)], check=True, capture_output=True)
    case.cleanups.append(lambda: subprocess.run(["umount", "-l", str(target)],
                                                capture_output=True))


def _read_only_mount(case, good):
    src = case.root / "src"
    case.env["KDB_CACHE_DIR"] = str(src)
    _copy_good(case, good)
    _mount(case, "--bind", str(src))
    subprocess.run(["mount", "-o", "remount,bind,ro", str(case.root / "mnt")], check=True,
                   capture_output=True)
    case.env["KDB_CACHE_DIR"] = str(case.root / "mnt")


def _full_disk(case, good):
    _mount(case, "-t", "tmpfs", "-o", f"size={good.stat().st_size + (64 << 10)},mode=0700",
           "tmpfs")
    case.env["KDB_CACHE_DIR"] = str(case.root / "mnt")
    _copy_good(case, good)
    fd = os.open(case.root / "mnt" / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # every free block taken
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def _stuck_upgrader(case, good):
    """A file at an old revision whose upgrader stopped holding the upgrade lock."""
    _old_revision(case, good)
    _stopped(case, HOLD_LOCK.format(path=str(case.user_file), more=""))
    case.env["KDB_LOCK_TIMEOUT"] = "0.3"


def _being_migrated(case, good):
    """Stopped inside the upgrade: the lock and SQLite's write lock held, DDL uncommitted."""
    _old_revision(case, good)
    more = ("conn = sqlite3.connect(path, isolation_level=None); "
            "conn.execute('BEGIN IMMEDIATE'); conn.execute('CREATE TABLE half_done (x)')")
    _stopped(case, HOLD_LOCK.format(path=str(case.user_file), more=more))
    case.env["KDB_LOCK_TIMEOUT"] = "0.3"


def _being_created(case, good):
    """A first write stopped between creating the file and creating its tables."""
    _tableless(case, good)
    _stopped(case, HOLD_LOCK.format(path=str(case.user_file), more=""))
    case.env["KDB_LOCK_TIMEOUT"] = "0.3"


def _stores_pending(case, good):
    """A live process's commits still in the -wal (not checkpointed), a store job queued for
    the store worker, and a hand-off spec an older kdb left behind."""
    _copy_good(case, good)
    _stopped(case, f"""
        import os, signal
        from kdb import HashAttributes, KernelDB
        db = KernelDB(use_system=False)
        assert db.put(HashAttributes(backend="test", source="pending", arch={case.arch!r},
                                     name="pending"), b"pending binary")
        os.kill(os.getpid(), signal.SIGSTOP)
    """)
    assert Path(str(case.user_file) + "-wal").stat().st_size > 0
    (case.user_file.parent / ".handoff-1-2.json").touch(mode=0o600)  # an older kdb's
    # A compile whose binaries the store worker has not stored yet (no worker runs for it).
    import json
    import time

    spool = case.user_file.parent / "spool" / "0000000000000000"
    spool.mkdir(parents=True, mode=0o700)
    job = {"kind": "store", "backend": "opencl", "seconds": 0.1, "entries": [],
           "logs": [["ab" * 32, "pending_kernel", case.arch, "opencl", 0.1, "user",
                     "not in any tier", time.time(), 1]]}
    (spool / f"{time.time_ns():020d}-1-1.job").write_text(json.dumps(job))


def _stuck_claim(case, good):
    """A process stopped while compiling the first kernel, holding its claim."""
    _user_dir(case)
    _stopped(case, """
        import os, signal
        import kdb.backends.opencl as ocl
        real = ocl.cl
        class Stop:
            def __getattr__(self, name):
                return getattr(real, name)
            def _Program(self, *args):
                if len(args) == 2:  # built from source: the claim is held now
                    os.kill(os.getpid(), signal.SIGSTOP)
                return real._Program(*args)
        ocl.cl = Stop()
        import pyopencl as cl
        plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
        ocl.build(cl.Context(plat.get_devices()[:1]), %r)
    """ % KERNELS[0])
    case.env["KDB_WAIT_TIMEOUT"] = "1"


def _bad_setting(case, good):
    _copy_good(case, good)
    case.env["KDB_CACHE_MAX_SIZE"] = "9" * 400


# -- states of issue 19: the store worker's spool, and attacks -------------------------------

RUNUSER = "/usr/sbin/runuser"
#: A spool no process of the workload's environment writes to: met as another's leftovers.
PLANTED_DIGEST = "0123456789abcdef"


def _pocl(good: Path) -> Path:
    return good.parents[2] / "pocl"  # the template's PoCL cache (see the fixture)


def _child_env(case: Case, good: Path) -> dict[str, str]:
    """The environment of the workload's first process (the spool it writes to is keyed by it)."""
    return {**os.environ, **case.env, "POCL_CACHE_DIR": str(_pocl(good))}


def _planted_files(case: Case, exe: Path) -> tuple[str, str, str, str]:
    """environment.json naming an executable ``exe`` that leaves a marker, and one job."""
    marker = case.root / "planted-ran"
    case.facts["marker"] = marker
    job = {"kind": "store", "backend": "opencl", "seconds": 0.1, "entries": [], "logs": []}
    return (json.dumps({"executable": str(exe), "variables": []}), json.dumps(job),
            f"#!/bin/sh\ntouch '{marker}'\n", str(exe))


def _planted_by_nobody(case, good):
    """Another user made the cache directory first (``/tmp/kdb``) and planted a spool whose
    environment.json names their executable, plus one job."""
    base = Path(tempfile.mkdtemp(prefix="kdb-planted-", dir="/tmp"))
    os.chmod(base, 0o1777)  # like /tmp: nobody makes base/kdb first
    case.cleanups.append(lambda: shutil.rmtree(base, ignore_errors=True))
    case.env["KDB_CACHE_DIR"] = str(base / "kdb")
    case.env["KDB_STORE_AT_EXIT"] = "detach"  # the process starts workers while it runs
    spool = base / "kdb" / "v1" / "spool" / PLANTED_DIGEST
    env_json, job, script, exe = _planted_files(case, base / "kdb" / "planted.sh")
    subprocess.run([RUNUSER, "-u", "nobody", "--", "sh", "-c",
                    'umask 022 && mkdir -p "$1" && printf %s "$2" > "$1/environment.json" && '
                    'printf %s "$3" > "$1/00000000000000001000-1-1.job" && '
                    'printf %s "$4" > "$5" && chmod 755 "$5"',
                    "sh", str(spool), env_json, job, script, exe], check=True, timeout=30)
    assert (spool / "environment.json").stat().st_uid == 65534
    case.facts.update(refused=base / "kdb", planted="00000000000000001000-1-1")


def _world_writable_spool(case, good):
    """The user's own cache, but a spool directory anyone can write (0777): what is in it may
    be anyone's (an environment.json naming an executable, one job)."""
    _user_dir(case)  # no entries: the workload compiles, spools, and meets the spool
    case.env["KDB_STORE_AT_EXIT"] = "detach"
    spool = case.cache / "v1" / "spool" / PLANTED_DIGEST
    spool.mkdir(parents=True, mode=0o700)
    os.chmod(spool, 0o777)
    env_json, job, script, exe = _planted_files(case, case.root / "planted.sh")
    Path(exe).write_text(script)
    os.chmod(exe, 0o755)
    (spool / "environment.json").write_text(env_json)
    (spool / "00000000000000001000-1-1.job").write_text(job)
    case.facts.update(refused=spool, planted="00000000000000001000-1-1")


def _marks_leading_nowhere(case, good):
    """The workload's keys marked as stored by jobs that will not come (issue 28): one in a
    spool anyone can write (beside an environment.json naming an executable), one gone, one
    mark naming a path outside any spool. The workload must compile, never wait or run them."""
    _world_writable_spool(case, good)
    conn = sqlite3.connect(good)
    try:
        keys = [r[0] for r in conn.execute("SELECT key FROM kernels ORDER BY key")]
    finally:
        conn.close()
    claims = case.cache / "v1" / "claims"
    claims.mkdir(mode=0o700)
    targets = [f"../spool/{PLANTED_DIGEST}/{case.facts['planted']}",
               f"../spool/{PLANTED_DIGEST}/00000000000000002000-1-1", "../../../etc/passwd"]
    for key, target in zip(keys, targets):
        os.symlink(target, claims / f"{key}.queued")
    case.facts["gone"] = claims / f"{keys[1]}.queued"


def _marks_not_followed(case: Case, warnings: list[str]) -> None:
    assert not os.path.lexists(case.facts["gone"]) or os.readlink(case.facts["gone"]) != \
        f"../spool/{PLANTED_DIGEST}/00000000000000002000-1-1", "a mark of a gone job was kept"
    _planted_not_run(case, warnings)


def _planted_not_run(case: Case, warnings: list[str]) -> None:
    """Neither the workload nor ``kdb pack --from-log`` (which waits for the spool's jobs,
    starting workers) runs the planted executable."""
    argv = [sys.executable, "-c", "from kdb.cli import cli; cli()", "pack", "--arch", "native",
            "--from-log", "--out", str(case.root / "packed")]
    pack = subprocess.Popen(argv, env={**os.environ, **case.env}, cwd=case.root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = pack.communicate(timeout=60)  # a few seconds; it once waited 900 s
    except subprocess.TimeoutExpired:
        os.killpg(pack.pid, signal.SIGKILL)
        out, err = pack.communicate()
        err += "\n(still waiting after 60 s: killed)"
    time.sleep(0.3)  # a worker started at a process's exit has had time to begin
    assert not case.facts["marker"].exists(), \
        ("kdb ran the executable another user planted in a spool directory", err[-2000:])
    assert pack.returncode is not None and pack.returncode >= 0, err[-2000:]
    assert "Traceback" not in out + err, err[-3000:]
    named = [w for w in warnings if str(case.facts["refused"]) in w]
    assert named, (f"no warning names {case.facts['refused']}", warnings)


def _forged(good: Path) -> Path:
    return good.parents[2] / "forged" / good.name  # built by the fixture


def _writable_system(case, good):
    """A system directory anyone can write (0777) holding a file anyone can write (0666),
    swapped for one that serves a wrong binary under a workload kernel's key."""
    _user_dir(case)  # an empty user tier: the workload looks in the system tier
    sysdir = case.root / "system"
    sysdir.mkdir()
    os.chmod(sysdir, 0o777)
    shutil.copy(_forged(good), sysdir / good.name)
    os.chmod(sysdir / good.name, 0o666)
    case.env["KDB_SYSTEM_DB_PATH"] = str(sysdir)
    case.facts["refused"] = sysdir


def _writable_parent(case, good):
    """The user's own private cache in a directory anyone can write (0777, not sticky):
    anyone could rename the cache away and put theirs in its place between two opens (a
    new thread's, a forked child's), so it is refused from the first (issue 27)."""
    parent = case.root / "open"
    parent.mkdir()
    case.env["KDB_CACHE_DIR"] = str(parent / "cache")
    _copy_good(case, good)
    os.chmod(parent, 0o777)
    case.facts["refused"] = parent


def _refusal_named(case: Case, warnings: list[str]) -> None:
    assert [w for w in warnings if str(case.facts["refused"]) in w], \
        (f"no warning names {case.facts['refused']}", warnings)


def _spool_of(case: Case, good: Path) -> Path:
    """The spool directory the workload's first process writes its jobs to."""
    code = "import sys; from kdb.storing import spool; print(spool.spool_dir(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(case.cache / "v1")],
                          env=_child_env(case, good), capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, cwd=case.root, check=True)
    return Path(proc.stdout.strip())


MALFORMED = ("[1]", '{"entries": [1]}', '{"seconds": "x"}',
             # refresh jobs (kdb.backends.opencl.refresh) that are not: dropped, logged
             '{"kind": "refresh", "backend": "opencl", "refresh": [1]}',
             '{"kind": "refresh", "backend": "opencl", "refresh": {"pocl_cache": "/", '
             '"entries": [["../../x", "k"], ["a"]]}}')


def _malformed_jobs(case, good):
    """Jobs that are JSON but not jobs, queued (oldest first) in the spool the workload
    writes to."""
    _user_dir(case)
    case.env["KDB_STORE_AT_EXIT"] = "detach"
    spool = _spool_of(case, good)
    spool.mkdir(parents=True, mode=0o700, exist_ok=True)
    names = []
    for i, text in enumerate(MALFORMED):
        names.append(f"{1000 + i:020d}-1-{i}")
        fd = os.open(spool / (names[-1] + ".job"), os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    case.facts["malformed"] = names


def _malformed_set_aside(case: Case, warnings: list[str]) -> None:
    log = (case.cache / "v1" / "store-worker.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    for name in case.facts["malformed"]:
        assert name in log, (f"the store worker's log does not name {name}", log[-3000:])


_NO_WORKER = """
import kdb.storing.spool
kdb.storing.spool.ensure_worker = lambda *args: None  # the worker that took them is gone
"""


def _dead_taken(case, good):
    """The workload's own store jobs, taken (``.taken``) by a worker that is gone."""
    _user_dir(case)
    case.env["KDB_STORE_AT_EXIT"] = "detach"
    proc = subprocess.run([sys.executable, "-c", _NO_WORKER + _workload_code(False)],
                          env=_child_env(case, good), capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, cwd=case.root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = list((case.cache / "v1" / "spool").glob("*/*.job"))
    assert jobs, "the workload left no store job"
    for job in jobs:
        os.rename(job, job.with_suffix(".taken"))


def _taken_again(case: Case, warnings: list[str]) -> None:
    left = list((case.cache / "v1" / "spool").glob("*/*.taken"))
    assert not left, f"a .taken whose worker is gone was never taken again: {left}"


def _relative_cache(case, good):
    """KDB_CACHE_DIR relative to the workload's working directory."""
    case.env["KDB_CACHE_DIR"] = "relc"
    case.env["KDB_STORE_AT_EXIT"] = "detach"


def _nothing_piled_up(case: Case, warnings: list[str]) -> None:
    from kdb.storing import spool

    left = spool.jobs(case.cache / "v1")
    assert not left, f"store jobs never stored: {left}"


def _header_edited(case, good):
    """The workload includes a header; its first process edits it right after the build
    (the store worker has not stored yet); the test restores it before the second."""
    _user_dir(case)
    case.env["KDB_STORE_AT_EXIT"] = "detach"
    _header_dir(case)


HEADER_NAME, HEADER_TEXT = "mx.h", "#define K 2\n"


def _header_dir(case) -> None:
    """The header's directory, in the temporary directory but built from as it is: a link
    in it refuses kdb's copy (kdb.backends.opencl.tempincludes), so an edit reaches the
    compiler (a copied one shields it: tests/test_early.py)."""
    (case.root / "inc").mkdir()
    (case.root / "inc" / HEADER_NAME).write_text(HEADER_TEXT)
    (case.root / "inc" / "link.h").symlink_to(HEADER_NAME)


def _header_saved(case, good):
    """The workload includes a header, which its first process saves while it compiles
    (``KDB_STORE_AT_EXIT=wait``: it stores itself); the test restores it before the second."""
    _user_dir(case)
    _header_dir(case)


def _header_named(case: Case, warnings: list[str]) -> None:
    assert any(f"header {HEADER_NAME!r} was edited" in w for w in warnings), warnings


def _tampered_copy(case, good):
    """The workload includes a header from a directory kdb builds from a copy of
    (kdb.backends.opencl.tempincludes); the copy in the cache, under the name of the
    header's digest, says another K (edited, or planted by a process of this user)."""
    from kdb.backends.opencl import tempincludes

    _user_dir(case)
    (case.root / "inc").mkdir()
    (case.root / "inc" / HEADER_NAME).write_text(HEADER_TEXT)
    name = tempincludes.digest_of(tempincludes.files_of(str(case.root / "inc")))
    planted = case.cache / "v1" / "includes" / name
    planted.mkdir(parents=True)
    (planted / HEADER_NAME).write_text("#define K 7\n")
    case.facts["copy"] = str(planted)


def _copy_made_again(case: Case, warnings: list[str]) -> None:
    assert (Path(case.facts["copy"]) / HEADER_NAME).read_text() == HEADER_TEXT


def _drain(case: Case, ignore: set[str], timeout: float = 45) -> None:
    """Wait until the store worker stored every job (but ``ignore``), or none runs to."""
    from kdb.storing import spool

    user_dir = case.cache / "v1"
    deadline, idle = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if not [p for p in spool.jobs(user_dir) if p.stem not in ignore]:
            return
        if any(spool.worker_running(d) for d in (user_dir / "spool").iterdir()
               if d.is_dir() and d.name != PLANTED_DIGEST):
            idle = None
        elif idle is None:
            idle = time.monotonic()
        elif time.monotonic() - idle > 1.5:
            return  # jobs left and no worker: the check says what that means
        time.sleep(0.1)


def _full_disk_detach(case, good):
    """A full disk, the stores going to the store worker (the default)."""
    _full_disk(case, good)
    case.env["KDB_STORE_AT_EXIT"] = "detach"


def _nothing_queued(case: Case, warnings: list[str]) -> None:
    """No store job was written to the full disk (tests/test_spool.py has a disk with room
    for jobs but not for the stores)."""
    from kdb.storing import spool

    assert not spool.jobs(case.cache / "v1"), "store jobs queued on a full disk"


def _pocl_uncached(case, good):
    """A sound user file, PoCL's kernel cache off (``POCL_KERNEL_CACHE=0``, as MIRGE-Com's
    documentation has users run): every build loads a stored binary."""
    _copy_good(case, good)
    case.env["POCL_KERNEL_CACHE"] = "0"


def _loaded_together(case: Case, warnings: list[str]) -> None:
    """Four workloads at once, one PoCL directory between them (as ``~/.cache/pocl/uncached``
    is), all served: none may delete the directory another's loaded program uses."""
    shared = case.root / "pocl-uncached"
    env = {**os.environ, **case.env, "POCL_CACHE_DIR": str(shared)}
    procs = [subprocess.Popen([sys.executable, "-c", _workload_code(False)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=case.root) for _ in range(4)]
    for p in procs:
        try:
            out, err = p.communicate(timeout=CHILD_TIMEOUT * 2)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("hang: workloads loading binaries at once")
        assert p.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got["ok"] == [True] * len(KERNELS) and got["compiles"] == 0, (got, err[-2000:])
    assert not [p for p in shared.iterdir() if p.name.startswith("_UNCACHED_kdb")]


STATES: dict[str, State] = {
    "missing": State(_missing, 0),
    "empty-dir": State(_empty_dir, 0),
    "sound": State(_good, 0),
    "zero-byte-file": State(_zero_byte, 0),
    "table-less-file": State(_tableless, 0),
    "random-bytes": State(_random_bytes, 1),
    "truncated": State(_truncated, 1),
    "directory-as-file": State(_directory, 1),
    "fifo-user-file": State(_fifo_user, 1),
    "fifo-system-file": State(_fifo_system, 1),
    "future-revision": State(_future, 1),
    "foreign-sqlite": State(_foreign, 1),
    "other-owner": State(_other_owner, 1),
    "world-writable-file": State(_world_writable, 1),
    "group-writable-dir": State(_group_writable_dir, 1),
    "wal-mode-system-file": State(_wal_system, 1),
    "old-revision": State(_old_revision, 0),
    "entries-at-revision-0005": State(_entries_at_0005, 0, check=_upgraded_in_place),
    "lost-sources": State(_lost_sources, 1),
    "cache-dir-is-a-file": State(_cache_is_file, 0, cli=2),  # refused as --cache-dir FILE is
    "cache-dir-is-dev-null": State(_cache_is_devnull, 0, cli=2),
    "read-only-dir": State(_read_only_dir, 0, needs="setpriv"),
    "read-only-mount": State(_read_only_mount, 0, needs="mount"),
    "full-disk": State(_full_disk, 0, needs="mount"),
    "full-disk-at-revision-0005": State(_full_disk_at_0005, 0, needs="mount",
                                        check=_upgrade_room_named),
    "stuck-upgrader": State(_stuck_upgrader, 0),
    "being-migrated": State(_being_migrated, 0),
    "being-created": State(_being_created, 0),
    "stores-pending": State(_stores_pending, 0),
    "stuck-claim-holder": State(_stuck_claim, 0),
    "replaced-under-a-process": State(_empty_dir, 0, replace=True),
    "bad-setting": State(_bad_setting, 0, cli=2),
    # issue 19
    "planted-spool": State(_planted_by_nobody, None, needs="runuser", detach=True,
                           check=_planted_not_run),
    "world-writable-spool": State(_world_writable_spool, None, detach=True,
                                  check=_planted_not_run),
    "world-writable-system-dir": State(_writable_system, 1, check=_refusal_named),
    "malformed-job": State(_malformed_jobs, None, detach=True, stored=True,
                           check=_malformed_set_aside),
    "dead-taken-job": State(_dead_taken, None, detach=True, stored=True, check=_taken_again),
    "relative-cache-dir": State(_relative_cache, 0, detach=True, stored=True,
                                check=_nothing_piled_up),
    "header-edited-before-store": State(_header_edited, 0, detach=True, header=True),
    # issue 27
    "cache-in-a-world-writable-dir": State(_writable_parent, 1, check=_refusal_named),
    "full-disk-detach": State(_full_disk_detach, 0, needs="mount", detach=True,
                              check=_nothing_queued),
    "pocl-kernel-cache-off": State(_pocl_uncached, 0, check=_loaded_together),
    # issue 28
    "queued-marks-leading-nowhere": State(_marks_leading_nowhere, None, detach=True,
                                          check=_marks_not_followed),
    "header-saved-while-compiling": State(_header_saved, 0, header=True, edit="during",
                                          check=_header_named),
    # issue 35
    "tampered-include-copy": State(_tampered_copy, 0, header=True, edit="",
                                   check=_copy_made_again),
}


def _without_dac_override(probe_dir: Path) -> list[str]:
    from test_faults import _without_dac_override as probe

    prefix = probe(probe_dir)
    if prefix is None:
        pytest.skip("cannot drop root's permission override here (no setpriv)")
    return prefix


def _can_mount(tmp: Path) -> bool:
    if os.getuid() != 0 or shutil.which("mount") is None:
        return False
    target = tmp / "mount-probe"
    target.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)],
                          capture_output=True)
    if proc.returncode == 0:
        subprocess.run(["umount", str(target)], capture_output=True)
    return proc.returncode == 0


# -- running ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def template(tmp_path_factory, cl_ctx) -> tuple[Path, str, Path]:
    """A sound user file holding the workload's kernels (WAL mode), the device's arch, and
    a PoCL cache that holds them: every state's builds are then PoCL cache hits (cheap)."""
    from kdb.backends.opencl import arch_of

    arch = arch_of(cl_ctx.devices[0])
    root = tmp_path_factory.mktemp("matrix-template")
    env = {**os.environ, "KDB_CACHE_DIR": str(root / "cache"),
           "POCL_CACHE_DIR": str(root / "pocl")}
    proc = subprocess.run([sys.executable, "-c", _workload_code(False)], env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT * 2)
    assert proc.returncode == 0, proc.stderr
    good = root / "cache" / "v1" / f"{arch}.kdb"
    assert good.is_file()
    _forge(good, arch, env)
    return good, arch, root / "pocl"


def _forge(good: Path, arch: str, env: dict[str, str]) -> None:
    """A system file of the workload's entries but for one: ``scale0``'s binary is that of
    another source (``* 7``), placed under the workload's key with its checksum, as another
    user who can write the file would. Proved served when nothing refuses the file."""
    from kdb.pack.systemfile import write_system_db

    root = good.parents[2]
    evil = [KERNELS[0].replace("* 2;", "* 7;"), KERNELS[1]]
    proc = subprocess.run([sys.executable, "-c", _workload_code(False, kernels=evil)],
                          env={**env, "KDB_CACHE_DIR": str(root / "evil-cache")},
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT * 2)
    assert proc.returncode == 0, proc.stderr
    forged = _forged(good)
    forged.parent.mkdir()
    write_system_db(forged, arch, [good])
    cols = "codec, dict_id, blob, raw_size, stored_size, checksum"
    src = sqlite3.connect(root / "evil-cache" / "v1" / good.name)
    row = src.execute(f"SELECT {cols} FROM kernels WHERE name = 'scale0'").fetchone()  # noqa: S608
    src.close()
    conn = sqlite3.connect(forged, isolation_level=None)
    try:
        n = conn.execute(f"UPDATE kernels SET ({cols}) = (?, ?, ?, ?, ?, ?) "  # noqa: S608
                         "WHERE name = 'scale0'", row).rowcount
        for total in ("raw_bytes", "stored_bytes"):  # the file's running totals agree
            conn.execute(f"UPDATE meta SET value = (SELECT CAST(sum({total.split('_')[0]}"
                         f"_size) AS TEXT) FROM kernels) WHERE name = '{total}'")  # noqa: S608
    finally:
        conn.close()
    assert n == 1, n
    proc = subprocess.run([sys.executable, "-c", _workload_code(False)],
                          env={**env, "KDB_CACHE_DIR": str(root / "forged-cache"),
                               "KDB_SYSTEM_DB_PATH": str(forged.parent)},
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ok"] == [False, True], (got, proc.stderr[-2000:])  # the forged one served


def _workload_code(replace: bool, header: Path | None = None, edit: str = "",
                   kernels: list[str] = KERNELS) -> str:
    head = None if header is None else str(header)
    return (f"KERNELS = {kernels!r}\nREPLACE = {replace!r}\nHEADER = {head!r}\n"
            f"EDIT = {edit!r}\n" + WORKLOAD)


def _run(case: Case, argv: list[str], env: dict[str, str | None] | None = None):
    full = {**os.environ, **case.env, **(env or {})}
    full = {k: v for k, v in full.items() if v is not None}  # None: unset
    try:
        return subprocess.run(case.prefix + argv, env=full, capture_output=True, text=True,
                               timeout=CHILD_TIMEOUT, cwd=case.root)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"hang: {argv[-1][:60]!r} ran past {CHILD_TIMEOUT} s\n{err.stderr}")


def _commands(case: Case, commands: list[list[str]], name: str) -> list[dict]:
    proc = _run(case, [sys.executable, "-c", CLI_CHILD, json.dumps(commands)])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, (name, proc.stdout[-3000:], proc.stderr[-3000:])
    results = json.loads(lines[-1][len("RESULTS "):])
    for r in results:
        what = (name, r["args"], r["code"], r["stdout"][-1500:], r["stderr"][-800:])
        assert r["traceback"] is None, (name, r["args"], r["traceback"])
        assert "Traceback" not in r["stdout"] + r["stderr"], what
        assert r["code"] in (0, 1, 2), what
        if "--json" in r["args"] and r["code"] != 2 and (r["code"] == 0 or r["args"][0] in (
                "verify", "migrate", "evict", "clear")):
            assert r["json"], what  # the whole of stdout is JSON, also on a problem
        doubled = {w for w in r["warnings"] if r["warnings"].count(w) > 1}
        assert not doubled, (name, r["args"], doubled)
    return results


def _workload(case: Case, state: State, pocl: Path, replace: bool = False,
              env: dict[str, str | None] | None = None, header: Path | None = None,
              edit: str = "") -> dict:
    proc = _run(case, [sys.executable, "-c", _workload_code(replace, header, edit)],
                {"POCL_CACHE_DIR": str(pocl), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, \
        proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # correct results, whatever the cache
    assert got["ok"] == [True] * (len(KERNELS) + (header is not None)), got
    notes = [ln[len("KDBWARN "):] for ln in proc.stderr.splitlines()
             if ln.startswith("KDBWARN ") and not any(i in ln for i in INFORMATIONAL)]
    assert len(notes) <= 1, "\n".join(notes)  # one state, one cause: at most one warning
    got["warnings"] = notes
    return got


def _concurrent(case: Case, tmp_path: Path, n: int) -> None:
    env = {k: v for k, v in {**os.environ, **case.env}.items()}
    procs = [subprocess.Popen(case.prefix + [sys.executable, "-c", _workload_code(False)],
                              env={**env, "POCL_CACHE_DIR": str(tmp_path / f"pocl-{i}")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=case.root) for i in range(n)]
    for p in procs:
        try:
            out, err = p.communicate(timeout=CHILD_TIMEOUT * 2)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("hang: a concurrent workload ran past its limit")
        assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["ok"] == [True] * len(KERNELS)


#: States after which the first process stored what it compiled.
STORED = {"missing", "empty-dir", "zero-byte-file", "table-less-file", "old-revision",
          "random-bytes", "truncated", "foreign-sqlite"}
#: States that get a second workload process (every state with KDB_LONG_TESTS=1): those
#: above, and those where it compiles again and, by default, hands its stores off at exit.
SECOND_RUN = STORED | {"replaced-under-a-process", "cache-dir-is-a-file", "read-only-mount",
                       "full-disk", "other-owner", "future-revision", "stores-pending",
                       "header-saved-while-compiling"}


@pytest.mark.parametrize("name", list(STATES))
def test_every_command_and_a_workload_survive_the_state(name, template, tmp_path, cl_ctx):
    state = STATES[name]
    good, arch, pocl = template
    if state.needs == "mount" and not _can_mount(tmp_path):
        pytest.skip("mounting a tmpfs or a read-only bind mount is not allowed here")
    if state.needs == "runuser" and (os.getuid() != 0 or not os.access(RUNUSER, os.X_OK)):
        pytest.skip(f"acting as user nobody needs root and {RUNUSER}")

    def built() -> Case:
        # No nvcc: `kdb info` would run it once per fresh cache (~0.5 s), and CUDA is not
        # what these states are about.
        case = Case(tmp_path / "state", arch, {"KDB_CACHE_DIR": str(tmp_path / "state" / "cache"),
                                               "KDB_STORE_AT_EXIT": "wait",
                                               "KDB_NVCC": str(tmp_path / "no-nvcc")})
        if case.root.exists():
            shutil.rmtree(case.root, ignore_errors=True)
        case.root.mkdir()
        try:
            state.build(case, good)
        except BaseException:
            case.close()
            raise
        return case

    # The reading commands, with and without --json, then the changing ones without.
    case = built()
    try:
        reading = _commands(case, [c + j for c in READING for j in ([], ["--json"])]
                            + CHANGING, name)
    finally:
        case.close()
    # The changing commands again with --json, on the state built afresh.
    case = built()
    try:
        changing = _commands(case, [c + ["--json"] for c in CHANGING], name)
    finally:
        case.close()
    results = reading + changing

    def code(*args: str) -> list[int]:
        return [r["code"] for r in results if r["args"] == list(args)]

    if state.cli is not None:  # a bad setting: every command refuses it the same way
        assert {r["code"] for r in results} == {state.cli}, results[0]
    else:
        want = [state.verify] if state.verify is not None else code("verify")[:1]
        assert want in ([0], [1]) and code("verify")[:1] == want and code(
            "verify", "--json")[:1] == want, [r for r in results if r["args"][0] == "verify"]
        for args in (["info"], ["ls"], ["stats"], ["log"]):
            assert code(*args) == [0] and code(*args, "--json") == [0], (args, results)
        for run in (reading, changing):
            codes = {" ".join(r["args"]).replace(" --json", ""): r for r in run}
            repair, after = codes["verify --repair"], codes["verify"]
            if repair["code"] == 0:  # a repair that says it worked, did
                assert after["code"] == 0, (repair, after)
            cleared, listed = codes["clear --yes"], codes["ls --tier user"]
            if cleared["code"] == 0 and state.verify == 0:
                out = listed["stdout"].strip()
                assert out == "[]" or out.startswith("no entries in the user tier"), (
                    cleared, listed)

    # The workload, twice: the second process reads what the first stored (the first
    # stores before it exits; the second does what kdb does by default).
    case = built()
    try:
        header = case.root / "inc" / HEADER_NAME if state.header else None
        first = _workload(case, state, pocl, replace=state.replace, header=header,
                          edit=state.edit)
        if state.detach:  # what the store worker does with the first process's stores
            _drain(case, {case.facts.get("planted", "")} | set(case.facts.get("malformed", ())))
        if header is not None:
            header.write_text(HEADER_TEXT)  # restored: the second process must compute with it
        second = _workload(case, state, pocl, header=header,
                           env={"KDB_STORE_AT_EXIT": None}) \
            if LONG or name in SECOND_RUN or state.detach else None
        if state.check is not None:
            state.check(case, first["warnings"] + (second["warnings"] if second else []))
        if state.verify == 0:  # a sound file (a full disk, a stuck upgrader) stays in place
            assert not list((case.cache / "v1").glob("*.corrupt-*")), "a sound file moved aside"
        if name.startswith("full-disk"):  # a job that could not be written leaves nothing
            assert not list((case.cache / "v1").glob("spool/*/.*.tmp")), "job left behind"
        if LONG:  # four processes meet the state at once
            _concurrent(case, tmp_path, 4)
    finally:
        case.close()
    if name in ("sound", "stores-pending", "pocl-kernel-cache-off"):
        assert first["compiles"] == 0  # served from the cache
    if name in STORED:
        assert second["compiles"] == 0, second  # the first process stored what it compiled
    if state.replace:
        assert second["compiles"] == 1, second  # the build after the clear was stored
    if state.stored:
        assert second["compiles"] == 0, second  # the store worker stored the first's builds


def test_the_matrix_covers_every_command():
    """Every command of the CLI but `demo` and `pack` (which build, not read, a cache),
    `run` (which reads no cache: its summary comes from the processes it ran, see
    tests/test_auto.py, and the workload here is what such a process does), `key` (which
    makes and reads key files, never a cache: tests/test_signing.py) and `shared` (which reads
    no cache either: it sets a shared server up, see tests/test_tenants.py)."""
    from kdb.cli import cli

    covered = {c[0] for c in READING + CHANGING}
    assert covered == set(cli.commands) - {"demo", "pack", "run", "key", "shared"}
    print(f"\nfault matrix: {len(STATES)} states x {COMMANDS} command invocations, "
          f"plus a workload run twice per state")

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
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from kdb import migrate

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
from kdb import latency, maintenance
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
print(json.dumps({"ok": ok, "compiles": len(latency.records())}))
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
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    @property
    def cache(self) -> Path:
        return Path(self.env["KDB_CACHE_DIR"])

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
    verify: int  # exit status `kdb verify` must give: 0 sound (or nothing there), 1 wrong
    cli: int | None = None  # every command's exit status, when the state fixes it (settings)
    replace: bool = False  # the workload clears the user tier between its builds
    needs: str = ""  # "setpriv", "mount": skipped where this machine does not allow it


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
    "cache-dir-is-a-file": State(_cache_is_file, 0),
    "cache-dir-is-dev-null": State(_cache_is_devnull, 0),
    "read-only-dir": State(_read_only_dir, 0, needs="setpriv"),
    "read-only-mount": State(_read_only_mount, 0, needs="mount"),
    "full-disk": State(_full_disk, 0, needs="mount"),
    "stuck-upgrader": State(_stuck_upgrader, 0),
    "being-migrated": State(_being_migrated, 0),
    "being-created": State(_being_created, 0),
    "stores-pending": State(_stores_pending, 0),
    "stuck-claim-holder": State(_stuck_claim, 0),
    "replaced-under-a-process": State(_empty_dir, 0, replace=True),
    "bad-setting": State(_bad_setting, 0, cli=2),
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
    return good, arch, root / "pocl"


def _workload_code(replace: bool) -> str:
    return f"KERNELS = {KERNELS!r}\nREPLACE = {replace!r}\n" + WORKLOAD


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
              env: dict[str, str | None] | None = None) -> dict:
    proc = _run(case, [sys.executable, "-c", _workload_code(replace)],
                {"POCL_CACHE_DIR": str(pocl), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, \
        proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["ok"] == [True] * len(KERNELS), got  # correct results, whatever the cache
    notes = [ln[len("KDBWARN "):] for ln in proc.stderr.splitlines()
             if ln.startswith("KDBWARN ") and not any(i in ln for i in INFORMATIONAL)]
    assert len(notes) <= 1, notes  # one state, one cause: at most one warning
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
                       "full-disk", "other-owner", "future-revision", "stores-pending"}


@pytest.mark.parametrize("name", list(STATES))
def test_every_command_and_a_workload_survive_the_state(name, template, tmp_path, cl_ctx):
    state = STATES[name]
    good, arch, pocl = template
    if state.needs == "mount" and not _can_mount(tmp_path):
        pytest.skip("mounting a tmpfs or a read-only bind mount is not allowed here")

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
        assert code("verify") [:1] == [state.verify] and code("verify", "--json")[:1] == [
            state.verify], [r for r in results if r["args"][0] == "verify"]
        for args in (["info"], ["ls"], ["stats"], ["log"]):
            assert code(*args) == [0] and code(*args, "--json") == [0], (args, results)
        for run in (reading, changing):
            codes = {" ".join(r["args"]).replace(" --json", ""): r for r in run}
            repair, after = codes["verify --repair"], codes["verify"]
            if repair["code"] == 0:  # a repair that says it worked, did
                assert after["code"] == 0, (repair, after)
            cleared, listed = codes["clear --yes"], codes["ls --tier user"]
            if cleared["code"] == 0 and state.verify == 0:
                assert listed["stdout"].strip() in ("no entries", "[]"), (cleared, listed)

    # The workload, twice: the second process reads what the first stored (the first
    # stores before it exits; the second does what kdb does by default).
    case = built()
    try:
        first = _workload(case, state, pocl, replace=state.replace)
        second = _workload(case, state, pocl, env={"KDB_STORE_AT_EXIT": None}) \
            if LONG or name in SECOND_RUN else None
        if state.verify == 0:  # a sound file (a full disk, a stuck upgrader) stays in place
            assert not list((case.cache / "v1").glob("*.corrupt-*")), "a sound file moved aside"
        if name == "full-disk":  # a job that could not be written leaves nothing
            assert not list((case.cache / "v1").glob("spool/*/.*.tmp")), "job left behind"
        if LONG:  # four processes meet the state at once
            _concurrent(case, tmp_path, 4)
    finally:
        case.close()
    if name in ("sound", "stores-pending"):
        assert first["compiles"] == 0  # served from the cache
    if name in STORED:
        assert second["compiles"] == 0, second  # the first process stored what it compiled
    if state.replace:
        assert second["compiles"] == 1, second  # the build after the clear was stored


def test_the_matrix_covers_every_command():
    """Every command of the CLI but `demo` and `pack` (which build, not read, a cache) and
    `run` (which reads no cache: its summary comes from the processes it ran, see
    tests/test_auto.py, and the workload here is what such a process does)."""
    from kdb.cli import cli

    covered = {c[0] for c in READING + CHANGING}
    assert covered == set(cli.commands) - {"demo", "pack", "run"}
    print(f"\nfault matrix: {len(STATES)} states x {COMMANDS} command invocations, "
          f"plus a workload run twice per state")

"""Shared fixtures: every test gets its own kdb cache directory; PoCL is the real device."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

# Nothing a test does may touch the real home cache, in this process or its children; nor
# leave anything behind: the session's folder goes at exit, and its children's temporary
# files (compilers', PoCL's, a store worker's) go in it, never straight into /tmp. This
# process's own tempfile folder is the system's, in xdist's workers too (pytest's tmp_path,
# a PostgreSQL server run as another user, who cannot enter a folder of ours).
tempfile.tempdir = os.environ.setdefault("KDB_TESTS_SYSTEM_TMP", tempfile.gettempdir())
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="kdb-tests-"))
atexit.register(shutil.rmtree, _SESSION_TMP, ignore_errors=True)
(_SESSION_TMP / "tmp").mkdir()
os.environ["TMPDIR"] = str(_SESSION_TMP / "tmp")
os.environ["KDB_CACHE_DIR"] = str(_SESSION_TMP / "kdb-cache")
# Every child imports numpy (pyopencl does), and OpenBLAS starts a thread a core that spins
# a while for linear algebra no test does: 0.1 of the 0.25 CPU-s an OpenCL child costs on 2
# cores, a fifth of the suite's CPU, which decides its time beside other work. (The
# benchmarks keep the user's default: they measure what a user runs.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("POCL_CACHE_DIR", str(_SESSION_TMP / "pocl-cache"))
# Mesa's Rusticl keeps what it compiled in ~/.cache/mesa_shader_cache otherwise.
os.environ.setdefault("MESA_SHADER_CACHE_DIR", str(_SESSION_TMP / "mesa-cache"))
for _var in ("KDB_SYSTEM_DB_PATH", "KDB_DISABLE_CACHE", "KDB_STRICT", "KDB_TRACE",
             "KDB_CACHE_MAX_SIZE", "KDB_SHARED_URL", "KDB_WAIT_TIMEOUT", "KDB_STORE_TIMEOUT",
             "KDB_NVCC", "KDB_NVRTC", "KDB_STORE_AT_EXIT", "KDB_AUTO", "KDB_RUN_REPORT",
             "KDB_LOCK_TIMEOUT", "KDB_SHARED_NAMESPACE", "KDB_TRUSTED_KEYS", "KDB_REQUIRE_SIGNED",
             "KDB_SIGNING_KEY", "KDB_STORE_SHARE", "KDB_HIPCC", "KDB_HIPRTC"):
    os.environ.pop(_var, None)
# The suite runs on the OpenCL that pyopencl's own loader brings (pip's PoCL): an ICD folder
# of no files hides those installed system-wide (a second PoCL from pocl-opencl-icd lists
# first, under the same platform name the tests pick by). tests/test_opencl_impls.py names
# the others in its children's OCL_ICD_VENDORS. A caller's own OCL_ICD_VENDORS is kept.
# Where pip's PoCL does not know this CPU, the suite runs on the one tools/default_opencl.py
# chooses (Debian's PoCL: `make test` installs it), listed first.
(_SESSION_TMP / "no-icds").mkdir(exist_ok=True)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import default_opencl  # noqa: E402 - a tool of this repository, not a package

sys.path.pop(0)


@functools.cache
def pip_pocl() -> tuple[bool, str]:
    """Whether pip's PoCL builds a kernel on this CPU, and what it said (once a session)."""
    return default_opencl.pip_pocl()


def need_pip_pocl() -> None:
    """Skip a test of pip's PoCL itself where it builds nothing on this CPU."""
    works, said = pip_pocl()
    if not works:
        pytest.skip(f"pip's PoCL builds no kernel on this CPU ({said}): "
                    "tools/default_opencl.py says why")


if "OCL_ICD_VENDORS" not in os.environ:
    os.environ["OCL_ICD_VENDORS"] = (default_opencl.choose(pip=pip_pocl())
                                     or str(_SESSION_TMP / "no-icds"))
# Children store before they exit (tests read what they stored right after); the default,
# the store worker, has its own tests (tests/test_spool.py).
os.environ["KDB_STORE_AT_EXIT"] = "wait"

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent


def stored_entries(cache_dir) -> int:
    """Entries in the user tier of a ``KDB_CACHE_DIR`` (0 where no user file exists yet)."""
    files = list((Path(cache_dir) / "v1").glob("*.kdb"))
    return sum(sql(f, "SELECT count(*) FROM kernels")[0][0] for f in files)


def sql(path, query: str, params=()) -> list[tuple]:
    """Run one statement on a SQLite file with a fresh connection (committed) and return rows."""
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        with conn:
            return conn.execute(query, params).fetchall()
    finally:
        conn.close()


def attributes_of(path, where: str = "1", params=()) -> list[tuple[str, str, str]]:
    """``(key, name, whole canonical attributes text)`` of a tier file's entries that match
    ``where``, at any schema revision (from 0006 they are stored compressed, each source
    once: kdb.file.compact)."""
    import sqlite3

    from kdb.file import compact

    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        compact.register(conn)
        cols = {r[1] for r in conn.execute("PRAGMA table_info(kernels)")}
        expr, join = compact.columns("attrs" in cols)
        return conn.execute(f"SELECT kernels.key, kernels.name, {expr} FROM kernels{join} "
                            f"WHERE {where} ORDER BY kernels.name", params).fetchall()
    finally:
        conn.close()


def set_attributes(path, key: str, text: str) -> None:
    """Store ``text`` as the attributes of ``key``'s entry, as a writer would (its digest
    computed from it): a row whose attributes may not be its key's input."""
    from kdb.file import compact

    packed = compact.pack(text)
    if packed.source is not None:
        sql(path, "INSERT OR IGNORE INTO sources (digest, body, size) VALUES (?, ?, ?)",
            (packed.source, packed.body, packed.size))
    sql(path, "UPDATE kernels SET attrs = ?, source = ?, attributes_sha256 = ? WHERE key = ?",
        (packed.attrs, packed.source, packed.sha256, key))


@contextlib.contextmanager
def no_store_worker(cache_dir, env: dict):
    """Hold the locks of the spool that a child with ``env`` (over this process's
    environment) writes its store jobs to: no store worker, and no process storing ahead,
    runs there, as when the worker was killed or cannot start. Its jobs stay queued."""
    import fcntl

    from kdb.dirs import make_private_dir
    from kdb.storing import jobfiles, spool

    pytest.importorskip("pyopencl")  # it sets PYOPENCL_HOME, as in the children, whose spool
    where = make_private_dir(spool.spool_dir(Path(cache_dir) / "v1", {**os.environ, **env}))
    fds = [os.open(where / name, os.O_RDWR | os.O_CREAT, 0o600)
           for name in (jobfiles.LOCK, jobfiles.AHEAD_LOCK)]
    try:
        for fd in fds:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield where
    finally:
        for fd in fds:
            os.close(fd)


def kill_workers(cache: Path) -> None:
    """SIGKILL the store workers of ``cache`` with their lanes (each worker leads its own
    session): what they would still store is a scan's minutes of idle-priority work."""
    import signal

    def pgrep(*args: str) -> list[int]:
        return [int(p) for p in subprocess.run(["pgrep", *args], capture_output=True,
                                               text=True).stdout.split()]

    workers = pgrep("-f", f"kdb.worker {cache}")
    lanes = [lane for pid in workers for lane in pgrep("-P", str(pid))]  # sessions of their own
    for pid in workers + lanes:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """Forget once-per-process warnings and this process's compile log between tests."""
    from kdb.storing import background
    from kdb import bookkeeping, faults
    from kdb.file import entrypoints

    faults.reset()
    bookkeeping.forget_compiles()
    yield
    background.drain()
    faults.reset()
    bookkeeping.forget_compiles()
    entrypoints.create_cache_dir = True  # as in a program (a `kdb` command turns it off)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A private KDB_CACHE_DIR for this test (the user tier lives in ``<it>/v1``)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("KDB_CACHE_DIR", str(d))
    return d


@pytest.fixture(scope="session")
def cl_ctx():
    """A context on the PoCL CPU device (skips if pyopencl/PoCL are absent)."""
    cl = pytest.importorskip("pyopencl")
    for plat in cl.get_platforms():
        if "Portable Computing Language" in plat.name:
            return cl.Context(plat.get_devices())
    pytest.skip("no PoCL platform")


@pytest.fixture
def run_py(tmp_path):
    """Run Python code in a fresh interpreter; returns the CompletedProcess (text mode).

    Each call gets its own POCL_CACHE_DIR unless ``env`` sets one, so concurrent children
    never share PoCL's cache (see docs/figures.md).
    """
    counter = iter(range(10**6))

    def run(code: str, env: dict[str, str] | None = None, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess:
        full = dict(os.environ)
        full["POCL_CACHE_DIR"] = str(tmp_path / f"pocl-{next(counter)}")
        full.update(env or {})
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"child failed ({proc.returncode})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    return run


def run_checked(cmd: list[str], cwd: Path, env: dict[str, str] | None = None,
                timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a command; fail the test with its output if it exits non-zero."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def once_per_run(tmp_path_factory, name: str, make) -> Path:
    """The folder ``name`` that this run's test processes (pytest-xdist) share, filled by
    ``make(folder)`` once: the first process to ask makes it, under a lock, and the others
    wait for it. What is made there costs many CPU-seconds and is never written after."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's folder, above each test process's own
    root = base / name
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "made").exists():
            make(root)
            (root / "made").touch()
    return root


def pip_into(env_dir: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    """This environment's pip run for the venv ``env_dir`` (``pip --python``): a venv made
    without pip of its own (its ``ensurepip`` costs 3 CPU-s)."""
    return run_checked([sys.executable, "-m", "pip", "--python", env_dir / "bin" / "python",
                        *args], cwd=cwd)


@pytest.fixture(scope="session")
def kdb_wheel(tmp_path_factory) -> Path:
    """kdb's wheel, built from this tree by pip once a run (:func:`once_per_run`)."""
    def make(root: Path) -> None:  # from a copy: setuptools builds in the tree it is given
        sys.path.insert(0, str(REPO / "benchmarks"))
        try:
            from _torch_pack import tree_copy
        finally:
            sys.path.pop(0)
        src = tree_copy(root / "src")
        run_checked([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", root,
                     src], cwd=root)
        shutil.rmtree(src, ignore_errors=True)

    [wheel] = once_per_run(tmp_path_factory, "kdb-wheel", make).glob("kdb-*.whl")
    return wheel


@pytest.fixture(scope="session")
def kdb_venv(tmp_path_factory, kdb_wheel) -> Path:
    """A new virtual environment holding the kdb wheel built from this tree, pyopencl[pocl]
    and numpy: what a user gets from ``pip install kdb``. Built once per run and shared by
    its test processes (:func:`once_per_run`), so no test may install into it or remove
    from it: one that does makes a venv of its own over it (:func:`venv_over`).
    """
    import venv

    def make(root: Path) -> None:
        venv.create(root / "venv", with_pip=False)
        pip_into(root / "venv", "install", "--quiet", kdb_wheel, "pyopencl[pocl]", "numpy",
                 cwd=root)

    return once_per_run(tmp_path_factory, "kdb-venv", make) / "venv"


def purelib(python: Path) -> Path:
    """The site-packages folder of the Python ``python``."""
    return Path(run_checked([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                           "['purelib'])"], cwd=python.parent).stdout.strip())


def venv_over(env_dir: Path, site: str | Path, *wheels: Path) -> Path:
    """A new venv at ``env_dir`` with ``wheels`` installed by pip, that also sees the
    packages in the folder ``site`` (a path line after its own, written after the install:
    pip would take a package found there for the one it is asked to install). The venv
    ``site`` belongs to stays as it is for the tests that share it."""
    import venv

    venv.create(env_dir, with_pip=False)
    if wheels:
        pip_into(env_dir, "install", "--no-deps", "--quiet", *wheels, cwd=env_dir)
    (purelib(env_dir / "bin" / "python") / "zz-base-site.pth").write_text(f"{site}\n")
    return env_dir


TORCH_STEP = REPO / "benchmarks" / "_torch_step.py"


def torch_step(python: Path, env: dict, where: Path, *args: str) -> tuple[dict, str]:
    """torch.compile's first step (benchmarks/_torch_step.py) of its one-layer model in a
    fresh process with empty Inductor caches of its own (its cache directory, and the
    temporary directory its precompiled headers default to): its figures and its stderr.
    The one-layer model compiles the same kinds of entries (a forward and a backward graph,
    AOTAutograd's, C++ modules) at 23 CPU-s cold, against 36 for the benchmark's model."""
    import json

    (where / "tmp").mkdir(parents=True)
    run_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(where / "inductor"),
               "TMPDIR": str(where / "tmp")}
    proc = subprocess.run([str(python), str(TORCH_STEP), "tiny", *args], env=run_env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("STEP-JSON:"))
    return json.loads(line.partition(":")[2]), proc.stderr


def torch_env(cache: Path) -> dict:
    """This environment without kdb's and Inductor's settings, kdb's cache at ``cache``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDB_", "TORCHINDUCTOR_"))}
    env["KDB_CACHE_DIR"] = str(cache)
    return env


@pytest.fixture(scope="session")
def torch_cold_master(tmp_path_factory) -> tuple[Path, dict]:
    """One cold torch.compile first step with kdb on (from code), for the whole run: its kdb
    cache and figures. A cold compile costs 20 s, so the test processes of one run share it
    (:func:`once_per_run`)."""
    import json

    def make(root: Path) -> None:
        first, _ = torch_step(Path(sys.executable), torch_env(root / "kdb"), root / "cold",
                              "kdb")
        (root / "first.json").write_text(json.dumps(first))

    root = once_per_run(tmp_path_factory, "torch-cold", make)
    return root / "kdb", json.loads((root / "first.json").read_text())


@pytest.fixture(scope="module")
def torch_cold(torch_cold_master, tmp_path_factory) -> tuple[dict, Path, dict]:
    """A copy of the cold step's kdb cache for one test module, which may write to it: the
    environment that uses it, the folder holding it (``kdb``) and the cold step's figures."""
    import shutil

    master, first = torch_cold_master
    root = tmp_path_factory.mktemp("torch")
    shutil.copytree(master, root / "kdb")
    return torch_env(root / "kdb"), root, first

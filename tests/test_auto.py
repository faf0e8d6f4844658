"""Zero-code adoption: KDB_AUTO=1, `kdb run -- CMD` and `pytest --kdb`, in real processes.

Every program here is an unmodified pyopencl script (it never imports kdb) run in a fresh
interpreter of this venv, on PoCL, with its own KDB_CACHE_DIR and POCL_CACHE_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

import _kdb_auto
from kdb import config
from kdb.adopt import tally
from conftest import no_store_worker, purelib, stored_entries

BIN = Path(sys.executable).parent
KDB = str(BIN / "kdb")

APP = textwrap.dedent('''
    import sys

    import numpy as np
    import pyopencl as cl

    ctx = cl.Context(cl.get_platforms()[0].get_devices())
    q = cl.CommandQueue(ctx)
    prg = cl.Program(ctx, """
        __kernel void twice(__global float *a) { int i = get_global_id(0); a[i] *= 2.0f; }
    """).build()
    a = np.arange(8, dtype=np.float32)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
    prg.twice(q, a.shape, None, buf)
    cl.enqueue_copy(q, a, buf)
    assert a[3] == 6.0, a
    # One write: print() writes the text and its newline apart on an unbuffered stdout
    # (PYTHONUNBUFFERED), and mpirun may splice another rank's line in between.
    sys.stdout.write(("adopted" if hasattr(cl.Program.build, "__wrapped__") else "plain") + "\\n")
''')


@pytest.fixture
def app(tmp_path) -> Path:
    path = tmp_path / "app.py"
    path.write_text(APP)
    return path


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """The children's environment: a private cache, KDB_AUTO and KDB_RUN_REPORT unset."""
    e = {k: v for k, v in os.environ.items() if k not in (config.ENV_AUTO,
                                                          config.ENV_RUN_REPORT)}
    e["KDB_CACHE_DIR"] = str(tmp_path / "cache")
    e["POCL_CACHE_DIR"] = str(tmp_path / "pocl")
    return e


def run(cmd, env, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True,
                          timeout=kwargs.pop("timeout", 120), **kwargs)


def stats(env) -> dict:
    return json.loads(run([KDB, "stats", "--json"], env, check=True).stdout)


def kdb_lines(stderr: str) -> list[str]:
    """kdb's own lines, but the notice that no system database exists (expected here)."""
    return [ln for ln in stderr.splitlines()
            if ln.startswith("kdb") and "no system kernel database" not in ln]


# -- the start-up hook ----------------------------------------------------------------------

def test_pth_is_installed_beside_kdb_and_checks_only_the_variable():
    pth = Path(sysconfig.get_paths()["purelib"]) / "kdb-auto.pth"
    line = pth.read_text()
    assert line.startswith("import ") and line.count("\n") == 1
    assert line.startswith("import os; os.environ.get('KDB_AUTO') and exec(")
    assert _kdb_auto.ENV_AUTO == config.ENV_AUTO


def test_auto_twice_in_fresh_processes_compiles_once(app, env):
    env["KDB_AUTO"] = "1"
    first = run([sys.executable, app], env, check=True)
    assert first.stdout.strip() == "adopted"
    after_first = stats(env)
    assert after_first["compiles"] == 1 and after_first["entries"] == 1
    second = run([sys.executable, app], env, check=True)
    assert second.stdout.strip() == "adopted"
    after_second = stats(env)
    assert after_second["compiles"] == 1, "the second process compiled"
    assert after_second["hits"]["user"] == 1
    assert kdb_lines(second.stderr) == []  # no "this start-up compiled" summary


@pytest.mark.parametrize("value", [None, "", "0", "off", "false", "maybe"])
def test_auto_off_values_leave_pyopencl_alone(value, env, run_py):
    if value is not None:
        env["KDB_AUTO"] = value
    code = "import sys, pyopencl; print(sorted(m for m in sys.modules if m.startswith('kdb')))"
    proc = run([sys.executable, "-c", code], env, check=True)
    assert proc.stdout.strip() == "[]"
    if value == "maybe":
        assert kdb_lines(proc.stderr) == [
            "kdb: KDB_AUTO='maybe' is not understood: set it to 1 to switch kdb on, 0 or unset "
            "for off; kdb stays off"]
    else:
        assert proc.stderr == ""


def test_auto_does_not_import_pyopencl_itself(env):
    env["KDB_AUTO"] = "1"
    code = "import sys; print('pyopencl' in sys.modules, 'kdb' in sys.modules)"
    assert run([sys.executable, "-c", code], env, check=True).stdout.split() == ["False", "False"]


def test_auto_with_an_unusable_cache_runs_plain_pyopencl_with_one_warning(app, env, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env["KDB_AUTO"] = "1"
    env["KDB_CACHE_DIR"] = str(blocker / "cache")  # under a file: no one can create it
    proc = run([sys.executable, app], env, check=True)
    assert proc.stdout.strip() == "plain"
    [line] = kdb_lines(proc.stderr)
    assert "could not switch on for pyopencl" in line and "cannot be created" in line


def test_auto_with_a_bad_setting_warns_once_and_uses_the_default(app, env):
    """The settings rule (README, Configuration): a bad value never ends or unplugs the
    program; it is named once with what is used instead."""
    env.update(KDB_AUTO="1", KDB_CACHE_MAX_SIZE="lots")
    proc = run([sys.executable, app], env, check=True)
    assert proc.stdout.strip() == "adopted"
    bad = [ln for ln in kdb_lines(proc.stderr) if "KDB_CACHE_MAX_SIZE" in ln]
    assert len(bad) == 1 and "'lots'" in bad[0] and "using 1G (the default)" in bad[0]


def test_auto_with_kdb_failing_to_import_runs_plain_pyopencl(app, env, tmp_path):
    broken = tmp_path / "broken" / "kdb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('kdb is broken here')\n")
    env.update(KDB_AUTO="1", PYTHONPATH=str(broken.parent))
    proc = run([sys.executable, app], env, check=True)
    assert "plain" in proc.stdout
    [line] = kdb_lines(proc.stderr)
    assert "ImportError: kdb is broken here" in line and "without kdb" in line


def test_auto_with_the_start_up_hook_failing_still_runs(app, env, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "_kdb_auto.py").write_text("raise RuntimeError('hook is broken')\n")
    env.update(KDB_AUTO="1", PYTHONPATH=str(broken))
    proc = run([sys.executable, app], env, check=True)
    assert proc.stdout.strip() == "plain"
    assert kdb_lines(proc.stderr) == [
        "kdb: KDB_AUTO is set but kdb cannot start (RuntimeError: hook is broken); running "
        "without it"]


def test_auto_adopts_pycuda_compile(env, tmp_path):
    """pycuda.compiler.compile (which pycuda's SourceModule calls) answered by kdb.cuda; a
    stand-in pycuda, as the real one needs a GPU to import."""
    from kdb.backends.cuda import find_nvcc

    try:
        find_nvcc()
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"no nvcc: {err}")
    fake = tmp_path / "fake" / "pycuda"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "compiler.py").write_text(textwrap.dedent("""
        DEFAULT_NVCC_FLAGS = []
        def compile(source, nvcc="nvcc", options=None, keep=False, no_extern_c=False,
                    arch=None, code=None, cache_dir=None, include_dirs=[], target="cubin"):
            return b"pycuda's own"
        class SourceModule:
            def __init__(self, source, arch=None):
                self.cubin = compile(source, arch=arch)
    """))
    code = textwrap.dedent("""
        from pycuda.compiler import SourceModule, compile
        cubin = compile("__global__ void k(float *a) { a[0] = 1.0f; }", arch="sm_90")
        print(cubin[:4], SourceModule("__global__ void k(float *a) { a[0] = 1.0f; }",
                                      arch="sm_90").cubin[:4], compile("x", keep=True))
    """)
    env.update(KDB_AUTO="1", PYTHONPATH=str(fake.parent))
    proc = run([sys.executable, "-c", code], env, check=True, timeout=300)
    assert proc.stdout.split() == ["b'\\x7fELF'", "b'\\x7fELF'", "b\"pycuda's", 'own"']
    assert stats(env)["compiles"] == 1  # the second request was served


IMPORT_ORDERS = {
    "pyopencl first": "import pyopencl as cl\nimport kdb.opencl\n",
    "kdb.opencl first": "import kdb.opencl\nimport pyopencl as cl\n",
    "kdb first": "import kdb\nimport pyopencl as cl\n",
    "the back end first": "import kdb.backends.opencl\nimport pyopencl as cl\nimport kdb.opencl\n",
}

ORDER_APP = """
import numpy as np
{imports}
ctx = cl.Context(cl.get_platforms()[0].get_devices())
q = cl.CommandQueue(ctx)
prg = cl.Program(ctx, "__kernel void k(__global int *a) {{ a[get_global_id(0)] = 7; }}").build()
a = np.zeros(4, dtype=np.int32)
buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
prg.k(q, a.shape, None, buf)
cl.enqueue_copy(q, a, buf)
assert list(a) == [7] * 4, a
import sys, kdb.opencl
sys.stdout.write(("adopted" if kdb.opencl.installed() else "plain") + "\\n")
"""


@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_auto_adopts_pyopencl_whichever_is_imported_first(order, env, tmp_path):
    """kdb's API imported by the program itself, before or after pyopencl: still adopted,
    with no warning (the hook once hit a half-imported kdb.opencl)."""
    app = tmp_path / "order.py"
    app.write_text(ORDER_APP.format(imports=IMPORT_ORDERS[order]))
    env["KDB_AUTO"] = "1"
    proc = run([sys.executable, app], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "adopted"
    assert kdb_lines(proc.stderr) == [ln for ln in kdb_lines(proc.stderr)
                                      if "this start-up compiled" in ln]
    assert "could not switch on" not in proc.stderr


def _worker_log(env) -> str:
    logs = list(Path(env["KDB_CACHE_DIR"]).rglob("store-worker.log"))
    return "".join(p.read_text(errors="replace") for p in logs)


def test_kdb_run_adopts_a_program_that_imports_kdb_first_and_the_worker_adopts_nothing(
        env, tmp_path):
    app = tmp_path / "order.py"
    app.write_text(ORDER_APP.format(imports=IMPORT_ORDERS["kdb.opencl first"]))
    env["KDB_STORE_AT_EXIT"] = "detach"  # the default: stores go to the store worker
    proc = run([KDB, "run", "--json", "--", sys.executable, app], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "adopted"
    from kdb.storing import spool

    assert spool.wait(Path(env["KDB_CACHE_DIR"]) / "v1", 300) == 0
    assert stats(env)["entries"] == 1
    text = _worker_log(env)
    assert "partially initialized" not in text and "KDB_AUTO" not in text, text


def test_pytest_kdb_adopts_a_test_module_that_imports_kdb_first(env, tmp_path):
    tests = tmp_path / "suite"
    tests.mkdir()
    body = ORDER_APP.format(imports=IMPORT_ORDERS["kdb.opencl first"])
    (tests / "test_order.py").write_text(
        "def test_order(capsys):\n    exec(compile(%r, 'app', 'exec'), {})\n"
        "    assert capsys.readouterr().out.strip() == 'adopted'\n" % body)
    proc = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests,
                "--kdb"], env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "could not switch on" not in proc.stdout + proc.stderr


# -- kdb run --------------------------------------------------------------------------------

def test_kdb_run_a_child_process_twice_compiles_nothing_the_second_time(app, env):
    parent = (f"import subprocess, sys; subprocess.check_call([sys.executable, {str(app)!r}]);"
              " sys.exit(3)")
    summaries = []
    for _ in range(2):
        proc = run([KDB, "run", "--json", "--", sys.executable, "-c", parent], env)
        assert proc.returncode == 3, proc.stderr
        assert proc.stdout.strip() == "adopted"
        summaries.append(json.loads(proc.stderr.strip().splitlines()[-1]))
    first, second = summaries
    assert (first["compiled"], first["served"], first["processes"]) == (1, 0, 1)
    assert first["compile_seconds"] > 0
    assert (second["compiled"], second["served"], second["hits"]["user"]) == (0, 1, 1)
    assert second["saved_seconds"] > 0 and second["exit_status"] == 3
    assert stats(env)["compiles"] == 1


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun here")
def test_kdb_run_mpirun_ranks_compile_each_kernel_once(app, env):
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = [KDB, "run", "--json", "--", "mpirun", *root, "--oversubscribe", "-n", "4",
           sys.executable, app]
    proc = run(cmd, env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["adopted"] * 4
    s = json.loads(proc.stderr.strip().splitlines()[-1])
    assert (s["requested"], s["compiled"], s["served"], s["processes"]) == (4, 1, 3, 4)


def test_kdb_run_prints_one_summary_line_and_takes_its_cache_dir(app, env, tmp_path):
    other = tmp_path / "other-cache"
    proc = run([KDB, "run", "--cache-dir", other, "--", sys.executable, app], env)
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kdb run: 1 program requested: 1 compiled (") and "exit status 0" in last
    assert list((other / "v1").glob("*.kdb"))


def test_kdb_run_passes_stdin_through(env):
    proc = run([KDB, "run", "--", sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1])"],
               env, input="abc")
    assert proc.stdout.strip() == "cba"
    assert "0 programs requested" in proc.stderr


def test_kdb_run_reports_death_by_signal_as_a_shell_does(env):
    proc = run([KDB, "run", "--", "sh", "-c", "kill -TERM $$"], env)
    assert proc.returncode == 128 + signal.SIGTERM


def test_kdb_run_forwards_sigterm_to_the_command(env, tmp_path):
    ready = tmp_path / "ready"
    code = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))
        pathlib.Path({str(ready)!r}).write_text("")
        time.sleep(60)
    """)
    proc = subprocess.Popen([KDB, "run", "--", sys.executable, "-c", code], env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 7, err


def test_kdb_run_does_not_send_a_terminals_ctrl_c_twice(env):
    """^C on a terminal reaches the whole foreground group, the command included: kdb run
    must not pass it on a second time (a Python command would see two KeyboardInterrupts)."""
    import pty

    code = ("import signal, sys, time; n = [0]; "
            "signal.signal(signal.SIGINT, lambda *a: n.__setitem__(0, n[0] + 1)); "
            "print('ready', flush=True); time.sleep(3); sys.exit(10 + n[0])")
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child execs at once
        os.execve(KDB, [KDB, "run", "--", sys.executable, "-c", code], env)
    seen = b""
    deadline = time.monotonic() + 30
    while b"ready" not in seen and time.monotonic() < deadline:
        seen += os.read(fd, 1024)
    os.write(fd, b"\x03")  # the terminal's interrupt character
    try:
        while True:
            seen += os.read(fd, 1024)
    except OSError:  # EIO: the terminal's other end is closed, everyone has exited
        pass
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 11, seen.decode(errors="replace")


def test_the_portable_forwarding_passes_status_and_signals_too(env):
    """The handler-based path (where sigwaitinfo is missing), run here on purpose."""
    from kdb.adopt import run as running

    assert running._run_handlers([sys.executable, "-c", "import sys; sys.exit(4)"], env) == 4
    assert running._run_handlers(["sh", "-c", "kill -TERM $$"], env) == 128 + signal.SIGTERM


def test_kdb_run_of_a_missing_command_exits_127(env):
    proc = run([KDB, "run", "--", "no-such-command-kdb"], env)
    assert proc.returncode == 127
    assert "command not found: no-such-command-kdb" in proc.stderr


def test_kdb_run_of_an_empty_command_name_is_a_usage_error(env):
    """It said "cannot execute  (Permission denied)" with status 126."""
    proc = run([KDB, "run", "--", ""], env)
    assert proc.returncode == 2 and "the command's name is empty" in proc.stderr


def test_kdb_run_passes_a_process_substitution_through(env):
    """bash's ``<(...)`` is a pipe the command reads as /dev/fd/N: kdb run must not close it."""
    proc = run(["bash", "-c", f"{KDB} run -- cat <(echo hello)"], env)
    assert (proc.returncode, proc.stdout) == (0, "hello\n"), proc.stderr


def test_kdb_run_passes_a_redirected_descriptor_through(env, tmp_path):
    (tmp_path / "data").write_text("on fd 3\n")
    proc = run(["bash", "-c", f"{KDB} run -- bash -c 'cat <&3' 3<data"], env, cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (0, "on fd 3\n"), proc.stderr


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_kdb_run_gives_the_command_the_descriptors_it_inherited_and_none_of_its_own(env, tmp_path):
    """The command's descriptors are those kdb run was given (here: 0-2 and one extra), as
    without kdb run: kdb's own (its Python, its files) are close-on-exec."""
    listing = [sys.executable, "-c", "import os; print(sorted(map(int, os.listdir('/proc/self/fd'))))"]
    with open(tmp_path / "extra", "w") as extra:
        fd = extra.fileno()
        kwargs = {"pass_fds": (fd,), "stdin": subprocess.DEVNULL}
        plain = run(listing, env, **kwargs)
        wrapped = run([KDB, "run", "--", *listing], env, **kwargs)
    assert wrapped.returncode == 0, wrapped.stderr
    assert fd in json.loads(plain.stdout)
    assert wrapped.stdout == plain.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_a_sub_make_under_kdb_run_keeps_the_jobserver(env, tmp_path):
    """make -j4 passes its jobserver to a recipe's $(MAKE) as inherited descriptors (make 4.3)
    or a named fifo (4.4): through kdb run the sub-make still gets -j4, not -j1."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "Makefile").write_text(f"all:\n\t+{KDB} run -- $(MAKE) -C sub\n")
    (tmp_path / "sub" / "Makefile").write_text("all: a b\na b:\n\t@echo $@ $(MAKEFLAGS)\n")
    proc = run(["make", "-j4"], env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "jobserver unavailable" not in proc.stderr
    assert "-j4" in proc.stdout and "-j1" not in proc.stdout, proc.stdout


SIGNALS = "import signal; print([int(signal.getsignal(s)) for s in (signal.SIGHUP, signal.SIGTERM)])"


def test_signals_ignored_for_kdb_run_stay_ignored_in_the_command(env):
    """nohup and a shell's ``trap ''`` ignore a signal for what they run; exec keeps it
    ignored, and so must kdb run (a handler of its own would reset it to the default)."""
    ignore = ["bash", "-c", f"trap '' HUP TERM; exec {KDB} run -- {sys.executable} -c \"$0\"",
              SIGNALS]
    proc = run(ignore, env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [int(signal.SIG_IGN)] * 2


# -- pytest --kdb ---------------------------------------------------------------------------

def test_pytest_kdb_switches_kdb_on_for_the_session_and_its_subprocesses(app, env, tmp_path):
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_kernels.py").write_text(textwrap.dedent(f"""
        import runpy, subprocess, sys

        def test_in_process(capsys):
            runpy.run_path({str(app)!r})
            assert capsys.readouterr().out.strip() == "adopted"

        def test_in_a_subprocess():
            out = subprocess.check_output([sys.executable, {str(app)!r}], text=True)
            assert out.strip() == "adopted"
    """))
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", tests]
    first = run([*pytest_cmd, "--kdb"], env, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "kdb: 2 programs requested: 1 compiled" in first.stdout  # the second waited or hit
    second = run([*pytest_cmd, "-p", "kdb.pytest"], env, cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert ("kdb: 2 programs requested: 0 compiled (0.00 s compiling), 2 served (user 2); the "
            "served programs took") \
        in second.stdout
    without = run(pytest_cmd, env, cwd=tmp_path)
    assert without.returncode == 1 and "kdb:" not in without.stdout  # plain pyopencl


def test_pytest_kdb_repeats_what_kdb_warned_of_in_its_summary(app, env, tmp_path):
    """A refused cache (a CI cache restored group-writable) recompiled every kernel at every
    run, and its one warning was a passing test's log record, which pytest keeps to itself:
    nothing said why. The summary repeats what kdb warned of, with how many processes did."""
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_kernels.py").write_text(textwrap.dedent(f"""
        import runpy, subprocess, sys

        def test_in_process(capsys):
            runpy.run_path({str(app)!r})

        def test_in_a_subprocess():
            subprocess.check_output([sys.executable, {str(app)!r}], text=True)
    """))
    cache = Path(env["KDB_CACHE_DIR"])
    cache.mkdir(mode=0o775)
    cache.chmod(0o775)  # as umask 002 restores it
    got = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kdb", tests],
              env, cwd=tmp_path)
    assert got.returncode == 0, got.stdout + got.stderr
    said = [ln for ln in got.stdout.splitlines() if ln.startswith("kdb: warned (")]
    assert any("refused" in ln and str(cache) in ln for ln in said), got.stdout
    assert any(ln.startswith("kdb: warned (2 processes)") for ln in said), got.stdout


def test_a_relative_cache_dir_is_one_directory_whatever_the_processes_cwd(env, tmp_path):
    """``kdb run --cache-dir rel`` and ``pytest --kdb-cache-dir rel`` handed ``rel`` on as
    written: a process that changed directory first made another cache (a test in its
    ``tmp_path`` one there, compiled again every session)."""
    out = run([KDB, "run", "--cache-dir", "rel", "--", "/usr/bin/env"], env, cwd=tmp_path)
    assert f"KDB_CACHE_DIR={tmp_path / 'rel'}\n" in out.stdout, out.stdout
    (tmp_path / "test_where.py").write_text(
        "import os\ndef test_where():\n    print('CACHE', os.environ['KDB_CACHE_DIR'])\n")
    got = run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "--kdb",
               "--kdb-cache-dir", "relp", "test_where.py"], env, cwd=tmp_path)
    assert f"CACHE {tmp_path / 'relp'}" in got.stdout, got.stdout + got.stderr


def test_kdb_run_hands_on_no_locale_its_python_set_itself(tmp_path):
    """Under the C locale Python sets ``LC_CTYPE=C.UTF-8`` in its own environment (PEP 538):
    ``kdb run`` handed it on, and ``wc -m`` counted a 2-byte character as one."""
    bare = {"PATH": os.environ["PATH"], "KDB_CACHE_DIR": str(tmp_path / "cache")}
    out = run([KDB, "run", "--", "/usr/bin/env"], bare)
    assert out.returncode == 0 and "LC_CTYPE=" not in out.stdout, out.stdout
    given = run([KDB, "run", "--", "/usr/bin/env"], {**bare, "LC_CTYPE": "C.UTF-8"})
    assert "LC_CTYPE=C.UTF-8" in given.stdout  # one the caller set is kept


# -- counting -------------------------------------------------------------------------------

def test_reports_add_up_across_processes_and_skip_torn_files(tmp_path):
    for i, counts in enumerate([{"hits.user": 2, "saved_seconds": 1.0},
                                {"compiles": 1, "compile_seconds": 0.25, "misses": 1}]):
        (tmp_path / f"{i}.json").write_text(json.dumps({"pid": i, "counts": counts}))
    (tmp_path / "torn.json").write_text('{"pid": 3, "cou')
    s = tally.read_reports(tmp_path)
    assert (s["requested"], s["served"], s["compiled"], s["processes"]) == (3, 2, 1, 2)
    assert tally.describe(s) == ("3 programs requested: 1 compiled (0.25 s compiling), "
                                 "2 served (user 2); the served programs took 1.00 s to "
                                 "compile when first built")
    assert s["saved_basis"] == tally.SAVED_BASIS


COUNTED_APP = textwrap.dedent('''
    import sys
    import pyopencl as cl

    ctx = cl.Context(cl.get_platforms()[0].get_devices())
    calls = 0
    for i in range(3):                  # three sources, the first built three times
        for _ in range(3 if i == 0 else 1):
            cl.Program(ctx, "__kernel void k%d(__global int *a) { a[0] = %d; }" % (i, i)).build()
            calls += 1
    sys.stdout.write("%d\\n" % calls)
''')


def test_kdb_run_summary_counts_every_build_call(env, tmp_path):
    """The summary's programs requested match the program's own count of its build calls:
    repeats served from this process's memory are counted as served, not dropped."""
    app = tmp_path / "counted.py"
    app.write_text(COUNTED_APP)
    summaries = []
    for _ in range(2):
        proc = run([KDB, "run", "--json", "--", sys.executable, app], env)
        assert proc.returncode == 0, proc.stderr
        summaries.append((int(proc.stdout), json.loads(proc.stderr.strip().splitlines()[-1])))
    (calls1, first), (calls2, second) = summaries
    assert (first["requested"], first["compiled"], first["hits"]["memory"]) == (calls1, 3, 2)
    assert first["served"] == 2
    assert (second["requested"], second["compiled"], second["served"]) == (calls2, 0, calls2)
    assert second["hits"]["user"] + second["hits"]["memory"] == calls2
    assert second["saved_basis"] == tally.SAVED_BASIS


POOL_APP = textwrap.dedent('''
    import multiprocessing, sys

    def build(i):
        import pyopencl as cl
        ctx = cl.Context(cl.get_platforms()[0].get_devices())
        cl.Program(ctx, "__kernel void p%d(__global int *a) { a[0] = %d; }" % (i, i)).build()
        return i

    if __name__ == "__main__":
        # Leaving "with" terminates the workers (SIGTERM); a forked one ends in os._exit.
        with multiprocessing.get_context(sys.argv[1]).Pool(2) as pool:
            print(sum(pool.map(build, range(4), chunksize=1)))
''')


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_kdb_run_counts_the_compiles_of_pool_workers_that_never_run_their_exit_handlers(
        start, env, tmp_path):
    """multiprocessing's pool workers end in os._exit or by the pool's SIGTERM: their counts,
    written only at exit, never reached ``kdb run``, whose summary said 0 compiled."""
    from kdb.storing import spool

    app = tmp_path / "pool.py"
    app.write_text(POOL_APP)
    proc = run([KDB, "run", "--json", "--", sys.executable, app, start], env)
    assert proc.returncode == 0 and proc.stdout.strip() == "6", proc.stderr
    summary = json.loads(proc.stderr.strip().splitlines()[-1])
    assert summary["compiled"] == 4, summary
    # Stored all the same with KDB_STORE_AT_EXIT=wait: a terminated worker's stores went
    # to the store worker (they waited for an exit that never came: every run compiled).
    assert env.get("KDB_STORE_AT_EXIT", os.environ.get("KDB_STORE_AT_EXIT")) == "wait"
    assert spool.wait(Path(env["KDB_CACHE_DIR"]) / "v1", 300) == 0
    assert stored_entries(env["KDB_CACHE_DIR"]) == 4
    proc = run([KDB, "run", "--json", "--", sys.executable, app, start], env)
    again = json.loads(proc.stderr.strip().splitlines()[-1])
    # What the workers were served is counted too (it was not: "0 programs requested").
    assert (again["requested"], again["compiled"], again["served"]) == (4, 0, 4), again


def test_kdb_run_summary_says_how_many_compiles_are_still_pending_store(app, env):
    """Issue 35: with no store worker running, a run's compile is counted at once and its
    store shown pending, in the summary line and its JSON; a later run, after the store
    landed, has none pending."""
    from kdb.storing import spool

    # No early stores: the second run is to compile again, as where none could be kept.
    env = {**env, "KDB_STORE_AT_EXIT": "detach", "KDB_DISABLE_EARLY_STORE": "1"}
    with no_store_worker(env["KDB_CACHE_DIR"], env):
        proc = run([KDB, "run", "--json", "--", sys.executable, app], env)
        assert proc.returncode == 0, proc.stderr
        s = json.loads(proc.stderr.strip().splitlines()[-1])
        assert (s["compiled"], s["pending_stores"]) == (1, 1)
        proc = run([KDB, "run", "--", sys.executable, app], env)  # nothing stored: again
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("kdb run: 1 program requested: 1 compiled (") and (
            " s compiling, 1 of them pending store), 0 served;" in last), last
        assert stats(env)["compiles"] == 2 and stats(env)["pending"]["entries"] == 2
    assert spool.wait(Path(env["KDB_CACHE_DIR"]) / "v1", 300) == 0
    proc = run([KDB, "run", "--json", "--", sys.executable, app], env)
    s = json.loads(proc.stderr.strip().splitlines()[-1])
    assert (s["compiled"], s["served"], s["pending_stores"]) == (0, 1, 0)
    assert stats(env)["compiles"] == 2


# -- from the wheel -------------------------------------------------------------------------

@pytest.mark.slow
def test_the_wheel_installs_the_hook_and_kdb_run_works_from_it(kdb_venv, app, env):
    """What `pip install kdb` gives: kdb-auto.pth in a fresh venv's site-packages, an
    unmodified script adopted under `kdb run`, nothing compiled the second time."""
    python, kdb = kdb_venv / "bin" / "python", kdb_venv / "bin" / "kdb"
    assert (purelib(python) / "kdb-auto.pth").is_file()
    compiled = []
    for _ in range(2):
        proc = run([kdb, "run", "--json", "--", python, app], env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "adopted"
        compiled.append(json.loads(proc.stderr.strip().splitlines()[-1])["compiled"])
    assert compiled == [1, 0]
    assert run([python, app], env, check=True).stdout.strip() == "plain"  # KDB_AUTO unset


def test_kdb_info_says_whether_kdb_auto_is_on_and_where_the_hook_is(env):
    env["KDB_AUTO"] = "maybe"
    out = run([KDB, "info"], env, check=True).stdout
    assert "KDB_AUTO: 'maybe' (not understood: off); start-up hook: " in out
    assert "kdb-auto.pth" in out
    env.pop("KDB_AUTO")
    data = json.loads(run([KDB, "info", "--json"], env, check=True).stdout)["auto"]
    assert data["variable"] is None and data["on"] is False
    assert data["hook"].endswith("kdb-auto.pth")

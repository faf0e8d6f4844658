"""Triton kernels from kdb, for real: Triton compiles for explicit NVIDIA and AMD targets on
this CPU-only machine, each in a fresh process, with Triton's own compile listener (not kdb's
report) saying whether a kernel was compiled or found in the cache. Launching needs a GPU:
those tests are marked ``gpu`` and skip without one."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import venv_over

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install 'kdb[triton]')")

TRITON = tuple(int(p) for p in triton.__version__.split(".")[:2])
#: Triton 3.2 keys a launch by its AttrsDescriptor, not by parse_attr: kdb pack's manifest
#: kernels need Triton 3.3 (a run's kernels pack from the log on every version).
MANIFESTS = TRITON >= (3, 3)
needs_manifests = pytest.mark.skipif(
    not MANIFESTS, reason=f"Triton {triton.__version__}: kdb pack's manifest kernels need 3.3")
#: Before 3.5, Triton's wheels do not bundle ROCm's linker, which their AMD targets need.
AMD_LINKER = TRITON >= (3, 5) or os.path.exists("/opt/rocm/llvm/bin/ld.lld") \
    or bool(os.environ.get("TRITON_HIP_LLD_PATH"))
needs_amd = pytest.mark.skipif(
    not AMD_LINKER, reason=f"Triton {triton.__version__} compiles for AMD only with ROCm's linker "
                    "installed (/opt/rocm/llvm/bin/ld.lld)")

KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit
def scale(x_ptr, out_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * FACTOR, mask=mask)


@triton.jit
def axpy(x_ptr, out_ptr, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * a, mask=mask)
'''

#: Defined in the programs below: an ASTSource as the Triton installed takes it.
AST_SOURCE = '''
def ast_source(fn, sig, consts):
    """An ASTSource as this Triton takes it: from 3.3, the constexprs in the signature and
    ``constexprs=``; Triton 3.2, ``constants=`` and a signature without them."""
    import inspect

    if "constexprs" in inspect.signature(ASTSource.__init__).parameters:
        return ASTSource(fn=fn, signature=sig, constexprs=consts)
    return ASTSource(fn=fn, signature={k: t for k, t in sig.items() if t != "constexpr"},
                     constants=consts)
'''

#: Compiles the kernels asked on the command line for one target; prints Triton's own view.
APP = '''
import json, os, sys
sys.path.insert(0, os.environ["KERNELS_DIR"])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels



def jit_source(fn, target, sig, consts):
    """The source and options Triton's JIT compiles for a launch with 16-byte-aligned float32
    buffers and n = 1000, made by Triton's own code as JITFunction.run does (no device is
    needed to make them; only the launch needs one). Triton internals: this breaks, as it
    should, when Triton changes how a launch is keyed."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    class Buffer:  # what Triton reads of a tensor to specialize on it
        def __init__(self, ptr):
            self.ptr, self.dtype = ptr, triton.language.float32

        def data_ptr(self):
            return self.ptr

        def ptr_range(self):  # AMD's buffer operations: a tensor within 2 GB
            return 1 << 20

    backend = make_backend(target)
    knobs = getattr(triton, "knobs", None)
    if knobs is None:  # Triton 3.3 (and 3.4, 3.5 below): JITFunction.run passes debug alone
        kw = {"debug": os.environ.get("TRITON_DEBUG", "0") == "1"}
    else:  # and these where Triton has them: 3.6 the first, 3.9 both
        kw = {"debug": knobs.runtime.debug}
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                kw[name] = getattr(knobs.compilation, name)
    args = [Buffer(1 << (20 + i)) if t.startswith("*") else 0.5 if t == "fp32" else 1000
            for i, t in enumerate(t for t in sig.values() if t != "constexpr")]
    bound, spec, opts = create_function_from_signature(fn.signature, fn.params, backend)(
        *args, **consts, **kw)
    if hasattr(fn, "_pack_args"):  # Triton 3.5 on
        options, signature, constexprs, attrs = fn._pack_args(backend, {**kw, **consts},
                                                              bound, spec, opts)
        return ASTSource(fn, signature, constexprs, attrs), options.__dict__
    from triton._utils import find_paths_if, get_iterable_path  # 3.3 and 3.4: run() inline

    options = backend.parse_options({**kw, **consts})
    sigvals = [x[0] for x in spec]
    signature = dict(zip([p.name for p in fn.params], sigvals))
    constexprs = {p: get_iterable_path(list(bound.values()), p)
                  for p in find_paths_if(sigvals, lambda _, v: v == "constexpr")}
    attrvals = [x[1] for x in spec]
    attrs = {k: backend.parse_attr(get_iterable_path(attrvals, k))
             for k in find_paths_if(attrvals, lambda _, x: isinstance(x, str))}
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__


''' + AST_SOURCE + '''

def count_compiles():
    """Triton's own word on each compile: its listener (Triton 3.4 on), else the backend's
    stages, which Triton runs only for a kernel it compiles (every version). Returns the
    list the compile calls below append to: True for a cache hit."""
    events = []
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.compilation, "listener"):
        knobs.compilation.listener = lambda **kw: events.append(bool(kw["cache_hit"]))
        return events, None
    import triton.compiler.compiler as tcc

    stages, make = [0], tcc.make_backend

    def make_backend(target):
        b = make(target)
        cls = type(b)
        if not getattr(cls.add_stages, "counted", False):
            inner = cls.add_stages

            def add_stages(self, *a, **k):
                stages[0] += 1
                return inner(self, *a, **k)

            add_stages.counted = True
            cls.add_stages = add_stages
        return b

    tcc.make_backend = make_backend
    return events, stages


def counted(call):
    """``call()``, and whether it was a cache hit when no listener says so."""
    before = STAGES[0] if STAGES else None
    got = call()
    if STAGES is not None:
        events.append(STAGES[0] == before)
    return got


events, STAGES = count_compiles()
if os.environ.get("LOG_KDB"):  # kdb's debug lines (why it waited, or compiled) on stderr
    import logging

    logging.basicConfig(format="%(relativeCreated)d %(threadName)s %(message)s")
    logging.getLogger("kdb").setLevel(logging.DEBUG)
backend, arch, warp = os.environ["TARGET"].split(":")
target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, int(warp))
SIG = {"add": {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32",
               "BLOCK": "constexpr"},
       "scale": {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "FACTOR": "constexpr",
                 "BLOCK": "constexpr"},
       "axpy": {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "a": "fp32",
                "BLOCK": "constexpr"}}
binaries, cubins = [], []
for spec in sys.argv[1:]:
    name, _, block = spec.partition("/")
    consts = {"BLOCK": int(block or 64)}
    if name == "scale":
        consts["FACTOR"] = 3
    src, options = ast_source(getattr(kernels, name), SIG[name], consts), None
    if os.environ.get("JIT"):  # keyed as kernel[grid](...) keys a launch (see jit_source)
        src, options = jit_source(getattr(kernels, name), target, SIG[name], consts)
    if os.environ.get("PLAIN"):
        k = counted(lambda: triton.compile(src, target=target, options=options))
    else:
        import kdb.triton
        k = counted(lambda: kdb.triton.compile(src, target, options))
    binaries.append(len(k.asm.get("cubin") or k.asm.get("hsaco") or b""))
    cubins.append((k.asm.get("cubin") or k.asm.get("hsaco") or b"")[:4].hex())
runtime = os.environ.get("XDG_RUNTIME_DIR")
manager = triton.knobs.cache.manager_class  # the cache Triton uses, as it names it
print(json.dumps({"hits": events, "binaries": binaries, "cubins": cubins,
                  "manager": manager and f"{manager.__module__}:{manager.__qualname__}",
                  "variable": os.environ.get("TRITON_CACHE_MANAGER"),
                  "runtime": sorted(os.listdir(runtime)) if runtime else None}))
'''

NVIDIA = "cuda:90:32"
#: kdb's cache manager as install() sets it, as the app prints it: ``kdb.triton.CacheManager``
#: unless the program names its own later.
KDB_MANAGER = "kdb.backends.triton.chosen:CacheManagerUnlessTheirs"
AMD = "hip:gfx90a:64"


@pytest.fixture
def triton_env(tmp_path, cache_dir):
    (tmp_path / "kernels.py").write_text(KERNELS)
    (tmp_path / "app.py").write_text(APP)
    env = dict(os.environ, KERNELS_DIR=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path / "tc"),
               TARGET=NVIDIA, KDB_STORE_AT_EXIT="wait")
    env.pop("TRITON_CACHE_MANAGER", None)
    return env


def run_app(tmp_path, env, *kernels, **more):
    proc = subprocess.run([sys.executable, str(tmp_path / "app.py"), *kernels],
                          env={**env, **more}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


#: Compiles ``scale`` for sm_90 through plain ``triton.compile`` (kdb under ``KDB_AUTO``), then
#: says whether torch was imported and whether the kernel was served.
NO_DRIVER = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels
hits = []
triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "FACTOR": "constexpr",
       "BLOCK": "constexpr"}
triton.compile(ASTSource(fn=kernels.scale, signature=sig, constexprs={"FACTOR": 3, "BLOCK": 64}),
               target=GPUTarget("cuda", 90, 32))
print(json.dumps({"torch": "torch" in sys.modules, "hits": hits}))
"""


def test_without_a_gpu_device_file_triton_s_driver_is_not_made_to_learn_the_arch(
        triton_env, tmp_path):
    """kdb asks Triton's driver for the device's arch only where a GPU device file exists:
    making the driver probes every backend, and AMD's probe imports torch (1.7 s of a warm
    start of 20 kernels that took 0.6 s without it, Triton 3.9), for an answer known already.
    The kernel is still compiled once and served from kdb after."""
    import importlib.util

    from kdb.backends.triton.targets import GPU_DEVICE_FILES

    if any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        pytest.skip("this machine has a GPU device file: there kdb asks the driver")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: AMD's probe has nothing to import")
    (tmp_path / "program.py").write_text(NO_DRIVER)
    env = {**triton_env, "KDB_AUTO": "1"}
    said = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(tmp_path / "program.py")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        said.append(json.loads(proc.stdout.splitlines()[-1]))
    assert said == [{"torch": False, "hits": [False]}, {"torch": False, "hits": [True]}], said


#: Compiles ``scale`` through plain ``triton.compile`` (kdb under ``KDB_AUTO``) for each target
#: of argv (``90``, ``80``: sm_XX), and says per compile whether it was a hit and the target
#: in the kernel's metadata, and how often kdb listed the arches it could look in.
TARGETS = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kdb.backends.triton import cache
import kernels
listed = []
real = cache.lookup_archs
cache.lookup_archs = lambda *a: listed.append(1) or real(*a)
hits, targets = [], []
triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "FACTOR": "constexpr",
       "BLOCK": "constexpr"}
for cc in sys.argv[1:]:
    k = triton.compile(ASTSource(fn=kernels.scale, signature=sig,
                                 constexprs={"FACTOR": 3, "BLOCK": 64}),
                       target=GPUTarget("cuda", int(cc), 32))
    targets.append(k.metadata.target.arch)
print(json.dumps({"hits": hits, "targets": targets, "listed": len(listed)}))
"""


def test_with_the_arch_unknown_each_target_gets_its_own_kernel_and_a_warm_start_lists_once(
        triton_env, tmp_path):
    """Without a GPU a plain ``triton.compile(..., target=...)`` does not tell kdb the target
    before Triton asks its cache: kdb looks first in the arches that served the process
    already (a warm start lists the cache's directories once, not per kernel), and the key
    holds the target, so a kernel for sm_80 is never served sm_90's files."""
    from kdb.backends.triton.targets import GPU_DEVICE_FILES

    if any(os.path.exists(f) for f in GPU_DEVICE_FILES):
        pytest.skip("this machine has a GPU device file: there kdb asks the driver")
    (tmp_path / "program.py").write_text(TARGETS)
    env = {**triton_env, "KDB_AUTO": "1"}

    said = []

    def run(*ccs: str) -> dict:
        proc = subprocess.run([sys.executable, str(tmp_path / "program.py"), *ccs], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        said.append(proc.stderr)
        return json.loads(proc.stdout.splitlines()[-1])

    assert run("90", "80")["hits"] == [False, False]
    warm = run("90", "90", "80", "90", "80")
    assert warm == {"hits": [True] * 5, "targets": [90, 90, 80, 90, 80], "listed": 2}, warm
    # A kernel for a third target, looked up in both arches first: one miss, its own arch's
    # (each arch it looked in counted one, and that arch's stats showed misses it never had),
    # and the arch it compiled for has no system database, not those it only looked in.
    assert run("75")["hits"] == [False]
    assert "no system kernel database for arch 'sm_75'" in said[-1], said[-1]
    assert "arch 'sm_90'" not in said[-1] and "arch 'sm_80'" not in said[-1], said[-1]
    stats = json.loads(subprocess.run([str(Path(sys.executable).with_name("kdb")), "stats",
                                       "--json"], env=env, capture_output=True, text=True,
                                      timeout=120, check=True).stdout)
    misses = {a: s["misses"] for a, s in stats["arches"].items()}
    compiles = {a: s["compiles"] for a, s in stats["arches"].items()}
    assert misses == compiles == {"sm_90": 1, "sm_80": 1, "sm_75": 1}, stats


def entries(cache_dir: Path, arch: str) -> list[tuple]:
    path = cache_dir / "v1" / f"{arch}.kdb"
    if not path.exists():
        return []
    with sqlite3.connect(path) as conn:
        return conn.execute("SELECT backend, name FROM kernels ORDER BY name").fetchall()


def kernel_files(triton_cache: Path) -> list[Path]:
    return [p for p in triton_cache.rglob("*") if p.is_file()] if triton_cache.exists() else []


def test_a_second_process_finds_every_kernel_in_kdb(tmp_path, triton_env, cache_dir):
    first, _ = run_app(tmp_path, triton_env, "add", "scale")
    assert first["hits"] == [False, False] and all(first["binaries"])
    assert entries(cache_dir, "sm_90") == [("triton", "add"), ("triton", "scale")]
    second, _ = run_app(tmp_path, triton_env, "add", "scale")
    assert second["hits"] == [True, True] and second["binaries"] == first["binaries"]
    assert kernel_files(tmp_path / "tc") == []  # nothing of Triton's own cache on disk


def test_a_kernel_built_with_triton_kernel_override_is_left_to_triton_s_own_cache(
        tmp_path, triton_env, cache_dir):
    """A stage Triton takes from TRITON_OVERRIDE_DIR is in no key: stored in kdb, the
    overridden kernel was served to every later process without the override, and removing
    TRITON_CACHE_DIR (the way to undo one) no longer did."""
    (tmp_path / "override").mkdir()
    run_app(tmp_path, triton_env, "add", TRITON_KERNEL_OVERRIDE="1",
            TRITON_OVERRIDE_DIR=str(tmp_path / "override"))
    assert entries(cache_dir, "sm_90") == []
    assert kernel_files(tmp_path / "tc")  # where Triton alone keeps it
    shutil.rmtree(tmp_path / "tc")
    later, _ = run_app(tmp_path, triton_env, "add")
    assert later["hits"] == [False]
    assert entries(cache_dir, "sm_90") == [("triton", "add")]


@needs_amd
def test_an_amd_target_is_stored_in_its_own_arch(tmp_path, triton_env, cache_dir):
    first, _ = run_app(tmp_path, triton_env, "add", TARGET=AMD)
    assert first["hits"] == [False] and first["binaries"][0] > 0
    assert entries(cache_dir, "gfx90a") == [("triton", "add")]
    assert entries(cache_dir, "sm_90") == []
    second, _ = run_app(tmp_path, triton_env, "add", TARGET=AMD)
    assert second["hits"] == [True]


def test_a_changed_constexpr_is_another_kernel(tmp_path, triton_env, cache_dir):
    run_app(tmp_path, triton_env, "add/64")
    got, _ = run_app(tmp_path, triton_env, "add/64", "add/128")
    assert got["hits"] == [True, False]
    assert len(entries(cache_dir, "sm_90")) == 2


def test_plain_triton_under_kdb_auto_is_cached(tmp_path, triton_env, cache_dir):
    """No kdb in the program: KDB_AUTO adopts Triton when it is imported; with no GPU the
    target comes from the kernel's metadata at the store and from the user files at lookup."""
    first, _ = run_app(tmp_path, triton_env, "add", PLAIN="1", KDB_AUTO="1")
    assert first["manager"] == KDB_MANAGER and first["hits"] == [False]
    assert first["variable"] is None  # in the process, not in what its children inherit
    assert entries(cache_dir, "sm_90") == [("triton", "add")]
    second, _ = run_app(tmp_path, triton_env, "add", PLAIN="1", KDB_AUTO="1")
    assert second["hits"] == [True]
    assert kernel_files(tmp_path / "tc") == []


#: A Python without kdb (another venv, the system python3) compiling a Triton kernel; it
#: is started with -S and finds Triton through sys.path alone, so kdb is not importable.
NO_KDB_CHILD = '''
import importlib.util, json, os, sys
assert importlib.util.find_spec("kdb") is None, "kdb is importable in this child"
sys.path.insert(0, os.environ["KERNELS_DIR"])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels
k = triton.compile(ASTSource(fn=kernels.add, constexprs={"BLOCK": 64}, signature={
    "x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}),
    target=GPUTarget("cuda", 90, 32))
print(json.dumps({"cubin": k.asm["cubin"][:4].hex()}))
'''

#: A KDB_AUTO program that imports Triton, then starts that child and a child with kdb.
PARENT = '''
import json, os, subprocess, sys
import triton  # adopted here
site, child = sys.argv[1], sys.argv[2]
bare = subprocess.run([sys.executable, "-S", "-c",
                       f"import sys; sys.path.append({site!r}); exec(open({child!r}).read())"],
                      capture_output=True, text=True, cwd=os.path.dirname(child))
with_kdb = subprocess.run([sys.executable, sys.argv[3], "scale"], capture_output=True,
                          text=True)
print(json.dumps({"bare": [bare.returncode, bare.stdout, bare.stderr[-2000:]],
                  "with_kdb": [with_kdb.returncode, with_kdb.stdout, with_kdb.stderr[-2000:]]}))
'''


def test_a_child_without_kdb_compiles_triton_under_a_kdb_auto_parent(tmp_path, triton_env,
                                                                     cache_dir):
    """TRITON_CACHE_MANAGER=kdb.triton:CacheManager used to be exported to every child: one
    whose Python has no kdb died at its first compile (No module named 'kdb'). A child that
    has kdb still caches through kdb (it inherits KDB_AUTO and adopts Triton itself)."""
    import sysconfig

    (tmp_path / "child.py").write_text(NO_KDB_CHILD)
    (tmp_path / "parent.py").write_text(PARENT)
    proc = subprocess.run([sys.executable, str(tmp_path / "parent.py"),
                           sysconfig.get_paths()["purelib"], str(tmp_path / "child.py"),
                           str(tmp_path / "app.py")],
                          env={**triton_env, "KDB_AUTO": "1", "PLAIN": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    code, out, err = got["bare"]
    assert code == 0 and json.loads(out)["cubin"] == "7f454c46", err
    code, out, err = got["with_kdb"]
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["manager"] == KDB_MANAGER, err
    assert entries(cache_dir, "sm_90") == [("triton", "scale")]  # only the kdb child's


def test_kdb_auto_never_imports_triton_itself(triton_env):
    code = "import sys, pyopencl; print('triton' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], env={**triton_env, "KDB_AUTO": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["False"], proc.stderr


def test_a_program_with_its_own_cache_manager_keeps_it(tmp_path, triton_env, cache_dir):
    mine = "triton.runtime.cache:FileCacheManager"
    got, err = run_app(tmp_path, triton_env, "add", PLAIN="1", KDB_AUTO="1",
                       TRITON_CACHE_MANAGER=mine)
    assert got["manager"] == mine and got["hits"] == [False]
    assert err.count("TRITON_CACHE_MANAGER is already set") == 1
    assert entries(cache_dir, "sm_90") == []
    assert kernel_files(tmp_path / "tc")  # Triton's own cache, as the program asked


def test_the_manager_variable_has_one_name():
    import kdb.triton
    from kdb.backends.triton import chosen

    assert chosen.ENV_MANAGER == kdb.triton.ENV_MANAGER == "TRITON_CACHE_MANAGER"


def test_a_program_that_names_its_own_manager_after_importing_triton_keeps_it(
        tmp_path, triton_env, cache_dir):
    """Triton 3.4 on reads TRITON_CACHE_MANAGER at each compile, so a program may set it
    after ``import triton``; KDB_AUTO installed kdb at that import, and Triton's setting it
    used hid the variable: kdb cached the program's kernels, with no word said."""
    mine = "triton.runtime.cache:FileCacheManager"
    late = ("import os, runpy, sys, triton; os.environ['TRITON_CACHE_MANAGER'] = sys.argv[2]; "
            "sys.argv = sys.argv[1:2] + sys.argv[3:]; runpy.run_path(sys.argv[0], "
            "run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", late, str(tmp_path / "app.py"), mine, "add"],
                          env={**triton_env, "PLAIN": "1", "KDB_AUTO": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1])["hits"] == [False]
    assert proc.stderr.count(f"TRITON_CACHE_MANAGER is set ({mine})") == 1, proc.stderr
    assert entries(cache_dir, "sm_90") == []
    assert kernel_files(tmp_path / "tc")  # Triton's own cache, as the program asked


def test_a_corrupt_entry_is_dropped_and_compiled_again(tmp_path, triton_env, cache_dir):
    run_app(tmp_path, triton_env, "add")
    path = cache_dir / "v1" / "sm_90.kdb"
    import zstandard

    with sqlite3.connect(path) as conn:
        # A sound zstd frame of bytes that are not a group: checksums pass, the group does not.
        blob = zstandard.ZstdCompressor(write_checksum=True).compress(b"not a group")
        import hashlib

        conn.execute("UPDATE kernels SET blob = ?, raw_size = ?, checksum = ?",
                     (blob, len(b"not a group"), hashlib.sha256(b"not a group").hexdigest()))
    got, err = run_app(tmp_path, triton_env, "add")
    assert got["hits"] == [False] and got["binaries"][0] > 0
    assert "not a Triton artifact group" in err
    third, _ = run_app(tmp_path, triton_env, "add")
    assert third["hits"] == [True]


@pytest.mark.parametrize("plain", [False, True], ids=["kdb.triton.compile", "plain, KDB_AUTO"])
def test_processes_compiling_the_same_kernels_compile_each_once(plain, tmp_path, triton_env,
                                                                 cache_dir):
    """With the target named, and without (plain triton.compile, no GPU: the claim is on
    Triton's key and waiters look in every arch)."""
    kernels = ["add/16", "add/32", "add/64", "scale/64"]
    env = {**triton_env, "LOG_KDB": "1"}
    env.update({"PLAIN": "1", "KDB_AUTO": "1"} if plain else {})
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "app.py"), *kernels],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    hits = [json.loads(o.splitlines()[-1])["hits"] for o, _ in outs]
    # On a failure, each process's own account: when it waited, for whom, and why it stopped.
    said = "\n\n".join(f"process {i} (pid {p.pid}): {h}\n" + "\n".join(
        line for line in err.splitlines() if " kdb" in line)
        for i, (p, h, (_, err)) in enumerate(zip(procs, hits, outs)))
    assert sum(h.count(False) for h in hits) == len(kernels), said
    assert len(entries(cache_dir, "sm_90")) == len(kernels)
    # One file, the target's: no empty one for the claims made before the target was known.
    assert [p.name for p in (cache_dir / "v1").glob("*.kdb")] == ["sm_90.kdb"]


def test_kdb_lists_and_explains_triton_entries(tmp_path, triton_env, cache_dir):
    run_app(tmp_path, triton_env, "add")
    kdb = Path(sys.executable).with_name("kdb")
    ls = subprocess.run([kdb, "ls", "--arch", "sm_90"], env=triton_env, capture_output=True,
                        text=True, timeout=120)
    assert ls.returncode == 0 and "add" in ls.stdout and "triton" in ls.stdout, ls.stderr


def test_a_kernel_stored_by_another_python_is_a_miss_that_says_so(tmp_path, triton_env,
                                                                   cache_dir):
    """Triton's key digests its compiled extension, built per Python version, so a pack built
    on CPython 3.11 misses on 3.12 (the GPU check met it): the Python is in the compiler
    identity, and ``kdb explain`` names it instead of a bare miss."""
    other = "import sys, runpy; sys.implementation.cache_tag = 'cpython-399'; " \
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", other, str(tmp_path / "app.py"), "add"],
                          env={**triton_env, "PYTHONDONTWRITEBYTECODE": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert entries(cache_dir, "sm_90") == [("triton", "add")]
    again, _ = run_app(tmp_path, triton_env, "add")
    assert again["hits"] == [False]
    kdb = Path(sys.executable).with_name("kdb")
    why = subprocess.run([kdb, "explain", "add", "--json"], env=triton_env, capture_output=True,
                         text=True, timeout=120)
    assert why.returncode == 0, why.stderr
    text = why.stdout
    assert "compiler" in text and "cpython-399" in text, text


def test_the_private_files_are_removed_at_exit_or_after_a_kill(tmp_path, triton_env):
    from kdb.backends.triton import groups

    base = Path(tmp_path / "run")
    base.mkdir(mode=0o700)
    env = {**triton_env, "XDG_RUNTIME_DIR": str(base)}
    run_app(tmp_path, env, "add")
    run_app(tmp_path, env, "add")  # a hit: the group was written for Triton to read
    assert list(base.iterdir()) == []
    # A process killed after it wrote its files leaves them; the next one removes them.
    code = ("import os, sys; sys.argv = ['app', 'add']; import runpy; "
            f"runpy.run_path({str(tmp_path / 'app.py')!r}); os._exit(0)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                   timeout=600)
    left = list(base.iterdir())
    assert len(left) == 1 and left[0].name.startswith(f"kdb-triton-{os.getuid()}-")
    groups.remove_stale(str(base), os.getuid())
    assert list(base.iterdir()) == []


def test_a_live_process_s_files_are_kept_where_its_pid_cannot_be_seen(tmp_path):
    """A sweeper in another PID namespace (a container sharing ``/dev/shm``) sees a pid that
    is not its own process's: the directory's lock, held while its process lives, keeps it
    (issue 37 item 8). Once that process is gone, it is swept."""
    from kdb.backends.triton import groups

    base = tmp_path / "run"
    base.mkdir(mode=0o700)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kdb.backends.triton import groups; "
         "print(groups.private_dir('k' * 64), flush=True); sys.stdin.read()"],
        env={**os.environ, "XDG_RUNTIME_DIR": str(base)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        made = Path(holder.stdout.readline().strip()).parent
        unseen = base / f"kdb-triton-{os.getuid()}-{2 ** 22 + 4321}-elsewhere"
        made.rename(unseen)  # its pid as the other namespace sees it: no such process here
        groups.remove_stale(str(base), os.getuid())
        assert unseen.is_dir()
    finally:
        holder.stdin.close()
        holder.wait(60)
    groups.remove_stale(str(base), os.getuid())
    assert not unseen.exists()


def test_the_files_go_to_a_memory_file_system_where_there_is_one(monkeypatch, tmp_path):
    from kdb.backends.triton import groups

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert groups.runtime_dirs()[0] == str(tmp_path)
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    expected = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    assert groups.runtime_dirs()[0] == (expected or __import__("tempfile").gettempdir())


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("whose", ["another user's", "anyone's"])
def test_a_runtime_directory_others_can_change_is_refused(tmp_path, triton_env, whose):
    """After su or sudo -E, XDG_RUNTIME_DIR is still the other user's: they could swap the
    private directory between kdb's write and Triton's read, and the process would load
    their kernel (and, on a miss, store it). Refused with one warning; Triton still works."""
    theirs = tmp_path / "run"
    theirs.mkdir(mode=0o700)
    if whose == "anyone's":
        theirs.chmod(0o777)
    else:
        os.chown(theirs, 65534, 65534)
    env = {**triton_env, "XDG_RUNTIME_DIR": str(theirs)}
    for hit in (False, True):
        got, err = run_app(tmp_path, env, "add")
        assert got["hits"] == [hit] and got["cubins"] == ["7f454c46"], err[-2000:]
        assert got["runtime"] == [], "kdb wrote Triton's files where another user can reach"
        assert err.count(f"{theirs} is refused for Triton's files") == 1, err[-2000:]


#: The other user rewrites a file of the compile between kdb's write and the store.
TAMPERING = '''
import kdb.backends.triton.cache as _cache
_put = _cache.CacheManager.put
def _tampered(self, data, filename, binary=True):
    path = _put(self, data, filename, binary)
    if filename.endswith(".cubin"):
        with open(path, "wb") as f:
            f.write(b"EVIL" * 64)
    return path
_cache.CacheManager.put = _tampered
'''


def test_a_file_changed_before_the_store_is_never_stored(tmp_path, triton_env, cache_dir):
    """What kdb stores is what it wrote: a file of the group read back with other bytes
    (someone else wrote it meanwhile) stores nothing, with one warning."""
    (tmp_path / "tampered.py").write_text(TAMPERING + APP)
    proc = subprocess.run([sys.executable, str(tmp_path / "tampered.py"), "add"],
                          env=triton_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("changed after kdb wrote it") == 1, proc.stderr[-2000:]
    assert entries(cache_dir, "sm_90") == []
    got, _ = run_app(tmp_path, triton_env, "add")
    assert got["hits"] == [False] and got["cubins"] == ["7f454c46"]  # compiled, sound


def test_a_name_on_the_way_to_the_private_files_is_never_followed(monkeypatch, tmp_path):
    """A kernel's directory replaced by a link: the files are never written where it leads."""
    import tempfile

    from kdb.backends.triton import groups

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(groups, "_root", [])
    first = Path(groups.write_files("K", {"k.json": b"{}"})["k.json"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for f in first.parent.iterdir():
        f.unlink()
    first.parent.rmdir()
    first.parent.symlink_to(elsewhere)
    try:
        got = groups.write_files("K", {"k.json": b"{}"})
        assert not Path(got["k.json"]).parent.is_symlink()  # another private directory
    except OSError:
        pass  # or none at all: Triton compiles
    assert list(elsewhere.iterdir()) == []
    groups._remove_at_exit()


def test_a_group_packs_and_unpacks_byte_for_byte():
    from kdb.backends.triton import groups

    files = {"k.json": b"{}", "k.cubin": bytes(range(256)), "k.ptx": b"// ptx"}
    blob = groups.pack(files)
    assert groups.unpack(blob) == files and groups.pack(dict(reversed(files.items()))) == blob
    assert groups.unpack(b"junk") is None
    assert groups.unpack(blob[:-1]) is None
    assert groups.unpack(groups.MAGIC + b'[["../x", 1]]\nx') is None
    # metadata Triton would fail to load (every later process crashed on it): not a group
    assert groups.unpack(groups.pack({**files, "k.json": b'{"name": "k", '})) is None
    assert groups.unpack(groups.pack({**files, "k.json": b"[]"})) is None


MANIFEST = '''
[[kernel]]
name = "add_64"
backend = "triton"
file = "kernels.py"
function = "add"
signature = { x_ptr = "*fp32", y_ptr = "*fp32", out_ptr = "*fp32", n = "i32", BLOCK = "constexpr" }
constexprs = { BLOCK = 64 }
arches = ["sm_80", "sm_90", "gfx90a", "gfx942"]

[[kernel]]
name = "scale_64"
backend = "triton"
file = "kernels.py"
function = "scale"
signature = { x_ptr = "*fp32", out_ptr = "*fp32", n = "i32", FACTOR = "constexpr", BLOCK = "constexpr" }
constexprs = { FACTOR = 3, BLOCK = 64 }
arches = ["sm_90", "gfx942"]

[[kernel]]
name = "axpy_64"
backend = "triton"
file = "kernels.py"
function = "axpy"
signature = { x_ptr = "*fp32", out_ptr = "*fp32", n = "i32", a = "fp32", BLOCK = "constexpr" }
constexprs = { BLOCK = 64 }
arches = ["sm_90", "gfx942"]
'''

ARCHES = ["sm_80", "sm_90", "gfx90a", "gfx942"]
#: A Triton pack's wheel is tagged for the Python its entries name (kdb.pack.builtfor).
PY_TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def amd_launches_keyed(tmp_path) -> bool:
    """Whether kdb pack can key an AMD launch with this Triton where torch is missing:
    Triton 3.6's AMD backend asks torch whether each tensor is within 2 GB (kdb pack says
    so); other versions read the stand-in's range."""
    from kdb.backends.triton import packing
    from kdb.errors import BackendUnavailableError

    (tmp_path / "probe.py").write_text(KERNELS)
    try:
        with warnings.catch_warnings():  # Triton's own notices about its defaults
            warnings.simplefilter("ignore")
            packing.launch_source(packing.kernel_of(str(tmp_path / "probe.py"), "add"),
                                  {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32",
                                   "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 64}, {},
                                  packing.gpu_target("gfx942"))
    except BackendUnavailableError as err:
        assert "torch" in str(err)
        return False
    return True


def pack(tmp_path, env, out: Path, arches=ARCHES) -> subprocess.CompletedProcess:
    (tmp_path / "kernels.toml").write_text(MANIFEST)
    kdb = Path(sys.executable).with_name("kdb")
    cmd = [kdb, "pack", *(a for arch in arches for a in ("--arch", arch)), "--manifest",
           tmp_path / "kernels.toml", "--version", "1.0.0", "--out", out]
    proc = subprocess.run([str(c) for c in cmd], env={**env, "SOURCE_DATE_EPOCH": "1700000000"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@needs_manifests
def test_packs_per_arch_are_reproducible_and_an_installed_one_compiles_nothing(
        tmp_path, triton_env, cache_dir, kdb_wheel):
    amd = AMD_LINKER and amd_launches_keyed(tmp_path)
    arches = ARCHES if amd else [a for a in ARCHES if a.startswith("sm_")]
    pack(tmp_path, {**triton_env, "KDB_CACHE_DIR": str(tmp_path / "pack-a")}, tmp_path / "a",
         arches)
    pack(tmp_path, {**triton_env, "KDB_CACHE_DIR": str(tmp_path / "pack-b"),
                    "TRITON_CACHE_DIR": str(tmp_path / "tc-b")}, tmp_path / "b", arches)
    built = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert built == sorted([f"{a}.kdb" for a in arches]
                           + [f"kdb_system_{a}-1.0.0-{PY_TAG}-none-any.whl" for a in arches])
    for name in built:  # byte for byte, files and wheels
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    import zipfile

    with zipfile.ZipFile(tmp_path / "a" / f"kdb_system_sm_90-1.0.0-{PY_TAG}-none-any.whl") as z:
        meta = next(z.read(n).decode() for n in z.namelist() if n.endswith("/METADATA"))
    assert f"Requires-Python: =={sys.version_info[0]}.{sys.version_info[1]}.*" in meta
    with sqlite3.connect(tmp_path / "a" / "sm_80.kdb") as conn:
        assert conn.execute("SELECT backend, name FROM kernels").fetchall() == [("triton", "add")]

    # A fresh venv: kdb's wheel and the sm_90 and gfx942 packs installed by pip; the other
    # packages (Triton, zstandard, ...) from this environment through a path line, as the
    # benchmarks' adopt scenario does, so nothing is downloaded.
    import sysconfig

    packs = [tmp_path / "a" / f"kdb_system_{a}-1.0.0-{PY_TAG}-none-any.whl"
             for a in ("sm_90", "gfx942") if a in arches]
    venv = venv_over(tmp_path / "venv", sysconfig.get_paths()["purelib"], kdb_wheel, *packs)
    python = venv / "bin" / "python"
    fresh = {k: v for k, v in triton_env.items() if k != "PYTHONPATH"}
    for target in (NVIDIA, "hip:gfx942:64") if amd else (NVIDIA,):
        for plain in ("", "1"):  # kdb.triton.compile; plain triton.compile under KDB_AUTO
            proc = subprocess.run([str(python), str(tmp_path / "app.py"), "add", "scale",
                                   "axpy"],
                                  env={**fresh, "TARGET": target, "PLAIN": plain,
                                       "KDB_AUTO": plain, "JIT": "1"}, capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, proc.stderr[-3000:]
            got = json.loads(proc.stdout.splitlines()[-1])
            assert got["hits"] == [True, True, True], (target, plain, proc.stderr[-2000:])
    assert entries(cache_dir, "sm_90") == [] and entries(cache_dir, "gfx942") == []
    assert kernel_files(tmp_path / "tc") == []


@pytest.mark.skipif(MANIFESTS, reason=f"Triton {triton.__version__} packs manifest kernels")
def test_a_manifest_pack_on_triton_3_2_says_what_to_do_instead(tmp_path, triton_env):
    """Triton 3.2 keys a launch by an AttrsDescriptor: kdb pack says which Triton it needs and
    what packs on this one, instead of a traceback."""
    (tmp_path / "kernels.toml").write_text(MANIFEST)
    kdb = Path(sys.executable).with_name("kdb")
    proc = subprocess.run([str(kdb), "pack", "--arch", "sm_90", "--manifest",
                           str(tmp_path / "kernels.toml"), "--out", str(tmp_path / "dist")],
                          env=triton_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Triton 3.3 or newer" in proc.stderr and "--from-log" in proc.stderr
    assert "Traceback" not in proc.stderr


LAUNCH = '''
import json, os, sys
sys.path.insert(0, os.environ["KERNELS_DIR"])
import torch, triton
import kernels

events = []
triton.knobs.compilation.listener = lambda **kw: events.append(bool(kw["cache_hit"]))
x = torch.arange(1000, dtype=torch.float32, device="cuda")
out = torch.empty_like(x)
kernels.add[(triton.cdiv(1000, 64),)](x, x, out, 1000, BLOCK=64)
print(json.dumps({"hits": events, "ok": bool(torch.equal(out, 2 * x))}))
'''


@pytest.mark.gpu
def test_a_launched_kernel_is_served_from_kdb_in_the_next_process(tmp_path, triton_env):
    """The JIT path on a GPU: the target is the device's; the second process launches the
    kernel kdb stored, and it computes the right numbers."""
    torch = pytest.importorskip("torch", reason="launching needs torch (and a GPU)")
    if not torch.cuda.is_available():
        pytest.skip("no GPU: launching a Triton kernel needs one")
    (tmp_path / "launch.py").write_text(LAUNCH)
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(tmp_path / "launch.py")],
                              env={**triton_env, "KDB_AUTO": "1"}, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.splitlines()[-1]))
    assert runs[0] == {"hits": [False], "ok": True}
    assert runs[1] == {"hits": [True], "ok": True}


def test_a_pack_from_the_start_up_log_ships_the_triton_kernels_a_run_compiled(
        tmp_path, triton_env, cache_dir):
    run_app(tmp_path, triton_env, "add", "scale")
    kdb = Path(sys.executable).with_name("kdb")
    proc = subprocess.run([str(kdb), "pack", "--arch", "sm_90", "--from-log", "--version",
                           "1.0.0", "--out", str(tmp_path / "dist")], env=triton_env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with sqlite3.connect(tmp_path / "dist" / "sm_90.kdb") as conn:
        names = conn.execute("SELECT backend, name FROM kernels ORDER BY name").fetchall()
    assert names == [("triton", "add"), ("triton", "scale")]
    served, _ = run_app(tmp_path, {**triton_env, "KDB_SYSTEM_DB_PATH": str(tmp_path / "dist"),
                                   "KDB_CACHE_DIR": str(tmp_path / "other")}, "add", "scale")
    assert served["hits"] == [True, True]  # from the system file alone


def test_kdb_run_and_pytest_kdb_route_triton_too(tmp_path, triton_env, cache_dir):
    kdb = Path(sys.executable).with_name("kdb")
    proc = subprocess.run([str(kdb), "run", "--", sys.executable, str(tmp_path / "app.py"), "add"],
                          env={**triton_env, "PLAIN": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1])["manager"] == KDB_MANAGER
    assert "1 program requested: 1 compiled" in proc.stderr
    assert entries(cache_dir, "sm_90") == [("triton", "add")]
    (tmp_path / "test_in_pytest.py").write_text(
        "import os, runpy, sys\n"
        "def test_triton(capsys):\n"
        "    sys.argv = ['app.py', 'scale']\n"
        "    runpy.run_path(os.path.join(os.environ['KERNELS_DIR'], 'app.py'))\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--kdb", "-p", "no:cacheprovider",
                           str(tmp_path / "test_in_pytest.py")], env={**triton_env, "PLAIN": "1"},
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert entries(cache_dir, "sm_90") == [("triton", "add"), ("triton", "scale")]


@pytest.mark.parametrize("bad, message", [
    ('specialization = { n = "X" }', "'specialization' maps arguments"),
    ('specialization = { nope = "D" }', "'specialization' maps arguments"),
    ('options = ["-O3"]', "not compiler options"),
    ("", "needs 'arches'"),
])
def test_a_bad_triton_manifest_entry_is_refused_with_what_to_write(tmp_path, bad, message):
    from kdb.errors import InvalidArgumentError
    from kdb.pack.manifest import load_manifest

    (tmp_path / "kernels.py").write_text(KERNELS)
    arches = '' if not bad else 'arches = ["sm_90"]\n'
    (tmp_path / "m.toml").write_text(
        '[[kernel]]\nname = "k"\nbackend = "triton"\nfile = "kernels.py"\nfunction = "add"\n'
        'signature = { x_ptr = "*fp32", y_ptr = "*fp32", out_ptr = "*fp32", n = "i32", '
        'BLOCK = "constexpr" }\n' + arches + bad + "\n")
    with pytest.raises(InvalidArgumentError, match=message):
        load_manifest(tmp_path / "m.toml")


SIBLING = """
import triton
import triton.language as tl
from helpers import twice


@triton.jit
def doubled(x_ptr, n, BLOCK: tl.constexpr = 64):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, twice(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)
"""

HELPERS = """
import triton


@triton.jit
def twice(x):
    return x * 2
"""


@needs_manifests
def test_a_manifest_module_imports_beside_it_and_one_that_fails_is_a_kernel_s_failure(
        tmp_path, triton_env):
    """A module importing a helper beside it failed (its directory not on the path), and a
    module that raised at import was a traceback of kdb pack, --keep-going or not. A
    constexpr left to its default was refused as "not a constexpr"."""
    (tmp_path / "sibling.py").write_text(SIBLING)
    (tmp_path / "helpers.py").write_text(HELPERS)
    (tmp_path / "syntax.py").write_text("def broken(:\n")
    (tmp_path / "m.toml").write_text(
        '[[kernel]]\nname = "doubled"\nbackend = "triton"\nfile = "sibling.py"\n'
        'function = "doubled"\nsignature = { x_ptr = "*fp32", n = "i32", BLOCK = "constexpr" }'
        '\narches = ["sm_90"]\n\n'
        '[[kernel]]\nname = "broken"\nbackend = "triton"\nfile = "syntax.py"\n'
        'function = "broken"\nsignature = { x_ptr = "*fp32" }\narches = ["sm_90"]\n')
    kdb_cli = str(Path(sys.executable).with_name("kdb"))
    env = {**triton_env, "KDB_CACHE_DIR": str(tmp_path / "pack")}
    args = [kdb_cli, "pack", "--arch", "sm_90", "--manifest", str(tmp_path / "m.toml"),
            "--out", str(tmp_path / "out")]
    proc = subprocess.run(args + ["--keep-going"], env=env, capture_output=True, text=True,
                          cwd="/", timeout=600)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "broken" in proc.stderr and "SyntaxError" in proc.stderr, proc.stderr[-3000:]
    with sqlite3.connect(tmp_path / "out" / "sm_90.kdb") as conn:
        assert conn.execute("SELECT name FROM kernels").fetchall() == [("doubled",)]

    (tmp_path / "m2.toml").write_text(
        (tmp_path / "m.toml").read_text().split("\n\n")[0].replace("sm_90", "sm_999") + "\n")
    bad_arch = subprocess.run([kdb_cli, "pack", "--arch", "sm_999", "--manifest",
                               str(tmp_path / "m2.toml"), "--out", str(tmp_path / "out2")],
                              env=env, capture_output=True, text=True, timeout=600)
    assert bad_arch.returncode != 0 and "Traceback" not in bad_arch.stderr
    assert "does not build sm_999; it builds" in bad_arch.stderr, bad_arch.stderr[-2000:]


BROKEN = '''
import triton
import triton.language as tl


@triton.jit
def broken(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), not_defined_anywhere)
'''

#: Compiles the broken kernel (and, with AND_GOOD, then a good one), says so, then lingers.
FAILING = '''
import os, sys, time
sys.path.insert(0, os.environ["KERNELS_DIR"])
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import broken, kernels
import kdb.triton
''' + AST_SOURCE + '''
target = GPUTarget("cuda", 90, 32)
start = time.perf_counter()
try:
    kdb.triton.compile(ast_source(broken.broken, {"x_ptr": "*fp32", "BLOCK": "constexpr"},
                                  {"BLOCK": 64}), target)
except Exception as err:
    print("failed:", type(err).__name__, flush=True)
if os.environ.get("AND_GOOD"):
    kdb.triton.compile(ast_source(kernels.add, {"x_ptr": "*fp32", "y_ptr": "*fp32",
                       "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                       {"BLOCK": 64}), target)
print("done %.1f" % (time.perf_counter() - start), flush=True)
time.sleep(float(os.environ.get("LINGER", "0")))
'''


def test_a_kernel_that_fails_to_compile_does_not_keep_others_waiting(tmp_path, triton_env):
    """A process whose compile raised and that goes on compiling releases the claim: another
    process compiling the same broken kernel fails at once instead of waiting for it."""
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "failing.py").write_text(FAILING)
    env = {**triton_env, "KDB_WAIT_TIMEOUT": "30"}
    first = subprocess.Popen([sys.executable, str(tmp_path / "failing.py")],
                             env={**env, "AND_GOOD": "1", "LINGER": "60"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()
        assert line.startswith("failed:"), line + first.stderr.read()
        assert first.stdout.readline().startswith("done")  # still alive, lingering
        second = subprocess.run([sys.executable, str(tmp_path / "failing.py")], env=env,
                                capture_output=True, text=True, timeout=120)
        assert second.stdout.startswith("failed:"), second.stderr[-2000:]
        waited = float(second.stdout.split("done")[1])
        assert waited < 15, f"the second process waited {waited} s for a compile that failed"
    finally:
        first.kill()
        first.wait()


def test_a_full_memory_file_system_moves_the_files_to_the_temporary_directory(
        monkeypatch, tmp_path, caplog):
    """A container's /dev/shm is 64 MB: when writing there fails, this process's files go to
    the temporary directory, with one warning; where nothing can be written, a hit is a miss
    (Triton compiles), never an error."""
    import errno
    import tempfile

    from kdb.backends.triton import groups

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir(mode=0o700)
    tmp.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(shm))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(groups, "_root", [])
    real = groups._write

    def full_shm(directory, files):
        if directory.startswith(str(shm)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(directory, files)

    monkeypatch.setattr(groups, "_write", full_shm)
    paths = groups.write_files("K", {"k.json": b"{}"})
    assert paths["k.json"].startswith(str(tmp)) and Path(paths["k.json"]).read_bytes() == b"{}"
    assert groups.write_files("K2", {"k.cubin": b"x"})["k.cubin"].startswith(str(tmp))
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1

    monkeypatch.setattr(groups, "_write", lambda d, f: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError):
        groups.write_files("K3", {"k.json": b"{}"})
    groups._remove_at_exit()


def test_a_planted_link_or_another_users_directory_is_never_removed(tmp_path):
    """Stale directories are found by name; a name someone else planted (a link to a
    directory of ours, a directory of theirs) must not make kdb delete what it points at."""
    from kdb.backends.triton import groups

    base, mine = tmp_path / "run", tmp_path / "precious"
    base.mkdir(mode=0o700)
    mine.mkdir()
    (mine / "keep").write_text("x")
    dead = 2 ** 22 + 12345  # above the usual pid_max: no such process
    (base / f"kdb-triton-{os.getuid()}-{dead}-link").symlink_to(mine)
    theirs = base / f"kdb-triton-{os.getuid()}-{dead}-theirs"
    theirs.mkdir()
    (theirs / "f").write_text("y")
    can_chown = os.getuid() == 0
    if can_chown:
        os.chown(theirs, 65534, 65534)
    groups.remove_stale(str(base), os.getuid())
    assert (mine / "keep").exists() and (base / f"kdb-triton-{os.getuid()}-{dead}-link").is_symlink()
    assert theirs.exists() == can_chown  # not ours: kept; ours (non-root run): removed

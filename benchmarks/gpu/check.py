#!/usr/bin/env python3
"""The GPU check: kdb on a real NVIDIA GPU, each result against the same code without kdb.

Two halves. Here, on any machine (no GPU needed)::

    .venv/bin/python benchmarks/gpu/check.py --no-gpu

builds what travels to the GPU machine into ``benchmarks/gpu/carry/`` (ignored by git): kdb's
wheel and its dependencies' wheels for CPython 3.10-3.13 (the GPU machine has no network),
pyopencl's, and the packs ``kdb pack`` builds without a GPU (sm_80, sm_90, gfx90a, gfx942;
the sm_XX wheels travel), prints the one command to run there and writes it to
``carry/command.txt``; then dry-runs what it can of the GPU half (the install from the carried
wheels alone, Triton kernels compiled for sm_90, CUDA compiled, a cubin served from the pack
by a process with no compiler, a HIP code object compiled then served). On the GPU machine,
from the repository's root::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu/check.py --out "$OUT"

installs kdb from the carried wheels into a venv that sees that python's own packages
(torch, Triton, CuPy), runs every part in fresh processes (``child.py``) and writes
``gpu-check.json`` (every figure) and a one-line verdict. The hip part runs only on an AMD
GPU (``/dev/kfd`` and a HIP runtime that reports a device), else says "no AMD GPU". A part
that cannot run says why; a part that fails is recorded and the others still run; the whole
stays within ``--budget`` seconds (default 450).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CARRY = HERE / "carry"
WORK = HERE / "work"
#: The Triton of the GPU machine's python (a pack serves only the Triton that built it).
DEVICE_TRITON = "3.6.0"
PACK_ARCHES = ("sm_80", "sm_90", "gfx90a", "gfx942")
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
#: What the device machine takes: the working tree and carried paths, and one command line.
CARRY_LIMIT = 64 * 1024 * 1024
COMMAND_LIMIT = 2000
CARRY_PATH = "benchmarks/gpu/carry"
COMMAND = 'PYTHONUNBUFFERED=1 python3 benchmarks/gpu/check.py --out "$OUT"'
#: Seconds to give the device's command: the budget, the last part's overrun, the JSON.
RUN_TIMEOUT = 540
#: The GPU machine's Python (its python3 is 3.12): pycuda ships no wheels, so one is built
#: here for it, against this machine's CUDA headers.
DEVICE_PYTHON = "3.12"
#: Left out of the carried wheels: the GPU machine's python has them.
ON_THE_MACHINE = ("numpy",)
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64", "any")
NO_GPU = "not run: no GPU"
NO_AMD_GPU = "no AMD GPU"
TRITON_KERNELS = ["add", "softmax", "layer_norm", "matmul"]
#: Issue 36: Triton on a new node (kdb warm, Triton's cache empty) within 2% of Triton warm.
FRESH_NODE_GOAL = 1.02
PACKED_KERNELS = ["add", "softmax", "layer_norm"]


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the record ------------------------------------------------------------------------------

class Check:
    """Every figure, part by part; the time budget; fresh directories."""

    def __init__(self, budget: float, scratch: Path) -> None:
        self.deadline = time.monotonic() + budget
        self.scratch = scratch
        self.data: dict = {"parts": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._n = 0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fresh(self, stem: str) -> str:
        self._n += 1
        d = self.scratch / f"{self._n:03d}-{stem}"
        d.mkdir(mode=0o700, parents=True)
        return str(d)

    @contextlib.contextmanager
    def part(self, name: str, needs: float = 30.0):
        """A part's record: ``status`` pass / fail / skipped / error, its reason and figures.
        An exception is recorded, never raised; a part that would not fit the budget is
        skipped, saying so."""
        rec = self.data["parts"].setdefault(name, {"status": "pass", "figures": {}})
        start = time.monotonic()
        if self.left() < needs:
            rec.update(status="skipped", reason=f"budget: {self.left():.0f} s left, the part "
                       f"needs about {needs:.0f} s")
            yield None
            return
        log(f"{name}: start ({self.left():.0f} s of budget left)")
        try:
            yield rec
        except Skip as s:
            rec.update(status="skipped", reason=str(s))
        except Exception as err:  # noqa: BLE001 - one part's failure must not stop the others
            rec.update(status="error", reason=f"{type(err).__name__}: {err}",
                       traceback=traceback.format_exc()[-3000:])
        rec["seconds"] = round(time.monotonic() - start, 1)
        log(f"{name}: {rec['status']}" + (f" ({rec['reason']})" if rec.get("reason") else ""))

    def fail_unless(self, rec: dict, condition: bool, what: str) -> None:
        """Record ``what`` as a failed expectation of the part (the part goes on)."""
        if not condition:
            rec["status"] = "fail"
            rec.setdefault("failed", []).append(what)


class Skip(Exception):
    """A part that cannot run here; the message says why."""


# -- processes -------------------------------------------------------------------------------

def stripped_env() -> list[str]:
    """The variables of the caller that the children do not inherit (kdb's, Triton's,
    Inductor's: they change keys and caches)."""
    return sorted(k for k in os.environ if k.startswith(("KDB_", "TORCHINDUCTOR_", "TRITON_")))


def base_env() -> dict[str, str]:
    """The environment every child starts from: nothing of kdb, Triton's or Inductor's cache
    settings inherited from the caller."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KDB_", "TORCHINDUCTOR_", "TRITON_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(check: Check, python: str, args: list[str], env: dict[str, str],
              timeout: float = 300) -> dict:
    """``child.py ARGS`` in a fresh process: its JSON, plus ``wall`` (spawn to exit), ``rc``
    and the end of its stderr."""
    limit = max(5.0, min(timeout, check.left() - 3))
    start = time.perf_counter()
    try:
        proc = subprocess.run([python, str(HERE / "child.py"), *args], env=env,
                              cwd=str(check.scratch),
                              capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"child.py {' '.join(args)} ran past {limit:.0f} s: "
                           f"{(err.stderr or b'')[-800:]!r}") from None
    wall = time.perf_counter() - start
    got: dict = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CHECK-JSON:"):
            got = json.loads(line[len("CHECK-JSON:"):])
    got.update(wall=round(wall, 4), rc=proc.returncode)
    if proc.returncode != 0:
        got["stderr"] = proc.stderr[-2500:]
        raise RuntimeError(f"child.py {' '.join(args)} exited {proc.returncode}: "
                           f"{proc.stderr.strip()[-1500:]}")
    return got


def run(cmd: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))[:300]} exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip()[-1500:]}")
    return proc


# -- installing kdb from the carried wheels --------------------------------------------------

def site_dirs(python: str) -> list[str]:
    code = ("import json, site, sysconfig; p = sysconfig.get_paths(); "
            "print(json.dumps(list(dict.fromkeys([p['purelib'], p['platlib'], "
            "*site.getsitepackages()]))))")
    return json.loads(run([python, "-c", code], timeout=60).stdout)


def install_kdb(machine_python: str, wheels: Path, root: Path) -> dict:
    """A venv with kdb and its dependencies from ``wheels`` only (``--no-index``), that also
    sees ``machine_python``'s own packages (torch, Triton, CuPy), except in a process that
    sets ``KDB_CHECK_BARE=1``: that one has kdb alone, no compiler package.

    A venv made from a venv does not see the outer one's packages even with
    ``--system-site-packages`` (it sees the base interpreter's), so a path file adds the
    machine python's site directories (with their own path files) after the venv's own."""
    start = time.perf_counter()
    venv = root / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    run([machine_python, "-m", "venv", "--without-pip", venv], timeout=120)
    python = str(venv / "bin" / "python")
    outer = site_dirs(machine_python)
    pip = [*pip_for(machine_python, python), "install", "--quiet", "--no-index",
           "--find-links", wheels]
    run([*pip, "kdb"], timeout=300)  # kdb's own dependencies, seen by the bare process too
    purelib = site_dirs(python)[0]
    Path(purelib, "zz-kdb-check-outer.pth").write_text(
        "import os, site; os.environ.get('KDB_CHECK_BARE') or "
        f"list(map(site.addsitedir, {outer!r}))\n", encoding="utf-8")
    got = {"python": python, "outer_site": outer, "seconds": None, "pyopencl": None}
    if list(wheels.glob("pyopencl-*.whl")):
        try:  # numpy comes from the machine's python
            run([*pip, "pyopencl"], timeout=300)
            got["pyopencl"] = "installed"
        except RuntimeError as err:
            got["pyopencl"] = f"not installed: {str(err)[-400:]}"
    got["pycuda"] = None
    if list(wheels.glob("pycuda-*.whl")):
        try:  # only for the Python it was built for
            run([*pip, "pycuda"], timeout=300)
            got["pycuda"] = "installed"
        except RuntimeError as err:
            got["pycuda"] = f"not installed: {str(err)[-400:]}"
    code = "import json, kdb; print(json.dumps({'kdb': kdb.__version__, 'file': kdb.__file__}))"
    got.update(json.loads(run([python, "-c", code], timeout=60, cwd=root).stdout))
    bare = run([python, "-c", "import kdb, importlib.util as u; print(u.find_spec('nvidia') "
                "is None and u.find_spec('triton') is None)"],
               env={**base_env(), "KDB_CHECK_BARE": "1"}, timeout=60, cwd=root).stdout.strip()
    got["from_the_wheel"] = "site-packages" in got["file"]
    got["bare_sees_no_compiler_packages"] = bare == "True"
    got["seconds"] = round(time.perf_counter() - start, 1)
    return got


def pip_for(machine_python: str, python: str) -> list[str]:
    """pip acting on the venv of ``python``: the machine's own pip (``--python``, pip 22.3
    on), else the venv's, bootstrapped by ensurepip (no network either way)."""
    outer = [machine_python, "-m", "pip", "--disable-pip-version-check", "--python", python]
    try:
        run([*outer, "--version"], timeout=120)
        return outer
    except RuntimeError:
        if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode:
            run([python, "-m", "ensurepip", "--default-pip"], timeout=300)
        return [python, "-m", "pip", "--disable-pip-version-check"]


def pip_pack(machine_python: str, python: str, wheel: Path | None, remove: str = "") -> None:
    pip = pip_for(machine_python, python)
    if remove:
        run([*pip, "uninstall", "--quiet", "--yes", remove], timeout=120)
    else:
        run([*pip, "install", "--quiet", "--no-index", "--no-deps", wheel], timeout=120)


# -- the CPU half: what travels --------------------------------------------------------------

def isolation(setuptools_version: str | None) -> list[str]:
    """pip's flag for building kdb's wheel: with this venv's setuptools where it reads
    pyproject's license string (PEP 639: setuptools 77), else none, so that pip builds in
    an isolated environment with the setuptools pyproject asks for.

    >>> isolation("80.9.0"), isolation("68.0.0"), isolation(None)
    (['--no-build-isolation'], [], [])
    """
    try:
        major = int((setuptools_version or "").split(".")[0])
    except ValueError:
        return []
    return ["--no-build-isolation"] if major >= 77 else []


def _setuptools_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("setuptools")
    except PackageNotFoundError:
        return None


def build_kdb_wheel(dest: Path) -> Path:
    for old in dest.glob("kdb-*.whl"):
        old.unlink()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation(_setuptools_version()),
         "--quiet", "-w", dest, REPO], timeout=600)
    return sorted(dest.glob("kdb-*.whl"))[-1]


def kdb_requirements(wheel: Path) -> list[str]:
    """kdb's own Requires-Dist (no extras), read from its wheel."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8").splitlines()
    return [ln.split(":", 1)[1].strip() for ln in lines
            if ln.startswith("Requires-Dist:") and "extra ==" not in ln]


def download_wheels(dest: Path, pythons: tuple[str, ...], requirements: list[str]) -> None:
    """Binary wheels of ``requirements`` and their dependencies for each CPython in
    ``pythons`` (manylinux x86_64), less what the machine has; SQLAlchemy as its pure-Python
    wheel (2 MB instead of 4.7 MB a version); one abi3 wheel per project."""
    for v in pythons:
        plats = [a for p in PLATFORMS for a in ("--platform", p)]
        run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--only-binary", ":all:", "--python-version", v, "--implementation", "cp", *plats,
             "-d", dest, *requirements, "pyopencl"], timeout=600)
        for old in dest.glob(f"sqlalchemy-*-cp{v.replace('.', '')}-*.whl"):
            old.unlink()
        run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--no-deps", "--only-binary", ":all:", "--python-version", v, "--implementation",
             "cp", "--platform", "any", "-d", dest,
             next(r for r in requirements if r.lower().startswith("sqlalchemy"))], timeout=600)
    for name in ON_THE_MACHINE:
        for w in dest.glob(f"{name}-*.whl"):
            w.unlink()
    _prune_abi3(dest)


def _prune_abi3(dest: Path) -> None:
    """Of several ``cpXY-abi3`` wheels of one project and version, the oldest ABI serves
    every newer Python: keep that one."""
    groups: dict[tuple[str, str], list[Path]] = {}
    for w in dest.glob("*-abi3-*.whl"):
        name, version, tag = w.name.split("-")[:3]
        groups.setdefault((name.lower(), version), []).append(w)
    for wheels in groups.values():
        wheels.sort(key=lambda w: int(w.name.split("-")[2][2:]))
        for extra in wheels[1:]:
            extra.unlink()


def triton_python(version: str, kdb_wheel: Path, work: Path) -> str:
    """A python whose Triton is ``version`` on the device's Python version (a pack serves
    only the Triton that built it, and Triton's key digests its compiled extension, which
    is per Python version): this one if it is both, else a venv under ``work`` (about 1 GB,
    made once)."""
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    try:
        import triton

        if triton.__version__ == version and mine == DEVICE_PYTHON:
            return sys.executable
    except ImportError:
        pass
    base = sys.executable if mine == DEVICE_PYTHON else _python(DEVICE_PYTHON)
    if base is None:
        raise RuntimeError(f"no python{DEVICE_PYTHON} here: the packs must be built on the "
                           f"GPU machine's Python ({DEVICE_PYTHON}); install it (pyenv)")
    venv = work / f"triton-{version}-py{DEVICE_PYTHON}"
    stamp = venv / ".ready"
    if not stamp.exists():
        log(f"making a venv with Triton {version} for the packs (once): {venv}")
        shutil.rmtree(venv, ignore_errors=True)
        run([base, "-m", "venv", venv], timeout=300)
        run([venv / "bin" / "python", "-m", "pip", "install", "--quiet",
             "--disable-pip-version-check", f"{kdb_wheel}[cuda]", f"triton=={version}"],
            timeout=1800)
        stamp.touch()
    else:  # the kdb of this checkout, not the one the venv was made with
        run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-deps",
             "--force-reinstall", "--disable-pip-version-check", kdb_wheel], timeout=600)
    return str(venv / "bin" / "python")


#: What Triton's cache key is made of, per python: a pack built here hits there only where
#: each is the same (printed as short digests; ``backend`` holds ptxas's version).
TRITON_IDENTITY = """
import hashlib, json, os, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
try:
    from triton.runtime.cache import triton_key
except ImportError:
    from triton.compiler.compiler import triton_key
short = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]
arch = int(sys.argv[1])
backend = make_backend(GPUTarget("cuda", arch, 32))
print(json.dumps({"triton": triton.__version__, "python": sys.implementation.cache_tag,
                  "triton_key": short(triton_key()), "backend": short(backend.hash()),
                  "options": short(backend.parse_options({}).hash()),
                  "ptxas": [l for l in backend.hash().splitlines() if "release" in l][:1],
                  "variables": sorted(k for k in os.environ if k.startswith("TRITON_"))}))
"""


def triton_identity(python: str, arch: str) -> dict:
    """The parts of Triton's cache key in ``python`` for ``arch`` (``sm_90``), to say why a
    pack built elsewhere misses."""
    try:
        got = run([python, "-c", TRITON_IDENTITY, arch.removeprefix("sm_")], timeout=300)
        return json.loads(got.stdout.splitlines()[-1])
    except (RuntimeError, ValueError, IndexError) as err:
        return {"error": str(err)[-400:]}


def build_packs(python: str, arches: tuple[str, ...], out: Path, scratch: Path) -> dict:
    """``kdb pack`` of manifest.toml for ``arches``, in ``python`` (its Triton), no GPU."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**base_env(), "KDB_CACHE_DIR": str(scratch / "pack-cache"),
           "TRITON_CACHE_DIR": str(scratch / "pack-triton"), "SOURCE_DATE_EPOCH": "1700000000"}
    kdb = Path(python).with_name("kdb")
    cmd = [kdb, "pack", *(a for arch in arches for a in ("--arch", arch)), "--manifest",
           HERE / "manifest.toml", "--version", "1.0.0", "--out", out, "--json"]
    start = time.perf_counter()
    proc = run(cmd, env=env, timeout=1200)
    info = run([python, "-c", "import triton, json; print(json.dumps(triton.__version__))"],
               timeout=120).stdout
    return {"arches": list(arches), "triton": json.loads(info),
            "seconds": round(time.perf_counter() - start, 1),
            "summary": _json_or_text(proc.stdout)}


def amd_packs(tpy: str, arches: tuple[str, ...], out: Path, check: Check) -> dict:
    """The AMD packs, with the device's Triton where it can key an AMD launch here (3.6
    asks torch about each tensor, and torch is not installed for the packs), else with
    this python's Triton, saying why."""
    log(f"kdb pack for {', '.join(arches)} (no GPU)")
    try:
        return build_packs(tpy, arches, out, Path(check.fresh("pack-amd")))
    except RuntimeError as err:
        if tpy == sys.executable:
            raise
        got = build_packs(sys.executable, arches, out, Path(check.fresh("pack-amd")))
        got["note"] = f"not with the device's Triton: {str(err)[-400:]}"
        return got


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text.strip()[-2000:]


def build_pycuda(dest: Path, work: Path) -> dict:
    """A pycuda wheel for the GPU machine's Python, built here from pycuda's source (it
    ships none, and building it there would take most of the check's budget): against
    this machine's CUDA headers, linked to a stand-in ``libcuda.so.1`` whose symbols the
    driver there provides. Skipped, saying why, where there is no such Python or toolkit."""
    python = _python(DEVICE_PYTHON)
    cuda = Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda")
    if python is None:
        return {"built": False, "reason": f"no python{DEVICE_PYTHON} here to build it with"}
    if not (cuda / "include" / "cuda.h").is_file():
        return {"built": False, "reason": f"no CUDA toolkit headers at {cuda} (set CUDA_HOME)"}
    out = work / "pycuda"
    tag = f"cp{DEVICE_PYTHON.replace('.', '')}"
    have = sorted((out / "dist").glob(f"pycuda-*-{tag}-*.whl"))
    if not have:
        log(f"building a pycuda wheel for CPython {DEVICE_PYTHON} (once; minutes)")
        _build_pycuda(python, cuda, out)
        have = sorted((out / "dist").glob(f"pycuda-*-{tag}-*.whl"))
    for old in dest.glob("pycuda-*.whl"):
        old.unlink()
    shutil.copy2(have[-1], dest / have[-1].name)
    return {"built": True, "wheel": have[-1].name, "bytes": have[-1].stat().st_size,
            "python": DEVICE_PYTHON}


def _python(version: str) -> str | None:
    """A working ``python<version>``: on PATH, else one pyenv installed (its shim on PATH
    fails unless that version is selected)."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv") / "versions"
    found = [shutil.which(f"python{version}"),
             *(str(d / "bin" / f"python{version}")
               for d in sorted(pyenv.glob(f"{version}.*"), reverse=True))]
    for candidate in filter(None, found):
        if subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    return None


def _build_pycuda(python: str, cuda: Path, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    (out / "stub").mkdir(parents=True)
    (out / "stub" / "stub.c").write_text("void cuInit(void) {}\n", encoding="utf-8")
    run(["gcc", "-shared", "-fPIC", "-o", out / "stub" / "libcuda.so",
         "-Wl,-soname,libcuda.so.1", out / "stub" / "stub.c"], timeout=120)
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
         ":all:", "--no-build-isolation", "-d", out, "pycuda"], timeout=600)
    sdist = sorted(out.glob("pycuda-*.tar.gz"))[-1]
    run(["tar", "xzf", sdist, "-C", out], timeout=120)
    src = out / sdist.name[:-len(".tar.gz")]
    run([python, "-m", "venv", out / "venv"], timeout=300)
    vpy = out / "venv" / "bin" / "python"
    run([vpy, "-m", "pip", "install", "--quiet", "numpy", "setuptools", "wheel"], timeout=900)
    run([vpy, "configure.py", f"--cuda-root={cuda}", f"--cudadrv-lib-dir={out / 'stub'}"],
        cwd=src, timeout=120)
    conf = (src / "siteconf.py").read_text(encoding="utf-8")
    (src / "siteconf.py").write_text(conf.replace("CUDA_ENABLE_CURAND = True",
                                                  "CUDA_ENABLE_CURAND = False"), encoding="utf-8")
    run([vpy, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
         out / "dist", "."], cwd=src, timeout=1800)


def tree_bytes() -> int:
    """What the device machine copies of the working tree: tracked files, and untracked
    files git does not ignore."""
    out = run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others",
               "--exclude-standard"], timeout=120).stdout
    return sum(os.path.getsize(REPO / p) for p in out.split("\0") if p and
               os.path.isfile(REPO / p))


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def prepare(args, check: Check) -> dict:
    """Everything that needs no device, into ``args.carry``."""
    carry, work = args.carry, args.work
    wheels, packs = carry / "wheels", carry / "packs"
    for d in (wheels, packs, work):
        d.mkdir(parents=True, exist_ok=True)
    got: dict = {}
    log("building kdb's wheel")
    kdb_wheel = build_kdb_wheel(wheels)
    reqs = kdb_requirements(kdb_wheel)
    pythons = (f"{sys.version_info[0]}.{sys.version_info[1]}",) if args.quick else PYTHONS
    log(f"downloading the wheels of {', '.join(reqs)} and pyopencl for CPython "
        f"{', '.join(pythons)}")
    for old in wheels.glob("*.whl"):
        if old != kdb_wheel:
            old.unlink()
    download_wheels(wheels, pythons, reqs)
    try:
        got["pycuda"] = ({"built": False, "reason": "--quick"} if args.quick
                         else build_pycuda(wheels, work))
    except RuntimeError as err:
        got["pycuda"] = {"built": False, "reason": f"the build failed: {str(err)[-600:]}"}
    got["wheels"] = {"pythons": list(pythons), "requirements": reqs,
                     "files": sorted(p.name for p in wheels.glob("*.whl")),
                     "bytes": dir_bytes(wheels), "left_out": list(ON_THE_MACHINE)}
    version = None if args.quick else DEVICE_TRITON
    tpy = sys.executable if version is None else triton_python(version, kdb_wheel, work)
    arches = ("sm_90",) if args.quick else PACK_ARCHES
    nvidia = tuple(a for a in arches if a.startswith("sm_"))
    log(f"kdb pack for {', '.join(nvidia)} with Triton {version or 'as installed'} (no GPU)")
    built = work / "packs"
    got["packs"] = build_packs(tpy, nvidia, built / "nvidia", Path(check.fresh("pack")))
    got["packs"].update(python=tpy, dir=str(built / "nvidia"), device_triton=DEVICE_TRITON,
                        identity=triton_identity(tpy, "sm_90"))
    for old in packs.glob("*"):
        old.unlink()
    for whl in (built / "nvidia").glob("kdb_system_sm_*.whl"):  # these travel
        shutil.copy2(whl, packs / whl.name)
    got["packs"]["carried"] = sorted(p.name for p in packs.iterdir())
    amd = tuple(a for a in arches if a not in nvidia)
    if amd:  # built to show they build without a GPU; they stay here
        got["packs_amd"] = amd_packs(tpy, amd, built / "amd", check)
    (carry / "command.txt").write_text(COMMAND + "\n", encoding="utf-8")
    tree, carried = tree_bytes(), dir_bytes(carry)
    got["travels"] = {"tree_bytes": tree, "carry_bytes": carried, "total_bytes": tree + carried,
                      "limit_bytes": CARRY_LIMIT, "fits": tree + carried < CARRY_LIMIT,
                      "command": COMMAND, "command_chars": len(COMMAND),
                      "command_fits": len(COMMAND) < COMMAND_LIMIT, "carry": [CARRY_PATH]}
    return got


# -- the dry run: the GPU half's steps that need no GPU ---------------------------------------

def dry_run(args, check: Check) -> dict:
    """The install from the carried wheels alone, then what the GPU half does that needs no
    device: Triton kernels compiled for sm_90 by a first and a second process; kdb.cuda
    compiled with nvcc and NVRTC; the pack's cubin served by a process with no compiler."""
    got: dict = {}
    inst = install_kdb(sys.executable, args.carry / "wheels", Path(check.fresh("dry-venv")))
    got["install"] = inst
    python = inst["python"]
    env = base_env()
    kdb_env = {**env, "KDB_AUTO": "1", "KDB_STORE_AT_EXIT": "wait",
               "KDB_CACHE_DIR": check.fresh("dry-kdb")}
    runs = []
    for _ in range(2):
        runs.append(run_child(check, python, ["triton-target", "sm_90"],
                              {**kdb_env, "TRITON_CACHE_DIR": check.fresh("dry-tc")}))
    got["triton_sm_90"] = {"compiles": [r.get("compiles") for r in runs],
                           "binaries_equal": runs[0]["binaries"] == runs[1]["binaries"],
                           "walls": [r["wall"] for r in runs], "triton": runs[0]["triton"]}
    got["cuda"] = {}
    for compiler in ("nvcc", "nvrtc"):
        cenv = {**env, "KDB_STORE_AT_EXIT": "wait", "KDB_CACHE_DIR": check.fresh("dry-cuda")}
        try:
            pair = [run_child(check, python, ["cuda-serve", "sm_90", str(Path(check.fresh(
                "cubin")) / "k.cubin"), compiler], cenv) for _ in range(2)]
            got["cuda"][compiler] = {"kdb": [p.get("kdb") for p in pair],
                                     "same_cubin": pair[0]["cubin"] == pair[1]["cubin"]}
        except RuntimeError as err:
            got["cuda"][compiler] = {"error": str(err)[-600:]}
    got["pack_served_without_compiler"] = serve_from_pack(check, sys.executable, python,
                                                          args.carry / "packs", "sm_90")
    got["pack_keys_are_launch_keys"] = launch_keys(check)
    got["hip"] = hip_dry(check, python)
    if not args.quick:
        got[f"install_for_python_{DEVICE_PYTHON}"] = install_for_device_python(args, check)
    return got


def install_for_device_python(args, check: Check) -> dict:
    """The install as the GPU machine's Python (3.12) does it, numpy its only package
    beforehand as there: kdb, pyopencl and pycuda from the carried wheels alone. pycuda's
    driver module cannot load here (no libcuda.so.1 without a GPU driver): that is said."""
    python = _python(DEVICE_PYTHON)
    if python is None:
        return {"skipped": f"no python{DEVICE_PYTHON} here"}
    root = Path(check.fresh("py312"))
    run([python, "-m", "venv", root / "machine"], timeout=300)
    machine = str(root / "machine" / "bin" / "python")
    run([machine, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "numpy"],
        timeout=900)
    got = install_kdb(machine, args.carry / "wheels", root)
    load = subprocess.run([got["python"], "-c", "import pycuda.driver"], capture_output=True,
                          text=True, cwd=root)
    got["import_pycuda_driver"] = "ok" if load.returncode == 0 else \
        (load.stderr.strip().splitlines() or ["?"])[-1][:300]
    return got


def launch_keys(check: Check) -> dict:
    """The packed Triton kernels keyed as their launches in child.py key them, with the
    pack's own Triton (the GPU machine's): each must be a system hit, or the pack would be
    compiled again on the GPU."""
    packs = check.data["parts"]["prepare"]["figures"]["packs"]
    env = {**base_env(), "KDB_SYSTEM_DB_PATH": packs["dir"],
           "KDB_CACHE_DIR": check.fresh("keys-kdb"), "TRITON_CACHE_DIR": check.fresh("keys-tc")}
    got = run_child(check, packs["python"], ["jit-keys", "sm_90"], env)
    return {"triton": got.get("triton"), "kernels": got.get("kernels"),
            "compiles": got.get("compiles"), "kdb": got.get("kdb")}


def bare_env(env: dict[str, str]) -> dict[str, str]:
    """A process with kdb and no CUDA compiler: no compiler package, no nvcc on PATH."""
    path = [d for d in env.get("PATH", "").split(os.pathsep)
            if d and not os.path.exists(os.path.join(d, "nvcc"))]
    out = {k: v for k, v in env.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    return {**out, "PATH": os.pathsep.join(path), "KDB_CHECK_BARE": "1"}


def serve_from_pack(check: Check, machine_python: str, python: str, packs: Path, arch: str,
                    launch: bool = False) -> dict:
    """The pack for ``arch`` installed; a process with no compiler is served its cubin (the
    newest compiler's build); launched when ``launch``."""
    wheel = next(iter(packs.glob(f"kdb_system_{arch}-*.whl")), None)
    if wheel is None:
        raise Skip(f"no pack for {arch} was carried (carried: "
                   f"{sorted(p.name for p in packs.glob('*.whl'))})")
    pip_pack(machine_python, python, wheel)
    try:
        cubin = str(Path(check.fresh("served")) / "served.cubin")
        env = bare_env({**base_env(), "KDB_CACHE_DIR": check.fresh("serve-kdb")})
        served = run_child(check, python, ["cuda-serve", arch, cubin], env)
        got = {"compiler_here": served.get("compiler_here"), "kdb": served.get("kdb"),
               "cubin": served.get("cubin")}
        if launch:
            launched = run_child(check, python, ["cuda-launch", cubin], base_env())
            got.update(launch_ok=launched["ok"], loader=launched.get("loader"))
        return got
    finally:
        pip_pack(machine_python, python, None, remove=f"kdb-system-{arch.replace('_', '-')}")


# -- the GPU half ----------------------------------------------------------------------------

PROBE = """
import json, platform
got = {"python": platform.python_version()}
for name in ("torch", "triton", "cupy", "numpy", "pyopencl"):
    try:
        got[name] = __import__(name).__version__
    except Exception as err:
        got[name] = None
try:
    import cuda.core
    got["cuda_core"] = getattr(cuda.core, "__version__", "present")
except Exception:
    got["cuda_core"] = None
try:
    import torch
    got["gpu"] = torch.cuda.is_available() and torch.cuda.get_device_name(0)
    got["capability"] = torch.cuda.is_available() and list(torch.cuda.get_device_capability(0))
    got["torch_cuda"] = torch.version.cuda
except Exception as err:
    got["gpu"], got["gpu_error"] = False, repr(err)
print(json.dumps(got))
"""


def probe(python: str) -> dict:
    got = json.loads(run([python, "-c", PROBE], env=base_env(), timeout=180).stdout)
    try:
        smi = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                   "--format=csv,noheader"], timeout=60).stdout.strip()
        got["nvidia_smi"] = smi
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as err:
        got["nvidia_smi"] = f"unavailable: {err}"
    nvcc = shutil.which("nvcc")
    if nvcc:
        got["nvcc"] = run([nvcc, "--version"], timeout=60).stdout.strip().splitlines()[-1]
    return got


class Gpu:
    """What the parts share: the venv, the device's arch, fresh environments."""

    def __init__(self, check: Check, machine_python: str, python: str, arch: str,
                 carry: Path) -> None:
        self.check, self.machine_python, self.python, self.arch, self.carry = \
            check, machine_python, python, arch, carry

    def plain(self, **more: str) -> dict[str, str]:
        return {**base_env(), "TRITON_CACHE_DIR": self.check.fresh("tc"), **more}

    def kdb(self, cache: str, **more: str) -> dict[str, str]:
        return self.plain(KDB_AUTO="1", KDB_CACHE_DIR=cache, KDB_STORE_AT_EXIT="wait", **more)

    def child(self, args: list[str], env: dict[str, str], timeout: float = 300) -> dict:
        return run_child(self.check, self.python, args, env, timeout)


def compiles(r: dict) -> int | None:
    return r.get("compiles")


def host_builds(r: dict) -> int | None:
    """How many host modules (cuda_utils, launchers) Triton built with the C compiler."""
    got = r.get("host_builds")
    return None if got is None else len(got)


def part_triton(g: Gpu, rec: dict) -> dict:
    """A first process compiles; a second, Triton's cache empty, compiles nothing and gets the
    same bits; the same code without kdb gives the same bits."""
    cache = g.check.fresh("kdb-triton")
    plain = g.child(["triton"], g.plain())
    first = g.child(["triton"], g.kdb(cache))
    second = g.child(["triton"], g.kdb(cache))
    f = rec["figures"]
    f.update(compiles={"no kdb": compiles(plain), "kdb first": compiles(first),
                       "kdb second": compiles(second)},
             stages_run={"no kdb": plain.get("stages_run"), "kdb first": first.get("stages_run"),
                         "kdb second": second.get("stages_run")},
             kdb_counts={"first": first.get("kdb"), "second": second.get("kdb")},
             host_builds={"no kdb": plain.get("host_builds"),
                          "kdb first": first.get("host_builds"),
                          "kdb second": second.get("host_builds")},
             wall_s={"no kdb": plain["wall"], "kdb first": first["wall"],
                     "kdb second": second["wall"]},
             digests=plain.get("digests"), ok=plain.get("ok"), target=plain.get("target"),
             triton=plain.get("triton"), matmul_config=plain.get("matmul_config"))
    c = g.check
    c.fail_unless(rec, all(plain.get("ok", {}).values()) and all(first["ok"].values())
                  and all(second["ok"].values()), "every result right against torch")
    c.fail_unless(rec, (compiles(first) or 0) > 0, "the first kdb process compiles")
    c.fail_unless(rec, compiles(second) == 0 and second.get("stages_run") == 0,
                  "the second process compiles 0 (Triton's listener and stages)")
    c.fail_unless(rec, host_builds(second) == 0,
                  "the second process, Triton's cache empty, builds no host module")
    c.fail_unless(rec, first.get("digests") == plain.get("digests") == second.get("digests"),
                  "results bitwise equal with and without kdb")
    return plain.get("digests", {})


def part_cuda(g: Gpu, rec: dict) -> None:
    """kdb.cuda.compile with nvcc and with NVRTC for the device's arch, loaded and launched;
    a second process compiles nothing and gets the same cubin."""
    for compiler in ("nvcc", "nvrtc"):
        cache = g.check.fresh(f"kdb-cuda-{compiler}")
        env = {**base_env(), "KDB_CACHE_DIR": cache, "KDB_STORE_AT_EXIT": "wait"}
        try:
            pair = [g.child(["cuda", compiler, g.arch], env) for _ in range(2)]
        except RuntimeError as err:
            rec["figures"][compiler] = {"error": str(err)[-800:]}
            g.check.fail_unless(rec, False, f"{compiler}: ran")
            continue
        counts = [p.get("kdb") or {} for p in pair]
        rec["figures"][compiler] = {
            "kdb": counts, "ok": [p["ok"] for p in pair], "loader": pair[0].get("loader"),
            "same_cubin": pair[0]["cubin"] == pair[1]["cubin"],
            "compile_s": [p["phases"].get("compile") for p in pair]}
        g.check.fail_unless(rec, all(all(p["ok"].values()) for p in pair),
                            f"{compiler}: saxpy right")
        g.check.fail_unless(rec, counts[0].get("compiles") == 1 and
                            not counts[1].get("compiles"), f"{compiler}: compiles 1 then 0")


AMD_PROBE = ("import json; from kdb.backends.hip import loading; "
             "print(json.dumps(loading.probe()))")


def amd_gpu(check: Check, python: str) -> str:
    """Why there is no AMD GPU to run the hip part on ('' where there is one): no /dev/kfd,
    no HIP runtime, or a runtime that reports no device (asked in a child: it may abort)."""
    if not os.path.exists("/dev/kfd"):
        return f"{NO_AMD_GPU} (no /dev/kfd)"
    proc = subprocess.run([python, "-c", AMD_PROBE], env=base_env(), capture_output=True,
                          text=True, timeout=max(5.0, min(120.0, check.left() - 3)))
    if proc.returncode != 0:
        return f"{NO_AMD_GPU} (the HIP runtime: {proc.stderr.strip()[-300:]})"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if got["count"] < 1 or got["status"] != 0:
        return f"{NO_AMD_GPU} (hipGetDeviceCount: {got['error']}, {got['count']} devices)"
    return ""


def part_hip(check: Check, python: str, rec: dict) -> None:
    """On an AMD GPU: kdb.hip.compile for the device's target ID, loaded and launched through
    ctypes on libamdhip64 (kdb.backends.hip.loading), saxpy checked; a second process is
    served from kdb and compiles nothing. Anywhere else: skipped, saying why."""
    why = amd_gpu(check, python)
    if why:
        raise Skip(why)
    env = {**base_env(), "KDB_CACHE_DIR": check.fresh("kdb-hip"), "KDB_STORE_AT_EXIT": "wait"}
    pair = [run_child(check, python, ["hip", "device", "launch"], env) for _ in range(2)]
    counts = [p.get("kdb") or {} for p in pair]
    rec["figures"].update(target=pair[0].get("target"), kdb=counts,
                          ok=[p.get("ok") for p in pair],
                          compile_s=[p["phases"].get("compile") for p in pair],
                          same_code_object=pair[0]["code_object"] == pair[1]["code_object"])
    check.fail_unless(rec, all(all(p["ok"].values()) for p in pair),
                      "saxpy right, the code object for the device's target")
    check.fail_unless(rec, counts[0].get("compiles") == 1 and not counts[1].get("compiles"),
                      "compiles 1 then 0")
    check.fail_unless(rec, pair[0].get("digests") == pair[1].get("digests"),
                      "the same bits from both processes")


def hip_dry(check: Check, python: str) -> dict:
    """What the hip part does that needs no GPU: kdb.hip.compile for gfx90a in a first and a
    second process (compiles 1, then 0, the same code object); no HIP compiler is said."""
    env = {**base_env(), "KDB_CACHE_DIR": check.fresh("dry-hip"), "KDB_STORE_AT_EXIT": "wait"}
    try:
        pair = [run_child(check, python, ["hip", "gfx90a"], env) for _ in range(2)]
    except RuntimeError as err:
        return {"error": str(err)[-600:]}
    return {"kdb": [p.get("kdb") for p in pair], "ok": [p.get("ok") for p in pair],
            "same_code_object": pair[0]["code_object"] == pair[1]["code_object"]}


def part_pycuda(g: Gpu, rec: dict, pycuda: str | None) -> None:
    """kdb.cuda.SourceModule, the drop-in for pycuda's, against pycuda's own: the same saxpy
    loaded and launched; kdb compiles once, then a second process compiles nothing."""
    if pycuda != "installed":
        raise Skip(f"pycuda is not installed in the venv ({pycuda or 'no wheel was carried'});"
                   " the cuda part loads its cubins through CuPy instead")
    c = g.check
    plain = g.child(["pycuda", "plain"], {**base_env(), "XDG_CACHE_HOME": c.fresh("xdg")})
    cache = c.fresh("kdb-pycuda")
    env = {**base_env(), "KDB_CACHE_DIR": cache, "KDB_STORE_AT_EXIT": "wait",
           "XDG_CACHE_HOME": c.fresh("xdg")}
    pair = [g.child(["pycuda", "kdb"], env) for _ in range(2)]
    counts = [p.get("kdb") or {} for p in pair]
    rec["figures"].update(loader=pair[0].get("loader"), kdb=counts,
                          compile_s={"pycuda": plain["phases"].get("compile"),
                                     "kdb first": pair[0]["phases"].get("compile"),
                                     "kdb second": pair[1]["phases"].get("compile")})
    c.fail_unless(rec, all(all(p["ok"].values()) for p in (plain, *pair)), "saxpy right")
    c.fail_unless(rec, counts[0].get("compiles") == 1 and not counts[1].get("compiles"),
                  "kdb's SourceModule compiles 1 then 0")
    c.fail_unless(rec, plain.get("digests") == pair[0].get("digests") == pair[1].get("digests"),
                  "the same bits as pycuda's own SourceModule")


def part_pack(g: Gpu, rec: dict, plain_digests: dict) -> None:
    """The pack built without a GPU, installed: a first start compiles 0 and gets the bits
    of the same kernels without kdb; its cubin, served to a process with no compiler and to
    one with the compilers, launched."""
    packs = g.carry / "packs"
    wheel = next(iter(packs.glob(f"kdb_system_{g.arch}-*.whl")), None)
    if wheel is None:
        raise Skip(f"no pack for {g.arch} was carried: {sorted(p.name for p in packs.glob('*'))}")
    f = rec["figures"]
    f["wheel"] = wheel.name
    pip_pack(g.machine_python, g.python, wheel)
    try:
        first = g.child(["triton", *PACKED_KERNELS], g.kdb(g.check.fresh("kdb-pack")))
        f["triton"] = {"compiles": compiles(first), "stages_run": first.get("stages_run"),
                       "kdb": first.get("kdb"), "ok": first.get("ok"), "wall": first["wall"]}
        want = {k: plain_digests.get(k) for k in PACKED_KERNELS}
        f["triton"]["bitwise_equal_to_no_kdb"] = first.get("digests") == want \
            if all(want.values()) else "no run without kdb to compare with"
        packed = (g.check.data.get("prepared") or {}).get("pack_identity") or {}
        here = triton_identity(g.python, g.arch)
        f["triton_identity"] = {"pack": packed, "here": here,
                                "differs": sorted(k for k in here if k != "variables"
                                                  and packed.get(k) != here.get(k))}
        g.check.fail_unless(rec, compiles(first) == 0, "first start with the pack compiles 0")
        g.check.fail_unless(rec, f["triton"]["bitwise_equal_to_no_kdb"] is not False,
                            "the pack's kernels give the bits of the same kernels without kdb")
        g.check.fail_unless(rec, all(first["ok"].values()), "the pack's kernels are right")
        for compiler in ("nvcc", "nvrtc"):  # a hit only for the very build that packed
            try:
                here = g.child(["cuda-serve", g.arch, str(Path(g.check.fresh("c")) / "k.cubin"),
                                compiler], {**base_env(), "KDB_CACHE_DIR": g.check.fresh("k")})
                f[f"cuda_with_{compiler}_here"] = {"kdb": here.get("kdb"),
                                                   "version_here": here.get("compiler_version")}
            except RuntimeError as err:
                f[f"cuda_with_{compiler}_here"] = {"error": str(err)[-500:]}
        f["cuda_note"] = ("with a compiler, the pack's cubin is a system hit only when this "
                          "machine's compiler is the very build that packed it (the compiler "
                          "is in the key); otherwise kdb compiles")
    finally:
        pip_pack(g.machine_python, g.python, None,
                 remove=f"kdb-system-{g.arch.replace('_', '-')}")
    served = serve_from_pack(g.check, g.machine_python, g.python, packs, g.arch, launch=True)
    f["cuda_without_compiler"] = served
    g.check.fail_unless(rec, (served.get("kdb") or {}).get("hits.system") == 1 and
                        not (served.get("kdb") or {}).get("compiles"),
                        "a process with no compiler is served the pack's cubin")
    g.check.fail_unless(rec, all((served.get("launch_ok") or {"x": False}).values()),
                        "the served cubin launches and computes saxpy")


INDUCTOR = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
            "TORCHINDUCTOR_COMPILE_THREADS": "1"}


def part_inductor(g: Gpu, rec: dict) -> None:
    """A small model's first training step under torch.compile, Inductor's caches empty in
    every run: Triton's cache empty, Triton's cache warm, kdb filling, kdb warm; then the
    reference, Inductor's own caches (FX graph, AOTAutograd) and Triton's all warm, against
    kdb.torch (``KDB_AUTO``) warm on a new node, every torch and Triton cache empty."""
    c = g.check

    def env(**more: str) -> dict[str, str]:
        return {**base_env(), **INDUCTOR, "TORCHINDUCTOR_CACHE_DIR": c.fresh("inductor"),
                **more}

    warm_tc, cache = c.fresh("tc-inductor"), c.fresh("kdb-inductor")
    runs = {"cold": g.child(["inductor"], env(TRITON_CACHE_DIR=warm_tc), 240)}
    runs["kdb first"] = g.child(["inductor"], env(
        TRITON_CACHE_DIR=c.fresh("tc"), KDB_AUTO="1", KDB_CACHE_DIR=cache,
        KDB_STORE_AT_EXIT="wait"), 240)
    firsts: dict[str, list[float]] = {"triton warm": [], "kdb warm": []}
    for r in range(2 if c.left() > 300 else 1):  # the timing part after this needs ~180 s
        for arm in (("triton warm", "kdb warm") if r % 2 == 0 else ("kdb warm", "triton warm")):
            e = env(TRITON_CACHE_DIR=warm_tc) if arm == "triton warm" else env(
                TRITON_CACHE_DIR=c.fresh("tc"), KDB_AUTO="1", KDB_CACHE_DIR=cache)
            runs[arm] = got = g.child(["inductor"], e, 240)
            firsts[arm].append(got["first_step_s"])
    if c.left() > 240:  # the reference a torch.compile user who keeps its caches has
        full = {**base_env(), "TORCHINDUCTOR_COMPILE_THREADS": "1",
                "TORCHINDUCTOR_CACHE_DIR": c.fresh("inductor-full"),
                "TRITON_CACHE_DIR": c.fresh("tc-full")}
        g.child(["inductor"], full, 240)  # fills Inductor's FX graph and AOTAutograd caches
        runs["inductor fully warm"] = g.child(["inductor"], full, 240)
        kdb_full = c.fresh("kdb-torch")

        def every_cache_empty() -> dict[str, str]:  # a new node: kdb.torch (KDB_AUTO) alone
            return {**base_env(), "TORCHINDUCTOR_COMPILE_THREADS": "1", "KDB_AUTO": "1",
                    "TORCHINDUCTOR_CACHE_DIR": c.fresh("inductor"), "TMPDIR": c.fresh("tmp"),
                    "TRITON_CACHE_DIR": c.fresh("tc"), "KDB_CACHE_DIR": kdb_full,
                    "KDB_STORE_AT_EXIT": "wait"}
        g.child(["inductor"], every_cache_empty(), 240)  # kdb takes graphs, kernels, tunings
        runs["kdb.torch warm"] = g.child(["inductor"], every_cache_empty(), 240)
    f = rec["figures"]
    f["compiles"] = {k: compiles(v) for k, v in runs.items()}
    f["first_step_s"] = {"cold": runs["cold"]["first_step_s"],
                         "kdb first": runs["kdb first"]["first_step_s"],
                         **{k: statistics.median(v) for k, v in firsts.items()}}
    if "inductor fully warm" in runs:
        ref = runs["inductor fully warm"]["first_step_s"]
        f["first_step_s"]["inductor fully warm"] = ref
        f["kdb_warm_vs_inductor_fully_warm"] = round(
            statistics.median(firsts["kdb warm"]) / ref, 3)
        f["first_step_s"]["kdb.torch warm"] = runs["kdb.torch warm"]["first_step_s"]
        f["kdb_torch_warm_vs_inductor_fully_warm"] = round(
            runs["kdb.torch warm"]["first_step_s"] / ref, 3)  # issue 36's goal: <= 1.05
    f["first_step_samples"] = firsts
    f["kdb_warm_vs_triton_warm"] = round(statistics.median(firsts["kdb warm"])
                                         / statistics.median(firsts["triton warm"]), 3)
    f["kdb_counts"] = {k: v.get("kdb") for k, v in runs.items() if v.get("kdb")}
    f["torch"], f["digests"] = runs["cold"].get("torch"), runs["cold"].get("digests")
    c.fail_unless(rec, (compiles(runs["cold"]) or 0) > 0, "Inductor compiles Triton kernels")
    c.fail_unless(rec, compiles(runs["kdb warm"]) == 0, "kdb warm: 0 Triton compiles")
    f["bitwise_equal"] = len({json.dumps(v.get("digests"), sort_keys=True)
                              for v in runs.values()}) == 1
    ref = runs["cold"].get("values") or []
    f["max_relative_difference"] = max(
        (abs(a - b) / max(abs(b), 1e-30) for v in runs.values()
         for a, b in zip(v.get("values") or [], ref)), default=None)
    c.fail_unless(rec, f["bitwise_equal"] or (f["max_relative_difference"] or 1) < 1e-4,
                  "every arm's step equal (bitwise, or within 1e-4 where Inductor tuned a "
                  "reduction differently)")


def opencl_vendors(check: Check) -> tuple[dict[str, str], str]:
    """The environment that points the OpenCL loader at NVIDIA's driver, and what was found;
    raises Skip when the machine has no NVIDIA OpenCL library."""
    for icd in Path("/etc/OpenCL/vendors").glob("*.icd"):
        if "nvidia" in icd.read_text(errors="replace").lower() or "nvidia" in icd.name.lower():
            return {}, f"{icd} ({icd.read_text(errors='replace').strip()})"
    found = []
    try:
        ldconfig = run(["ldconfig", "-p"], timeout=30).stdout
        found = re.findall(r"=> (\S*libnvidia-opencl\.so\S*)", ldconfig)
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        pass
    for d in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu",
              "/usr/lib64", "/usr/lib"):
        found += [str(p) for p in Path(d).glob("libnvidia-opencl.so*") if p.exists()]
    if not found:
        raise Skip("no NVIDIA OpenCL ICD on this machine: no /etc/OpenCL/vendors/*.icd names "
                   "NVIDIA and no libnvidia-opencl.so is installed (the driver's OpenCL part "
                   "is not in this image)")
    vendors = Path(check.fresh("icd"))
    (vendors / "nvidia.icd").write_text(sorted(found)[0] + "\n", encoding="utf-8")
    return {"OCL_ICD_VENDORS": str(vendors)}, f"{sorted(found)[0]} (an .icd made for it)"


def part_opencl(g: Gpu, rec: dict, pyopencl: str | None) -> None:
    """pyopencl on NVIDIA's driver: 20 programs built and launched without kdb (the driver's
    and pyopencl's caches empty, then warm) and with kdb (a first start, then a second with
    those caches empty again): compiles, bits, build seconds, and what the driver's binary
    is."""
    if pyopencl != "installed":
        raise Skip(f"pyopencl is not installed in the venv: {pyopencl}")
    c = g.check
    icd, where = opencl_vendors(c)
    f = rec["figures"]
    f["icd"] = where
    driver_cache = c.fresh("nv-cache")

    def env(caches: tuple[str, str], **more: str) -> dict[str, str]:
        """The driver's cache (CUDA_CACHE_PATH) and pyopencl's (under XDG_CACHE_HOME)."""
        return {**base_env(), **icd, "CUDA_CACHE_PATH": caches[0],
                "XDG_CACHE_HOME": caches[1], **more}

    kdb_cache = c.fresh("kdb-opencl")
    plain = (driver_cache, c.fresh("xdg"))
    try:
        runs = {"no kdb, caches empty": g.child(["opencl"], env(plain))}
    except RuntimeError as err:
        if "PLATFORM_NOT_FOUND" in str(err) or "no NVIDIA OpenCL platform" in str(err):
            raise Skip(f"the OpenCL loader finds no NVIDIA platform with {where}: "
                       f"{str(err)[-300:]}") from None
        raise
    f["driver_cache_files_after_first_start"] = sum(1 for p in Path(driver_cache).rglob("*")
                                                    if p.is_file())
    runs["no kdb, caches warm"] = g.child(["opencl"], env(plain))
    runs["kdb first"] = g.child(["opencl"], env((c.fresh("nv"), c.fresh("xdg")), KDB_AUTO="1",
                                                KDB_CACHE_DIR=kdb_cache, KDB_STORE_AT_EXIT="wait"))
    runs["kdb second, driver and pyopencl caches empty"] = g.child(["opencl"], env(
        (c.fresh("nv"), c.fresh("xdg")), KDB_AUTO="1", KDB_CACHE_DIR=kdb_cache))
    f["device"] = runs["kdb first"].get("device")
    f["binary"] = runs["kdb first"].get("binary")
    f["build_s"] = {k: v["phases"].get("build") for k, v in runs.items()}
    f["kdb"] = {k: v.get("kdb") for k, v in runs.items() if v.get("kdb")}
    second = runs["kdb second, driver and pyopencl caches empty"].get("kdb") or {}
    c.fail_unless(rec, all(all(v["ok"].values()) for v in runs.values()), "results right")
    c.fail_unless(rec, not second.get("compiles") and second.get("hits.user", 0) > 0,
                  "the second start with kdb compiles 0")
    c.fail_unless(rec, len({json.dumps(v.get("digests")) for v in runs.values()}) == 1,
                  "results bitwise equal with and without kdb")


def part_timing(g: Gpu, rec: dict, pairs: int) -> None:
    """Process wall time (spawn to exit) of the four Triton kernels: cold (no cache), warm
    from Triton's cache, warm from kdb with Triton's cache empty (a new node or container),
    and warm from kdb with Triton's cache warm (its launchers built); arms interleaved. The
    host modules Triton builds with the C compiler are counted per arm: none in a kdb arm."""
    c = g.check
    warm_tc, cache, kdb_tc = c.fresh("tc-timing"), c.fresh("kdb-timing"), c.fresh("tc-kdb")
    g.child(["triton"], {**base_env(), "TRITON_CACHE_DIR": warm_tc})
    g.child(["triton"], g.kdb(cache, TRITON_CACHE_DIR=kdb_tc))
    arms = {
        "cold": lambda: g.plain(),
        "triton warm": lambda: {**base_env(), "TRITON_CACHE_DIR": warm_tc},
        "kdb warm, Triton cache empty": lambda: g.kdb(cache),
        "kdb warm, Triton cache warm": lambda: g.kdb(cache, TRITON_CACHE_DIR=kdb_tc),
    }
    walls: dict[str, list[float]] = {a: [] for a in arms}
    counts: dict[str, list] = {a: [] for a in arms}
    builds: dict[str, list] = {a: [] for a in arms}
    names = list(arms)
    done = 0
    for r in range(pairs):
        if c.left() < 45:
            rec["reason"] = f"budget: {r} of {pairs} rounds run"
            break
        for arm in names[r % len(names):] + names[:r % len(names)]:
            got = g.child(["triton"], arms[arm]())
            walls[arm].append(got["wall"])
            counts[arm].append(compiles(got))
            builds[arm].append(host_builds(got))
        done += 1
    med = {a: round(statistics.median(v), 3) for a, v in walls.items() if v}
    rec["figures"].update(rounds=done, wall_s=med, samples=walls, compiles=counts,
                          host_builds=builds,
                          vs_triton_warm={a: round(v / med["triton warm"], 3)
                                          for a, v in med.items()} if med else {})
    fresh = "kdb warm, Triton cache empty"
    if med.get(fresh) and med.get("triton warm"):
        ratio = round(med[fresh] / med["triton warm"], 3)
        rec["figures"]["fresh_node_goal"] = {"ratio": ratio, "goal": FRESH_NODE_GOAL,
                                             "met": ratio <= FRESH_NODE_GOAL}
    c.fail_unless(rec, done > 0, "at least one round")
    c.fail_unless(rec, all(x == 0 for a in arms if a.startswith("kdb") for x in counts[a]),
                  "kdb arms compile 0")
    c.fail_unless(rec, all(x == 0 for a in arms if a.startswith("kdb") for x in builds[a]),
                  "kdb arms build no host module (cuda_utils, launchers)")


def gpu_half(args, check: Check) -> None:
    """Install, probe, then every part; each part's failure is its own."""
    parts = check.data["parts"]
    wheels = args.carry / "wheels"
    machine = args.python
    with check.part("install", needs=20) as rec:
        if rec is not None:
            if not list(wheels.glob("kdb-*.whl")):
                raise Skip(f"nothing carried in {wheels}: run `check.py --no-gpu` where the "
                           f"package registry is reachable, and carry {CARRY_PATH}")
            rec["figures"] = install_kdb(machine, wheels, Path(check.fresh("venv")))
    names = ("triton", "cuda", "pycuda", "pack", "inductor", "opencl", "timing")
    inst = parts["install"].get("figures") or {}
    if parts["install"]["status"] != "pass":
        for n in (*names, "hip"):
            parts[n] = {"status": "skipped", "reason": "kdb could not be installed"}
        return
    python = inst["python"]
    try:
        prepared = json.loads((args.carry / "gpu-check.json").read_text(encoding="utf-8"))
        pf = prepared["parts"]["prepare"]["figures"]
        check.data["prepared"] = {"at": prepared.get("started"), "host": prepared.get("host"),
                                  "pack_triton": pf["packs"]["triton"],
                                  "pack_identity": pf["packs"].get("identity"),
                                  "pythons": pf["wheels"]["pythons"]}
    except (OSError, ValueError, KeyError, TypeError):
        check.data["prepared"] = None
    check.data["machine"] = info = probe(python)
    info["env_not_inherited"] = stripped_env()
    if args.only and "hip" not in args.only:
        parts["hip"] = {"status": "skipped", "reason": "not asked for (--only)"}
    else:
        with check.part("hip", needs=30) as rec:  # AMD's GPU: not torch's nor NVIDIA's
            if rec is not None:
                part_hip(check, python, rec)
    if not info.get("gpu"):
        for n in names:
            parts[n] = {"status": "skipped",
                        "reason": f"{NO_GPU} (torch sees none: {info.get('gpu_error', '')})"}
        return
    major, minor = info["capability"]
    g = Gpu(check, machine, python, f"sm_{major}{minor}", args.carry)
    plain_digests: dict = {}
    runs = [("triton", 40, lambda rec: plain_digests.update(part_triton(g, rec))),
            ("cuda", 20, lambda rec: part_cuda(g, rec)),
            ("pycuda", 15, lambda rec: part_pycuda(g, rec, inst.get("pycuda"))),
            ("pack", 30, lambda rec: part_pack(g, rec, plain_digests)),
            ("inductor", 90, lambda rec: part_inductor(g, rec)),
            ("opencl", 25, lambda rec: part_opencl(g, rec, inst.get("pyopencl"))),
            ("timing", 60, lambda rec: part_timing(g, rec, args.pairs))]
    for name, needs, body in runs:
        if args.only and name not in args.only:
            parts[name] = {"status": "skipped", "reason": "not asked for (--only)"}
            continue
        with check.part(name, needs=needs) as rec:
            if rec is not None:
                body(rec)


def verdict(data: dict) -> str:
    """One line: the outcome, where, and each part's status (parts that share a status and a
    reason said once)."""
    parts = data["parts"]
    groups: dict[str, list[str]] = {}
    for name, rec in parts.items():
        word = rec["status"]
        if rec.get("failed"):
            word += " (" + "; ".join(rec["failed"]) + ")"
        elif rec.get("reason"):
            word += f" ({rec['reason'][:200]})"
        groups.setdefault(word, []).append(name)
    said = "; ".join(f"{', '.join(names)}: {word}" for word, names in groups.items())
    bad = [n for n, r in parts.items() if r["status"] in ("fail", "error")]
    m = data.get("machine") or {}
    where = m.get("gpu") or f"{platform.node()} (no GPU)"
    if data.get("mode") == "no-gpu":
        head = "FAILED" if bad else "PREPARED, GPU half " + NO_GPU
    else:
        head = "FAIL" if bad else ("PASS" if parts.get("triton", {}).get("status") == "pass"
                                   else "NOT PROVEN")
    return f"kdb GPU check: {head} on {where} in {data.get('seconds', 0):.0f} s; {said}"


def write(data: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu-check.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-gpu", action="store_true",
                    help="the CPU half: build what travels, print the command, dry-run")
    ap.add_argument("--quick", action="store_true", help="with --no-gpu: this Python's wheels "
                    "only, the installed Triton, sm_90 only (what the test runs)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where gpu-check.json goes (default: the carry folder)")
    ap.add_argument("--carry", type=Path, default=CARRY, help="what travels (default: %(default)s)")
    ap.add_argument("--work", type=Path, default=WORK, help="what stays here (packs for AMD, "
                    "the Triton venv)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole check (default: 450 on the GPU machine, 1800 "
                    "for --no-gpu)")
    ap.add_argument("--pairs", type=int, default=5, help="rounds of the timing part")
    ap.add_argument("--only", type=lambda v: set(v.split(",")), default=None,
                    help="run these parts alone (comma-separated: hip, triton, cuda, "
                    "pycuda, pack, inductor, opencl, timing), to rerun one that failed")
    ap.add_argument("--python", default=sys.executable,
                    help="the python whose packages the check uses (default: this one)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="kdb-gpu-check-"))
    check = Check(args.budget or (1800 if args.no_gpu else 450), scratch)
    data = check.data
    data.update(mode="no-gpu" if args.no_gpu else "gpu", command=COMMAND,
                host={"python": platform.python_version(), "platform": platform.platform()})
    try:
        if args.no_gpu:
            with check.part("prepare", needs=0) as rec:
                rec["figures"] = prepare(args, check)
            with check.part("dry run", needs=0) as rec:
                if data["parts"]["prepare"]["status"] != "pass":
                    raise Skip("nothing was prepared")
                rec["figures"] = dry_run(args, check)
            for name in ("triton", "cuda", "pycuda", "pack", "inductor", "opencl", "timing"):
                data["parts"][name] = {"status": "skipped", "reason": NO_GPU}
            data["parts"]["hip"] = {"status": "skipped", "reason": f"{NO_AMD_GPU} ({NO_GPU})"}
        else:
            gpu_half(args, check)
    finally:
        data["seconds"] = round(time.monotonic() - start, 1)
        data["verdict"] = verdict(data)
        path = write(data, args.out or args.carry)
        shutil.rmtree(scratch, ignore_errors=True)
    print(data["verdict"])
    print(f"every figure: {path}")
    if args.no_gpu:
        t = (data["parts"]["prepare"].get("figures") or {}).get("travels", {})
        if t:
            print(f"travels: {t['total_bytes'] / 2**20:.1f} MiB of {CARRY_LIMIT / 2**20:.0f} "
                  f"(working tree {t['tree_bytes'] / 2**20:.1f}, {CARRY_PATH} "
                  f"{t['carry_bytes'] / 2**20:.1f}); on the GPU machine, from the "
                  f"repository's root, carrying {CARRY_PATH} ({t['command_chars']} characters):")
            print(f"    {COMMAND}")
            print(f"(device run: carry [\"{CARRY_PATH}\"], timeout_s {RUN_TIMEOUT}: the "
                  f"check's budget is 450 s)")
    bad = any(r["status"] in ("fail", "error") for r in data["parts"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

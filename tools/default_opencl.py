"""Which OpenCL `make demo`, `make bench` and the tests run on: pip's PoCL where it builds a
kernel on this CPU, else Debian's PoCL, else Intel's CPU runtime.

pip's PoCL 3.0 (``pocl-binary-distribution``, LLVM 14) asks LLVM 14 for the host CPU's name.
A CPU newer than LLVM 14 (AMD's Zen 4 and Zen 5, for example) comes back as ``generic``,
which PoCL then passes to the compiler as the target CPU, and every build fails with
"unknown target CPU 'generic'". Debian's PoCL 3.1 (LLVM 15, a distribution build that picks
its kernel library by the CPU's features) builds on such a CPU, and so does Intel's runtime.

Prints ``OCL_ICD_VENDORS=<folder>`` (an ICD folder in the venv naming the OpenCL to use)
for the environment of the demo and the tests, or nothing where pip's PoCL works (the
OpenCL the machine had is then left as it was). With ``--install``, installs Debian's PoCL
where it is needed and absent (``tools/ensure_opencl.sh --debian-only``). Says on stderr
what it found. Never fails: with no working OpenCL, the demo says what PoCL said.

Usage: python tools/default_opencl.py [--install]
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Builds one kernel on the first PoCL platform, else the first platform; exit 0 if it built.
PROBE = r"""
import sys
import pyopencl as cl
plats = cl.get_platforms()
pick = [p for p in plats if "Portable Computing Language" in p.name] or plats
dev = pick[0].get_devices()[0]
try:
    cl.Program(cl.Context([dev]), "__kernel void k(__global int *a) { a[0] = 1; }").build()
except cl.Error as err:
    lines = [x for x in str(err).splitlines() if x.startswith("error:")] or [str(err)]
    print(f"{pick[0].name} ({pick[0].version.strip()}): {lines[0].strip()}")
    sys.exit(1)
print(f"{pick[0].name} ({pick[0].version.strip()})")
"""


def probe(vendors: str) -> tuple[bool, str]:
    """Whether a kernel builds with ``OCL_ICD_VENDORS=vendors`` (first PoCL, else first
    platform), and what the OpenCL said."""
    with tempfile.TemporaryDirectory(prefix="kdb-probe-") as tmp:
        env = {**os.environ, "OCL_ICD_VENDORS": vendors, "POCL_CACHE_DIR": tmp,
               "PYOPENCL_NO_CACHE": "1"}
        env.pop("PYOPENCL_CTX", None)
        try:
            done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                                  text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as err:
            return False, str(err)
    said = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or [""])[-1]
    return done.returncode == 0, said


def debian_pocl() -> str | None:
    found = sorted(glob.glob("/usr/lib/*/libpocl.so.2"))
    return found[0] if found else None


def intel_runtime() -> str | None:
    path = Path(sys.prefix, "opencl-intel", "lib", "libintelocl.so")
    return str(path) if path.exists() else None


def pip_pocl() -> tuple[bool, str]:
    """Whether pip's PoCL (pyopencl's own loader, no other ICD) builds a kernel here."""
    with tempfile.TemporaryDirectory(prefix="kdb-no-icds-") as empty:
        return probe(empty)


def choose(install: bool = False, pip: tuple[bool, str] | None = None) -> str | None:
    """The ICD folder to use (``None``: pip's PoCL works, or nothing does); ``pip``: what
    :func:`pip_pocl` said, where the caller asked already."""
    works, said = pip or pip_pocl()
    if works:
        return None
    _say(f"pip's PoCL cannot build a kernel on this CPU ({said})")
    if install and debian_pocl() is None:
        subprocess.run(["bash", str(HERE / "ensure_opencl.sh"), "--debian-only"], check=False,
                       stdout=sys.stderr)  # stdout is for OCL_ICD_VENDORS alone
    folder = Path(sys.prefix, "opencl-default")
    for name, library in (("Debian's PoCL", debian_pocl()), ("Intel's runtime", intel_runtime())):
        if library is None:
            continue
        folder.mkdir(exist_ok=True)
        for old in folder.glob("*.icd"):
            old.unlink()
        (folder / "default.icd").write_text(library + "\n")
        works, said = probe(str(folder))
        if works:
            _say(f"using {name} instead: {said} (OCL_ICD_VENDORS={folder})")
            return str(folder)
        _say(f"{name} cannot build a kernel either ({said})")
    _say("no OpenCL here builds a kernel; install Debian's PoCL (apt-get install libpocl2) "
         "or Intel's runtime (tools/ensure_opencl.sh)")
    return None


def _say(text: str) -> None:
    print(f"default_opencl: {text}", file=sys.stderr)


if __name__ == "__main__":
    chosen = choose(install="--install" in sys.argv[1:])
    if chosen:
        print(f"OCL_ICD_VENDORS={chosen}")

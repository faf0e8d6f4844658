"""A differential test of the include model: random layouts, the compilers as the oracle.

Each case draws an include layout (headers nested in the working directory, include dirs,
subdirectories and symlinks; shadowed names; quoted and angled includes in every spelling a
preprocessor reads: byte-order marks, CR and CR LF line ends, form feeds and vertical tabs,
digraphs, trigraphs, splices, comments; ``-I`` in every option form, in list elements with
other options, relative, and in the variables the compilers read). The property: every file
the compiler reads is a file kdb's key holds by content, or kdb says it cannot be sure (the
build is then not cached). A file the compiler reads and the key does not hold is a stale
binary waiting for an edit.

Oracles: clang's own preprocessor through the ``libclang`` wheel for OpenCL C (thousands of
cases in seconds); nvcc's host preprocessor (``cpp -M``) on the include options kdb hands
nvcc, and nvcc itself (``nvcc -M``) on the caller's options for a sample. A sample of OpenCL
cases also runs end to end on PoCL: built through kdb, a header edited, built again through
kdb and without it; the results must agree.

``KDB_DIFFERENTIAL_CASES=N`` runs N cases per oracle (default: a CI-sized run);
``KDB_DIFFERENTIAL_SEED=S`` starts from seed S. A failure names its seed.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kdb.backends.includes import UncertainIncludes, read_headers

CASES = int(os.environ.get("KDB_DIFFERENTIAL_CASES", "0") or 0)
SEED = int(os.environ.get("KDB_DIFFERENTIAL_SEED", "0") or 0)

#: Directive spellings: a format taking the include's ``<name>`` or ``"name"``.
SPELLINGS = ["#include {}", "  #  include {}", "\f#include {}", "#\vinclude {}", "%:include {}",
             "??=include {}", "#inc\\\nlude {}", "#inc\\ \nlude {}", "#/* c */include {}",
             "#inc??/\nlude {}", "# include{}"]
DECOYS = ["/* #include {} */", "// #include {}"]
LINE_ENDS = ["\n", "\n", "\r\n", "\r"]


@dataclass
class Layout:
    """One drawn case: files written under ``root``, a program, its options and variables."""

    seed: int
    root: Path
    cwd: Path
    source: str = ""
    options: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    headers: list[Path] = field(default_factory=list)
    search: list[Path] = field(default_factory=list)  # the include dirs, in order

    def describe(self) -> str:
        files = "\n".join(f"  {p.relative_to(self.root)}: {p.read_bytes()[:120]!r}"
                          for p in sorted(self.root.rglob("*")) if p.is_file())
        return (f"seed {self.seed} (KDB_DIFFERENTIAL_SEED={self.seed} KDB_DIFFERENTIAL_CASES=1)"
                f"\noptions {self.options!r} env {self.env!r}\nsource {self.source!r}\n{files}")


def _write(path: Path, text: str, rng: random.Random) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    end = rng.choice(LINE_ENDS)
    data = text.replace("\n", end)
    bom = "\ufeff" if rng.random() < 0.15 else ""
    path.write_bytes((bom + data).encode("utf-8"))


def draw(seed: int, root: Path, cuda: bool = False, hip: bool = False) -> Layout:
    """A random include layout under ``root`` (an empty directory)."""
    rng = random.Random(seed)
    cwd = root / "work"
    cwd.mkdir(parents=True)
    lay = Layout(seed, root, cwd)
    dirs = [root / f"inc{i}" for i in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        dirs.append(cwd / "local")
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    if rng.random() < 0.25:  # an include dir reached through a symlink
        link = root / "linked"
        link.symlink_to(dirs[0], target_is_directory=True)
        dirs[0] = link
    lay.search = dirs
    names = [rng.choice(["", "sub/"]) + f"h{i}.h" for i in range(rng.randint(1, 6))]
    homes = [cwd, *dirs] if not (cuda or hip) else dirs  # kdb builds a copy elsewhere
    placed: list[tuple[str, Path]] = []
    for i, name in enumerate(names):
        for home in rng.sample(homes, k=min(len(homes), rng.choice([1, 1, 1, 2]))):  # shadowed
            placed.append((name, home / name))
    # Headers include later headers (no cycles); the program includes a few of them.
    for k, (name, path) in enumerate(placed):
        lines = [f"#define V{names.index(name)} {rng.randint(1, 9)}"]
        later = [n for n, _ in placed[k + 1:] if n != name]
        for inc in rng.sample(later, k=min(len(later), rng.randint(0, 2))):
            lines.insert(0, _directive(rng, inc))
        if rng.random() < 0.2:
            lines.append(rng.choice(DECOYS).format(f'"{rng.choice(names)}"'))
        if not path.exists():
            _write(path, "\n".join(lines) + "\n", rng)
            lay.headers.append(path)
    if rng.random() < 0.15:  # a header that is a symlink to another
        target = rng.choice(lay.headers)
        link = rng.choice(dirs) / "linked.h"
        if not link.exists():
            link.symlink_to(target)
            names.append("linked.h")
    top = rng.sample(names, k=rng.randint(1, len(names)))
    lines = [_directive(rng, n) for n in top]
    lay.source = "\n".join(lines) + "\n" + rng.choice(LINE_ENDS).join(["", "// kernel", ""])
    if rng.random() < 0.1:
        lay.source = "\ufeff" + lay.source
    lay.options, lay.env = _options(rng, dirs, cwd, cuda, hip)
    return lay


def _directive(rng: random.Random, name: str) -> str:
    spelled = f'"{name}"' if rng.random() < 0.6 else f"<{name}>"
    return rng.choice(SPELLINGS).format(spelled)


def _options(rng: random.Random, dirs: list[Path], cwd: Path, cuda: bool, hip: bool = False
             ) -> tuple[list[str], dict[str, str]]:
    opts: list[str] = []
    env: dict[str, str] = {}
    for d in dirs:
        rel = os.path.relpath(d, cwd)
        path = rel if rng.random() < 0.3 else str(d)
        if hip:  # clang's spellings, and the variables hipcc and clang read
            form = rng.choice(["-I{}", "-I {}", "--include-directory={}", "-isystem {}",
                               "-idirafter {}", "-iquote {}", "CPATH", "APPEND"])
            if form == "CPATH":
                env["CPATH"] = ":".join(filter(None, [env.get("CPATH"), str(d)]))
            elif form == "APPEND":
                env["HIPCC_COMPILE_FLAGS_APPEND"] = \
                    f"{env.get('HIPCC_COMPILE_FLAGS_APPEND', '')} -I{d}".strip()
            else:
                opts += form.format(path).split(" ", 1)
            continue
        if cuda:
            form = rng.choice(["-I{}", "-I {}", "--include-path={}", "--include-path {}",
                               "-isystem {}", "--system-include={}", "CPATH", "APPEND"])
            if form == "CPATH":
                env["CPATH"] = ":".join(filter(None, [env.get("CPATH"), str(d)]))
            elif form == "APPEND":
                env["NVCC_APPEND_FLAGS"] = f"{env.get('NVCC_APPEND_FLAGS', '')} -I{d}".strip()
            else:
                opts += form.format(path).split(" ", 1)
            continue
        form = rng.choice(["-I{}", "-I {}", "[-I {}]", "[-I{} -DX=1]", "[-DY=2 -I {}]",
                           "[-I {} -DZ=3]", "POCL"])
        if form == "POCL":
            env["POCL_EXTRA_BUILD_FLAGS"] = f"{env.get('POCL_EXTRA_BUILD_FLAGS', '')} -I{d}"
        elif form.startswith("["):
            opts.append(form[1:-1].format(path))
        else:
            opts += form.format(path).split(" ", 1)
    if rng.random() < 0.3:
        opts.insert(rng.randint(0, len(opts)), "-DW=1")
    return opts, env


def _idents(paths) -> set[tuple[int, int]]:
    out = set()
    for p in paths:
        st = os.stat(p)
        out.add((st.st_dev, st.st_ino))
    return out


# -- OpenCL: clang's preprocessor as the oracle -------------------------------------------

def _kdb_opencl(lay: Layout) -> set[tuple[int, int]] | None:
    """The files kdb's key holds for this build, or None where kdb is not sure."""
    from kdb.backends.opencl.keys import search_of

    files: set[tuple[int, int]] = set()
    opt_bytes = " ".join(lay.options).encode()
    try:
        read_headers(lay.source, search_of(opt_bytes, sorted(lay.env.items())), str(lay.cwd),
                     files=files)
    except UncertainIncludes:
        return None
    return files


def _clang_reads(index, lay: Layout) -> set[tuple[int, int]]:
    """What clang's preprocessor opens for the program, built as PoCL builds it: the
    program a file in the working directory, ``-I.``, the options then the variable's."""
    import clang.cindex as ci

    args = ["-x", "cl", "-cl-no-stdinc", "-I."]
    args += shlex.split(" ".join(lay.options)) + shlex.split(lay.env.get("POCL_EXTRA_BUILD_FLAGS", ""))
    main = str(lay.cwd / "kdb_main.cl")
    try:
        tu = index.parse(main, args=args, unsaved_files=[(main, lay.source)])
    except ci.TranslationUnitLoadError:
        return set()
    return _idents(str(i.include.name) for i in tu.get_includes())


def _cases(default: int) -> range:
    return range(SEED, SEED + (CASES or default))


def test_clang_reads_nothing_the_opencl_key_does_not_hold(tmp_path, monkeypatch):
    ci = pytest.importorskip("clang.cindex", reason="the libclang wheel (the test extra)")
    index = ci.Index.create()
    uncertain = 0
    for seed in _cases(1500):
        root = tmp_path / str(seed)
        lay = draw(seed, root)
        monkeypatch.chdir(lay.cwd)
        held = _kdb_opencl(lay)
        if held is None:
            uncertain += 1
            continue
        missed = _clang_reads(index, lay) - held
        assert not missed, f"clang read a file the key does not hold:\n{lay.describe()}"
        shutil.rmtree(root)
    assert uncertain < (CASES or 1500) / 10  # the draw exercises the model, not its refusals


# -- CUDA: nvcc's host preprocessor, and nvcc itself ----------------------------------------

CPP = shutil.which("cpp")
NVCC = shutil.which("nvcc")


def _kdb_cuda(lay: Layout, monkeypatch):
    """kdb's request for this build (nvcc), or None where kdb is not sure."""
    from kdb.backends.cuda import keys as cuda_keys

    for name in ("CPATH", "NVCC_APPEND_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in lay.env.items():
        monkeypatch.setenv(name, value)
    req = cuda_keys._request(lay.source, "sm_90", lay.options, (), "ptx", nvcc=None,
                             memo_dir=None, name=None,
                             compiler="nvcc")
    return None if req.uncertain else (req, set(req.header_files))


def _cuda_layouts(tmp_path, monkeypatch, default: int):
    """``(root, layout, kdb's request, the files its key holds)`` for each drawn CUDA case
    kdb is sure of, with the working directory and variables as the case has them."""
    for seed in _cases(default):
        root = tmp_path / str(seed)
        lay = draw(seed, root, cuda=True)
        monkeypatch.chdir(lay.cwd)
        got = _kdb_cuda(lay, monkeypatch)
        if got is not None:
            yield (root, lay, *got)


def _deps(cmd: list[str], tmp: Path, env: dict[str, str]) -> set[tuple[int, int]]:
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, env={**os.environ, **env})
    from kdb.backends.includes import dependency_paths

    paths = dependency_paths(proc.stdout.decode("utf-8", "surrogateescape"))[1:]
    system = ("/usr/", "/opt/", os.path.realpath(os.path.dirname(os.path.dirname(NVCC or "/"))))
    return _idents(p for p in (os.path.realpath(tmp / p) for p in paths)
                   if not p.startswith(system) and os.path.exists(p))


@pytest.mark.skipif(CPP is None or NVCC is None, reason="needs cpp and nvcc on PATH")
def test_nvccs_preprocessor_reads_nothing_the_cuda_key_does_not_hold(tmp_path, monkeypatch):
    """``cpp -M`` with the include options kdb hands nvcc, in a directory of its own as
    nvcc runs; CPATH as nvcc's environment has it."""
    for root, lay, req, held in _cuda_layouts(tmp_path, monkeypatch, 400):
        missed = _cpp_reads(root, lay, req, "kernel.cu", "NVCC_APPEND_FLAGS") - held
        assert not missed, f"cpp read a file the key does not hold:\n{lay.describe()}"
        shutil.rmtree(root)


def _cpp_reads(root, lay, req, name: str, flags_variable: str) -> set:
    """What ``cpp -M`` reads with the include options kdb hands the compiler, run on the
    program as ``name`` in a directory of its own (as nvcc and hipcc run it), with the
    options of ``flags_variable`` and CPATH as the compiler's environment has them."""
    build = root / "build"
    build.mkdir()
    (build / name).write_text(lay.source)
    extra = shlex.split(lay.env.get(flags_variable, ""))
    cmd = [CPP, "-M", "-x", "c++", *req.include_args, *extra, name]
    return _deps(cmd, build, {"CPATH": lay.env["CPATH"]} if "CPATH" in lay.env else {})


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_nvcc_reads_nothing_the_cuda_key_does_not_hold(tmp_path, monkeypatch):
    """The caller's own options, handed to nvcc unchanged (``nvcc -M``, run in the
    working directory so relative paths mean what the caller meant)."""
    for _, lay, _, held in _cuda_layouts(tmp_path, monkeypatch, 12):
        (lay.cwd / "kdb_main.cu").write_text(lay.source)
        held |= _idents([lay.cwd / "kdb_main.cu"])
        missed = _deps([NVCC, "-M", "-arch=sm_90", *lay.options, "kdb_main.cu"], lay.cwd,
                       lay.env) - held
        assert not missed, f"nvcc read a file the key does not hold:\n{lay.describe()}"


# -- HIP: the host preprocessor on what kdb hands hipcc, and hipcc itself ----------------

HIPCC = shutil.which("hipcc")


def _hip_layouts(tmp_path, monkeypatch, default: int):
    """``(root, layout, kdb's request, the files its key holds)`` for each drawn HIP case
    kdb is sure of, with the working directory and variables as the case has them."""
    from kdb.backends.hip import keys as hip_keys

    for seed in _cases(default):
        root = tmp_path / str(seed)
        lay = draw(seed, root, hip=True)
        monkeypatch.chdir(lay.cwd)
        for name in ("CPATH", "HIPCC_COMPILE_FLAGS_APPEND"):
            monkeypatch.delenv(name, raising=False)
        for name, value in lay.env.items():
            monkeypatch.setenv(name, value)
        req = hip_keys.request(lay.source, "gfx90a", lay.options, (), compiler="hipcc")
        if not req.uncertain:
            yield root, lay, req, set(req.header_files)


@pytest.mark.skipif(CPP is None or HIPCC is None, reason="needs cpp and hipcc on PATH")
def test_the_preprocessor_reads_nothing_the_hip_key_does_not_hold(tmp_path, monkeypatch):
    """``cpp -M`` with the include options kdb hands hipcc (``-I``, ``-isystem``,
    ``-iquote``, ``-include``: the host preprocessor takes them as clang does), in a
    directory of its own as hipcc runs; CPATH and HIPCC_COMPILE_FLAGS_APPEND as hipcc's
    environment has them."""
    for root, lay, req, held in _hip_layouts(tmp_path, monkeypatch, 300):
        missed = _cpp_reads(root, lay, req, "kernel.hip", "HIPCC_COMPILE_FLAGS_APPEND") - held
        assert not missed, f"cpp read a file the HIP key does not hold:\n{lay.describe()}"
        shutil.rmtree(root)


@pytest.mark.skipif(HIPCC is None, reason="hipcc is not on PATH")
def test_hipcc_reads_nothing_the_hip_key_does_not_hold(tmp_path, monkeypatch):
    """The caller's own options, handed to hipcc unchanged (``hipcc -M``, run in the working
    directory so relative paths mean what the caller meant). A case clang refuses is left
    out: a failed build stores nothing, and clang's error recovery reads files a build never
    does (an ``<angled>`` include it cannot find, it opens as a quoted one to suggest it)."""
    for _, lay, _, held in _hip_layouts(tmp_path, monkeypatch, 6):
        (lay.cwd / "kdb_main.hip").write_text(lay.source)
        held |= _idents([lay.cwd / "kdb_main.hip"])
        cmd = [HIPCC, "--genco", "--offload-arch=gfx90a", "-M", *lay.options, "kdb_main.hip"]
        env = {**lay.env, "HIP_PLATFORM": "amd"}
        if subprocess.run(cmd, cwd=lay.cwd, capture_output=True,
                          env={**os.environ, **env}).returncode != 0:
            continue
        missed = _deps(cmd, lay.cwd, env) - held
        assert not missed, f"hipcc read a file the key does not hold:\n{lay.describe()}"


# -- OpenCL end to end on PoCL: kdb against a plain build, after an edit ------------------

def _kernel(n: int) -> str:
    body = "".join(f"#ifdef V{i}\n o[{i}] = V{i};\n#else\n o[{i}] = -1;\n#endif\n"
                   for i in range(n))
    return f"__kernel void k(__global int *o) {{\n{body}}}\n"


def test_a_random_edit_gives_the_same_result_through_kdb_as_without_it(cache_dir, cl_ctx,
                                                                       tmp_path, monkeypatch):
    cl = pytest.importorskip("pyopencl")
    np = pytest.importorskip("numpy")
    import kdb
    import kdb.opencl

    def run(prg) -> list[int]:
        q = cl.CommandQueue(cl_ctx)
        buf = cl.Buffer(cl_ctx, cl.mem_flags.WRITE_ONLY, 4 * 8)
        prg.k(q, (1,), None, buf)
        out = np.zeros(8, np.int32)
        cl.enqueue_copy(q, out, buf)
        q.finish()
        return out.tolist()

    for seed in _cases(10):
        rng = random.Random(seed)
        lay = draw(seed, tmp_path / str(seed))
        monkeypatch.chdir(lay.cwd)
        for name in ("POCL_EXTRA_BUILD_FLAGS",):
            monkeypatch.delenv(name, raising=False)
        for name, value in lay.env.items():
            monkeypatch.setenv(name, value)
        src = lay.source + _kernel(8)
        try:
            first = run(kdb.opencl.build(cl_ctx, src, lay.options))
        except kdb.CompileError:
            continue  # a layout the compiler refuses (a missing header): nothing to compare
        kdb.default_db().flush()
        victim = rng.choice(lay.headers)  # "#define V1 7" -> "#define V1 17"
        victim.write_bytes(re.sub(rb"(#define V\d+ )", rb"\g<1>1", victim.read_bytes(), count=1))
        through = run(kdb.opencl.build(cl_ctx, src, lay.options))
        plain = run(cl.Program(cl_ctx, src).build(options=lay.options))
        assert through == plain, f"kdb served {through}, the compiler gives {plain} " \
                                 f"(before the edit: {first}):\n{lay.describe()}"

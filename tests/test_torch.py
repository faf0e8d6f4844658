"""torch.compile's caches in kdb, for real: torch (CPU), Inductor's C++ backend, a small
model's first training step in fresh processes whose Inductor caches are empty, with torch's
own counters (not kdb's report) saying what was compiled. Skips where torch is absent
(``make test`` installs it: the ``torch`` extra)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TORCH_STEP as STEP, torch_step

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'kdb[torch]')")

#: torch 2.7's end-of-compile callback names no trigger (no ``CallbackArgs``): kdb then
#: releases AOTAutograd's claim at the frame's end, and a waiter may trace again.
needs_trigger = pytest.mark.skipif(
    not hasattr(pytest.importorskip("torch._dynamo.callback"), "CallbackArgs"),
    reason=f"torch {torch.__version__}'s compile-end callback names no trigger: an "
           "AOTAutograd claim ends with its frame (docs/torch.md)")



def step(env: dict, where: Path, *args: str, kdb_auto: bool = False) -> dict:
    """The first step in a fresh process with empty Inductor caches of its own."""
    return torch_step(Path(sys.executable), {**env, "KDB_AUTO": "1"} if kdb_auto else env,
                      where, *args)[0]


def _together(tmp_path: Path, n: int, *args: str) -> list[str]:
    """The stdout of ``n`` Python processes started together on one cold kdb cache, each
    with empty Inductor caches and a temporary directory of its own. Inductor's check of
    the CPU's vector instructions is off (scalar C++ kernels): a cold step then builds 5 C++
    modules in 13 CPU-s instead of 11 in 25, and who compiles what is the same (the check's
    modules served from kdb: the warm-start test, whose cold step keeps it on)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDB_", "TORCHINDUCTOR_"))}
    env.update(KDB_CACHE_DIR=str(tmp_path / "kdb"), TORCHINDUCTOR_VEC_ISA_OK="0")
    procs = []
    for i in range(n):
        where = tmp_path / f"p{i}"
        (where / "tmp").mkdir(parents=True)
        procs.append(subprocess.Popen(
            [sys.executable, *args], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**env, "TORCHINDUCTOR_CACHE_DIR": str(where / "ind"),
                 "TMPDIR": str(where / "tmp")}))
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def cold(torch_cold):
    """One cold compile with kdb on (from code), its entries in a kdb cache of this module's
    own (conftest: made once a run)."""
    return torch_cold


@pytest.mark.slow
def test_a_fresh_process_with_kdb_warm_compiles_nothing_and_gives_the_same_bits(cold):
    env, root, first = cold
    assert first["fx_miss"] >= 2 and first["cpp_builds"] > 0  # the cold run compiled
    again = step(env, root / "warm", kdb_auto=True)  # KDB_AUTO=1: no code changed
    assert (again["fx_miss"], again["aot_miss"]) == (0, 0), again
    assert again["fx_hit"] == first["fx_miss"] and again["aot_hit"] == 1, again
    assert again["cpp_builds"] == 0, again  # every C++ module (and ISA check) from kdb
    assert again["digest"] == first["digest"]


def test_inductor_told_to_cache_nothing_is_served_nothing(cold):
    """``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` (one debugging a compiler): Inductor looks
    in no cache, and kdb served it every C++ module all the same."""
    env, root, first = cold
    off = step({**env, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}, root / "off", kdb_auto=True)
    assert off["cpp_builds"] > 0 and (off["fx_hit"], off["aot_hit"]) == (0, 0), off
    assert off["digest"] == first["digest"]


def test_triton_kernels_go_to_inductors_own_fresh_directory_when_it_caches_nothing(
        cache_dir, tmp_path, monkeypatch):
    """On a GPU, Inductor told to cache nothing gives Triton a fresh directory of its own:
    kdb, Triton's cache manager, leaves every kernel to it (none looked up, none stored)."""
    pytest.importorskip("triton")
    from torch._inductor import config as inductor_config

    from kdb.backends.triton.cache import CacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    kernel = tmp_path / "made" / "k.cubin"
    kernel.parent.mkdir()
    kernel.write_bytes(b"cubin")
    with inductor_config.patch(force_disable_caches=True):
        manager = CacheManager("a" * 52)
        assert manager.get_group("k.json") is None
        where = manager.put(b"cubin", "k.cubin")
        manager.put_group("k.json", {"k.cubin": where})
    assert where.startswith(str(tmp_path / "fresh" / ("a" * 52)))
    assert not list(cache_dir.glob("v1/*.kdb"))


@pytest.mark.slow
def test_stored_compile_seconds_count_each_second_once(cold):
    """The AOTAutograd entry's compile holds its graphs', a graph's its C++ modules': each
    entry keeps its own seconds, so what served entries "saved" adds up to the step's time,
    plus the time C++ modules built side by side (Inductor's compile threads) overlapped:
    each of those really took its whole build (before: about three times the step)."""
    from kdb.bookkeeping import covered_seconds

    env, root, first = cold
    [kdb_file] = (root / "kdb" / "v1").glob("cpu-*.kdb")
    with sqlite3.connect(kdb_file) as conn:
        stored = conn.execute("SELECT SUM(compile_seconds) FROM kernels").fetchone()[0]
        modules = conn.execute("SELECT at - seconds, at FROM compile_log "
                               "WHERE name LIKE 'cpp:%'").fetchall()
    overlap = sum(end - start for start, end in modules) - covered_seconds(modules)
    assert modules and 0 < stored <= first["first_step"] * 1.01 + overlap, (stored, first,
                                                                            overlap)


@pytest.mark.slow
def test_an_entry_made_by_another_torch_is_a_miss(cold, tmp_path):
    """The same graphs, the same kdb cache, under another torch release: all compiled, and
    ``kdb explain`` names the cause. Inductor's keys hold torch's version too, so the
    nearest entry of a graph is one of this torch's other graphs (it differs in source
    only): kdb explain named that one, and never "another torch"."""
    env, root, _ = cold
    other = step(env, tmp_path / "other", "kdb", "other-torch")
    assert other["fx_hit"] == 0 and other["fx_miss"] >= 2, other
    assert other["cpp_builds"] > 0, other
    [kdb_file] = (root / "kdb" / "v1").glob("cpu-*.kdb")
    with sqlite3.connect(kdb_file) as conn:  # a graph the other torch compiled
        name = conn.execute("SELECT name FROM compile_log WHERE name LIKE 'fx-graph%' "
                            "ORDER BY at DESC LIMIT 1").fetchone()[0]
    kdb = Path(sys.executable).with_name("kdb")
    why = subprocess.run([str(kdb), "explain", name, "--json"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert why.returncode == 0, why.stderr
    said = json.loads(why.stdout)["why"]
    assert "another torch" in said and "another python" not in said, said


@pytest.mark.slow
@needs_trigger
def test_processes_at_once_compile_each_graph_and_its_autograd_entry_once(tmp_path):
    """Three fresh processes start one training step together on a cold kdb cache: one
    compiles the forward and backward graphs and AOTAutograd's entry, the others wait and
    get all three. AOTAutograd puts its entry only after the lazy backward's compile, once
    the frame's compile has ended: released there, its claim sent waiters to trace again."""
    each = []
    for out in _together(tmp_path, 3, str(STEP), "kdb", "tiny"):
        line = next(x for x in out.splitlines() if x.startswith("STEP-JSON:"))
        each.append(json.loads(line.partition(":")[2]))
    assert sum(x["fx_miss"] for x in each) == 2, each  # the forward and the backward graph
    assert sorted(x["aot_miss"] for x in each) == [0, 0, 1], each
    assert sorted(x["aot_hit"] for x in each) == [0, 1, 1], each
    assert len({x["digest"] for x in each}) == 1


@needs_trigger
def test_an_autograd_claim_outlives_its_frame_until_the_lazy_backward_compiled(monkeypatch):
    """At a frame's end a claim that stored nothing is released, but AOTAutograd's is kept
    (pending) until that frame's lazy backward has compiled, other frames ending meanwhile."""
    import threading

    from torch._dynamo.callback import CallbackArgs, CallbackTrigger

    from kdb.backends.torch import entries

    class Claim:
        released, pending, state = False, None, None

        def release(self):
            self.released = True

        def mark_pending(self, seconds, budget=None):
            self.pending, self.budget = seconds, budget

        def mark(self, state):
            self.state = state

    aot, fx = Claim(), Claim()
    me = threading.get_ident()
    monkeypatch.setattr(entries, "_compiling", {
        "aot": entries._Compiling(aot, 0.0, me, aot=True),
        "fx": entries._Compiling(fx, 0.0, me, aot=False)})
    monkeypatch.setattr(entries.time, "perf_counter", lambda: 100.0)  # compiled in 100 s
    entries.release_unstored(CallbackArgs(CallbackTrigger.DYNAMO, "0/0"))
    assert fx.released and not aot.released and aot.pending == 100.0
    # A waiter waits while the holder spends a fifth of the compile of CPU, for the backward
    # to begin; a program that never runs one puts no entry.
    assert aot.budget == pytest.approx(entries.AWAIT_BACKWARD * 100.0)
    entries.backward_begins(CallbackArgs(CallbackTrigger.LAZY_BACKWARD, "1/0"))
    assert aot.state is None  # another frame's backward
    entries.release_unstored(CallbackArgs(CallbackTrigger.DYNAMO, "1/0"))
    entries.release_unstored(CallbackArgs(CallbackTrigger.LAZY_BACKWARD, "1/0"))
    assert not aot.released
    entries.backward_begins(CallbackArgs(CallbackTrigger.LAZY_BACKWARD, "0/0"))
    assert aot.state == "compiling"  # judged as a compile again, by its progress
    entries.release_unstored(CallbackArgs(CallbackTrigger.LAZY_BACKWARD, "0/0"))
    assert aot.released and not entries._compiling


SERVE = """
import json, os, sys, time
import torch
from torch._dynamo.utils import counters
import kdb.torch
kdb.torch.install()
torch.manual_seed(0)
model = torch.compile(torch.nn.Sequential(torch.nn.Linear(64, 10), torch.nn.ReLU()))
x = torch.randn(32, 64)
t0 = time.perf_counter()
model(x)  # grad mode on and parameters that require grad: a joint graph, no backward ever
first, cpu = time.time(), time.process_time()
wall = time.perf_counter() - t0
print(json.dumps({"first": first, "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
                  "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}), flush=True)
ranks = sys.argv[1]
open(os.path.join(ranks, str(os.getpid())), "w").close()
# Serve requests, busy, until every rank has answered one or for 1.5x the first's time of CPU.
while time.process_time() - cpu < 1.5 * wall and len(os.listdir(ranks)) < 2:
    model(x)
print(json.dumps({"exit": time.time()}), flush=True)
"""


@pytest.mark.slow
@needs_trigger
def test_ranks_that_never_run_a_backward_do_not_wait_for_its_autograd_entry(tmp_path):
    """Inference with parameters that require grad (no ``torch.no_grad()``), two ranks
    started together: AOTAutograd puts its entry only with a backward, which never runs. The
    rank that traced and compiled serves requests (until both have answered one, or for
    1.5x its first answer's time of CPU); the other must not wait for that entry until it
    exits (before, it waited while the holder spent 4x its compile time of CPU:
    first outputs at 29-30 s against 9 s for the holder, 13 s each without kdb). It traces
    the graph itself once the holder's frame has compiled, and compiles none of it."""
    script, ranks = tmp_path / "serve.py", tmp_path / "answered"
    script.write_text(SERVE)
    ranks.mkdir()
    runs = []
    for out in _together(tmp_path, 2, str(script), str(ranks)):
        lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        runs.append({**lines[0], **lines[1]})
    holder, waiter = sorted(runs, key=lambda r: r["first"])
    assert holder["fx_miss"] >= 1 and waiter["fx_miss"] == 0, runs  # compiled once
    assert waiter["aot_miss"] == 1, runs  # traced itself: no entry was coming
    assert waiter["first"] < holder["exit"], runs  # not kept waiting until the holder ended


def test_keys_hold_no_path_of_this_machine(tmp_path, monkeypatch):
    """The C++ module's key: the venv's torch, the Python's headers and the cache directory
    are replaced by what they stand for; a path kdb cannot place makes no key at all."""
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions

    from kdb.backends.torch import cpp

    src = tmp_path / "k.cpp"
    src.write_text("extern \"C\" int f() { return 1; }\n")
    builder = CppBuilder("k", [str(src)], CppTorchOptions(), str(tmp_path))
    attrs = cpp.attrs_for([builder])
    assert attrs is not None
    text = attrs.encoded().decode()
    for local in (str(tmp_path), sys.prefix, os.path.dirname(torch.__file__)):
        assert local not in text
    assert "{torch}" in attrs.source and "{src0}" in attrs.source

    class Elsewhere:  # a command naming a directory kdb cannot place
        def get_command_line(self):
            return f"g++ {src} -I/opt/somewhere/include -o {tmp_path}/k.so"

        def get_target_file_path(self):
            return f"{tmp_path}/k.so"

    assert cpp.attrs_for([Elsewhere()]) is None


def test_install_keeps_a_remote_cache_the_program_chose(monkeypatch):
    """A program that switched a remote cache itself (its Redis) keeps it; kdb takes the
    others; uninstall gives every one back."""
    import kdb.torch
    from torch._inductor import config, remote_cache

    monkeypatch.setattr(config, "fx_graph_remote_cache", False)
    try:
        assert kdb.torch.install()
        assert remote_cache.RemoteFxGraphCache.backend_override_cls is None
        assert remote_cache.RemoteAOTAutogradCache.backend_override_cls is not None
        assert config.fx_graph_remote_cache is False
    finally:
        kdb.torch.uninstall()
    assert remote_cache.RemoteAOTAutogradCache.backend_override_cls is None


def test_a_source_that_includes_a_header_by_absolute_path_is_keyed_by_its_content(tmp_path):
    """torch 2.7's C++ sources include their prefix header from Inductor's cache directory
    by absolute path: the key holds the header's content, not the directory, so another
    cache directory (another machine) hits, and an edited header misses."""
    from kdb.backends.torch.cpp import _source_digest

    digests = []
    for where, prefix in (("a", "int x;"), ("b", "int x;"), ("c", "int y;")):
        (tmp_path / where).mkdir()
        header = tmp_path / where / "prefix.h"
        header.write_text(prefix)
        source = tmp_path / where / "module.cpp"
        source.write_text(f'#include "{header}"\nextern "C" void kernel() {{}}\n')
        digests.append(_source_digest(str(source)))
    assert digests[0] == digests[1] != digests[2]
    (tmp_path / "a" / "prefix.h").unlink()
    assert _source_digest(str(tmp_path / "a" / "module.cpp")) is None  # cannot key: built


def test_a_cpp_module_is_keyed_by_the_c_library_it_links_against(tmp_path, monkeypatch):
    """An Inductor C++ module built on a newer glibc may not load on an older one (a pack
    built in a new container, served on an older cluster): the C library is in its key, as
    it is in a Triton host module's."""
    from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions

    from kdb.backends import stdlibs
    from kdb.backends.torch import cpp

    src = tmp_path / "k.cpp"
    src.write_text('extern "C" int f() { return 1; }\n')
    builder = CppBuilder(name="k", sources=[str(src)], BuildOption=CppTorchOptions(),
                         output_dir=str(tmp_path))
    here = cpp.attrs_for([builder])
    assert dict(here.compiler)["libc"] == os.confstr("CS_GNU_LIBC_VERSION")
    monkeypatch.setattr(stdlibs, "libc", lambda: "glibc 2.17")
    assert cpp.attrs_for([builder]).key != here.key

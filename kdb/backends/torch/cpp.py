"""Inductor's compiled C++ modules (its CPU backend's kernels) in kdb.

Inductor builds each C++ module with the host compiler into its cache directory, named by a
digest of the source and the compile command (``torch._inductor.codecache.CppCodeCache``),
and its FX graph cache holds only the source: a graph served from any cache compiles its C++
again where the directory is empty (and checks the CPU's vector ISA by building test
libraries there, in every fresh directory). The command names paths of this machine (the venv's
torch, the Python's headers, the cache directory), so kdb keys a module by the command with
those paths replaced by what they stand for, the sources' content, the compiler's version,
the C library (``glibc 2.36``: a module built on a newer one may not load on an older one)
and the host CPU's class (Inductor compiles with ``-march=native``); a command that names a
path kdb cannot place is built as without kdb. The two functions this wraps are private:
``torch._inductor.codecache._worker_compile_cpp(lock_path, builders)``, which Inductor calls
(in this process, or a thread of its pool) to build a module's missing files, and
``torch._inductor.cpp_builder.CppBuilder.build``, for builds outside a module's.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import tempfile
import threading
import time

from ... import faults, logs
from ...claims import Claim
from ...db import default_db
from ...keys import HashAttributes, sha256
from ...tiers import Hit
from .. import stdlibs
from ..common import inductor_caches_off
from .targets import BACKEND, cxx_identity, host_arch, identity

log = logs.get("kdb")

#: An absolute path in a command's word (``/x``, ``-I/x``, ``-Wl,-rpath=/x``).
_ABSOLUTE = re.compile(r"(?:^|[=,:]|^-[A-Za-z]{1,2})/")

#: Inductor's functions, as they were before :func:`install`.
_original = None
_original_build = None
#: Set on a thread while it runs :func:`build`: its steps are that module's, not entries.
_inside = threading.local()


def install() -> None:
    """Route Inductor's C++ builds through kdb (idempotent)."""
    global _original, _original_build
    from torch._inductor import codecache
    from torch._inductor.cpp_builder import CppBuilder

    if codecache._worker_compile_cpp is not build:
        _original = codecache._worker_compile_cpp
        codecache._worker_compile_cpp = build
    if CppBuilder.build is not build_one:
        _original_build = CppBuilder.build
        CppBuilder.build = build_one


def uninstall() -> None:
    from torch._inductor import codecache
    from torch._inductor.cpp_builder import CppBuilder

    if codecache._worker_compile_cpp is build and _original is not None:
        codecache._worker_compile_cpp = _original
    if CppBuilder.build is build_one and _original_build is not None:
        CppBuilder.build = _original_build


def build(lock_path: str, cpp_builders) -> None:  # mirrors Inductor's _worker_compile_cpp
    """A module (its compile and link steps) from kdb, else built by Inductor and stored.
    ``cpp_builders``: the steps in order (torch 2.8 on), or the one ``CppBuilder`` that
    builds the module (torch 2.7)."""
    def compile_() -> None:
        _inside.on = True
        try:
            _original(lock_path, cpp_builders)
        finally:
            _inside.on = False

    steps = list(cpp_builders) if isinstance(cpp_builders, (list, tuple)) else [cpp_builders]
    target = steps[-1].get_target_file_path()
    attrs = None if os.path.exists(target) or inductor_caches_off() else attrs_for(steps)
    if attrs is None:
        return compile_()
    return _through_kdb(attrs, target, compile_)


def build_one(self) -> None:  # mirrors CppBuilder.build
    """One build outside a module's (Inductor's checks of the CPU's vector ISA, which build
    a test library in every fresh cache directory): from kdb, else built and stored."""
    if getattr(_inside, "on", False):
        return _original_build(self)
    target = self.get_target_file_path()
    attrs = None if os.path.exists(target) or inductor_caches_off() else attrs_for([self])
    if attrs is None:
        return _original_build(self)
    return _through_kdb(attrs, target, lambda: _original_build(self))


def _through_kdb(attrs: HashAttributes, target: str, compile_) -> None:
    """The binary for ``attrs`` written to ``target`` from kdb's tiers, else ``compile_()``
    (one process of many: the others wait for its entry) and stored."""
    tiers = default_db().tiers
    hit = tiers.lookup(attrs)
    claim = None
    if hit is None:
        claimed = tiers.claim_or_wait(attrs)
        hit = claimed if isinstance(claimed, Hit) else None
        claim = claimed if isinstance(claimed, Claim) else None
    if hit is not None and _write(target, _whole(tiers, attrs, hit)):
        return None
    start = time.perf_counter()
    try:
        compile_()
        with open(target, "rb") as f:
            binary = f.read()
    except BaseException:
        if claim is not None:
            claim.release()
        raise
    seconds = time.perf_counter() - start
    rec = tiers.record_compile(attrs, seconds)  # a module holds no compile: all its own
    tiers.storing.put_later(attrs, lambda: binary, compile_seconds=seconds, log=rec, claim=claim,
                            details={"module": os.path.basename(target)})
    return None


def _whole(tiers, attrs: HashAttributes, hit: Hit) -> bytes | None:
    """The served module's bytes if they are a whole shared library, else None: the entry is
    dropped and the module compiled (kdb's checksum catches a damaged frame; this catches a
    module stored cut short, which Inductor would fail to load)."""
    from ..triton.hostmods import whole_elf

    data = bytes(hit.binary)
    if whole_elf(data) or not sys.platform.startswith("linux") and data:
        return data
    tiers.storing.discard(attrs, "not a whole C++ module", hit.tier)
    return None


def attrs_for(cpp_builders) -> HashAttributes | None:
    """The key of a module: every builder's command with this machine's paths replaced, the
    content of each source Inductor wrote, the compiler, the C library it links against (a
    module built on a newer glibc may not load on an older one) and the host CPU's class;
    None when a command names a path kdb cannot place (or a precompiled header: not a
    module)."""
    outputs = {b.get_target_file_path(): f"{{out{i}}}" for i, b in enumerate(cpp_builders)}
    places = _places()
    commands, sources = [], []
    for builder in cpp_builders:
        words = []
        for word in builder.get_command_line().split():
            if word in outputs:
                word = outputs[word]
            elif word.startswith("/") and os.path.isfile(word) and word.endswith((".cpp", ".c")):
                digest = _source_digest(word)
                if digest is None:
                    return None
                sources.append(digest)
                word = f"{{src{len(sources) - 1}}}"
            else:
                for path, name in places:
                    word = word.replace(path, name)
                if _ABSOLUTE.search(word):
                    log.debug("kdb: C++ module not cached: its command names %s", word)
                    return None
            words.append(word)
        commands.append(" ".join(words))
    if not sources or any(o.endswith((".gch", ".i")) for o in outputs) \
            or any(" -E " in c or "c++-header" in c for c in commands):
        return None  # a precompiled header or a preprocessor's output: not a module
    compiler = cpp_builders[0].get_command_line().split()[0]
    return HashAttributes(
        backend=BACKEND, source="\n".join(commands), arch=host_arch(),
        headers=[(f"src{i}", digest) for i, digest in enumerate(sources)],
        compiler=(*identity(), ("cxx", cxx_identity(compiler)), ("libc", stdlibs.libc())),
        name=f"cpp:{os.path.basename(cpp_builders[-1].get_target_file_path())[:13]}")


#: An ``#include`` of a file by its absolute path (torch 2.7's sources name their prefix
#: header in Inductor's cache directory so: another directory on every machine).
_ABSOLUTE_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"(/[^"]+)"', re.M)


def _source_digest(path: str) -> str | None:
    """The digest of a source Inductor wrote: its text with each header it includes by
    absolute path replaced by that header's content digest, so the key holds no directory
    of this machine and still changes with the header; None when such a header cannot be
    read (the module is then built, not cached)."""
    with open(path, "rb") as f:
        text = f.read()

    def by_content(match: re.Match) -> bytes:
        with open(match.group(1), "rb") as header:
            digest = sha256(header.read()).hexdigest()
        return match.group(0).replace(match.group(1), b"{header:" + digest.encode() + b"}")

    try:
        text = _ABSOLUTE_INCLUDE.sub(by_content, text)
    except OSError as err:
        log.debug("kdb: C++ module not cached: a header its source includes: %s", err)
        return None
    return sha256(text).hexdigest()


def _places() -> list[tuple[str, str]]:
    """This machine's paths a command names, longest first, and what each stands for."""
    import torch

    paths = {os.path.dirname(os.path.abspath(torch.__file__)): "{torch}",
             sysconfig.get_paths().get("include", ""): "{python-include}",
             sysconfig.get_config_var("LIBDIR") or "": "{python-lib}",
             sys.prefix: "{prefix}", sys.base_prefix: "{base-prefix}"}
    return sorted(((p, n) for p, n in paths.items() if p and p != "/"),
                  key=lambda item: -len(item[0]))


def _write(target: str, binary: bytes | None) -> bool:
    """The served module where Inductor loads it from (a whole file or none)."""
    if binary is None:
        return False
    try:
        folder = os.path.dirname(target)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kdb-", suffix=".so")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(binary)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
        return True
    except OSError as err:
        faults.fault(f"cannot write Inductor's module {target} ({err}); compiling it",
                     once="torch-cpp-write")
        return False

"""kdb for HIP: code objects built by hipcc or HIPRTC for any ``gfx`` target, no GPU needed.

    import kdb.hip
    co = kdb.hip.compile(source, arch="gfx90a", options=["-DN=64"])    # bytes: an ELF
    co = kdb.hip.compile(source, arch="gfx90a:sramecc+:xnack-", compiler="hiprtc")

Compiling needs hipcc (``apt-get install hipcc``; ``KDB_HIPCC``, else ``$ROCM_PATH/bin``,
else PATH) or HIPRTC (``KDB_HIPRTC``, else ``libamdhip64``); with neither, stored builds are
served (:mod:`kdb.backends.fallback`).
"""

from __future__ import annotations

from .backends.hip import (
    COMPILERS,
    ENV_VARS,
    HipccIdentity,
    HiprtcIdentity,
    attributes_for,
    canonical,
    code_object_target,
    compile,
    compiler_kind,
    compiler_rank,
    find_compiler,
    find_hipcc,
    find_hiprtc,
    identity,
    kernel_names,
    parse_target,
)

__all__ = ["COMPILERS", "ENV_VARS", "HipccIdentity", "HiprtcIdentity", "attributes_for",
           "canonical", "code_object_target", "compile", "compiler_kind", "compiler_rank",
           "find_compiler", "find_hipcc", "find_hiprtc", "identity", "kernel_names",
           "parse_target"]

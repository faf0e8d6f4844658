"""HIP through hipcc or HIPRTC: code objects for any ``gfx`` target ID, served from kdb.

``compile(source, arch="gfx90a")`` returns a code object from the system ``gfx90a.kdb``,
else the user tier, else from the compiler (``hipcc --genco`` in a temporary directory, or
HIPRTC), stored in the background. Neither needs a GPU.

The rooms: :mod:`.targets` reads target IDs and code objects' ELF headers, :mod:`.hipcc`
finds hipcc and works out its identity (:mod:`.hiprtc` the same for HIPRTC), :mod:`.search`
is the include model of their options, :mod:`.keys` checks a request and makes its key,
:mod:`.builds` compiles and serves. This module names them all; it imports only its rooms
and the core below it.
"""

from __future__ import annotations

from .builds import compile
from .hipcc import ENV_VARS, HipccIdentity, find_hipcc, identity
from .hiprtc import HiprtcIdentity, find_hiprtc
from .keys import (
    BACKEND,
    COMPILERS,
    RESERVED_OPTIONS,
    attributes_for,
    compiler_kind,
    compiler_rank,
    find_compiler,
    kernel_names,
    split_options,
)
from .targets import canonical, code_object_target, parse_target

__all__ = ["BACKEND", "COMPILERS", "ENV_VARS", "RESERVED_OPTIONS", "HipccIdentity",
           "HiprtcIdentity", "attributes_for", "canonical", "code_object_target", "compile",
           "compiler_kind", "compiler_rank", "find_compiler", "find_hipcc", "find_hiprtc",
           "identity", "kernel_names", "parse_target", "split_options"]

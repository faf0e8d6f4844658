"""kdb for torch.compile: what Inductor caches, from kdb instead of each node's own directory.

    import kdb.torch
    kdb.torch.install()      # before the first torch.compile'd call

or with no code changed, for a program and every process it starts that has kdb:
``KDB_AUTO=1``, ``kdb run -- CMD`` or ``pytest --kdb``. Needs torch
(``pip install 'kdb[torch]'``); what is stored and keyed how: docs/torch.md.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as _err:  # pragma: no cover - exercised where torch is not installed
    from .errors import BackendUnavailableError

    raise BackendUnavailableError("kdb.torch needs torch: pip install 'kdb[torch]'") from _err

from .backends.torch import BACKEND, CACHES, install, installed, uninstall

__all__ = ["BACKEND", "CACHES", "install", "installed", "uninstall"]

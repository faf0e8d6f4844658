"""What single flight asks of the other nodes' side: the cross-node locks a shared tier keeps.

:func:`kdb.claims.waiting.claim_or_wait` takes this node's claim (a ``flock``), then the
key's cross-node lock from whatever ``shared`` it was given, and judges another node's holder
by what that side reports. :class:`kdb.shared.locks.CrossNodeLocks` (PostgreSQL's advisory
locks, part of :class:`kdb.shared.tier.SharedTier`) is the one implementation; a shared tier
of another kind (an object store with conditional writes) answers the same calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from . import Claim
    from .progress import Sample


@runtime_checkable
class CrossNode(Protocol):
    """The cross-node side of single flight, as :mod:`kdb.claims.waiting` calls it."""

    def try_lock(self, key: str) -> bool | None:
        """Take the key's cross-node compile lock: True (ours), False (another process
        holds it), None (unavailable: compile without it)."""

    def unlock(self, key: str) -> None:
        """Give the lock up (after publishing, or when compiling failed)."""

    def want(self, key: str) -> None:
        """Tell the node that compiles ``key`` that this process waits for it."""

    def unwant(self, key: str) -> None:
        """Stop waiting for ``key``."""

    def wanted(self, key: str) -> bool:
        """Whether a process of another node waits for ``key``, which this process holds."""

    def holder_progress(self, key: str) -> tuple[tuple, Sample | None]:
        """Who holds the key's lock on another node and its progress: ``(ident, sample)``,
        the sample None where the holder reports none."""

    def adopt(self, claim: Claim) -> Claim:
        """Make a local claim also hold, and on release give up, the cross-node lock."""

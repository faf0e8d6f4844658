"""The tier protocol (:class:`kdb.file.rows.Tier`): every tier the lookup walks, a file or the
shared server, answers each operation with the one signature, so ``Tiers`` never asks which
tier it holds. (The answers of a real server: tests/test_shared.py.)"""

from __future__ import annotations

import inspect

import pytest

from kdb.file.kernelfile import KernelFile
from kdb.file.rows import Tier
from kdb.tiers import FileTier

#: The operations of the protocol, as ``Tiers`` calls them.
OPERATIONS = ("describe", "fetch", "signature", "publish", "drop", "touch")


def _shared_tier_class():
    return pytest.importorskip("kdb.shared.tier").SharedTier


def _signature(cls, name: str) -> list[tuple]:
    """What a caller sees of ``cls.name``: each parameter's name, kind, default and annotation,
    then the return annotation. A tier's own row type (``SharedRow``) stands for ``Row``."""
    sig = inspect.signature(getattr(cls, name))

    def text(annotation) -> str:
        return str(annotation).replace("SharedRow", "Row")

    params = [(p.name, p.kind, p.default, text(p.annotation)) for p in sig.parameters.values()]
    return [*params, ("return", text(sig.return_annotation))]


@pytest.mark.parametrize("name", OPERATIONS)
def test_the_file_and_shared_tiers_have_the_protocols_signature(name):
    expected = _signature(Tier, name)
    assert _signature(FileTier, name) == expected
    assert _signature(_shared_tier_class(), name) == expected


def test_a_file_tier_and_a_shared_tier_are_tiers(tmp_path):
    """Neither constructor opens anything: the checks read the classes' members."""
    shared = _shared_tier_class()("postgresql+psycopg://nobody@127.0.0.1:1/none")
    user = FileTier(KernelFile(tmp_path / "a1.kdb", tier="user", readonly=False))
    assert isinstance(user, Tier) and isinstance(shared, Tier)
    assert (user.name, shared.name) == ("user", "shared")
    assert not isinstance(object(), Tier)
    assert set(OPERATIONS) == {n for n in vars(Tier) if not n.startswith("_")} - {"name"}

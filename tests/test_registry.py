"""One registry of back ends (kdb.registry) that every front end reads: a back end registered
here, a package of a few lines and one ``register`` call, appears in ``kdb info``, is packed
by ``kdb pack`` from a manifest, and ``kdb explain`` ranks its compilers with its own
function; the store worker takes jobs only of back ends that say they hand it some; a shared
tier is chosen by its URL's scheme."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from click.testing import CliRunner

from kdb import HashAttributes, KernelDB, registry
from kdb.cli import cli

FAKE = '''
"""A back end of a test: its binary is its source, upper-cased."""
from kdb import HashAttributes


def attrs(source, arch, name, version="1"):
    return HashAttributes(backend="fake", source=source, arch=arch, name=name,
                          compiler={"fakecc": version})


def compile_spec(spec, arch, db):
    db.get_or_compile(attrs(spec.source, arch, spec.name), lambda: spec.source.upper().encode())


def rank(compiler):
    return dict(compiler).get("fakecc", "")
'''


@pytest.fixture
def fake(tmp_path, monkeypatch):
    (tmp_path / "fakebackend.py").write_text(textwrap.dedent(FAKE))
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = registry.register(registry.BackEnd(
        "fake", "fakebackend", "A fake back end", pack="fakebackend",
        compiler_rank="fakebackend:rank"))
    yield entry
    registry.unregister("fake")
    sys.modules.pop("fakebackend", None)


def test_a_registered_back_end_appears_in_kdb_info(fake, cache_dir):
    data = json.loads(CliRunner().invoke(cli, ["info", "--json"]).output)
    rows = {b["name"]: b for b in data["backends"]}
    assert rows["fake"]["label"] == "A fake back end" and rows["fake"]["packs"] is True
    assert {"opencl", "cuda", "triton", "torch"} <= set(rows)
    assert "A fake back end" in CliRunner().invoke(cli, ["info"]).output


def test_a_registered_back_end_is_packed_from_a_manifest(fake, tmp_path, cache_dir):
    manifest = tmp_path / "fake.toml"
    manifest.write_text('[[kernel]]\nname = "shout"\nbackend = "fake"\narches = ["a1"]\n'
                        'source = "hello"\n')
    res = CliRunner().invoke(cli, ["pack", "--arch", "a1", "--manifest", str(manifest),
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    served = KernelDB(cache_dir=tmp_path / "empty", system_path=[tmp_path / "out"])
    import fakebackend

    hit = served.lookup(fakebackend.attrs("hello", "a1", "shout"))
    assert hit is not None and hit.tier == "system" and hit.binary == b"HELLO"
    registry.unregister("fake")  # gone from the registry: a manifest naming it is refused
    bad = CliRunner().invoke(cli, ["pack", "--arch", "a1", "--manifest", str(manifest),
                                   "--out", str(tmp_path / "out2")])
    assert bad.exit_code != 0 and "'fake' is not one kdb packs" in bad.output, bad.output


def test_kdb_explain_ranks_a_registered_back_end_s_compilers_with_its_function(
        fake, cache_dir):
    import fakebackend

    db = KernelDB()
    for version in ("1", "3", "2"):  # one kernel built by three compilers
        db.get_or_compile(fakebackend.attrs("k", "a1", "k", version), lambda: b"K")
    db.close()
    data = json.loads(CliRunner().invoke(cli, ["explain", "k", "--json"]).output)
    assert data["backend"] == "fake"
    # Served where no compiler is installed: the build its rank puts first, fakecc 3.
    assert data["without_compiler"]["served"] == fakebackend.attrs("k", "a1", "k", "3").key


def test_only_back_ends_that_hand_the_worker_jobs_are_its():
    from kdb.storing import jobs

    assert jobs.job_backends() == [b.name for b in registry.backends() if b.stores_jobs]
    with pytest.raises(LookupError, match="no back end 'nosuch'"):
        registry.get("nosuch")


def test_a_shared_tier_is_chosen_by_its_url_s_scheme():
    assert registry.shared_tier_module("postgresql+psycopg://u@h/db") == "kdb.shared.tier"
    assert registry.shared_tier_module("postgres://u@h/db") == "kdb.shared.tier"
    # A scheme with no tier of its own: the default's URL check says what it takes.
    assert registry.shared_tier_module("s3://bucket/kdb") == registry.DEFAULT_SHARED


def test_a_manifest_naming_torch_says_how_a_torch_pack_is_made(tmp_path, cache_dir):
    """torch.compile's entries come from a run (``--from-db``): a manifest naming them said
    "use 'opencl' or 'cuda' ...", or, with a missing file, only that the file was missing."""
    manifest = tmp_path / "torch.toml"
    manifest.write_text('[[kernel]]\nname = "model"\nbackend = "torch"\nfile = "gone.py"\n')
    res = CliRunner().invoke(cli, ["pack", "--arch", "a1", "--manifest", str(manifest),
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code != 0
    assert "--from-db" in res.output and "cannot read" not in res.output, res.output

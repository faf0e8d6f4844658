"""Signed entries on the shared tier, against the real PostgreSQL server: a rogue writer with
write access to the database but no signing key never gets its bytes loaded by a node with
trusted keys (tests/test_signing.py has the key files and the local tiers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest


from kdb import HashAttributes, KernelDB
from kdb.signing import keyfiles
from test_shared import _arch, pg, shared_url  # noqa: F401 - the fixtures, used by name
from test_signing import key_id, keys  # noqa: F401 - the key pairs' fixture

#: Builds and runs ``k<i>(a) { a[i] += ADD }`` for each (name, add) given, on a zeroed buffer;
#: prints what each kernel computed and what this process compiled.
CHILD = textwrap.dedent('''
    import json, sys
    import numpy as np
    import pyopencl as cl
    import kdb.opencl
    from kdb import bookkeeping

    plat = [p for p in cl.get_platforms() if "Portable Computing Language" in p.name][0]
    ctx = cl.Context(plat.get_devices())
    queue = cl.CommandQueue(ctx)
    got = {}
    for name, add in json.loads(sys.argv[1]):
        src = "__kernel void %s(__global float *a) { a[get_global_id(0)] += %d.0f; }" % (name, add)
        prg = kdb.opencl.build(ctx, src, name=name)
        a = np.zeros(4, dtype=np.float32)
        buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=a)
        getattr(prg, name)(queue, a.shape, None, buf)
        cl.enqueue_copy(queue, a, buf)
        got[name] = float(a[0])
    kdb.default_db().flush()
    print(json.dumps({"got": got, "compiled": sorted(r.name for r in bookkeeping.records())}))
''')

KERNELS = [("k0", 1), ("k1", 2), ("k2", 3)]
EVIL = [("k0", 100), ("k1", 100), ("k2", 100)]
HONEST = {"k0": 1.0, "k1": 2.0, "k2": 3.0}


def node(tmp_path: Path, name: str, url: str | None, kernels=KERNELS, **env: str) -> dict:
    full = dict(os.environ, KDB_CACHE_DIR=str(tmp_path / name),
                POCL_CACHE_DIR=str(tmp_path / f"pocl-{name}-{time.monotonic_ns()}"), **env)
    if url is None:
        full.pop("KDB_SHARED_URL", None)
    else:
        full["KDB_SHARED_URL"] = url
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kernels)], env=full,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr"] = proc.stderr
    return out


kid = key_id

def db_of(url: str) -> str:
    return url.rsplit("/", 1)[1]


def test_a_rogue_writer_never_gets_its_bytes_loaded_by_a_node_with_trusted_keys(
        pg, shared_url, keys, tmp_path):
    db = db_of(shared_url)
    trusted = {"KDB_TRUSTED_KEYS": str(keys["ci.pub"])}
    # The CI node signs what it compiles and publishes.
    ci = node(tmp_path, "ci", shared_url, KDB_SIGNING_KEY=str(keys["ci"]), **trusted)
    assert ci["got"] == HONEST and ci["compiled"] == ["k0", "k1", "k2"]
    rows = {r[0]: r[1:] for r in pg.sql("SELECT name, key, signer FROM kernels", db)}
    assert {n: r[1] for n, r in rows.items()} == {n: kid(keys["ci.pub"]) for n in HONEST}

    # The rogue has the database role, not the key. It compiles its own k0..k2 (adding 100)
    # and writes those bytes under the honest keys, three ways.
    evil = node(tmp_path, "evil", None, EVIL)
    assert evil["got"] == {n: 100.0 for n in HONEST}
    import sqlite3

    conn = sqlite3.connect(tmp_path / "evil" / "v1" / f"{_arch()}.kdb")
    planted = {n: r for n, *r in conn.execute(
        "SELECT name, codec, blob, raw_size, stored_size, checksum FROM kernels")}
    conn.close()
    from kdb.signing import policy as signing

    rogue_key, rogue_id = keyfiles.load_private(str(keys["rogue"]))
    rogue = signing.Policy({}, False, rogue_key, rogue_id)
    # k0: overwritten in place, the CI's signature left beside the rogue's bytes.
    codec_, blob, raw_size, stored_size, checksum = planted["k0"]
    pg.sql("UPDATE kernels SET codec=%s, blob=%s, raw_size=%s, stored_size=%s, checksum=%s "
           "WHERE name='k0'", db, (codec_, blob, raw_size, stored_size, checksum))
    # k1: deleted and inserted anew, unsigned.
    codec_, blob, raw_size, stored_size, checksum = planted["k1"]
    pg.sql("UPDATE kernels SET codec=%s, blob=%s, raw_size=%s, stored_size=%s, checksum=%s, "
           "signer=NULL, signature=NULL WHERE name='k1'", db,
           (codec_, blob, raw_size, stored_size, checksum))
    # k2: signed with the rogue's own key, under the CI key's id.
    codec_, blob, raw_size, stored_size, checksum = planted["k2"]
    from kdb.file import compact

    key2, attrs2, source2, body2 = pg.sql(
        "SELECT key, attrs, source, (SELECT body FROM sources WHERE digest = source) "
        "FROM kernels WHERE name='k2'", db)[0]
    attributes2 = compact.unpack(attrs2, source2, body2)
    _, forged = rogue.sign(key2, attributes2, checksum)
    pg.sql("UPDATE kernels SET codec=%s, blob=%s, raw_size=%s, stored_size=%s, checksum=%s, "
           "signer=%s, signature=%s WHERE name='k2'", db,
           (codec_, blob, raw_size, stored_size, checksum, kid(keys["ci.pub"]), forged))

    # Without a trust policy a node runs the rogue's code: the attack is real.
    exposed = node(tmp_path, "exposed", shared_url)
    assert exposed["got"] == {n: 100.0 for n in HONEST} and exposed["compiled"] == []

    # With the CI's key trusted, a node compiles instead, and computes the right thing.
    guarded = node(tmp_path, "guarded", shared_url, **trusted)
    assert guarded["got"] == HONEST
    assert guarded["compiled"] == ["k0", "k1", "k2"]
    err = guarded["stderr"]
    assert "is not the one its signer" in err or "does not verify" in err  # k0
    assert "it is not signed" in err  # k1
    assert f"does not verify against the trusted key {kid(keys['ci.pub'])}" in err  # k2

    # A node that signs replaces the rows no trusted key vouches for; the next node with
    # the policy is served from the shared tier again and compiles nothing.
    both = {"KDB_TRUSTED_KEYS": f"{keys['ci.pub']}{os.pathsep}{keys['other.pub']}"}
    mender = node(tmp_path, "mender", shared_url, KDB_SIGNING_KEY=str(keys["other"]), **both)
    assert mender["got"] == HONEST
    signers = {r[0]: r[1] for r in pg.sql("SELECT name, signer FROM kernels", db)}
    assert signers == {n: kid(keys["other.pub"]) for n in HONEST}
    fresh = node(tmp_path, "fresh", shared_url, **both)
    assert fresh["got"] == HONEST and fresh["compiled"] == []
    assert "not served" not in fresh["stderr"]


def _attrs(i: int) -> HashAttributes:
    return HashAttributes(backend="test", source=f"shared signed {i}", arch="st1", name=f"s{i}")


def _publish_k0(tmp_path: Path) -> None:
    """A node compiles s0 (signed if KDB_SIGNING_KEY is set) and publishes it."""
    from kdb.storing import background

    writer = KernelDB(cache_dir=tmp_path / "writer")
    writer.get_or_compile(_attrs(0), lambda: b"binary 0" * 50)
    writer.close()
    background.drain()


def test_a_tampered_shared_entry_is_dropped_and_a_revoked_signer_is_left_alone(
        pg, shared_url, keys, tmp_path, monkeypatch, caplog):
    import logging

    import kdb.shared.tier
    from kdb.storing import background

    db = db_of(shared_url)
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["ci"]))
    writer = KernelDB(cache_dir=tmp_path / "writer")
    for i in range(2):
        writer.get_or_compile(_attrs(i), lambda i=i: b"binary %d" % i * 50)
    writer.close()
    background.drain()
    monkeypatch.delenv("KDB_SIGNING_KEY")
    assert len(pg.sql("SELECT key FROM kernels WHERE signer IS NOT NULL", db)) == 2
    sig = pg.sql("SELECT signature FROM kernels WHERE name='s0'", db)[0][0]
    pg.sql("UPDATE kernels SET signature=%s WHERE name='s0'", db, (bytes([sig[0] ^ 1]) + sig[1:],))

    # The CI key revoked (only "other" trusted): s1 is refused and left for others.
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["other.pub"]))
    kdb.shared.tier.reset()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert KernelDB(cache_dir=tmp_path / "revoked").lookup(_attrs(1)) is None
    background.drain()
    assert f"its signer {kid(keys['ci.pub'])} is not in KDB_TRUSTED_KEYS" in caplog.text
    assert pg.sql("SELECT count(*) FROM kernels WHERE name='s1'", db) == [(1,)]

    # Trusted again: the tampered s0 is refused and dropped; s1 is served.
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    reader = KernelDB(cache_dir=tmp_path / "reader")
    assert reader.lookup(_attrs(0)) is None
    assert reader.lookup(_attrs(1)).tier == "shared"
    reader.close()
    background.drain()
    assert [r[0] for r in pg.sql("SELECT name FROM kernels ORDER BY name", db)] == ["s1"]
    # The copy in the reader's user tier keeps the CI's signature: served under
    # KDB_REQUIRE_SIGNED too, with no signing key of the reader's own.
    monkeypatch.setenv("KDB_REQUIRE_SIGNED", "1")
    monkeypatch.delenv("KDB_SHARED_URL")
    assert KernelDB(cache_dir=tmp_path / "reader").lookup(_attrs(1)).tier == "user"


@pytest.mark.parametrize("rogue_sql", [
    "UPDATE kernels SET signature = ''::bytea",  # the trusted id, an empty signature
    "UPDATE kernels SET signer = NULL",  # the signature kept, no signer
])
def test_a_row_with_an_empty_signature_or_no_signer_is_replaced_by_a_signing_node(
        pg, shared_url, keys, tmp_path, monkeypatch, rogue_sql):
    from kdb.storing import background

    db = db_of(shared_url)
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["ci"]))
    _publish_k0(tmp_path)
    pg.sql(rogue_sql, db)
    node = KernelDB(cache_dir=tmp_path / "node")
    assert node.lookup(_attrs(0)) is None  # refused: unsigned
    assert node.get_or_compile(_attrs(0), lambda: b"binary 0" * 50) == b"binary 0" * 50
    node.close()
    background.drain()
    assert pg.sql("SELECT signer, length(signature) FROM kernels", db) == [
        (kid(keys["ci.pub"]), 64)]  # replaced by the node's signed build
    fresh = KernelDB(cache_dir=tmp_path / "fresh")
    assert fresh.lookup(_attrs(0)).tier == "shared"
    fresh.close()


@pytest.mark.parametrize("ddl", [
    "ALTER TABLE kernels ALTER COLUMN signature TYPE text USING encode(signature, 'hex')",
    "ALTER TABLE kernels ALTER COLUMN details DROP DEFAULT, "
    "ALTER COLUMN details TYPE integer USING 1",
])
def test_a_column_changed_to_another_type_is_a_miss_not_an_error(
        pg, shared_url, keys, tmp_path, monkeypatch, ddl):
    """Whoever holds the tables' role can change a column's type: a lookup misses (and the
    process compiles), under a trust policy or not."""
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["ci"]))
    _publish_k0(tmp_path)
    pg.sql(ddl, db_of(shared_url))
    for policy in ("", str(keys["ci.pub"])):
        monkeypatch.setenv("KDB_TRUSTED_KEYS", policy)
        reader = KernelDB(cache_dir=tmp_path / f"reader{len(policy)}")
        assert reader.lookup(_attrs(0)) is None
        reader.close()


def test_a_signing_node_never_replaces_a_row_another_trusted_signer_wrote(
        pg, shared_url, keys, tmp_path, monkeypatch):
    """Two signers that do not trust each other leave each other's rows alone."""
    from kdb.storing import background

    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["ci"]))
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    _publish_k0(tmp_path)
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["other"]))
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["other.pub"]))
    node = KernelDB(cache_dir=tmp_path / "node")
    assert node.get_or_compile(_attrs(0), lambda: b"binary 0" * 50) == b"binary 0" * 50
    node.close()
    background.drain()
    rows = pg.sql("SELECT key, signer FROM kernels ORDER BY key", db_of(shared_url))
    key = _attrs(0).key  # the first signer's row stays; the second's goes beside it
    assert rows == [(key, kid(keys["ci.pub"])), (f"{key}@{kid(keys['other.pub'])}",
                                                 kid(keys["other.pub"]))]
    for private, public in (("ci", "ci.pub"), ("other", "other.pub")):
        monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys[public]))
        monkeypatch.setenv("KDB_SIGNING_KEY", str(keys[private]))
        fresh = KernelDB(cache_dir=tmp_path / f"fresh-{private}")
        assert fresh.lookup(_attrs(0)).tier == "shared"  # each signer's nodes served
        fresh.close()
    background.drain()
    assert pg.sql("SELECT key, signer FROM kernels ORDER BY key", db_of(shared_url)) == rows


def test_a_row_signed_by_a_key_nobody_trusts_never_keeps_the_tier_useless(
        pg, shared_url, keys, tmp_path):
    """A rogue with the database role signs its rows with a key of its own: nodes that
    trust the CI's key refuse them, the CI's signing node publishes its build beside them,
    and from then on every node that trusts the CI is served from the shared tier (it
    compiled on every new node, for ever). The rogue's rows are left to whoever trusts them."""
    db = db_of(shared_url)
    # The rogue's rows under the kernels' keys (its bytes do not matter: refused unread).
    rogue = node(tmp_path, "rogue", shared_url, KDB_SIGNING_KEY=str(keys["rogue"]))
    assert rogue["compiled"] == ["k0", "k1", "k2"]
    trusted = {"KDB_TRUSTED_KEYS": str(keys["ci.pub"])}
    ci = node(tmp_path, "ci", shared_url, KDB_SIGNING_KEY=str(keys["ci"]), **trusted)
    assert ci["got"] == HONEST and ci["compiled"] == ["k0", "k1", "k2"]
    fresh = node(tmp_path, "fresh", shared_url, **trusted)
    assert fresh["got"] == HONEST and fresh["compiled"] == [], fresh["stderr"]
    signers = sorted(r[0] for r in pg.sql("SELECT signer FROM kernels", db))
    assert signers == sorted([kid(keys["rogue.pub"])] * 3 + [kid(keys["ci.pub"])] * 3)

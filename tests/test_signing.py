"""Signed entries (kdb.signing): key files, the trust policy on the system and user tiers,
`kdb pack --sign`, `kdb verify`. The shared tier's rogue-writer tests are in
tests/test_shared_trust.py (they need the PostgreSQL server)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdb import HashAttributes, KernelDB, bookkeeping
from kdb.cli import cli
from kdb.file import codec
from kdb.pack.systemfile import write_system_db
from kdb.signing import keyfiles, policy as signing
from conftest import attributes_of

ARCH = "sig1"


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def attrs(i: int, arch: str = ARCH) -> HashAttributes:
    return HashAttributes(backend="test", source=f"signed kernel {i}", arch=arch, name=f"k{i}")


def binary(i: int) -> bytes:
    return (f"kernel {i} binary ".encode() * 64) + bytes([i % 256])


@pytest.fixture
def keys(tmp_path) -> dict[str, Path]:
    """Three key pairs: the CI's, a second trusted signer's, and a rogue's (never trusted)."""
    d = tmp_path / "keys"
    d.mkdir()
    out = {}
    for who in ("ci", "other", "rogue"):
        keyfiles.generate(str(d / f"{who}.pem"), str(d / f"{who}.pub.pem"))
        out[who] = d / f"{who}.pem"
        out[who + ".pub"] = d / f"{who}.pub.pem"
    return out


def key_id(public: Path) -> str:
    return keyfiles.key_id(keyfiles.public_raw_from_pem(public.read_bytes(), str(public)))


def signer(private: Path) -> signing.Policy:
    key, kid = keyfiles.load_private(str(private))
    return signing.Policy({}, False, key, kid)


def user_file_with(cache: Path, n: int = 3, arch: str = ARCH) -> Path:
    """A user file holding ``n`` entries, stored the way a program stores them."""
    db = KernelDB(cache_dir=cache)
    for i in range(n):
        db.put(attrs(i, arch), binary(i))
    db.close()
    return cache / "v1" / f"{arch}.kdb"


def system_dir_with(tmp_path: Path, src: Path, name: str, sign=None, arch: str = ARCH) -> Path:
    d = tmp_path / name
    write_system_db(d / f"{arch}.kdb", arch, [src], sign=sign)
    return d


def served_from(tmp_path: Path, system: Path, i: int = 0):
    """What a fresh KernelDB with only ``system`` behind an empty user tier serves for k<i>."""
    db = KernelDB(cache_dir=tmp_path / f"reader-{os.urandom(4).hex()}", system_path=[system])
    try:
        hit = db.lookup(attrs(i))
        return hit.tier if hit is not None else None
    finally:
        db.close()


def tamper(path: Path, sql: str, params=()) -> None:
    path.chmod(0o644)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(sql, params)
    conn.close()


# -- key files -------------------------------------------------------------------------------

def test_key_gen_writes_a_private_key_only_its_owner_reads_and_its_public_key(tmp_path):
    result = invoke("key", "gen", tmp_path / "ci.pem")
    assert result.exit_code == 0, result.output
    private, public = tmp_path / "ci.pem", tmp_path / "ci.pub.pem"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----")
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    kid = invoke("key", "id", public).output.strip()
    assert kid == invoke("key", "id", private).output.strip() and len(kid) == 16
    assert kid in result.output
    again = invoke("key", "gen", tmp_path / "ci.pem")
    assert again.exit_code == 1 and "never overwrites" in again.output
    assert invoke("key", "id", public).output.strip() == kid  # untouched


def test_keys_made_by_openssl_sign_and_verify(tmp_path, cache_dir, monkeypatch):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl on PATH")
    private, public = tmp_path / "o.pem", tmp_path / "o.pub"
    subprocess.run([openssl, "genpkey", "-algorithm", "ed25519", "-out", private], check=True)
    private.chmod(0o600)
    subprocess.run([openssl, "pkey", "-in", private, "-pubout", "-out", public], check=True)
    assert invoke("key", "id", private).output == invoke("key", "id", public).output
    monkeypatch.setenv("KDB_SIGNING_KEY", str(private))
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(public))
    monkeypatch.setenv("KDB_REQUIRE_SIGNED", "1")
    user_file_with(cache_dir, 1)
    assert KernelDB().lookup(attrs(0)).tier == "user"
    kid = invoke("key", "id", public).output.strip()
    [(who,)] = sqlite3.connect(cache_dir / "v1" / f"{ARCH}.kdb").execute(
        "SELECT signer FROM kernels").fetchall()
    assert who == kid


def test_a_private_key_group_or_others_can_read_is_refused(keys, tmp_path, cache_dir,
                                                           monkeypatch, caplog):
    keys["ci"].chmod(0o644)
    result = invoke("pack", "--arch", ARCH, "--from-db", user_file_with(cache_dir, 1),
                    "--sign", keys["ci"], "--out", tmp_path / "out")
    assert result.exit_code == 1
    assert "accessible by group or others" in result.output and "chmod 600" in result.output
    assert not (tmp_path / "out" / f"{ARCH}.kdb").exists()
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["ci"]))
    info = invoke("info")
    assert info.exit_code == 2 and "KDB_SIGNING_KEY" in info.output and "chmod 600" in info.output
    # A program warns once and stores unsigned (never with a key others may have read).
    with caplog.at_level(logging.WARNING, logger="kdb"):
        db = KernelDB()
        db.put(attrs(7), binary(7))
        db.close()
    assert "chmod 600" in caplog.text
    row = sqlite3.connect(cache_dir / "v1" / f"{ARCH}.kdb").execute(
        "SELECT signer, signature FROM kernels WHERE name = 'k7'").fetchone()
    assert row == (None, None)


def test_a_key_that_is_not_ed25519_is_a_clear_error(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    pub = tmp_path / "ec.pub"
    pub.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    result = invoke("key", "id", pub)
    assert result.exit_code == 1 and "not an Ed25519 key" in result.output
    junk = tmp_path / "junk.pub"
    junk.write_text("hello")
    result = invoke("key", "id", junk)
    assert result.exit_code == 1 and "not a PEM public key" in result.output


def test_a_trusted_key_file_others_can_write_is_not_trusted(keys, tmp_path, cache_dir,
                                                            monkeypatch, caplog):
    system = system_dir_with(tmp_path, user_file_with(tmp_path / "build", 1), "sys",
                             sign=signer(keys["ci"]))
    keys["ci.pub"].chmod(0o666)
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert served_from(tmp_path, system) is None
    assert "can make this node trust their own key" in caplog.text
    assert "no usable trusted key" in caplog.text
    keys["ci.pub"].chmod(0o644)
    signing.reset()  # trusted keys are read once per process (and when a variable changes)
    assert served_from(tmp_path, system) == "system"


def test_a_trusted_key_linked_from_a_directory_others_can_write_is_not_trusted(keys, tmp_path):
    """The check follows the link: a key in a directory others can write could be swapped
    for theirs, whatever directory the link itself is in."""
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)
    shutil.copy(keys["ci.pub"], world / "ci.pub")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "ci.pub").symlink_to(world / "ci.pub")
    [problem] = signing.problems({"KDB_TRUSTED_KEYS": str(trusted)})
    assert f"(its directory {world})" in problem and "group or others can write it" in problem
    world.chmod(0o755)
    assert signing.problems({"KDB_TRUSTED_KEYS": str(trusted)}) == []


def test_a_link_on_the_way_to_a_trusted_key_in_a_directory_others_can_write_is_refused(
        keys, tmp_path):
    """A hop through a directory others can write: they could re-point it at any key."""
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)
    (world / "hop.pub").symlink_to(keys["ci.pub"])  # the key itself is in a safe directory
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / "ci.pub").symlink_to(world / "hop.pub")
    [problem] = signing.problems({"KDB_TRUSTED_KEYS": str(trusted / "ci.pub")})
    assert f"(its directory {world})" in problem


def test_a_fifo_named_as_a_trusted_key_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "ci.pub"
    os.mkfifo(fifo)
    [problem] = signing.problems({"KDB_TRUSTED_KEYS": str(fifo)})
    assert "not a regular file" in problem


def test_a_malformed_signer_id_is_shown_quoted_and_cut(keys, tmp_path, monkeypatch, caplog):
    policy = signing.Policy({}, False)
    with caplog.at_level(logging.WARNING, logger="kdb"):
        for n in range(3):
            policy.refused("shared", "db", "k" * 64, "k", signing.UNKNOWN_SIGNER,
                           f"{n}\nkdb: all verified \x1b[8m" + "x" * 1000)
    [record] = [r for r in caplog.records if "not served" in r.getMessage()]
    assert "\n" not in record.getMessage() and "\x1b" not in record.getMessage()
    assert len(record.getMessage()) < 600


# -- the policy on the system tier -----------------------------------------------------------

def test_a_signed_system_file_is_served_under_the_policy_and_an_unsigned_one_is_not(
        keys, tmp_path, monkeypatch, caplog):
    src = user_file_with(tmp_path / "build", 3)
    signed = system_dir_with(tmp_path, src, "signed", sign=signer(keys["ci"]))
    unsigned = system_dir_with(tmp_path, src, "unsigned")
    assert served_from(tmp_path, unsigned) == "system"  # no policy: as before
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    assert served_from(tmp_path, signed) == "system"
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert served_from(tmp_path, unsigned) is None
        assert served_from(tmp_path, unsigned, 1) is None
    refusals = [r.getMessage() for r in caplog.records if "is not served" in r.getMessage()]
    assert len(refusals) == 1 and "it is not signed" in refusals[0]  # once per cause


def test_a_missing_signature_makes_the_kernel_compile_and_the_result_is_the_compiled_one(
        keys, tmp_path, monkeypatch):
    src = user_file_with(tmp_path / "build", 1)
    unsigned = system_dir_with(tmp_path, src, "unsigned")
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    db = KernelDB(cache_dir=tmp_path / "node", system_path=[unsigned])
    got = db.get_or_compile(attrs(0), lambda: b"compiled here")
    db.close()
    assert got == b"compiled here"
    assert [r.name for r in bookkeeping.records()] == ["k0"]


def test_pack_sign_is_reproducible_and_verify_checks_signatures(keys, tmp_path, monkeypatch):
    src = user_file_with(tmp_path / "build", 3)
    a = invoke("pack", "--arch", ARCH, "--from-db", src, "--sign", keys["ci"], "--out",
               tmp_path / "a")
    b = invoke("pack", "--arch", ARCH, "--from-db", src, "--sign", keys["ci"], "--out",
               tmp_path / "b")
    assert a.exit_code == 0 and b.exit_code == 0, a.output
    assert f"signed by key {key_id(keys['ci.pub'])}" in a.output
    assert (tmp_path / "a" / f"{ARCH}.kdb").read_bytes() == \
        (tmp_path / "b" / f"{ARCH}.kdb").read_bytes()  # Ed25519 is deterministic
    unsigned = system_dir_with(tmp_path, src, "unsigned")
    monkeypatch.setenv("KDB_SYSTEM_DB_PATH", f"{tmp_path / 'a'}{os.pathsep}{unsigned}")
    monkeypatch.setenv("KDB_CACHE_DIR", str(tmp_path / "cache"))
    plain = invoke("verify", "--arch", ARCH)
    assert plain.exit_code == 0, plain.output  # no policy: signatures are reported, not checked
    assert f"3 by key {key_id(keys['ci.pub'])}" in plain.output and "not checked" in plain.output
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    shown = invoke("info")
    assert f"system, shared tier(s) must verify; trusted keys: {key_id(keys['ci.pub'])}" in \
        shown.output
    checked = invoke("verify", "--arch", ARCH)
    assert checked.exit_code == 1
    ok, bad = [line for line in checked.output.splitlines() if line.startswith(("ok", "BAD"))]
    assert ok.startswith("ok") and str(tmp_path / "a") in ok
    assert bad.startswith("BAD") and str(unsigned) in bad
    assert "not served under the trust policy: unsigned" in checked.output


def test_a_revoked_key_a_tampered_signature_a_colliding_key_id_and_a_swapped_binary(
        keys, tmp_path, monkeypatch, caplog):
    src = user_file_with(tmp_path / "build", 4)
    ci_id = key_id(keys["ci.pub"])

    def signed_copy(name: str) -> Path:
        return system_dir_with(tmp_path, src, name, sign=signer(keys["ci"]))

    # Revoked: the ci key is no longer listed; the other trusted key does not vouch.
    revoked = signed_copy("revoked")
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["other.pub"]))
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert served_from(tmp_path, revoked) is None
    assert f"its signer {ci_id} is not in KDB_TRUSTED_KEYS" in caplog.text
    monkeypatch.setenv("KDB_TRUSTED_KEYS", f"{keys['other.pub']}{os.pathsep}{keys['ci.pub']}")
    assert served_from(tmp_path, revoked) == "system"

    # A signature with one byte flipped.
    flipped = signed_copy("flipped")
    f = flipped / f"{ARCH}.kdb"
    sig = sqlite3.connect(f).execute("SELECT signature FROM kernels WHERE name='k0'").fetchone()[0]
    tamper(f, "UPDATE kernels SET signature = ? WHERE name = 'k0'",
           (bytes([sig[0] ^ 1]) + sig[1:],))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert served_from(tmp_path, flipped) is None
        assert served_from(tmp_path, flipped, 1) == "system"  # the others still verify
    assert f"its signature does not verify against the trusted key {ci_id}" in caplog.text

    # The rogue signs with its own key and labels the signature with the ci key's id.
    collide = signed_copy("collide")
    f = collide / f"{ARCH}.kdb"
    [(key, _, attributes)] = attributes_of(f, "name = 'k1'")
    [(checksum,)] = sqlite3.connect(f).execute(
        "SELECT checksum FROM kernels WHERE name='k1'").fetchall()
    _, forged = signer(keys["rogue"]).sign(key, attributes, checksum)
    tamper(f, "UPDATE kernels SET signer = ?, signature = ? WHERE key = ?", (ci_id, forged, key))
    assert served_from(tmp_path, collide, 1) is None
    assert served_from(tmp_path, collide, 2) == "system"

    # The rogue swaps the binary for its own and keeps the signed checksum: zstd's own frame
    # checksum passes, the signed sha256 does not.
    swapped = signed_copy("swapped")
    f = swapped / f"{ARCH}.kdb"
    evil = b"evil" * 300
    kind, blob = codec.encode(evil)
    tamper(f, "UPDATE kernels SET codec = ?, blob = ?, raw_size = ?, stored_size = ? "
              "WHERE name = 'k2'", (kind, blob, len(evil), len(blob)))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert served_from(tmp_path, swapped, 2) is None
    assert "its binary is not the one its signer" in caplog.text
    # ... and with the checksum changed to match, the signature no longer verifies.
    tamper(f, "UPDATE kernels SET checksum = ? WHERE name = 'k2'", (codec.checksum(evil),))
    assert served_from(tmp_path, swapped, 2) is None


def test_a_signature_column_of_another_type_counts_as_unsigned_and_a_pack_leaves_it_out(
        keys, tmp_path, monkeypatch):
    """SQLite columns are typed by the row: a damaged source whose signature holds text is
    not a crash of `kdb pack --sign`, and not a verified entry."""
    src = user_file_with(tmp_path / "build", 2)
    [(key, _, attributes)] = attributes_of(src, "name = 'k0'")
    [(checksum,)] = sqlite3.connect(src).execute(
        "SELECT checksum FROM kernels WHERE name = 'k0'").fetchall()
    who, sig = signer(keys["ci"]).sign(key, attributes, checksum)
    conn = sqlite3.connect(src)
    with conn:
        conn.execute("UPDATE kernels SET signer = ?, signature = ? WHERE key = ?",
                     (who, sig.hex(), key))
    conn.close()
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    result = invoke("pack", "--arch", ARCH, "--from-db", src, "--sign", keys["ci"], "--out",
                    tmp_path / "out")
    assert result.exit_code == 1 and "no kernel for arch" in result.output  # k1 unsigned too
    policy = signing.current()
    assert policy.check(key, attributes, binary(0), checksum, who, sig.hex()) == signing.UNSIGNED
    assert policy.check(key, attributes, binary(0), checksum, 7, sig) == signing.UNSIGNED


def test_two_trusted_keys_sharing_an_id_are_both_tried(keys):
    """A key id is a label: where two trusted keys carry the same one, a signature by either
    verifies, and one by neither does not."""
    ci = signer(keys["ci"])
    other_raw = keyfiles.public_raw_from_pem(keys["other.pub"].read_bytes(), "other")
    ci_raw = keyfiles.public_raw_from_pem(keys["ci.pub"].read_bytes(), "ci")
    both = signing.Policy({ci.signer_id: [other_raw, ci_raw]}, False)
    checksum = signing.digest(b"bin")
    who, sig = ci.sign("key", "{}", checksum)
    assert both.check("key", "{}", b"bin", checksum, who, sig) is None
    _, forged = signer(keys["rogue"]).sign("key", "{}", checksum)
    assert both.check("key", "{}", b"bin", checksum, who, forged) == signing.BAD_SIGNATURE


def test_pack_from_a_database_under_a_policy_signs_only_what_a_trusted_key_vouches_for(
        keys, tmp_path, monkeypatch):
    mixed = tmp_path / "mixed"
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["other"]))
    user_file_with(mixed, 2)  # k0, k1 signed by "other"
    monkeypatch.delenv("KDB_SIGNING_KEY")
    db = KernelDB(cache_dir=mixed)
    db.put(attrs(5), binary(5))  # unsigned
    db.close()
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["other.pub"]))
    result = invoke("pack", "--arch", ARCH, "--from-db", mixed, "--sign", keys["ci"], "--out",
                    tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "1 copied entries were left out" in result.output and "k5" in result.output
    conn = sqlite3.connect(tmp_path / "out" / f"{ARCH}.kdb")
    rows = conn.execute("SELECT name, signer FROM kernels ORDER BY name").fetchall()
    assert rows == [("k0", key_id(keys["ci.pub"])), ("k1", key_id(keys["ci.pub"]))]


def test_a_logged_kernel_left_out_for_want_of_a_trusted_key_is_not_called_missing(
        keys, tmp_path, monkeypatch):
    """``--from-log`` under a policy named the refused entries twice: left out for want of a
    trusted key (right), and "logged kernel(s) have no stored binary" (wrong)."""
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["other"]))
    signed = user_file_with(tmp_path / "signed", 1)  # k0, signed by "other"
    monkeypatch.delenv("KDB_SIGNING_KEY")
    db = KernelDB(cache_dir=tmp_path / "signed")
    db.put(attrs(1), binary(1))  # k1, unsigned: refused
    db.close()
    trusted = signing.Policy({key_id(keys["other.pub"]): [keyfiles.public_raw_from_pem(
        keys["other.pub"].read_bytes(), str(keys["other.pub"]))]}, False)
    result = write_system_db(tmp_path / "out" / f"{ARCH}.kdb", ARCH, [signed],
                             {attrs(0).key, attrs(1).key, "f" * 64},
                             sign=signer(keys["ci"]), vouch=trusted)
    assert [name for name, _ in result.refused] == ["k1"]
    assert result.missing == ["f" * 64] and result.entries == 1


# -- the user tier ---------------------------------------------------------------------------

def test_require_signed_serves_what_this_process_signed_and_not_an_unsigned_entry(
        keys, cache_dir, monkeypatch, caplog):
    user_file_with(cache_dir, 1)  # stored unsigned, before any policy
    assert KernelDB().lookup(attrs(0)).tier == "user"
    monkeypatch.setenv("KDB_TRUSTED_KEYS", str(keys["ci.pub"]))
    assert KernelDB().lookup(attrs(0)).tier == "user"  # the user tier is not covered yet
    monkeypatch.setenv("KDB_REQUIRE_SIGNED", "1")
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert KernelDB().lookup(attrs(0)) is None
    assert "in the user tier" in caplog.text and "it is not signed" in caplog.text
    monkeypatch.setenv("KDB_SIGNING_KEY", str(keys["other"]))  # its own key is trusted too
    db = KernelDB()
    assert db.get_or_compile(attrs(0), lambda: binary(0)) == binary(0)
    db.close()
    assert KernelDB().lookup(attrs(0)).tier == "user"


def test_a_bad_require_signed_value_is_refused_by_commands_and_means_required(
        keys, cache_dir, monkeypatch, caplog):
    user_file_with(cache_dir, 1)
    monkeypatch.setenv("KDB_REQUIRE_SIGNED", "maybe")
    result = invoke("info")
    assert result.exit_code == 2 and "KDB_REQUIRE_SIGNED" in result.output
    with caplog.at_level(logging.WARNING, logger="kdb"):
        assert KernelDB().lookup(attrs(0)) is None  # the safe side: required
    assert "KDB_REQUIRE_SIGNED" in caplog.text


def test_without_a_policy_a_hit_never_imports_cryptography(keys, cache_dir, run_py):
    user_file_with(cache_dir, 1)
    code = f"""
        import sys
        from kdb import HashAttributes, KernelDB
        hit = KernelDB().lookup(HashAttributes(backend="test", source="signed kernel 0",
                                               arch={ARCH!r}, name="k0"))
        print(hit.tier, any(m.startswith("cryptography") for m in sys.modules))
    """
    assert run_py(code).stdout.split() == ["user", "False"]
    # Trusted keys set, a user-tier hit: the user tier is not covered, nothing is verified.
    trusted = run_py(code, env={"KDB_TRUSTED_KEYS": str(keys["ci.pub"])})
    assert trusted.stdout.split() == ["user", "False"]


def test_opencl_stores_are_signed_with_the_programs_key_given_as_a_relative_path(
        keys, cache_dir, tmp_path, run_py):
    """OpenCL stores (handed to the store worker, which runs in /, with the program's
    variables made absolute) are signed with the program's KDB_SIGNING_KEY, so the next start
    under KDB_REQUIRE_SIGNED compiles nothing."""
    pytest.importorskip("pyopencl")
    from test_spool import BUILD, stored, wait_for_worker

    code = f"import os; os.chdir({str(keys['ci'].parent)!r})\n" + textwrap.dedent(BUILD.format(n=2))
    env = {"KDB_STORE_AT_EXIT": "detach", "KDB_SIGNING_KEY": "ci.pem",
           "KDB_TRUSTED_KEYS": "ci.pub.pem", "KDB_REQUIRE_SIGNED": "1"}
    first = json.loads(run_py(code, env=env).stdout.splitlines()[-1])
    assert first["compiles"] == 2
    wait_for_worker(cache_dir)
    assert stored(cache_dir) == 2
    again = run_py(code, env=env)
    assert json.loads(again.stdout.splitlines()[-1])["compiles"] == 0, again.stderr
    log = cache_dir / "v1" / "store-worker.log"
    assert "signing" not in log.read_text()


def test_a_process_whose_signing_key_is_refused_never_replaces_a_signed_entry(
        keys, cache_dir, run_py):
    """Under KDB_REQUIRE_SIGNED=1 a process whose key file is refused (others can read it)
    trusts nothing, compiles, and stores its build unsigned: the signed entry stays, and a
    process with the key in order is served it again."""
    code = f"""
        import json
        from kdb import HashAttributes, KernelDB, bookkeeping
        db = KernelDB()
        a = HashAttributes(backend="test", source="signed kernel 0", arch={ARCH!r}, name="k0")
        assert db.get_or_compile(a, lambda: b"compiled here" * 64) == b"compiled here" * 64
        db.close()
        print(json.dumps(len(bookkeeping.records())))
    """
    env = {"KDB_SIGNING_KEY": str(keys["ci"]), "KDB_REQUIRE_SIGNED": "1"}
    assert run_py(code, env=env).stdout.split()[-1] == "1"
    user = cache_dir / "v1" / f"{ARCH}.kdb"
    signed = sqlite3.connect(user).execute("SELECT signer, signature FROM kernels").fetchall()
    assert signed[0][0] == key_id(keys["ci.pub"]) and len(signed[0][1]) == 64
    os.chmod(keys["ci"], 0o644)
    refused = run_py(code, env=env)
    assert refused.stdout.split()[-1] == "1", refused.stderr  # compiled: it trusts nothing
    assert "nothing this process stores is signed" in refused.stderr
    rows = sqlite3.connect(user).execute("SELECT signer, signature FROM kernels").fetchall()
    assert rows == signed
    os.chmod(keys["ci"], 0o600)
    assert run_py(code, env=env).stdout.split()[-1] == "0"  # served, signed, from the user tier

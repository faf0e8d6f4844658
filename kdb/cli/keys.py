"""``kdb key``: make and inspect the Ed25519 keys that sign entries (:mod:`kdb.signing`)."""

from __future__ import annotations

from pathlib import Path

import click

from .tools import emit_json, json_option


@click.group("key")
def key() -> None:
    """Signing keys: `kdb key gen` makes a pair, `kdb key id` names one.

    A writer (a CI job, `kdb pack --sign`, a node with KDB_SIGNING_KEY) signs what it stores
    with its private key; readers list the public keys they trust in KDB_TRUSTED_KEYS. The
    files are standard PEM: `openssl genpkey -algorithm ed25519 -out KEY` and
    `openssl pkey -in KEY -pubout -out KEY.pub` make the same.

    \b
    Example:
        kdb key gen ci-signing.pem
        kdb key id ci-signing.pub.pem
    """


def _public_path(private: Path) -> Path:
    """``ci.pem`` -> ``ci.pub.pem``; ``ci`` -> ``ci.pub``."""
    if private.suffix == ".pem":
        return private.with_suffix(".pub.pem")
    return private.with_name(private.name + ".pub")


@key.command("gen")
@click.argument("private", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--public", "public", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Where the public key goes (default: PRIVATE with .pub).")
@click.option("--force", is_flag=True, help="Overwrite existing key files.")
@json_option
def gen(private: Path, public: Path | None, force: bool, as_json: bool) -> None:
    """Write a new Ed25519 key pair: PRIVATE (mode 600) and its public key (644).

    Keep the private key where only the signer can read it; copy the public key to every
    reader and list it (or its directory) in KDB_TRUSTED_KEYS. A directory of trusted keys
    should hold public keys only.

    \b
    Example:
        kdb key gen ci-signing.pem        # writes ci-signing.pem and ci-signing.pub.pem
    """
    from ..signing import keyfiles

    public = public or _public_path(private)
    for path, hint in ((private, "PRIVATE"), (public, "--public")):
        if not path.resolve().parent.is_dir():
            raise click.BadParameter(f"{path.resolve().parent} is not a directory: make it "
                                     "first", param_hint=hint)
    key_id = keyfiles.generate(str(private), str(public), force=force)
    if as_json:
        emit_json({"private": str(private), "public": str(public), "key_id": key_id})
        return
    click.echo(f"key {key_id}: private {private} (keep it secret), public {public}")
    click.echo(f"signers: KDB_SIGNING_KEY={private} (or kdb pack --sign {private})")
    click.echo(f"readers: KDB_TRUSTED_KEYS={public}")


@key.command("id")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def id_(path: Path) -> None:
    """Print the key id of a public or private key file (the id `kdb verify` and warnings
    name as the signer).

    \b
    Example:
        kdb key id ci-signing.pub.pem
    """
    from ..signing import keyfiles

    data = path.read_bytes()
    if b"PRIVATE KEY" in data:
        _, key_id = keyfiles.load_private(str(path))
    else:
        key_id = keyfiles.key_id(keyfiles.public_raw_from_pem(data, str(path)))
    click.echo(key_id)

"""Ed25519 key files: standard PEM, read and written as an administrator's tools do.

Private keys are PKCS#8 (``openssl genpkey -algorithm ed25519``), public keys
SubjectPublicKeyInfo (``openssl pkey -pubout``), so keys are made and rotated with the usual
tools or ``kdb key gen``. A key's id is the first 16 hex digits of the sha256 of its 32 raw
public bytes: a label stored beside a signature, never a proof (a signature is checked against
every trusted key carrying that id).

A private key file group or others can read or write, or owned by another user, is refused
(:class:`SigningKeyError`), as ssh refuses an unprotected identity. A trusted public key file
(or its directory) that someone else can write is refused too: they could add their own key.
"""

from __future__ import annotations

import base64
import os
import stat

from ..errors import ConfigError

#: What every Ed25519 SubjectPublicKeyInfo is before its 32 key bytes (RFC 8410): parsing it
#: here spares a reader the import of cryptography's PEM loader (4.5 ms) on a hit.
_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
_PUBLIC_BEGIN, _PUBLIC_END = "-----BEGIN PUBLIC KEY-----", "-----END PUBLIC KEY-----"
#: File names a directory in ``KDB_TRUSTED_KEYS`` contributes.
PUBLIC_SUFFIXES = (".pem", ".pub")


class SigningKeyError(ConfigError):
    """A key file kdb cannot use; the message says which file and what to do."""


def key_id(public_raw: bytes) -> str:
    """The id stored with a signature: 16 hex digits of the sha256 of the raw public key.

    >>> key_id(bytes(32))
    '66687aadf862bd77'
    """
    from ..keys import sha256  # the builtin one: hashlib's OpenSSL costs 3 ms to import

    return sha256(public_raw).hexdigest()[:16]


def _crypto():
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as err:
        raise SigningKeyError(
            f"signed entries need the cryptography package ({err}); install it with "
            "pip install 'cryptography>=42'") from err
    return ed25519


def public_raw_from_pem(data: bytes, where: str) -> bytes:
    """The 32 raw bytes of the Ed25519 public key in PEM ``data`` (from file ``where``)."""
    text = data.decode("ascii", "replace").strip()
    if text.startswith(_PUBLIC_BEGIN) and text.endswith(_PUBLIC_END) and text.count("-----BEGIN") == 1:
        try:
            der = base64.b64decode("".join(text[len(_PUBLIC_BEGIN):-len(_PUBLIC_END)].split()),
                                   validate=True)
        except ValueError:
            der = b""
        if len(der) == len(_SPKI_PREFIX) + 32 and der.startswith(_SPKI_PREFIX):
            return der[len(_SPKI_PREFIX):]
    # Not the plain form (another algorithm, a private key, junk): the full loader says what.
    from cryptography.hazmat.primitives import serialization

    ed25519 = _crypto()
    try:
        key = serialization.load_pem_public_key(data)
    except Exception as err:  # noqa: BLE001 - ValueError, UnsupportedAlgorithm: not a key for us
        raise SigningKeyError(
            f"{where} is not a PEM public key ({err}); a trusted key is what "
            "`openssl pkey -in KEY -pubout` or `kdb key gen` writes") from err
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise SigningKeyError(f"{where} holds a {type(key).__name__}, not an Ed25519 key; kdb "
                              "signs with Ed25519 (openssl genpkey -algorithm ed25519)")
    return key.public_bytes_raw()


def public_key(raw: bytes):
    """An ``Ed25519PublicKey`` for 32 raw bytes."""
    return _crypto().Ed25519PublicKey.from_public_bytes(raw)


def check_private_file(path: str) -> None:
    """Refuse a private key others could read, replace or own (the message says the fix)."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise SigningKeyError(f"cannot read the signing key {path}: {err.strerror or err}; "
                              "KDB_SIGNING_KEY (or --sign) names a PEM private key file, e.g. "
                              "one `kdb key gen` wrote") from err
    if not stat.S_ISREG(st.st_mode):
        raise SigningKeyError(f"the signing key {path} is not a regular file")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise SigningKeyError(f"the signing key {path} is owned by another user (uid "
                              f"{st.st_uid}); a private key must be yours alone")
    if st.st_mode & 0o077:
        raise SigningKeyError(
            f"the signing key {path} is accessible by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): anyone who reads it can sign kernels every node "
            f"runs. Run: chmod 600 {path}")


def load_private(path: str):
    """``(private key, key id)`` from a PKCS#8 PEM file, after :func:`check_private_file`."""
    check_private_file(path)
    with open(path, "rb") as f:
        data = f.read()
    from cryptography.hazmat.primitives import serialization

    ed25519 = _crypto()
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as err:  # encrypted
        raise SigningKeyError(f"the signing key {path} is encrypted; kdb reads unencrypted "
                              "PKCS#8 keys protected by their file mode (chmod 600)") from err
    except Exception as err:  # noqa: BLE001 - ValueError, UnsupportedAlgorithm
        raise SigningKeyError(f"{path} is not a PEM private key ({err}); `kdb key gen` or "
                              "`openssl genpkey -algorithm ed25519 -out KEY` writes one") from err
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise SigningKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 key; make "
                              "one with `kdb key gen` or `openssl genpkey -algorithm ed25519`")
    return key, key_id(key.public_key().public_bytes_raw())


def trusted_files(spec: str) -> list[str]:
    """The files ``KDB_TRUSTED_KEYS`` names: each ``:``-separated item is a file, or a
    directory whose ``*.pem`` and ``*.pub`` files count (sorted; not recursive)."""
    out: list[str] = []
    for item in spec.split(os.pathsep):
        item = item.strip()
        if not item:
            continue
        if os.path.isdir(item):
            try:
                names = sorted(os.listdir(item))
            except OSError:
                names = []
            out += [os.path.join(item, n) for n in names if n.endswith(PUBLIC_SUFFIXES)]
        else:
            out.append(item)
    return out


def read_trusted(path: str) -> bytes:
    """The raw public key in trusted key file ``path``; refuses one others can change: every
    link on the way (its owner and its directory), the directory of the file it leads to, and
    the file itself (checked on the open descriptor, opened without blocking on a FIFO)."""
    where, why = _unsafe_links(path)
    fd = -1
    if why is None:
        try:
            fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
            st = os.fstat(fd)
            from ..file import fs

            why = ("it is not a regular file" if not stat.S_ISREG(st.st_mode) else
                   fs.stat_problem(st, (os.getuid(), 0) if hasattr(os, "getuid") else None))
            data = os.read(fd, 64 * 1024) if why is None else b""
        except OSError as err:
            raise SigningKeyError(f"cannot read the trusted key {path}: {err.strerror or err} "
                                  "(KDB_TRUSTED_KEYS)") from err
        finally:
            if fd >= 0:
                os.close(fd)
    if why is not None:
        raise SigningKeyError(f"the trusted key {path} is refused{where}: {why}, and whoever "
                              "can change it can make this node trust their own key. Make it "
                              "owned by you or root and not writable by group or others")
    return public_raw_from_pem(data, path)


def _unsafe_links(path: str) -> tuple[str, str | None]:
    """Follow ``path``'s links one at a time: ``(where, why)`` of the first link owned by
    someone else or in a directory others can write, else of the final directory."""
    from ..file import fs

    allowed = (os.getuid(), 0) if hasattr(os, "getuid") else ()
    current = os.path.abspath(path)
    for _ in range(40):
        bad = fs.unsafe_chain([os.path.dirname(current)], system=True)
        if bad is not None:
            return f" (its directory {bad[0]})", bad[1]
        try:
            st = os.lstat(current)
        except OSError:
            return "", None  # missing: the open says so
        if not stat.S_ISLNK(st.st_mode):
            return "", None
        if allowed and st.st_uid not in allowed:
            return f" (the link {current})", f"it is owned by another user (uid {st.st_uid})"
        current = os.path.join(os.path.dirname(current), os.readlink(current))
    return "", "too many levels of links"


def generate(private_path: str, public_path: str | None = None, force: bool = False) -> str:
    """Write a new key pair (private 0600, public 0644); returns its key id. Never
    overwrites a file unless ``force``."""
    from cryptography.hazmat.primitives import serialization

    ed25519 = _crypto()
    public_path = public_path or private_path + ".pub"
    for p in (private_path, public_path):
        if os.path.exists(p) and not force:
            raise SigningKeyError(f"{p} exists; kdb never overwrites a key (use --force, or "
                                  "another name)")
    key = ed25519.Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    _write(private_path, private_pem, 0o600, force)
    _write(public_path, public_pem, 0o644, force)
    return key_id(key.public_key().public_bytes_raw())


def _write(path: str, data: bytes, mode: int, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)

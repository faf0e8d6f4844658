"""The trust policy this process runs under, and the one sign and verify of an entry.

Read from the environment on first use and again whenever one of its three variables
changes (a test, a long-lived process re-configured):

- ``KDB_TRUSTED_KEYS``: public keys (``:``-separated files or directories). Set, an entry
  from a system file or the shared tier is served only when a trusted key signed it.
- ``KDB_REQUIRE_SIGNED=1``: the same for the user tier too.
- ``KDB_SIGNING_KEY``: the private key this process signs what it stores and publishes
  with; its public half is trusted too, so an entry this process wrote itself verifies.

A signature covers the entry's key, its canonical attributes and the sha256 of its binary
(:func:`message`); on a hit the sha256 is computed from the bytes about to be served, so a
blob swapped under a signed digest is caught. An entry that fails is a miss (the process
compiles) and one warning per cause and signer says so. With none of the variables set,
:func:`current` is three environment reads and ``None``.
"""

from __future__ import annotations

import os
import re
import threading

from .. import config, faults, logs
from . import keyfiles

from ..config import ENV_REQUIRE_SIGNED, ENV_SIGNING_KEY, ENV_TRUSTED_KEYS

#: Why an entry was not served (the first word of each warning's cause).
UNSIGNED = "unsigned"
UNKNOWN_SIGNER = "unknown signer"
BAD_SIGNATURE = "bad signature"
BAD_DIGEST = "binary does not match its signed digest"

_DOMAIN = b"kdb entry signature v1\0"
#: What a key id looks like (:func:`kdb.signing.keyfiles.key_id`).
_ID = re.compile(r"[0-9a-f]{16}\Z")


def message(key: str, attributes: str, checksum: str) -> bytes:
    """The bytes a signature covers: each field length-prefixed, after a domain tag (so a
    kdb signature can never be replayed as one over anything else).

    >>> message("k", "{}", "00")[-12:]
    b'\\x00\\x00\\x00\\x02{}\\x00\\x00\\x00\\x0200'
    """
    out = [_DOMAIN]
    for field in (key, attributes, checksum):
        data = field.encode("utf-8")
        out += [len(data).to_bytes(4, "big"), data]
    return b"".join(out)


def digest(raw: bytes) -> str:
    """The sha256 hex a signature vouches for (the rows' ``checksum`` column), by OpenSSL
    through ``cryptography`` (loaded anyway to sign or verify): 4x the builtin's speed on a
    30 KB binary, and no import of :mod:`hashlib`'s own OpenSSL binding."""
    from cryptography.hazmat.primitives import hashes

    h = hashes.Hash(hashes.SHA256())
    h.update(raw)
    return h.finalize().hex()


class Policy:
    """Trusted keys by id, whether the user tier is covered, and this process's signer."""

    def __init__(self, trusted: dict[str, list[bytes]], require: bool,
                 signer=None, signer_id: str | None = None, verify: bool = True) -> None:
        self.trusted = trusted
        self.require = require
        self.verify = verify  # False: only a signing key is set; nothing is checked
        self.signer, self.signer_id = signer, signer_id
        self._keys: dict[bytes, object] = {}

    def covers(self, tier: str) -> bool:
        """Whether entries read from ``tier`` must verify."""
        return self.verify and (tier != "user" or self.require)

    def sign(self, key: str, attributes: str, checksum: str) -> tuple[str, bytes] | None:
        """``(signer id, signature)`` for an entry this process stores; None without a key."""
        if self.signer is None:
            return None
        return self.signer_id, self.signer.sign(message(key, attributes, checksum))

    def check(self, key: str, attributes: str, raw: bytes, checksum: str,
              signer: str | None, signature: bytes | None) -> str | None:
        """None when a trusted key signed this entry and ``raw`` is what it signed; else the
        cause (:data:`UNSIGNED`, :data:`UNKNOWN_SIGNER`, :data:`BAD_SIGNATURE`,
        :data:`BAD_DIGEST`)."""
        if (not isinstance(signer, str) or not isinstance(signature, (bytes, memoryview))
                or not signer or not signature):
            return UNSIGNED  # NULL, empty, or a damaged row's column of another type
        candidates = self.trusted.get(signer)
        if not candidates:
            return UNKNOWN_SIGNER
        if digest(raw) != checksum:
            return BAD_DIGEST
        data = message(key, attributes, checksum)
        for raw_key in candidates:  # ids are labels: two trusted keys may share one
            if self._verify(raw_key, bytes(signature), data):
                return None
        return BAD_SIGNATURE

    def _verify(self, raw_key: bytes, signature: bytes, data: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        pub = self._keys.get(raw_key)
        if pub is None:
            pub = self._keys[raw_key] = keyfiles.public_key(raw_key)
        try:
            pub.verify(signature, data)
        except InvalidSignature:
            return False
        return True

    def refused(self, tier: str, where: str, key: str, name: str, cause: str,
                signer: str | None) -> None:
        """One warning per tier, cause and signer: the entry is a miss and is compiled. A
        signer id that is not one (the database's text, shown to a terminal) is shown quoted
        and cut, under one warning for every such id."""
        once = signer
        if signer is not None and not _ID.match(signer):
            signer, once = "malformed " + repr(signer[:40]), "malformed"
        who = f" (signer {signer})" if signer else ""
        text = {UNSIGNED: "it is not signed",
                UNKNOWN_SIGNER: f"its signer {signer} is not in {ENV_TRUSTED_KEYS}",
                BAD_SIGNATURE: f"its signature does not verify against the trusted key {signer}",
                BAD_DIGEST: f"its binary is not the one its signer{who} signed"}[cause]
        logs.warn_once(f"unsigned:{tier}:{cause}:{once}",
                       "kdb: entry %s (%s) in the %s tier %s is not served: %s; it is compiled "
                       "instead (trust policy: %s%s). Further entries refused for this cause%s "
                       "are logged at debug level.", key[:16], name or "unnamed", tier, where,
                       text, ENV_TRUSTED_KEYS,
                       f", {ENV_REQUIRE_SIGNED}=1" if self.require else "", who)
        logs.get("kdb").debug("kdb: entry %s in %s refused: %s%s", key[:16], where, cause, who)


_lock = threading.Lock()
_memo: dict[tuple, Policy | None] = {}


def current() -> Policy | None:
    """The policy the environment asks for, or None (no variable set: nothing to do)."""
    get = os.environ.get
    spec = (get(ENV_TRUSTED_KEYS) or "", get(ENV_REQUIRE_SIGNED) or "", get(ENV_SIGNING_KEY) or "")
    if spec == ("", "", ""):
        return None
    got = _memo.get(spec, False)
    if got is not False:
        return got
    with _lock:
        if spec not in _memo:
            _memo.clear()  # one environment at a time
            _memo[spec] = _load(*spec)
        return _memo[spec]


def reset() -> None:
    """Read the environment again on next use (tests)."""
    with _lock:
        _memo.clear()


def _load(trusted_spec: str, require_raw: str, signing_path: str) -> Policy | None:
    require = config.flag(ENV_REQUIRE_SIGNED) if require_raw.strip() else False
    trusted: dict[str, list[bytes]] = {}
    for path in keyfiles.trusted_files(trusted_spec):
        try:
            raw = keyfiles.read_trusted(path)
        except keyfiles.SigningKeyError as err:
            faults.fault(f"{err}; entries it signed are not served", once="trusted:" + path)
            continue
        ids = trusted.setdefault(keyfiles.key_id(raw), [])
        if raw not in ids:
            ids.append(raw)
    signer = signer_id = None
    if signing_path.strip():
        try:
            signer, signer_id = keyfiles.load_private(os.path.abspath(signing_path))
        except keyfiles.SigningKeyError as err:
            faults.fault(f"{err}; nothing this process stores is signed",
                         once="signing:" + signing_path)
        else:
            raw = signer.public_key().public_bytes_raw()
            ids = trusted.setdefault(signer_id, [])
            if raw not in ids:
                ids.append(raw)
    verify = bool(trusted_spec.strip()) or require
    if verify and not trusted:
        logs.warn_once("no-trusted-keys",
                       "kdb: a trust policy is set (%s=%r%s) but no usable trusted key was "
                       "found: no entry of a covered tier can be served, and every kernel is "
                       "compiled. List public key files or directories in %s.",
                       ENV_TRUSTED_KEYS, trusted_spec,
                       f", {ENV_REQUIRE_SIGNED}=1" if require else "", ENV_TRUSTED_KEYS)
    elif require and signer is None:
        logs.warn_once("require-no-signer",
                       "kdb: %s=1 without a usable %s: what this process stores is unsigned, "
                       "so the user tier never serves it and kernels are compiled at every "
                       "start. Set %s to your private key.", ENV_REQUIRE_SIGNED,
                       ENV_SIGNING_KEY, ENV_SIGNING_KEY)
    return Policy(trusted, require, signer, signer_id, verify)


def problems(environ=None) -> list[str]:
    """What is wrong with the key files the policy's variables name, one message each (the
    command line refuses to run with any; :func:`kdb.config.problems` checks the flag)."""
    env = os.environ if environ is None else environ
    out = []
    path = env.get(ENV_SIGNING_KEY, "").strip()
    if path:
        try:
            keyfiles.check_private_file(path)
        except keyfiles.SigningKeyError as err:
            out.append(f"{ENV_SIGNING_KEY}: {err}")
    for f in keyfiles.trusted_files(env.get(ENV_TRUSTED_KEYS, "")):
        try:
            keyfiles.read_trusted(f)
        except keyfiles.SigningKeyError as err:
            out.append(f"{ENV_TRUSTED_KEYS}: {err}")
    return out

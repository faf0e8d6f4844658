"""Signed entries: who may vouch for a binary, and the check a hit makes under a trust policy.

A kdb checksum detects corruption, not a malicious writer: anyone who can write a tier can
replace a kernel every reader then runs. With ``KDB_TRUSTED_KEYS`` set, an entry read from a
system file or the shared tier (and, with ``KDB_REQUIRE_SIGNED=1``, from the user tier too) is
served only when an Ed25519 signature by a trusted key covers its key, its canonical
attributes and the sha256 of its binary; anything else is a miss and is compiled.

:mod:`kdb.signing.keyfiles` reads and writes the PEM key files (``openssl genpkey -algorithm
ed25519`` / ``openssl pkey -pubout`` write the same); :mod:`kdb.signing.policy` is the policy
a process runs under, read from the environment once, and the one sign and verify. The
``cryptography`` package is imported only when a policy or a signing key is set, never on a
hit without one.
"""

from __future__ import annotations

import os

from ..config import ENV_REQUIRE_SIGNED, ENV_SIGNING_KEY, ENV_TRUSTED_KEYS


def current():
    """The trust policy the environment asks for (:func:`kdb.signing.policy.current`), or
    None. With none of its three variables set, three reads: the policy module (and
    ``cryptography``) is imported by the first process that sets one, not by every hit."""
    get = os.environ.get
    if not (get(ENV_TRUSTED_KEYS) or get(ENV_REQUIRE_SIGNED) or get(ENV_SIGNING_KEY)):
        return None
    from . import policy

    return policy.current()

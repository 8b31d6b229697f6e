"""The attempt credential: what proves a tool call comes from the live attempt's worker.

Each attempt that becomes live gets a random secret (minted by the adapters' `Ids` port,
`secrets.token_urlsafe(32)`), sent upstream to its replica in `x-gateway-attempt-secret`
and nowhere else. The journal keeps only its SHA-256 digest (`<prefix>/cred/<rid>/<aid>`),
written in the transaction that makes the attempt live. The tool route compares the
digest of the presented secret with the stored one in constant time (decision 0028).

Pure: stdlib only, no I/O, no randomness (the secret comes in from the caller).
"""

from __future__ import annotations

import hashlib
import hmac
import re

# secrets.token_urlsafe(32): 32 random bytes, base64url without padding = 43 characters.
SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{43}$")
# Compared against when no digest is stored, so both refusals take the same work.
_ABSENT = "0" * 64


def well_formed(secret: str) -> bool:
    """The shape the gateway mints; anything else is refused before any hashing."""
    return bool(SECRET_RE.match(secret))


def digest(secret: str) -> str:
    """What the journal keeps of a secret: its SHA-256, hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def matches(secret: str, stored: str | None) -> bool:
    """True only for a well-formed secret whose digest equals the stored one.

    The digests are compared in constant time (`hmac.compare_digest`); an absent digest is
    compared too (against a value no SHA-256 hex has in practice), so a missing credential
    and a wrong one take the same work and get the same answer.
    """
    expected = stored if stored is not None else _ABSENT
    equal = hmac.compare_digest(digest(secret).encode(), expected.encode())
    return equal and stored is not None and well_formed(secret)

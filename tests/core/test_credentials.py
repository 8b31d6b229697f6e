"""The attempt credential's rules without I/O (decision 0028)."""

from __future__ import annotations

import hashlib
import secrets

import pytest

from extproc.core.credentials import digest, matches, well_formed


def test_the_journal_keeps_the_sha256_hex_of_the_secret() -> None:
    s = secrets.token_urlsafe(32)
    assert digest(s) == hashlib.sha256(s.encode()).hexdigest()
    assert s not in digest(s) and len(digest(s)) == 64


def test_the_minted_shape_is_well_formed_and_nothing_else() -> None:
    for _ in range(50):
        assert well_formed(secrets.token_urlsafe(32))
    for bad in ("", "x" * 42, "x" * 44, "x" * 42 + "=", "x" * 42 + " ", "x" * 42 + "é"):
        assert not well_formed(bad)


def test_only_the_secret_of_the_stored_digest_matches() -> None:
    s, other = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    assert matches(s, digest(s))
    assert not matches(other, digest(s))  # another attempt's secret
    assert not matches(s, None)  # no credential stored (unknown attempt, undone, expired)
    assert not matches("", digest(s))
    assert not matches(digest(s), digest(s))  # the digest itself is no secret


@pytest.mark.parametrize("stored", ["", "not hex", "ü" * 64, "0" * 64])
def test_a_damaged_or_placeholder_digest_never_matches(stored: str) -> None:
    assert not matches(secrets.token_urlsafe(32), stored)


def test_a_malformed_secret_never_matches_even_its_own_digest() -> None:
    odd = "short"
    assert not matches(odd, digest(odd))

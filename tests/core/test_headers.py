"""core/headers: the names the gateway owns, which a client may not set (the guard
overwrites them), and the two it writes on responses only."""

from __future__ import annotations

from extproc.core import headers as H

_NAMES = {k: v for k, v in vars(H).items() if k.isupper() and isinstance(v, str)}
RESPONSE_ONLY = {H.ENVOY_REPLY, H.GATEWAY_ERROR}


def test_names_are_lower_case_and_distinct() -> None:
    """Envoy hands header maps over lower-cased (HTTP/2): a capital would never match."""
    assert all(v == v.lower() and v.strip() == v and " " not in v for v in _NAMES.values())
    assert len(set(_NAMES.values())) == len(_NAMES)


def test_every_request_header_of_ours_is_owned() -> None:
    """A gateway header a client could set and the guard would keep is a forgery path: every
    x-gateway-* header the gateway sends upstream is in OWNED; only the response markers
    are not (a client's request never carries them toward a replica as ours)."""
    ours = {v for v in _NAMES.values() if v.startswith("x-gateway-")}
    assert ours - RESPONSE_ONLY == set(H.OWNED)
    assert not RESPONSE_ONLY & set(H.OWNED)
    assert len(H.OWNED) == len(set(H.OWNED))


def test_the_attempt_secret_and_the_ids_are_owned() -> None:
    for name in (H.ATTEMPT_SECRET, H.REQUEST_ID, H.ATTEMPT_ID, H.PREADMITTED, H.HANDOFF,
                 H.PROCESSOR):
        assert name in H.OWNED, name
    # Envoy's own and the client's: never overwritten by the guard.
    for name in (H.IDEMPOTENCY_KEY, H.ENVOY_ATTEMPT_COUNT, H.ENVOY_REQUEST_ID,
                 H.ROLE_METADATA):
        assert name not in H.OWNED, name

"""The four failure classes and how each is fenced (docs/failure-classes.md)."""

from __future__ import annotations

import itertools

import pytest

from extproc.core.failure import AttemptEnd, FailureClass, Fence, classify, fence_for


def end(**kw: object) -> AttemptEnd:
    base: dict[str, object] = dict(released=False, upstream_finished=False,
                                   failed_on_purpose=False, http_status=0, cause="unknown")
    base.update(kw)
    return AttemptEnd(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("e", "cls"), [
    (end(released=True, upstream_finished=True, http_status=200), FailureClass.COMPLETED),
    (end(cause="upstream"), FailureClass.REPLICA_DEAD),
    (end(http_status=200, cause="upstream"), FailureClass.REPLICA_DEAD),
    (end(released=True, http_status=200, cause="upstream"), FailureClass.REPLICA_DEAD),
    (end(cause="timeout"), FailureClass.NETWORK_UNCERTAIN),
    (end(http_status=200, cause="timeout"), FailureClass.NETWORK_UNCERTAIN),
    (end(cause="unknown"), FailureClass.NETWORK_UNCERTAIN),
    (end(released=True, http_status=200, cause="unknown"), FailureClass.NETWORK_UNCERTAIN),
    (end(http_status=429, upstream_finished=True), FailureClass.OVERLOADED),
    (end(http_status=503, upstream_finished=True), FailureClass.OVERLOADED),
    (end(http_status=503, cause="upstream"), FailureClass.OVERLOADED),
    (end(http_status=400, upstream_finished=True), FailureClass.COMPLETED),
    (end(http_status=500, cause="unknown"), FailureClass.REPLICA_ERROR),
    (end(http_status=502, cause="timeout"), FailureClass.REPLICA_ERROR),
    (end(cause="client"), FailureClass.CLIENT_GONE),
    (end(released=True, http_status=200, cause="client"), FailureClass.CLIENT_GONE),
    (end(failed_on_purpose=True, http_status=200, cause="unknown"),
     FailureClass.ENDED_BY_GATEWAY),
    (end(failed_on_purpose=True, http_status=200, upstream_finished=True),
     FailureClass.ENDED_BY_GATEWAY),
])
def test_classes(e: AttemptEnd, cls: FailureClass) -> None:
    assert classify(e) is cls


def test_only_uncertain_liveness_with_no_word_from_envoy_waits_for_expiry() -> None:
    assert fence_for(FailureClass.NETWORK_UNCERTAIN, envoy_closed=False) is Fence.EXPIRE
    # Envoy's own entry for the attempt says it tore the upstream stream down: the gate
    # (the only publisher) is gone, so revoking fences it (docs/fencing.md).
    assert fence_for(FailureClass.NETWORK_UNCERTAIN, envoy_closed=True) is Fence.REVOKE
    for c in FailureClass:
        if c is not FailureClass.NETWORK_UNCERTAIN:
            for closed in (False, True):
                assert fence_for(c, closed) is Fence.REVOKE


def test_never_dead_without_evidence() -> None:
    # Exhaustive over the inputs: REPLICA_DEAD (immediate retry) needs Envoy to have said
    # the upstream reset/refused; a timeout or silence is never taken for death.
    for rel, fin, fail, st, cause in itertools.product(
            [False, True], [False, True], [False, True], [0, 200, 400, 429, 503],
            ["upstream", "timeout", "client", "unknown"]):
        e = AttemptEnd(rel, fin, fail, st, cause)
        c = classify(e)
        if c is FailureClass.REPLICA_DEAD:
            assert cause == "upstream"
        if cause in ("timeout", "unknown") and not fin and not fail and st in (0, 200):
            assert c is FailureClass.NETWORK_UNCERTAIN

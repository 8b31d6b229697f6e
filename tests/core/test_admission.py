"""Admission: the retry budget, the request's budget and each attempt's deadlines, pure."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.admission import (
    MIN_ATTEMPT_S,
    RECLAIM,
    TAKE_OVER,
    WAIT,
    Admitted,
    AttemptRequest,
    after_failed_admission,
    decide,
    lost_release_fence,
    release_lost,
)
from extproc.core.budget import RetryBudget
from extproc.core.errors import ErrorCode, GatewayError
from extproc.core.failure import Fence
from extproc.core.journal import delivered_by

# --- admission ------------------------------------------------------------------------


def req(**kw: object) -> AttemptRequest:
    base: dict[str, object] = dict(request_id="req_1", attempt=1, max_attempts=2,
                                   reached_before=False, elapsed_s=0.0,
                                   total_first_delta_s=60.0, first_delta_s=30.0,
                                   fence_wait_s=12.0)
    base.update(kw)
    return AttemptRequest(**base)  # type: ignore[arg-type]


def test_the_budget_never_refuses_a_first_run() -> None:
    budget = RetryBudget(fraction=0.0, min_retry_concurrency=0, expiry_s=600)  # refuses all
    for attempt in (1, 2, 3):
        v = decide(req(attempt=attempt, max_attempts=3, reached_before=False), budget, 0.0)
        assert isinstance(v, Admitted) and v.counts_as_retry is False
    v = decide(req(attempt=2, reached_before=True), budget, 0.0)
    assert isinstance(v, GatewayError) and v.code is ErrorCode.RETRY_BUDGET_EXHAUSTED
    assert v.retryable is True and v.http_status == 503


def test_only_re_prefills_are_counted() -> None:
    budget = RetryBudget(fraction=0.2, min_retry_concurrency=2, expiry_s=600)
    for i in range(5):
        budget.request_started(f"req_{i}", 0.0)
    outcomes = [decide(req(attempt=2, reached_before=r, attempt_id=f"att_{i}"), budget, 0.0)
                for i, r in enumerate((False, True, False, True, True))]
    counted = [isinstance(o, Admitted) and o.counts_as_retry for o in outcomes]
    refused = [isinstance(o, GatewayError) for o in outcomes]
    assert counted == [False, True, False, True, False]
    assert refused == [False, False, False, False, True]  # max(2, 0.2 x 5) = 2 in flight


def test_retry_cost_applies_to_re_prefills_only() -> None:
    budget = RetryBudget(0.2, 10, 600)
    big = dict(prompt_tokens=5000, max_prompt_tokens=1000)
    assert isinstance(decide(req(attempt=2, reached_before=False, **big), budget, 0), Admitted)
    v = decide(req(attempt=2, reached_before=True, **big), budget, 0)
    assert isinstance(v, GatewayError) and v.code is ErrorCode.RETRY_TOO_EXPENSIVE


def test_fingerprint_and_max_attempts() -> None:
    b = RetryBudget(0.2, 10, 600)
    v = decide(req(want_fingerprint="fp-a", replica_fingerprint="fp-b", replica="x:1"), b, 0)
    assert isinstance(v, GatewayError) and v.code is ErrorCode.NO_COMPATIBLE_REPLICA
    v = decide(req(attempt=3, max_attempts=2), b, 0)
    assert isinstance(v, GatewayError) and v.code is ErrorCode.RETRY_BUDGET_EXHAUSTED
    assert v.retryable is False


@pytest.mark.parametrize(("attempt", "elapsed", "final", "deadline"), [
    (1, 0.0, False, 30.0),     # attempt 1 of 2, the whole budget left
    (2, 30.3, True, 29.7),     # the last attempt: what is left of the budget
    (1, 0.0, True, 30.0),      # with max_attempts 1 (below)
])
def test_deadlines(attempt: int, elapsed: float, final: bool, deadline: float) -> None:
    max_attempts = 1 if (attempt, final) == (1, True) else 2
    v = decide(req(attempt=attempt, elapsed_s=elapsed, max_attempts=max_attempts,
                   total_first_delta_s=30.0 * max_attempts), RetryBudget(0.2, 10, 600), 0)
    assert isinstance(v, Admitted)
    assert v.final is final and v.deadline_s == pytest.approx(deadline)
    assert v.fence_wait_s <= v.deadline_s - MIN_ATTEMPT_S


def test_no_attempt_starts_without_budget_left() -> None:
    v = decide(req(attempt=2, elapsed_s=59.8), RetryBudget(0.2, 10, 600), 0)
    assert isinstance(v, GatewayError) and v.code is ErrorCode.UPSTREAM_TIMEOUT
    assert v.http_status == 504 and v.retryable is True and v.request_id == "req_1"


@given(st.integers(1, 4), st.integers(1, 4), st.booleans(), st.floats(0, 200),
       st.floats(0.5, 60), st.floats(0, 30))
def test_admission_invariants(attempt: int, max_attempts: int, reached: bool, elapsed: float,
                              first: float, fence: float) -> None:
    total = first * max_attempts
    budget = RetryBudget(0.2, 10, 600)
    v = decide(req(attempt=attempt, max_attempts=max_attempts, reached_before=reached,
                   elapsed_s=elapsed, first_delta_s=first, total_first_delta_s=total,
                   fence_wait_s=fence), budget, 0.0)
    if attempt > max_attempts:
        assert isinstance(v, GatewayError)
        return
    if isinstance(v, GatewayError):
        # Refused only for the request's budget: never a first run for the retry budget.
        assert attempt > 1 and v.code is ErrorCode.UPSTREAM_TIMEOUT
        assert total - elapsed < MIN_ATTEMPT_S
        return
    assert v.counts_as_retry == (attempt > 1 and reached)
    # Never past the per-attempt limit, never past the request's budget (attempt 1 always
    # gets its limit: the budget is at least one first_delta_s).
    assert v.deadline_s <= first + 1e-9
    if attempt > 1:
        assert v.deadline_s <= total - elapsed + 1e-9
    assert 0.0 <= v.fence_wait_s <= max(0.0, v.deadline_s - MIN_ATTEMPT_S) + 1e-9
    assert v.final == (attempt >= max_attempts or total - elapsed <= first)


# --- the journal's admission once its compare failed (every store asks this) ------------


def _failed(**kw: object) -> str:
    base: dict[str, object] = dict(attempt=2, has_meta=True, delivered=False,
                                   attempt_taken=False, live_never_started=False,
                                   waited_s=0.0, fence_wait_s=5.0, release_lost=False)
    base.update(kw)
    return after_failed_admission(**base)  # type: ignore[arg-type]


@given(st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans(),
       st.booleans())
def test_after_failed_admission_precedence(has_meta: bool, delivered: bool, lost: bool,
                                           taken: bool, never: bool, waited: bool) -> None:
    got = _failed(has_meta=has_meta, delivered=delivered, release_lost=lost,
                  attempt_taken=taken, live_never_started=never,
                  waited_s=5.0 if waited else 0.0)
    if not has_meta:
        assert got == "unknown request (no journal record)"
    elif delivered and lost and not taken:
        assert got == RECLAIM  # decision 0057: Envoy retried, so nothing left
    elif delivered:
        assert got == "first delta already sent: no second attempt"
    elif taken:
        assert got == "attempt 2 was already admitted"
    elif never:
        assert got == TAKE_OVER
    elif waited:
        assert got == "previous attempt is not fenced (lease still live)"
    else:
        assert got == WAIT


@pytest.mark.parametrize(("by", "live", "lost"), [
    ((1, "att_1"), "att_1", True),  # released, nothing ended it
    ((1, "att_1"), "fenced:att_1", True),  # fenced already: wait for its lease
    ((1, "att_1"), None, True),  # its process's lease lapsed
    ((1, "att_1"), "att_9", False),  # a third attempt holds `live`: not this case
    ((2, "att_2"), "att_2", False),  # this very attempt number (its gate twice)
    ((3, "att_3"), "att_3", False),  # a later attempt's: never a retry of it
    ((1, "att_x"), "att_x", False),  # ... and one naming this attempt's id
    (None, "att_1", False),  # a delivery naming no attempt: nothing inferred
])
def test_which_delivery_is_a_release_that_never_left(
        by: tuple[int, str] | None, live: str | None, lost: bool) -> None:
    aid = "att_x" if by == (1, "att_x") else "att_2"
    assert release_lost(by, live, 2, aid) is lost


def test_a_lost_release_is_fenced_as_envoys_confirmed_close() -> None:
    assert lost_release_fence(cancel_ack=True) is Fence.REVOKE
    assert lost_release_fence(cancel_ack=False) is Fence.EXPIRE


@pytest.mark.parametrize(("raw", "by"), [
    (b'{"attempt": 1, "attempt_id": "att_1", "at": 1.0}', (1, "att_1")),
    (b'{"attempt_id": "att_1"}', None),
    (b'{"attempt": true, "attempt_id": "att_1"}', None),
    (b'{"attempt": 1, "attempt_id": ""}', None),
    (b"[1]", None),
    (b"not json", None),
    (None, None),
])
def test_delivered_by_reads_only_a_whole_name(raw: bytes | None,
                                              by: tuple[int, str] | None) -> None:
    assert delivered_by(raw) == by

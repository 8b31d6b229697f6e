"""Pool health, admission and first-delta deadlines: pure, no sockets (decision 0010)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.core.admission import MIN_ATTEMPT_S, Admitted, AttemptRequest, decide
from extproc.core.budget import RetryBudget
from extproc.core.config import ConfigError, load_config
from extproc.core.errors import ErrorCode, GatewayError
from extproc.core.events import (
    AwaitCause,
    FailAttempt,
    Refuse,
    ResponseHeaders,
    RevokeEarly,
    State,
    StreamClosed,
    TimerFired,
    TimerKind,
)
from extproc.core.gate import GateMachine
from extproc.core.health import HealthPolicy, HostHealth

from .gate_drive import ADMITTED, FINAL, admit

HOSTS = ["a:1", "b:1", "c:1"]


# --- health ---------------------------------------------------------------------------


def test_consecutive_failures_eject_and_the_ejection_grows() -> None:
    h = HostHealth(HealthPolicy(consecutive_failures=2, base_ejection_s=5, max_ejection_s=12))
    assert h.attempt_failed("a:1", 0.0) is False and h.healthy("a:1", 0.0)
    assert h.attempt_failed("a:1", 0.1) is True
    assert not h.healthy("a:1", 0.2) and h.healthy("a:1", 5.2)
    assert h.order(HOSTS, 1.0) == ["b:1", "c:1", "a:1"]
    assert h.order(HOSTS, 5.2) == HOSTS
    # Failing again after the ejection: twice as long, then capped.
    h.attempt_failed("a:1", 6.0)
    assert h.attempt_failed("a:1", 6.1) is True
    assert not h.healthy("a:1", 16.0) and h.healthy("a:1", 16.2)
    h.attempt_failed("a:1", 20.0)
    h.attempt_failed("a:1", 20.1)
    assert not h.healthy("a:1", 32.0) and h.healthy("a:1", 32.2)  # 12 s cap, not 15


def test_a_success_resets_the_count() -> None:
    h = HostHealth(HealthPolicy(consecutive_failures=2))
    h.attempt_failed("a:1", 0.0)
    h.attempt_succeeded("a:1", 0.1)
    assert h.attempt_failed("a:1", 0.2) is False and h.healthy("a:1", 0.3)


def test_probes_mark_down_and_bring_back_at_once() -> None:
    h = HostHealth(HealthPolicy(unhealthy_threshold=2, healthy_threshold=1, base_ejection_s=60))
    h.probed("b:1", False, 0.0)
    assert h.healthy("b:1", 0.0)
    h.probed("b:1", False, 1.0)
    assert not h.healthy("b:1", 1.0) and not h.healthy("b:1", 1000.0)
    h.attempt_failed("b:1", 1.1)
    h.attempt_failed("b:1", 1.2)  # also ejected for 60 s
    h.probed("b:1", True, 2.0)  # a restarted pod: back at once, the ejection forgiven
    assert h.healthy("b:1", 2.0) and h.order(HOSTS, 2.0) == HOSTS


def test_a_good_probe_lifts_a_passive_ejection() -> None:
    h = HostHealth(HealthPolicy(consecutive_failures=1, base_ejection_s=60))
    h.attempt_failed("c:1", 0.0)
    assert not h.healthy("c:1", 1.0)
    h.probed("c:1", True, 1.0)
    assert h.healthy("c:1", 1.0)


@given(st.lists(st.tuples(st.sampled_from(HOSTS), st.sampled_from(["fail", "ok", "up", "down"]),
                          st.floats(0, 5)), max_size=40),
       st.permutations(HOSTS), st.floats(0, 300))
def test_order_is_a_permutation_healthy_first(events: list[tuple[str, str, float]],
                                              hosts: list[str], at: float) -> None:
    h = HostHealth(HealthPolicy())
    now = 0.0
    for addr, what, dt in events:
        now += dt
        if what == "fail":
            h.attempt_failed(addr, now)
        elif what == "ok":
            h.attempt_succeeded(addr, now)
        else:
            h.probed(addr, what == "up", now)
    out = h.order(hosts, now + at)
    assert sorted(out) == sorted(hosts)  # never drops a host
    good = [a for a in hosts if h.healthy(a, now + at)]
    assert out[:len(good)] == good  # healthy ones first, in the request's rotation


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


# --- the gate machine at its deadline ---------------------------------------------------


def gate_in(state: str, final: bool) -> GateMachine:
    m = GateMachine.new("req_1", 1 << 20)
    admit(m, attempt=2, verdict=FINAL if final else ADMITTED, accepted_at=1000.0)
    if state == "holding":
        m.handle(ResponseHeaders(200, "text/event-stream"))
    return m


@pytest.mark.parametrize(("state", "final"), list(itertools.product(["forwarded", "holding"],
                                                                     [False, True])))
def test_first_delta_deadline(state: str, final: bool) -> None:
    m = gate_in(state, final)
    acts = m.handle(TimerFired(TimerKind.FIRST_DELTA, 12.5, 1012.5))
    if final:
        # Nothing left to retry with: our error goes to the client (never retried).
        (a,) = acts
        assert isinstance(a, Refuse) and a.error.code is ErrorCode.UPSTREAM_TIMEOUT
        assert a.error.http_status == 504 and "12.5 s" in a.error.message
        assert m.state is State.GATE_FAILED
    elif state == "holding":
        (a,) = acts
        assert isinstance(a, FailAttempt)  # 503 to the router: retry elsewhere
    else:
        assert acts == []  # no headers to answer: Envoy's per-try timeout ends it
        assert m.state is State.GATE_FORWARDED
    *_, end = m.handle(StreamClosed(13.0, 1013.0))
    timed_out = final or state == "holding"
    # A timed-out end is uncertain: Envoy's word is awaited before it is settled.
    # Not timed out, ended before the limit: confirmed, revoked at once.
    assert isinstance(end, AwaitCause if timed_out else RevokeEarly)
    assert m.timed_out is timed_out


def test_config_first_delta_total_and_pool_health() -> None:
    c = load_config({})
    assert c.timeouts.total_first_delta_s(c.policy.max_attempts) == 60.0
    assert c.policy.retry_budget.min_retry_concurrency == 10
    assert c.pool.health_check.path == "/health" and c.pool.outlier_detection.enabled
    c = load_config({"timeouts": {"first_delta_s": 5, "first_delta_total_s": 7}})
    assert c.timeouts.total_first_delta_s(2) == 7.0
    for raw, field in [
        ({"timeouts": {"first_delta_s": 5, "first_delta_total_s": 4}},
         "timeouts.first_delta_total_s"),
        ({"pool": {"health_check": {"path": "health"}}}, "pool.health_check.path"),
        ({"pool": {"health_check": {"interval": 1}}}, "pool.health_check.interval"),
        ({"pool": {"outlier_detection": {"consecutive_local_origin_failure": 0}}},
         "pool.outlier_detection.consecutive_local_origin_failure"),
        ({"pool": {"outlier_detection": {"base_ejection_time_s": 10,
                                         "max_ejection_time_s": 5}}},
         "pool.outlier_detection.max_ejection_time_s"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(raw)
        assert e.value.path == field

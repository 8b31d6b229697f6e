"""A repeat of a key: answered from the journal, or run again as the same logical request
(decision 0027). `journal.answer_repeat` decides for every outcome the journal records."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.core.errors import ErrorCode, GatewayError
from extproc.core.journal import (
    MAX_RUNS,
    RERUNNABLE,
    JournalView,
    Outcome,
    Rerun,
    answer_repeat,
    assemble,
    rerun_blocker,
)

RID = "req_0123456789abcdefghjkmnpqrs"
DIGEST = "sha256:" + "a" * 64
META = {"model": "m-1", "stream": True, "max_attempts": 2, "request_digest": DIGEST}


def att(n: int, **extra: Any) -> dict[str, Any]:
    return {"attempt": n, "attempt_id": f"att_{n}", **extra}


def ended(outcome: Outcome | str, delivered: int = 0, *, delivery: bool = False,
          live: str | None = None, cause: str | None = "http 503", attempts: int = 2,
          history: tuple[dict[str, Any], ...] = (), **extra: Any) -> JournalView:
    oc = {"outcome": str(outcome), "delivered_output_tokens": delivered, "cause": cause,
          "finished_at": 5.0, **extra}
    return JournalView(request_id=RID, meta=META,
                       attempts=tuple(att(n) for n in range(1, attempts + 1)),
                       delivery={"at": 1.0} if delivery else None, outcome=oc,
                       live_attempt_id=live, history=history)


def code(res: GatewayError | Rerun) -> str:
    return "rerun" if isinstance(res, Rerun) else str(res.code)


# Every outcome, with and without a delivered first delta: what its repeat gets.
@pytest.mark.parametrize(("outcome", "delivered", "want"), [
    # Nothing delivered, for a reason not the request's own: it runs again.
    (Outcome.UPSTREAM_FAILED, False, "rerun"),
    (Outcome.CLIENT_DISCONNECTED, False, "rerun"),
    (Outcome.GATEWAY_INTERRUPTED, False, "rerun"),
    (Outcome.REFUSED, False, "rerun"),
    # A first delta left: answered from the journal, as before decision 0027.
    (Outcome.UPSTREAM_FAILED, True, "request_already_finished"),
    (Outcome.CLIENT_DISCONNECTED, True, "request_already_finished"),
    (Outcome.GATEWAY_INTERRUPTED, True, "gateway_interrupted"),
    (Outcome.REFUSED, True, "request_already_finished"),
    (Outcome.UPSTREAM_DECODE_INTERRUPTED, True, "upstream_decode_interrupted"),
    (Outcome.COMPLETED, True, "request_already_completed"),
    # Ends that never go without a delivery, but if one did: never run twice.
    (Outcome.UPSTREAM_DECODE_INTERRUPTED, False, "upstream_decode_interrupted"),
    (Outcome.COMPLETED, False, "request_already_completed"),
])
def test_every_outcome(outcome: Outcome, delivered: bool, want: str) -> None:
    v = ended(outcome, 3 if delivered else 0, delivery=delivered)
    res = answer_repeat(v, DIGEST, "k-1")
    assert code(res) == want
    assert (rerun_blocker(v) is None) is (want == "rerun")
    if isinstance(res, GatewayError):
        assert res.http_status == 409 and res.request_id == RID


def test_the_list_covers_every_outcome() -> None:
    # A new outcome must be decided here, not fall into a list by accident.
    assert RERUNNABLE | {Outcome.COMPLETED, Outcome.UPSTREAM_DECODE_INTERRUPTED} == set(Outcome)


def test_the_rerun_continues_the_attempt_numbers_and_keeps_the_ended_run() -> None:
    v = ended(Outcome.UPSTREAM_FAILED, attempts=2)
    res = answer_repeat(v, DIGEST, "k-1")
    assert isinstance(res, Rerun)
    assert (res.request_id, res.run, res.first_attempt, res.attempt_offset) == (RID, 2, 3, 2)
    assert res.outcome == v.outcome and res.ended_first_attempt == 1
    h = res.history(6.0, "gw-1", "envoy-2")
    assert h == {"run": 1, "first_attempt": 1, "last_attempt": 2, "outcome": v.outcome,
                 "reopened_at": 6.0, "reopened_by": "gw-1", "next_envoy_request_id": "envoy-2"}
    # Run 2 (attempts 3, 4) failed too: run 3 starts at 5, and says where run 2 began.
    v2 = ended(Outcome.UPSTREAM_FAILED, attempts=4, history=(h,))
    res2 = answer_repeat(v2, DIGEST, "k-1")
    assert isinstance(res2, Rerun)
    assert (res2.run, res2.first_attempt, res2.ended_first_attempt) == (3, 5, 3)
    # The numbering goes on from the highest recorded, gaps and order aside.
    gappy = JournalView(request_id=RID, meta=META, attempts=(att(1), att(4)),
                        outcome={"outcome": "upstream_failed", "delivered_output_tokens": 0})
    res3 = answer_repeat(gappy)
    assert isinstance(res3, Rerun) and res3.first_attempt == 5


@pytest.mark.parametrize(("cause", "want"), [
    ("http 503", "rerun"), ("http 502", "rerun"), ("http 504", "rerun"), ("http 500", "rerun"),
    ("http 429", "rerun"), ("http 408", "rerun"),
    ("upstream", "rerun"), ("unknown", "rerun"), ("client", "rerun"), (None, "rerun"),
    # The upstream refused the request itself: the same body gets the same answer.
    ("http 400", "request_already_finished"), ("http 404", "request_already_finished"),
    ("http 413", "request_already_finished"), ("http 422", "request_already_finished"),
])
def test_a_refusal_of_the_request_itself_is_not_run_again(cause: str | None,
                                                           want: str) -> None:
    assert code(answer_repeat(ended(Outcome.UPSTREAM_FAILED, cause=cause))) == want


def test_a_different_body_under_the_key_is_refused_before_anything() -> None:
    res = answer_repeat(ended(Outcome.UPSTREAM_FAILED), "sha256:" + "b" * 64, "k-1")
    assert isinstance(res, GatewayError) and res.code is ErrorCode.IDEMPOTENCY_KEY_REUSED
    assert res.http_status == 422


def test_in_progress_is_answered_as_today() -> None:
    v = JournalView(request_id=RID, meta=META, attempts=(att(1),), live_attempt_id="att_1")
    res = answer_repeat(v, DIGEST)
    assert isinstance(res, GatewayError) and res.code is ErrorCode.REQUEST_IN_PROGRESS
    assert res.body()["error"]["phase"] == "prefill"


def test_an_attempt_that_may_still_run_waits_for_its_fence() -> None:
    v = JournalView(request_id=RID, meta=META,
                    attempts=(att(1), att(2, lease_expires_by=17.5)),
                    outcome={"outcome": "upstream_failed", "delivered_output_tokens": 0,
                             "cause": "http 504"},
                    live_attempt_id="fenced:att_2")
    assert rerun_blocker(v) == "an attempt of it may still be running"
    res = answer_repeat(v, DIGEST)
    assert isinstance(res, GatewayError) and res.code is ErrorCode.REQUEST_IN_PROGRESS
    assert res.http_status == 409 and res.retryable is True
    body = res.body()["error"]
    assert body["phase"] == "done" and body["fence_expires_at"] == 17.5
    # Not re-runnable anyway (delivered): the journal's answer, not a wait.
    delivered = JournalView(request_id=RID, meta=META, attempts=v.attempts,
                            delivery={"at": 1.0}, outcome=v.outcome,
                            live_attempt_id="fenced:att_2")
    assert code(answer_repeat(delivered, DIGEST)) == "request_already_finished"


def test_a_key_runs_at_most_max_runs_times() -> None:
    hist = tuple({"run": r, "first_attempt": 2 * r - 1, "last_attempt": 2 * r,
                  "outcome": {"outcome": "upstream_failed"}} for r in range(1, MAX_RUNS - 1))
    v = ended(Outcome.UPSTREAM_FAILED, attempts=2 * (MAX_RUNS - 1), history=hist)
    assert v.runs == MAX_RUNS - 1
    res = answer_repeat(v, DIGEST)
    assert isinstance(res, Rerun) and res.run == MAX_RUNS
    last = ended(Outcome.UPSTREAM_FAILED, attempts=2 * MAX_RUNS,
                 history=(*hist, {"run": MAX_RUNS - 1, "first_attempt": 2 * MAX_RUNS - 3,
                                  "last_attempt": 2 * MAX_RUNS - 2}))
    assert last.runs == MAX_RUNS
    res = answer_repeat(last, DIGEST)
    assert isinstance(res, GatewayError) and res.code is ErrorCode.REQUEST_ALREADY_FINISHED
    assert res.retryable is False and "new key" in res.message
    assert code(answer_repeat(last, DIGEST, max_runs=MAX_RUNS + 1)) == "rerun"


def test_a_partial_output_flag_counts_as_delivered() -> None:
    v = ended(Outcome.UPSTREAM_FAILED, partial_output=True)
    assert code(answer_repeat(v)) == "request_already_finished"


def test_the_status_view_shows_every_run() -> None:
    h = {"run": 1, "first_attempt": 1, "last_attempt": 2,
         "outcome": {"outcome": "upstream_failed", "cause": "http 503"}, "reopened_at": 6.0}
    entries = [("meta", json.dumps(META).encode()),
               ("attempts/003", json.dumps(att(3)).encode()),
               ("attempts/001", json.dumps(att(1)).encode()),
               ("attempts/002", json.dumps(att(2)).encode()),
               ("history/001", json.dumps(h).encode()),
               ("guard", b"gw-1")]
    v = assemble(RID, entries, "att_3")
    assert v is not None and v.history == (h,) and v.runs == 2
    assert (v.run_first_attempt, v.last_attempt) == (3, 3)
    d = v.to_dict()
    assert (d["phase"], d["attempt"], d["attempt_id"], d["runs"]) == ("prefill", 3, "att_3", 2)
    assert d["history"] == [h] and [a["attempt"] for a in d["attempts"]] == [1, 2, 3]
    # max_attempts (2) holds per run: run 2 has used one.
    assert d["retry_budget"] == 1
    once = assemble(RID, entries[:4], None)
    assert once is not None and once.to_dict()["runs"] == 1 and once.to_dict()["history"] == []

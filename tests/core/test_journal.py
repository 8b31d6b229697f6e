"""The journal record as operators and clients see it, request ids, and a repeat of a key:
answered from the journal, or run again as the same logical request (decision 0027).
`journal.answer_repeat` decides for every outcome the journal records."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.adapters.ports import RandomIds
from extproc.core.errors import ErrorCode, GatewayError
from extproc.core.intake import classify_request
from extproc.core.journal import (
    MAX_RUNS,
    REQUEST_ID_RE,
    RERUNNABLE,
    JournalView,
    Outcome,
    Phase,
    Rerun,
    _b32,
    answer_repeat,
    assemble,
    new_request_id,
    repeat_answer,
    request_id_for_key,
    rerun_blocker,
    validate_request_id,
)

from .test_intake import _BODY, CFG, RID, _digest, post

# --- journal view -----------------------------------------------------------------------------

META = {"model": "m-1", "stream": True, "max_attempts": 2, "created_at": "t0"}


def attempt(n: int, rev: str | None = "model-x@sha256:aa") -> dict[str, Any]:
    return {"attempt": n, "attempt_id": f"{RID}:a{n}", "replica": "r", "model_revision": rev}


def view(**kw: Any) -> JournalView:
    return JournalView(request_id=RID, meta=META, **kw)


def test_phase_derivation() -> None:
    assert view().phase is Phase.PREFILL
    assert view(attempts=(attempt(1),)).phase is Phase.PREFILL
    assert view(delivery={"at": "t1"}).phase is Phase.DECODE
    assert view(delivery={"at": "t1"}, outcome={"outcome": "completed"}).phase is Phase.DONE
    assert view(outcome={"outcome": "upstream_failed"}).phase is Phase.DONE
    assert not view().first_delta_sent and view(delivery={}).first_delta_sent


def test_to_dict_in_prefill() -> None:
    d = view(attempts=(attempt(1),)).to_dict()
    assert d["request_id"] == RID
    assert d["phase"] == "prefill" and d["attempt"] == 1
    assert d["attempt_id"] == f"{RID}:a1"
    assert d["first_delta_sent"] is False
    assert d["delivered_output_tokens"] == 0
    assert d["model_revision"] == "model-x@sha256:aa"
    assert d["retry_budget"] == 1
    assert d["outcome"] is None and d["finished_at"] is None and d["first_delta_at"] is None
    assert d["created_at"] == "t0"
    assert "error" not in d
    json.dumps(d)  # the status endpoint serializes it


def test_to_dict_without_attempts() -> None:
    d = view().to_dict()
    assert d["attempt"] == 0 and d["attempt_id"] is None and d["model_revision"] is None
    assert d["retry_budget"] == 2


def test_to_dict_retry_budget_never_negative() -> None:
    d = view(attempts=(attempt(1), attempt(2), attempt(3))).to_dict()
    assert d["retry_budget"] == 0 and d["attempt"] == 3


def test_to_dict_interrupted() -> None:
    v = view(attempts=(attempt(1, None), attempt(2, "rev-2")),
             delivery={"at": "t1", "model_revision": "rev-delivered"},
             outcome={"outcome": "upstream_decode_interrupted",
                      "delivered_output_tokens": 37, "cause": "upstream",
                      "finished_at": "t2"})
    d = v.to_dict()
    assert d["phase"] == "done" and d["first_delta_sent"] is True
    assert d["attempt"] == 2 and d["attempt_id"] == f"{RID}:a2"
    assert d["delivered_output_tokens"] == 37
    assert d["model_revision"] == "rev-delivered"
    assert d["outcome"] == "upstream_decode_interrupted" and d["cause"] == "upstream"
    assert d["first_delta_at"] == "t1" and d["finished_at"] == "t2"
    err = d["error"]
    assert err["code"] == "upstream_decode_interrupted"
    assert err["partial_output"] is True and err["retryable"] is False
    assert err["delivered_output_tokens"] == 37 and err["request_id"] == RID
    ce = v.client_error()
    assert ce is not None and ce.code is ErrorCode.UPSTREAM_DECODE_INTERRUPTED


INTERRUPTED = (Outcome.UPSTREAM_DECODE_INTERRUPTED, Outcome.GATEWAY_INTERRUPTED)


@pytest.mark.parametrize("oc", [o for o in Outcome if o not in INTERRUPTED])
def test_client_error_only_for_interrupted(oc: Outcome) -> None:
    v = view(delivery={"at": "t"}, outcome={"outcome": str(oc), "delivered_output_tokens": 3})
    assert v.client_error() is None
    assert "error" not in v.to_dict()
    assert view().client_error() is None


# --- repeat answers ---------------------------------------------------------------------------


def test_repeat_while_in_progress() -> None:
    for v, phase in [(view(), "prefill"), (view(delivery={"at": "t"}), "decode")]:
        err = repeat_answer(v)
        assert err.code is ErrorCode.REQUEST_IN_PROGRESS
        assert err.http_status == 409 and err.retryable is True
        assert err.body()["error"]["phase"] == phase
        assert err.request_id == RID


def test_repeat_after_interruption() -> None:
    err = repeat_answer(view(delivery={"at": "t"}, outcome={
        "outcome": "upstream_decode_interrupted", "delivered_output_tokens": 5}))
    assert err.code is ErrorCode.UPSTREAM_DECODE_INTERRUPTED
    assert err.http_status == 409 and err.retryable is False and err.partial_output is True
    assert err.delivered_output_tokens == 5
    body = err.body()["error"]
    assert body["delivered_output_tokens"] == 5 and body["request_id"] == RID


def test_repeat_after_completion() -> None:
    err = repeat_answer(view(delivery={"at": "t"}, outcome={
        "outcome": "completed", "delivered_output_tokens": 9}))
    assert err.code is ErrorCode.REQUEST_ALREADY_COMPLETED
    assert err.http_status == 409 and err.retryable is False
    body = err.body()["error"]
    assert body["outcome"] == "completed" and body["delivered_output_tokens"] == 9


@pytest.mark.parametrize(("oc", "delivered"), [
    (Outcome.CLIENT_DISCONNECTED, 4), (Outcome.CLIENT_DISCONNECTED, 0),
    (Outcome.UPSTREAM_FAILED, 0), (Outcome.REFUSED, 0),
])
def test_repeat_after_another_end(oc: Outcome, delivered: int) -> None:
    err = repeat_answer(view(outcome={"outcome": str(oc), "delivered_output_tokens": delivered}))
    assert err.code is ErrorCode.REQUEST_ALREADY_FINISHED
    assert err.http_status == 409 and err.retryable is False
    assert err.partial_output is (delivered > 0)
    body = err.body()["error"]
    assert body["outcome"] == str(oc) and body["delivered_output_tokens"] == delivered


# --- a key names one request (its canonical digest) -------------------------------------------


def _with_digest(digest: str | None, **kw: Any) -> JournalView:
    meta = {**META, **({"request_digest": digest} if digest is not None else {})}
    return JournalView(request_id=RID, meta=meta, **kw)


@pytest.mark.parametrize("recorded", [
    {},  # in progress
    {"delivery": {"at": "t"}, "outcome": {"outcome": "completed",
                                          "delivered_output_tokens": 9}},
    {"delivery": {"at": "t"}, "outcome": {"outcome": "upstream_decode_interrupted",
                                          "delivered_output_tokens": 5}},
])
def test_a_different_request_under_a_used_key_is_refused(recorded: dict[str, Any]) -> None:
    d = _digest(_BODY)
    other = _digest({**_BODY, "model": "m-2"})
    err = repeat_answer(_with_digest(d, **recorded), other, "key-1")
    assert err.code is ErrorCode.IDEMPOTENCY_KEY_REUSED
    assert err.http_status == 422 and err.retryable is False and not err.partial_output
    body = err.body()["error"]
    assert "'key-1'" in body["message"] and body["param"] == "Idempotency-Key"
    assert body["request_id"] == RID
    # Nothing of the first request is told to the second.
    assert "delivered_output_tokens" not in body and "outcome" not in body
    # The same request under the key: today's answers, unchanged.
    same = repeat_answer(_with_digest(d, **recorded), d, "key-1")
    assert same.code is not ErrorCode.IDEMPOTENCY_KEY_REUSED and same.http_status == 409


def test_a_record_from_before_digests_is_answered_as_a_repeat() -> None:
    err = repeat_answer(_with_digest(None, delivery={"at": "t"}, outcome={
        "outcome": "completed", "delivered_output_tokens": 9}), _digest(_BODY), "key-1")
    assert err.code is ErrorCode.REQUEST_ALREADY_COMPLETED


# --- request ids ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(tenant=st.text(min_size=1, max_size=40), key=st.text(min_size=1, max_size=80))
def test_request_id_for_key_is_deterministic(tenant: str, key: str) -> None:
    rid = request_id_for_key(tenant, key)
    assert REQUEST_ID_RE.match(rid)
    assert validate_request_id(rid) is None
    assert rid == request_id_for_key(tenant, key)
    assert rid != request_id_for_key(tenant + "x", key)
    assert rid != request_id_for_key(tenant, key + "x")


def test_ids_are_spelled_as_they_always_were() -> None:
    # A repeat after an upgrade must land on the record its key made before: the spelling
    # is pinned (Crockford base32 of the top bits; issue 28 rewrote how it is computed).
    assert request_id_for_key("default", "key-1") == "req_a8wn9eyeverqj7bvqxet9ryhzm"
    assert new_request_id(1764711234567, bytes(range(10))) == "req_01kbgfrz07000g40r40m30e209"
    assert new_request_id(0, b"\xff" * 10) == "req_0000000000zzzzzzzzzzzzzzzz"


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=40), n=st.integers(1, 60))
def test_base32_is_one_character_per_five_bits(data: bytes, n: int) -> None:
    alphabet = "0123456789abcdefghjkmnpqrstvwxyz"
    value = int.from_bytes(data, "big")
    if len(data) * 8 > 5 * n:
        value >>= len(data) * 8 - 5 * n
    assert _b32(data, n) == "".join(alphabet[(value >> (5 * (n - 1 - i))) & 31]
                                    for i in range(n))


def test_tenant_and_key_do_not_run_together() -> None:
    assert request_id_for_key("ab", "c") != request_id_for_key("a", "bc")


@settings(max_examples=200, deadline=None)
@given(t1=st.integers(0, 2**48 - 2), dt=st.integers(1, 10**9),
       r1=st.binary(min_size=10, max_size=10), r2=st.binary(min_size=10, max_size=10))
def test_new_request_id_is_time_ordered(t1: int, dt: int, r1: bytes, r2: bytes) -> None:
    t2 = min(t1 + dt, 2**48 - 1)
    a, b = new_request_id(t1, r1), new_request_id(t2, r2)
    assert REQUEST_ID_RE.match(a) and REQUEST_ID_RE.match(b)
    assert a < b


def test_new_request_id_uses_the_randomness() -> None:
    ids = {RandomIds().request_id() for _ in range(50)}
    assert len(ids) == 50
    assert new_request_id(5, b"\x01" * 10) != new_request_id(5, b"\x02" * 10)
    assert all(REQUEST_ID_RE.match(i) for i in ids)
    with pytest.raises(RuntimeError, match="new_id"):  # no id without the port
        classify_request(post(), CFG)


def test_new_request_id_keeps_every_random_bit() -> None:
    assert new_request_id(5, b"\x00" * 9 + b"\x07") != new_request_id(5, b"\x00" * 10)


def test_gateway_interrupted_says_its_count_is_unknown() -> None:
    from extproc.core.journal import orphan_outcome
    v = view(delivery={"at": "t"}, progress={"delivered_output_tokens": 5})
    assert v.orphaned
    oc = orphan_outcome(v, 1.0)
    assert oc["outcome"] == "gateway_interrupted" and oc["delivered_output_tokens"] == 5
    assert oc["delivered_output_tokens_exact"] is False
    # The checkpoint is what had been handed to Envoy then: it may not all have left
    # (decision 0025) and the stream may have gone on; neither bound holds.
    assert oc["delivered_output_tokens_bound"] == "unknown"
    # Fenced, no checkpoint yet: 0, not a made-up 1 (the released delta may never have left).
    no_checkpoint = orphan_outcome(view(delivery={"at": "t"}), 1.0)
    assert no_checkpoint["delivered_output_tokens"] == 0
    assert no_checkpoint["delivered_output_tokens_bound"] == "unknown"
    settled = view(delivery={"at": "t"}, outcome=oc)
    err = settled.client_error()
    assert err is not None and err.code is ErrorCode.GATEWAY_INTERRUPTED
    assert err.partial_output is True and err.retryable is False
    body = err.body()["error"]
    assert body["delivered_output_tokens"] == 5 and body["delivered_output_tokens_exact"] is False
    # Before the fence nothing was released: 0 is exact and the client may retry.
    none_sent = orphan_outcome(view(), 1.0)
    assert none_sent["delivered_output_tokens"] == 0
    assert none_sent["delivered_output_tokens_exact"] is True
    err0 = view(outcome=none_sent).client_error()
    assert err0 is not None and err0.retryable is True and err0.partial_output is False
    # A request with a live processor or attempt is not orphaned.
    assert not view(delivery={"at": "t"}, guard="gw-1/1").orphaned


# --- a repeat answered or run again (decision 0027) --------------------------------------------

RERUN_RID = "req_0123456789abcdefghjkmnpqrs"
DIGEST = "sha256:" + "a" * 64
RERUN_META = {"model": "m-1", "stream": True, "max_attempts": 2, "request_digest": DIGEST}


def att(n: int, **extra: Any) -> dict[str, Any]:
    return {"attempt": n, "attempt_id": f"att_{n}", **extra}


def ended(outcome: Outcome | str, delivered: int = 0, *, delivery: bool = False,
          live: str | None = None, cause: str | None = "http 503", attempts: int = 2,
          history: tuple[dict[str, Any], ...] = (), **extra: Any) -> JournalView:
    oc = {"outcome": str(outcome), "delivered_output_tokens": delivered, "cause": cause,
          "finished_at": 5.0, **extra}
    return JournalView(request_id=RERUN_RID, meta=RERUN_META,
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
        assert res.http_status == 409 and res.request_id == RERUN_RID


def test_the_list_covers_every_outcome() -> None:
    # A new outcome must be decided here, not fall into a list by accident.
    assert RERUNNABLE | {Outcome.COMPLETED, Outcome.UPSTREAM_DECODE_INTERRUPTED} == set(Outcome)


def test_the_rerun_continues_the_attempt_numbers_and_keeps_the_ended_run() -> None:
    v = ended(Outcome.UPSTREAM_FAILED, attempts=2)
    res = answer_repeat(v, DIGEST, "k-1")
    assert isinstance(res, Rerun)
    assert (res.request_id, res.run, res.first_attempt, res.attempt_offset) == (RERUN_RID, 2, 3, 2)
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
    gappy = JournalView(request_id=RERUN_RID, meta=RERUN_META, attempts=(att(1), att(4)),
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
    v = JournalView(request_id=RERUN_RID, meta=RERUN_META, attempts=(att(1),),
                    live_attempt_id="att_1")
    res = answer_repeat(v, DIGEST)
    assert isinstance(res, GatewayError) and res.code is ErrorCode.REQUEST_IN_PROGRESS
    assert res.body()["error"]["phase"] == "prefill"


def test_an_attempt_that_may_still_run_waits_for_its_fence() -> None:
    v = JournalView(request_id=RERUN_RID, meta=RERUN_META,
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
    delivered = JournalView(request_id=RERUN_RID, meta=RERUN_META, attempts=v.attempts,
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
    entries = [("meta", json.dumps(RERUN_META).encode()),
               ("attempts/003", json.dumps(att(3)).encode()),
               ("attempts/001", json.dumps(att(1)).encode()),
               ("attempts/002", json.dumps(att(2)).encode()),
               ("history/001", json.dumps(h).encode()),
               ("guard", b"gw-1")]
    v = assemble(RERUN_RID, entries, "att_3")
    assert v is not None and v.history == (h,) and v.runs == 2
    assert (v.run_first_attempt, v.last_attempt) == (3, 3)
    d = v.to_dict()
    assert (d["phase"], d["attempt"], d["attempt_id"], d["runs"]) == ("prefill", 3, "att_3", 2)
    assert d["history"] == [h] and [a["attempt"] for a in d["attempts"]] == [1, 2, 3]
    # max_attempts (2) holds per run: run 2 has used one.
    assert d["retry_budget"] == 1
    once = assemble(RERUN_RID, entries[:4], None)
    assert once is not None and once.to_dict()["runs"] == 1 and once.to_dict()["history"] == []

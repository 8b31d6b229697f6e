"""A key whose request ended with nothing delivered runs again (issue 24, finding 8;
decision 0027), through real Envoy, etcd and demo replicas.

Per request_id: the exact events the client received, the attempts each replica logged, and
the journal record (attempts, runs, outcome), not just HTTP codes.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from .conftest import Gateway, Result

pytestmark = pytest.mark.e2e

MAX = 8
ALL_OVERLOADED = {"x-replica-fault": "overloaded:503", "x-replica-fault-attempt": "all"}


def _rows(gw: Gateway, rid: str) -> list[tuple[int, str]]:
    return [(r["attempt"], r["outcome"]) for r in gw.attempts_logged(rid)]


def _failed_run(gw: Gateway, key: str, body: dict[str, Any]) -> tuple[Result, dict[str, Any]]:
    """Every attempt answered 503 (the replicas overloaded): nothing delivered."""
    res = gw.post(body, headers=ALL_OVERLOADED, key=key)
    assert res.status == 503 and res.transport_error is None, res.raw[:300]
    assert res.contents == []
    rid = res.request_id
    assert rid.startswith("req_")
    assert _rows(gw, rid) == [(1, "overloaded"), (2, "overloaded")]
    j = gw.journal(rid)
    assert (j["outcome"], j["cause"], j["first_delta_sent"], j["delivered_output_tokens"]) \
        == ("upstream_failed", "http 503", False, 0), j
    assert [a["attempt"] for a in j["attempts"]] == [1, 2] and j["runs"] == 1
    return res, j


def test_a_key_that_failed_with_nothing_delivered_runs_again_as_the_same_request(
        gw: Gateway) -> None:
    ref = gw.post(gw.body(max_tokens=MAX))
    assert ref.status == 200 and len(ref.contents) == MAX
    key = f"rerun-{time.time_ns()}"
    body = gw.body(max_tokens=MAX)
    first, before = _failed_run(gw, key, body)
    rid = first.request_id

    # A different request under the key is still refused, and changes nothing.
    other = gw.post(gw.body(max_tokens=MAX, prompt="another question"), key=key)
    assert other.status == 422 and other.error is not None
    assert other.error["code"] == "idempotency_key_reused" and other.error["request_id"] == rid
    assert gw.journal(rid) == before
    assert _rows(gw, rid) == [(1, "overloaded"), (2, "overloaded")]

    # The same request again: it runs as the same logical request. Its Envoy attempt 1 (the
    # journal's 3) is killed before any byte; Envoy's attempt 2 (the journal's 4) answers.
    again = gw.post(body, key=key, headers={"x-replica-fault": "kill-before-headers",
                                            "x-replica-fault-attempt": "1"})
    assert again.status == 200 and again.transport_error is None, again.raw[:300]
    assert again.request_id == rid
    assert again.normalized() == ref.normalized() and len(again.contents) == MAX
    assert _rows(gw, rid) == [(1, "overloaded"), (2, "overloaded"), (1, "killed"),
                              (2, "completed")]
    j = gw.journal(rid)
    assert (j["outcome"], j["first_delta_sent"], j["delivered_output_tokens"]) \
        == ("completed", True, MAX), j
    assert [a["attempt"] for a in j["attempts"]] == [1, 2, 3, 4]
    assert j["attempts"][:2] == before["attempts"]  # run 1's records, untouched
    a3, a4 = j["attempts"][2], j["attempts"][3]
    assert a3["released"] is False and a3["ended_at"] >= a3["admitted_at"]
    assert a4["released"] is True and a4["fence"] == "ended_with_request"
    assert len({a["attempt_id"] for a in j["attempts"]}) == 4
    assert (j["attempt"], j["attempt_id"]) == (4, a4["attempt_id"])
    assert j["runs"] == 2 and j["retry_budget"] == 0
    (h,) = j["history"]
    assert (h["run"], h["first_attempt"], h["last_attempt"]) == (1, 1, 2)
    assert h["outcome"]["outcome"] == "upstream_failed" == before["outcome"]
    assert h["outcome"]["finished_at"] == before["finished_at"]
    assert j["created_at"] == before["created_at"]  # the same logical request

    # Completed now: answered from the journal, nothing runs.
    third = gw.post(body, key=key)
    assert third.status == 409 and third.error is not None
    assert third.error["code"] == "request_already_completed"
    assert third.error["request_id"] == rid
    assert len(gw.attempts_logged(rid)) == 4


def test_a_key_whose_answer_was_interrupted_is_answered_from_the_journal(
        gw: Gateway) -> None:
    key = f"interrupted-{time.time_ns()}"
    body = gw.body(max_tokens=MAX)
    first = gw.post(body, headers={"x-replica-fault": "error-after-deltas:2"}, key=key)
    assert first.status == 200 and len(first.contents) == 2
    assert first.error is not None and first.error["code"] == "upstream_decode_interrupted"
    j = gw.journal(first.request_id)
    assert (j["outcome"], j["first_delta_sent"], j["runs"]) == \
        ("upstream_decode_interrupted", True, 1)
    again = gw.post(body, key=key)
    assert again.status == 409 and again.error is not None
    assert again.error["code"] == "upstream_decode_interrupted"
    assert again.error["delivered_output_tokens"] == j["delivered_output_tokens"]
    assert again.error["partial_output"] is True and again.error["retryable"] is False
    assert len(gw.attempts_logged(first.request_id)) == 1  # nothing ran again
    assert gw.journal(first.request_id) == j

"""core/errors: the client contract of every error the gateway writes itself: the OpenAI
shape plus request_id, partial_output, retryable and delivered_output_tokens, the status of
each, and what a repeat of a recorded interruption is told."""

from __future__ import annotations

import json

import pytest

from extproc.core import errors as X
from extproc.core.errors import ErrorCode, GatewayError


def test_codes_are_their_names_in_snake_case() -> None:
    assert all(c.value == c.name.lower() for c in ErrorCode)


def test_the_body_is_the_openai_shape_with_our_fields() -> None:
    e = GatewayError(ErrorCode.JOURNAL_UNAVAILABLE, "m", 503, request_id="req_1",
                     retryable=True, extra=(("phase", "done"),))
    assert e.body() == {"error": {"message": "m", "type": "server_error",
                                  "code": "journal_unavailable", "request_id": "req_1",
                                  "partial_output": False, "retryable": True,
                                  "phase": "done"}}
    assert X.bad_request(ErrorCode.INVALID_HEADER, "h").body()["error"]["type"] \
        == "gateway_error"  # a 4xx is the client's
    assert "delivered_output_tokens" not in e.body()["error"]  # only when counted
    assert json.loads(e.json_bytes()) == e.body()
    assert b" " not in e.json_bytes()  # compact: it goes on the wire


def test_a_5xx_is_the_server_s_error_a_4xx_the_client_s() -> None:
    def kind(status: int) -> str:
        return str(GatewayError(ErrorCode.INVALID_HEADER, "m", status).body()["error"]["type"])
    assert [kind(s) for s in (400, 499, 500, 503)] == ["gateway_error", "gateway_error",
                                                        "server_error", "server_error"]


def test_the_sse_form_is_one_event_then_done() -> None:
    e = X.decode_interrupted("req_1", 7)
    assert e.sse_bytes() == b"data: " + e.json_bytes() + b"\n\ndata: [DONE]\n\n"


def test_an_interruption_after_output_is_partial_and_not_retried_by_the_gateway() -> None:
    e = X.decode_interrupted("req_1", 12, exact=True)
    body = e.body()["error"]
    assert (e.http_status, body["partial_output"], body["retryable"]) == (502, True, False)
    assert (body["delivered_output_tokens"], body["delivered_output_tokens_exact"]) == (12, True)
    # A record written before the count's exactness was kept says nothing about it.
    assert "delivered_output_tokens_exact" not in X.decode_interrupted("r", 1).body()["error"]


CONSTRUCTED = [
    (X.upstream_timeout("r", 30.0, 2), 504, ErrorCode.UPSTREAM_TIMEOUT, True),
    (X.budget_exhausted("r", 3, 10, 2), 503, ErrorCode.RETRY_BUDGET_EXHAUSTED, True),
    (X.attempts_exhausted("r", 4, 3), 503, ErrorCode.RETRY_BUDGET_EXHAUSTED, False),
    (X.too_expensive("r", 9000, 8000), 503, ErrorCode.RETRY_TOO_EXPENSIVE, True),
    (X.no_compatible_replica("r", "none"), 503, ErrorCode.NO_COMPATIBLE_REPLICA, True),
    (X.journal_unavailable("r"), 503, ErrorCode.JOURNAL_UNAVAILABLE, True),
    (X.tool_ledger_unavailable("r"), 503, ErrorCode.JOURNAL_UNAVAILABLE, True),
    (X.attempt_not_admitted("r", "why"), 503, ErrorCode.ATTEMPT_NOT_ADMITTED, False),
    (X.upstream_unavailable("r", "reset"), 503, ErrorCode.UPSTREAM_UNAVAILABLE, True),
    (X.upstream_unavailable("r", "slow", 504), 504, ErrorCode.UPSTREAM_TIMEOUT, True),
    (X.body_required("r"), 400, ErrorCode.INVALID_REQUEST_BODY, False),
    (X.request_not_found("r"), 404, ErrorCode.REQUEST_NOT_FOUND, False),
    (X.request_in_progress("r", "running"), 409, ErrorCode.REQUEST_IN_PROGRESS, True),
    (X.request_fence_pending("r", 5.0), 409, ErrorCode.REQUEST_IN_PROGRESS, True),
    (X.request_already_completed("r", 3), 409, ErrorCode.REQUEST_ALREADY_COMPLETED, False),
    (X.request_already_finished("r", "x", 0), 409, ErrorCode.REQUEST_ALREADY_FINISHED, False),
    (X.idempotency_key_reused("r", "k"), 422, ErrorCode.IDEMPOTENCY_KEY_REUSED, False),
    (X.tool_result_not_replayable("r", "k", 9, 200, "h"), 409,
     ErrorCode.TOOL_RESULT_NOT_REPLAYABLE, False),
    (X.tool_outcome_unknown("r", "k", "why"), 409, ErrorCode.TOOL_CALL_OUTCOME_UNKNOWN, False),
    (X.attempt_fenced("r", "a"), 409, ErrorCode.ATTEMPT_FENCED, False),
    (X.tool_in_progress("r", "k"), 409, ErrorCode.TOOL_CALL_IN_PROGRESS, True),
    (X.tool_call_unauthorized("r", "a"), 403, ErrorCode.TOOL_CALL_UNAUTHORIZED, False),
    (X.tool_route_not_here("/p", True), 404, ErrorCode.TOOL_ROUTE_NOT_HERE, False),
]


@pytest.mark.parametrize(("err", "status", "code", "retryable"), CONSTRUCTED)
def test_each_constructor_says_its_status_code_and_whether_the_gateway_retries(
        err: GatewayError, status: int, code: ErrorCode, retryable: bool) -> None:
    assert (err.http_status, err.code, err.retryable) == (status, code, retryable)
    assert err.body()["error"]["type"] == ("server_error" if status >= 500 else "gateway_error")


def test_the_timeout_counts_its_attempts_in_words() -> None:
    assert "(1 attempt)" in X.upstream_timeout("r", 1.0, 1).message
    assert "(2 attempts)" in X.upstream_timeout("r", 1.0, 2).message


def test_a_gateway_interruption_is_retryable_only_before_any_output() -> None:
    before = X.gateway_interrupted("r", first_delta_sent=False, delivered=0, exact=True)
    after = X.gateway_interrupted("r", first_delta_sent=True, delivered=4, exact=False)
    assert (before.retryable, before.partial_output) == (True, False)
    assert (after.retryable, after.partial_output) == (False, True)
    assert after.body()["error"]["delivered_output_tokens_exact"] is False


def test_a_repeat_is_told_the_recorded_error_as_409_never_retried() -> None:
    first = X.decode_interrupted("req_1", 5, exact=False)
    again = X.repeat_of(first)
    assert (again.http_status, again.retryable) == (409, False)
    assert {k: v for k, v in again.body()["error"].items() if k != "type"} \
        == {k: v for k, v in first.body()["error"].items() if k != "type"}


def test_a_finished_request_is_partial_only_if_something_was_delivered() -> None:
    assert not X.request_already_finished("r", "client_disconnected", 0).partial_output
    assert X.request_already_finished("r", "client_disconnected", 2).partial_output


def test_the_fence_pending_answer_says_when_only_if_known() -> None:
    assert X.request_fence_pending("r", 12.5).body()["error"]["fence_expires_at"] == 12.5
    assert "fence_expires_at" not in X.request_fence_pending("r", None).body()["error"]


@pytest.mark.parametrize("err", [c[0] for c in CONSTRUCTED] + [
    X.decode_interrupted("r", 7, True), X.decode_interrupted("r", 0),
    GatewayError(ErrorCode.INVALID_HEADER, "m", 400)])
def test_an_error_comes_back_whole_from_the_body_the_client_got(err: GatewayError) -> None:
    # A trace keeps an error as its body; replay re-decides from what comes back, so every
    # field must (retryable, partial output, the count, the extra fields). A count some
    # constructors put in `extra` comes back as the field: the same body either way.
    back = GatewayError.from_body(err.body(), err.http_status, ErrorCode.JOURNAL_UNAVAILABLE)
    assert back.body() == err.body()
    assert (back.code, back.message, back.http_status, back.request_id, back.retryable,
            back.partial_output) == (err.code, err.message, err.http_status, err.request_id,
                                     err.retryable, err.partial_output)


def test_a_body_without_a_code_takes_the_default() -> None:
    back = GatewayError.from_body({"error": {"message": "m"}}, 503,
                                  ErrorCode.JOURNAL_UNAVAILABLE)
    assert (back.code, back.message, back.retryable, back.extra) == (
        ErrorCode.JOURNAL_UNAVAILABLE, "m", False, ())

"""The client contract: every error the gateway itself produces, in one place.

Errors follow the OpenAI error shape (`{"error": {"message", "type", "code", ...}}`) so that
existing SDKs surface them, plus the fields the mission requires (`request_id`,
`partial_output`, `retryable`, `delivered_output_tokens`). `retryable` always speaks about
the *gateway*: false means the gateway will not silently re-run it; the user still may.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    UPSTREAM_DECODE_INTERRUPTED = "upstream_decode_interrupted"
    GATEWAY_INTERRUPTED = "gateway_interrupted"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    REQUEST_IN_PROGRESS = "request_in_progress"
    REQUEST_ALREADY_COMPLETED = "request_already_completed"
    REQUEST_ALREADY_FINISHED = "request_already_finished"
    REQUEST_NOT_FOUND = "request_not_found"
    INVALID_REQUEST_ID = "invalid_request_id"
    INVALID_REQUEST_BODY = "invalid_request_body"
    REQUEST_BODY_TOO_LARGE = "request_body_too_large"
    MISSING_IDEMPOTENCY_KEY = "missing_idempotency_key"
    INVALID_IDEMPOTENCY_KEY = "invalid_idempotency_key"
    INVALID_HEADER = "invalid_header"
    ATTEMPT_NOT_ADMITTED = "attempt_not_admitted"
    RETRY_BUDGET_EXHAUSTED = "retry_budget_exhausted"
    JOURNAL_UNAVAILABLE = "journal_unavailable"
    UPSTREAM_RESPONSE_TOO_LARGE = "upstream_response_too_large"
    UPSTREAM_MALFORMED_RESPONSE = "upstream_malformed_response"
    ATTEMPT_FENCED = "attempt_fenced"
    RETRY_TOO_EXPENSIVE = "retry_too_expensive"
    NO_COMPATIBLE_REPLICA = "no_compatible_replica"
    TOOL_CALL_IN_PROGRESS = "tool_call_in_progress"
    TOOL_CALL_OUTCOME_UNKNOWN = "tool_call_outcome_unknown"
    TOOL_RESULT_NOT_REPLAYABLE = "tool_result_not_replayable"


INTERRUPTED_MESSAGE = "Generation was interrupted after part of the answer was sent"


@dataclass(frozen=True, slots=True)
class GatewayError:
    """An error the gateway answers itself, with the HTTP status used when it can choose one."""

    code: ErrorCode
    message: str
    http_status: int
    request_id: str | None = None
    retryable: bool = False
    partial_output: bool = False
    delivered_output_tokens: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {
            "message": self.message,
            "type": "gateway_error" if self.http_status < 500 else "server_error",
            "code": str(self.code),
            "request_id": self.request_id,
            "partial_output": self.partial_output,
            "retryable": self.retryable,
        }
        if self.delivered_output_tokens is not None:
            err["delivered_output_tokens"] = self.delivered_output_tokens
        for k, v in self.extra:
            err[k] = v
        return {"error": err}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body(), separators=(",", ":")).encode()

    def sse_bytes(self) -> bytes:
        """The terminal SSE event followed by `[DONE]`, as the stream's last bytes."""
        return b"data: " + self.json_bytes() + b"\n\ndata: [DONE]\n\n"


def decode_interrupted(request_id: str, delivered_output_tokens: int) -> GatewayError:
    return GatewayError(
        code=ErrorCode.UPSTREAM_DECODE_INTERRUPTED,
        message=INTERRUPTED_MESSAGE,
        http_status=502,
        request_id=request_id,
        retryable=False,
        partial_output=True,
        delivered_output_tokens=delivered_output_tokens,
    )


def bad_request(code: ErrorCode, message: str, request_id: str | None = None,
                status: int = 400) -> GatewayError:
    return GatewayError(code=code, message=message, http_status=status, request_id=request_id)


def upstream_timeout(request_id: str | None, waited_s: float, attempts: int) -> GatewayError:
    """The request's first-delta budget ran out; nothing reached the client."""
    return GatewayError(
        code=ErrorCode.UPSTREAM_TIMEOUT,
        message=f"no replica produced a first delta within {waited_s:.1f} s "
                f"({attempts} attempt{'s' if attempts != 1 else ''}); nothing was sent",
        http_status=504, request_id=request_id, retryable=True)


def budget_exhausted(rid: str, retries: int, requests: int, limit: int) -> GatewayError:
    return GatewayError(
        ErrorCode.RETRY_BUDGET_EXHAUSTED,
        f"the pool's retry budget is exhausted ({retries} retries for {requests} requests "
        f"in the window, limit {limit}); nothing was sent to the client",
        503, request_id=rid, retryable=True)


def too_expensive(rid: str, tokens: int, limit: int) -> GatewayError:
    return GatewayError(
        ErrorCode.RETRY_TOO_EXPENSIVE,
        f"re-running this request's prefill (~{tokens} prompt tokens) exceeds the retry cost "
        f"limit ({limit}); nothing was sent to the client",
        503, request_id=rid, retryable=True,
        extra=(("estimated_prompt_tokens", tokens),))


def no_compatible_replica(rid: str | None, why: str) -> GatewayError:
    return GatewayError(ErrorCode.NO_COMPATIBLE_REPLICA,
                        f"no compatible healthy replica: {why}", 503, request_id=rid,
                        retryable=True)


def journal_unavailable(rid: str | None, what: str = "nothing was run") -> GatewayError:
    """etcd did not answer: fail closed, before anything ran or was sent."""
    return GatewayError(ErrorCode.JOURNAL_UNAVAILABLE,
                        f"the request journal is unavailable; {what}", 503,
                        request_id=rid, retryable=True)


def tool_ledger_unavailable(rid: str | None) -> GatewayError:
    return GatewayError(ErrorCode.JOURNAL_UNAVAILABLE,
                        "the tool ledger is unavailable; the tool was not called", 503,
                        request_id=rid, retryable=True)


def attempt_not_admitted(rid: str | None, reason: str) -> GatewayError:
    return GatewayError(ErrorCode.ATTEMPT_NOT_ADMITTED, reason, 503, request_id=rid,
                        retryable=False)


def attempts_exhausted(rid: str | None, attempt: int, max_attempts: int) -> GatewayError:
    return GatewayError(ErrorCode.RETRY_BUDGET_EXHAUSTED,
                        f"attempt {attempt} exceeds max_attempts {max_attempts}",
                        503, request_id=rid, retryable=False)

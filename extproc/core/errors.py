"""The client contract: every error the gateway itself produces, in one place.

Errors follow the OpenAI error shape (`{"error": {"message", "type", "code", ...}}`) so that
existing SDKs surface them, plus the fields the mission requires (`request_id`,
`partial_output`, `retryable`, `delivered_output_tokens`). `retryable` always speaks about
the *gateway*: false means the gateway will not silently re-run it; the user still may.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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
    IDEMPOTENCY_KEY_REUSED = "idempotency_key_reused"
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
    TOOL_CALL_UNAUTHORIZED = "tool_call_unauthorized"
    TOOL_ROUTE_NOT_HERE = "tool_route_not_here"


# The fields `GatewayError.body` always writes or derives (the rest are `extra`'s).
_BODY_FIELDS = frozenset({"message", "type", "code", "request_id", "partial_output",
                          "retryable", "delivered_output_tokens"})

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

    @classmethod
    def from_body(cls, body: Mapping[str, Any], http_status: int,
                  default: ErrorCode) -> GatewayError:
        """The error whose `body()` this is (a trace keeps errors as the body the client
        got): every field back, those `body` adds to the known ones as `extra`."""
        e = body.get("error", {})
        known = _BODY_FIELDS
        tokens = e.get("delivered_output_tokens")
        return cls(ErrorCode(e.get("code", default)), str(e.get("message", "")), http_status,
                   request_id=e.get("request_id"), retryable=bool(e.get("retryable", False)),
                   partial_output=bool(e.get("partial_output", False)),
                   delivered_output_tokens=None if tokens is None else int(tokens),
                   extra=tuple((k, v) for k, v in e.items() if k not in known))

    def json_bytes(self) -> bytes:
        return json.dumps(self.body(), separators=(",", ":")).encode()

    def sse_bytes(self) -> bytes:
        """The terminal SSE event followed by `[DONE]`, as the stream's last bytes."""
        return b"data: " + self.json_bytes() + b"\n\ndata: [DONE]\n\n"


def decode_interrupted(request_id: str, delivered_output_tokens: int,
                       exact: bool | None = None) -> GatewayError:
    """`exact`: whether the count is the engine's own (decision 0018); None for records
    written before the field existed."""
    return GatewayError(
        code=ErrorCode.UPSTREAM_DECODE_INTERRUPTED,
        message=INTERRUPTED_MESSAGE,
        http_status=502,
        request_id=request_id,
        retryable=False,
        partial_output=True,
        delivered_output_tokens=delivered_output_tokens,
        extra=() if exact is None else (("delivered_output_tokens_exact", exact),),
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
        f"the pool's retry budget is exhausted ({retries} re-prefills in flight for "
        f"{requests} requests in flight, limit {limit}); nothing was sent to the client",
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


def attempt_not_admitted(rid: str | None, reason: str,
                         retryable: bool = False) -> GatewayError:
    return GatewayError(ErrorCode.ATTEMPT_NOT_ADMITTED, reason, 503, request_id=rid,
                        retryable=retryable)


def attempts_exhausted(rid: str | None, attempt: int, max_attempts: int) -> GatewayError:
    return GatewayError(ErrorCode.RETRY_BUDGET_EXHAUSTED,
                        f"attempt {attempt} exceeds max_attempts {max_attempts}",
                        503, request_id=rid, retryable=False)


# --- the upstream --------------------------------------------------------------------


def upstream_unavailable(request_id: str | None, why: str, status: int = 503) -> GatewayError:
    """No replica produced an answer (the gate failed an attempt, or Envoy's own 5xx)."""
    code = ErrorCode.UPSTREAM_TIMEOUT if status == 504 else ErrorCode.UPSTREAM_UNAVAILABLE
    return GatewayError(code, f"no replica produced an answer ({why})", status,
                        request_id=request_id, retryable=True)


# --- intake and lookups ---------------------------------------------------------------


def body_required(request_id: str | None) -> GatewayError:
    return GatewayError(ErrorCode.INVALID_REQUEST_BODY, "a JSON request body is required",
                        400, request_id=request_id)


def request_not_found(request_id: str | None) -> GatewayError:
    """Also what another tenant's request looks like: indistinguishable from a missing one."""
    return GatewayError(ErrorCode.REQUEST_NOT_FOUND, "no request with this id", 404,
                        request_id=request_id)


# --- what a repeat of a known request is told (journal.repeat_answer decides which) ----


def gateway_interrupted(request_id: str, first_delta_sent: bool, delivered: int,
                        exact: bool) -> GatewayError:
    return GatewayError(
        code=ErrorCode.GATEWAY_INTERRUPTED,
        message="The gateway serving this request failed before it ended"
        + ("; part of the answer was sent" if first_delta_sent else ""),
        http_status=502, request_id=request_id, retryable=not first_delta_sent,
        partial_output=first_delta_sent, delivered_output_tokens=delivered,
        extra=(("delivered_output_tokens_exact", exact),))


def request_in_progress(request_id: str, phase: str) -> GatewayError:
    return GatewayError(
        code=ErrorCode.REQUEST_IN_PROGRESS,
        message="A request with this Idempotency-Key is still in progress; "
        "poll GET /v1/requests/{request_id}",
        http_status=409, request_id=request_id, retryable=True, extra=(("phase", phase),))


def request_fence_pending(request_id: str, expires_at: float | None) -> GatewayError:
    """A repeat of a request that may run again (nothing was delivered) while one of its
    attempts may still be running on a replica: it runs once that attempt is fenced."""
    return GatewayError(
        code=ErrorCode.REQUEST_IN_PROGRESS,
        message="An attempt of the request with this Idempotency-Key may still be running "
        "on a replica; repeat it once that attempt's lease has expired and it runs again",
        http_status=409, request_id=request_id, retryable=True,
        extra=(("phase", "done"),) + ((("fence_expires_at", expires_at),)
                                      if expires_at is not None else ()))


def repeat_of(err: GatewayError) -> GatewayError:
    """The recorded interruption, answered again to a repeat (409: nothing runs again)."""
    return GatewayError(code=err.code, message=err.message, http_status=409,
                        request_id=err.request_id, retryable=False,
                        partial_output=err.partial_output,
                        delivered_output_tokens=err.delivered_output_tokens, extra=err.extra)


def request_already_completed(request_id: str, delivered: int) -> GatewayError:
    return GatewayError(
        code=ErrorCode.REQUEST_ALREADY_COMPLETED,
        message="A request with this Idempotency-Key already completed; "
        "send a new key for a new request",
        http_status=409, request_id=request_id, retryable=False,
        extra=(("outcome", "completed"), ("delivered_output_tokens", delivered)))


def request_already_finished(request_id: str, outcome: str, delivered: int) -> GatewayError:
    return GatewayError(
        code=ErrorCode.REQUEST_ALREADY_FINISHED,
        message=f"A request with this Idempotency-Key already ended ({outcome}); "
        "send a new key for a new request",
        http_status=409, request_id=request_id, retryable=False,
        partial_output=delivered > 0,
        extra=(("outcome", outcome), ("delivered_output_tokens", delivered)))


def idempotency_key_reused(request_id: str, key: str) -> GatewayError:
    """The key names another request (a different body or endpoint): nothing runs, nothing
    of the first request is told (422, as payment APIs answer a reused key)."""
    return GatewayError(
        code=ErrorCode.IDEMPOTENCY_KEY_REUSED,
        message=f"Idempotency-Key {key!r} was already used for a different request (the "
        "model, messages, parameters or endpoint differ); send a new key for a new request",
        http_status=422, request_id=request_id, retryable=False,
        extra=(("param", "Idempotency-Key"),))


# --- server-side tools ----------------------------------------------------------------


def tool_result_not_replayable(request_id: str, key: str, size: Any, status: Any,
                               sha256: Any) -> GatewayError:
    return GatewayError(
        ErrorCode.TOOL_RESULT_NOT_REPLAYABLE,
        f"tool call {key} already ran; its result ({size} bytes) was too large to record, "
        "so it cannot be replayed and is not run again",
        409, request_id=request_id, retryable=False,
        extra=(("status", status), ("sha256", sha256)))


def tool_outcome_unknown(request_id: str, key: str, reason: str) -> GatewayError:
    return GatewayError(
        ErrorCode.TOOL_CALL_OUTCOME_UNKNOWN,
        f"tool call {key} was started but its result was never recorded ({reason}); it may "
        "or may not have run, so the gateway will not run it again",
        409, request_id=request_id, retryable=False)


def attempt_fenced(request_id: str, attempt_id: str) -> GatewayError:
    return GatewayError(
        ErrorCode.ATTEMPT_FENCED,
        f"attempt {attempt_id} is not the live attempt of {request_id}: "
        "a fenced attempt may not trigger side effects",
        409, request_id=request_id, retryable=False)


def tool_in_progress(request_id: str, key: str) -> GatewayError:
    return GatewayError(ErrorCode.TOOL_CALL_IN_PROGRESS,
                        f"tool call {key} is being executed by another call",
                        409, request_id=request_id, retryable=True)


def tool_call_unauthorized(request_id: str, attempt_id: str) -> GatewayError:
    """A tool call without the live attempt's credential: missing, malformed and wrong
    secrets get this one answer (no oracle), and nothing is claimed or run."""
    return GatewayError(
        ErrorCode.TOOL_CALL_UNAUTHORIZED,
        f"tool calls of attempt {attempt_id} need that attempt's credential in the "
        "x-gateway-attempt-secret header: it is missing or does not match",
        403, request_id=request_id, retryable=False)


def tool_route_not_here(path: str, tools_listener: bool) -> GatewayError:
    """The tool route is served only on the tool listener, and that listener serves nothing
    else (decision 0028)."""
    where = ("this listener serves only the tool route" if tools_listener
             else "the tool route is not served on the client listener")
    return GatewayError(ErrorCode.TOOL_ROUTE_NOT_HERE, f"{where}: {path!r}", 404)

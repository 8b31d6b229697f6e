"""Side effects happen once: the tool-call ledger's rules, without I/O.

A model worker calls a server-side tool through the gateway's tool route with four headers
(`x-gateway-request-id`, `x-gateway-attempt-id`, `x-tool-call-id` and its attempt's
credential, `x-gateway-attempt-secret`: decision 0028; `core.credentials`). The ledger key is the
mission's `idempotency_key = <logical_request_id>:<tool_call_id>`: it names the *logical*
request, not the GPU attempt, so a re-run on another replica finds the earlier execution.

Entry states:
  running   claimed by one call, forwarded to the tool server, result not yet recorded
  done      result recorded (any HTTP status: a tool's error is an answer too); replayed
  unknown   the executing call ended without a result (tool server or executor died): the
            action may or may not have happened, so it is never run again automatically
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import errors
from .errors import ErrorCode, GatewayError, bad_request, tool_call_unauthorized
from .headers import ATTEMPT_ID, ATTEMPT_SECRET, REQUEST_ID
from .journal import REQUEST_ID_RE

TOOL_CALL_ID = "x-tool-call-id"
REPLAYED = "x-tool-replayed"
CALL_ID_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
ATTEMPT_ID_RE = re.compile(r"^att_[0-9a-z]{26}$")
# Response headers kept with a result and replayed (the rest are transport details).
KEPT_HEADERS = ("content-type",)


@dataclass(frozen=True, slots=True)
class ToolCall:
    request_id: str
    attempt_id: str
    call_id: str
    tool: str
    # The presented credential: checked against the journal's digest, never logged or
    # printed (kept out of repr), never forwarded to the tool server.
    secret: str = field(default="", repr=False)

    @property
    def key(self) -> str:
        return f"{self.request_id}:{self.call_id}"


def parse_tool_call(headers: Mapping[str, str], prefix: str) -> ToolCall | GatewayError:
    path = headers.get(":path", "").split("?", 1)[0]
    tool = path[len(prefix):]
    if headers.get(":method") != "POST":
        return bad_request(ErrorCode.INVALID_HEADER, "tool calls are POST requests", status=405)
    if not tool or "/" in tool or not CALL_ID_RE.match(tool):
        return bad_request(ErrorCode.INVALID_HEADER, f"bad tool name in {path!r}")
    rid = headers.get(REQUEST_ID, "")
    aid = headers.get(ATTEMPT_ID, "")
    cid = headers.get(TOOL_CALL_ID, "")
    if not REQUEST_ID_RE.match(rid):
        return bad_request(ErrorCode.INVALID_HEADER,
                           f"tool calls need a valid {REQUEST_ID} header")
    if not ATTEMPT_ID_RE.match(aid):
        return bad_request(ErrorCode.INVALID_HEADER,
                           f"tool calls need a valid {ATTEMPT_ID} header", rid)
    if not CALL_ID_RE.match(cid):
        return bad_request(ErrorCode.INVALID_HEADER,
                           f"tool calls need a {TOOL_CALL_ID} header of 1-128 "
                           "characters [A-Za-z0-9_.:-]", rid)
    secret = headers.get(ATTEMPT_SECRET, "")
    if not secret:
        # 403 like a wrong one, with the same body: its absence tells a caller nothing new.
        return tool_call_unauthorized(rid, aid)
    return ToolCall(request_id=rid, attempt_id=aid, call_id=cid, tool=tool, secret=secret)


def unauthorized_error(call: ToolCall) -> GatewayError:
    return tool_call_unauthorized(call.request_id, call.attempt_id)


def running_entry(call: ToolCall, now: float) -> dict[str, Any]:
    return {"key": call.key, "tool": call.tool, "state": "running",
            "attempt_id": call.attempt_id, "started_at": now}


class ResultCapture:
    """Accumulates a tool result as it streams back, keeping at most `max_bytes` of it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.kept = bytearray()
        self.size = 0
        self.digest = hashlib.sha256()

    def add(self, data: bytes) -> None:
        self.size += len(data)
        self.digest.update(data)
        if len(self.kept) <= self.max_bytes:
            self.kept += data[: self.max_bytes + 1 - len(self.kept)]

    @property
    def too_large(self) -> bool:
        return self.size > self.max_bytes


def done_entry(running: Mapping[str, Any], status: int, headers: Mapping[str, str],
               result: ResultCapture, now: float) -> dict[str, Any]:
    """The recorded result; a body over the limit is recorded by digest only."""
    e = dict(running)
    e.update(state="done", status=status, finished_at=now, size=result.size,
             sha256=result.digest.hexdigest(),
             headers={k: v for k, v in headers.items() if k in KEPT_HEADERS})
    if result.too_large:
        e["truncated"] = True
    else:
        e["body_b64"] = base64.b64encode(bytes(result.kept)).decode()
    return e


def unknown_entry(running: Mapping[str, Any], reason: str, now: float) -> dict[str, Any]:
    e = dict(running)
    e.update(state="unknown", reason=reason, finished_at=now)
    return e


@dataclass(frozen=True, slots=True)
class Replay:
    status: int
    headers: dict[str, str]
    body: bytes


def answer_for(entry: Mapping[str, Any], call: ToolCall,
               executor_alive: bool) -> Replay | GatewayError | None:
    """What a repeat of a recorded call gets; None means "still running: wait"."""
    state = entry.get("state")
    if state == "done":
        if entry.get("truncated"):
            return errors.tool_result_not_replayable(call.request_id, call.key,
                                                     entry.get("size"), entry.get("status"),
                                                     entry.get("sha256"))
        hdrs = dict(entry.get("headers") or {})
        hdrs[REPLAYED] = "true"
        return Replay(status=int(entry["status"]), headers=hdrs,
                      body=base64.b64decode(entry.get("body_b64", "")))
    if state == "running" and executor_alive:
        return None
    return errors.tool_outcome_unknown(call.request_id, call.key,
                                       str(entry.get("reason", "its executor died")))


def fenced_error(call: ToolCall) -> GatewayError:
    return errors.attempt_fenced(call.request_id, call.attempt_id)


def in_progress_error(call: ToolCall) -> GatewayError:
    return errors.tool_in_progress(call.request_id, call.key)

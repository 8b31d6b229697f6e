"""The tool ledger's rules without I/O."""

from __future__ import annotations

import base64

import pytest

from extproc.core.errors import ErrorCode, GatewayError
from extproc.core.tools import (
    Replay,
    ResultCapture,
    ToolCall,
    answer_for,
    done_entry,
    parse_tool_call,
    running_entry,
    unauthorized_error,
    unknown_entry,
)

RID = "req_" + "a" * 26
AID = "att_" + "b" * 26
SECRET = "s" * 43


def hdrs(**kw: str) -> dict[str, str]:
    h = {":method": "POST", ":path": "/tools/demo_tool", "x-gateway-request-id": RID,
         "x-gateway-attempt-id": AID, "x-tool-call-id": "call_07",
         "x-gateway-attempt-secret": SECRET}
    h.update(kw)
    return h


def test_parse_and_key_uses_the_logical_request() -> None:
    call = parse_tool_call(hdrs(), "/tools/")
    assert call == ToolCall(RID, AID, "call_07", "demo_tool", SECRET)
    assert isinstance(call, ToolCall) and call.key == f"{RID}:call_07"
    assert SECRET not in repr(call)  # a logged call never shows its credential


def test_a_call_without_its_attempt_credential_is_403_not_400() -> None:
    no_secret = hdrs()
    del no_secret["x-gateway-attempt-secret"]
    for h in (no_secret, hdrs(**{"x-gateway-attempt-secret": ""})):
        err = parse_tool_call(h, "/tools/")
        assert isinstance(err, GatewayError)
        assert (err.http_status, err.code) == (403, ErrorCode.TOOL_CALL_UNAUTHORIZED)
        # The same answer a wrong secret gets from the tool route (no oracle).
        call = parse_tool_call(hdrs(), "/tools/")
        assert isinstance(call, ToolCall)
        assert err.json_bytes() == unauthorized_error(call).json_bytes()
        assert err.request_id == RID and err.retryable is False


@pytest.mark.parametrize("bad", [
    {":method": "GET"}, {":path": "/tools/"}, {":path": "/tools/a/b"},
    {"x-gateway-request-id": "nope"}, {"x-gateway-attempt-id": "att_x"},
    {"x-tool-call-id": ""}, {"x-tool-call-id": "has space"}, {"x-tool-call-id": "x" * 129},
])
def test_bad_calls_are_refused(bad: dict[str, str]) -> None:
    assert isinstance(parse_tool_call(hdrs(**bad), "/tools/"), GatewayError)


def test_recorded_result_replays_exactly() -> None:
    call = parse_tool_call(hdrs(), "/tools/")
    assert isinstance(call, ToolCall)
    cap = ResultCapture(100)
    cap.add(b'{"a":')
    cap.add(b"1}")
    e = done_entry(running_entry(call, 1.0), 201, {"content-type": "application/json",
                                                     "date": "x"}, cap, 2.0)
    assert base64.b64decode(e["body_b64"]) == b'{"a":1}' and e["headers"] == {
        "content-type": "application/json"}
    ans = answer_for(e, call, executor_alive=False)
    assert ans == Replay(201, {"content-type": "application/json", "x-tool-replayed": "true"},
                         b'{"a":1}')


def test_too_large_running_and_unknown() -> None:
    call = parse_tool_call(hdrs(), "/tools/")
    assert isinstance(call, ToolCall)
    cap = ResultCapture(4)
    cap.add(b"0123456789")
    e = done_entry(running_entry(call, 1.0), 200, {}, cap, 2.0)
    assert e["truncated"] is True and e["size"] == 10 and "body_b64" not in e
    big = answer_for(e, call, executor_alive=True)
    assert isinstance(big, GatewayError) and big.code is ErrorCode.TOOL_RESULT_NOT_REPLAYABLE
    run = running_entry(call, 1.0)
    assert answer_for(run, call, executor_alive=True) is None  # wait for it
    dead = answer_for(run, call, executor_alive=False)  # its executor died: unknown
    assert isinstance(dead, GatewayError) and dead.code is ErrorCode.TOOL_CALL_OUTCOME_UNKNOWN
    unk = answer_for(unknown_entry(run, "x", 3.0), call, executor_alive=True)
    assert isinstance(unk, GatewayError) and unk.code is ErrorCode.TOOL_CALL_OUTCOME_UNKNOWN
    assert unk.retryable is False

"""adapters/tools: the tool route's executor. core.tool_route's actions become codec writes
and ledger calls, a wait's answer is fed back as the next event: one call runs, is recorded
with its result and replayed to a repeat from the ledger; with the ledger away nothing is
forwarded (fail closed); each decision is said once in the log, never with the secret. (The
credential's refusals, on the hermetic harness: test_sessions.py.)"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from extproc.adapters.processor import Processor
from extproc.adapters.tools import ToolCallHandler
from extproc.core import headers as H
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from .support import FakeClock, FakeTimers, idle
from .test_sessions import SECRET_A, TOOL_AID, TOOL_RID, immediate, two_live_requests

HD = {":method": "POST", ":path": "/tools/demo_tool", H.REQUEST_ID: TOOL_RID,
      H.ATTEMPT_ID: TOOL_AID, "x-tool-call-id": "call_1", H.ATTEMPT_SECRET: SECRET_A}


def _handler(p: Processor) -> tuple[ToolCallHandler, list[ep.ProcessingResponse]]:
    out: list[ep.ProcessingResponse] = []

    async def write(r: ep.ProcessingResponse) -> None:
        out.append(r)
    timers = FakeTimers(FakeClock())
    return ToolCallHandler(p.cfg, p.ledger, write, p.spawn, timers.clock, timers), out


async def test_a_call_runs_once_is_recorded_and_a_repeat_gets_the_result(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="extproc")
    p, _ = await two_live_requests()
    first, out = _handler(p)
    await first.on_request_headers(dict(HD))
    assert out[-1].WhichOneof("response") == "request_headers"  # forwarded to the tool
    await first.on_response_headers({":status": "200", "content-type": "application/json"},
                                    end_of_stream=False)
    await first.on_response_body(b'{"ok":true}', end_of_stream=True)
    await first.on_closed()
    await p.drain()
    entry, _ = await p.ledger.get(f"{TOOL_RID}:call_1")
    assert entry is not None and entry["state"] == "done"
    again, out2 = _handler(p)
    await again.on_request_headers(dict(HD))
    r = out2[-1]
    assert r.WhichOneof("response") == "immediate_response"
    assert (r.immediate_response.status.code, r.immediate_response.body) == (200,
                                                                             b'{"ok":true}')
    msgs = [rec.getMessage() for rec in caplog.records]
    assert msgs.count("tool call executing") == 1
    assert "tool result recorded" in msgs and "tool call replayed from the ledger" in msgs
    assert all(SECRET_A not in str(vars(rec)) for rec in caplog.records)


async def test_with_the_ledger_away_nothing_is_forwarded(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="extproc")
    p, store = await two_live_requests()
    store.unavailable = True
    h, out = _handler(p)
    await h.on_request_headers(dict(HD))
    status, body = immediate(out[-1])
    assert (status, body["error"]["code"]) == (503, "journal_unavailable")
    assert [rec.getMessage() for rec in caplog.records] == [
        "tool ledger unavailable: not executing"]


async def test_the_request_body_passes_untouched() -> None:
    p, _ = await two_live_requests()
    h, out = _handler(p)
    await h.on_request_headers(dict(HD))
    msg: Any = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"{}", end_of_stream=True))
    await h.on_message("request_body", msg)
    assert out[-1].WhichOneof("response") == "request_body"
    assert not out[-1].request_body.response.HasField("body_mutation")
    assert (h.rid, h.aid) == (TOOL_RID, TOOL_AID)


async def test_the_result_is_recorded_again_on_the_handler_s_timers_while_etcd_is_away(
        ) -> None:
    p, store = await two_live_requests()
    first, out = _handler(p)
    timers = first.timers
    assert isinstance(timers, FakeTimers)
    await first.on_request_headers(dict(HD))
    await first.on_response_headers({":status": "200", "content-type": "application/json"},
                                    end_of_stream=False)
    store.fail_next(2)
    body = asyncio.ensure_future(first.on_response_body(b'{"ok":true}', end_of_stream=True))
    for pause in (0.1, 0.2):  # processor.retrying's pauses, on the handler's fake clock
        await idle()
        assert not body.done() and timers.pending() == 1
        assert timers.advance(pause) == 1
    await asyncio.wait_for(body, 1)
    entry, _ = await p.ledger.get(f"{TOOL_RID}:call_1")
    assert entry is not None and entry["state"] == "done"
    assert out[-1].WhichOneof("response") == "response_body"

"""The gate's session carrying out its rows' waits on a fake clock, as Envoy plays it.

The resend of an unconfirmed admission (decision 0026) is the rows' timer, Envoy's word is
awaited through the cause log's port on the Timers port, and the revocation watch is an
event: no real time passes, and what reaches Envoy and the journal is exact.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from extproc.adapters.gate import GateSession
from extproc.core import headers as H
from extproc.core.credentials import digest
from extproc.gen.envoy.data.accesslog.v3 import accesslog_pb2 as al

from .support import RID, SSE_ROLE, FakeClock, FakeTimers, idle
from .test_sessions import (
    PRE_SECRET,
    REPLICA,
    gate_headers,
    no_gate_entry,
    open_request,
    proc,
    resp_body,
    resp_headers,
    set_headers,
    start,
)


def attempt_entry(attempt_id: str) -> al.HTTPAccessLogEntry:
    """Envoy's per-attempt entry of an attempt the replica reset."""
    e = al.HTTPAccessLogEntry()
    e.common_properties.access_log_type = al.UpstreamEnd
    e.common_properties.upstream_cluster = "replicas"
    e.common_properties.response_flags.upstream_remote_reset = True
    e.request.request_headers[H.REQUEST_ID] = RID
    e.request.request_headers[H.ATTEMPT_ID] = attempt_id
    return e


async def test_an_unconfirmed_admission_is_sent_again_on_the_rows_timer_with_one_secret(
        caplog: pytest.LogCaptureFixture) -> None:
    timers = FakeTimers(FakeClock())
    p, store = proc({"policy": {"retry_budget": {"min_retry_concurrency": 5}}}, timers)
    await open_request(store, p)
    # Attempt 1's connection was refused (no gate ran): attempt 2 may take `live` over.
    p.causes.offer(no_gate_entry(RID, "att_pre"))
    ctx, _, task = start(GateSession, p)
    store.fail_next(2)
    with caplog.at_level(logging.INFO, logger="extproc"):
        ctx.send(gate_headers(2, p.clock.wall()))
        await idle()
        assert ctx.out == [] and timers.pending() == 1  # the first pause, nothing answered
        assert timers.advance(0.05) == 1
        await idle()
        assert ctx.out == [] and timers.pending() == 1  # the second, twice as long
        assert timers.advance(0.05) == 0 and timers.advance(0.05) == 1
        (r,) = await ctx.wait_for(1)
    sent = set_headers(r, "request_headers")
    assert sent[H.ATTEMPT_ID] == "att_test_1"
    # One credential for every try: the journal keeps the one that went upstream.
    assert p.ids.secrets == 1  # type: ignore[attr-defined]
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id == "att_test_1"
    lines = [r.getMessage() for r in caplog.records
             if getattr(r, "attempt_id", None) == "att_test_1"]
    assert lines == ["admission not confirmed; sending it again"] * 2 + [
        "admission confirmed", "attempt admitted"]
    assert digest(sent[H.ATTEMPT_SECRET]) != digest(PRE_SECRET)
    ctx.close()
    await asyncio.wait_for(task, 3)


async def admitted(timers: FakeTimers | None = None) -> tuple[Any, Any, Any, GateSession,
                                                               asyncio.Task[None]]:
    """A gate stream for attempt 1 of a recorded request, its request headers answered."""
    p, store = proc(None, timers) if timers is not None else proc()
    await open_request(store, p)
    ctx, s, task = start(GateSession, p)
    ctx.send(gate_headers(1, p.clock.wall()))
    await ctx.wait_for(1)
    return p, store, ctx, s, task


async def test_an_ended_attempt_is_settled_from_envoys_word_through_the_port() -> None:
    timers = FakeTimers(FakeClock())
    p, store, ctx, _, task = await admitted(timers)
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
    ctx.send(resp_body(SSE_ROLE))  # held: no content yet
    await idle()
    ctx.close()  # the stream went before the first delta: how, Envoy's word says
    await asyncio.wait_for(task, 3)
    await idle()
    assert timers.pending() == 1  # the word's bound, on the Timers port
    p.causes.offer(attempt_entry("att_pre"))
    await idle()
    assert timers.pending() == 0  # heard: the bound is cancelled
    await p.drain()
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id is None
    (att,) = view.attempts
    assert (att["failure_class"], att["envoy_cause"], att["envoy_closed"], att["fence"]) == (
        "replica_dead", "upstream", True, "revoked")


async def test_the_close_row_stops_the_watch_before_the_attempts_own_revoke() -> None:
    # The session stops nothing by itself: the close's StopWatching does, before the early
    # revoke deletes `live` (heard, that delete would be fed as someone else's fence).
    p, store, ctx, s, task = await admitted(FakeTimers(FakeClock()))
    assert s.rec is not None and s.rec.unwatch is not None
    ctx.close()  # before any response: a confirmed end, revoked at once
    await asyncio.wait_for(task, 3)
    await idle()
    p.causes.offer(attempt_entry("att_pre"))
    await p.drain()
    assert s.rec.unwatch is None and s.m is not None
    kinds = [e["type"] for e in s.m.trace]
    assert "LiveChanged" not in kinds
    assert s.m.decisions[kinds.index("StreamClosed")].split(":")[1].startswith(
        "StopTimers,StopWatching")
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id is None


async def test_a_replaced_live_ends_the_attempts_permission_once(
        caplog: pytest.LogCaptureFixture) -> None:
    timers = FakeTimers(FakeClock())
    p, store = proc(None, timers)
    await open_request(store, p)
    ctx, s, task = start(GateSession, p)
    with caplog.at_level(logging.WARNING, logger="extproc"):
        ctx.send(gate_headers(1, p.clock.wall()))
        await ctx.wait_for(1)
        assert s.lease is not None and s.lease.valid()
        store.revoke_lease(s.lease.lease_id)  # etcd dropped the lease: `live` went
        await idle()
    assert s.lease.lost_because == "revoked or replaced"
    assert [r.getMessage() for r in caplog.records] == [
        "attempt fenced: its lease was revoked or replaced"]
    assert s.m is not None and s.m.trace[-1] == {"type": "LiveChanged", "value": None}
    ctx.close()
    await asyncio.wait_for(task, 3)
    await idle()
    timers.advance(1.0)
    await p.drain()


async def test_the_gate_asks_the_replicas_address_from_envoys_attributes() -> None:
    _, _, ctx, s, task = await admitted()
    assert s.replica == REPLICA and s.m.start.replica == REPLICA
    ctx.close()
    await asyncio.wait_for(task, 3)

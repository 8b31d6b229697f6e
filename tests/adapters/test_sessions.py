"""The guard and gate sessions, played as Envoy plays them, on the in-memory store.

No sockets: a fake gRPC context feeds ProcessingRequests in and collects the exact
ProcessingResponses out; the journal and ledger are `memory_store` (its agreement with etcd
is tests/adapters/test_journal_store.py); the clock and ids are injected. Real Envoy runs
the same sessions end to end in tests/e2e.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2

from extproc.adapters.gate import GateSession
from extproc.adapters.guard import GuardSession
from extproc.adapters.leases import UNDO_SETTLE_S
from extproc.adapters.memory_store import MemoryLedger, MemoryStore
from extproc.adapters.processor import Processor
from extproc.core import guard as G
from extproc.core import headers as H
from extproc.core.config import Config, load_config
from extproc.core.credentials import digest
from extproc.core.events import TimerKind
from extproc.gen.envoy.config.core.v3 import base_pb2 as core
from extproc.gen.envoy.data.accesslog.v3 import accesslog_pb2 as al
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from .support import (
    RID,
    SSE_CONTENT,
    SSE_DONE,
    SSE_ROLE,
    SSE_VLLM,
    FakeClock,
    FakeTimers,
    FixedIds,
    idle,
    run_on,
    sse_vllm_usage,
)

REPLICA = "127.0.0.1:8001"


class _AnyRev:
    """Equal to any positive store revision."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, int) and other > 0


ANY_REV: Any = _AnyRev()


class FakeContext:
    """What a session needs of grpc.aio's ServicerContext: read, write, metadata."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.out: list[ep.ProcessingResponse] = []
        self.grew = asyncio.Event()

    async def read(self) -> Any:
        return await self.inbox.get()

    async def write(self, resp: ep.ProcessingResponse) -> None:
        self.out.append(resp)
        self.grew.set()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def send(self, msg: ep.ProcessingRequest) -> None:
        self.inbox.put_nowait(msg)

    def close(self) -> None:
        self.inbox.put_nowait(grpc.aio.EOF)

    async def wait_for(self, n: int, timeout_s: float = 3.0) -> list[ep.ProcessingResponse]:
        """Until `n` responses were written in all (bounded)."""
        async def until() -> None:
            while len(self.out) < n:
                self.grew.clear()
                await self.grew.wait()
        await asyncio.wait_for(until(), timeout_s)
        return self.out


def hmap(h: dict[str, str]) -> core.HeaderMap:
    return core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode())
                                   for k, v in h.items()])


def req_headers(h: dict[str, str], eos: bool = False,
                attrs: dict[str, str] | None = None) -> ep.ProcessingRequest:
    m = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hmap(h), end_of_stream=eos))
    if attrs:
        st = struct_pb2.Struct()
        st.update(attrs)
        m.attributes["envoy.filters.http.ext_proc"].CopyFrom(st)
    return m


def req_body(b: bytes) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=b, end_of_stream=True))


def resp_headers(h: dict[str, str], eos: bool = False) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hmap(h),
                                                                end_of_stream=eos))


def resp_body(b: bytes, eos: bool = False) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=b, end_of_stream=eos))


def set_headers(r: ep.ProcessingResponse, which: str) -> dict[str, str]:
    mut = getattr(r, which).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mut.set_headers}


def immediate(r: ep.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    assert r.WhichOneof("response") == "immediate_response", r
    return r.immediate_response.status.code, json.loads(r.immediate_response.body)


def proc(raw: dict[str, Any] | None = None, timers: FakeTimers | None = None
         ) -> tuple[Processor, MemoryStore]:
    """A processor on the in-memory store, its clock and timers fake (`timers`, or its own:
    `p.timers`): no time passes unless the test moves the clock."""
    timers = timers if timers is not None else FakeTimers(FakeClock())
    cfg: Config = load_config({"timeouts": {"access_log_wait_s": 0.05}, **(raw or {})})
    store = MemoryStore(cfg.etcd, owner="gw-1/test")
    return Processor(cfg, store, MemoryLedger(store, cfg.tools.ledger_ttl_s),
                     ids=FixedIds(), clock=timers.clock, timers=timers), store


def start(session_cls: Callable[[Processor, Any], Any], p: Processor
          ) -> tuple[FakeContext, Any, asyncio.Task[None]]:
    ctx = FakeContext()
    s = session_cls(p, ctx)
    return ctx, s, asyncio.ensure_future(s.run())


CHAT = json.dumps({"model": "demo-model", "stream": True, "max_tokens": 2,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
DOWN = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json",
        "idempotency-key": "k-1", "x-request-id": "envoy-1"}


async def test_guard_accepts_opens_the_journal_and_streams() -> None:
    p, store = proc()
    ctx, _, task = start(GuardSession, p)
    ctx.send(req_headers({**DOWN, H.PREADMITTED: "forged", H.TRACEPARENT: "forged",
                          H.ATTEMPT_SECRET: "forged-by-the-client"}))
    (r,) = await ctx.wait_for(1)
    rid = set_headers(r, "request_headers")[H.REQUEST_ID]
    removed = set(r.request_headers.response.header_mutation.remove_headers)
    assert {H.PREADMITTED, H.TRACEPARENT, H.ACCEPTED_AT, H.ATTEMPT_ID,
            H.ATTEMPT_SECRET} <= removed
    ctx.send(req_body(CHAT))
    r = (await ctx.wait_for(2))[1]
    sent = set_headers(r, "request_body")
    assert sent[H.PREADMITTED] == "att_test_1" and float(sent[H.ACCEPTED_AT]) > 0
    # Attempt 1's secret goes to its gate; the journal keeps only its digest, beside `live`.
    secret = sent[H.ATTEMPT_SECRET]
    assert secret == "secret_test_1_".ljust(43, "x")
    assert await p.ledger.credential(rid, "att_test_1") == (digest(secret), ANY_REV)
    view = await store.get(rid)
    assert view is not None and view.live_attempt_id == "att_test_1"
    assert view.meta["endpoint"] == "/v1/chat/completions" and view.outcome is None
    handoff = json.dumps({"attempt": 1, "attempt_id": "att_test_1", "replica": REPLICA,
                          "lease_id": 0})
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream",
                           H.HANDOFF: handoff}))
    r = (await ctx.wait_for(3))[2]
    assert set_headers(r, "response_headers") == {H.REQUEST_ID: rid}
    assert list(r.response_headers.response.header_mutation.remove_headers) == [
        H.HANDOFF, H.ATTEMPT_SECRET]
    ctx.send(resp_body(SSE_ROLE + SSE_CONTENT + SSE_CONTENT))
    ctx.send(resp_body(SSE_DONE, eos=True))
    out = await ctx.wait_for(5)
    assert [o.response_body.response.body_mutation.streamed_response.body for o in out[3:]] \
        == [SSE_ROLE + SSE_CONTENT + SSE_CONTENT, SSE_DONE]
    ctx.close()
    await asyncio.wait_for(task, 3)
    await p.drain()
    view = await store.get(rid)
    assert view is not None and view.outcome is not None
    assert view.outcome["outcome"] == "completed" and view.outcome["delivered_output_tokens"] == 2
    assert view.live_attempt_id is None  # the request's end deleted `live`
    (att,) = view.attempts
    assert att["fence"] == "ended_with_request" and att["released"] is True


@pytest.mark.parametrize("content", [SSE_CONTENT, SSE_VLLM], ids=["table", "fast"])
async def test_guard_ends_a_silent_stream_on_its_stall_timer(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
        content: bytes) -> None:
    # On a fake clock: the stall watchdog is the machine's timer (StartTimer/TimerFired),
    # run on the Timers port; one timer whose deadline each chunk moves. The guard's log
    # lines come from its transitions (the observer), once each, with the request id.
    caplog.set_level(logging.INFO, logger="extproc")
    timers = FakeTimers(FakeClock())
    p, store = proc({"timeouts": {"stall_after_first_delta_s": 10, "access_log_wait_s": 0.05,
                                  "progress_interval_s": 0}}, timers)
    ctx, s, task = start(GuardSession, p)
    ctx.send(req_headers(DOWN))
    rid = set_headers((await ctx.wait_for(1))[0], "request_headers")[H.REQUEST_ID]
    ctx.send(req_body(CHAT))
    await ctx.wait_for(2)
    handoff = json.dumps({"attempt": 1, "attempt_id": "att_test_1", "replica": REPLICA,
                          "lease_id": 0})
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream",
                           H.HANDOFF: handoff}))
    await ctx.wait_for(3)
    assert timers.pending() == 0  # nothing delivered yet: Envoy's per-try timeout's time
    ctx.send(resp_body(SSE_ROLE + SSE_CONTENT))
    await ctx.wait_for(4)
    assert timers.pending() == 1
    assert timers.advance(6.0) == 0
    fast = took_fast(monkeypatch)
    ctx.send(resp_body(content))  # a chunk moves the deadline to 16 s (either path)
    await ctx.wait_for(5)
    assert fast == ([content] if content is SSE_VLLM else [])
    assert timers.advance(4.0) == 1  # the timer's first end: moved on, so started again
    await idle()
    assert len(ctx.out) == 5 and timers.pending() == 1
    assert timers.advance(5.9) == 0
    await idle()
    assert len(ctx.out) == 5
    assert timers.advance(0.1) == 1  # silent for 10 s since the last chunk
    end = (await ctx.wait_for(6))[5].response_body.response.body_mutation.streamed_response
    assert end.end_of_stream and b"decode_interrupted" in end.body
    ctx.close()
    await asyncio.wait_for(task, 3)
    await p.drain()
    view = await store.get(rid)
    assert view is not None and view.outcome is not None
    assert view.outcome["outcome"] == "upstream_decode_interrupted"
    assert view.outcome["cause"] == "stall" and view.outcome["delivered_output_tokens"] == 2
    assert s.m.recorded is True  # the record's write answered the machine (RecordWritten)
    lines = [r.getMessage() for r in caplog.records if getattr(r, "request_id", None) == rid]
    assert lines == ["request accepted", "upstream silent after first delta: ending stream",
                     "request finished", "attempt ended"]


def took_fast(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The chunks the guard's fast path takes from now on (core.guard.streaming_chunk)."""
    took: list[bytes] = []
    real = G.streaming_chunk

    def spy(m: Any, data: bytes, eos: bool, expired: bool) -> bytes | None:
        out = real(m, data, eos, expired)
        if out is not None:
            took.append(data)
        return out
    monkeypatch.setattr(G, "streaming_chunk", spy)
    return took


async def test_the_guards_common_chunk_goes_the_fast_way_stripped_and_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's token events with the running usage the gateway asked for: past the first
    delta the fast path forwards them without it, reads the engine's count, and a lease
    gone stops it (the row fences the stream)."""
    p, store = proc()
    ctx, s, task = start(GuardSession, p)
    ctx.send(req_headers(DOWN))
    rid = set_headers((await ctx.wait_for(1))[0], "request_headers")[H.REQUEST_ID]
    ctx.send(req_body(CHAT))
    await ctx.wait_for(2)
    handoff = json.dumps({"attempt": 1, "attempt_id": "att_test_1", "replica": REPLICA,
                          "lease_id": 0})
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream",
                           H.HANDOFF: handoff}))
    await ctx.wait_for(3)
    fast = took_fast(monkeypatch)
    chunks = [sse_vllm_usage(1), sse_vllm_usage(2), sse_vllm_usage(3),
              sse_vllm_usage(5) + sse_vllm_usage(7)]
    for c in chunks:
        ctx.send(resp_body(c))
    out = await ctx.wait_for(3 + len(chunks))
    assert [o.response_body.response.body_mutation.streamed_response.body
            for o in out[3:]] == [SSE_VLLM, SSE_VLLM, SSE_VLLM, SSE_VLLM + SSE_VLLM]
    assert fast == chunks[1:]  # the first delivers the first delta: the table's
    assert (s.m.delivered, s.m.engine_tokens) == (5, 7)
    assert s.released is not None
    s.released.lose("revoked")  # the lease's check with the next chunk: no fast way
    ctx.send(resp_body(sse_vllm_usage(8)))
    end = (await ctx.wait_for(8))[7].response_body.response.body_mutation.streamed_response
    assert end.end_of_stream and b'"delivered_output_tokens":7' in end.body
    assert len(fast) == 3
    ctx.close()
    await asyncio.wait_for(task, 3)
    await p.drain()
    view = await store.get(rid)
    assert view is not None and view.outcome is not None
    assert view.outcome["cause"] == "fenced" and view.outcome["delivered_output_tokens"] == 7


async def test_a_sampled_chunk_is_timed_and_still_goes_the_fast_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With metrics exported, one body message in CHUNK_TIME_SAMPLE is timed: the read loop
    times the same step, the fast path included (here every one is sampled)."""
    from extproc.adapters import session

    monkeypatch.setattr(session, "CHUNK_TIME_SAMPLE", 1)
    timers = FakeTimers(FakeClock())
    p, _ = proc(timers=timers)
    timed: list[float] = []
    monkeypatch.setattr(p.tel, "enabled", True)
    monkeypatch.setattr(p.tel, "chunk_time", type("H", (), {"record": staticmethod(
        lambda ms, *a: timed.append(ms))})())
    ctx, s, task = start(GuardSession, p)
    ctx.send(req_headers(DOWN))
    await ctx.wait_for(1)
    ctx.send(req_body(CHAT))
    await ctx.wait_for(2)
    handoff = json.dumps({"attempt": 1, "attempt_id": "att_test_1", "replica": REPLICA,
                          "lease_id": 0})
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream",
                           H.HANDOFF: handoff}))
    await ctx.wait_for(3)
    fast = took_fast(monkeypatch)
    for n in (1, 2, 3):
        ctx.send(resp_body(sse_vllm_usage(n)))
    out = await ctx.wait_for(6)
    assert [o.response_body.response.body_mutation.streamed_response.body
            for o in out[3:]] == [SSE_VLLM] * 3
    assert fast == [sse_vllm_usage(2), sse_vllm_usage(3)] and len(timed) == 3
    assert s.m.delivered == 3 and "stall" in s.timers
    ctx.close()
    await asyncio.wait_for(task, 3)
    await run_on(timers, p.drain())
    assert timers.clock.now == 0.05  # the outcome waited for its access-log entry


async def test_guard_checkpoints_the_delivered_count_on_its_timer() -> None:
    # On a fake clock: every progress_interval_s while streaming, the count so far is
    # recorded (the machine's CHECKPOINT timer and WriteProgress, answered ProgressWritten).
    timers = FakeTimers(FakeClock())
    p, store = proc({"timeouts": {"stall_after_first_delta_s": 100, "progress_interval_s": 2,
                                  "access_log_wait_s": 0.05}}, timers)
    writes: list[int] = []
    real = store.progress

    async def progress(rid: str, record: Any) -> None:
        writes.append(record["delivered_output_tokens"])
        await real(rid, record)
    store.progress = progress  # type: ignore[method-assign]
    ctx, s, task = start(GuardSession, p)
    ctx.send(req_headers(DOWN))
    await ctx.wait_for(1)
    ctx.send(req_body(CHAT))
    await ctx.wait_for(2)
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
    ctx.send(resp_body(SSE_ROLE + SSE_CONTENT))
    await ctx.wait_for(4)
    # The stall timer and the checkpoint's: one port timer, for the earlier (decision 0058).
    assert TimerKind.STALL in s.timers and TimerKind.CHECKPOINT in s.timers
    assert timers.pending() == 1 and timers.next_due() == 2.0
    assert timers.advance(1.9) == 0
    assert timers.advance(0.1) == 1
    await idle()
    assert writes == [1] and s.m.progress_inflight is False  # written, answered
    assert timers.advance(2.0) == 1  # nothing new went out: nothing written
    await idle()
    assert writes == [1]
    ctx.send(resp_body(SSE_CONTENT))
    await ctx.wait_for(5)
    assert timers.advance(2.0) == 1
    await idle()
    assert writes == [1, 2]
    ctx.send(resp_body(SSE_DONE, eos=True))
    await ctx.wait_for(6)
    assert timers.pending() == 0  # the end stops both
    ctx.close()
    await asyncio.wait_for(task, 3)
    await p.drain()


def counted(store: MemoryStore, name: str, timers: FakeTimers) -> list[float]:
    """The fake clock's reading at each call of the store's `name` (the call goes on)."""
    at: list[float] = []
    real = getattr(store, name)

    async def call(*args: Any, **kw: Any) -> Any:
        at.append(timers.clock.now)
        return await real(*args, **kw)
    setattr(store, name, call)
    return at


# The intake's tries with etcd away for good and the default 3 s resend deadline: pauses of
# 0.05, 0.1, 0.2, then 0.4 s; at 2.75 s the next pause would end past the deadline.
INTAKE_TRIES_DOWN = [0.0, 0.05, 0.15, 0.35, 0.75, 1.15, 1.55, 1.95, 2.35, 2.75]


async def test_guard_fails_closed_when_the_journal_is_down() -> None:
    timers = FakeTimers(FakeClock())
    p, store = proc(timers=timers)
    tries, undos = counted(store, "open_request", timers), counted(store, "undo_intake", timers)
    ctx, _, task = start(GuardSession, p)
    ctx.send(req_headers(DOWN))
    await ctx.wait_for(1)
    store.unavailable = True
    ctx.send(req_body(CHAT))
    status, body = immediate((await run_on(timers, ctx.wait_for(2)))[1])
    assert status == 503 and body["error"]["code"] == "journal_unavailable"
    assert body["error"]["retryable"] is True
    assert tries == pytest.approx(INTAKE_TRIES_DOWN) and timers.clock.now == tries[-1]
    # Given up: its take-back is tried at once and pauses while etcd is away.
    assert undos == [tries[-1]] and timers.pending() == 1
    ctx.close()
    await asyncio.wait_for(task, 3)


FRESH = {k: v for k, v in DOWN.items() if k != "idempotency-key"}


def held_intake(store: MemoryStore) -> asyncio.Event:
    """Make the store's intake transaction wait until the returned event is set."""
    release, real = asyncio.Event(), store.open_request

    async def slow(*args: Any, **kw: Any) -> Any:
        await release.wait()
        return await real(*args, **kw)
    store.open_request = slow  # type: ignore[method-assign]
    return release


async def fresh_request_at_its_gate(p: Processor) -> tuple[Any, ...]:
    """A key-less request through its guard's body, then attempt 1's gate headers sent:
    (guard ctx, guard session, guard task, request id, the body's set headers, gate ctx)."""
    guard, gs, gtask = start(GuardSession, p)
    guard.send(req_headers(FRESH))
    rid = set_headers((await guard.wait_for(1))[0], "request_headers")[H.REQUEST_ID]
    guard.send(req_body(CHAT))
    sent = set_headers((await guard.wait_for(2))[1], "request_body")
    gate, _, _ = start(GateSession, p)
    gate.send(req_headers({H.REQUEST_ID: rid, H.ENVOY_ATTEMPT_COUNT: "1",
                           H.ACCEPTED_AT: sent[H.ACCEPTED_AT], H.PREADMITTED: "att_test_1"},
                          attrs={"upstream.address": REPLICA}))
    return guard, gs, gtask, rid, sent, gate


async def test_a_fresh_request_goes_on_while_its_intake_commits_and_its_gate_waits() -> None:
    p, store = proc()
    release = held_intake(store)
    guard, _, gtask, rid, sent, gate = await fresh_request_at_its_gate(p)
    # The body went on at once, with attempt 1's id, before anything was recorded.
    assert sent[H.PREADMITTED] == "att_test_1"
    assert await store.get(rid) is None
    await idle()
    assert gate.out == [] and rid not in p.reached  # attempt 1 waits for the record
    release.set()
    (r,) = await gate.wait_for(1)
    assert set_headers(r, "request_headers") == {H.ATTEMPT_ID: "att_test_1"}
    view = await store.get(rid)
    assert view is not None and view.live_attempt_id == "att_test_1" and rid in p.reached
    assert p.intakes.take(rid) is None  # a committed intake is not kept
    gate.close()
    guard.close()
    await asyncio.wait_for(gtask, 3)


async def test_a_fresh_request_whose_intake_fails_is_refused_by_its_gate() -> None:
    timers = FakeTimers(FakeClock())
    p, store = proc(timers=timers)
    tries, undos = counted(store, "open_request", timers), counted(store, "undo_intake", timers)
    release = held_intake(store)
    guard, gs, gtask, rid, _, gate = await fresh_request_at_its_gate(p)
    store.unavailable = True
    release.set()
    status, body = immediate((await run_on(timers, gate.wait_for(1)))[0])
    assert tries == pytest.approx(INTAKE_TRIES_DOWN) and timers.clock.now == tries[-1]
    assert undos == [tries[-1]]
    assert status == 503 and body["error"]["code"] == "journal_unavailable"
    assert body["error"]["request_id"] == rid and body["error"]["retryable"] is True
    assert rid not in p.reached  # it never went upstream
    assert gs.m is not None and not gs.m.accepted
    # The refusal passes the guard untouched: it is not a response of ours to count.
    guard.send(resp_headers({":status": "503", "content-type": "application/json"}))
    r = (await guard.wait_for(3))[2]
    assert r.WhichOneof("response") == "response_headers"
    assert set_headers(r, "response_headers") == {}
    store.unavailable = False
    await run_on(timers, p.drain())
    # The take-back: tried again after its 0.1 s pause, then applied every 0.25 s while
    # it settles (UNDO_SETTLE_S, 3 s).
    gave_up = tries[-1]
    assert undos == pytest.approx([gave_up, gave_up + 0.1,
                                   *(gave_up + 0.1 + 0.25 * k for k in range(1, 13))])
    assert timers.clock.now == pytest.approx(gave_up + 0.1 + UNDO_SETTLE_S)
    assert await store.get(rid) is None  # nothing recorded, nothing to give back
    assert p.intakes.get(rid) is not None  # kept for any later attempt's gate ...
    gate.close()
    guard.close()
    await asyncio.wait_for(gtask, 3)
    assert p.intakes.get(rid) is None  # ... until the guard's stream is over


async def test_envoy_s_reply_to_a_request_whose_intake_failed_carries_the_intake_s_error(
        ) -> None:
    # Every attempt was refused or reset before its gate answered (the chaos slice: the
    # pool down while a journal shard was): Envoy's own 503 reaches the guard, the intake
    # failed and nothing was recorded, so the client is told so, not "upstream_unavailable"
    # for a request whose lookup would say 404.
    timers = FakeTimers(FakeClock())
    p, store = proc(timers=timers)
    release = held_intake(store)
    guard, gs, gtask, rid, _, gate = await fresh_request_at_its_gate(p)
    store.unavailable = True
    release.set()
    await run_on(timers, gate.wait_for(1))  # the intake gave up
    assert gs.m is not None and not gs.m.accepted
    guard.send(resp_headers({":status": "503", "content-type": "application/json",
                             H.ENVOY_REPLY: "URX,UF"}))
    r = (await guard.wait_for(3))[2]
    assert set_headers(r, "response_headers") == {H.REQUEST_ID: rid,
                                                  "content-type": "application/json"}
    guard.send(resp_body(b'{"error":{"code":"upstream_unavailable"}}', True))
    r = (await guard.wait_for(4))[3]
    body = json.loads(r.response_body.response.body_mutation.streamed_response.body)
    assert body["error"]["code"] == "journal_unavailable"
    assert body["error"]["request_id"] == rid and body["error"]["retryable"] is True
    store.unavailable = False
    await run_on(timers, p.drain())
    assert await store.get(rid) is None  # nothing recorded: the lookup's 404 agrees
    gate.close()
    guard.close()
    await asyncio.wait_for(gtask, 3)


async def test_an_intake_whose_answer_was_lost_is_confirmed_by_its_own_record() -> None:
    # The intake applied but its answer never came (a member frozen or electing past the
    # call's deadline); sent again it finds the record with its own attempt 1: success, not
    # a repeat answered 409 request_in_progress (issue 24, findings 3 and 4).
    timers = FakeTimers(FakeClock())
    p, store = proc(timers=timers)
    tries = counted(store, "open_request", timers)
    store.lose_next_intake_answer()
    guard, gs, gtask = start(GuardSession, p)
    guard.send(req_headers(DOWN))
    rid = set_headers((await guard.wait_for(1))[0], "request_headers")[H.REQUEST_ID]
    guard.send(req_body(CHAT))
    r = (await run_on(timers, guard.wait_for(2)))[1]
    assert tries == [0.0, 0.05]  # sent again after the intake's first pause
    assert r.WhichOneof("response") == "request_body", r
    sent = set_headers(r, "request_body")
    view = await store.get(rid)
    assert view is not None and view.live_attempt_id == sent[H.PREADMITTED]
    assert [a["attempt_id"] for a in view.attempts] == [sent[H.PREADMITTED]]
    assert gs.m is not None and gs.m.accepted
    guard.close()
    await asyncio.wait_for(gtask, 3)


async def test_a_given_up_intake_that_applied_late_is_taken_back() -> None:
    # The intake applied, then etcd stayed away past resend_deadline_s: the client is told
    # `503 journal_unavailable`, nothing was run; when etcd answers again the record is
    # taken back, so a repeat of the key runs instead of 409 request_in_progress forever
    # (issue 24, finding 5). The intake's pauses and the take-back's run on a fake clock.
    timers = FakeTimers(FakeClock())
    p, store = proc({"etcd": {"timeout_s": 0.1, "resend_deadline_s": 0.3}}, timers)
    store.lose_next_intake_answer()
    real, real_undo, undone = store.open_request, store.undo_intake, asyncio.Event()
    intake_tries: list[float] = []
    undo_tries: list[float] = []

    async def then_down(*args: Any, **kw: Any) -> Any:
        intake_tries.append(timers.clock.now)
        try:
            return await real(*args, **kw)
        finally:
            store.unavailable = True

    async def undo(*args: Any, **kw: Any) -> Any:
        undo_tries.append(timers.clock.now)
        res = await real_undo(*args, **kw)
        undone.set()
        return res
    store.open_request = then_down  # type: ignore[method-assign]
    store.undo_intake = undo  # type: ignore[method-assign]
    guard, _, gtask = start(GuardSession, p)
    guard.send(req_headers(DOWN))
    rid = set_headers((await guard.wait_for(1))[0], "request_headers")[H.REQUEST_ID]
    guard.send(req_body(CHAT))
    # Sent again after 0.05 s and 0.1 s; the next pause (0.2 s) would end past the 0.3 s
    # deadline: given up at 0.15 s.
    status, body = immediate((await run_on(timers, guard.wait_for(2)))[1])
    assert intake_tries == [0.0, pytest.approx(0.05), pytest.approx(0.15)]
    assert timers.clock.now == pytest.approx(0.15)
    assert status == 503 and body["error"]["code"] == "journal_unavailable"
    assert body["error"]["retryable"] is True
    guard.close()
    await asyncio.wait_for(gtask, 3)
    store.open_request = real  # type: ignore[method-assign]
    assert undo_tries == [pytest.approx(0.15)]  # tried at the give-up: etcd still away
    store.unavailable = False
    assert await store.get(rid) is not None and not undone.is_set()  # the late apply ...
    await run_on(timers, undone.wait())  # ... until the take-back lands, after its pause
    assert undo_tries == [pytest.approx(0.15), pytest.approx(0.25)]
    assert await store.get(rid) is None
    again, _, atask = start(GuardSession, p)
    again.send(req_headers(DOWN))
    again.send(req_body(CHAT))
    r = (await again.wait_for(2))[1]
    assert r.WhichOneof("response") == "request_body", r  # it runs this time
    again.close()
    await asyncio.wait_for(atask, 3)


def no_gate_entry(rid: str, attempt_1: str) -> al.HTTPAccessLogEntry:
    """Envoy's per-attempt entry for an attempt whose upstream filters never ran."""
    e = al.HTTPAccessLogEntry()
    e.common_properties.access_log_type = al.UpstreamEnd
    e.common_properties.upstream_cluster = "replicas"
    e.common_properties.upstream_remote_address.socket_address.address = "127.0.0.1"
    e.common_properties.upstream_remote_address.socket_address.port_value = 8001
    e.common_properties.response_flags.upstream_connection_failure = True
    e.request.request_headers[H.REQUEST_ID] = rid
    e.request.request_headers[H.PREADMITTED] = attempt_1
    return e


async def test_a_later_attempt_waits_for_the_intake_too() -> None:
    # Attempt 1's connection was refused, so no gate ran for it, and Envoy's attempt 2 reached
    # its gate while the intake was still in flight (issue 24, finding 1). It must wait for
    # the record, then take over the never-started attempt 1: not be refused as unknown.
    p, store = proc()
    release = held_intake(store)
    guard, _, gtask = start(GuardSession, p)
    guard.send(req_headers(FRESH))
    rid = set_headers((await guard.wait_for(1))[0], "request_headers")[H.REQUEST_ID]
    guard.send(req_body(CHAT))
    sent = set_headers((await guard.wait_for(2))[1], "request_body")
    p.causes.offer(no_gate_entry(rid, sent[H.PREADMITTED]))
    gate, _, _ = start(GateSession, p)
    gate.send(req_headers({H.REQUEST_ID: rid, H.ENVOY_ATTEMPT_COUNT: "2",
                           H.ACCEPTED_AT: sent[H.ACCEPTED_AT],
                           H.PREADMITTED: sent[H.PREADMITTED]},
                          attrs={"upstream.address": "127.0.0.1:8002"}))
    await idle()
    assert gate.out == [] and await store.get(rid) is None
    release.set()
    (r,) = await gate.wait_for(1)
    assert r.WhichOneof("response") == "request_headers", r
    aid2 = set_headers(r, "request_headers")[H.ATTEMPT_ID]
    view = await store.get(rid)
    assert view is not None and view.live_attempt_id == aid2 != sent[H.PREADMITTED]
    gate.close()
    guard.close()
    await asyncio.wait_for(gtask, 3)


@pytest.mark.parametrize("headers", [DOWN, FRESH], ids=["keyed", "key-less"])
async def test_a_stream_reset_during_its_intake_still_gets_an_outcome(
        headers: dict[str, str]) -> None:
    # Envoy resets the stream (the client left) while the intake is in flight; grpc.aio
    # cancels the handler. The intake commits anyway: the request must be finished, or a
    # repeat of its key would be answered request_in_progress for as long as we run.
    timers = FakeTimers(FakeClock())
    p, store = proc(timers=timers)
    release = held_intake(store)
    guard, gs, gtask = start(GuardSession, p)
    guard.send(req_headers(headers))
    rid = set_headers((await guard.wait_for(1))[0], "request_headers")[H.REQUEST_ID]
    guard.send(req_body(CHAT))
    await idle()
    # Its intake is in flight, held by the store.
    assert gs._tx is not None and gs._tx.opening is not None
    gtask.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await gtask
    release.set()
    await run_on(timers, p.drain())
    # Finished once its attempt's access-log entry was waited for (access_log_wait_s).
    assert timers.clock.now == 0.05
    view = await store.get(rid)
    assert view is not None and view.outcome is not None
    assert view.outcome["outcome"] == "upstream_failed"  # no access-log cause here
    assert view.outcome["delivered_output_tokens"] == 0
    assert view.live_attempt_id is None
    if headers is DOWN:
        # Nothing ran, nothing was delivered: a repeat of the key runs it again as the same
        # request, its attempts numbered after attempt 1 (decision 0027).
        again, _, atask = start(GuardSession, p)
        again.send(req_headers(DOWN))
        again.send(req_body(CHAT))
        r = (await again.wait_for(2))[1]
        assert r.WhichOneof("response") == "request_body", r
        assert set_headers(r, "request_body")[H.ATTEMPT_OFFSET] == "1"
        again.close()
        await asyncio.wait_for(atask, 3)


async def test_guard_status_lookup_of_an_unknown_id_is_404() -> None:
    p, _ = proc()
    ctx, _, task = start(GuardSession, p)
    ctx.send(req_headers({":method": "GET", ":path": f"/v1/requests/{RID}"}, eos=True))
    status, body = immediate((await ctx.wait_for(1))[0])
    assert status == 404 and body["error"]["code"] == "request_not_found"
    ctx.close()
    await asyncio.wait_for(task, 3)


PRE_SECRET = "pre_admitted_attempt_secret_".ljust(43, "p")


async def open_request(store: MemoryStore, p: Processor) -> None:
    await store.open_request(RID, {"request_id": RID, "created_at": p.clock.wall()},
                             ("att_pre", {"attempt": 1, "attempt_id": "att_pre"}),
                             credential=digest(PRE_SECRET))


def gate_headers(attempt: int, accepted_at: float, **extra: str) -> ep.ProcessingRequest:
    """What Envoy gives attempt n's gate: the guard's headers (attempt 1's secret among
    them: an earlier mutation stays on Envoy's later attempts)."""
    h = {H.REQUEST_ID: RID, H.ENVOY_ATTEMPT_COUNT: str(attempt),
         H.ACCEPTED_AT: f"{accepted_at:.6f}", H.PREADMITTED: "att_pre",
         H.ATTEMPT_SECRET: PRE_SECRET, **extra}
    return req_headers(h, attrs={"upstream.address": REPLICA})


async def test_gate_holds_until_the_first_delta_is_fenced_then_hands_off() -> None:
    p, store = proc()
    await open_request(store, p)
    ctx, _s, task = start(GateSession, p)
    ctx.send(gate_headers(1, p.clock.wall()))
    (r,) = await ctx.wait_for(1)
    # Attempt 1 goes upstream with the guard's secret for it, the one the journal keeps.
    assert set_headers(r, "request_headers") == {H.ATTEMPT_ID: "att_pre",
                                                 H.ATTEMPT_SECRET: PRE_SECRET}
    assert list(r.request_headers.response.header_mutation.remove_headers) == [H.PREADMITTED]
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
    ctx.send(resp_body(SSE_ROLE))  # not content: still held, nothing answered
    await idle()
    assert len(ctx.out) == 1
    ctx.send(resp_body(SSE_CONTENT))
    out = await ctx.wait_for(4)
    released = set_headers(out[1], "response_headers")
    assert released[H.ATTEMPT_ID] == "att_pre"
    assert json.loads(released[H.HANDOFF])["attempt_id"] == "att_pre"
    # The two held chunks, answered unchanged, in order.
    assert [o.WhichOneof("response") for o in out[2:]] == ["response_body"] * 2
    assert not any(o.response_body.response.HasField("body_mutation") for o in out[2:])
    await asyncio.wait_for(task, 3)  # detached: the gate left the stream after release
    view = await store.get(RID)
    assert view is not None and view.first_delta_sent
    assert view.delivery is not None and view.delivery["attempt_id"] == "att_pre"
    assert p.handoffs.take("att_pre") is not None


async def test_gate_logs_each_step_once_from_its_transitions(
        caplog: pytest.LogCaptureFixture) -> None:
    # The session says nothing itself: the observer derives each line from the machine's
    # transition, so an attempt failed on purpose logs its admission, its failure and its
    # end, once each, every line with both ids.
    p, store = proc()
    await open_request(store, p)
    ctx, _, task = start(GateSession, p)
    with caplog.at_level(logging.INFO, logger="extproc"):
        ctx.send(gate_headers(1, p.clock.wall()))
        await ctx.wait_for(1)
        ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
        ctx.send(resp_body(b'data: {"error": {"message": "boom"}}\n\n'))
        out = await ctx.wait_for(3)
        assert out[1].response_headers.response.header_mutation.set_headers
        ctx.close()
        await asyncio.wait_for(task, 3)
        await p.drain()
    mine = [r for r in caplog.records if getattr(r, "attempt_id", None) == "att_pre"]
    assert [r.getMessage() for r in mine] == [
        "attempt admitted", "attempt failed before first delta", "attempt ended"]
    assert all(getattr(r, "request_id", None) == RID for r in mine)
    view = await store.get(RID)
    assert view is not None and view.attempts[0]["failure_class"] == "ended_by_gateway"


async def test_gate_refuses_a_re_prefill_past_the_budget_but_not_a_first_run() -> None:
    raw = {"policy": {"retry_budget": {"min_retry_concurrency": 0, "fraction": 0.0}}}
    # Attempt 1 never reached a replica (no gate ran): attempt 2 is the first real run.
    p, store = proc(raw)
    await store.open_request(RID, {"request_id": RID}, None)
    ctx, _, task = start(GateSession, p)
    ctx.send(gate_headers(2, p.clock.wall()))
    (r,) = await ctx.wait_for(1)
    assert r.WhichOneof("response") == "request_headers"
    ctx.close()
    await asyncio.wait_for(task, 3)
    # Now one that follows an attempt that did reach a replica.
    p, store = proc(raw)
    await store.open_request(RID, {"request_id": RID}, None)
    p.mark_reached(RID)
    ctx, _, task = start(GateSession, p)
    ctx.send(gate_headers(2, p.clock.wall()))
    (refused,) = await ctx.wait_for(1)
    status, body = immediate(refused)
    assert status == 503 and body["error"]["code"] == "retry_budget_exhausted"
    # A refused later attempt sends nothing upstream and shows no secret (attempt 1's
    # came with its headers; none was minted for it: it was never admitted).
    assert PRE_SECRET.encode() not in refused.SerializeToString()
    assert p.ids.secrets == 0  # type: ignore[attr-defined]
    ctx.close()
    await asyncio.wait_for(task, 3)


async def test_gate_ends_a_silent_last_attempt_with_upstream_timeout() -> None:
    # On a fake clock: the first-delta timers are the machine's, run on the Timers port.
    timers = FakeTimers(FakeClock())
    p, store = proc({"timeouts": {"first_delta_s": 30, "soft_first_delta_s": 5,
                                  "access_log_wait_s": 0.05},
                     "policy": {"on_upstream_failure": {"before_first_delta": {
                         "max_attempts": 1}}}}, timers)
    await open_request(store, p)
    ctx, s, task = start(GateSession, p)
    ctx.send(gate_headers(1, p.clock.wall()))
    await ctx.wait_for(1)  # forwarded; the replica never sends headers
    # Both first-delta limits, on one port timer for the earlier (decision 0058).
    assert TimerKind.SOFT_FIRST_DELTA in s.timers and TimerKind.FIRST_DELTA in s.timers
    assert timers.pending() == 1 and timers.next_due() == 5.0
    assert timers.advance(5.0) == 1  # the soft limit: slow, not failed
    await idle()
    assert len(ctx.out) == 1 and s.m.slow
    assert timers.advance(24.9) == 0  # just before the limit: nothing
    await idle()
    assert len(ctx.out) == 1
    assert timers.advance(0.1) == 1
    status, body = immediate((await ctx.wait_for(2))[1])
    assert status == 504 and body["error"]["code"] == "upstream_timeout"
    assert body["error"]["request_id"] == RID
    assert "30.0 s" in body["error"]["message"]  # the wait as the fake clock measured it
    ctx.close()
    await asyncio.wait_for(task, 3)
    await idle()
    # Envoy's word is awaited on the Timers port too: it never comes, the fake clock ends it.
    assert timers.advance(0.05) == 1
    await p.drain()
    view = await store.get(RID)
    assert view is not None and not view.first_delta_sent
    (att,) = view.attempts
    assert att["slow"] is True
    # No word from Envoy in this test (no access log): liveness unknown, lease must expire.
    assert att["failure_class"] == "network_uncertain" and att["fence"] == "expiry"
    assert att["envoy_closed"] is False


async def test_gate_refuses_a_cross_fingerprint_host() -> None:
    fp = {"weights_revision": "w@1"}
    p, store = proc({"pool": {"replicas": [{"address": REPLICA, "fingerprint": fp}]}})
    await open_request(store, p)
    ctx, _, task = start(GateSession, p)
    ctx.send(gate_headers(1, p.clock.wall(), **{H.FINGERPRINT: "fp-other"}))
    status, body = immediate((await ctx.wait_for(1))[0])
    assert status == 503 and body["error"]["code"] == "no_compatible_replica"
    ctx.close()
    await asyncio.wait_for(task, 3)
    await p.drain()
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id is None  # `live` given back


# --- a key whose request ended with nothing delivered runs again (decision 0027) ----------


async def gate_run(p: Processor, rid: str, envoy_attempt: int, sent: dict[str, str],
                   status: int) -> tuple[FakeContext, ep.ProcessingResponse]:
    """One attempt's gate, as Envoy plays it: its headers (with what the guard set on the
    body), admitted or refused; on admission the replica answers `status`."""
    gate, _, task = start(GateSession, p)
    h = {H.REQUEST_ID: rid, H.ENVOY_ATTEMPT_COUNT: str(envoy_attempt),
         H.ACCEPTED_AT: sent[H.ACCEPTED_AT], H.PREADMITTED: sent[H.PREADMITTED],
         H.ATTEMPT_SECRET: sent[H.ATTEMPT_SECRET]}
    if H.ATTEMPT_OFFSET in sent:
        h[H.ATTEMPT_OFFSET] = sent[H.ATTEMPT_OFFSET]
    gate.send(req_headers(h, attrs={"upstream.address": REPLICA}))
    (r,) = await gate.wait_for(1)
    if r.WhichOneof("response") == "request_headers" and status != 200:
        gate.send(resp_headers({":status": str(status), "content-type": "application/json"},
                               eos=True))
        await gate.wait_for(2)
        gate.close()
        await asyncio.wait_for(task, 3)
    return gate, r


async def test_a_key_whose_run_failed_with_nothing_delivered_runs_again() -> None:
    # Run 1: both attempts answered 503 (the replicas overloaded), nothing delivered, outcome
    # upstream_failed. The repeat of the key runs again as the same request: re-opened with
    # its first attempt numbered 3, and its gate admits journal attempt 3 for Envoy's 1.
    p, store = proc({"policy": {"retry_budget": {"min_retry_concurrency": 1000}}})
    guard, _, gtask = start(GuardSession, p)
    guard.send(req_headers(DOWN))
    rid = set_headers((await guard.wait_for(1))[0], "request_headers")[H.REQUEST_ID]
    guard.send(req_body(CHAT))
    sent = set_headers((await guard.wait_for(2))[1], "request_body")
    assert H.ATTEMPT_OFFSET not in sent  # a first run names its attempts as Envoy does
    await gate_run(p, rid, 1, sent, 503)
    await gate_run(p, rid, 2, sent, 503)
    guard.send(resp_headers({":status": "503", "content-type": "application/json"}))
    guard.send(resp_body(b'{"error":{"message":"overloaded"}}', eos=True))
    await guard.wait_for(4)
    guard.close()
    await asyncio.wait_for(gtask, 3)
    await p.drain()
    first = await store.get(rid)
    assert first is not None and first.outcome is not None and not first.first_delta_sent
    assert (first.outcome["outcome"], first.outcome["cause"]) == ("upstream_failed", "http 503")
    assert [a["attempt"] for a in first.attempts] == [1, 2] and first.live_attempt_id is None

    # The repeat: same key, same body.
    again, _, atask = start(GuardSession, p)
    again.send(req_headers({**DOWN, H.ATTEMPT_OFFSET: "99"}))  # a client's is stripped
    removed = set((await again.wait_for(1))[0].request_headers.response.header_mutation
                  .remove_headers)
    assert H.ATTEMPT_OFFSET in removed
    again.send(req_body(CHAT))
    r = (await again.wait_for(2))[1]
    assert r.WhichOneof("response") == "request_body", r
    sent2 = set_headers(r, "request_body")
    aid3 = sent2[H.PREADMITTED]
    assert sent2[H.ATTEMPT_OFFSET] == "2" and aid3 != sent[H.PREADMITTED]
    reopened = await store.get(rid)
    assert reopened is not None and reopened.outcome is None  # in progress again
    assert reopened.live_attempt_id == aid3 and reopened.meta == first.meta
    assert [(a["attempt"], a["attempt_id"]) for a in reopened.attempts][2] == (3, aid3)
    (h,) = reopened.history
    assert (h["run"], h["first_attempt"], h["last_attempt"]) == (1, 1, 2)
    assert h["outcome"] == first.outcome

    # Envoy's attempt 1 of the new HTTP request is the journal's attempt 3.
    gate, r = await gate_run(p, rid, 1, sent2, 200)
    assert r.WhichOneof("response") == "request_headers", r
    # With the re-run's own secret, recorded (as a digest) by the re-open.
    assert set_headers(r, "request_headers") == {H.ATTEMPT_ID: aid3,
                                                 H.ATTEMPT_SECRET: sent2[H.ATTEMPT_SECRET]}
    assert sent2[H.ATTEMPT_SECRET] != sent[H.ATTEMPT_SECRET]
    assert await p.ledger.credential(rid, aid3) == (digest(sent2[H.ATTEMPT_SECRET]), ANY_REV)
    # Kept for Envoy's later attempts: a removal here would hold for them too.
    assert list(r.request_headers.response.header_mutation.remove_headers) == [H.PREADMITTED]
    gate.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
    gate.send(resp_body(SSE_ROLE + SSE_CONTENT))
    released = set_headers((await gate.wait_for(3))[1], "response_headers")
    handoff = json.loads(released[H.HANDOFF])
    assert (handoff["attempt"], handoff["attempt_id"]) == (3, aid3)
    again.send(resp_headers({":status": "200", "content-type": "text/event-stream",
                             H.HANDOFF: released[H.HANDOFF]}))
    again.send(resp_body(SSE_ROLE + SSE_CONTENT))
    again.send(resp_body(SSE_DONE, eos=True))
    await again.wait_for(5)
    again.close()
    await asyncio.wait_for(atask, 3)
    await p.drain()
    done = await store.get(rid)
    assert done is not None and done.outcome is not None
    assert done.outcome["outcome"] == "completed" and done.delivery is not None
    assert done.delivery["attempt"] == 3
    assert [a["attempt"] for a in done.attempts] == [1, 2, 3]
    assert done.attempts[2]["released"] is True and done.live_attempt_id is None
    d = done.to_dict()
    assert (d["attempt"], d["runs"], d["retry_budget"]) == (3, 2, 1)
    assert [x["outcome"]["outcome"] for x in d["history"]] == ["upstream_failed"]

    # Completed now: a further repeat is answered from the journal, nothing runs.
    third, _, ttask = start(GuardSession, p)
    third.send(req_headers(DOWN))
    third.send(req_body(CHAT))
    status, body = immediate((await third.wait_for(2))[1])
    assert status == 409 and body["error"]["code"] == "request_already_completed"
    third.close()
    await asyncio.wait_for(ttask, 3)


async def test_a_repeat_with_another_body_is_still_refused_after_a_failed_run() -> None:
    p, store = proc()
    guard, _, gtask = start(GuardSession, p)
    guard.send(req_headers(DOWN))
    rid = set_headers((await guard.wait_for(1))[0], "request_headers")[H.REQUEST_ID]
    guard.send(req_body(CHAT))
    await guard.wait_for(2)
    guard.send(resp_headers({":status": "503", "content-type": "application/json"}))
    guard.send(resp_body(b"{}", eos=True))
    await guard.wait_for(4)
    guard.close()
    await asyncio.wait_for(gtask, 3)
    await p.drain()
    other = json.dumps({**json.loads(CHAT), "max_tokens": 3}).encode()
    again, _, atask = start(GuardSession, p)
    again.send(req_headers(DOWN))
    again.send(req_body(other))
    status, body = immediate((await again.wait_for(2))[1])
    assert status == 422 and body["error"]["code"] == "idempotency_key_reused"
    again.close()
    await asyncio.wait_for(atask, 3)
    view = await store.get(rid)
    assert view is not None and view.outcome is not None and view.history == ()


# --- the attempt credential and the tool route (decision 0028) ------------------------------

TOOL_RID, TOOL_AID = "req_" + "t" * 26, "att_" + "a" * 26
OTHER_RID, OTHER_AID = "req_" + "o" * 26, "att_" + "b" * 26
SECRET_A, SECRET_B = "secret_of_a_".ljust(43, "a"), "secret_of_b_".ljust(43, "b")


def tool_headers(rid: str, aid: str, secret: str | None, call: str = "evil_1",
                 path: str = "/tools/demo_tool") -> ep.ProcessingRequest:
    h = {":method": "POST", ":path": path, "content-type": "application/json",
         H.REQUEST_ID: rid, H.ATTEMPT_ID: aid, "x-tool-call-id": call}
    if secret is not None:
        h[H.ATTEMPT_SECRET] = secret
    return req_headers(h)


async def two_live_requests() -> tuple[Processor, MemoryStore]:
    """TOOL_RID's attempt TOOL_AID and OTHER_RID's OTHER_AID are live, each with its own
    credential (as their intakes write them)."""
    p, store = proc()
    for rid, aid, secret in ((TOOL_RID, TOOL_AID, SECRET_A), (OTHER_RID, OTHER_AID, SECRET_B)):
        assert await store.open_request(rid, {"request_id": rid}, (aid, {"attempt": 1,
                                                                          "attempt_id": aid}),
                                        credential=digest(secret)) is None
    return p, store


async def one_call(p: Processor, msg: ep.ProcessingRequest, tools: bool = True
                   ) -> ep.ProcessingResponse:
    ctx = FakeContext()
    s = GuardSession(p, ctx, tools=tools)
    task = asyncio.ensure_future(s.run())
    ctx.send(msg)
    (r,) = await ctx.wait_for(1)
    ctx.close()
    await asyncio.wait_for(task, 3)
    await p.drain()
    return r


@pytest.mark.parametrize("case", ["none", "wrong", "other attempt's", "other request's ids",
                                  "malformed", "the digest"])
async def test_a_tool_call_without_the_live_attempts_own_secret_is_403_and_claims_nothing(
        case: str) -> None:
    p, store = await two_live_requests()
    rid, aid, secret = {
        "none": (TOOL_RID, TOOL_AID, None),
        "wrong": (TOOL_RID, TOOL_AID, "x" * 43),
        "other attempt's": (TOOL_RID, TOOL_AID, SECRET_B),  # request B's worker, A's ids
        "other request's ids": (TOOL_RID, OTHER_AID, SECRET_B),  # B's attempt, A's request
        "malformed": (TOOL_RID, TOOL_AID, SECRET_A + "!"),
        "the digest": (TOOL_RID, TOOL_AID, digest(SECRET_A)),  # what the journal keeps
    }[case]
    r = await one_call(p, tool_headers(rid, aid, secret))
    status, body = immediate(r)
    assert status == 403 and body["error"]["code"] == "tool_call_unauthorized"
    # One answer for every case (no oracle): the one a missing secret gets.
    none = await one_call(p, tool_headers(rid, aid, None))
    assert r.immediate_response.body == none.immediate_response.body
    assert secret is None or secret.encode() not in r.SerializeToString()
    # Nothing claimed, nothing forwarded; the attempts are unharmed.
    assert await p.ledger.get(f"{rid}:evil_1") == (None, False)
    for owner, live in ((TOOL_RID, TOOL_AID), (OTHER_RID, OTHER_AID)):
        view = await store.get(owner)
        assert view is not None and view.live_attempt_id == live


async def test_the_live_attempts_own_secret_claims_and_stops_at_the_gateway() -> None:
    p, _ = await two_live_requests()
    r = await one_call(p, tool_headers(TOOL_RID, TOOL_AID, SECRET_A, call="call_1"))
    assert r.WhichOneof("response") == "request_headers", r
    assert set_headers(r, "request_headers") == {"idempotency-key": f"{TOOL_RID}:call_1"}
    # The tool server never sees the credential.
    assert list(r.request_headers.response.header_mutation.remove_headers) == [
        H.ATTEMPT_SECRET]
    # Claimed by it (the stream then closed before any result: recorded as unknown).
    entry, _ = await p.ledger.get(f"{TOOL_RID}:call_1")
    assert entry is not None and entry["state"] == "unknown"
    assert entry["attempt_id"] == TOOL_AID and SECRET_A not in json.dumps(entry)


async def test_a_fenced_attempts_secret_no_longer_claims() -> None:
    p, store = await two_live_requests()
    await store.end_attempt(TOOL_RID, 1, TOOL_AID, {"attempt": 1}, expire=True)
    status, body = immediate(await one_call(p, tool_headers(TOOL_RID, TOOL_AID, SECRET_A)))
    assert status == 409 and body["error"]["code"] == "attempt_fenced"
    assert await p.ledger.get(f"{TOOL_RID}:evil_1") == (None, False)


async def test_the_client_listener_never_serves_the_tool_route() -> None:
    p, _ = await two_live_requests()
    # Even with the live attempt's own secret: role `guard` refuses before reading anything.
    before = await p.ledger.credential(TOOL_RID, TOOL_AID)
    p.ledger = None  # type: ignore[assignment]  # any use of the ledger would raise
    status, body = immediate(await one_call(p, tool_headers(TOOL_RID, TOOL_AID, SECRET_A),
                                            tools=False))
    assert status == 404 and body["error"]["code"] == "tool_route_not_here"
    assert before[0] == digest(SECRET_A)


async def test_the_tool_listener_serves_nothing_but_the_tool_route() -> None:
    p, store = proc()
    for path in ("/v1/chat/completions", f"/v1/requests/{RID}", "/v1/models"):
        status, body = immediate(await one_call(p, req_headers({**DOWN, ":path": path})))
        assert status == 404 and body["error"]["code"] == "tool_route_not_here"
    assert await store.get(RID) is None


async def test_the_request_phase_says_each_refusal_once_from_its_rows(
        caplog: pytest.LogCaptureFixture) -> None:
    # The request phase's log lines come from the observer (role, transition, actions).
    caplog.set_level(logging.INFO, logger="extproc")
    p, store = proc()
    misrouted = await one_call(p, req_headers({**DOWN, ":path": "/v1/chat/completions?x=1"}))
    bad_key = await one_call(p, req_headers({**DOWN, "idempotency-key": "a b"}), tools=False)
    store.unavailable = True
    lookup = await one_call(p, req_headers({":method": "GET", ":path": f"/v1/requests/{RID}"},
                                           eos=True), tools=False)
    assert [immediate(r)[1]["error"]["code"] for r in (misrouted, bad_key, lookup)] == [
        "tool_route_not_here", "invalid_idempotency_key", "journal_unavailable"]
    assert [(r.getMessage(), getattr(r, "request_id", None)) for r in caplog.records] == [
        ("request refused: wrong listener for its path", None),
        ("request rejected", None),
        ("journal unavailable", RID)]
    assert caplog.records[0].path == "/v1/chat/completions"  # type: ignore[attr-defined]


async def test_gate_of_a_later_attempt_sends_its_own_secret_never_attempt_1s() -> None:
    p, store = proc()
    await open_request(store, p)
    await store.end_attempt(RID, 1, "att_pre", {"attempt": 1}, expire=False)
    ctx, _, task = start(GateSession, p)
    ctx.send(gate_headers(2, p.clock.wall()))  # attempt 1's secret still on the request
    (r,) = await ctx.wait_for(1)
    sent = set_headers(r, "request_headers")
    aid2, secret2 = sent[H.ATTEMPT_ID], sent[H.ATTEMPT_SECRET]
    assert aid2 != "att_pre" and secret2 != PRE_SECRET
    assert await p.ledger.credential(RID, aid2) == (digest(secret2), ANY_REV)
    # Attempt 1's secret no longer matches anything live; the new one is attempt 2's.
    ctx.close()
    await asyncio.wait_for(task, 3)


async def test_a_repeat_of_a_running_tool_call_waits_on_timers_then_gets_the_result() -> None:
    """The bounded wait runs on the executor's Timers port over a fake clock (no real
    time): the second call of a key waits while the first runs, and replays its result
    once recorded."""
    from extproc.adapters.tools import ToolCallHandler
    p, _ = await two_live_requests()
    timers = FakeTimers(FakeClock())
    first_out: list[ep.ProcessingResponse] = []

    async def w1(r: ep.ProcessingResponse) -> None:
        first_out.append(r)
    first = ToolCallHandler(p.cfg, p.ledger, w1, p.spawn, timers.clock, timers)
    hd = {":method": "POST", ":path": "/tools/demo_tool", H.REQUEST_ID: TOOL_RID,
          H.ATTEMPT_ID: TOOL_AID, "x-tool-call-id": "call_w", H.ATTEMPT_SECRET: SECRET_A}
    await first.on_request_headers(dict(hd))
    assert first_out[-1].WhichOneof("response") == "request_headers"  # forwarded
    second_out: list[ep.ProcessingResponse] = []

    async def w2(r: ep.ProcessingResponse) -> None:
        second_out.append(r)
    second = ToolCallHandler(p.cfg, p.ledger, w2, p.spawn, timers.clock, timers)
    waiting = asyncio.ensure_future(second.on_request_headers(dict(hd)))
    await idle()
    assert timers.pending() == 1 and second_out == []  # it waits, on a timer
    assert timers.advance(0.005) == 0
    assert timers.advance(0.005) == 1  # the first pause: still running, a longer one
    await idle()
    assert timers.pending() == 1 and second_out == []
    # Meanwhile the tool server answers the first call.
    await first.on_response_headers({":status": "200", "content-type": "application/json"},
                                    False)
    await first.on_response_body(b'{"r":1}', True)
    assert timers.advance(0.02) == 1
    await asyncio.wait_for(waiting, 3)
    (r,) = second_out
    assert r.immediate_response.status.code == 200 and r.immediate_response.body == b'{"r":1}'
    replayed = {h.header.key: h.header.raw_value.decode()
                for h in r.immediate_response.headers.set_headers}
    assert replayed.get("x-tool-replayed") == "true"
    # The first call's caller got its last chunk after the record.
    assert first_out[-1].WhichOneof("response") == "response_body"


async def test_an_unreadable_hand_off_is_said_once_and_nothing_taken_over(
        caplog: pytest.LogCaptureFixture) -> None:
    # The row reads the header (UnreadableHandOff); the observer says it, the session owns
    # nothing, and the headers go on as any accepted request's.
    caplog.set_level(logging.INFO, logger="extproc")
    timers = FakeTimers(FakeClock())
    p, _ = proc(timers=timers)
    ctx, s, task = start(GuardSession, p)
    ctx.send(req_headers(DOWN))
    ctx.send(req_body(CHAT))
    await ctx.wait_for(2)
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream",
                           H.HANDOFF: "{not json"}))
    r = (await ctx.wait_for(3))[2]
    assert set_headers(r, "response_headers") == {H.REQUEST_ID: s.rid}
    assert s.released is None and s.m.released_id is None
    assert [rec.getMessage() for rec in caplog.records
            if "hand-off" in rec.getMessage()] == ["unreadable attempt hand-off"]
    ctx.close()
    await asyncio.wait_for(task, 3)
    await run_on(timers, p.drain())
    assert timers.clock.now == 0.05  # the outcome waited for its access-log entry

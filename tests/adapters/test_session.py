"""adapters/session: the roles' one executor. Messages are read in order, one at a time,
until the stream's end; the end is cleaned up whatever happened; an action is a codec write
or a port call whose answer is the next event; an answer that comes on its own is fed in
turn, and not once the stream is over if it asked for an open stream; a write to a stream
Envoy closed marks it closed instead of failing the handler."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import grpc
import pytest

from extproc.adapters.session import Session, Turn
from extproc.core.events import Event, LeaseLost, TimerFired, TimerKind
from extproc.gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from .support import FakeClock, FakeTimers, idle


@dataclass(frozen=True)
class Write:
    text: str


@dataclass(frozen=True)
class Ask:
    pass


class Stream:
    def __init__(self, msgs: list[Any], gone_after: int | None = None) -> None:
        self.msgs, self.out, self.gone_after = list(msgs), [], gone_after

    async def read(self) -> Any:
        return self.msgs.pop(0) if self.msgs else grpc.aio.EOF

    async def write(self, m: Any) -> None:
        if self.gone_after is not None and len(self.out) >= self.gone_after:
            raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata())
        self.out.append(m)


async def _ask(s: Toy, a: Ask) -> Event:
    return LeaseLost()


class Toy(Session):
    __slots__ = ("cleaned", "fail_on", "fed", "m", "seen", "tasks")
    ROLE = "toy"
    WRITES: ClassVar[dict[type, Any]] = {Write: lambda s, a: ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(details=a.text))}
    ACTS: ClassVar[dict[type, Any]] = {Ask: _ask}

    def __init__(self, ctx: Stream, fail_on: str = "") -> None:
        self.tasks: list[asyncio.Task[Any]] = []
        timers = FakeTimers(FakeClock())
        proc = SimpleNamespace(timers=timers, clock=timers.clock,
                               tel=SimpleNamespace(enabled=False))
        super().__init__(proc, ctx, lambda c, n: self.tasks.append(asyncio.ensure_future(c)))
        self.m: Any = object()
        self.seen: list[str] = []
        self.fed: list[Event] = []
        self.cleaned = 0
        self.fail_on = fail_on

    async def on_message(self, which: str, msg: ep.ProcessingRequest) -> None:
        self.seen.append(which)
        if which == self.fail_on:
            raise RuntimeError("a bug in the role")
        if which == "response_headers":
            self.detach = True  # handed off: the rest of the HTTP stream goes without us

    async def on_closed(self) -> None:
        self.cleaned += 1

    async def feed(self, ev: Event) -> None:
        self.fed.append(ev)


def msg(which: str) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(**{which: ep.HttpHeaders() if "headers" in which
                                   else ep.HttpBody()})


async def test_messages_are_handled_in_order_until_the_end_then_cleaned_up() -> None:
    s = Toy(Stream([msg("request_headers"), msg("request_body"), None, msg("request_body")]))
    await s.run()
    assert s.seen == ["request_headers", "request_body"]  # None is an end too (grpclib)
    assert s.closed and s.cleaned == 1


async def test_the_end_is_cleaned_up_even_when_handling_failed() -> None:
    s = Toy(Stream([msg("request_headers"), msg("request_body")]), fail_on="request_headers")
    with pytest.raises(RuntimeError):
        await s.run()
    assert s.seen == ["request_headers"] and s.cleaned == 1 and s.closed


async def test_a_detached_stream_reads_no_more() -> None:
    s = Toy(Stream([msg("response_headers"), msg("response_body")]))
    await s.run()
    assert s.seen == ["response_headers"] and s.cleaned == 1


async def test_an_action_is_a_write_or_a_port_call_answered_by_an_event() -> None:
    ctx = Stream([])
    s = Toy(ctx)
    write = s.act(Write("hello"))
    assert write is not None and await write is None
    assert ctx.out[0].immediate_response.details == "hello"
    ask = s.act(Ask())
    assert ask is not None and await ask == LeaseLost()
    assert s.act(TimerFired(TimerKind.STALL)) is None  # not an action of this role


async def test_a_write_to_a_stream_envoy_closed_closes_it_quietly() -> None:
    ctx = Stream([], gone_after=1)
    s = Toy(ctx)
    await s.write(ep.ProcessingResponse())
    await s.write(ep.ProcessingResponse())  # Envoy reset the stream: no exception
    assert s.closed and len(ctx.out) == 1
    await s.write(ep.ProcessingResponse())
    assert len(ctx.out) == 1


async def test_answers_that_come_later_are_fed_in_turn_and_timers_only_while_open() -> None:
    s = Toy(Stream([]))
    fut: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
    s.later(fut, "wait")
    await idle()
    assert s.fed == []
    fut.set_result(LeaseLost())
    await idle()
    assert s.fed == [LeaseLost()]
    s.timers.start(TimerKind.STALL, 1.0)
    s.p.timers.advance(1.0)
    await idle()
    assert s.fed[-1] == TimerFired(TimerKind.STALL, s.p.clock.monotonic(), s.p.clock.wall())
    s.closed = True
    s.fired(TimerKind.CHECKPOINT)  # the stream is over: a timer feeds nothing
    s.later(LeaseLost(), "late")  # but an answer the stream waited for still is
    await idle()
    assert s.fed[2:] == [LeaseLost()]
    s.m = None  # no machine: nothing to feed
    s.later(LeaseLost(), "none")
    await idle()
    assert len(s.fed) == 3


# --- the stream's lock (Turn) ---------------------------------------------------------
# A stream's lock (session.Turn): one holder, waiters served in the order they asked,
# cancellation never losing or duplicating the turn. It replaced asyncio.Lock on the message
# path, so it must keep that lock's contract.


async def _holder(turn: Turn, name: str, log: list[str], go: asyncio.Event) -> None:
    async with turn:
        log.append(f"{name} in")
        await go.wait()
        log.append(f"{name} out")


async def test_one_holder_at_a_time_in_the_order_they_asked() -> None:
    turn, log, go = Turn(), [], asyncio.Event()
    assert turn.take() and not turn.take()  # held: nobody else takes it
    tasks = [asyncio.ensure_future(_holder(turn, n, log, go)) for n in "abc"]
    await idle()
    assert log == []  # all three wait
    turn.release()
    await idle()
    assert log == ["a in"] and turn.held
    assert not turn.take()  # handed over: a message cannot overtake a waiter
    go.set()
    await asyncio.gather(*tasks)
    assert log == ["a in", "a out", "b in", "b out", "c in", "c out"]
    assert not turn.held and turn.take()


async def test_a_waiter_cancelled_while_waiting_is_skipped() -> None:
    turn, log, go = Turn(), [], asyncio.Event()
    turn.take()
    a, b = (asyncio.ensure_future(_holder(turn, n, log, go)) for n in "ab")
    await idle()
    a.cancel()
    await idle()
    turn.release()
    go.set()
    await b
    assert log == ["b in", "b out"] and a.cancelled() and not turn.held


async def test_a_waiter_cancelled_once_handed_the_turn_passes_it_on() -> None:
    turn, log, go = Turn(), [], asyncio.Event()
    turn.take()
    a, b = (asyncio.ensure_future(_holder(turn, n, log, go)) for n in "ab")
    await idle()
    turn.release()  # a is handed the turn, and cancelled before it runs
    a.cancel()
    go.set()
    await b
    with pytest.raises(asyncio.CancelledError):
        await a
    assert log == ["b in", "b out"] and not turn.held


async def test_an_error_inside_releases_it() -> None:
    turn = Turn()

    async def boom() -> None:
        async with turn:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await boom()
    assert not turn.held and turn.take()


def test_a_turn_nobody_waited_for_holds_no_wait_queue() -> None:
    """One Turn per open stream, and nearly every stream never waits: its waiters' deque
    (624 bytes empty, its first block) is made by the first wait (decision 0055)."""
    keep: list[Turn] = []
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keep += [Turn() for _ in range(1000)]
        each = (tracemalloc.get_traced_memory()[0] - before) / len(keep)
    finally:
        tracemalloc.stop()
    assert each < 128, f"{each:.0f} bytes per Turn"


async def test_the_first_wait_makes_the_queue_and_a_cancelled_waiter_leaves_it() -> None:
    turn, log, go = Turn(), [], asyncio.Event()
    turn.take()
    assert not turn._waiters  # none yet (the read loop tests it for truth, as here)
    a = asyncio.ensure_future(_holder(turn, "a", log, go))
    await idle()
    assert len(turn._waiters or ()) == 1
    a.cancel()
    await idle()
    assert not turn._waiters and turn.held
    turn.release()
    assert not turn.held and turn.take()


async def test_an_open_stream_waiting_for_its_next_message_holds_none_it_read() -> None:
    """The read loop waits for the next message most of an open stream's life: it holds
    neither the last message read (a parsed message keeps its protobuf arena), its kind,
    nor the last fast answer, nor a bound method of the stream (decision 0059); and the
    stream still goes on as before."""
    from extproc.adapters.guard import GuardSession

    from .test_sessions import (
        CHAT,
        DOWN,
        SSE_CONTENT,
        SSE_ROLE,
        proc,
        req_body,
        req_headers,
        resp_body,
        resp_headers,
        start,
    )

    p, _ = proc()
    ctx, s, task = start(GuardSession, p)
    msgs = [req_headers(DOWN), req_body(CHAT),
            resp_headers({":status": "200", "content-type": "text/event-stream"}),
            resp_body(SSE_ROLE + SSE_CONTENT), resp_body(SSE_CONTENT)]
    for n, msg in enumerate(msgs, 1):
        ctx.send(msg)
        await ctx.wait_for(n)
        await idle()
        frame = task.get_coro().cr_frame
        assert frame is not None
        held = {k: v for k, v in frame.f_locals.items()
                if isinstance(v, (ep.ProcessingRequest, ep.ProcessingResponse, types.MethodType))
                or (k == "which" and v is not None)}
        assert held == {}, f"after message {n}: {held}"
    assert s.first_delta_evented  # the last chunk went the fast way, and was answered
    out = ctx.out[-1].response_body.response.body_mutation.streamed_response.body
    assert out == SSE_CONTENT
    ctx.close()
    await task
    await p.drain()


def test_a_stream_without_tracing_keeps_no_metadata_of_its_own() -> None:
    """Its initial metadata is read only for trace context: with tracing off every stream
    shares one empty, read-only mapping instead of an empty dict each."""
    from extproc.adapters.guard import GuardSession
    from extproc.adapters.session import NO_METADATA

    from .test_sessions import FakeContext, proc

    p, _ = proc()
    a, b = GuardSession(p, FakeContext()), GuardSession(p, FakeContext())
    assert a.md is NO_METADATA and b.md is NO_METADATA and dict(a.md) == {}
    with pytest.raises(TypeError):
        a.md["traceparent"] = "x"  # type: ignore[index]

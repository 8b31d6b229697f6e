"""How an ext_proc stream is read and its machine's actions run: the roles' one executor.

`Session` reads messages in order, one at a time, answered by the role's `on_message`,
cleaned up by `on_closed`; it runs each action the role's machine answers with (`act`)
and feeds an answer that comes on its own in turn (`later`). It reads and writes through
`Messages`, which both gRPC stacks' streams provide (`server.transport`, decision 0020).
What the streams of one process share is `processor.Processor`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

import grpc
import grpclib.exceptions
import h2.exceptions
from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan, Span

from ..core.events import Action, Event, StartTimer, StopTimers, TimerFired, TimerKind
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from .ports import Clock
from .timers import TimerSet

INVALID = NonRecordingSpan(INVALID_SPAN_CONTEXT)
# A stream's initial metadata when tracing is off (nothing reads it then): one shared,
# read-only empty mapping instead of an empty dict per open stream.
NO_METADATA: Mapping[str, str] = MappingProxyType({})
# llmgw.chunk.processing_time is recorded for one body message in this many (a histogram
# record per message would cost more than the message's own processing).
CHUNK_TIME_SAMPLE = 64


class Messages(Protocol):
    """One ext_proc stream's messages: grpc.aio's servicer context, or grpclib's stream
    behind `grpclib_server.StreamMessages`. `read` returns `grpc.aio.EOF` or None at the end."""

    async def read(self) -> Any: ...

    async def write(self, message: Any) -> None: ...


# What writing to a stream Envoy already closed raises, on either stack. grpc.aio's own
# "execute_batch" failure (a write racing Envoy's reset of the stream, seen after a gate's
# 503 when Envoy retried at once) is not public API: found by name.
_BATCH_GONE: type[Exception] = getattr(getattr(grpc, "_cython", None) and
                                       grpc._cython.cygrpc, "ExecuteBatchError", RuntimeError)
WRITE_GONE = (grpc.aio.AioRpcError, RuntimeError, asyncio.InvalidStateError,
              grpclib.exceptions.StreamTerminatedError, grpclib.exceptions.ProtocolError,
              h2.exceptions.ProtocolError, ConnectionError, _BATCH_GONE)


class Turn:
    """A stream's lock: its messages and the answers that come on their own (`later`), one
    at a time, in the order they asked (asyncio.Lock's contract, cancellation included).

    Taken and released with one call each when free, as it is for nearly every message:
    asyncio.Lock's `async with` cost ~5.7k instructions per message under callgrind (its
    __aenter__/__aexit__ coroutines, acquire, release, the wake-up), a twentieth of a
    chunk's. A release hands the turn to the first waiter still waiting, so a message
    never overtakes an answer that asked first.

    The waiters' deque is made by the first wait (None until then, falsy as an empty one
    is): an empty deque is 624 bytes (its first block), one per open stream, and nearly
    every stream never waits (decision 0055)."""

    __slots__ = ("_waiters", "held")

    def __init__(self) -> None:
        self.held = False
        self._waiters: deque[asyncio.Future[None]] | None = None

    def take(self) -> bool:
        """The turn at once, if it is free and nobody waits for it."""
        if self.held or self._waiters:
            return False
        self.held = True
        return True

    async def acquire(self) -> None:
        if self.take():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if (waiters := self._waiters) is None:
            waiters = self._waiters = deque()
        waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed the turn as it was cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    waiters.remove(fut)
            raise
        # `release` handed it over: `held` stayed True.

    def release(self) -> None:
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.held = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class Session:
    """One Envoy ext_proc stream, the roles' shared executor: read messages in order, feed
    the role's machine, run each action it answers with (a codec write from `WRITES`, or a
    port call from `ACTS` whose answer, if it waits, is an event), clean up at the end.

    Sessions use __slots__: one exists per open stream, and 10,000 open streams is a target.
    """

    __slots__ = ("cfg", "closed", "ctx", "detach", "lock", "md", "p", "rid", "span", "spawn",
                 "timers")
    ctx: Messages
    lock: Turn
    closed: bool
    rid: str | None
    # Set by the gate once it handed its attempt to the guard: returning from the handler
    # closes the gRPC stream with OK, and Envoy processes the rest of this HTTP stream
    # without us (ext_proc's onGrpcClose; chunks in flight are passed on unchanged).
    detach: bool
    md: Mapping[str, str]
    span: Span
    p: Any  # the role's ports (GatePorts, GuardPorts), each session's own type
    m: Any  # the role's machine once the stream has one
    timers: TimerSet[TimerKind]
    ROLE: ClassVar[str] = ""  # in the names of the work a stream leaves behind
    # Per role: the actions that are one codec write, and the other actions' port calls.
    WRITES: ClassVar[dict[type, Callable[[Any, Any], ep.ProcessingResponse]]] = {}
    ACTS: ClassVar[dict[type, Callable[[Any, Any], Awaitable[Event | None] | None]]] = {}
    # The timers' actions, the same in every role's ACTS.
    TIMER_ACTS: ClassVar[dict[type, Callable[[Any, Any], None]]] = {
        StartTimer: lambda s, a: s.timers.start(a.kind, a.seconds),
        StopTimers: lambda s, a: s.timers.stop()}

    def __init__(self, proc: Any, ctx: Messages,
                 spawn: Callable[[Awaitable[Any], str], object]) -> None:
        self.detach, self.closed, self.p, self.ctx, self.spawn = False, False, proc, ctx, spawn
        self.lock, self.md, self.span, self.rid = Turn(), NO_METADATA, INVALID, None
        self.timers = TimerSet(proc.timers, proc.clock, self.fired)

    async def write(self, resp: ep.ProcessingResponse) -> None:
        if self.closed:
            return
        try:
            await self.ctx.write(resp)
        except WRITE_GONE:
            self.closed = True

    def act(self, a: Action) -> Awaitable[Event | None] | None:
        """One action: its codec write, or its port call; what to await for it (the
        write, or the call's answer), None when it is done already (a call that returns
        nothing: no coroutine made for it)."""
        if (w := self.WRITES.get(type(a))) is not None:
            return self.write(w(self, a))
        if (do := self.ACTS.get(type(a))) is not None:
            return do(self, a)
        return None

    async def feed(self, ev: Event) -> None:
        raise NotImplementedError

    def later(self, answer: Event | Awaitable[Event] | Callable[[Clock], Event], name: str,
              open_only: bool = False) -> None:
        """An answer that comes on its own (a journal write's, a timer, the watch, Envoy's
        word, the stream's end): fed in turn, under the stream's lock, while the stream has
        a machine (and is open, if `open_only`); a callable is given the clock then."""
        async def fire() -> None:
            ev = await answer if inspect.isawaitable(answer) else answer
            lock = self.lock
            if not lock.take():  # `async with lock`, without its two coroutines when free
                await lock.acquire()
            try:
                if self.m is not None and not (open_only and self.closed):
                    await self.feed(ev(self.p.clock) if callable(ev) else ev)
            finally:
                lock.release()
        self.spawn(fire(), name)

    def fired(self, kind: TimerKind) -> None:
        self.later(lambda c: TimerFired(kind, c.monotonic(), c.wall()),
                   f"{self.ROLE}-timer-{kind}-{self.rid}", open_only=True)

    # The message whose handling the process's chunk-time histogram samples ("": none).
    TIMED: ClassVar[str] = ""
    # The message kind a role may answer at once (`fast`), without an event ("": none).
    FAST: ClassVar[str] = ""

    def fast(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse | None:
        """The answer to a `FAST` message that the role's core decided without its table
        (core.guard.streaming_chunk), or None: `on_message` handles the message. Called
        from the read loop itself, one coroutine less per message; `fast_done` runs once
        the answer is written."""
        return None

    def fast_done(self) -> None:
        return None

    async def _fast_or_message(self, which: str, msg: ep.ProcessingRequest) -> None:
        """The read loop's step, as one coroutine (for the sampled message it times)."""
        if which == self.FAST and (resp := self.fast(msg)) is not None:
            await self.write(resp)
            self.fast_done()
        else:
            await self.on_message(which, msg)

    async def run(self) -> None:
        # (ctx.read() and ctx.write() called as methods: a bound method held by this frame
        # is 64 bytes per open stream.)
        ctx, lock, eof, tel, timed = self.ctx, self.lock, grpc.aio.EOF, self.p.tel, self.TIMED
        fast = self.FAST
        try:
            while not self.detach:
                msg = await ctx.read()
                if msg is eof or msg is None:
                    break
                which = msg.WhichOneof("request") or ""
                # lock.take() and lock.release(), inlined: once per message.
                if lock.held or lock._waiters:
                    await lock.acquire()
                else:
                    lock.held = True
                try:
                    # Nothing per message unless metrics are exported; then one in
                    # CHUNK_TIME_SAMPLE of the timed kind is measured.
                    if which == timed and tel.enabled:
                        tel.chunks_seen += 1
                        if tel.chunks_seen % CHUNK_TIME_SAMPLE == 0:
                            t0 = time.perf_counter()
                            await self._fast_or_message(which, msg)
                            tel.chunk_time.record((time.perf_counter() - t0) * 1000)
                            continue
                    if which == fast and (resp := self.fast(msg)) is not None:
                        if not self.closed:  # self.write, inlined
                            try:
                                await ctx.write(resp)
                            except WRITE_GONE:
                                self.closed = True
                        self.fast_done()
                        continue
                    await self.on_message(which, msg)
                finally:
                    if lock._waiters:
                        lock.release()
                    else:
                        lock.held = False
                    # Not held while the next read waits: a parsed message keeps its
                    # protobuf arena (~0.7 KiB for a chunk, most of it outside Python's
                    # allocator), and an open stream is mostly waiting here.
                    msg = resp = which = None
        finally:
            self.closed = True
            await self.on_closed()

    async def on_message(self, which: str, msg: ep.ProcessingRequest) -> None:
        raise NotImplementedError

    async def on_closed(self) -> None:
        raise NotImplementedError

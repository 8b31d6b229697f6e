"""The tool route's executor: Envoy's messages in as events, `core.tool_route`'s actions out
as codec and ledger calls.

A call is forwarded to the tool server only by the one request that claims its ledger key,
and only with its attempt's credential while that attempt is the live one (decision 0028);
everyone else gets the recorded result, waits for it (bounded), or a clear refusal. Every
one of those rules is a row of `core.tool_route.ToolRoute`; here each action is carried out,
a wait's answer (a store's reply, a timer) fed back as the next event. The log lines are
derived from (event, actions) in `observe`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ..core.config import Config
from ..core.headers import ATTEMPT_ID
from ..core.tool_route import (
    Action,
    Answer,
    AnswerReplay,
    Claim,
    ClaimAnswered,
    ContinueRequestBody,
    CredentialRead,
    Event,
    Forward,
    HeadersSeen,
    LedgerRead,
    PassBody,
    PassResponseHeaders,
    ReadCredential,
    ReadLedger,
    Record,
    Recorded,
    RecordLater,
    RequestBodySeen,
    ResponseBodySeen,
    ResponseHeadersSeen,
    StartTimer,
    StoreDown,
    StreamClosed,
    TimerFired,
    ToolRoute,
    UndoClaimLater,
    Why,
)
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from .leases import UNDO_SETTLE_S, StoreUnavailable
from .logs import rlog
from .ports import Clock, Ledger
from .processor import OUTCOME_RETRY_S, retrying
from .timers import Timers, sleep

log = logging.getLogger("extproc.tools")


class ToolPorts(Protocol):
    """What the tool route needs from its process, declared here by its consumer: the
    configuration, the ledger, the clock and the Timers port of its bounded wait and its
    retried ledger writes, and
    background work for the writes that outlive the stream."""

    @property
    def cfg(self) -> Config: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def timers(self) -> Timers: ...

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...


class ToolCallHandler:
    def __init__(self, cfg: Config, ledger: Ledger,
                 write: Callable[[ep.ProcessingResponse], Awaitable[None]],
                 spawn: Callable[[Awaitable[Any], str], Any],
                 clock: Clock, timers: Timers) -> None:
        t = cfg.tools
        self.m = ToolRoute(t.path_prefix, t.wait_s, t.max_result_bytes)
        self.ledger = ledger
        self.write = write
        self.spawn = spawn
        self.clock = clock
        # The timers of the bounded wait and of the ledger's retried writes, on the clock's
        # time (the process's: `over`).
        self.timers = timers

    @classmethod
    def over(cls, p: ToolPorts, write: Callable[[ep.ProcessingResponse], Awaitable[None]]
             ) -> ToolCallHandler:
        """A tool call's handler on its process's ports (the tool listener's guard)."""
        return cls(p.cfg, p.ledger, write, p.spawn, p.clock, p.timers)

    def retrying(self, fn: Callable[[], Awaitable[Any]], what: str,
                 limit_s: float | None = None, settle_s: float = 0.0) -> Awaitable[bool]:
        """`processor.retrying` for this call's ledger write, on its Timers port and clock."""
        return retrying(fn, what, self.rid, self.aid,
                        OUTCOME_RETRY_S if limit_s is None else limit_s, settle_s,
                        timers=self.timers, now=self.clock.monotonic)

    @property
    def rid(self) -> str | None:
        return self.m.request_id

    @property
    def aid(self) -> str | None:
        return self.m.attempt_id

    async def on_message(self, which: str, msg: ep.ProcessingRequest) -> None:
        """Envoy's messages after the tool call's headers (its body passes untouched)."""
        if which == "request_body":
            await self.write(codec.continue_request_body())
        elif which == "response_headers":
            await self.on_response_headers(codec.headers_dict(msg.response_headers.headers),
                                           msg.response_headers.end_of_stream)
        else:
            await self.on_response_body(msg.response_body.body, msg.response_body.end_of_stream)

    async def on_request_headers(self, hd: dict[str, str]) -> None:
        await self.feed(HeadersSeen(hd))

    async def on_request_body(self) -> None:
        await self.feed(RequestBodySeen())

    async def on_response_headers(self, hd: dict[str, str], end_of_stream: bool) -> None:
        await self.feed(ResponseHeadersSeen(hd, end_of_stream, self.clock.wall()))

    async def on_response_body(self, data: bytes, end_of_stream: bool) -> None:
        await self.feed(ResponseBodySeen(data, end_of_stream, self.clock.wall()))

    async def on_closed(self) -> None:
        await self.feed(StreamClosed(self.clock.wall()))

    async def feed(self, ev: Event) -> None:
        """Feed `ev`, carry out its actions; an action that waits feeds its answer next."""
        pending: list[Event] = [ev]
        while pending:
            ev = pending.pop()
            actions = self.m.handle(ev)
            observe(self.m, ev, actions)
            for a in actions:
                nxt = await self.act(a)
                if nxt is not None:
                    pending.append(nxt)

    async def act(self, a: Action) -> Event | None:
        ledger = self.ledger
        try:
            if isinstance(a, ReadCredential):
                stored, rev = await ledger.credential(a.request_id, a.attempt_id)
                return CredentialRead(stored, rev, self.clock.wall())
            if isinstance(a, Claim):
                got = await ledger.claim(a.key, a.request_id, a.attempt_id, a.entry,
                                         a.credential_rev)
                return ClaimAnswered(*got, mono=self.clock.monotonic())
            if isinstance(a, ReadLedger):
                seen, alive = await ledger.get(a.key)
                return LedgerRead(seen, alive, self.clock.monotonic())
        except StoreUnavailable as e:
            return StoreDown(str(e))
        if isinstance(a, StartTimer):
            await sleep(self.timers, a.seconds)
            return TimerFired(a.kind)
        if isinstance(a, Record):
            key, entry = a.key, a.entry
            ok = await self.retrying(lambda: ledger.record(key, entry), a.what, a.limit_s)
            return Recorded(ok)
        if isinstance(a, RecordLater):
            key, entry = a.key, a.entry
            self.spawn(self.retrying(lambda: ledger.record(key, entry), a.what),
                       f"tool-record-{key}")
        elif isinstance(a, UndoClaimLater):
            key, entry = a.key, a.entry
            self.spawn(self.retrying(lambda: ledger.undo_claim(key, entry),
                                     "undo an unconfirmed tool claim",
                                     settle_s=UNDO_SETTLE_S), f"tool-undo-{key}")
        elif isinstance(a, Forward):
            await self.write(codec.continue_request_headers(a.set_headers, remove=a.remove))
        elif isinstance(a, Answer):
            await self.write(codec.immediate(a.error))
        elif isinstance(a, AnswerReplay):
            r = a.replay
            await self.write(codec.immediate_raw(r.status, r.body, r.headers))
        elif isinstance(a, PassResponseHeaders):
            await self.write(codec.continue_response_headers(remove=a.remove))
        elif isinstance(a, PassBody):
            await self.write(codec.streamed_response_body(a.data, a.end_of_stream))
        elif isinstance(a, ContinueRequestBody):
            await self.write(codec.continue_request_body())
        return None


def observe(m: ToolRoute, ev: Event, actions: list[Action]) -> None:
    """The tool route's log lines, derived from what it decided (never its secret)."""
    rid, aid, call = m.request_id, m.attempt_id, m.call
    key = call.key if call else None
    for a in actions:
        if isinstance(a, Answer):
            if a.why is Why.NO_CREDENTIAL and isinstance(ev, HeadersSeen):
                rlog(log, logging.WARNING, "tool call refused: no attempt credential",
                     a.error.request_id, ev.headers.get(ATTEMPT_ID),
                     path=ev.headers.get(":path"))
            elif a.why is Why.UNAUTHORIZED and isinstance(ev, CredentialRead):
                rlog(log, logging.WARNING, "tool call refused: attempt credential missing or "
                     "wrong", rid, aid, tool=call.tool if call else None, key=key,
                     stored=ev.stored is not None)
            elif a.why is Why.FENCED:
                rlog(log, logging.WARNING, "tool call refused: attempt is fenced", rid, aid,
                     key=key)
            elif a.why is Why.REFUSED:
                rlog(log, logging.WARNING, "tool call refused", rid, aid, key=key,
                     code=str(a.error.code))
            elif a.why is Why.UNAVAILABLE and isinstance(ev, StoreDown):
                # Fail closed: no execution without a ledger record.
                rlog(log, logging.WARNING, "tool ledger unavailable: not executing", rid, aid,
                     error=ev.error)
        elif isinstance(a, AnswerReplay):
            rlog(log, logging.INFO, "tool call replayed from the ledger", rid, aid, key=key,
                 status=a.replay.status)
        elif isinstance(a, Forward):
            rlog(log, logging.INFO, "tool call executing", rid, aid,
                 tool=call.tool if call else None, key=key)
        elif isinstance(a, Record) and isinstance(ev, StreamClosed):
            rlog(log, logging.WARNING, "tool call outcome unknown", rid, aid, key=key)
    if isinstance(ev, Recorded) and m.done is not None and m.result is not None:
        rlog(log, logging.INFO, "tool result recorded", rid, aid, key=key, status=m.status,
             size=m.result.size, truncated=m.result.too_large)

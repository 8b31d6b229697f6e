"""The guard: the downstream ext_proc stream that owns a logical request.

It validates the request, opens its journal record (attempt 1 admitted in the same
transaction), orders the compatible hosts for Envoy, counts what reaches the client, owns
the attempt the gate released, and ends a started stream with the terminal error event when
the upstream stalls, errs or loses its fence. A plain executor: Envoy's messages become events
for `core.guard.GuardMachine` (what `core.intake` read of them), its actions codec writes and
port calls, whose answers are fed back; logs, spans and metrics are `observer.guard`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Protocol

from opentelemetry.trace import Span

from ..core import events as E
from ..core import guard as G
from ..core import headers as H
from ..core import records
from ..core.budget import RetryBudget
from ..core.config import Config
from ..core.credentials import digest
from ..core.errors import GatewayError
from ..core.failure import FailureClass
from ..core.guard import GuardMachine
from ..core.handoff import HandOff, TraceSnapshot
from ..core.intake import (
    Generation,
    Prepared,
    StatusLookup,
    ToolCall,
    Verdict,
    body_headers,
    kind_of,
    prepare_intake,
    read_headers,
)
from ..core.journal import JournalView, Outcome, Rerun
from ..core.pool import Pool
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from . import observer
from .leases import UNDO_SETTLE_S, AttemptLease, ProcessLease, StoreUnavailable
from .ports import Clock, GuardJournal, Ids, Ledger, SentLog
from .session import CHUNK_TIME_SAMPLE, INVALID, HandedOff, Messages, Pending, Session, retrying
from .telemetry import Telemetry
from .timers import TimerHandle, Timers
from .tools import ToolCallHandler

# Response headers that never reach a client: the gate's hand-off, and an attempt's secret
# (a replica could echo it back; decision 0028).
NEVER_TO_CLIENT = (H.HANDOFF, H.ATTEMPT_SECRET)



class GuardPorts(Protocol):
    """What one request's guard needs from its process, declared here by its consumer: the
    configuration, the clock, ids and timers, the journal calls of a request, the tool
    ledger, Envoy's word on what it sent, the pool's view and the hosts' order, the
    tokenizers, the budget, the intake in flight, the count of attempts that reached a
    replica, the hand-off, background work and traces. `session.Processor` provides it."""

    @property
    def cfg(self) -> Config: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def ids(self) -> Ids: ...
    @property
    def timers(self) -> Timers: ...
    @property
    def journal(self) -> GuardJournal: ...
    @property
    def ledger(self) -> Ledger: ...
    @property
    def causes(self) -> SentLog: ...
    @property
    def pool(self) -> Pool: ...
    @property
    def tokenizers(self) -> Mapping[str, Callable[[str], int]]: ...
    @property
    def budget(self) -> RetryBudget: ...
    @property
    def reached(self) -> MutableMapping[str, int]: ...
    @property
    def intakes(self) -> Pending[asyncio.Future[GatewayError | None]]: ...
    @property
    def handoffs(self) -> Pending[HandedOff]: ...
    @property
    def tel(self) -> Telemetry: ...

    def host_order(self, hosts: list[str]) -> list[str]: ...
    def trace_budget(self) -> int: ...
    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]: ...
    def keep_trace(self, clean: bool) -> bool: ...
    async def save_trace(self, rid: str, name: str, m: GuardMachine | TraceSnapshot,
                         meta: dict[str, Any]) -> None: ...
    async def settled(self, view: JournalView | None) -> JournalView | None: ...


class _Timer:
    __slots__ = ("at", "handle")

    def __init__(self, handle: TimerHandle, at: float) -> None:
        self.handle = handle
        self.at = at  # monotonic deadline


# --- guard ---------------------------------------------------------------------------


class GuardSession(Session):
    __slots__ = ("_timers", "_unwatch", "attempt", "attempt_machine", "attempt_span",
                 "cred1", "envoy_request_id", "first_delta_evented", "gen", "intake",
                 "lease", "m", "opening", "rerun", "secret1", "tool",
                 "tools_listener", "verdict")

    def __init__(self, proc: GuardPorts, ctx: Messages, tools: bool = False) -> None:
        self.detach = False
        self.p: GuardPorts = proc
        self.cfg = proc.cfg
        self.ctx = ctx
        # The role of the stream's filter: False, the client listener (role `guard`), which
        # never serves the tool route; True, the tool listener (role `tools`), which serves
        # only it (decision 0028).
        self.tools_listener = tools
        self.lock = asyncio.Lock()
        self.m: GuardMachine | None = None
        self.rid: str | None = None
        self.verdict: Verdict | None = None  # what core.intake read from the headers
        self.gen: Generation | None = None
        self.intake: Prepared | None = None  # the body, the route, the record, attempt 1
        # The machine's timers on the Timers port: per kind, its handle and its deadline.
        self._timers: dict[E.TimerKind, _Timer] = {}
        self.closed = False
        self.tool: ToolCallHandler | None = None
        # A repeat of a key that runs the request again (decision 0027), once re-opened.
        self.rerun: Rerun | None = None
        # The intake transaction while this session waits for it (decision 0021).
        self.opening: asyncio.Task[GatewayError | None] | None = None
        self.md: dict[str, str] = {}
        self.span: Span = INVALID
        self.first_delta_evented = False
        self.envoy_request_id: str | None = None
        # Attempt 1's secret until the body answer carries it to its gate (never logged),
        # and the digest the intake (or the re-open) records for it.
        self.secret1: str | None = None
        self.cred1: str | None = None
        # The attempt the gate handed over at release: its record, its permission to
        # publish (process lease + the revocation watch), its span and the gate's trace.
        self.attempt: HandOff | None = None
        self.lease: AttemptLease | None = None
        self.attempt_span: Span | None = None
        self.attempt_machine: TraceSnapshot | None = None
        self._unwatch: Callable[[], None] | None = None

    # --- Envoy's messages -> events ---------------------------------------------------

    async def on_message(self, msg: ep.ProcessingRequest) -> None:
        which = msg.WhichOneof("request")
        if self.tool is not None and which in ("request_body", "response_headers",
                                               "response_body"):
            await self.on_tool_message(which, msg)
        elif which == "request_headers":
            await self.on_request_headers(codec.headers_dict(msg.request_headers.headers),
                                          msg.request_headers.end_of_stream)
        elif which == "request_body":
            await self.on_request_body(msg.request_body.body)
        elif which == "response_headers":
            hd = codec.headers_dict(msg.response_headers.headers)
            await self.feed(E.ResponseHeaders(status=int(hd.get(":status", "0") or 0),
                                            content_type=hd.get("content-type", ""),
                                            end_of_stream=msg.response_headers.end_of_stream,
                                            envoy_reply=H.ENVOY_REPLY in hd,
                                            ours=H.GATEWAY_ERROR in hd,
                                            handoff=hd.get(H.HANDOFF)))
        elif which == "response_body":
            body, lease, tel = msg.response_body, self.lease, self.p.tel
            ev = E.ResponseBody(body.body, body.end_of_stream,
                              lease is not None and not lease.valid())
            if tel.enabled:  # nothing per chunk unless metrics are exported
                tel.chunks_seen += 1
                if tel.chunks_seen % CHUNK_TIME_SAMPLE == 0:
                    t0 = time.perf_counter()
                    await self.feed(ev)
                    tel.chunk_time.record((time.perf_counter() - t0) * 1000)
                    return
            await self.feed(ev)
        elif which == "response_trailers":
            await self.write(codec.trailers_response())
        elif which == "request_trailers":
            await self.write(codec.request_trailers_response())

    async def on_tool_message(self, which: str, msg: ep.ProcessingRequest) -> None:
        assert self.tool is not None
        if which == "request_body":
            await self.write(codec.continue_request_body())
        elif which == "response_headers":
            await self.tool.on_response_headers(codec.headers_dict(msg.response_headers.headers),
                                                msg.response_headers.end_of_stream)
        else:
            await self.tool.on_response_body(msg.response_body.body,
                                             msg.response_body.end_of_stream)

    async def on_request_headers(self, hd: dict[str, str], end_of_stream: bool) -> None:
        v = self.verdict = read_headers(hd, self.cfg, self.tools_listener,
                                        self.p.ids.request_id)
        kind, family, error = kind_of(v)
        rid = v.request_id if isinstance(v, Generation | StatusLookup) else (
            error.request_id if error is not None else None) or ""
        if isinstance(v, Generation):
            self.gen, self.rid = v, v.request_id
            self.envoy_request_id = None if end_of_stream else hd.get(H.ENVOY_REQUEST_ID)
        t = self.cfg.timeouts
        m = self.m = GuardMachine.new(rid, t.stall_after_first_delta_s,
                                      self.cfg.limits.max_buffered_response_bytes,
                                      at_request=True, progress_every=t.progress_interval_s)
        m.trace_budget = self.p.trace_budget()
        await self.feed(E.RequestHeadersSeen(kind, family, error, end_of_stream))

    async def on_request_body(self, body: bytes) -> None:
        gen, m = self.gen, self.m
        if gen is None or m is None or not m.reads_body:
            await self.write(codec.continue_request_body())
            return
        prep = prepare_intake(body, self.cfg, gen, pool=self.p.pool,
                              order_hosts=self.p.host_order,
                              new_attempt_id=self.p.ids.attempt_id, wall=self.p.clock.wall(),
                              envoy_request_id=self.envoy_request_id)
        if isinstance(prep, GatewayError):
            await self.feed(E.RequestBodySeen(prep))
            return
        if prep.meta.stream:
            m.count_text = self.p.tokenizers.get(prep.meta.model or "")
        # Attempt 1's credential (decision 0028): its digest is recorded with it, the
        # secret goes to its gate (and on to its replica) in the body answer.
        self.secret1 = self.p.ids.attempt_secret()
        self.cred1 = digest(self.secret1)
        self.intake = prep
        # The order of the intake, the body's answer and the wait is the machine's
        # (decision 0021): E.OpenIntake, E.RegisterIntake, E.AnswerBody, E.AwaitIntake, E.Accepted.
        await self.feed(E.RequestBodySeen(None, prep.meta.usage_mode,
                                        keyed=gen.idempotency_key is not None))

    async def on_closed(self) -> None:
        self._stop_timers()
        if self.rid is not None and self.intake is not None and self.tool is None:
            # The request is over, and with it its re-prefills (the released one too).
            self.p.budget.request_ended(self.rid, self.aid1)
        if self.rid is not None and self.opening is None:
            # A failed intake waited here for its gates; none comes after the stream.
            self.p.intakes.take(self.rid)
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self.m is not None:
            self.p.spawn(self.locked(E.StreamClosed()), f"guard-close-{self.rid}")
        if self.opening is not None:
            # Closed while the intake was in flight: its answer still goes to the machine.
            self.p.spawn(self.opened_after_close(self.opening), f"guard-opened-{self.rid}")
            self.opening = None
        if self.tool is not None:
            self.p.spawn(self.tool.on_closed(), f"tool-close-{self.rid}")

    @property
    def aid1(self) -> str:
        return str(self.intake.first["attempt_id"]) if self.intake is not None else ""

    # --- events -> the machine -> actions ---------------------------------------------

    async def feed(self, ev: E.Event) -> None:
        assert self.m is not None
        actions = self.m.handle(ev)
        observer.guard(self, ev, actions)
        # The outcome is recorded first, in its own task: once our terminal event is
        # written Envoy may close this stream and cancel us mid-await (found by the sweep).
        for a in actions:
            if isinstance(a, E.Finish):
                self.p.spawn(self.record(a), f"guard-finish-{self.rid}")
        for a in actions:
            if not isinstance(a, E.Finish):
                await self.act(a)

    async def locked(self, ev: E.Event, while_open: bool = False) -> None:
        """An event from outside Envoy's message order (a port's answer, a timer)."""
        async with self.lock:
            if self.m is not None and not (while_open and self.closed):
                await self.feed(ev)

    async def act(self, a: E.Action) -> None:
        rid, p = self.rid or "", self.p
        if isinstance(a, E.Send):
            if a.data or a.end_of_stream:
                await self.write(codec.streamed_response_body(a.data, a.end_of_stream))
        elif isinstance(a, E.StartTimer):
            self._start_timer(a.kind, a.seconds)
        elif isinstance(a, E.StopTimers):
            self._stop_timers()
        elif isinstance(a, E.AnswerHeaders):
            await self.write(codec.continue_request_headers(
                {H.REQUEST_ID: rid}, remove=tuple(h for h in H.OWNED if h != H.REQUEST_ID)))
        elif isinstance(a, E.PassRequest):
            await self.write(codec.continue_request_headers(remove=H.OWNED))
        elif isinstance(a, E.LookUpStatus):
            await self.feed(await self.status_read())
        elif isinstance(a, E.AnswerStatus):
            await self.write(codec.immediate_json(
                200, json.dumps(a.view.to_dict(), separators=(",", ":")).encode(),
                {H.REQUEST_ID: a.view.request_id}))
        elif isinstance(a, E.StartToolCall):
            assert isinstance(self.verdict, ToolCall)
            self.tool = ToolCallHandler(self.cfg, p.ledger, self.write, p.spawn, retrying,
                                        p.clock, p.timers)
            await self.tool.on_request_headers(dict(self.verdict.headers))
            self.rid = self.tool.rid
        elif isinstance(a, E.OpenIntake):
            self.opening = p.spawn(self.open_record(), f"guard-intake-{rid}")
        elif isinstance(a, E.RegisterIntake):
            assert self.opening is not None
            p.intakes.put(rid, self.opening)
        elif isinstance(a, E.AnswerBody):
            assert self.intake is not None
            secret, self.secret1 = self.secret1, None  # kept no longer than this answer
            set_headers, lb = body_headers(self.intake, secret=secret, rerun=self.rerun,
                                           traceparent=p.tel.traceparent(self.span))
            await self.write(codec.continue_request_body_with(set_headers, lb,
                                                              self.intake.meta.upstream_body))
        elif isinstance(a, E.AwaitIntake):
            assert self.opening is not None
            err = await asyncio.shield(self.opening)
            self.opening = None
            await self.feed(E.RequestOpened(err is None, err))
        elif isinstance(a, E.Accepted):
            # In flight for the retry budget until this stream ends (on_closed).
            p.budget.request_started(rid, p.clock.monotonic(), self.aid1)
        elif isinstance(a, E.TakeOver):
            self.take_over(a.handoff)
        elif isinstance(a, E.LoseLease):
            if self.lease is not None:
                self.lease.lose(a.why)
        elif isinstance(a, E.PassAside):
            await self.write(codec.continue_response_headers(remove=NEVER_TO_CLIENT))
        elif isinstance(a, E.PassHeaders):
            if self.m is not None and self.m.replaced_error is not None:
                await self.write(codec.continue_response_headers(
                    {H.REQUEST_ID: rid, "content-type": "application/json"},
                    remove=("content-length", *NEVER_TO_CLIENT)))
            else:
                await self.write(codec.continue_response_headers({H.REQUEST_ID: rid},
                                                                 remove=NEVER_TO_CLIENT))
        elif isinstance(a, E.WriteProgress):
            p.spawn(self.write_progress(a.delivered), f"guard-progress-{rid}")
        elif isinstance(a, E.Refuse):
            await self.write(codec.immediate(a.error, {H.REQUEST_ID: rid} if rid else None))
        elif isinstance(a, E.AwaitCause):
            # Why it ended, and how much of the body Envoy sent the client (decision 0025).
            got = await p.causes.wait_sent(rid, self.cfg.timeouts.access_log_wait_s)
            await self.feed(E.CauseLearned("unknown", None) if got is None
                            else E.CauseLearned(got[0], got[1]))
        # IntakeFailed: the gate gives the client this error; nothing ran (its span's end
        # is the observer's).

    # --- the port calls that take more than a line ------------------------------------

    async def status_read(self) -> E.StatusRead:
        q = self.verdict
        assert isinstance(q, StatusLookup)
        try:
            view = await self.p.settled(await self.p.journal.get(q.request_id))
        except StoreUnavailable as e:
            return E.StatusRead(None, q.tenant, str(e))
        return E.StatusRead(view, q.tenant)

    async def open_record(self) -> GatewayError | None:
        """The intake transaction (core.guard.IntakeFlow decides; here each step is carried
        out and its answer fed back): None when the request is new, else what to answer."""
        gen, prep, rid = self.gen, self.intake, self.rid or ""
        assert gen is not None and prep is not None
        journal, clock, first = self.p.journal, self.p.clock, prep.first
        flow = G.IntakeFlow(rid, str(first["attempt_id"]), prep.meta.request_digest,
                          gen.idempotency_key, self.cfg.etcd.resend_deadline_s,
                          self.cfg.server.gateway_id, self.envoy_request_id)
        pending: list[G.IntakeEvent] = [G.IntakeStart(clock.monotonic())]
        while pending:
            ev = pending.pop()
            acts = flow.handle(ev)
            observer.guard_intake(flow, ev, acts)
            for a in acts:
                try:
                    if isinstance(a, G.WriteIntake):
                        pending.append(G.IntakeWritten(await journal.open_request(
                            rid, prep.record, (flow.attempt_id, first), credential=self.cred1)))
                    elif isinstance(a, G.SettleView):
                        pending.append(G.ViewSettled(await self.p.settled(a.view), clock.wall()))
                    elif isinstance(a, G.Reopen):
                        pending.append(G.ReopenAnswered(await journal.reopen_request(
                            rid, a.outcome, a.history, a.first, credential=self.cred1)))
                except StoreUnavailable as e:
                    pending.append(G.IntakeDown(str(e), clock.monotonic()))
                if isinstance(a, G.PauseIntake):
                    await self.timer(a.seconds)
                    pending.append(G.IntakePauseOver())
                elif isinstance(a, G.TakeBackIntake | G.UndoReopenLater):
                    self.take_back(a)
                elif isinstance(a, G.IntakeAnswer):
                    if a.error is None:
                        # Recorded: a gate that comes from now on need not wait.
                        self.p.intakes.take(rid)
                    if a.rerun is not None:
                        self.rerun = a.rerun
                        # Envoy counts this request's attempts from 1 again, and so does the
                        # count of attempts that reached a replica (max_attempts is per run).
                        self.p.reached.pop(rid, None)
                    return a.error
        raise AssertionError("the intake ended without an answer")

    def take_back(self, a: G.TakeBackIntake | G.UndoReopenLater) -> None:
        """An intake (or a re-open) whose answer never came may still apply: taken back
        once etcd answers (nothing ran for it: the client is told journal_unavailable)."""
        rid, journal = self.rid or "", self.p.journal
        if isinstance(a, G.TakeBackIntake):
            what, aid = "intake", a.attempt_id
            undo: Callable[[], Awaitable[Any]] = lambda: journal.undo_intake(rid, aid)  # noqa: E731
        else:
            what, (history, (n, aid)) = "reopen", (a.history, a.first)
            undo = lambda: journal.undo_reopen(rid, history, (n, aid))  # noqa: E731
        self.p.spawn(retrying(undo, "take back an unconfirmed " + what.replace("reo", "re-o"),
                              rid, aid, settle_s=UNDO_SETTLE_S), f"guard-undo-{what}-{rid}")

    async def timer(self, seconds: float) -> None:
        """A wait on the Timers port (the injected clock's time)."""
        fired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.p.timers.start(seconds, lambda: None if fired.done() else fired.set_result(None))
        await fired

    def take_over(self, handoff: str) -> None:
        """The gate released its attempt to us: own its end, its record and its fence."""
        ho = HandOff.from_header(handoff)
        if ho is None:
            observer.guard_handoff_unreadable(self)
            return
        aid = ho.attempt_id
        got = self.p.handoffs.take(aid)
        if got is not None:
            ho = got.handoff  # the same record, with the gate's trace (in-process only)
        self.attempt, self.attempt_machine = ho, ho.trace
        self.attempt_span = got.span if got is not None else None
        pl = self.p.journal.current_process_lease()
        # The attempt's `live` key hangs on the lease of the process that admitted it; when
        # that is us, its local deadline also bounds publishing (etcd unreachable).
        self.lease = AttemptLease(pl if pl is not None and pl.lease_id == ho.lease_id
                                   else ProcessLease(0, 0, float("inf")))

        def on_live(value: str | None) -> None:
            if value != aid:  # revoked or replaced: the machine says it once
                self.p.spawn(self.locked(E.Fenced("revoked or replaced"), while_open=True),
                             f"guard-fenced-{self.rid}")
        self._unwatch = self.p.journal.on_live_change(self.rid or "", on_live, aid)

    async def write_progress(self, n: int) -> None:
        # A missed checkpoint only weakens the lower bound it gives.
        with contextlib.suppress(StoreUnavailable):
            await self.p.journal.progress(self.rid or "", {"delivered_output_tokens": n,
                                                         "at": self.p.clock.wall()})
        await self.locked(E.ProgressWritten())

    def _start_timer(self, kind: E.TimerKind, seconds: float) -> None:
        # A kind started again (the stall timer, with every chunk) moves its deadline and
        # keeps its one timer on the port (a timer per chunk was a measurable share of the
        # per-chunk cost). The guard's deadlines only ever move later.
        at = self.p.clock.monotonic() + seconds
        t = self._timers.get(kind)
        if t is not None:
            t.at = at
        else:
            self._timers[kind] = _Timer(self.p.timers.start(seconds, lambda: self._fired(kind)),
                                        at)

    def _fired(self, kind: E.TimerKind) -> None:
        t = self._timers.get(kind)
        if t is None:
            return
        left = t.at - self.p.clock.monotonic()
        if left > 0:  # moved on since it was started: wait the rest
            t.handle = self.p.timers.start(left, lambda: self._fired(kind))
            return
        del self._timers[kind]
        self.p.spawn(self.locked(E.TimerFired(kind, self.p.clock.monotonic(), self.p.clock.wall()),
                                 while_open=True), f"guard-timer-{self.rid}")

    def _stop_timers(self) -> None:
        for t in self._timers.values():
            t.handle.cancel()
        self._timers.clear()

    async def opened_after_close(self, opening: asyncio.Task[GatewayError | None]) -> None:
        err = await opening
        if err is not None and self.rid is not None:
            self.p.intakes.take(self.rid)
        await self.locked(E.RequestOpened(err is None))

    async def record(self, f: E.Finish) -> None:
        rid = self.rid
        if rid is None:
            return
        if self._unwatch is not None:
            # Our own finish deletes `live`: that is no revocation to react to.
            self._unwatch()
            self._unwatch = None
        wall, gw = self.p.clock.wall(), self.cfg.server.gateway_id
        body = records.outcome(outcome=str(f.outcome),
                               delivered_output_tokens=f.delivered_output_tokens,
                               cause=f.cause, finished_at=wall, gateway_id=gw, exact=f.exact,
                               source=f.source, bound=f.bound)
        if self.m is not None and self.p.keep_trace(f.outcome is Outcome.COMPLETED):
            self.p.spawn(self.p.save_trace(rid, "guard", self.m, {
                "outcome": str(f.outcome), "gateway_id": gw}), f"trace-{rid}")
        attempt_end = self.attempt_end(f, wall)
        # etcd may be briefly away (frozen, electing a leader): keep trying for a bounded
        # time. Until it lands, the record shows no outcome rather than a wrong one.
        landed = await retrying(lambda: self.p.journal.finish(rid, body, attempt_end),
                                "record the outcome", rid, None)
        await self.locked(E.RecordWritten(landed))

    def attempt_end(self, f: E.Finish, wall: float) -> tuple[int, dict[str, Any]] | None:
        """The record of the attempt the gate handed over, now that its end is known."""
        ho = self.attempt
        if ho is None:
            return None
        info = ho.record()
        n, aid = int(info["attempt"]), str(info["attempt_id"])
        cls, record = records.released_end(info, upstream_finished=f.upstream_finished,
                                           cause=f.cause, ended_at=wall)
        span, self.attempt_span = self.attempt_span, None
        observer.attempt_ended(self.p.tel, span, self.rid, aid, attempt=n, released=True,
                               failure_class=str(cls), fence="ended_with_request",
                               cause=f.cause, envoy_cause=record["envoy_cause"],
                               model_revision=record.get("model_revision"), http_status=200)
        gm, self.attempt_machine = self.attempt_machine, None
        if gm is not None and self.p.keep_trace(cls is FailureClass.COMPLETED):
            self.p.spawn(self.p.save_trace(self.rid or "", f"attempt-{n:03d}", gm, {
                "attempt_id": aid, "replica": info.get("replica"),
                "failure_class": str(cls)}), f"trace-{aid}")
        return n, record

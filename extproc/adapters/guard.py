"""The guard: the downstream ext_proc stream that owns a logical request.

It validates the request, opens its journal record (attempt 1 admitted in the same
transaction), orders the compatible hosts for Envoy, counts what reaches the client, owns
the attempt the gate released, and ends a started stream with the terminal error event when
the upstream stalls, errs or loses its fence. Decisions come from `core.machine.GuardMachine`
and `core.records`; this module carries them out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Protocol

from opentelemetry.trace import Span

from ..core import headers as H
from ..core import records
from ..core.budget import RetryBudget
from ..core.config import Config
from ..core.credentials import digest
from ..core.errors import (
    GatewayError,
    body_required,
    journal_unavailable,
    no_compatible_replica,
    request_not_found,
    tool_route_not_here,
)
from ..core.events import (
    Accepted,
    Action,
    AnswerBody,
    AwaitCause,
    AwaitIntake,
    CauseLearned,
    Event,
    Fenced,
    Finish,
    IntakeFailed,
    OpenIntake,
    PassAside,
    PassHeaders,
    ProgressWritten,
    RecordWritten,
    Refuse,
    RegisterIntake,
    RequestBodySeen,
    RequestHeadersSeen,
    RequestOpened,
    ResponseBody,
    ResponseHeaders,
    Send,
    StartTimer,
    State,
    StopTimers,
    StreamClosed,
    TakeOver,
    TimerFired,
    TimerKind,
    WriteProgress,
)
from ..core.failure import FailureClass
from ..core.families import family_for_path
from ..core.guard import (
    GuardMachine,
    IntakeAnswer,
    IntakeDown,
    IntakeEvent,
    IntakeFlow,
    IntakePauseOver,
    IntakeStart,
    IntakeWritten,
    PauseIntake,
    Reopen,
    ReopenAnswered,
    SettleView,
    TakeBackIntake,
    UndoReopenLater,
    ViewSettled,
    WriteIntake,
)
from ..core.handoff import HandOff, TraceSnapshot
from ..core.intake import (
    Generation,
    PassThrough,
    Rejected,
    RequestMeta,
    StatusLookup,
    classify_request,
    parse_body,
)
from ..core.journal import (
    JournalView,
    Outcome,
    Rerun,
    tenant_digest,
)
from ..core.pool import Pool
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from . import envoy_codec as codec
from . import observer
from .leases import UNDO_SETTLE_S, AttemptLease, ProcessLease, StoreUnavailable
from .logs import rlog
from .ports import Clock, GuardJournal, Ids, Ledger, SentLog
from .session import (
    CHUNK_TIME_SAMPLE,
    INVALID,
    HandedOff,
    Messages,
    Pending,
    Session,
    log,
    retrying,
)
from .telemetry import TRACEPARENT_HEADER, Telemetry
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
    __slots__ = (
        "_timers",
        "_unwatch",
        "aid1",
        "attempt",
        "attempt_machine",
        "attempt_span",
        "cred1",
        "envoy_request_id",
        "first_delta_evented",
        "gen",
        "intake",
        "lease",
        "m",
        "opening",
        "rerun",
        "secret1",
        "tool",
        "tools_listener",
    )

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
        self.gen: Generation | None = None
        # What the intake's steps need: the parsed body, the route, the record, attempt 1.
        self.intake: tuple[RequestMeta, tuple[str, list[str]] | None, dict[str, Any],
                           dict[str, Any]] | None = None
        # The machine's timers on the Timers port: per kind, its handle and its deadline.
        self._timers: dict[TimerKind, _Timer] = {}
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
        # The attempt the gate handed over at release: its record, and its permission to
        # publish (process lease + the revocation watch).
        self.aid1: str | None = None
        # Attempt 1's secret until the body answer carries it to its gate (never logged),
        # and the digest the intake (or the re-open) records for it.
        self.secret1: str | None = None
        self.cred1: str | None = None
        self.attempt: HandOff | None = None
        self.lease: AttemptLease | None = None
        self.attempt_span: Span | None = None
        self.attempt_machine: TraceSnapshot | None = None
        self._unwatch: Callable[[], None] | None = None

    async def on_closed(self) -> None:
        self._stop_timers()
        if self.rid is not None and self.aid1 is not None and self.tool is None:
            # The request is over, and with it its re-prefills (the released one too).
            self.p.budget.request_ended(self.rid, self.aid1)
        if self.rid is not None and self.opening is None:
            # A failed intake waited here for its gates; none comes after the stream.
            self.p.intakes.take(self.rid)
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self.m is not None:
            self.p.spawn(self.close_out(), f"guard-close-{self.rid}")
        if self.opening is not None:
            # Closed while the intake was in flight: its answer still goes to the machine.
            self.p.spawn(self.opened_after_close(self.opening), f"guard-opened-{self.rid}")
            self.opening = None
        if self.tool is not None:
            self.p.spawn(self.tool.on_closed(), f"tool-close-{self.rid}")

    async def on_message(self, msg: ep.ProcessingRequest) -> None:
        which = msg.WhichOneof("request")
        if self.tool is not None and which in ("request_body", "response_headers",
                                               "response_body"):
            await self.on_tool_message(which, msg)
            return
        if which == "request_headers":
            await self.on_request_headers(codec.headers_dict(msg.request_headers.headers),
                                          msg.request_headers.end_of_stream)
        elif which == "request_body":
            await self.on_request_body(msg.request_body.body)
        elif which == "response_headers":
            hd = codec.headers_dict(msg.response_headers.headers)
            await self.feed(ResponseHeaders(status=int(hd.get(":status", "0") or 0),
                                            content_type=hd.get("content-type", ""),
                                            end_of_stream=msg.response_headers.end_of_stream,
                                            envoy_reply=H.ENVOY_REPLY in hd,
                                            ours=H.GATEWAY_ERROR in hd,
                                            handoff=hd.get(H.HANDOFF)))
        elif which == "response_body":
            body = msg.response_body
            lease = self.lease
            if lease is not None and not lease.valid() and lease.lose("expired locally"):
                # its lease ran out locally: said once, acted on once
                observer.guard_fenced(self)
                await self.feed(Fenced())
            tel = self.p.tel
            sample = False
            if tel.enabled:  # nothing per chunk unless metrics are exported
                tel.chunks_seen += 1
                sample = tel.chunks_seen % CHUNK_TIME_SAMPLE == 0
            if sample:
                t0 = time.perf_counter()
                await self.feed(ResponseBody(body.body, body.end_of_stream))
                tel.chunk_time.record((time.perf_counter() - t0) * 1000)
            else:
                await self.feed(ResponseBody(body.body, body.end_of_stream))
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

    def _machine(self, rid: str, kind: str, family: str = "chat") -> GuardMachine:
        """The request's machine, from its headers on (its request phase is in the table)."""
        t = self.cfg.timeouts
        m = self.m = GuardMachine.new(rid, t.stall_after_first_delta_s,
                                      self.cfg.limits.max_buffered_response_bytes,
                                      at_request=True, progress_every=t.progress_interval_s)
        m.trace_budget = self.p.trace_budget()
        m.handle(RequestHeadersSeen(kind, family))
        return m

    async def on_request_headers(self, hd: dict[str, str], end_of_stream: bool) -> None:
        path = hd.get(":path", "")
        is_tool = path.startswith(self.cfg.tools.path_prefix)
        if is_tool != self.tools_listener:
            # A tool call on the client listener, or anything else on the tool listener:
            # refused before anything is read (no ledger, no journal).
            err = tool_route_not_here(path.split("?", 1)[0], self.tools_listener)
            self._machine("", "rejected")
            rlog(log, logging.WARNING, "request refused: wrong listener for its path", None,
                 None, code=str(err.code), path=path.split("?", 1)[0],
                 tools_listener=self.tools_listener)
            await self.write(codec.immediate(err))
            return
        if is_tool:
            self._machine("", "tool")
            self.tool = ToolCallHandler(self.cfg, self.p.ledger, self.write, self.p.spawn,
                                        retrying, self.p.clock, self.p.timers)
            await self.tool.on_request_headers(hd)
            self.rid = self.tool.rid
            return
        intake = classify_request(hd, self.cfg, self.p.ids.request_id)
        if isinstance(intake, Rejected):
            self._machine(intake.error.request_id or "", "rejected")
            rlog(log, logging.INFO, "request rejected", intake.error.request_id, None,
                 code=str(intake.error.code))
            await self.write(codec.immediate(intake.error))
            return
        if isinstance(intake, StatusLookup):
            self._machine(intake.request_id, "status")
            await self.on_status_lookup(intake)
            return
        if isinstance(intake, PassThrough):
            self._machine("", "passthrough")
            await self.write(codec.continue_request_headers(remove=H.OWNED))
            return
        self.gen = intake
        self.rid = intake.request_id
        self._machine(intake.request_id, "generation", family_for_path(intake.path).name)
        if end_of_stream:
            await self.feed(RequestBodySeen(body_required(self.rid)))
            return
        self.envoy_request_id = hd.get(H.ENVOY_REQUEST_ID)
        await self.write(codec.continue_request_headers(
            {H.REQUEST_ID: intake.request_id},
            remove=tuple(h for h in H.OWNED if h != H.REQUEST_ID)))

    async def on_status_lookup(self, q: StatusLookup) -> None:
        try:
            view = await self.p.settled(await self.p.journal.get(q.request_id))
        except StoreUnavailable as e:
            await self.write(codec.immediate(self._journal_down(q.request_id, e)))
            return
        if view is None or view.meta.get("tenant") != tenant_digest(q.tenant):
            # Another tenant's request is indistinguishable from a missing one.
            await self.write(codec.immediate(request_not_found(q.request_id)))
            return
        await self.write(codec.immediate_json(
            200, json.dumps(view.to_dict(), separators=(",", ":")).encode(),
            {H.REQUEST_ID: q.request_id}))

    def _journal_down(self, rid: str | None, e: Exception) -> GatewayError:
        rlog(log, logging.WARNING, "journal unavailable", rid, None, error=str(e))
        return journal_unavailable(rid)

    async def on_request_body(self, body: bytes) -> None:
        gen, rid, m = self.gen, self.rid, self.m
        if gen is None or rid is None or m is None or m.state is not State.GUARD_AWAITING_BODY:
            await self.write(codec.continue_request_body())
            return
        meta = parse_body(body, self.cfg, rid, gen.path)
        if isinstance(meta, GatewayError):
            rlog(log, logging.INFO, "request body rejected", rid, None, code=str(meta.code))
            await self.feed(RequestBodySeen(meta))
            return
        route: tuple[str, list[str]] | None = None
        if self.p.pool.enabled:
            route = self.p.pool.choose(meta.model, rid)
            if route is None:
                await self.feed(RequestBodySeen(no_compatible_replica(
                    rid, f"no replica declared for model {meta.model!r}")))
                return
            # Hosts known to be down go last: attempt 1 should not be spent on them.
            route = (route[0], self.p.host_order(route[1]))
        if meta.stream:
            m.count_text = self.p.tokenizers.get(meta.model or "")
        record = records.request_meta(
            request_id=rid, tenant=gen.tenant, idempotency_key=gen.idempotency_key,
            endpoint=gen.path, max_attempts=self.cfg.policy.max_attempts,
            gateway_id=self.cfg.server.gateway_id, envoy_request_id=self.envoy_request_id,
            created_at=self.p.clock.wall(), body_meta=meta.to_dict(), route=route)
        # Attempt 1 is admitted in the same transaction as the record (its gate finds it
        # in a header we set): one etcd round trip fewer before the first byte.
        self.aid1 = aid1 = self.p.ids.attempt_id()
        # Attempt 1's credential (decision 0028): its digest is recorded with it, the
        # secret goes to its gate (and on to its replica) in the body answer.
        self.secret1 = self.p.ids.attempt_secret()
        self.cred1 = digest(self.secret1)
        first = records.first_attempt(aid1, self.cfg.server.gateway_id, self.p.clock.wall())
        self.intake = (meta, route, record, first)
        # The order of the intake, the body's answer and the wait is the machine's
        # (decision 0021): OpenIntake, RegisterIntake, AnswerBody, AwaitIntake, Accepted.
        await self.feed(RequestBodySeen(None, meta.usage_mode,
                                        keyed=gen.idempotency_key is not None))

    async def open_record(self, rid: str, record: dict[str, Any],
                          first: tuple[str, dict[str, Any]], digest: str,
                          key: str | None) -> GatewayError | None:
        """The intake transaction (core.guard.IntakeFlow decides; here each step is carried
        out and its answer fed back): None when the request is new, else what to answer."""
        flow = IntakeFlow(rid, first[0], digest, key, self.cfg.etcd.resend_deadline_s,
                          self.cfg.server.gateway_id, self.envoy_request_id)
        journal, clock = self.p.journal, self.p.clock
        pending: list[IntakeEvent] = [IntakeStart(clock.monotonic())]
        while pending:
            ev = pending.pop()
            acts = flow.handle(ev)
            observer.guard_intake(flow, ev, acts)
            for a in acts:
                try:
                    if isinstance(a, WriteIntake):
                        pending.append(IntakeWritten(await journal.open_request(
                            rid, record, first, credential=self.cred1)))
                    elif isinstance(a, SettleView):
                        pending.append(ViewSettled(await self.p.settled(a.view), clock.wall()))
                    elif isinstance(a, Reopen):
                        pending.append(ReopenAnswered(await journal.reopen_request(
                            rid, a.outcome, a.history, a.first, credential=self.cred1)))
                except StoreUnavailable as e:
                    pending.append(IntakeDown(str(e), clock.monotonic()))
                if isinstance(a, PauseIntake):
                    await self.timer(a.seconds)
                    pending.append(IntakePauseOver())
                elif isinstance(a, TakeBackIntake):
                    self._take_back_intake(rid, a.attempt_id)
                elif isinstance(a, UndoReopenLater):
                    self.undo_reopen_later(rid, a.history, *a.first)
                elif isinstance(a, IntakeAnswer):
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

    async def timer(self, seconds: float) -> None:
        """A wait on the Timers port (the injected clock's time)."""
        fired: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.p.timers.start(seconds, lambda: None if fired.done() else fired.set_result(None))
        await fired

    def undo_reopen_later(self, rid: str, history: tuple[int, Mapping[str, Any]], n: int,
                          aid: str) -> None:
        """A re-open whose answer never came may still apply: take it back once etcd
        answers (nothing ran for it: the client is told journal_unavailable)."""
        store = self.p.journal
        self.p.spawn(retrying(lambda: store.undo_reopen(rid, history, (n, aid)),
                              "take back an unconfirmed re-open", rid, aid,
                              settle_s=UNDO_SETTLE_S), f"guard-undo-reopen-{rid}")

    def _take_back_intake(self, rid: str, aid: str) -> None:
        store = self.p.journal
        self.p.spawn(retrying(lambda: store.undo_intake(rid, aid),
                              "take back an unconfirmed intake", rid, aid,
                              settle_s=UNDO_SETTLE_S), f"guard-undo-intake-{rid}")

    def body_answer(self, meta: RequestMeta, route: tuple[str, list[str]] | None,
                    record: dict[str, Any], aid1: str) -> ep.ProcessingResponse:
        set_headers = {H.PROMPT_TOKENS: str(meta.estimated_prompt_tokens), H.PREADMITTED: aid1,
                       H.ACCEPTED_AT: f"{record['created_at']:.6f}"}
        if self.secret1 is not None:
            # For the gate of attempt 1, which keeps it; a later attempt's gate replaces it
            # with its own. Not kept here any longer than this answer needs it.
            set_headers[H.ATTEMPT_SECRET] = self.secret1
            self.secret1 = None
        tp = self.p.tel.traceparent(self.span)
        if tp:
            set_headers[TRACEPARENT_HEADER] = tp
        if self.rerun is not None:
            # The gates name their attempts after the runs before (decision 0027).
            set_headers[H.ATTEMPT_OFFSET] = str(self.rerun.attempt_offset)
        lb: dict[str, Any] | None = None
        if route is not None:
            # Attempt n goes to hosts[n-1]: every host listed shares one fingerprint, so no
            # retry can land on an incompatible replica.
            set_headers[H.FINGERPRINT] = route[0]
            lb = {"envoy.lb": {"x-gateway-destination-endpoint": ",".join(route[1])}}
        if meta.upstream_body is not None:
            # Envoy rejects a buffered body mutation whose content-length does not match.
            set_headers["content-length"] = str(len(meta.upstream_body))
        return codec.continue_request_body_with(set_headers, lb, meta.upstream_body)

    async def intake_step(self, a: OpenIntake | RegisterIntake | AnswerBody | AwaitIntake
                          | Accepted | IntakeFailed) -> None:
        """One step of the intake, in the order the machine gave (decision 0021)."""
        rid, gen, intake = self.rid or "", self.gen, self.intake
        assert gen is not None and intake is not None
        meta, route, record, first = intake
        if isinstance(a, OpenIntake):
            self.opening = self.p.spawn(
                self.open_record(rid, record, (first["attempt_id"], first),
                                 meta.request_digest, gen.idempotency_key),
                f"guard-intake-{rid}")
        elif isinstance(a, RegisterIntake):
            assert self.opening is not None
            self.p.intakes.put(rid, self.opening)
        elif isinstance(a, AnswerBody):
            await self.write(self.body_answer(meta, route, record, first["attempt_id"]))
        elif isinstance(a, AwaitIntake):
            assert self.opening is not None
            err = await asyncio.shield(self.opening)
            self.opening = None
            await self.feed(RequestOpened(err is None, err))
        elif isinstance(a, Accepted):
            # In flight for the retry budget until this stream ends (on_closed).
            self.p.budget.request_started(rid, self.p.clock.monotonic(), self.aid1 or "")
        # IntakeFailed: the gate gives the client this error; nothing ran (its span's end
        # is the observer's).

    def take_over(self, handoff: str | None) -> None:
        """The gate released its attempt to us: own its end, its record and its fence."""
        if not handoff:
            return
        ho = HandOff.from_header(handoff)
        if ho is None:
            observer.guard_handoff_unreadable(self)
            return
        aid = ho.attempt_id
        got = self.p.handoffs.take(aid)
        if got is not None:
            ho = got.handoff  # the same record, with the gate's trace (in-process only)
        self.attempt = ho
        self.attempt_span = got.span if got is not None else None
        self.attempt_machine = ho.trace
        pl = self.p.journal.current_process_lease()
        # The attempt's `live` key hangs on the lease of the process that admitted it; when
        # that is us, its local deadline also bounds publishing (etcd unreachable).
        self.lease = AttemptLease(pl if pl is not None and pl.lease_id == ho.lease_id
                                   else ProcessLease(0, 0, float("inf")))

        def on_live(value: str | None) -> None:
            lease = self.lease
            if lease is not None and value != aid and lease.lose("revoked or replaced"):
                observer.guard_fenced(self)
                self.p.spawn(self.on_fenced(), f"guard-fenced-{self.rid}")
        self._unwatch = self.p.journal.on_live_change(self.rid or "", on_live, aid)

    async def on_fenced(self) -> None:
        async with self.lock:
            if not self.closed and self.m is not None:
                await self.feed(Fenced())

    async def feed(self, ev: Event) -> None:
        assert self.m is not None
        actions = self.m.handle(ev)
        observer.guard(self, ev, actions)
        # The outcome is recorded first, in its own task: once our terminal event is
        # written Envoy may close this stream and cancel us mid-await (found by the sweep).
        for a in actions:
            if isinstance(a, Finish):
                self.p.spawn(self.record(a), f"guard-finish-{self.rid}")
        for a in actions:
            if not isinstance(a, Finish):
                await self.act(a)

    async def act(self, a: Action) -> None:
        rid = self.rid or ""
        if isinstance(a, (OpenIntake, RegisterIntake, AnswerBody, AwaitIntake, Accepted,
                          IntakeFailed)):
            await self.intake_step(a)
        elif isinstance(a, TakeOver):
            self.take_over(a.handoff)
        elif isinstance(a, PassAside):
            await self.write(codec.continue_response_headers(remove=NEVER_TO_CLIENT))
        elif isinstance(a, PassHeaders):
            if self.m is not None and self.m.replaced_error is not None:
                await self.write(codec.continue_response_headers(
                    {H.REQUEST_ID: rid, "content-type": "application/json"},
                    remove=("content-length", *NEVER_TO_CLIENT)))
            else:
                await self.write(codec.continue_response_headers({H.REQUEST_ID: rid},
                                                                 remove=NEVER_TO_CLIENT))
        elif isinstance(a, Send):
            if a.data or a.end_of_stream:
                await self.write(codec.streamed_response_body(a.data, a.end_of_stream))
        elif isinstance(a, StartTimer):
            self._start_timer(a.kind, a.seconds)
        elif isinstance(a, StopTimers):
            self._stop_timers()
        elif isinstance(a, WriteProgress):
            self.p.spawn(self.write_progress(a.delivered), f"guard-progress-{rid}")
        elif isinstance(a, Refuse):
            await self.write(codec.immediate(a.error, {H.REQUEST_ID: rid} if rid else None))
        elif isinstance(a, AwaitCause):
            # Why it ended, and how much of the body Envoy sent the client (decision 0025).
            got = await self.p.causes.wait_sent(rid, self.cfg.timeouts.access_log_wait_s)
            await self.feed(CauseLearned("unknown", None) if got is None
                            else CauseLearned(got[0], got[1]))

    async def write_progress(self, n: int) -> None:
        # A missed checkpoint only weakens the lower bound it gives.
        with contextlib.suppress(StoreUnavailable):
            await self.p.journal.progress(self.rid or "", {"delivered_output_tokens": n,
                                                         "at": self.p.clock.wall()})
        async with self.lock:
            if self.m is not None:
                await self.feed(ProgressWritten())

    def _start_timer(self, kind: TimerKind, seconds: float) -> None:
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

    def _fired(self, kind: TimerKind) -> None:
        t = self._timers.get(kind)
        if t is None:
            return
        left = t.at - self.p.clock.monotonic()
        if left > 0:  # moved on since it was started: wait the rest
            t.handle = self.p.timers.start(left, lambda: self._fired(kind))
            return
        del self._timers[kind]
        self.p.spawn(self.on_timer(kind), f"guard-timer-{self.rid}")

    def _stop_timers(self) -> None:
        for t in self._timers.values():
            t.handle.cancel()
        self._timers.clear()

    async def on_timer(self, kind: TimerKind) -> None:
        async with self.lock:
            if self.closed or self.m is None:
                return
            await self.feed(TimerFired(kind, self.p.clock.monotonic(), self.p.clock.wall()))

    async def opened_after_close(self, opening: asyncio.Task[GatewayError | None]) -> None:
        err = await opening
        if err is not None and self.rid is not None:
            self.p.intakes.take(self.rid)
        async with self.lock:
            if self.m is not None:
                await self.feed(RequestOpened(err is None))

    async def close_out(self) -> None:
        async with self.lock:
            if self.m is not None:
                await self.feed(StreamClosed())

    async def record(self, f: Finish) -> None:
        if self.rid is None:
            return
        if self._unwatch is not None:
            # Our own finish deletes `live`: that is no revocation to react to.
            self._unwatch()
            self._unwatch = None
        body = records.outcome(outcome=str(f.outcome),
                               delivered_output_tokens=f.delivered_output_tokens,
                               cause=f.cause, finished_at=self.p.clock.wall(),
                               gateway_id=self.cfg.server.gateway_id, exact=f.exact,
                               source=f.source, bound=f.bound)
        if self.m is not None and self.p.keep_trace(f.outcome is Outcome.COMPLETED):
            self.p.spawn(self.p.save_trace(self.rid, "guard", self.m, {
                "outcome": str(f.outcome), "gateway_id": self.cfg.server.gateway_id}),
                f"trace-{self.rid}")
        attempt_end = self.attempt_end(f)
        # etcd may be briefly away (frozen, electing a leader): keep trying for a bounded
        # time. Until it lands, the record shows no outcome rather than a wrong one.
        rid = self.rid
        landed = await retrying(lambda: self.p.journal.finish(rid, body, attempt_end),
                                "record the outcome", rid, None)
        async with self.lock:
            await self.feed(RecordWritten(landed))

    def attempt_end(self, f: Finish) -> tuple[int, dict[str, Any]] | None:
        """The record of the attempt the gate handed over, now that its end is known."""
        ho = self.attempt
        if ho is None:
            return None
        info = ho.record()
        finished = self.m is not None and (self.m.done_seen
                                           or f.outcome is Outcome.COMPLETED)
        cls, record = records.released_end(info, upstream_finished=finished, cause=f.cause,
                                           ended_at=self.p.clock.wall())
        span, self.attempt_span = self.attempt_span, None
        observer.attempt_ended(self.p.tel, span, self.rid, str(info["attempt_id"]),
                               attempt=int(info["attempt"]), released=True,
                               failure_class=str(cls), fence="ended_with_request",
                               cause=f.cause, envoy_cause=record["envoy_cause"],
                               model_revision=record.get("model_revision"), http_status=200)
        gm = self.attempt_machine
        if gm is not None and self.p.keep_trace(cls is FailureClass.COMPLETED):
            self.attempt_machine = None
            n = int(info["attempt"])
            self.p.spawn(self.p.save_trace(self.rid or "", f"attempt-{n:03d}", gm, {
                "attempt_id": info["attempt_id"], "replica": info.get("replica"),
                "failure_class": str(cls)}), f"trace-{info['attempt_id']}")
        return int(info["attempt"]), record

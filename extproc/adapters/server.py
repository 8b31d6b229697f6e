"""The grpc.aio processor: one process serving Envoy's two ext_proc filters and its access log.

- the **guard** (downstream filter, FULL_DUPLEX_STREAMED responses) owns the logical request:
  validates it, opens its journal record, counts what reaches the client, and ends a started
  stream with the terminal error event when the upstream stalls or errs;
- the **gate** (upstream filter, once per attempt) admits the attempt in etcd, holds the
  response headers until the first content delta, fences it in etcd, then releases;
- the **access-log service** tells the guard why a stream ended (client vs upstream).

Each gRPC stream is driven by the pure machines of `extproc.core.machine`; this module only
moves bytes and carries out their actions.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan, Span, SpanKind

from ..core import headers as H
from ..core import records
from ..core.admission import Admitted, AttemptRequest, decide
from ..core.budget import RetryBudget
from ..core.config import Config
from ..core.errors import (
    ErrorCode,
    GatewayError,
    attempt_not_admitted,
    journal_unavailable,
    no_compatible_replica,
)
from ..core.failure import FailureClass
from ..core.failure import Fence as FenceKind
from ..core.health import HealthPolicy, HostHealth
from ..core.intake import (
    Generation,
    PassThrough,
    Rejected,
    StatusLookup,
    classify_request,
    parse_body,
)
from ..core.journal import (
    JournalView,
    Outcome,
    key_digest,
    new_request_id,
    orphan_outcome,
    repeat_answer,
    tenant_digest,
)
from ..core.machine import (
    Action,
    Admit,
    AdmitDecided,
    ArmWatchdog,
    AwaitCause,
    CauseLearned,
    ContinueRequest,
    DisarmWatchdog,
    DropChunk,
    EndAttempt,
    Event,
    FailAttempt,
    Fence,
    Fenced,
    FenceDecided,
    Finish,
    FirstDeltaTimeout,
    GateMachine,
    GuardMachine,
    HoldChunk,
    LeaseLost,
    PassChunk,
    PassHeaders,
    Refuse,
    Release,
    RequestStarted,
    ResponseBody,
    ResponseHeaders,
    Send,
    StallTimeout,
    State,
    StreamClosed,
)
from ..core.pool import pool_from_config
from ..core.replay import record as trace_record
from ..gen.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from ..gen.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from . import envoy_codec as codec
from .causes import NO_GATE, CauseRegistry
from .etcd_store import EtcdStore, ToolLedger
from .leases import UNDO_SETTLE_S, AttemptLease, ProcessLease, StoreUnavailable
from .logs import rlog
from .prober import probe_forever
from .telemetry import TRACEPARENT_HEADER, Telemetry, end_span
from .tools import ToolCallHandler

log = logging.getLogger("extproc")
INVALID = NonRecordingSpan(INVALID_SPAN_CONTEXT)


OUTCOME_RETRY_S = 60.0
# llmgw.chunk.processing_time is recorded for one body message in this many (a histogram
# record per message would cost more than the message's own processing).
CHUNK_TIME_SAMPLE = 64
# Test-only: proves the fault sweep can fail (docs/sweep.md). Logged loudly at start-up.
UNSAFE_RELEASE_WITHOUT_FENCE = os.environ.get("EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE") == "1"


async def retrying(fn: Callable[[], Awaitable[Any]], what: str, rid: str | None,
                   aid: str | None, limit_s: float = OUTCOME_RETRY_S,
                   settle_s: float = 0.0) -> bool:
    """Retry an etcd write while etcd is briefly away (frozen, electing), for a bounded time.

    With `settle_s` (take-backs, which are idempotent compare-and-deletes), the write is
    applied again every 0.25 s for that long after its first answer (UNDO_SETTLE_S).
    """
    delay, deadline = 0.1, time.monotonic() + limit_s
    while True:
        try:
            await fn()
            break
        except StoreUnavailable as e:
            if time.monotonic() + delay > deadline:
                rlog(log, logging.ERROR, f"gave up: {what}", rid, aid, error=str(e))
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
    settled = time.monotonic() + settle_s
    while time.monotonic() < settled:
        await asyncio.sleep(0.25)
        with contextlib.suppress(StoreUnavailable):
            await fn()
    return True


def _now() -> float:
    return round(time.time(), 6)


class Processor:
    """Shared state of one processor process."""

    def __init__(self, cfg: Config, store: EtcdStore) -> None:
        self.cfg = cfg
        self.store = store
        self.ledger = ToolLedger(store, cfg.tools.ledger_ttl_s)
        self.pool = pool_from_config(cfg.pool.replicas)
        rb = cfg.policy.retry_budget
        self.budget = RetryBudget(rb.fraction, rb.min_retries, rb.window_s)
        self.tel = Telemetry(cfg.telemetry, cfg.server.gateway_id)
        od, hc = cfg.pool.outlier_detection, cfg.pool.health_check
        self.health = HostHealth(HealthPolicy(
            consecutive_failures=od.consecutive_local_origin_failure if od.enabled else 1 << 30,
            base_ejection_s=od.base_ejection_time_s, max_ejection_s=od.max_ejection_time_s,
            unhealthy_threshold=hc.unhealthy_threshold, healthy_threshold=hc.healthy_threshold))
        self.causes = CauseRegistry(on_attempt=self.attempt_seen)
        # Requests with an attempt that reached a replica (a gate let it go upstream): a
        # later attempt of theirs is a re-prefill, charged to the retry budget.
        self.reached: OrderedDict[str, None] = OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.open_streams = 0
        # attempt id -> (span, machine) of a gate that handed its attempt to the guard (same
        # process); the guard ends the span, and keeps the trace, at the attempt's real end.
        self.handed_off: OrderedDict[str, tuple[Span, GateMachine]] = OrderedDict()

    def mark_reached(self, rid: str) -> None:
        self.reached[rid] = None
        while len(self.reached) > 20000:
            self.reached.popitem(last=False)

    def attempt_seen(self, replica: str, cause: str, status: int) -> None:
        """Envoy's per-attempt access-log entry: passive health evidence, as its outlier
        detection counts it (refused, reset or timed out: a local-origin failure)."""
        now = time.monotonic()
        if cause in ("upstream", "timeout"):
            if self.health.attempt_failed(replica, now):
                rlog(log, logging.WARNING, "replica ejected after failed attempts", None, None,
                     replica=replica, cause=cause)
        elif status == 200:
            self.health.attempt_succeeded(replica, now)

    def host_order(self, hosts: list[str]) -> list[str]:
        return self.health.order(hosts, time.monotonic())

    async def probe_pool(self) -> None:
        addrs = [r.address for r in self.pool.replicas]
        await probe_forever(addrs, self.cfg.pool.health_check, self.health)

    def hand_off(self, aid: str, span: Span, m: GateMachine) -> None:
        self.handed_off[aid] = (span, m)
        while len(self.handed_off) > 10000:  # a guard that never saw the headers
            old_span, _ = self.handed_off.popitem(last=False)[1]
            end_span(old_span, None)

    def trace_budget(self) -> int:
        t = self.cfg.telemetry
        return 0 if t.record_traces == "none" else t.max_trace_bytes

    def keep_trace(self, clean: bool) -> bool:
        mode = self.cfg.telemetry.record_traces
        return mode == "all" or (mode == "failures" and not clean)

    async def save_trace(self, rid: str, name: str, m: GateMachine | GuardMachine,
                         meta: dict[str, Any]) -> None:
        try:
            await self.store.put_trace(rid, name, trace_record(
                m, meta, self.cfg.telemetry.max_trace_bytes))
        except StoreUnavailable as e:
            rlog(log, logging.WARNING, "could not keep the event trace", rid, None,
                 error=str(e))

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        """Run work that must outlive a cancelled gRPC handler (journal writes, revokes)."""
        t: asyncio.Task[Any] = asyncio.ensure_future(coro)
        t.set_name(name)
        self._tasks.add(t)
        t.add_done_callback(self._done)
        return t

    def _done(self, t: asyncio.Task[Any]) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("background task failed", exc_info=t.exception(),
                      extra={"task": t.get_name(), "request_id": None, "attempt_id": None})

    async def settled(self, view: JournalView | None) -> JournalView | None:
        """A record whose processor died is settled (gateway_interrupted) when first read."""
        if view is None or not view.orphaned:
            return view
        oc = orphan_outcome(view, _now())
        if await self.store.settle_orphan(view.request_id, oc):
            rlog(log, logging.WARNING, "settled a request whose processor died",
                 view.request_id, None, outcome=oc["outcome"],
                 delivered_output_tokens=oc["delivered_output_tokens"])
        return await self.store.get(view.request_id)

    async def share_budget(self) -> None:
        """Every second: publish our retry-budget counts, learn the other gateways'."""
        while True:
            await asyncio.sleep(1.0)
            req, ret = self.budget.snapshot(time.monotonic())
            # On failure keep the last view of the others; our own counts stay exact.
            with contextlib.suppress(StoreUnavailable):
                self.budget.others = await self.store.exchange_budget(
                    self.cfg.server.gateway_id, req, ret)

    async def drain(self, timeout_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)


# --- sessions ------------------------------------------------------------------------


class Session:
    """One Envoy ext_proc stream: read messages in order, answer them, clean up at the end.

    Sessions use __slots__: one exists per open stream, and 10,000 open streams is a target.
    """

    __slots__ = ("cfg", "closed", "ctx", "detach", "lock", "md", "p", "rid", "span")
    ctx: grpc.aio.ServicerContext[Any, Any]
    lock: asyncio.Lock
    closed: bool
    rid: str | None
    # Set by the gate once it handed its attempt to the guard: returning from the handler
    # closes the gRPC stream with OK, and Envoy processes the rest of this HTTP stream
    # without us (ext_proc's onGrpcClose; chunks in flight are passed on unchanged).
    detach: bool
    md: dict[str, str]
    span: Span

    async def write(self, resp: ep.ProcessingResponse) -> None:
        if self.closed:
            return
        try:
            await self.ctx.write(resp)
        except (grpc.aio.AioRpcError, RuntimeError, asyncio.InvalidStateError):
            self.closed = True

    async def run(self) -> None:
        read, lock = self.ctx.read, self.lock
        try:
            while not self.detach:
                msg = await read()
                if msg is grpc.aio.EOF:
                    break
                async with lock:
                    await self.on_message(msg)
        finally:
            self.closed = True
            await self.on_closed()

    async def on_message(self, msg: ep.ProcessingRequest) -> None:
        raise NotImplementedError

    async def on_closed(self) -> None:
        raise NotImplementedError


# --- guard ---------------------------------------------------------------------------


class GuardSession(Session):
    __slots__ = (
        "_unwatch",
        "aid1",
        "attempt",
        "attempt_machine",
        "attempt_span",
        "envoy_request_id",
        "finished",
        "first_delta_evented",
        "gen",
        "m",
        "permit",
        "progress_at",
        "progress_inflight",
        "progress_sent",
        "tool",
        "watchdog",
        "watchdog_at",
    )

    def __init__(self, proc: Processor, ctx: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.detach = False
        self.p = proc
        self.cfg = proc.cfg
        self.ctx = ctx
        self.lock = asyncio.Lock()
        self.m: GuardMachine | None = None
        self.rid: str | None = None
        self.gen: Generation | None = None
        self.watchdog: asyncio.TimerHandle | None = None
        self.finished = False
        self.closed = False
        self.progress_at = time.monotonic()
        self.progress_sent = 0
        self.progress_inflight = False
        self.tool: ToolCallHandler | None = None
        self.md: dict[str, str] = {}
        self.span: Span = INVALID
        self.first_delta_evented = False
        self.envoy_request_id: str | None = None
        self.watchdog_at = 0.0  # monotonic deadline of the stall watchdog (0: disarmed)
        # The attempt the gate handed over at release: its record, and its permission to
        # publish (process lease + the revocation watch).
        self.aid1: str | None = None
        self.attempt: dict[str, Any] | None = None
        self.permit: AttemptLease | None = None
        self.attempt_span: Span | None = None
        self.attempt_machine: GateMachine | None = None
        self._unwatch: Callable[[], None] | None = None

    async def on_closed(self) -> None:
        self._disarm()
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        if self.m is not None:
            self.p.spawn(self.close_out(), f"guard-close-{self.rid}")
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
            if self.m is None:
                await self.write(codec.continue_response_headers(remove=(H.HANDOFF,)))
                return
            status = int(hd.get(":status", "0") or 0)
            if status == 200:
                self.take_over(hd.get(H.HANDOFF))
            await self.feed(ResponseHeaders(status=status,
                                            content_type=hd.get("content-type", ""),
                                            end_of_stream=msg.response_headers.end_of_stream))
        elif which == "response_body":
            body = msg.response_body
            if self.m is None:
                await self.write(codec.streamed_response_body(body.body, body.end_of_stream))
                return
            permit = self.permit
            if permit is not None and not permit.revoked and not permit.valid():
                permit.revoked = True  # its lease ran out locally: said once, acted on once
                self.fenced_log()
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
            await self.write(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))

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
        if hd.get(":path", "").startswith(self.cfg.tools.path_prefix):
            self.tool = ToolCallHandler(self.cfg, self.p.ledger, self.write, self.p.spawn,
                                        retrying)
            await self.tool.on_request_headers(hd)
            self.rid = self.tool.rid
            return
        intake = classify_request(hd, self.cfg)
        if isinstance(intake, Rejected):
            rlog(log, logging.INFO, "request rejected", intake.error.request_id, None,
                 code=str(intake.error.code))
            await self.write(codec.immediate(intake.error))
            return
        if isinstance(intake, StatusLookup):
            await self.on_status_lookup(intake)
            return
        if isinstance(intake, PassThrough):
            await self.write(codec.continue_request_headers(remove=H.OWNED))
            return
        self.gen = intake
        self.rid = intake.request_id
        if end_of_stream:
            await self.write(codec.immediate(GatewayError(
                ErrorCode.INVALID_REQUEST_BODY, "a JSON request body is required", 400,
                request_id=self.rid)))
            return
        self.envoy_request_id = hd.get(H.ENVOY_REQUEST_ID)
        await self.write(codec.continue_request_headers(
            {H.REQUEST_ID: intake.request_id},
            remove=tuple(h for h in H.OWNED if h != H.REQUEST_ID)))

    async def on_status_lookup(self, q: StatusLookup) -> None:
        try:
            view = await self.p.settled(await self.p.store.get(q.request_id))
        except StoreUnavailable as e:
            await self.write(codec.immediate(self._journal_down(q.request_id, e)))
            return
        if view is None or view.meta.get("tenant") != _tenant_tag(q.tenant):
            # Another tenant's request is indistinguishable from a missing one.
            await self.write(codec.immediate(GatewayError(
                ErrorCode.REQUEST_NOT_FOUND, "no request with this id", 404,
                request_id=q.request_id)))
            return
        await self.write(codec.immediate_json(
            200, json.dumps(view.to_dict(), separators=(",", ":")).encode(),
            {H.REQUEST_ID: q.request_id}))

    def _journal_down(self, rid: str | None, e: Exception) -> GatewayError:
        rlog(log, logging.WARNING, "journal unavailable", rid, None, error=str(e))
        return journal_unavailable(rid)

    async def on_request_body(self, body: bytes) -> None:
        gen, rid = self.gen, self.rid
        if gen is None or rid is None:
            await self.write(codec.continue_request_body())
            return
        meta = parse_body(body, self.cfg, rid)
        if isinstance(meta, GatewayError):
            rlog(log, logging.INFO, "request body rejected", rid, None, code=str(meta.code))
            await self.write(codec.immediate(meta, {H.REQUEST_ID: rid}))
            return
        route: tuple[str, list[str]] | None = None
        if self.p.pool.enabled:
            route = self.p.pool.choose(meta.model, rid)
            if route is None:
                err = no_compatible_replica(rid, f"no replica declared for model {meta.model!r}")
                await self.write(codec.immediate(err, {H.REQUEST_ID: rid}))
                return
            # Hosts known to be down go last: attempt 1 should not be spent on them.
            route = (route[0], self.p.host_order(route[1]))
        record = {
            "request_id": rid,
            "tenant": _tenant_tag(gen.tenant),
            "idempotency_key_sha256": _key_tag(gen.idempotency_key),
            "endpoint": gen.path,
            "max_attempts": self.cfg.policy.max_attempts,
            "gateway_id": self.cfg.server.gateway_id,
            "envoy_request_id": self.envoy_request_id,
            "created_at": _now(),
            **meta.to_dict(),
        }
        if route is not None:
            record["fingerprint"], record["hosts"] = route[0], route[1]
        # Attempt 1 is admitted in the same transaction as the record (its gate finds it
        # in a header we set): one etcd round trip fewer before the first byte.
        self.aid1 = aid1 = "att_" + new_request_id()[4:]
        first = records.first_attempt(aid1, self.cfg.server.gateway_id, _now())
        try:
            existing = await self.p.settled(await self.p.store.open_request(
                rid, record, (aid1, first)))
        except StoreUnavailable as e:
            await self.write(codec.immediate(self._journal_down(rid, e), {H.REQUEST_ID: rid}))
            return
        if existing is not None:
            err = repeat_answer(existing)
            rlog(log, logging.INFO, "repeat of a known request", rid, None,
                 code=str(err.code), outcome=existing.outcome_value)
            await self.write(codec.immediate(err, {H.REQUEST_ID: rid}))
            return
        self.m = GuardMachine.new(rid, self.cfg.timeouts.stall_after_first_delta_s,
                                  self.cfg.limits.max_buffered_response_bytes)
        self.m.trace_budget = self.p.trace_budget()
        self.p.budget.note_request(time.monotonic())
        rlog(log, logging.INFO, "request accepted", rid, None, stream=meta.stream,
             model=meta.model, fingerprint=route[0] if route else None)
        self.span = self.p.tel.start("llm.request", self.p.tel.parent_from(self.md),
                                     SpanKind.SERVER, {
            "llmgw.request_id": rid, "gen_ai.request.model": meta.model,
            "gen_ai.operation.name": "chat" if gen.path.endswith("chat/completions")
            else "text_completion",
            "http.request.method": "POST", "url.path": gen.path,
            "llmgw.stream": meta.stream, "llmgw.fingerprint": route[0] if route else None,
            "llmgw.gateway_id": self.cfg.server.gateway_id})
        self.span.add_event("request.accepted")
        set_headers = {H.PROMPT_TOKENS: str(meta.estimated_prompt_tokens), H.PREADMITTED: aid1,
                       H.ACCEPTED_AT: f"{record['created_at']:.6f}"}
        tp = self.p.tel.traceparent(self.span)
        if tp:
            set_headers[TRACEPARENT_HEADER] = tp
        lb: dict[str, Any] | None = None
        if route is not None:
            # Attempt n goes to hosts[n-1]: every host listed shares one fingerprint, so no
            # retry can land on an incompatible replica.
            set_headers[H.FINGERPRINT] = route[0]
            lb = {"envoy.lb": {"x-gateway-destination-endpoint": ",".join(route[1])}}
        await self.write(codec.continue_request_body_with(set_headers, lb))

    def take_over(self, handoff: str | None) -> None:
        """The gate released its attempt to us: own its end, its record and its fence."""
        if not handoff:
            return
        try:
            info = json.loads(handoff)
            aid = str(info["attempt_id"])
            int(info["attempt"])
        except (ValueError, KeyError, TypeError):
            rlog(log, logging.ERROR, "unreadable attempt hand-off", self.rid, None)
            return
        self.attempt = info
        self.attempt_span, self.attempt_machine = self.p.handed_off.pop(aid, (None, None))
        pl = self.p.store.current_process_lease()
        # The attempt's `live` key hangs on the lease of the process that admitted it; when
        # that is us, its local deadline also bounds publishing (etcd unreachable).
        self.permit = AttemptLease(pl if pl is not None and pl.lease_id == info.get("lease_id")
                                   else ProcessLease(0, 0, float("inf")))

        def on_live(value: str | None) -> None:
            permit = self.permit
            if permit is not None and value != aid and not permit.revoked:
                permit.revoked = True
                self.fenced_log()
                self.p.spawn(self.on_fenced(), f"guard-fenced-{self.rid}")
        self._unwatch = self.p.store.on_live_change(self.rid or "", on_live)

    def fenced_log(self) -> None:
        rlog(log, logging.WARNING, "attempt fenced: its lease was revoked or replaced",
             self.rid, self.attempt.get("attempt_id") if self.attempt else None)

    async def on_fenced(self) -> None:
        async with self.lock:
            if not self.closed and self.m is not None:
                await self.feed(Fenced())

    async def feed(self, ev: Event) -> None:
        assert self.m is not None
        actions = self.m.handle(ev)
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
        if isinstance(a, PassHeaders):
            if self.m is not None and self.m.replaced_error is not None:
                await self.write(codec.continue_response_headers(
                    {H.REQUEST_ID: rid, "content-type": "application/json"},
                    remove=("content-length", H.HANDOFF)))
            else:
                await self.write(codec.continue_response_headers({H.REQUEST_ID: rid},
                                                                 remove=(H.HANDOFF,)))
        elif isinstance(a, Send):
            if a.data or a.end_of_stream:
                await self.write(codec.streamed_response_body(a.data, a.end_of_stream))
                self._maybe_checkpoint()
                if (not self.first_delta_evented and self.m is not None
                        and self.m.delivered > 0):
                    self.first_delta_evented = True
                    self.span.add_event("first_delta.delivered")
        elif isinstance(a, ArmWatchdog):
            self._arm(a.seconds)
        elif isinstance(a, DisarmWatchdog):
            self._disarm()
        elif isinstance(a, AwaitCause):
            cause = await self.p.causes.wait(rid, self.cfg.timeouts.access_log_wait_s)
            await self.feed(CauseLearned(cause))

    def _maybe_checkpoint(self) -> None:
        """Now and then record the delivered count, in case this process dies mid-stream."""
        every = self.cfg.timeouts.progress_interval_s
        m = self.m
        if every <= 0 or m is None or self.progress_inflight or m.delivered <= self.progress_sent:
            return
        now = time.monotonic()
        if now - self.progress_at < every:
            return
        self.progress_at, self.progress_sent, self.progress_inflight = now, m.delivered, True

        async def put(n: int) -> None:
            try:
                await self.p.store.progress(self.rid or "", {"delivered_output_tokens": n,
                                                             "at": _now()})
            except StoreUnavailable:
                pass  # a missed checkpoint only weakens the lower bound
            finally:
                self.progress_inflight = False
        self.p.spawn(put(m.delivered), f"guard-progress-{self.rid}")

    def _arm(self, seconds: float) -> None:
        # Re-armed on every chunk: move a deadline, keep one timer (a timer per chunk was
        # a measurable share of the per-chunk cost).
        loop = asyncio.get_running_loop()
        self.watchdog_at = loop.time() + seconds
        if self.watchdog is None:
            self.watchdog = loop.call_at(self.watchdog_at, self._watchdog_fired)

    def _watchdog_fired(self) -> None:
        loop = asyncio.get_running_loop()
        if self.watchdog_at > loop.time():
            self.watchdog = loop.call_at(self.watchdog_at, self._watchdog_fired)
            return
        self.watchdog = None
        self.p.spawn(self.on_stall(), f"guard-stall-{self.rid}")

    def _disarm(self) -> None:
        self.watchdog_at = 0.0
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None

    async def on_stall(self) -> None:
        async with self.lock:
            if self.closed or self.m is None:
                return
            rlog(log, logging.WARNING, "upstream silent after first delta: ending stream",
                 self.rid, None, delivered_output_tokens=self.m.delivered)
            await self.feed(StallTimeout())

    async def close_out(self) -> None:
        async with self.lock:
            if self.m is not None:
                await self.feed(StreamClosed())

    async def record(self, f: Finish) -> None:
        if self.finished or self.rid is None:
            return
        self.finished = True
        if self._unwatch is not None:
            # Our own finish deletes `live`: that is no revocation to react to.
            self._unwatch()
            self._unwatch = None
        body: dict[str, Any] = {
            "outcome": str(f.outcome),
            "delivered_output_tokens": f.delivered_output_tokens,
            "cause": f.cause,
            "finished_at": _now(),
            "gateway_id": self.cfg.server.gateway_id,
        }
        if f.cause == "unknown":
            # Envoy (or the network to it) vanished with bytes in flight: what we handed
            # to Envoy is an upper bound of what the client got.
            body["delivered_output_tokens_exact"] = False
        rlog(log, logging.INFO, "request finished", self.rid, None, outcome=str(f.outcome),
             delivered_output_tokens=f.delivered_output_tokens, cause=f.cause)
        if f.cause in ("stall", "in-band error", "malformed event"):
            self.span.add_event("terminal_error.injected", {"llmgw.cause": f.cause})
        if f.outcome is Outcome.CLIENT_DISCONNECTED:
            self.span.add_event("client.gone")
        if f.outcome is Outcome.UPSTREAM_DECODE_INTERRUPTED:
            self.p.tel.interruptions.add(1, {"cause": f.cause or "unknown"})
        self.p.tel.outcomes.add(1, {"outcome": str(f.outcome)})
        end_span(self.span, None if f.outcome is Outcome.COMPLETED else str(f.outcome),
                 **{"llmgw.outcome": str(f.outcome), "llmgw.cause": f.cause,
                    "llmgw.delivered_output_tokens": f.delivered_output_tokens,
                    "llmgw.first_delta_sent": f.delivered_output_tokens > 0,
                    "http.response.status_code": self.m.status if self.m else None})
        if self.m is not None and self.p.keep_trace(f.outcome is Outcome.COMPLETED):
            self.p.spawn(self.p.save_trace(self.rid, "guard", self.m, {
                "outcome": str(f.outcome), "gateway_id": self.cfg.server.gateway_id}),
                f"trace-{self.rid}")
        attempt_end = self.attempt_end(f)
        # etcd may be briefly away (frozen, electing a leader): keep trying for a bounded
        # time. Until it lands, the record shows no outcome rather than a wrong one.
        rid = self.rid
        await retrying(lambda: self.p.store.finish(rid, body, attempt_end),
                       "record the outcome", rid, None)

    def attempt_end(self, f: Finish) -> tuple[int, dict[str, Any]] | None:
        """The record of the attempt the gate handed over, now that its end is known."""
        info = self.attempt
        if info is None:
            return None
        finished = self.m is not None and (self.m.done_seen
                                           or f.outcome is Outcome.COMPLETED)
        cls, record = records.released_end(info, upstream_finished=finished, cause=f.cause,
                                           ended_at=_now())
        cause = record["envoy_cause"]
        rlog(log, logging.INFO, "attempt ended", self.rid, str(info["attempt_id"]),
             attempt=info["attempt"], released=True, failure_class=str(cls),
             fence="ended_with_request", cause=f.cause)
        span = self.attempt_span
        if span is not None:
            self.attempt_span = None
            span.add_event("lease.revoked")
            self.p.tel.fences.add(1, {"kind": "ended_with_request", "class": str(cls)})
            end_span(span, None if cls is FailureClass.COMPLETED else str(cls),
                     **{"llmgw.failure_class": str(cls), "llmgw.released": True,
                        "llmgw.fence": "ended_with_request", "llmgw.envoy_cause": cause,
                        "llmgw.model_revision": record.get("model_revision"),
                        "http.response.status_code": 200})
        gm = self.attempt_machine
        if gm is not None and self.p.keep_trace(cls is FailureClass.COMPLETED):
            self.attempt_machine = None
            n = int(info["attempt"])
            self.p.spawn(self.p.save_trace(self.rid or "", f"attempt-{n:03d}", gm, {
                "attempt_id": info["attempt_id"], "replica": info.get("replica"),
                "failure_class": str(cls)}), f"trace-{info['attempt_id']}")
        return int(info["attempt"]), record


# --- gate ----------------------------------------------------------------------------


class GateSession(Session):
    __slots__ = (
        "_hard_timer",
        "_soft_timer",
        "_unwatch",
        "accepted_at",
        "admitted",
        "aid",
        "attempt",
        "failed_on_purpose",
        "first_admitted",
        "http_status",
        "lease",
        "m",
        "model_revision",
        "parent_tp",
        "preadmitted",
        "prompt_tokens",
        "replica",
        "slow",
        "started_at",
        "started_wall",
        "waited_for_previous_s",
        "want_fingerprint",
    )

    def __init__(self, proc: Processor, ctx: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.detach = False
        self.p = proc
        self.cfg = proc.cfg
        self.ctx = ctx
        self.m: GateMachine | None = None
        self.rid: str | None = None
        self.aid: str | None = None
        self.attempt = 0
        self.replica: str | None = None
        self.lease: AttemptLease | None = None
        self.preadmitted: str | None = None  # attempt 1's id, admitted by the guard
        self.first_admitted: str | None = None  # the same, as later attempts see it
        self.model_revision: str | None = None
        self.started_at = 0.0
        self.started_wall = 0.0
        self.closed = False
        self.http_status = 0
        self.failed_on_purpose = False
        self.slow = False
        self.waited_for_previous_s = 0.0
        self._unwatch: Callable[[], None] | None = None
        self._soft_timer: asyncio.TimerHandle | None = None
        self._hard_timer: asyncio.TimerHandle | None = None
        self.lock = asyncio.Lock()
        self.want_fingerprint: str | None = None
        self.prompt_tokens = 0
        self.md: dict[str, str] = {}
        self.span: Span = INVALID
        self.parent_tp: str | None = None
        self.accepted_at: float | None = None  # wall clock, from the guard
        self.admitted: Admitted | None = None

    async def on_closed(self) -> None:
        for timer in (self._soft_timer, self._hard_timer):
            if timer is not None:
                timer.cancel()
        if self.m is not None:
            for a in self.m.handle(StreamClosed()):
                if isinstance(a, EndAttempt):
                    self.p.spawn(self.end(a), f"gate-end-{self.aid}")

    async def on_message(self, msg: ep.ProcessingRequest) -> None:
        which = msg.WhichOneof("request")
        if which == "request_headers":
            hd = codec.headers_dict(msg.request_headers.headers)
            rid = hd.get(H.REQUEST_ID)
            if not rid:
                # Not a journaled request (e.g. /v1/models): nothing to gate.
                await self.write(codec.continue_request_headers())
                return
            self.rid = rid
            try:
                self.attempt = int(hd.get(H.ENVOY_ATTEMPT_COUNT, "1"))
            except ValueError:
                self.attempt = 1
            attrs = codec.attributes(msg)
            self.replica = str(attrs.get("upstream.address") or "") or None
            self.want_fingerprint = hd.get(H.FINGERPRINT)
            self.parent_tp = hd.get(TRACEPARENT_HEADER)
            self.first_admitted = hd.get(H.PREADMITTED) or None
            if self.attempt == 1:
                self.preadmitted = self.first_admitted
            try:
                self.prompt_tokens = int(hd.get(H.PROMPT_TOKENS, "0"))
            except ValueError:
                self.prompt_tokens = 0
            try:
                self.accepted_at = float(hd.get(H.ACCEPTED_AT, ""))
            except ValueError:
                self.accepted_at = None
            self.m = GateMachine.new(rid, self.cfg.limits.max_buffered_response_bytes)
            await self.feed(RequestStarted(self.attempt))
        elif which == "response_headers":
            hd = codec.headers_dict(msg.response_headers.headers)
            if self.m is not None and UNSAFE_RELEASE_WITHOUT_FENCE:
                # Test-only sabotage (docs/sweep.md): release at once, no hold, no fence.
                # The fault sweep must catch what this breaks; never set it in production.
                self.m = None
            if self.m is None:
                await self.write(codec.continue_response_headers(remove=(H.HANDOFF,)))
                return
            self.model_revision = hd.get("x-model-revision")
            self.http_status = int(hd.get(":status", "0") or 0)
            await self.feed(ResponseHeaders(int(hd.get(":status", "0") or 0),
                                            hd.get("content-type", ""),
                                            msg.response_headers.end_of_stream))
        elif which == "response_body":
            if self.m is None:
                await self.write(codec.continue_response_body())
                return
            m, lease = self.m, self.lease
            if (m.state is State.GATE_RELEASED and not m.lease_lost and lease is not None
                    and not lease.valid()):
                rlog(log, logging.WARNING, "lease lost after release: dropping the rest",
                     self.rid, self.aid)
                await self.feed(LeaseLost())
            await self.feed(ResponseBody(msg.response_body.body,
                                         msg.response_body.end_of_stream))
        elif which == "request_body":
            await self.write(codec.continue_request_body())
        elif which == "response_trailers":
            await self.write(codec.trailers_response())
        elif which == "request_trailers":
            await self.write(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))

    async def feed(self, ev: Event) -> None:
        assert self.m is not None
        queue = [ev]
        while queue:
            for a in self.m.handle(queue.pop(0)):
                nxt = await self.act(a)
                if nxt is not None:
                    queue.append(nxt)

    async def act(self, a: Action) -> Event | None:
        rid = self.rid or ""
        if isinstance(a, HoldChunk):
            return None
        if isinstance(a, PassChunk):
            await self.write(codec.continue_response_body())
            return None
        if isinstance(a, PassHeaders):
            # Only the gate may say which attempt the guard owns, never the replica.
            await self.write(codec.continue_response_headers(remove=(H.HANDOFF,)))
            return None
        if isinstance(a, DropChunk):
            await self.write(codec.replace_response_body(b""))
            return None
        if isinstance(a, Fence):
            return FenceDecided(await self.fence())
        if isinstance(a, Release):
            for timer in (self._soft_timer, self._hard_timer):
                if timer is not None:
                    timer.cancel()
            self.span.add_event("first_delta.fenced", {"llmgw.held_chunks": a.held_chunks})
            rlog(log, logging.INFO, "first delta fenced: released", rid, self.aid,
                 attempt=self.attempt, replica=self.replica, held_chunks=a.held_chunks,
                 ttfd_ms=round((time.monotonic() - self.started_at) * 1000, 2))
            # From here the guard owns the attempt: it sees the rest of the response, its end,
            # and writes the attempt's record with the request's outcome (one etcd txn).
            # Registered before the headers go out: the guard looks for it when they arrive.
            self.span.add_event("attempt.handed_off")
            if self.aid is not None and self.m is not None:
                self.p.hand_off(self.aid, self.span, self.m)
                self.span = INVALID
            await self.write(codec.continue_response_headers(
                {H.ATTEMPT_ID: self.aid or "", H.HANDOFF: self.handoff()}))
            for _ in range(a.held_chunks):
                await self.write(codec.continue_response_body())
            if a.hand_off:
                self.detach = True
            return None
        if isinstance(a, FailAttempt):
            self.failed_on_purpose = True
            self.span.add_event("attempt.failed", {"llmgw.reason": a.reason})
            rlog(log, logging.WARNING, "attempt failed before first delta", rid, self.aid,
                 attempt=self.attempt, replica=self.replica, reason=a.reason)
            await self.write(codec.fail_attempt_headers(rid))
            for i in range(a.held_chunks):
                await self.write(codec.replace_response_body(a.error.json_bytes() if i == 0
                                                             else b""))
            return None
        if isinstance(a, ContinueRequest):
            self.p.mark_reached(rid)
            await self.write(codec.continue_request_headers({H.ATTEMPT_ID: self.aid or ""},
                                                            remove=(H.PREADMITTED,)))
            return None
        if isinstance(a, Refuse):
            await self.write(codec.immediate(a.error, {H.REQUEST_ID: rid}))
            return None
        if isinstance(a, Admit):
            return await self.admit(a.attempt)
        return None

    def facts(self) -> records.AttemptFacts:
        return records.AttemptFacts(
            attempt=self.attempt, attempt_id=self.aid or "", replica=self.replica,
            gateway_id=self.cfg.server.gateway_id, started_at=self.started_wall,
            waited_for_previous_s=self.waited_for_previous_s,
            model_revision=self.p.pool.fingerprint_of(self.replica or "") or self.model_revision,
            slow=self.slow)

    def handoff(self) -> str:
        return json.dumps(self.facts().handoff(self.lease.lease_id if self.lease else 0),
                          separators=(",", ":"))

    async def admit(self, attempt: int) -> AdmitDecided:
        rid = self.rid or ""
        self.aid = self.preadmitted or "att_" + new_request_id()[4:]
        self.started_at = time.monotonic()
        tel = self.p.tel
        parent = tel.parent_from({"traceparent": self.parent_tp} if self.parent_tp
                                 else self.md)
        host, _, port = (self.replica or "").rpartition(":")
        self.span = tel.start("llm.attempt", parent, SpanKind.CLIENT, {
            "llmgw.request_id": rid, "llmgw.attempt_id": self.aid, "llmgw.attempt": attempt,
            "server.address": host or None, "server.port": int(port) if port.isdigit() else None,
            "llmgw.fingerprint": self.p.pool.fingerprint_of(self.replica or "")})
        res = await self._admit(attempt)
        if res.admitted:
            self.span.add_event("attempt.admitted",
                                {"llmgw.waited_for_previous_ms":
                                 round(self.waited_for_previous_s * 1000, 2)})
            self.span.add_event("lease.granted")
            if attempt > 1:
                tel.retries.add(1, {"decision": "admitted"})
        else:
            if self.preadmitted is not None:
                # The guard admitted it with the request: give `live` back.
                aid, store = self.aid or "", self.p.store
                rec = records.refused_first_attempt(
                    aid, self.replica, _now(), str(res.error.code) if res.error else "unknown")
                self.p.spawn(retrying(lambda: store.end_attempt(rid, 1, aid, rec, False),
                                      "give back a refused attempt", rid, aid),
                             f"gate-refused-{aid}")
            code = str(res.error.code) if res.error else "unknown"
            self.span.add_event("attempt.refused", {"llmgw.reason": code})
            if attempt > 1:
                tel.retries.add(1, {"decision": "refused", "reason": code})
            end_span(self.span, code)
        return res

    async def _admit(self, attempt: int) -> AdmitDecided:
        rid = self.rid or ""
        aid = self.aid or ""
        cfg, pool = self.cfg, self.p.pool
        t = cfg.timeouts
        elapsed = (max(0.0, time.time() - self.accepted_at) if self.accepted_at is not None
                   else 0.0)
        verdict = decide(AttemptRequest(
            request_id=rid, attempt=attempt, max_attempts=cfg.policy.max_attempts,
            reached_before=rid in self.p.reached, elapsed_s=elapsed,
            total_first_delta_s=t.total_first_delta_s(cfg.policy.max_attempts),
            first_delta_s=t.first_delta_s, fence_wait_s=t.fence_wait_s,
            want_fingerprint=self.want_fingerprint if pool.enabled else None,
            replica_fingerprint=pool.fingerprint_of(self.replica or ""),
            replica=self.replica, prompt_tokens=self.prompt_tokens,
            max_prompt_tokens=cfg.policy.retry_cost.max_prompt_tokens),
            self.p.budget, time.monotonic())
        last = self.p.budget.last
        if isinstance(verdict, GatewayError):
            if verdict.code is ErrorCode.RETRY_BUDGET_EXHAUSTED and last is not None:
                self.p.tel.budget_used.record(last.retries / max(1, last.limit))
            return self._refused(verdict)
        if verdict.counts_as_retry and last is not None:
            self.p.tel.budget_used.record(last.retries / max(1, last.limit))
        self.admitted = verdict
        self.started_wall = _now()
        record = self.facts().admission()
        if self.preadmitted is not None:
            # Admitted in the guard's intake transaction; the live key hangs on the process
            # lease (granted already, or granted now if another process admitted it).
            try:
                self.lease = await self.p.store.attempt_lease()
            except StoreUnavailable as e:
                return AdmitDecided(False, self._journal_down(e))
            return self._admitted(0.0)
        try:
            res = await self.p.store.admit_attempt(rid, attempt, aid, record,
                                                   verdict.fence_wait_s, self._never_started)
        except StoreUnavailable as e:
            rlog(log, logging.WARNING, "journal unavailable at admission", rid, self.aid,
                 error=str(e))
            self.p.spawn(retrying(lambda: self.p.store.undo_admission(rid, attempt, aid),
                                  "undo an unconfirmed admission", rid, aid,
                                  settle_s=UNDO_SETTLE_S),
                         f"gate-undo-admit-{aid}")
            return AdmitDecided(False, self._journal_down(e))
        if not res.admitted:
            return self._refused(attempt_not_admitted(rid, res.reason))
        self.lease = res.lease
        return self._admitted(res.waited_s)

    def _never_started(self, live: str) -> bool:
        """`live` is attempt 1 as the guard admitted it, and no gate ever ran for it."""
        first = self.first_admitted
        return first is not None and live == first and self.p.causes.seen(NO_GATE + first)

    def _journal_down(self, e: Exception) -> GatewayError:
        return journal_unavailable(self.rid, "the attempt could not be fenced, so nothing "
                                             "was run")

    def _admitted(self, waited_s: float) -> AdmitDecided:
        rid, attempt = self.rid or "", self.attempt
        self.waited_for_previous_s = waited_s
        self._unwatch = self.p.store.on_live_change(rid, self._on_live_change)
        soft = self.cfg.timeouts.soft_first_delta_s
        loop = asyncio.get_running_loop()
        if soft > 0:
            self._soft_timer = loop.call_later(soft, self._on_soft_limit)
        deadline = (self.admitted.deadline_s if self.admitted is not None
                    else self.cfg.timeouts.first_delta_s)
        self._hard_timer = loop.call_later(
            max(0.0, deadline - waited_s),
            lambda: self.p.spawn(self._on_first_delta_limit(), f"gate-limit-{self.aid}"))
        rlog(log, logging.INFO, "attempt admitted", rid, self.aid, attempt=attempt,
             replica=self.replica, waited_ms=round(waited_s * 1000, 2),
             with_request=self.preadmitted is not None)
        return AdmitDecided(True)

    def _on_live_change(self, value: str | None) -> None:
        """The revocation watch: someone fenced this attempt (revoked, expired, replaced)."""
        lease = self.lease
        if lease is not None and value != self.aid and not lease.revoked:
            lease.revoked = True
            rlog(log, logging.WARNING, "attempt fenced: its lease was revoked or replaced",
                 self.rid, self.aid, live=value)

    async def _on_first_delta_limit(self) -> None:
        async with self.lock:
            if self.m is None or self.closed:
                return
            waited = (time.time() - self.accepted_at if self.accepted_at is not None
                      else time.monotonic() - self.started_at)
            final = self.admitted.final if self.admitted is not None else False
            await self.feed(FirstDeltaTimeout(final=final, waited_s=round(waited, 3)))

    def _on_soft_limit(self) -> None:
        # Slow is not dead: record it, change nothing (only first_delta_s fails over).
        self.slow = True
        rlog(log, logging.INFO, "first delta slower than the soft expectation (not a failure)",
             self.rid, self.aid, soft_first_delta_s=self.cfg.timeouts.soft_first_delta_s,
             replica=self.replica)

    def _refused(self, err: GatewayError) -> AdmitDecided:
        rlog(log, logging.WARNING, "attempt refused", self.rid, self.aid, attempt=self.attempt,
             code=str(err.code), reason=err.message, replica=self.replica)
        return AdmitDecided(False, err)

    async def fence(self) -> bool:
        rid = self.rid or ""
        if self.lease is None or not self.lease.valid():
            return False
        record = self.facts().fence(_now())
        try:
            return await self.p.store.fence_first_delta(rid, self.aid or "", record)
        except StoreUnavailable as e:
            rlog(log, logging.WARNING, "journal unavailable at the fence: not releasing", rid,
                 self.aid, error=str(e))
            # The transaction may still apply when etcd wakes: take it back once it can.
            self.p.spawn(retrying(lambda: self.p.store.undo_fence(rid, record),
                                  "undo an unconfirmed fence", rid, self.aid,
                                  settle_s=UNDO_SETTLE_S),
                         f"gate-undo-fence-{self.aid}")
            return False

    async def end(self, a: EndAttempt) -> None:
        """Classify how the attempt ended, fence it accordingly, and close its record."""
        rid = self.rid or ""
        if self._unwatch is not None:
            self._unwatch()
        if self.aid is None or self.lease is None:
            return
        if a.released:
            # Handed to the guard at release: it ends the attempt with the request.
            return
        aid, attempt, store = self.aid, self.attempt, self.p.store
        facts = records.EndFacts(
            released=False, upstream_finished=a.upstream_finished, timed_out=a.timed_out,
            failed_on_purpose=self.failed_on_purpose, http_status=self.http_status,
            elapsed_s=time.monotonic() - self.started_at,
            first_delta_s=self.cfg.timeouts.first_delta_s)
        plan = records.plan_end(facts)
        base = self.facts().base()
        if plan.revoke_now:
            self.lease.revoked = True
            # `ended_at` is when `live` went: what any overlap check needs.
            ended_at = _now()
            pending = records.pending_revoke(base, ended_at)
            revoked = await retrying(
                lambda: store.end_attempt(rid, attempt, aid, pending, False),
                "fence the ended attempt", rid, aid)
            if not revoked:  # never confirmed: the lease will lapse by itself
                plan = records.EndPlan(False, False, plan.needs_cause)
        entry = None
        if plan.needs_cause:
            # Envoy's per-attempt access-log entry says reset (dead) vs timeout (uncertain),
            # and that Envoy has closed the attempt at all.
            entry = await self.p.causes.wait_entry(aid, self.cfg.timeouts.access_log_wait_s)
        cancel_ack = (self.cfg.policy.uncertain_source_liveness.wait_for
                      == "cancel_ack_or_lease_expiry")
        done = records.settle_end(facts, plan, entry, cancel_ack)
        cls, fence = done.failure_class, done.fence
        if a.timed_out and self.replica:
            self.p.health.attempt_failed(self.replica, time.monotonic())
        record = records.attempt_end(base, facts, done, ended_at if plan.revoke_now else _now(),
                                     self.cfg.etcd.attempt_lease_ttl_s)
        rlog(log, logging.INFO, "attempt ended", rid, aid, attempt=attempt,
             released=False, failure_class=str(cls), fence=str(fence), cause=done.cause)
        self.span.add_event("lease.revoked" if fence is FenceKind.REVOKE
                            else "lease.fenced_until_expiry")
        self.p.tel.fences.add(1, {"kind": str(fence), "class": str(cls)})
        end_span(self.span, None if cls is FailureClass.COMPLETED else str(cls),
                 **{"llmgw.failure_class": str(cls), "llmgw.released": False,
                    "llmgw.fence": str(fence), "llmgw.envoy_cause": done.cause,
                    "llmgw.model_revision": record.get("model_revision"),
                    "http.response.status_code": self.http_status or None})
        if self.m is not None and self.p.keep_trace(cls is FailureClass.COMPLETED):
            self.p.spawn(self.p.save_trace(rid, f"attempt-{attempt:03d}", self.m, {
                "attempt_id": aid, "replica": self.replica,
                "failure_class": str(cls)}), f"trace-{aid}")
        self.lease.revoked = True
        if plan.revoke_now:
            await retrying(lambda: store.update_attempt(rid, attempt, record),
                           "close the attempt record", rid, aid)
            return
        # Confirmed end (the replica closed, answered, the client left, or Envoy closed an
        # uncertain one): `live` is deleted, so a retry may start now. Unknown
        # (policy.uncertain_source_liveness): the replica may still be decoding and may
        # still publish; fenced now, a retry is admitted only once the fence's lease
        # expires. etcd may be briefly away: retried for a bounded time, so the record does
        # not keep an attempt without its end (found by the fault sweep).
        await retrying(lambda: store.end_attempt(rid, attempt, aid, record,
                                                 fence is FenceKind.EXPIRE),
                       "fence the ended attempt", rid, aid)


# --- gRPC services ---------------------------------------------------------------------


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, proc: Processor) -> None:
        self.p = proc

    async def Process(self, request_iterator: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext[Any, Any]) -> None:
        md = dict(context.invocation_metadata() or ())
        role = md.get(H.ROLE_METADATA, "guard")
        session: GuardSession | GateSession
        session = GateSession(self.p, context) if role == "gate" else GuardSession(self.p, context)
        # The metadata is only read again for trace context: do not keep it per stream.
        session.md = md if self.p.tel.enabled else {}
        self.p.open_streams += 1
        try:
            await session.run()
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("processing stream failed",
                          extra={"request_id": session.rid, "attempt_id":
                                 getattr(session, "aid", None), "role": role})
            raise
        finally:
            self.p.open_streams -= 1


class AccessLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self, proc: Processor) -> None:
        self.p = proc

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        async for msg in request_iterator:
            if msg.WhichOneof("log_entries") == "http_logs":
                for entry in msg.http_logs.log_entry:
                    self.p.causes.offer(entry)
        return als_pb2.StreamAccessLogsResponse()


async def serve(cfg: Config, ready: Callable[[str], None] | None = None) -> None:
    store = EtcdStore(cfg.etcd, owner=f"{cfg.server.gateway_id}/{os.getpid()}")
    await store.connect()
    store.start_background()
    proc = Processor(cfg, store)
    proc.spawn(proc.share_budget(), "budget-exchange")
    if proc.pool.enabled and cfg.pool.health_check.enabled:
        proc.spawn(proc.probe_pool(), "pool-probe")
    server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100000),
                                      ("grpc.so_reuseport", 0)])
    ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(proc), server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLog(proc), server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port(cfg.server.listen)
    if port == 0 and not cfg.server.listen.startswith("unix:"):
        raise OSError(f"cannot listen on {cfg.server.listen}")
    await server.start()
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    # Everything allocated at start-up lives for the process: keep it out of every future
    # collection, and collect young objects less often (fewer pauses in the chunk path).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 50)
    addr = cfg.server.listen if port == 0 else cfg.server.listen.rsplit(":", 1)[0] + f":{port}"
    if UNSAFE_RELEASE_WITHOUT_FENCE:
        log.critical("EXTPROC_UNSAFE_RELEASE_WITHOUT_FENCE=1: the first-delta fence is OFF; "
                     "this is a test-only sabotage", extra={"request_id": None,
                                                           "attempt_id": None})
    log.info("processor listening", extra={"listen": addr, "pid": os.getpid(),
                                           "request_id": None, "attempt_id": None})
    if ready is not None:
        ready(addr)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: report NOT_SERVING first so Envoy's health checks move traffic away, then let
    # open streams finish for a bounded time.
    await hs.enter_graceful_shutdown()
    await server.stop(grace=5.0)
    await proc.drain()
    proc.tel.shutdown()
    await store.close()


def _tenant_tag(tenant: str) -> str:
    return tenant_digest(tenant)


def _key_tag(key: str | None) -> str | None:
    return key_digest(key) if key is not None else None

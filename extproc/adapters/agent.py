"""`extproc agent`: the replica's half of the contract (issue 26, decision 0033).

A streaming HTTP/1.1 reverse proxy in front of one model server (the engine, on loopback
behind it), beside `extproc register`'s membership loop. For a request that carries the
gateway's request and attempt ids it executes what `core.source.SourceFence` decides:

- before calling the engine: `<prefix>/live/<rid>` must name the attempt (else 409
  `attempt_fenced`, the engine never called) and no cancel may be written;
- while forwarding: `live/<rid>` and `cancel/<rid>/<aid>` are watched, and each chunk is
  checked against the local deadline of the live key's lease (refreshed with one
  time-to-live call per lease per TTL/3, never per chunk);
- on a fence, a cancel, the deadline or Envoy's connection gone: forwarding stops at once,
  the engine request is aborted (its connection closed; SGLang's /abort_request too), the
  engine's own evidence that it let go is awaited (bounded) and then acknowledged under
  `<prefix>/ack/<rid>/<aid>`;
- when the engine's connection breaks after content left: one in-band error event ends the
  response well-formed (the gateway writes `upstream_decode_interrupted`); before content:
  the downstream connection is reset, as the engine's death would.

The first content event also leaves a notice under `<prefix>/src/<processor>/<rid>/<aid>`,
written off the forwarding path. Requests without the ids are proxied plainly.

Each tracked attempt is one `llm.agent.attempt` span in the request's trace (its parent: the
gateway's request span from `x-gateway-traceparent`, else the request's `traceparent`), with
events for the first content, the stop at the source, the engine abort and the ack;
exported with the processor's OTel settings (telemetry.*, OTEL_*; docs/telemetry.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry.trace import Span, SpanKind

from ..core import headers as H
from ..core.families import family_for_path
from ..core.source import Do, Input, LeaseView, Phase, SourceFence
from .kv import KV, Get, KeyValue, Put, Txn, WatchEvent
from .leases import StoreUnavailable
from .shards import shard_of
from .telemetry import Telemetry, end_span
from .timers import LoopTimers, Timers, sleep, wait_for

__all__ = ["DEFAULT_METRICS", "AgentMetrics", "EngineSpec", "ReplicaAgent"]

log = logging.getLogger("extproc.agent")

# Engine metrics whose sum is the number of requests the engine still holds.
DEFAULT_METRICS: Mapping[str, tuple[str, ...]] = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    "demo": ("demo_requests_running",),
    "openai": (),
}
# Engines whose gauges move only when an engine step ends: a request stopped before the
# engine's first output (in its prefill step) is counted nowhere yet, so a gauge reading 0
# proves nothing: vLLM 0.32 was seen computing an aborted ~2,000-token prefill for 4.3 s
# while its running + waiting gauges read 0 throughout (tests/vllm/test_04_agent.py).
# The demo replica counts a request from its arrival. SGLang: assumed like vLLM (unverified).
STEP_GAUGES = frozenset({"vllm", "sglang"})
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                  "te", "trailer", "trailers", "transfer-encoding", "upgrade", "host",
                  "content-length"})
_TICK_S = 0.02  # deadline and downstream checks, and lease refreshes, at most this late
_POLL_S = 0.025  # the engine's metrics while confirming an abort
_FINISHED_KEPT = 4096  # attempts whose response ended whole, for a cancel that comes late
_ACK_TTL_S = 300  # ack keys live at least half of this
_SRC_TTL_S = 60  # first-content notices likewise
_MAX_BODY = 64 * 1024 * 1024
_READ = 64 * 1024
_HIST = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class EngineSpec:
    address: str  # host:port on loopback
    kind: str = "openai"  # openai | vllm | sglang | demo
    metrics: tuple[str, ...] = ()  # summed; empty: the connection's close is the evidence
    health_path: str = "/health"

    @classmethod
    def make(cls, address: str, kind: str, metrics: str | None = None,
             health_path: str = "/health") -> EngineSpec:
        if kind not in DEFAULT_METRICS:
            raise ValueError(f"--engine-kind {kind!r}: one of {', '.join(DEFAULT_METRICS)}")
        names = (tuple(m.strip() for m in metrics.split(",") if m.strip())
                 if metrics is not None else DEFAULT_METRICS[kind])
        return cls(address, kind, names, health_path)


@dataclass
class AgentMetrics:
    """Prometheus text, kept by hand: a few counters and one histogram."""

    counters: dict[tuple[str, str], float] = field(default_factory=dict)
    ack_buckets: list[int] = field(default_factory=lambda: [0] * (len(_HIST) + 1))
    ack_sum: float = 0.0
    ack_count: int = 0

    def inc(self, name: str, label: str = "", by: float = 1.0) -> None:
        self.counters[(name, label)] = self.counters.get((name, label), 0.0) + by

    def get(self, name: str, label: str = "") -> float:
        return self.counters.get((name, label), 0.0)

    def ack_latency(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(_HIST) if seconds <= b), len(_HIST))
        self.ack_buckets[i] += 1
        self.ack_sum += seconds
        self.ack_count += 1

    def text(self, engine_open: int) -> str:
        out = ["# TYPE extproc_agent_engine_requests_open gauge",
               f"extproc_agent_engine_requests_open {engine_open}"]
        for (name, label), v in sorted(self.counters.items()):
            lab = f'{{why="{label}"}}' if label else ""
            out.append(f"extproc_agent_{name}_total{lab} {v:g}")
        out.append("# TYPE extproc_agent_ack_latency_seconds histogram")
        acc = 0
        for b, n in zip((*_HIST, float("inf")), self.ack_buckets, strict=True):
            acc += n
            le = "+Inf" if b == float("inf") else f"{b:g}"
            out.append(f'extproc_agent_ack_latency_seconds_bucket{{le="{le}"}} {acc}')
        out.append(f"extproc_agent_ack_latency_seconds_sum {self.ack_sum:g}")
        out.append(f"extproc_agent_ack_latency_seconds_count {self.ack_count}")
        return "\n".join(out) + "\n"


@dataclass(eq=False)
class Tracked:
    """One attempt in flight through the agent."""

    fence: SourceFence
    request: web.BaseRequest
    processor: str = ""
    engine: aiohttp.ClientResponse | None = None
    open_counted: bool = False  # counted in the agent's still-forwarding engine requests
    downstream_reset: bool = False
    admitted: bool = False  # before: a stop is only noted (the answer is then a 409)
    engine_output: bool = False  # the engine's body had sent bytes before the stop
    pending: asyncio.Task[aiohttp.ClientResponse] | None = None  # awaiting its headers
    span: Span | None = None  # its `llm.agent.attempt` span until ended

    def event(self, name: str, **attrs: Any) -> None:
        if self.span is not None:
            self.span.add_event(name, {k: v for k, v in attrs.items() if v is not None})

    @property
    def ids(self) -> dict[str, Any]:
        return {"request_id": self.fence.request_id or None,
                "attempt_id": self.fence.attempt_id or None}


def _reset(request: web.BaseRequest) -> None:
    """Close Envoy's connection with an RST, as a dead engine's connection would end."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _error(status: int, err_type: str, message: str, rid: str | None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "code": err_type,
                      "request_id": rid}}
    return web.Response(status=status, body=json.dumps(body).encode(),
                        content_type="application/json")


def metric_sum(text: str, names: tuple[str, ...]) -> float | None:
    """The sum of every sample of the named metrics (any labels); None if none is there."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
    return total if seen else None


class ReplicaAgent:
    def __init__(self, kv: KV | Sequence[KV], prefix: str, lease_ttl_s: float,
                 engine: EngineSpec, *,
                 ack_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time,
                 telemetry: Telemetry | None = None,
                 timers: Timers | None = None) -> None:
        # One KV per journal shard (decision 0042): a request's keys are on the cluster
        # `shard_of(request id)` names, as the processor computes it from the same config.
        self.kvs: tuple[KV, ...] = tuple(kv) if isinstance(kv, Sequence) else (kv,)
        self.kv = self.kvs[0]
        self.tel = telemetry
        self.prefix = prefix.encode()
        self.ttl_s = lease_ttl_s
        self.engine = engine
        self.ack_timeout_s = ack_timeout_s
        self.clock = clock
        self.wall = wall
        self.timers: Timers = timers or LoopTimers()  # every wait, on `clock`'s time
        self.metrics = AgentMetrics()
        self.engine_healthy = False
        self.engine_open = 0  # engine generation requests still forwarding (not aborting)
        self._by_rid: dict[str, set[Tracked]] = {}
        # One watch of `live/<rid>` per request with an attempt in flight here, stopped
        # with its last one: an agent hears its own attempts' fences, not the fleet's.
        self._live_watches: dict[str, Callable[[], None]] = {}
        self._leases: dict[tuple[int, int], LeaseView] = {}  # (shard, lease id)
        self._refreshing: set[tuple[int, int]] = set()
        # (ack|src, shard) -> (id, granted)
        self._own_leases: dict[tuple[str, int], tuple[int, float]] = {}
        self._watches_up: set[int] = set()  # shards whose cancel watch is up
        self._lease_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stops: list[Callable[[], None]] = []
        self._ticker: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.watch_up = asyncio.Event()
        # Attempts whose engine response ended whole, newest last (bounded): a cancel that
        # comes for one later is answered with that evidence (the engine let go already).
        self._finished: OrderedDict[tuple[str, str], float] = OrderedDict()

    # --- keys ----------------------------------------------------------------------------

    def _shard(self, rid: str) -> int:
        return shard_of(rid, len(self.kvs))

    def _kv(self, rid: str) -> KV:
        return self.kvs[shard_of(rid, len(self.kvs))]

    def _live(self, rid: str) -> bytes:
        return self.prefix + b"/live/" + rid.encode()

    def _cancel(self, rid: str, aid: str) -> bytes:
        return self.prefix + b"/cancel/" + rid.encode() + b"/" + aid.encode()

    def _ack(self, rid: str, aid: str) -> bytes:
        return self.prefix + b"/ack/" + rid.encode() + b"/" + aid.encode()

    def _src(self, processor: str, rid: str, aid: str) -> bytes:
        return (self.prefix + b"/src/" + processor.encode() + b"/" + rid.encode() + b"/"
                + aid.encode())

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, enable_cleanup_closed=True),
            auto_decompress=False, skip_auto_headers=("Accept-Encoding", "User-Agent"),
            timeout=aiohttp.ClientTimeout(total=None, connect=5.0, sock_connect=5.0))
        # Cancels are few (only uncertain ends): one watch of them all, per shard.
        for i, kv in enumerate(self.kvs):
            self._stops.append(kv.watch(self.prefix + b"/cancel/", self._cancel_event,
                                        partial(self._watch_state, i), "agent cancel watch"))
        self._ticker = asyncio.ensure_future(self._tick())

    async def close(self) -> None:
        for stop in [*self._stops, *self._live_watches.values()]:
            stop()
        self._live_watches.clear()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        for t in list(self._tasks):
            with contextlib.suppress(Exception):
                await wait_for(self.timers, t, self.ack_timeout_s + 1.0)
        if self.session is not None:
            await self.session.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    def ops_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics_view)
        return app

    async def healthz(self, request: web.Request) -> web.Response:
        """The engine's health as the registration loop last probed it."""
        return web.Response(status=200 if self.engine_healthy else 503,
                            text="ok\n" if self.engine_healthy else "engine unhealthy\n")

    async def metrics_view(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.text(self.engine_open),
                            content_type="text/plain")

    # --- watches, the ticker -------------------------------------------------------------

    def _watch_state(self, shard: int, up: bool) -> None:
        if not up:
            self._watches_up.discard(shard)
            self.watch_up.clear()
            return
        was = shard in self._watches_up
        self._watches_up.add(shard)
        if len(self._watches_up) == len(self.kvs):
            self.watch_up.set()
        if not was:
            # Changes made while the watch was down were not heard: read them again.
            for rid, ts in list(self._by_rid.items()):
                if self._shard(rid) != shard:
                    continue
                for t in list(ts):
                    self._spawn(self._recheck(rid, t))

    def _watch_live(self, rid: str) -> None:
        if rid in self._live_watches:
            return

        def state(up: bool) -> None:
            # Created (or created again): what changed before it is read once more, so a
            # fence between the admission's read and the watch is not missed.
            if up:
                for t in list(self._by_rid.get(rid, ())):
                    self._spawn(self._recheck(rid, t))
        self._live_watches[rid] = self._kv(rid).watch(self._live(rid), self._live_event,
                                                      state, "agent live watch")

    async def _recheck(self, rid: str, t: Tracked) -> None:
        try:
            live, cancel = await self._read(rid, t.fence.attempt_id)
        except StoreUnavailable:
            return  # the deadline still protects
        now = self.clock()
        self._execute(t, t.fence.live_changed(live.value if live else None, now))
        if cancel is not None:
            self._execute(t, t.fence.step(Input.CANCEL, now))

    def _live_event(self, ev: WatchEvent) -> None:
        rid = ev.key[len(self.prefix) + len(b"/live/"):].decode("utf-8", "replace")
        if ev.key != self._live(rid) or rid not in self._live_watches:
            return  # a longer key under the watched one, or a watch being stopped
        for t in list(self._by_rid.get(rid, ())):
            if ev.prev_known and ev.prev != t.fence.attempt_id.encode():
                # A change of another attempt's value: the previous attempt's end, heard
                # after this one was admitted and read (the watch lags the read). Not this
                # attempt's fence; a change whose previous value is unknown is told to all.
                continue
            self._execute(t, t.fence.live_changed(ev.value, self.clock()))

    def _cancel_event(self, ev: WatchEvent) -> None:
        if ev.value is None:
            return
        rest = ev.key[len(self.prefix) + len(b"/cancel/"):].decode("utf-8", "replace")
        rid, _, aid = rest.rpartition("/")
        ended = self._finished.pop((rid, aid), None)
        if ended is not None:
            # Its engine response had ended whole before the cancel came (e.g. a short
            # answer sent into a partition): the engine let go then.
            ack = {"at": round(self.wall(), 6), "evidence": "engine_finished: its response "
                   "had ended", "abort_ms": 0.0, "why": "cancel"}
            self._spawn(self._put_ack(rid, aid, ack, {"request_id": rid, "attempt_id": aid}))
            return
        for t in list(self._by_rid.get(rid, ())):
            if t.fence.attempt_id == aid:
                self._execute(t, t.fence.step(Input.CANCEL, self.clock()))

    async def _tick(self) -> None:
        """Every _TICK_S: deadlines passed without a chunk, Envoy's connection gone, and
        the time-to-live of each lease in use once per TTL/3. Ends with the agent."""
        while True:
            await sleep(self.timers, _TICK_S)
            now = self.clock()
            used: set[tuple[int, int]] = set()
            for ts in list(self._by_rid.values()):
                for t in list(ts):
                    f = t.fence
                    if f.phase is not Phase.FORWARDING:
                        continue
                    used.add((self._shard(f.request_id), f.lease.lease))
                    tr = t.request.transport
                    if tr is None or tr.is_closing():
                        self._execute(t, f.step(Input.DOWNSTREAM_GONE, now))
                    else:
                        self._execute(t, f.check(now))
            for lease in list(self._leases):
                if lease not in used:
                    del self._leases[lease]
                elif self._leases[lease].refresh_due(now) and lease not in self._refreshing:
                    self._spawn(self._refresh(lease[0], self._leases[lease]))

    async def _refresh(self, shard: int, lv: LeaseView) -> None:
        self._refreshing.add((shard, lv.lease))
        try:
            sent = self.clock()
            remaining = await self.kvs[shard].time_to_live(lv.lease)
            lv.answered(sent, float(remaining))
        except StoreUnavailable as e:
            log.warning("lease time-to-live not answered; the deadline stands",
                        extra={"request_id": None, "attempt_id": None, "lease": lv.lease,
                               "error": str(e)})
        finally:
            self._refreshing.discard((shard, lv.lease))

    # --- executing the fence's decisions ------------------------------------------------

    def _uncount(self, t: Tracked) -> None:
        if t.open_counted:
            t.open_counted = False
            self.engine_open -= 1

    def _execute(self, t: Tracked, do: Do) -> None:
        if do is Do.NOTHING or not t.admitted:
            return
        f = t.fence
        why = f.why.value if f.why else ""
        if do in (Do.ABORT, Do.ABORT_QUIET):
            self.metrics.inc("aborts", why)
            log.info("attempt stopped at the source; aborting at the engine",
                     extra={**t.ids, "why": why, "content_events": f.content_events})
            t.event("source.fenced", **{"llmgw.why": why,
                                        "llmgw.content_events": f.content_events})
            if do is Do.ABORT and not t.downstream_reset:
                t.downstream_reset = True
                _reset(t.request)
            self._uncount(t)
            if t.engine is not None:
                t.engine.close()  # the engine sees its client leave: its own abort
                t.event("engine.aborted", **{"llmgw.abort": "connection_closed"})
            elif t.pending is not None:
                # Stopped before the engine's headers (vLLM sends them after its prefill):
                # the pending request is cancelled, which closes its connection.
                t.pending.cancel()
                t.event("engine.aborted", **{"llmgw.abort": "pending_request_cancelled"})
            self._spawn(self._confirm(t))
        elif do is Do.END_DOWNSTREAM:
            self._uncount(t)
            self._spawn(self._confirm(t))
        elif do is Do.FINISH:
            self._untrack(t)

    def _untrack(self, t: Tracked, keep_span: bool = False) -> None:
        self._uncount(t)
        if not keep_span:
            self._end_span(t)
        if t.fence.bytes_stopped:
            self.metrics.inc("bytes_stopped", "", t.fence.bytes_stopped)
            t.fence.bytes_stopped = 0
        ts = self._by_rid.get(t.fence.request_id)
        if ts is not None:
            ts.discard(t)
            if not ts:
                del self._by_rid[t.fence.request_id]
                stop = self._live_watches.pop(t.fence.request_id, None)
                if stop is not None:
                    stop()

    async def _confirm(self, t: Tracked) -> None:
        """Wait (bounded) for the engine's own evidence that it let go, then ack."""
        f = t.fence
        why = f.why.value if f.why else ""
        evidence: str | None = None
        if self.engine.kind == "sglang":
            await self._sglang_abort(t)
        if not self.engine.metrics:
            evidence = "engine_connection_closed"
        elif self.engine.kind in STEP_GAUGES and not t.engine_output:
            # Stopped in the prefill: the gauges would read "let go" while the engine still
            # computes the step. No evidence to wait for: no ack, the lease rule holds.
            f.step(Input.NO_EVIDENCE, self.clock())
            self.metrics.inc("no_evidence", why)
            log.warning("stopped before the engine's first output: its gauges cannot show "
                        "the abort; no ack", extra={**t.ids, "why": why,
                                                    "engine_kind": self.engine.kind})
            t.event("ack.none", **{"llmgw.reason": "stopped before the engine's first output"})
            self._untrack(t)
            return
        else:
            end = self.clock() + self.ack_timeout_s
            while evidence is None and self.clock() < end:
                evidence = await self._engine_let_go()
                if evidence is None:
                    await sleep(self.timers, _POLL_S)
        now = self.clock()
        if evidence is None:
            f.step(Input.NO_EVIDENCE, now)
            self.metrics.inc("no_evidence", why)
            log.warning("no evidence that the engine let go within the bound: no ack",
                        extra={**t.ids, "why": why, "bound_s": self.ack_timeout_s})
            t.event("ack.none", **{"llmgw.reason": "no evidence within the bound"})
            self._untrack(t)
            return
        ack = f.ack(now, evidence, self.wall())
        self._untrack(t, keep_span=True)
        if ack is None:
            self._end_span(t)
            return
        if await self._put_ack(f.request_id, f.attempt_id, ack, t.ids):
            if f.stopped_at is not None:
                self.metrics.ack_latency(self.clock() - f.stopped_at)
            t.event("ack.written", **{"llmgw.evidence": evidence,
                                      "llmgw.abort_ms": ack["abort_ms"]})
            self._end_span(t)
        else:
            t.event("ack.write_failed", **{"llmgw.evidence": evidence})
            self._end_span(t, "ack_not_written")

    async def _put_ack(self, rid: str, aid: str, ack: dict[str, Any],
                       ids: dict[str, Any]) -> bool:
        why = str(ack.get("why", ""))
        try:
            lease = await self._own_lease("ack", _ACK_TTL_S, rid)
            await self._kv(rid).txn(Txn(success=[Put(self._ack(rid, aid), json.dumps(ack).encode(),
                                               lease)]))
        except StoreUnavailable as e:
            self.metrics.inc("ack_write_failures", why)
            log.warning("ack not written: etcd unavailable", extra={**ids, "error": str(e)})
            return False
        self.metrics.inc("acks", why)
        log.info("engine let go; ack written", extra={**ids, **ack})
        return True

    def _remember_finished(self, t: Tracked) -> None:
        key = (t.fence.request_id, t.fence.attempt_id)
        self._finished[key] = self.clock()
        self._finished.move_to_end(key)
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)

    async def _engine_let_go(self) -> str | None:
        """The engine's metrics: what it still holds <= what the agent still forwards
        (the engine listens on loopback behind the agent: the agent is its only client)."""
        assert self.session is not None
        url = f"http://{self.engine.address}/metrics"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                text = await r.text()
        except aiohttp.ClientConnectorError as e:
            if isinstance(e.os_error, ConnectionRefusedError):
                return "engine_down: metrics connection refused"
            return None
        except (aiohttp.ClientError, TimeoutError):
            return None
        held = metric_sum(text, self.engine.metrics)
        if held is None:
            return None
        others = self.engine_open
        if held <= others:
            return f"{'+'.join(self.engine.metrics)}={held:g} <= {others} still forwarding"
        return None

    async def _sglang_abort(self, t: Tracked) -> None:
        assert self.session is not None
        rid = t.request.headers.get(H.ENVOY_REQUEST_ID) or t.fence.attempt_id
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.session.post(f"http://{self.engine.address}/abort_request",
                                         json={"rid": rid},
                                         timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                await r.read()

    async def _own_lease(self, kind: str, ttl_s: int, rid: str) -> int:
        """The agent's lease for its `kind` keys on the cluster of `rid`'s shard."""
        key = (kind, self._shard(rid))
        async with self._lease_lock:
            held = self._own_leases.get(key)
            now = self.clock()
            if held is not None and now - held[1] < ttl_s / 2:
                return held[0]
            lease = await self._kv(rid).grant(ttl_s)
            self._own_leases[key] = (lease.id, now)
            return lease.id

    async def _notice(self, t: Tracked) -> None:
        """The first content event left: `src/<processor>/<rid>/<aid>` (not awaited by the
        forwarding)."""
        f = t.fence
        try:
            lease = await self._own_lease("src", _SRC_TTL_S, f.request_id)
            await self._kv(f.request_id).txn(Txn(success=[Put(
                self._src(t.processor, f.request_id, f.attempt_id),
                json.dumps({"at": self.wall(), "first_content": True}).encode(), lease)]))
            self.metrics.inc("src_notices")
        except StoreUnavailable as e:
            log.warning("first-content notice not written", extra={**t.ids, "error": str(e)})

    async def _read(self, rid: str, aid: str) -> tuple[KeyValue | None, KeyValue | None]:
        res = await self._kv(rid).txn(Txn(success=[Get(self._live(rid)),
                                             Get(self._cancel(rid, aid))]))
        live = res.reads[0][0] if res.reads and res.reads[0] else None
        cancel = res.reads[1][0] if len(res.reads) > 1 and res.reads[1] else None
        return live, cancel

    # --- spans ---------------------------------------------------------------------------

    def _start_span(self, t: Tracked) -> None:
        """One span per tracked attempt, a child of the gateway's request span (the guard's
        `x-gateway-traceparent`, which reaches the replica with every attempt)."""
        if self.tel is None or not self.tel.tracing:
            return
        hd = t.request.headers
        tp = hd.get(H.TRACEPARENT) or hd.get("traceparent")
        host, _, port = self.engine.address.rpartition(":")
        t.span = self.tel.start(
            "llm.agent.attempt", self.tel.parent_from({"traceparent": tp}) if tp else None,
            SpanKind.SERVER, {"llmgw.request_id": t.fence.request_id,
                              "llmgw.attempt_id": t.fence.attempt_id,
                              "llmgw.processor": t.processor or None,
                              "llmgw.engine_kind": self.engine.kind,
                              "server.address": host, "server.port": int(port),
                              "http.request.method": t.request.method,
                              "url.path": t.request.path})

    def _end_span(self, t: Tracked, error: str | None = None, **attrs: Any) -> None:
        span, t.span = t.span, None
        if span is None:
            return
        f = t.fence
        end_span(span, error, **{"llmgw.phase": f.phase.value,
                                 "llmgw.why": f.why.value if f.why else None,
                                 "llmgw.content_events": f.content_events,
                                 "llmgw.bytes_forwarded": f.bytes_forwarded,
                                 "llmgw.bytes_stopped": f.bytes_stopped or None, **attrs})

    # --- the proxy -----------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get(H.REQUEST_ID, "")
        aid = request.headers.get(H.ATTEMPT_ID, "")
        fence = SourceFence(rid, aid, LeaseView(0, self.ttl_s))
        t = Tracked(fence, request, request.headers.get(H.PROCESSOR, ""))
        body = await request.read()
        if rid and aid:
            self.metrics.inc("requests_tracked")
            self._start_span(t)
            refused = await self._admit(t)
            if refused is not None:
                reason = "attempt_fenced" if refused.status == 409 else "attempt_unverified"
                t.event("attempt.refused", **{"llmgw.reason": reason})
                self._untrack(t, keep_span=True)
                self._end_span(t, reason, **{"http.response.status_code": refused.status})
                return refused
        else:
            self.metrics.inc("requests_untracked")
        t.admitted = True
        try:
            return await self._forward(t, request, body)
        finally:
            if t.fence.phase is Phase.FORWARDING:  # an exception the fence never heard of
                self._execute(t, t.fence.step(Input.DOWNSTREAM_GONE, self.clock()))
            elif t.fence.phase is Phase.ENDED:
                self._untrack(t)
                self._remember_finished(t)

    async def _admit(self, t: Tracked) -> web.Response | None:
        """The attempt must be the live one, uncancelled; its lease's deadline known."""
        f = t.fence
        self._by_rid.setdefault(f.request_id, set()).add(t)  # hear changes from now on
        self._watch_live(f.request_id)
        try:
            live, cancel = await self._read(f.request_id, f.attempt_id)
            lv: LeaseView | None = None
            if live is not None and live.value == f.attempt_id.encode():
                held = (self._shard(f.request_id), live.lease)
                lv = self._leases.get(held)
                if lv is None or lv.refresh_due(self.clock()):
                    lv = self._leases.setdefault(held, LeaseView(live.lease, self.ttl_s))
                    sent = self.clock()
                    lv.answered(sent, float(await self._kv(f.request_id).time_to_live(
                        live.lease)))
        except StoreUnavailable as e:
            self.metrics.inc("unverified_refusals")
            log.warning("attempt not verified: etcd unavailable; refused",
                        extra={**t.ids, "error": str(e)})
            return _error(503, "attempt_unverified", "the replica agent could not read the "
                          "attempt's fence", f.request_id)
        now = self.clock()
        if live is None or lv is None or cancel is not None or f.phase is not Phase.FORWARDING \
                or not lv.valid(now):
            self.metrics.inc("fenced_refusals")
            log.info("request for an attempt that is not live: 409, engine not called",
                     extra={**t.ids, "live": live.value.decode("utf-8", "replace")
                            if live else None, "cancelled": cancel is not None})
            return _error(409, "attempt_fenced", "this attempt is no longer the live one",
                          f.request_id)
        f.lease = lv
        return None

    async def _forward(self, t: Tracked, request: web.Request,
                       body: bytes) -> web.StreamResponse:
        assert self.session is not None
        f = t.fence
        hdrs = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = f"http://{self.engine.address}{request.rel_url}"
        if request.method == "POST":
            t.open_counted = True
            self.engine_open += 1
        t.pending = asyncio.ensure_future(self.session.request(
            request.method, url, headers=hdrs, data=body if body else None,
            allow_redirects=False))
        try:
            engine = await t.pending
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if t.pending.cancelled() and not (task is not None and task.cancelling()):
                return web.Response(status=499)  # stopped at the source before the headers
            raise
        except (aiohttp.ClientError, OSError) as e:
            return await self._engine_gone(t, None, e)
        finally:
            t.pending = None
        t.engine = engine
        if f.phase is not Phase.FORWARDING:  # fenced while the engine answered
            engine.close()
            return web.Response(status=499)
        if t.span is not None:
            t.span.set_attribute("http.response.status_code", engine.status)
        ctype = engine.headers.get("Content-Type", "")
        f.response(engine.status == 200 and ctype.startswith("text/event-stream"),
                   family_for_path(request.path))
        resp = web.StreamResponse(status=engine.status, reason=engine.reason)
        for k, v in engine.headers.items():
            if k.lower() not in _HOP or k.lower() == "content-length":
                resp.headers.add(k, v)
        try:
            await resp.prepare(request)
            while True:
                try:
                    data = await engine.content.readany()
                except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as e:
                    if f.phase is Phase.FORWARDING:
                        return await self._engine_gone(t, resp, e)
                    return resp
                if not data:
                    break
                t.engine_output = True
                c = f.chunk(data, self.clock())
                if c.out:
                    await resp.write(c.out)
                if c.first_content:
                    t.event("first_content.sent")
                    if f.attempt_id and t.processor:
                        self._spawn(self._notice(t))
                if c.stop is not None:
                    self._execute(t, c.stop)
                if f.phase is not Phase.FORWARDING:
                    return resp
            tail, do = f.engine_ended(self.clock())
            if do is Do.FINISH:
                if tail:
                    await resp.write(tail)
                await resp.write_eof()
                self._execute(t, do)
            return resp
        except (ConnectionError, aiohttp.ClientConnectionResetError):
            self._execute(t, f.step(Input.DOWNSTREAM_GONE, self.clock()))
            return resp
        finally:
            if t.fence.ended:
                engine.release()
            else:
                engine.close()

    async def _engine_gone(self, t: Tracked, resp: web.StreamResponse | None,
                     err: BaseException) -> web.StreamResponse:
        """The engine's connection broke (or never opened) while forwarding."""
        f = t.fence
        end, do = f.engine_died(self.clock())
        in_band = end is not None and resp is not None
        log.warning("engine connection broke", extra={
            **t.ids, "error": repr(err), "content_events": f.content_events,
            "in_band": in_band})
        t.event("engine.died", **{"llmgw.in_band": in_band,
                                  "llmgw.content_events": f.content_events})
        if end is not None and resp is not None:
            self.metrics.inc("engine_deaths_in_band")
            with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
                if end:
                    await resp.write(end)
                await resp.write_eof()
        else:
            self.metrics.inc("engine_deaths_reset")
            t.downstream_reset = True
            _reset(t.request)
        if f.attempt_id:
            self._execute(t, do)
        else:
            self._untrack(t)
            f.phase = Phase.ENDED
        return resp if resp is not None else web.Response(status=502)


async def run(cfg: Any, record: Mapping[str, Any], listen: str, engine: EngineSpec,
              ops: str | None = None, ack_timeout_s: float = 5.0) -> int:
    """The proxy, its ops listener and the registration loop, until SIGTERM/SIGINT."""
    import signal

    from .kv_etcd import EtcdKV
    from .register import run_agent

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    kvs = [EtcdKV(c) for c in cfg.etcd.clusters()]  # one per journal shard (decision 0042)
    for kv in kvs:
        kv.open()
    # The processor's OTel settings (telemetry.*, OTEL_*); the agent's id as the instance.
    tel = Telemetry(cfg.telemetry, str((record.get("agent") or {}).get("id") or "agent"))
    agent = ReplicaAgent(kvs, cfg.etcd.prefix, cfg.etcd.attempt_lease_ttl_s, engine,
                         ack_timeout_s=ack_timeout_s, telemetry=tel)
    await agent.start()
    runners = []
    for app, addr in ((agent.app(), listen), (agent.ops_app(), ops)):
        if addr is None:
            continue
        runner = web.AppRunner(app, access_log=None, handler_cancellation=False,
                               shutdown_timeout=2.0)
        await runner.setup()
        host, _, port = addr.rpartition(":")
        await web.TCPSite(runner, host.strip("[]"), int(port)).start()
        runners.append(runner)

    def probed(ok: bool) -> None:
        agent.engine_healthy = ok

    log.info("replica agent started", extra={"request_id": None, "attempt_id": None,
                                             "listen": listen, "engine": engine.address,
                                             "engine_kind": engine.kind, "ops": ops})
    try:
        return await run_agent(cfg, record, engine.address, stop, on_probe=probed,
                               signals=False)
    finally:
        for runner in runners:
            await runner.cleanup()
        await agent.close()
        for kv in kvs:
            await kv.close()
        tel.shutdown()  # flushes the spans still batched

"""What every ext_proc stream of one processor process shares.

`Processor` holds the services the sessions use, each behind the port the sessions declare
(`ports.py`): the journal, the tool ledger, the cause log, the clock and the ids, plus the
pool, its health, the retry budget and telemetry; with it the bounded registries one
stream leaves for another (`Pending`, `Reached`), the work that outlives a stream
(`Background`) and the bounded retry of a journal write while etcd is away (`retrying`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from opentelemetry.trace import Span

from ..core.admission import Admitted, AttemptRequest, decide
from ..core.budget import RetryBudget
from ..core.config import Config
from ..core.errors import GatewayError
from ..core.events import IntakeCommitted
from ..core.gate import GateMachine, GateParams
from ..core.guard import GuardMachine
from ..core.handoff import HandOff, TraceSnapshot
from ..core.health import HealthPolicy, HostHealth
from ..core.journal import JournalView, orphan_outcome
from ..core.pool import Pool, pool_from_config
from ..core.replay import record as trace_record
from .causes import CauseRegistry
from .leases import StoreUnavailable
from .logs import rlog
from .ports import Clock, Ids, Journal, Ledger, RandomIds, SystemClock
from .prober import probe_forever
from .telemetry import Telemetry, end_span
from .timers import LoopTimers, Timers, sleep
from .tokenizer import load_tokenizers

log = logging.getLogger("extproc")
T = TypeVar("T")


OUTCOME_RETRY_S = 60.0
RETRY_MAX_DELAY_S = 0.5


async def retrying(fn: Callable[[], Awaitable[Any]], what: str, rid: str | None,
                   aid: str | None, limit_s: float = OUTCOME_RETRY_S,
                   settle_s: float = 0.0, *, timers: Timers, now: Callable[[], float]
                   ) -> bool:
    """Retry an etcd write while etcd is briefly away (frozen, electing), for a bounded time.

    With `settle_s` (take-backs, which are idempotent compare-and-deletes), the write is
    applied again every 0.25 s for that long after its first answer (UNDO_SETTLE_S).
    The pauses are on `timers` and the limits on `now`: the caller's process's Timers port
    and clock (`Processor.timers` and `Processor.clock.monotonic`, which a hermetic test
    makes a FakeTimers and its FakeClock); there is no default.
    """
    delay, deadline, tries = 0.1, now() + limit_s, 0
    while True:
        try:
            await fn()
            if tries:
                rlog(log, logging.INFO, f"done after etcd came back: {what}", rid, aid,
                     tries=tries + 1)
            break
        except StoreUnavailable as e:
            if now() + delay > deadline:
                rlog(log, logging.ERROR, f"gave up: {what}", rid, aid, error=str(e))
                return False
            if tries == 0:
                # Said once: a write only this process holds (an outcome, a take-back) is
                # pending; if the process dies before etcd answers, it is lost.
                rlog(log, logging.WARNING, f"pending until etcd answers: {what}", rid, aid,
                     error=str(e))
            tries += 1
            await sleep(timers, delay)
            # At most RETRY_MAX_DELAY_S between tries: a pending write lands within that of
            # etcd's return (each try fails fast while etcd has no leader: decision 0026).
            delay = min(delay * 2, RETRY_MAX_DELAY_S)
    settled = now() + settle_s
    while now() < settled:
        await sleep(timers, 0.25)
        with contextlib.suppress(StoreUnavailable):
            await fn()
    return True


@dataclass(frozen=True, slots=True)
class HandedOff:
    """A gate's attempt, released and handed to the guard of the same request: the frozen
    record (core.handoff) and the attempt's open span."""

    span: Span
    handoff: HandOff


class Pending(Generic[T]):
    """Id -> what one stream left for another stream of the same request to take, bounded:
    the taker may never come (its stream died first), and must not pin items forever.

    Two are kept: the gate's released attempts (`handoffs`: attempt id -> HandedOff; the
    guard takes it when the released headers reach it, and ends the span at the attempt's
    real end; an evicted one's span is ended here) and the guard's intakes in flight
    (`intakes`: request id -> the intake task, which the gate of every attempt waits for
    before the attempt goes upstream, decision 0021; a committed intake leaves at once, a
    failed one when its guard's stream closes).
    """

    def __init__(self, keep: int = 10000,
                 on_evict: Callable[[T], None] | None = None) -> None:
        self._items: OrderedDict[str, T] = OrderedDict()
        self._keep = keep
        self._on_evict = on_evict

    def put(self, key: str, item: T) -> None:
        self._items[key] = item
        while len(self._items) > self._keep:
            old = self._items.popitem(last=False)[1]
            if self._on_evict is not None:
                self._on_evict(old)

    def take(self, key: str) -> T | None:
        return self._items.pop(key, None)

    def get(self, key: str) -> T | None:
        """The item, left in place for other takers (several attempts wait on one intake)."""
        return self._items.get(key)


class Reached(OrderedDict[str, int]):
    """Request id -> how many of its attempts reached a replica (a gate let them go
    upstream): a later attempt of theirs is a re-prefill, charged to the retry budget, and
    max_attempts counts only those (decision 0024). Bounded: the oldest go first."""

    def of(self, rid: str) -> int:
        return self.get(rid, 0)

    def mark(self, rid: str) -> None:
        self[rid] = self.get(rid, 0) + 1
        while len(self) > 20000:
            self.popitem(last=False)


class Background:
    """Work that must outlive a stream's handler (journal writes, revokes, traces), and
    the traces kept as telemetry.record_traces says."""

    def __init__(self, journal: Journal, cfg: Config) -> None:
        self._journal = journal
        self._cfg = cfg
        self._tasks: set[asyncio.Task[Any]] = set()

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

    def keep_trace(self, clean: bool) -> bool:
        mode = self._cfg.telemetry.record_traces
        return mode == "all" or (mode == "failures" and not clean)

    async def save_trace(self, rid: str, name: str, m: GateMachine | GuardMachine | TraceSnapshot,
                         meta: dict[str, Any]) -> None:
        try:
            await self._journal.put_trace(rid, name, trace_record(
                m, meta, self._cfg.telemetry.max_trace_bytes))
        except StoreUnavailable as e:
            rlog(log, logging.WARNING, "could not keep the event trace", rid, None,
                 error=str(e))

    def keep(self, rid: str, name: str, m: GateMachine | GuardMachine | TraceSnapshot,
             meta: dict[str, Any], clean: bool) -> None:
        """Store the trace in the background if the traces kept include this one."""
        if self.keep_trace(clean):
            self.spawn(self.save_trace(rid, name, m, meta), f"trace-{name}-{rid}")

    async def drain(self, timeout_s: float = 5.0) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)


class Processor:
    """Shared services of one processor process, each behind the port the sessions use."""

    def __init__(self, cfg: Config, journal: Journal, ledger: Ledger,
                 clock: Clock | None = None, ids: Ids | None = None,
                 timers: Timers | None = None) -> None:
        self.cfg = cfg
        self.gate_params = GateParams.from_config(cfg)
        self.journal = journal
        self.ledger = ledger
        self.clock: Clock = clock or SystemClock()
        self.ids: Ids = ids or RandomIds()
        # This process's id toward the replicas' agents (decision 0034): fixed for its life.
        self.instance_id: str = self.ids.instance_id()
        self.timers: Timers = timers or LoopTimers()
        self.pool = pool_from_config(cfg.pool.replicas)
        self.tokenizers = load_tokenizers(cfg.accounting)
        rb = cfg.policy.retry_budget
        self.budget = RetryBudget(rb.fraction, rb.min_retry_concurrency, rb.in_flight_expiry_s)
        self.tel = Telemetry(cfg.telemetry, cfg.server.gateway_id, cfg.server.metrics_listen)
        od, hc = cfg.pool.outlier_detection, cfg.pool.health_check
        self.health = HostHealth(HealthPolicy(
            consecutive_failures=od.consecutive_local_origin_failure if od.enabled else 1 << 30,
            base_ejection_s=od.base_ejection_time_s, max_ejection_s=od.max_ejection_time_s,
            unhealthy_threshold=hc.unhealthy_threshold, healthy_threshold=hc.healthy_threshold))
        self.causes = CauseRegistry(on_attempt=self.attempt_seen, timers=self.timers)
        self.reached = Reached()
        self.work = Background(journal, cfg)
        self.open_streams = 0
        self.handoffs: Pending[HandedOff] = Pending(
            on_evict=lambda h: end_span(h.span, None))
        self.intakes: Pending[asyncio.Future[GatewayError | None]] = Pending()

    def set_pool(self, pool: Pool) -> None:
        """A live pool's new membership (adapters.membership); sessions read it per request."""
        self.pool = pool

    async def intake_committed(self, rid: str, replica: str) -> IntakeCommitted:
        """An attempt's wait for its request's intake (decision 0021), answered with what
        the process knows then: how many of its attempts reached a replica, and the pool's
        view of this replica."""
        opening = self.intakes.get(rid)
        err = await asyncio.shield(opening) if opening is not None else None
        pool = self.pool
        return IntakeCommitted(err, self.reached.of(rid), pool.fingerprint_of(replica),
                               pool.enabled, self.clock.wall(), pool.agent_of(replica))

    def decide(self, request: AttemptRequest, now: float) -> Admitted | GatewayError:
        """core.admission's verdict on an attempt, with this process's retry budget (which
        a re-prefill it admits is charged to)."""
        return decide(request, self.budget, now)

    def mark_reached(self, rid: str) -> None:
        self.reached.mark(rid)

    def attempt_seen(self, replica: str, cause: str, status: int) -> None:
        """Envoy's per-attempt access-log entry: passive health evidence, as its outlier
        detection counts it (refused, reset or timed out: a local-origin failure)."""
        now = self.clock.monotonic()
        if cause in ("upstream", "timeout"):
            # A timed-out attempt (silent past the first-delta limit) ejects at once.
            fail = (self.health.first_delta_timed_out if cause == "timeout"
                    else self.health.attempt_failed)
            if fail(replica, now):
                rlog(log, logging.WARNING, "replica ejected after failed attempts", None, None,
                     replica=replica, cause=cause)
        elif status == 200:
            self.health.attempt_succeeded(replica, now)

    def host_order(self, hosts: list[str]) -> list[str]:
        return self.health.order(hosts, self.clock.monotonic())

    async def probe_pool(self) -> None:
        await probe_forever(lambda: [r.address for r in self.pool.replicas],
                            self.cfg.pool.health_check, self.health, self.timers,
                            self.clock.monotonic)

    def trace_budget(self) -> int:
        t = self.cfg.telemetry
        return 0 if t.record_traces == "none" else t.max_trace_bytes

    def keep_trace(self, clean: bool) -> bool:
        return self.work.keep_trace(clean)

    async def save_trace(self, rid: str, name: str, m: GateMachine | GuardMachine | TraceSnapshot,
                         meta: dict[str, Any]) -> None:
        await self.work.save_trace(rid, name, m, meta)

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        """Run work that must outlive a cancelled gRPC handler (journal writes, revokes)."""
        return self.work.spawn(coro, name)

    async def settled(self, view: JournalView | None) -> JournalView | None:
        """A record whose processor died is settled (gateway_interrupted) when first read."""
        if view is None or not view.orphaned:
            return view
        oc = orphan_outcome(view, self.clock.wall())
        if await self.journal.settle_orphan(view.request_id, oc):
            rlog(log, logging.WARNING, "settled a request whose processor died",
                 view.request_id, None, outcome=oc["outcome"],
                 delivered_output_tokens=oc["delivered_output_tokens"])
        return await self.journal.get(view.request_id)

    async def share_budget(self) -> None:
        """Every second: publish our retry-budget counts (requests and re-prefills in
        flight), learn the other gateways'."""
        while True:
            await sleep(self.timers, 1.0)
            req, ret = self.budget.snapshot(self.clock.monotonic())
            # On failure keep the last view of the others; our own counts stay exact.
            with contextlib.suppress(StoreUnavailable):
                self.budget.others = await self.journal.exchange_budget(
                    self.cfg.server.gateway_id, req, ret)

    async def drain(self, timeout_s: float = 5.0) -> None:
        await self.work.drain(timeout_s)

"""adapters/released.py: the attempt a gate released, taken over, fenced and ended."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from extproc.adapters.leases import ProcessLease
from extproc.adapters.processor import HandedOff, Pending
from extproc.adapters.released import Released
from extproc.adapters.session import INVALID
from extproc.adapters.telemetry import Telemetry
from extproc.core.config import load_config
from extproc.core.guard import GuardMachine
from extproc.core.handoff import HandOff, TraceSnapshot
from extproc.core.pool import Pool

AID = "att_test_1"
RID = "req_0123456789abcdefghjkmnpqrs"
HEADER = json.dumps({"attempt": 2, "attempt_id": AID, "replica": "127.0.0.1:8001",
                     "lease_id": 7, "gateway_id": "gw-1", "started_at": 1.0,
                     "admitted_at": 1.5})
HO = HandOff.from_header(HEADER)
assert HO is not None


class Journal:
    def __init__(self, lease: ProcessLease | None) -> None:
        self.lease = lease
        self.watches: list[Callable[[str | None], None]] = []
        self.unwatched = 0

    def current_process_lease(self, rid: str) -> ProcessLease | None:
        assert rid == RID
        return self.lease

    def on_live_change(self, rid: str, cb: Callable[[str | None], None],
                       mine: str | None = None) -> Callable[[], None]:
        assert (rid, mine) == (RID, AID)
        self.watches.append(cb)

        def unwatch() -> None:
            self.unwatched += 1
        return unwatch


class Ports:
    def __init__(self, lease: ProcessLease | None = None, keep: bool = True) -> None:
        cfg = load_config({})
        self.journal = Journal(lease)
        self.handoffs: Pending[HandedOff] = Pending()
        self.tel = Telemetry(cfg.telemetry, "gw-1", cfg.server.metrics_listen)
        self.pool = Pool()  # the fence metric's replica label is bounded by it
        self.keep = keep
        self.saved: list[tuple[str, str, dict[str, Any]]] = []

    def keep_trace(self, clean: bool) -> bool:
        return self.keep

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        return asyncio.ensure_future(coro)

    async def save_trace(self, rid: str, name: str, m: GuardMachine | TraceSnapshot,
                         meta: dict[str, Any]) -> None:
        self.saved.append((rid, name, meta))


async def test_the_live_watch_fences_only_on_another_value_and_stops_once() -> None:
    p, fenced = Ports(ProcessLease(9, 0, float("inf"))), []
    r = Released.take_over(p, RID, HO, lambda: fenced.append(1))
    assert r.handoff.attempt == 2 and r.span is None and r.trace is None
    # Another process's lease (7 is not ours, 9): no local deadline bounds it.
    assert r.lease.valid() and r.lease.process.lease_id == 0
    (cb,) = p.journal.watches
    cb(AID)
    assert fenced == []
    cb(None)
    cb("att_other")
    assert fenced == [1, 1]  # the machine says it once (LoseLease); the watch only tells
    r.stop_watching()
    r.stop_watching()
    assert p.journal.unwatched == 1


async def test_the_same_process_hand_off_brings_its_span_and_trace_and_our_lease() -> None:
    lease = ProcessLease(7, 0, 123.0)
    p = Ports(lease)
    trace = TraceSnapshot("gate", RID, {}, (), (), {})
    p.handoffs.put(AID, HandedOff(INVALID, replace(HO, trace=trace)))
    r = Released.take_over(p, RID, HO, lambda: None)
    assert r.span is INVALID and r.trace is trace
    assert r.lease.process is lease and p.handoffs.take(AID) is None


async def test_its_end_is_the_record_said_once_and_the_gate_trace_kept() -> None:
    p = Ports()
    r = Released.take_over(p, RID, HO, lambda: None)
    r.trace = TraceSnapshot("gate", RID, {}, (), (), {})
    n, rec = r.end(upstream_finished=True, cause="client", wall=50.0)
    await asyncio.sleep(0)
    assert n == 2 and rec["attempt_id"] == AID and "lease_id" not in rec
    assert (rec["fence"], rec["released"], rec["ended_at"], rec["envoy_cause"]) == (
        "ended_with_request", True, 50.0, "client")
    assert p.saved == [(RID, "attempt-002", {"attempt_id": AID, "replica": "127.0.0.1:8001",
                                             "failure_class": rec["failure_class"]})]
    assert r.trace is None and r.span is None

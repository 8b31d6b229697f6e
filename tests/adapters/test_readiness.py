"""adapters/readiness: liveness is SERVING from start to the very end whatever etcd does;
readiness follows etcd's last answer (asking etcd itself only when no call of ours has been
answered for half the grace), drains to NOT_SERVING on shutdown; the gauges read the same."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from grpc_health.v1 import health_pb2

from extproc.adapters.readiness import (
    LIVENESS_SERVICE,
    READINESS_SERVICE,
    HealthReporter,
    export_gauges,
)

from .support import FakeClock, FakeTimers, idle

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
GRACE_S = 0.5  # its tick (a quarter) and the times below are exact in binary


class Statuses:
    """The health servicer's statuses as set, in order; a test waits for one."""

    def __init__(self) -> None:
        self.sets: list[tuple[str, int]] = []
        self.now: dict[str, int] = {}
        self.shut = False
        self.moved = asyncio.Event()

    async def set(self, service: str, status: int) -> None:
        self.sets.append((service, status))
        self.now[service] = status
        self.moved.set()

    async def enter_graceful_shutdown(self) -> None:
        self.shut = True

    async def until(self, service: str, status: int, s: float = 5.0) -> None:
        async def wait() -> None:
            while self.now.get(service) != status:
                self.moved.clear()
                await self.moved.wait()
        await asyncio.wait_for(wait(), s)


class Source:
    def __init__(self) -> None:
        self.last_answer: float | None = None
        self.probes = 0
        self.probe_answers = False

    async def healthy(self) -> bool:
        self.probes += 1
        return self.probe_answers


async def until(timers: FakeTimers, hs: Statuses, service: str, status: int) -> None:
    """Move the fake clock, timer by timer, until the service has the status."""
    for _ in range(1000):
        await idle()
        if hs.now.get(service) == status:
            return
        due = timers.next_due()
        assert due is not None, "no timer pending: the loop stopped"
        timers.advance(due - timers.clock.now)
    raise AssertionError(f"{service!r} never became {status}: {hs.sets}")


async def test_readiness_follows_etcd_and_liveness_never_does() -> None:
    timers = FakeTimers(FakeClock())
    clock = timers.clock
    hs, src = Statuses(), Source()
    r = HealthReporter(hs, src, GRACE_S, clock=clock.monotonic, timers=timers)
    await r.start()
    try:
        assert hs.sets[:2] == [(LIVENESS_SERVICE, SERVING), (READINESS_SERVICE, NOT_SERVING)]
        assert not r.ready and r.last_answer_age() is None
        await idle()
        assert src.probes == 1  # never answered: it asks etcd itself at once
        timers.advance(1.0)  # (one tick, late: the loop re-arms when it runs)
        await idle()
        src.last_answer = clock.now  # a call of ours was answered
        await until(timers, hs, READINESS_SERVICE, SERVING)
        assert r.ready and clock.now == pytest.approx(1.0 + r.tick_s)  # on the next tick
        assert r.last_answer_age() == pytest.approx(r.tick_s)
        # Silent past the grace, and the probe gets no answer either: not ready, within a
        # few milliseconds of the grace's end (the loop wakes at the flip, not a tick later).
        await until(timers, hs, READINESS_SERVICE, NOT_SERVING)
        assert clock.now == pytest.approx(1.0 + GRACE_S + 0.005)
        age = r.last_answer_age()
        assert age is not None and age == pytest.approx(GRACE_S + 0.005)
        probes = src.probes
        # It asked etcd itself while no call of ours had answered (at 0 and 1.0), then at
        # each wake-up from half the grace of silence on (1.25, 1.375, 1.5, 1.505).
        assert probes == 6
        src.probe_answers = True  # etcd answers the probe again: no call of ours did
        await until(timers, hs, READINESS_SERVICE, SERVING)
        assert src.probes == probes + 1
        assert clock.now == pytest.approx(1.0 + GRACE_S + 0.005 + r.tick_s)
        assert all(st == SERVING for sv, st in hs.sets if sv == LIVENESS_SERVICE)
    finally:
        await r.drain()
        assert hs.now == {LIVENESS_SERVICE: SERVING, READINESS_SERVICE: NOT_SERVING}
        await r.stop()
    assert hs.shut  # every service NOT_SERVING for good, at the very end


async def test_draining_is_not_ready_whatever_etcd_says() -> None:
    timers = FakeTimers(FakeClock())
    clock = timers.clock
    hs, src = Statuses(), Source()
    src.last_answer = clock.now
    r = HealthReporter(hs, src, 30.0, clock=clock.monotonic, timers=timers)
    await r.start()
    try:
        await until(timers, hs, READINESS_SERVICE, SERVING)
        assert clock.now == 0.0  # answered: serving at once, no tick needed
        await r.drain()
        src.last_answer = clock.now
        timers.advance(r.tick_s)  # the loop's next tick: etcd answered, still draining
        await idle()
        assert hs.now[READINESS_SERVICE] == NOT_SERVING and not r.ready
    finally:
        await r.stop()


class Gauges:
    def __init__(self) -> None:
        self.read: dict[str, Callable[[], float | None]] = {}

    def observe(self, name: str, description: str, unit: str,
                read: Callable[[], float | None]) -> None:
        assert description and unit and name not in self.read
        self.read[name] = read


def test_gauges_say_readiness_age_streams_and_each_shard_s_silence() -> None:
    now = [100.0]
    src, shard1 = Source(), Source()
    src.last_answer, shard1.last_answer = 98.0, 90.0
    r = HealthReporter(Statuses(), src, 5.0, clock=lambda: now[0])
    g = Gauges()
    export_gauges(g, r, open_streams=lambda: 3, loop_lag=lambda: 0.002, shards=(src, shard1))
    assert g.read["llmgw.ready"]() == 0.0  # not evaluated yet: never ready before etcd
    assert g.read["llmgw.etcd.last_answer_age"]() == 2.0
    assert g.read["llmgw.open_streams"]() == 3.0
    assert g.read["llmgw.event_loop.lag"]() == 0.002
    assert g.read["llmgw.etcd.shard0.last_answer_age"]() == 2.0
    assert g.read["llmgw.etcd.shard1.last_answer_age"]() == 10.0
    one = Gauges()
    export_gauges(one, r, open_streams=lambda: 0, shards=(src,))
    assert not any("shard" in n for n in one.read) and "llmgw.event_loop.lag" not in one.read

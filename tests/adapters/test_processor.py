"""adapters/processor: what every stream of one process shares. The bounded registries one
stream leaves for another, the bounded retry of a journal write while etcd is away, the
work that outlives a stream and the traces it keeps, and Envoy's per-attempt word as passive
health. (The sessions over it: test_sessions.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import pytest

from extproc.adapters.leases import StoreUnavailable
from extproc.adapters.memory_store import MemoryStore
from extproc.adapters.processor import Background, Pending, Reached, retrying
from extproc.core.config import load_config
from extproc.core.errors import journal_unavailable
from extproc.core.guard import GuardMachine

from .support import FakeClock, FakeTimers, idle, run_on
from .test_sessions import proc


def test_pending_keeps_the_newest_and_hands_an_evicted_item_back() -> None:
    evicted: list[str] = []
    p: Pending[str] = Pending(keep=2, on_evict=evicted.append)
    for k in ("a", "b", "c"):
        p.put(k, k.upper())
    assert evicted == ["A"] and p.get("a") is None
    assert p.get("b") == "B" and p.get("b") == "B"  # get leaves it for other takers
    assert p.take("b") == "B" and p.take("b") is None  # take takes it once


def test_reached_counts_per_request_and_forgets_the_oldest() -> None:
    r = Reached()
    assert r.of("req_1") == 0
    r.mark("req_1")
    r.mark("req_1")
    assert r.of("req_1") == 2
    for i in range(20000):
        r.mark(f"req_x{i}")
    assert len(r) == 20000 and r.of("req_1") == 0  # bounded: the oldest went first


class Flaky:
    def __init__(self, fails: int) -> None:
        self.fails, self.calls = fails, 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.fails:
            raise StoreUnavailable("etcd frozen")


async def test_a_write_is_retried_until_etcd_answers(caplog: pytest.LogCaptureFixture) -> None:
    timers = FakeTimers(FakeClock())
    fn = Flaky(fails=2)
    with caplog.at_level(logging.INFO, logger="extproc"):
        assert await run_on(timers, retrying(fn, "write the outcome", "req_1", None,
                                             limit_s=5.0, timers=timers,
                                             now=timers.clock.monotonic))
    assert fn.calls == 3
    assert timers.clock.now == pytest.approx(0.1 + 0.2)  # its pauses double from 0.1 s
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs.count("pending until etcd answers: write the outcome") == 1  # said once
    assert "done after etcd came back: write the outcome" in msgs


async def test_a_write_etcd_never_answers_is_given_up_within_the_limit() -> None:
    timers = FakeTimers(FakeClock())
    fn = Flaky(fails=10**6)
    assert await run_on(timers, retrying(fn, "write", None, None, limit_s=0.35,
                                         timers=timers, now=timers.clock.monotonic)) is False
    # Tries at 0, 0.1 and 0.3 s; the next pause (0.4 s) would end past the limit.
    assert fn.calls == 3 and timers.clock.now == pytest.approx(0.3)


async def test_a_write_under_the_pause_cap_lands_within_it_of_etcd_s_return() -> None:
    timers = FakeTimers(FakeClock())
    fn = Flaky(fails=6)
    assert await run_on(timers, retrying(fn, "write", None, None, limit_s=5.0,
                                         timers=timers, now=timers.clock.monotonic))
    # 0.1, 0.2, 0.4, then RETRY_MAX_DELAY_S (0.5) between tries.
    assert fn.calls == 7 and timers.clock.now == pytest.approx(0.1 + 0.2 + 0.4 + 3 * 0.5)


async def test_a_take_back_is_applied_again_while_it_settles() -> None:
    timers = FakeTimers(FakeClock())
    fn = Flaky(fails=0)
    assert await run_on(timers, retrying(fn, "undo", None, None, settle_s=0.3,
                                         timers=timers, now=timers.clock.monotonic))
    # Once, then every 0.25 s while it settles: a late write applied after it is caught.
    assert fn.calls == 3 and timers.clock.now == pytest.approx(0.5)


def _cfg(mode: str) -> Any:
    return load_config({"telemetry": {"record_traces": mode}})


@pytest.mark.parametrize(("mode", "clean", "kept"), [
    ("all", True, True), ("all", False, True), ("failures", True, False),
    ("failures", False, True), ("none", False, False)])
def test_traces_are_kept_as_record_traces_says(mode: str, clean: bool, kept: bool) -> None:
    cfg = _cfg(mode)
    assert Background(MemoryStore(cfg.etcd, owner="t"), cfg).keep_trace(clean) is kept


async def test_background_work_outlives_its_caller_and_stores_the_trace() -> None:
    cfg = _cfg("all")
    store = MemoryStore(cfg.etcd, owner="t")
    work = Background(store, cfg)
    m = GuardMachine.new("req_t", 15.0, 1 << 20)
    work.keep("req_t", "guard", m, {"why": "test"}, clean=True)

    async def boom() -> None:
        raise RuntimeError("a bug in background work")
    failed = work.spawn(boom(), "boom")
    await work.drain(2.0)
    assert failed.done() and isinstance(failed.exception(), RuntimeError)
    traces = await store.get_traces("req_t")
    assert traces["guard"]["role"] == "guard" and traces["guard"]["meta"] == {"why": "test"}
    assert not work._tasks  # every finished task left the set


async def test_an_attempt_s_intake_wait_answers_with_what_the_process_knows() -> None:
    p, _ = proc()
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    p.intakes.put("req_1", fut)
    p.mark_reached("req_1")
    waiting = asyncio.ensure_future(p.intake_committed("req_1", "127.0.0.1:9"))
    await asyncio.sleep(0)
    assert not waiting.done()  # the attempt waits for its request's intake
    err = journal_unavailable("req_1")
    fut.set_result(err)
    got = await waiting
    assert (got.error, got.reached_count, got.pool_enabled) == (err, 1, False)
    assert (await p.intake_committed("req_none", "x")).error is None


def test_envoy_s_failed_attempts_eject_a_replica_and_a_200_restores_it() -> None:
    timers = FakeTimers(FakeClock())
    p, _ = proc(timers=timers)
    a, b = "127.0.0.1:1", "127.0.0.1:2"
    for _ in range(p.cfg.pool.outlier_detection.consecutive_local_origin_failure):
        p.attempt_seen(a, "upstream", 503)
    assert p.host_order([a, b]) == [b, a]
    p.attempt_seen(b, "timeout", 0)  # silent past the first-delta limit: ejected at once
    assert not p.health.healthy(b, p.clock.monotonic())
    p.attempt_seen("127.0.0.1:3", "client", 200)  # a client's leaving says nothing bad
    assert p.host_order(["127.0.0.1:3", a]) == ["127.0.0.1:3", a]


async def test_the_retry_budget_is_exchanged_once_a_second_on_the_timers_port() -> None:
    timers = FakeTimers(FakeClock())
    p, store = proc(timers=timers)
    sent: list[tuple[str, int, int, float]] = []
    real = store.exchange_budget

    async def exchange(gid: str, requests: int, retries: int) -> dict[str, tuple[int, int]]:
        sent.append((gid, requests, retries, timers.clock.now))
        await real(gid, requests, retries)
        return {"gw-2": (7, 1)}
    store.exchange_budget = exchange  # type: ignore[method-assign]
    task = asyncio.ensure_future(p.share_budget())
    try:
        await idle()
        assert sent == [] and timers.next_due() == 1.0  # first after a second, not at once
        timers.advance(0.999)
        await idle()
        assert sent == []
        for step in (0.001, 1.0, 1.0):
            assert timers.advance(step) == 1
            await idle()
        gid = p.cfg.server.gateway_id
        assert sent == [(gid, 0, 0, pytest.approx(t)) for t in (1.0, 2.0, 3.0)]
        assert p.budget.others == {"gw-2": (7, 1)}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

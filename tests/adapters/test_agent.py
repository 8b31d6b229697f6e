"""adapters/agent: the replica's agent, in process, on the in-memory KV and a loopback
engine. A request without the gateway's ids passes through untouched; one for an attempt
that is not the live one (or whose fence cannot be read) is refused before the engine is
called; the live attempt's is forwarded. Its own small parts: the engine kinds and their
gauges, the sum of a scraped metric, its Prometheus text. (Fences, cancels, acks and engine
deaths against a real etcd and a demo replica: tests/e2e/test_agent.py; against vLLM:
tests/vllm/test_04_agent.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from extproc.adapters.agent import (
    DEFAULT_METRICS,
    AgentMetrics,
    EngineSpec,
    ReplicaAgent,
    metric_sum,
)
from extproc.adapters.kv import Put, Txn
from extproc.adapters.kv_memory import MemoryKV
from extproc.core import headers as H

from .support import FakeClock, FakeTimers, idle

PREFIX = "/llmgw/v1"
RID, AID = "req_" + "a" * 26, "att_" + "b" * 26


def test_an_engine_kind_brings_its_gauges_unless_named() -> None:
    assert EngineSpec.make("127.0.0.1:1", "vllm").metrics == DEFAULT_METRICS["vllm"]
    assert EngineSpec.make("127.0.0.1:1", "vllm", metrics=" a , b,").metrics == ("a", "b")
    assert EngineSpec.make("127.0.0.1:1", "openai").metrics == ()  # the close is the evidence
    with pytest.raises(ValueError, match="--engine-kind 'tgi'"):
        EngineSpec.make("127.0.0.1:1", "tgi")


def test_metric_sum_adds_every_sample_of_the_named_metrics() -> None:
    text = ("# HELP vllm:num_requests_running running\n"
            'vllm:num_requests_running{model_name="m",engine="0"} 2.0\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 1\n'
            "vllm:num_requests_waiting 3\n"
            "vllm:num_requests_running_other 100\n"
            "vllm:num_requests_waiting_x notanumber\n")
    assert metric_sum(text, DEFAULT_METRICS["vllm"]) == 6.0
    assert metric_sum(text, ("sglang:num_running_reqs",)) is None  # absent: unknown, not 0


def test_the_metrics_text_counts_and_buckets_cumulatively() -> None:
    m = AgentMetrics()
    m.inc("stops", "fence")
    m.inc("stops", "fence")
    m.inc("requests_tracked")
    for s in (0.004, 0.3, 99.0):
        m.ack_latency(s)
    text = m.text(engine_open=2)
    assert "extproc_agent_engine_requests_open 2\n" in text
    assert 'extproc_agent_stops_total{why="fence"} 2\n' in text
    assert "extproc_agent_requests_tracked_total 1\n" in text
    assert 'extproc_agent_ack_latency_seconds_bucket{le="0.005"} 1\n' in text
    assert 'extproc_agent_ack_latency_seconds_bucket{le="0.5"} 2\n' in text
    assert 'extproc_agent_ack_latency_seconds_bucket{le="10"} 2\n' in text
    assert 'extproc_agent_ack_latency_seconds_bucket{le="+Inf"} 3\n' in text
    assert "extproc_agent_ack_latency_seconds_count 3\n" in text


@dataclass
class Rig:
    agent: ReplicaAgent
    kv: MemoryKV
    url: str
    engine_calls: list[bytes]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"127.0.0.1:{port}"


@pytest.fixture()
async def rig() -> AsyncIterator[Rig]:
    calls: list[bytes] = []

    async def complete(request: web.Request) -> web.Response:
        calls.append(await request.read())
        return web.json_response({"echo": json.loads(calls[-1] or b"null")}, status=201)
    engine_app = web.Application()
    engine_app.router.add_post("/v1/completions", complete)
    engine, engine_addr = await _serve(engine_app)
    clock = FakeClock()
    kv = MemoryKV(clock)
    # Its ticker and waits on the same fake clock as the KV: nothing here needs them to run.
    agent = ReplicaAgent(kv, PREFIX, 10.0, EngineSpec.make(engine_addr, "openai"),
                         clock=clock.monotonic, timers=FakeTimers(clock))
    await agent.start()
    runner, addr = await _serve(agent.app())
    try:
        yield Rig(agent, kv, f"http://{addr}", calls)
    finally:
        await runner.cleanup()
        await agent.close()
        await engine.cleanup()
        await kv.close()


async def _post(rig: Rig, headers: dict[str, str]) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.post(
            rig.url + "/v1/completions", json={"prompt": "hi"}, headers=headers) as r:
        return r.status, await r.json()


async def test_a_request_without_the_gateway_s_ids_passes_untouched(rig: Rig) -> None:
    assert await _post(rig, {}) == (201, {"echo": {"prompt": "hi"}})
    assert rig.engine_calls == [b'{"prompt": "hi"}']
    assert rig.agent.metrics.get("requests_untracked") == 1


async def test_an_attempt_that_is_not_the_live_one_never_reaches_the_engine(rig: Rig) -> None:
    ids = {H.REQUEST_ID: RID, H.ATTEMPT_ID: AID}
    status, body = await _post(rig, ids)  # no live key at all
    assert status == 409 and body["error"]["code"] == "attempt_fenced"  # type: ignore[index]
    lease = await rig.kv.grant(10)
    live = f"{PREFIX}/live/{RID}".encode()
    await rig.kv.txn(Txn(success=[Put(live, b"att_other", lease.id)]))
    assert (await _post(rig, ids))[0] == 409  # another attempt is live
    rig.kv.unavailable = True
    status, body = await _post(rig, ids)  # the fence cannot be read: refused too
    assert status == 503 and body["error"]["code"] == "attempt_unverified"  # type: ignore[index]
    assert rig.engine_calls == []
    assert rig.agent.metrics.get("fenced_refusals") == 2
    assert rig.agent.metrics.get("unverified_refusals") == 1


async def test_the_live_attempt_is_forwarded(rig: Rig) -> None:
    lease = await rig.kv.grant(10)
    await rig.kv.txn(Txn(success=[Put(f"{PREFIX}/live/{RID}".encode(), AID.encode(),
                                      lease.id)]))
    assert await _post(rig, {H.REQUEST_ID: RID, H.ATTEMPT_ID: AID}) == (
        201, {"echo": {"prompt": "hi"}})
    assert len(rig.engine_calls) == 1 and rig.agent.metrics.get("requests_tracked") == 1


async def test_healthz_follows_the_engine_s_last_probe(rig: Rig) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(rig.url + "/healthz") as r:
            assert r.status == 503
        rig.agent.engine_healthy = True
        async with s.get(rig.url + "/healthz") as r:
            assert r.status == 200


async def test_close_waits_for_its_work_bounded_on_the_timers_port() -> None:
    """Work still running at close (an ack being confirmed) gets ack_timeout_s + 1 on the
    agent's Timers port, then is cancelled."""
    timers = FakeTimers(FakeClock())
    kv = MemoryKV(timers.clock)
    agent = ReplicaAgent(kv, PREFIX, 10.0, EngineSpec.make("127.0.0.1:1", "openai"),
                         ack_timeout_s=2.0, clock=timers.clock.monotonic, timers=timers)
    stuck = asyncio.Event()
    agent._spawn(stuck.wait())
    closing = asyncio.ensure_future(agent.close())
    await idle()
    assert timers.advance(2.999) == 0
    await idle()
    assert not closing.done() and len(agent._tasks) == 1
    assert timers.advance(0.001) == 1
    await asyncio.wait_for(closing, 5)
    assert not agent._tasks and timers.pending() == 0  # cancelled, its deadline gone
    await kv.close()

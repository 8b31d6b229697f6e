"""adapters/agent_link: the gate's link to one agent-fronted attempt (decision 0034). It hears
the agent's word for its own attempt only, until stopped; it listens for the acknowledgement
before it asks for the cancel, so an early one is not missed; the wait for it is bounded on
the Timers port; and what the acknowledgement changed is written (the fenced marker ended,
or the engine's evidence added). The gate's whole session with an agent: test_gate_agent.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from extproc.adapters.agent_link import AgentLink
from extproc.adapters.kv import Get, Put, Txn
from extproc.adapters.memory_store import MemoryStore
from extproc.adapters.processor import Background
from extproc.core import events as E
from extproc.core.config import load_config

from .support import FakeClock, FakeTimers, idle

RID, AID = "req_link", "att_1"


def _link() -> tuple[AgentLink, MemoryStore, FakeTimers]:
    cfg = load_config({})
    timers = FakeTimers(FakeClock())
    store = MemoryStore(cfg.etcd, clock=timers.clock, owner="gw/link")
    ports = SimpleNamespace(clock=timers.clock, timers=timers, journal=store,
                            instance_id="proc_l", work=Background(store, cfg))
    return AgentLink(ports, RID, AID), store, timers  # type: ignore[arg-type]


async def _put(store: MemoryStore, kind: str, *parts: str, value: dict[str, Any]) -> None:
    key = store.prefix + ("/" + "/".join((kind, *parts))).encode()
    await store.kv.txn(Txn(success=[Put(key, json.dumps(value).encode())]))


async def test_the_agent_s_word_is_heard_for_this_attempt_only_until_stopped() -> None:
    link, store, _ = _link()
    heard: list[float] = []
    link.listen(heard.append)
    await _put(store, "src", "proc_l", RID, "att_other", value={"at": 1.0})
    await _put(store, "src", "proc_other", RID, AID, value={"at": 2.0})
    await _put(store, "src", "proc_l", RID, AID, value={"at": 3.0})
    assert heard == [3.0]
    link.stop()
    await _put(store, "src", "proc_l", RID, AID, value={"at": 4.0})
    assert heard == [3.0]


async def test_the_cancel_is_written_and_its_acknowledgement_awaited() -> None:
    link, store, _ = _link()
    link.put_cancel("gw-1", bound_s=5.0)
    await idle()
    got = await store.kv.txn(Txn(success=[Get(store.prefix + f"/cancel/{RID}/{AID}".encode())]))
    rec = json.loads(got.reads[0][0].value)
    assert (rec["gateway_id"], rec["processor"]) == ("gw-1", "proc_l")
    await _put(store, "ack", RID, AID, value={"engine": "aborted"})
    # Bounded here too: an acknowledgement not heard would wait on the fake timers forever.
    ev = await asyncio.wait_for(link.await_ack(E.AwaitAck(seconds=3.0)), 5)
    assert ev == E.AckLearned(True, {"engine": "aborted"}, ev.wall)


async def test_the_cancel_is_put_again_on_the_timers_port_within_its_bound() -> None:
    link, store, timers = _link()
    tries: list[float] = []
    real = store.put_cancel

    async def put_cancel(*args: Any) -> Any:
        tries.append(timers.clock.now)
        return await real(*args)
    store.put_cancel = put_cancel  # type: ignore[method-assign]
    store.unavailable = True
    link.put_cancel("gw-1", bound_s=0.35)
    for pause in (0.1, 0.2):  # on the fake clock; the next (0.4 s) would end past the bound
        await idle()
        assert timers.advance(pause) == 1
    await idle()
    assert tries == [0.0, 0.1, pytest.approx(0.3)] and timers.pending() == 0  # given up


async def test_no_acknowledgement_within_the_bound_is_none_heard() -> None:
    link, _, timers = _link()
    link.put_cancel("gw-1", bound_s=5.0)
    waiting = asyncio.ensure_future(link.await_ack(E.AwaitAck(seconds=2.0)))
    await idle()
    assert not waiting.done()
    timers.advance(2.0)  # the Timers port: no real wait
    ev = await waiting
    assert (ev.heard, ev.evidence) == (False, None)


async def test_what_the_acknowledgement_changed_is_written() -> None:
    link, store, _ = _link()
    await link.settled(E.AckSettled(1, None, False, "network_uncertain", {}))  # nothing heard
    reads = await store.kv.txn(Txn(success=[Get(store.prefix + b"/req/", prefix=True)]))
    assert reads.reads[0] == ()
    await link.settled(E.AckSettled(1, {"attempt_id": AID, "ack": {"engine": "aborted"}},
                                    False, "network_uncertain", {}))
    reads = await store.kv.txn(Txn(success=[Get(store.prefix + b"/req/", prefix=True)]))
    (kv,) = reads.reads[0]
    assert kv.key.endswith(f"/req/{RID}/attempts/001".encode())
    assert json.loads(kv.value)["ack"] == {"engine": "aborted"}


async def test_an_acknowledged_fenced_attempt_leaves_its_marker_so_a_retry_runs() -> None:
    link, store, _ = _link()
    live = store.live_prefix + RID.encode()
    await store.kv.txn(Txn(success=[Put(live, b"fenced:" + AID.encode())]))
    await link.settled(E.AckSettled(1, {"attempt_id": AID}, True, "network_uncertain", {}))
    assert (await store.kv.txn(Txn(success=[Get(live)]))).reads[0] == ()
    # Another attempt's marker is not this acknowledgement's to end.
    await store.kv.txn(Txn(success=[Put(live, b"fenced:att_2")]))
    await link.settled(E.AckSettled(1, {"attempt_id": AID}, True, "network_uncertain", {}))
    assert (await store.kv.txn(Txn(success=[Get(live)]))).reads[0][0].value == b"fenced:att_2"

"""The gateway's side of the replica agent (decision 0034), on the in-memory store.

The journal store's calls for the agent run on both stores (the `env` fixture of
test_journal_store: the in-memory fake and a real etcd): the one `src/<processor>/` watch
and its listeners by attempt, the cancel key, the acknowledgement's watch (also of an ack
written before it), and the revoke of a `fenced:` end on it. Then the gate's session with
an agent-fronted replica on a fake clock: the test plays the agent by writing its keys.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from extproc.adapters.gate import GateSession
from extproc.adapters.kv import Get, Put, Txn
from extproc.adapters.memory_store import MemoryStore
from extproc.core import headers as H

from .support import RID, SSE_CONTENT, SSE_ROLE, FakeClock, FakeTimers, KVTap, idle
from .test_journal_store import (  # noqa: F401  (env, etcd_endpoint: the fixtures, by name)
    Env,
    _open,
    _rec,
    _until,
    _within,
    env,
    etcd_endpoint,
)
from .test_sessions import (
    REPLICA,
    gate_headers,
    open_request,
    proc,
    resp_body,
    resp_headers,
    set_headers,
    start,
)

ACK = {"at": 1.0, "evidence": "vllm:num_requests_running=0", "abort_ms": 38.5,
       "why": "cancel"}


@pytest.fixture
def store(env: Env) -> Env:  # noqa: F811
    """Each store of test_journal_store's contract: the in-memory fake, a real etcd; its
    KV tapped, so a test waits for a watch's stream and its events, not for time."""
    env.raw.kv = KVTap(env.raw.kv)
    return env


def _tap(e: Env) -> KVTap:
    assert isinstance(e.raw.kv, KVTap)
    return e.raw.kv


def _key(e: Env, kind: str, *parts: str) -> bytes:
    return e.raw.prefix + f"/{kind}/{'/'.join(parts)}".encode()


async def _put(e: Env, key: bytes, value: dict[str, Any]) -> None:
    await e.raw.kv.txn(Txn(success=[Put(key, json.dumps(value).encode())]))


# --- the journal store, on both stores ----------------------------------------------------


async def test_the_source_watch_tells_each_attempt_its_own_word_only(store: Env) -> None:
    s, tap = store.store, _tap(store)
    heard: list[tuple[str, float]] = []
    off1 = s.on_source_sent("proc_a", "req_a", "att_1", lambda at: heard.append(("1", at)))
    off2 = s.on_source_sent("proc_a", "req_a", "att_2", lambda at: heard.append(("2", at)))
    src = _key(store, "src", "proc_a") + b"/"
    # etcd creates the watch's stream in the background: a put before it would be missed.
    await tap.until(lambda: tap.up.get(src, False), "the source watch's stream")
    await _put(store, _key(store, "src", "proc_b", "req_a", "att_1"), {"at": 9.0})  # another's
    await _put(store, _key(store, "src", "proc_a", "req_a", "att_1"),
               {"at": 12.5, "first_content": True})
    await _until(lambda: heard == [("1", 12.5)], "attempt 1's word")
    off1()
    await _put(store, _key(store, "src", "proc_a", "req_a", "att_1"), {"at": 13.0})
    await _put(store, _key(store, "src", "proc_a", "req_a", "att_2"), {"first_content": True})
    # One stream, in revision order: attempt 2's word came after attempt 1's second put.
    await _until(lambda: heard == [("1", 12.5), ("2", 0.0)], "attempt 2's word, no time")
    off2()


async def test_the_cancel_is_a_key_the_agent_reads(store: Env) -> None:
    await store.store.put_cancel("req_a", "att_1", {"at": 5.0, "processor": "proc_a"})
    res = await store.raw.kv.txn(Txn(success=[Get(_key(store, "cancel", "req_a", "att_1"))]))
    (kv,) = res.reads[0]
    assert json.loads(kv.value) == {"at": 5.0, "processor": "proc_a"}
    assert kv.lease != 0  # it goes by itself


async def test_the_acknowledgement_is_heard_once_whether_before_or_after_the_watch(
        store: Env) -> None:
    s, tap = store.store, _tap(store)
    got: list[dict[str, Any]] = []
    key = _key(store, "ack", "req_a", "att_1")
    off = s.on_ack("req_a", "att_1", got.append)
    # Heard by the watch, not by the read once it is up: the stream is up before the put.
    await tap.until(lambda: tap.up.get(key, False), "the ack watch's stream")
    await _put(store, _key(store, "ack", "req_a", "att_1x"), {"other": True})  # not its key
    await _put(store, key, ACK)
    await _until(lambda: got == [ACK], "the acknowledgement")
    again = {**ACK, "again": True}
    await _put(store, key, again)
    await tap.until(lambda: tap.delivered(key, key, json.dumps(again).encode()),
                    "the second put, delivered to the ack watch")
    assert got == [ACK]
    off()
    # Written before anyone listened: read once the watch is up.
    await _put(store, _key(store, "ack", "req_a", "att_2"), {"raw": "not json?"})
    early: list[dict[str, Any]] = []
    off = s.on_ack("req_a", "att_2", early.append)
    await _until(lambda: early == [{"raw": "not json?"}], "the earlier acknowledgement")
    off()


async def test_the_acknowledgement_ends_a_fenced_marker_and_a_retry_runs_at_once(
        store: Env) -> None:
    s, tap = store.store, _tap(store)
    await _open(store)
    await s.end_attempt("req_a", 1, "att_1", _rec(1, "att_1", fence="expiry"), expire=True)
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "fenced:att_1"
    live, since = store.raw.live_prefix + b"req_a", len(tap.txns)
    task = asyncio.create_task(s.admit_attempt("req_a", 2, "att_2", _rec(2, "att_2"), 6.0))
    # The admission looked and found the marker: from then on it waits for it to go.
    await tap.until(lambda: any(not res.succeeded and any(
        kv.key == live and kv.value == b"fenced:att_1" for r in res.reads for kv in r)
        for _, res in tap.txns[since:]), "the admission's refused look")
    assert not task.done()
    await s.revoke_fenced("req_a", 1, "att_1", _rec(1, "att_1", fence="revoked",
                                                    cancel_ack=ACK))
    res = await _within(task, 3.0)
    assert res.admitted and res.waited_s < 1.5  # not the marker's 2 s lease
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_2"
    assert view.attempts[0] == _rec(1, "att_1", fence="revoked", cancel_ack=ACK)
    # A late acknowledgement never touches another attempt's `live`: its record only.
    await s.revoke_fenced("req_a", 1, "att_1", _rec(1, "att_1", late=True))
    view = await s.get("req_a")
    assert view is not None and view.live_attempt_id == "att_2"
    assert view.attempts[0] == _rec(1, "att_1", late=True)


# --- the gate's session with an agent-fronted replica --------------------------------------

FP = {"weights_revision": "w@1"}


def _agent_proc(timers: FakeTimers, agent: bool = True) -> tuple[Any, MemoryStore]:
    rep: dict[str, Any] = {"address": REPLICA, "fingerprint": FP}
    if agent:
        rep["agent"] = {"version": 1}
    return proc({"pool": {"replicas": [rep]},
                 "timeouts": {"first_delta_s": 30, "soft_first_delta_s": 0,
                              "access_log_wait_s": 0.05, "source_grace_s": 0.5}}, timers)


async def _until_state(s: GateSession, state: str) -> None:
    for _ in range(5000):  # turns of the loop, not time: the memory store answers at once
        if s.m is not None and str(s.m.state) == state:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"the gate never reached {state}: {s.m.state if s.m else None}")


async def _path_lost(timers: FakeTimers) -> tuple[Any, MemoryStore, Any, GateSession,
                                                   asyncio.Task[None]]:
    """Headers and the role event held; the agent's word; the grace runs out."""
    p, store = _agent_proc(timers)
    await open_request(store, p)
    ctx, s, task = start(GateSession, p)
    ctx.send(gate_headers(1, p.clock.wall()))
    (r,) = await ctx.wait_for(1)
    assert set_headers(r, "request_headers")[H.PROCESSOR] == "proc_test"
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
    ctx.send(resp_body(SSE_ROLE))
    await _until_state(s, "gate_holding")
    await idle()
    await store.kv.txn(Txn(success=[Put(
        store.prefix + f"/src/proc_test/{RID}/att_pre".encode(),
        json.dumps({"at": p.clock.wall(), "first_content": True}).encode())]))
    await idle()
    assert timers.advance(0.49) == 0
    await idle()
    assert len(ctx.out) == 1
    assert timers.advance(0.01) == 1
    out = await ctx.wait_for(3)
    assert set_headers(out[1], "response_headers")[":status"] == "503"
    body = json.loads(out[2].response_body.response.body_mutation.body)
    assert body["error"]["code"] == "upstream_unavailable"
    assert "source_grace_s" in body["error"]["message"]
    await idle()
    res = await store.kv.txn(Txn(success=[Get(
        store.prefix + f"/cancel/{RID}/att_pre".encode())]))
    assert json.loads(res.reads[0][0].value)["processor"] == "proc_test"
    return p, store, ctx, s, task


async def test_a_lost_path_fails_in_the_grace_and_the_ack_lets_the_retry_run() -> None:
    timers = FakeTimers(FakeClock())
    p, store, ctx, s, task = await _path_lost(timers)
    ctx.close()
    await asyncio.wait_for(task, 3)
    await _until_state(s, "gate_awaiting_word")
    assert timers.advance(0.05) == 1  # access_log_wait_s: no word from Envoy here
    await _until_state(s, "gate_awaiting_ack")  # fenced
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id == "fenced:att_pre"
    await store.kv.txn(Txn(success=[Put(store.prefix + f"/ack/{RID}/att_pre".encode(),
                                        json.dumps(ACK).encode())]))
    await _until_state(s, "gate_closed")
    await p.drain()
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id is None
    (att,) = view.attempts
    assert (att["failure_class"], att["fence"], att["path_lost"], att["cancel_sent"],
            att["cancel_ack"]) == ("network_uncertain", "revoked", True, True, ACK)
    assert "lease_expires_by" not in att


async def test_no_acknowledgement_within_the_lease_leaves_the_expiry() -> None:
    timers = FakeTimers(FakeClock())
    p, store, ctx, s, task = await _path_lost(timers)
    ctx.close()
    await asyncio.wait_for(task, 3)
    await _until_state(s, "gate_awaiting_word")
    assert timers.advance(0.05) == 1  # access_log_wait_s: no word from Envoy here
    await _until_state(s, "gate_awaiting_ack")
    assert timers.advance(9.9) == 0
    await idle()
    assert s.m is not None and str(s.m.state) == "gate_awaiting_ack"
    assert timers.advance(0.1) == 1
    await _until_state(s, "gate_closed")
    await p.drain()
    view = await store.get(RID)
    assert view is not None and view.live_attempt_id == "fenced:att_pre"
    (att,) = view.attempts
    assert (att["fence"], att["path_lost"]) == ("expiry", True)
    assert "cancel_ack" not in att and "engine_ack" not in att


async def test_without_an_agent_nothing_of_it_runs() -> None:
    timers = FakeTimers(FakeClock())
    p, store = _agent_proc(timers, agent=False)
    await open_request(store, p)
    ctx, _s, task = start(GateSession, p)
    ctx.send(gate_headers(1, p.clock.wall()))
    (r,) = await ctx.wait_for(1)
    assert H.PROCESSOR not in set_headers(r, "request_headers")
    ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream"}))
    ctx.send(resp_body(SSE_ROLE + SSE_CONTENT))
    await ctx.wait_for(3)
    assert store._stop_src is None  # no source watch at all
    ctx.close()
    await asyncio.wait_for(task, 3)
    await p.drain()

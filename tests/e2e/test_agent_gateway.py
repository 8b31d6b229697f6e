"""The gateway's side of the replica agent (decision 0034), end to end.

Real Envoy, etcd, demo replicas and the processor; a partition proxy between Envoy and each
replica (devkit.demo.partition_proxy). The pool names both proxies with an agent in front
(`agent: {version: 1}`), and the test plays the agent itself: it writes the attempt's
`src/<processor>/<rid>/<aid>` key when the replica's first content went into the cut, and
the `ack/<rid>/<aid>` key once the gateway put the cancel (the real agent comes later).

- Path lost before the first delta: with the agent's word, the gate fails the attempt
  `source_grace_s` after it and Envoy retries on the other replica at once; without it, the
  first-delta limit does (`first_delta_s`). Both times to the first token are measured.
- No word from Envoy (its per-attempt access log, the router's `upstream_log`, taken out of
  this stack's Envoy config: what a lost access-log stream looks like to the gate): the
  attempt is fenced until its lease expires, unless the agent acknowledges the cancel; the
  acknowledgement lets the retry run long before the lease's TTL.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from devkit import devstack
from devkit.devstack import Stack, free_port

from .conftest import Gateway, Result, parse_events

pytestmark = pytest.mark.e2e

TTL = 3
FIRST_DELTA_S = 4.0
GRACE_S = 0.5
NOWORD_FIRST_S = TTL + 3.0
MAX = 8
FP = {"weights_revision": "demo@1"}
CONFIG: dict[str, Any] = {
    "etcd": {"attempt_lease_ttl_s": TTL, "session_ttl_s": 10},
    "timeouts": {"first_delta_s": FIRST_DELTA_S, "soft_first_delta_s": 0.5,
                 "stall_after_first_delta_s": 2.0, "access_log_wait_s": 0.5,
                 "fence_wait_s": TTL + 1.0, "source_grace_s": GRACE_S},
    "policy": {"retry_budget": {"min_retry_concurrency": 100000}},
}
CUT = {"x-partition": "after-deltas:0", "x-partition-attempt": "1",
       "x-replica-fault": "slow-first-delta:0.3"}
EVIDENCE = {"at": 0.0, "evidence": "test agent: engine idle", "abort_ms": 12.0,
            "why": "cancel"}


def _without_upstream_log(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_upstream_log(v) for k, v in node.items() if k != "upstream_log"}
    if isinstance(node, list):
        return [_without_upstream_log(v) for v in node]
    return node


class AgentStack(Stack):
    """Partition proxies on ports chosen before the processor starts (`proxy_ports`), so
    its static pool can name them (Envoy dials the proxies: `upstream.address` is a
    proxy's); with `no_word`, Envoy sends no per-attempt access-log entry."""

    no_word: bool = False

    def _start_envoy(self) -> None:
        if not self.no_word:
            super()._start_envoy()
            return
        render = devstack.render
        with mock.patch.object(devstack, "render",
                               lambda *a, **kw: _without_upstream_log(render(*a, **kw))):
            super()._start_envoy()


def _stack(wd: Path, timeouts: dict[str, Any], no_word: bool = False) -> AgentStack:
    preset = [free_port(), free_port()]
    cfg = {**CONFIG, "timeouts": {**CONFIG["timeouts"], **timeouts},
           "pool": {"replicas": [{"address": f"127.0.0.1:{p}", "fingerprint": FP,
                                  "agent": {"version": 1}} for p in preset]}}
    st = AgentStack(workdir=wd, config=cfg, replicas=2, partition_proxies=True)
    # Reserved before the start: the devstack keeps ports it is given.
    st.proxy_ports, st.no_word = preset, no_word
    return st.start()  # type: ignore[return-value]


class FakeAgent:
    """What the replica's agent writes into etcd, played by the test (etcdctl)."""

    def __init__(self, st: Stack) -> None:
        assert st.cfg is not None
        self.ctl = str(Path(sys.executable).parent / "etcdctl")
        self.endpoint = st.etcd_endpoint
        self.prefix = st.cfg.etcd.prefix
        self.st = st

    def _run(self, *args: str) -> str:
        return subprocess.run([self.ctl, "--endpoints", self.endpoint, *args], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()

    def get(self, key: str) -> str | None:
        return self._run("get", self.prefix + key, "--print-value-only") or None

    def put(self, key: str, value: dict[str, Any]) -> None:
        self._run("put", self.prefix + key, json.dumps(value))

    def processor(self) -> str:
        """The processor's instance id, as its start-up line says."""
        for line in self.st.procs["processor"].log_path.read_text().splitlines():
            if '"processor listening"' in line:
                return str(json.loads(line)["instance_id"])
        raise AssertionError("the processor logged no instance id")


def _rid_of_cut_attempt(g: Gateway, since: float, s: float = 5.0) -> str:
    """The request the partitioned replica served (it logs when it wrote its last token
    into the cut: its first content left it before that)."""
    deadline = time.monotonic() + s
    while True:
        rows = [r for r in g.stack.all_replica_logs() if r["ts"] >= since
                and r["fault"] == CUT["x-replica-fault"]]
        if rows:
            return str(rows[0]["request_id"])
        assert time.monotonic() < deadline, "the partitioned replica logged nothing"
        time.sleep(0.02)


def _until(get: Any, what: str, s: float) -> Any:
    deadline = time.monotonic() + s
    while True:
        v = get()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _post_timed(g: Gateway, headers: dict[str, str]) -> tuple[Result, float]:
    """The client's request, and the time from its start to the first content delta."""
    t0 = time.monotonic()
    first: float | None = None
    raw = b""
    with g.client.stream("POST", "/v1/chat/completions", json=g.body(max_tokens=MAX),
                         headers=headers) as r:
        status, hdrs = r.status_code, dict(r.headers)
        for chunk in r.iter_raw():
            raw += chunk
            if first is None and b'"content":"' in raw.replace(b'"content":""', b""):
                first = time.monotonic() - t0
    res = Result(status=status, headers=hdrs, raw=raw, transport_error=None)
    res.events = parse_events(raw)
    assert first is not None, raw
    return res, first


def _ref(g: Gateway) -> Result:
    r = g.post(g.body(max_tokens=MAX))
    assert r.status == 200 and r.transport_error is None
    return r


@contextlib.contextmanager
def _serving(st: Stack) -> Iterator[Gateway]:
    """A started stack's client, both closed and stopped after the module."""
    g = Gateway(st)
    try:
        yield g
    finally:
        g.client.close()
        st.stop()


# --- path lost: the agent's word and the grace ----------------------------------------------


@pytest.fixture(scope="module")
def agw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    st = _stack(tmp_path_factory.mktemp("agent-gw"), {})
    with _serving(st) as g:
        yield g


def test_a_path_lost_before_the_first_delta_costs_the_grace_not_the_first_delta_limit(
        agw: Gateway) -> None:
    g = agw
    g.stack.wait_replicas_healthy()
    agent = FakeAgent(g.stack)
    proc = agent.processor()
    reference = _ref(g)
    # The agent's word: the first content left the replica (into the cut) at once.
    since = time.time()
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _post_timed(g, CUT)))
    t.start()
    rid = _rid_of_cut_attempt(g, since)
    aid = _until(lambda: agent.get(f"/live/{rid}"), "attempt 1's live key", 3.0)
    agent.put(f"/src/{proc}/{rid}/{aid}", {"at": time.time(), "first_content": True})
    t.join(20)
    res, ttft = box["r"]
    assert res.status == 200 and res.normalized() == reference.normalized()
    j = g.journal(res.request_id)
    a1, a2 = j["attempts"]
    assert (a1["attempt_id"], a1["released"], a1["path_lost"], a1["cancel_sent"]) == (
        aid, False, True, True)
    assert a1["failure_class"] == "network_uncertain"
    assert a1["fence"] == "revoked" and a1["envoy_closed"] is True  # Envoy's word came
    assert a2["replica"] != a1["replica"] and a2["waited_for_previous_s"] < 1.0
    assert (j["outcome"], j["delivered_output_tokens"]) == ("completed", MAX)
    # The gateway asked the agent to stop the attempt at the engine.
    assert json.loads(agent.get(f"/cancel/{rid}/{aid}") or "{}")["processor"] == proc
    # Typically 0.5-0.7 s; the bound leaves room for a loaded machine and still sits half
    # the first-delta limit below the time the same cut takes without the word.
    assert ttft < FIRST_DELTA_S / 2, ttft
    print(f"\nTTFT with the agent's word: {ttft:.3f} s (source_grace_s {GRACE_S})")

    # The same cut without the agent's word: the first-delta limit fails it over.
    res2, ttft2 = _post_timed(g, CUT)
    assert res2.status == 200 and res2.normalized() == reference.normalized()
    j2 = g.journal(res2.request_id)
    b1, _b2 = j2["attempts"]
    assert "path_lost" not in b1 and b1["failure_class"] == "network_uncertain"
    assert FIRST_DELTA_S <= ttft2 < FIRST_DELTA_S + 1.5, ttft2
    print(f"TTFT without it: {ttft2:.3f} s (first_delta_s {FIRST_DELTA_S})")


# --- no word from Envoy: the agent's acknowledgement or the lease ----------------------------


@pytest.fixture(scope="module")
def noword_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # Envoy says nothing of its attempts: every uncertain end is "no word". A retry's wait
    # for the old lease comes out of its own first-delta time: that must outlast the lease.
    st = _stack(tmp_path_factory.mktemp("agent-noword"), {"first_delta_s": NOWORD_FIRST_S},
                no_word=True)
    with _serving(st) as g:
        yield g


def test_with_no_word_the_acknowledgement_lets_the_retry_run_before_the_lease_ttl(
        noword_gw: Gateway) -> None:
    g = noword_gw
    g.stack.wait_replicas_healthy()
    agent = FakeAgent(g.stack)
    reference = _ref(g)
    since = time.time()
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", _post_timed(g, CUT)))
    t.start()
    rid = _rid_of_cut_attempt(g, since)
    aid = _until(lambda: agent.get(f"/live/{rid}"), "attempt 1's live key", 3.0)
    # No agent's word: the first-delta limit fails it; the gateway puts the cancel, and
    # the agent acknowledges once the engine let go.
    _until(lambda: agent.get(f"/cancel/{rid}/{aid}"), "the cancel", NOWORD_FIRST_S + 3.0)
    acked = time.monotonic()
    agent.put(f"/ack/{rid}/{aid}", EVIDENCE)
    t.join(30)
    res, ttft = box["r"]
    assert res.status == 200 and res.normalized() == reference.normalized()
    j = g.journal(res.request_id, settle_s=5.0)
    a1, a2 = j["attempts"]
    assert a1["attempt_id"] == aid and a1["envoy_closed"] is False
    assert (a1["failure_class"], a1["fence"], a1["cancel_ack"]) == (
        "network_uncertain", "revoked", EVIDENCE)
    assert a2["waited_for_previous_s"] < TTL / 2, a2
    assert time.monotonic() - acked < TTL
    print(f"\nno word, acknowledged: TTFT {ttft:.3f} s, attempt 2 waited "
          f"{a2['waited_for_previous_s']:.3f} s for attempt 1's fence (lease TTL {TTL} s)")


def test_with_no_word_and_no_acknowledgement_the_retry_waits_for_the_lease(
        noword_gw: Gateway) -> None:
    g = noword_gw
    g.stack.wait_replicas_healthy()
    reference = _ref(g)
    res, ttft = _post_timed(g, CUT)
    assert res.status == 200 and res.normalized() == reference.normalized()
    j = g.journal(res.request_id, settle_s=5.0)
    a1, a2 = j["attempts"]
    assert (a1["fence"], a1["cancel_sent"]) == ("expiry", True)
    assert "cancel_ack" not in a1
    assert a2["waited_for_previous_s"] >= TTL * 2 / 3 - 0.5
    print(f"\nno word, no acknowledgement: TTFT {ttft:.3f} s, attempt 2 waited "
          f"{a2['waited_for_previous_s']:.3f} s")


# --- the real agent: its word, the gate's grace, its acknowledgement --------------------------


@pytest.fixture(scope="module")
def real_agw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # `extproc agent` in front of each demo replica, a partition proxy between Envoy and
    # each agent; the agents register their replicas (with `agent: {version: 1}`), so the
    # gate knows them as agent-fronted and sends them its instance id.
    st = Stack(workdir=tmp_path_factory.mktemp("agent-real"), config=CONFIG, replicas=2,
               partition_proxies=True, agents=True, registry=True).start()
    with _serving(st) as g:
        yield g


def test_the_real_agents_word_fails_a_lost_path_in_the_grace_and_it_acknowledges(
        real_agw: Gateway) -> None:
    g = real_agw
    g.stack.wait_replicas_healthy()
    etcd = FakeAgent(g.stack)  # only its etcdctl reads here: the agent is real
    proc = etcd.processor()
    reference = _ref(g)
    since = time.time()
    res, ttft = _post_timed(g, CUT)
    assert res.status == 200 and res.normalized() == reference.normalized()
    rid = _rid_of_cut_attempt(g, since)
    assert rid == res.request_id
    j = g.journal(res.request_id)
    a1, a2 = j["attempts"]
    aid = a1["attempt_id"]
    # The agent's own word reached this processor's watch, and the gate failed the attempt
    # within the grace, not the first-delta limit.
    note = json.loads(_until(lambda: etcd.get(f"/src/{proc}/{rid}/{aid}"), "the word", 3.0))
    assert note["first_content"] is True
    assert (a1["path_lost"], a1["cancel_sent"], a1["failure_class"]) == (
        True, True, "network_uncertain")
    assert a2["replica"] != a1["replica"]
    assert (j["outcome"], j["attempt"], j["delivered_output_tokens"]) == ("completed", 2, MAX)
    # Typically 0.5-0.7 s; the bound leaves room for a loaded machine and still sits half
    # the first-delta limit below the time the same cut takes without the word.
    assert ttft < FIRST_DELTA_S / 2, ttft
    # The agent stopped attempt 1 at its engine and said so, with the engine's evidence.
    ack = json.loads(_until(lambda: etcd.get(f"/ack/{rid}/{aid}"), "the agent's ack", 10.0))
    assert ack["why"] in ("cancel", "fenced") and ack["evidence"], ack
    print(f"\nTTFT with the real agent: {ttft:.3f} s; ack {ack}")


def test_the_real_agent_aborts_an_engine_still_busy_with_a_lost_attempt(
        real_agw: Gateway) -> None:
    g = real_agw
    g.stack.wait_replicas_healthy()
    etcd = FakeAgent(g.stack)
    reference = _ref(g)
    # Attempt 1's engine sends two deltas into the cut, then keeps the request open: the
    # agent must stop it at the engine once the gateway moved on, and say so.
    busy = {"x-partition": "after-deltas:0", "x-partition-attempt": "1",
            "x-replica-fault": "stall-after-deltas:2", "x-replica-fault-attempt": "1"}
    res, ttft = _post_timed(g, busy)
    assert res.status == 200 and res.normalized() == reference.normalized()
    j = g.journal(res.request_id)
    a1, a2 = j["attempts"]
    rid, aid = res.request_id, a1["attempt_id"]
    assert (a1["path_lost"], a2["replica"] != a1["replica"], j["outcome"]) == (
        True, True, "completed")
    # Typically 0.5-0.7 s; the bound leaves room for a loaded machine and still sits half
    # the first-delta limit below the time the same cut takes without the word.
    assert ttft < FIRST_DELTA_S / 2, ttft
    ack = json.loads(_until(lambda: etcd.get(f"/ack/{rid}/{aid}"), "the agent's ack", 10.0))
    # The demo engine's own gauge: it holds no more than the agent still forwards.
    assert ack["why"] in ("cancel", "fenced") and "demo_requests_running" in ack["evidence"]
    rows = [r for r in g.stack.all_replica_logs() if r["request_id"] == rid
            and r["attempt"] == 1]
    assert [r["outcome"] for r in rows] == ["stalled_peer_closed"], rows
    print(f"\nbusy engine: TTFT {ttft:.3f} s; ack {ack}")

"""The replica agent (`extproc agent --engine-kind vllm`, issue 26, decision 0033) in front of
each real vLLM replica, each case next to the same case without it.

Two stacks in one run: `vstack` (Envoy -> partition proxy -> vLLM, as test_01..03) and
`astack` (Envoy -> partition proxy -> agent -> vLLM, vLLM on its own loopback port). The
figures land in MEASURED["agent"][case] = {"with_agent": ..., "without_agent": ...}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from devkit.devstack import Stack, _bin
from extproc.adapters.agent import DEFAULT_METRICS, metric_sum
from extproc.core.config import TimeoutsConfig

from .conftest import (
    MEASURED,
    Client,
    Engines,
    Result,
    assert_same_stream,
    engine_tokens,
    group_pids,
    long_prompt,
    new_xrid,
)

VLLM_HELD = DEFAULT_METRICS["vllm"]  # what the agent sums as "still held by the engine"
CONTENT = re.compile(rb'"content":"[^"]')


def figure(case: str, side: str, value: dict[str, Any]) -> None:
    MEASURED.setdefault("agent", {}).setdefault(case, {})[side] = value


def acks(st: Stack) -> dict[str, dict[str, Any]]:
    """Every acknowledgement in etcd (`<prefix>/ack/<rid>/<aid>` -> its JSON value)."""
    assert st.cfg is not None
    prefix = st.cfg.etcd.prefix + "/ack/"
    out = subprocess.run([_bin("etcdctl"), "--endpoints", st.etcd_endpoint, "get", "--prefix",
                          prefix], capture_output=True, text=True, timeout=10, check=True)
    lines = out.stdout.splitlines()
    return {k[len(prefix):]: json.loads(v) for k, v in zip(lines[::2], lines[1::2], strict=True)}


def agent_counter(st: Stack, name: str, sample: str) -> float:
    return st.agent_metrics(f"agent-{name}").get(sample, 0.0)


def wait_engine_idle(e: Engines, name: str, since: float, bound_s: float = 15.0) -> float:
    """Seconds from `since` until vLLM's own running + waiting gauges read 0 (polled)."""
    deadline = time.monotonic() + bound_s
    while e.held(name) > 0:
        assert time.monotonic() < deadline, f"{name} still holds a request after {bound_s}s"
        time.sleep(0.005)
    return time.monotonic() - since


def group_cpu_s(e: Engines, name: str) -> float:
    """CPU seconds used so far by a replica's whole process group (API server, EngineCore,
    Worker, tracker): the engine's own work, seen from outside."""
    p = e.proc(name)
    assert p.popen is not None
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in group_pids(p.popen.pid):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text()
            f = stat[stat.rindex(")") + 2:].split()
            total += int(f[11]) + int(f[12])  # utime + stime
    return total / tick


def wait_engine_quiet(e: Engines, name: str, since: float, bound_s: float = 20.0) -> float:
    """Seconds from `since` until the replica's process group stops computing: the start
    of the first 3 x 100 ms windows in a row in which it used under 15 ms of CPU each (a
    prefill step uses ~100 % of a core; 3 in a row, as a busy machine may starve it for one)."""
    deadline = time.monotonic() + bound_s
    prev, t_prev = group_cpu_s(e, name), time.monotonic()
    quiet_from: float | None = None
    quiet = 0
    while True:
        assert time.monotonic() < deadline, f"{name} still computing after {bound_s}s"
        time.sleep(0.1)
        now, t_now = group_cpu_s(e, name), time.monotonic()
        if now - prev < 0.015:
            quiet_from = t_prev if quiet == 0 else quiet_from
            quiet += 1
            if quiet == 3:
                assert quiet_from is not None
                return quiet_from - since
        else:
            quiet = 0
        prev, t_prev = now, t_now


def probe_after(e: Engines, name: str, since: float) -> float:
    """Seconds from `since` until a 1-token request sent straight to vLLM right now is
    answered: it cannot be scheduled before the engine step in flight (the aborted
    prefill) ends, so this is the engine's own word on when it let go."""
    c = Client(e.url(name))
    try:
        r = c.post(Client.body(max_tokens=1, prompt="hi", stream=False))
    finally:
        c.close()
    assert r.status == 200
    return r.t_end - since


def replica_of(stack: Stack, attempt: dict[str, Any]) -> str:
    port = int(attempt["replica"].rpartition(":")[2])
    return f"r{stack.front_ports().index(port) + 1}"


# --- the engine's metrics are what the agent reads --------------------------------------


def test_vllm_metrics_carry_the_names_the_agent_sums(agw: Client, aengines: Engines) -> None:
    """vLLM 0.32's /metrics has `vllm:num_requests_running` and `..._waiting` (with labels):
    0 when idle, >= 1 while a stream runs; the agent's parser reads the same numbers."""
    def text(name: str) -> str:
        with urllib.request.urlopen(aengines.url(name) + "/metrics", timeout=5) as r:
            return str(r.read().decode())

    for name in aengines.names:
        t = text(name)
        for metric in VLLM_HELD:
            assert re.search(rf"^{re.escape(metric)}\{{[^}}]*\}} ", t, re.M), metric
        assert metric_sum(t, VLLM_HELD) == 0.0
    seen: dict[str, float] = {}
    xrid = new_xrid()

    def look(n: int, ev: object) -> str | None:
        if n == 2 and "held" not in seen:
            name = aengines.who_received(xrid)[0]
            seen["held"] = metric_sum(text(name), VLLM_HELD) or 0.0
            seen["gauge"] = aengines.held(name)
        return None

    res = agw.post(Client.body(max_tokens=32), on_event=look, xrid=xrid)
    assert res.status == 200 and res.transport_error is None and res.events[-1] == "[DONE]"
    assert seen["held"] == seen["gauge"] == 1.0
    name = aengines.who_received(xrid)[0]
    wait_engine_idle(aengines, name, time.monotonic(), 5.0)
    assert metric_sum(text(name), VLLM_HELD) == 0.0


# --- a) the engine SIGKILLed after 2 deltas, the agent alive ----------------------------


def kill_after(c: Client, e: Engines, after: int, max_tokens: int) -> tuple[Result, str, float]:
    """Stream; right after the client read its `after`-th content delta, SIGKILL the whole
    process group of the vLLM that runs it (API server, EngineCore, Worker, tracker)."""
    xrid = new_xrid()
    box: dict[str, Any] = {}

    def cb(n: int, ev: object) -> str | None:
        if n == after and "name" not in box:
            box["name"] = e.who_received(xrid)[0]
            box["t"] = e.kill(box["name"], signal.SIGKILL)
        return None

    res = c.post(Client.body(max_tokens=max_tokens), on_event=cb, xrid=xrid)
    return res, str(box["name"]), float(box["t"])


def test_engine_killed_after_two_deltas_ends_in_band_with_the_agent(
        agw: Client, aengines: Engines, astack: Stack) -> None:
    ref = agw.post(Client.body(max_tokens=64))
    assert ref.status == 200 and ref.transport_error is None and ref.events[-1] == "[DONE]"
    before = {n: agent_counter(astack, n, "extproc_agent_engine_deaths_in_band_total")
              for n in aengines.names}
    res, killed, t_kill = kill_after(agw, aengines, 2, 64)
    other = next(n for n in aengines.names if n != killed)
    # Not a cut: the exact prefix the client had, then our terminal event and [DONE].
    assert res.status == 200 and res.transport_error is None, res.transport_error
    got = len(res.contents)
    assert got >= 2 and ref.text.startswith(res.text) and len(res.text) < len(ref.text)
    if res.contents == ref.contents[:got]:  # else vLLM coalesced tokens under load
        assert res.normalized()[:got + 1] == ref.normalized()[:got + 1]  # role + deltas
    err = res.error
    assert err is not None and err["code"] == "upstream_decode_interrupted", res.events[-3:]
    assert err["partial_output"] is True and err["retryable"] is False
    assert err["request_id"] == res.request_id
    assert res.events[-1] == "[DONE]" and res.events.count("[DONE]") == 1
    assert b"engine_interrupted" not in res.raw  # the agent's event is replaced by ours
    n = err["delivered_output_tokens"]
    assert err["delivered_output_tokens_exact"] is True
    assert n in engine_tokens(Client(aengines.url(other)), Client.body(max_tokens=64),
                              res.text, lo=got)
    j = agw.journal(res.request_id)
    assert (j["outcome"], j["delivered_output_tokens"]) == ("upstream_decode_interrupted", n)
    assert j["cause"] == "in-band error", j
    assert j["attempt"] == 1 and len(j["attempts"]) == 1
    assert j["error"]["code"] == "upstream_decode_interrupted"
    # The agent lived, counted one death ended in-band; nothing ran elsewhere.
    assert astack.procs[f"agent-{killed}"].alive()
    assert not aengines.proc(killed).alive()
    after = agent_counter(astack, killed, "extproc_agent_engine_deaths_in_band_total")
    assert after == before[killed] + 1
    assert not aengines.received(other, res.xrid)
    figure("engine_sigkill_after_2_deltas", "with_agent", {
        "client_got": "prefix + upstream_decode_interrupted in-band + [DONE]",
        "content_events": got, "delivered_output_tokens": n,
        "journal": [j["outcome"], j["cause"]],
        "kill_to_stream_end_s": round(res.t_end - t_kill, 3)})


def test_engine_killed_after_two_deltas_is_a_cut_without_the_agent(
        gw: Client, engines: Engines) -> None:
    """The counterpart (test_03's case, at 2 deltas): a transport cut, no terminal event."""
    ref = gw.post(Client.body(max_tokens=64))
    res, _, t_kill = kill_after(gw, engines, 2, 64)
    assert res.status == 200 and res.transport_error is not None
    assert "[DONE]" not in res.events and res.error is None
    assert ref.text.startswith(res.text)
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["cause"]) == ("upstream_decode_interrupted", "upstream")
    figure("engine_sigkill_after_2_deltas", "without_agent", {
        "client_got": "prefix + transport cut (no terminal event, no [DONE])",
        "content_events": len(res.contents), "journal": [j["outcome"], j["cause"]],
        "kill_to_stream_end_s": round(res.t_end - t_kill, 3)})


# --- b) the client hangs up mid-decode --------------------------------------------------


def hang_up_mid_decode(c: Client, e: Engines, at: int = 3) -> tuple[Result, str, float, float]:
    closed: dict[str, float] = {}

    def hang_up(n: int, ev: object) -> str | None:
        if n >= at and "t" not in closed:
            closed["t"], closed["wall"] = time.monotonic(), time.time()
            return "close"
        return None

    res = c.post(Client.body(max_tokens=400), on_event=hang_up)
    assert res.status == 200 and res.transport_error == "client closed"
    got = e.who_received(res.xrid)
    assert len(got) == 1, got  # one attempt, one replica
    idle_s = wait_engine_idle(e, got[0], closed["t"])
    return res, got[0], idle_s, closed["wall"]


@pytest.mark.parametrize("agent", [True, False], ids=["with_agent", "without_agent"])
def test_client_disconnect_mid_decode(request: pytest.FixtureRequest, agent: bool) -> None:
    st: Stack = request.getfixturevalue("astack" if agent else "vstack")
    e: Engines = request.getfixturevalue("aengines" if agent else "engines")
    c: Client = request.getfixturevalue("agw" if agent else "gw")
    acked = acks(st) if agent else {}
    res, name, idle_s, wall = hang_up_mid_decode(c, e)
    # vLLM's own log: the request aborted (named by our x-request-id).
    deadline = time.monotonic() + 5
    while not e.aborted(name, res.xrid):
        assert time.monotonic() < deadline, e.lines(name, res.xrid)
        time.sleep(0.01)
    j = c.journal(res.request_id)
    assert (j["outcome"], j["cause"]) == ("client_disconnected", "client")
    assert len(j["attempts"]) == 1
    fig: dict[str, Any] = {"disconnect_to_engine_idle_s": round(idle_s, 3)}
    if agent:
        ack = wait_new_ack(st, acked)
        aid = j["attempts"][0]["attempt_id"]
        key, val = ack
        assert key == f"{res.request_id}/{aid}"
        # Envoy's close reaching the agent, or the gateway's release of live/<rid> heard
        # on the watch: whichever came first stopped it.
        assert val["why"] in ("downstream_gone", "fenced"), val
        assert val["evidence"].startswith(
            "vllm:num_requests_running+vllm:num_requests_waiting=0 <= 0"), val
        fig.update(disconnect_to_ack_written_s=round(val["at"] - wall, 3),
                   ack_abort_ms=val["abort_ms"], ack_why=val["why"],
                   ack_evidence=val["evidence"])
    figure("client_disconnect_mid_decode", "with_agent" if agent else "without_agent", fig)


def wait_new_ack(st: Stack, before: dict[str, Any],
                 bound_s: float = 8.0) -> tuple[str, dict[str, Any]]:
    """The one acknowledgement written since `before` was read."""
    deadline = time.monotonic() + bound_s
    while True:
        new = {k: v for k, v in acks(st).items() if k not in before}
        if new:
            assert len(new) == 1, new
            return next(iter(new.items()))
        assert time.monotonic() < deadline, "no acknowledgement written"
        time.sleep(0.05)


# --- c) the client hangs up mid-prefill (a prompt near --max-model-len) -----------------
#
# vLLM's running/waiting gauges move only when an engine step ends: during a one-step
# prefill they read 0 (measured: 0 throughout a 3-4 s prefill, and throughout an aborted
# one). So here the engine's own work is read from outside: its process group's CPU time.

PREFILL_WORDS = 1950  # ~1957 prompt tokens with the chat template; max-model-len 2048


def hang_up_in_prefill(port: int, e: Engines, delay_s: float) -> tuple[str, str, float, float]:
    """A raw client: send, wait until vLLM logs the request, `delay_s` more, hang up."""
    xrid = new_xrid()
    data = json.dumps(Client.body(max_tokens=16, prompt=long_prompt(PREFILL_WORDS))).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: "
                   f"application/json\r\nContent-Length: {len(data)}\r\nx-request-id: {xrid}"
                   f"\r\nIdempotency-Key: v-{xrid}\r\n\r\n").encode() + data)
        name = e.wait_received(xrid, timeout_s=15)
        c0 = group_cpu_s(e, name)
        time.sleep(delay_s)
        assert group_cpu_s(e, name) - c0 > delay_s / 3  # the engine computes: its prefill
        s.setblocking(False)
        got = b""
        with contextlib.suppress(BlockingIOError):
            got = s.recv(1 << 20)
        assert not CONTENT.search(got), got  # no content yet: the hang-up is in the prefill
        t, wall = time.monotonic(), time.time()
    finally:
        s.close()
    return xrid, name, t, wall


@pytest.mark.parametrize("agent", [True, False], ids=["with_agent", "without_agent"])
def test_client_disconnect_mid_prefill(request: pytest.FixtureRequest, agent: bool) -> None:
    """The abort reaches vLLM either way (its log says so), but the engine finishes the
    prefill step it is in: the time to quiet is the prefill's remainder, agent or not. The
    agent, stopped before the engine's first output, has no gauge evidence: no ack."""
    st: Stack = request.getfixturevalue("astack" if agent else "vstack")
    e: Engines = request.getfixturevalue("aengines" if agent else "engines")
    acked = acks(st) if agent else {}
    no_ev = {n: agent_counter(st, n, 'extproc_agent_no_evidence_total{why="fenced"}')
             + agent_counter(st, n, 'extproc_agent_no_evidence_total{why="downstream_gone"}')
             for n in e.names} if agent else {}
    delay = 0.5
    xrid, name, t_close, _ = hang_up_in_prefill(st.envoy_port, e, delay)
    probe_s = probe_after(e, name, t_close)
    deadline = time.monotonic() + 5
    while not e.aborted(name, xrid):
        assert time.monotonic() < deadline, e.lines(name, xrid)
        time.sleep(0.01)
    abort_logged_s = time.monotonic() - t_close
    quiet_s = wait_engine_quiet(e, name, t_close)
    assert e.who_received(xrid) == [name]
    assert e.held(name) == 0
    # The prefill's own length on that replica now: the same prompt straight to vLLM.
    own = Client(e.url(name))
    try:
        prefill = own.post(Client.body(max_tokens=1, prompt=long_prompt(PREFILL_WORDS)))
    finally:
        own.close()
    assert prefill.status == 200 and prefill.ttft_s is not None
    fig: dict[str, Any] = {"disconnect_to_engine_quiet_s": round(quiet_s, 3),
                           "disconnect_to_1_token_probe_answered_s": round(probe_s, 3),
                           "disconnect_to_abort_logged_s": round(abort_logged_s, 3),
                           "prefill_alone_s": round(prefill.ttft_s, 3),
                           "disconnect_after_received_s": delay}
    if agent:
        def counted() -> float:
            return (agent_counter(st, name, 'extproc_agent_no_evidence_total{why="fenced"}')
                    + agent_counter(st, name,
                                    'extproc_agent_no_evidence_total{why="downstream_gone"}'))
        deadline = time.monotonic() + 5
        while counted() < no_ev[name] + 1:
            assert time.monotonic() < deadline, "the agent did not give up the evidence"
            time.sleep(0.05)
        assert {k: v for k, v in acks(st).items() if k not in acked} == {}
        fig["ack"] = "none: stopped before the engine's first output (no gauge evidence)"
    figure("client_disconnect_mid_prefill", "with_agent" if agent else "without_agent", fig)


# --- d) a partition between Envoy and the agent before the first delta -----------------

GATE_SIDE = "source_grace_s" in {f.name for f in dataclasses.fields(TimeoutsConfig)}


@pytest.mark.skipif(not GATE_SIDE, reason="needs the gateway's side of the agent protocol "
                    "(timeouts.source_grace_s: the gate reads the agent's first-content notice, "
                    "cancels and waits for the ack), not merged yet")
@pytest.mark.parametrize("agent", [True, False], ids=["with_agent", "without_agent"])
def test_partition_before_first_delta(request: pytest.FixtureRequest, agent: bool) -> None:
    """Attempt 1 cut by the proxy after vLLM's headers and role event: with the agent, the
    gate learns content left (the agent's notice), cancels, and the agent aborts vLLM's
    request and acknowledges; without, the retry waits for the old lease."""
    st: Stack = request.getfixturevalue("astack" if agent else "vstack")
    e: Engines = request.getfixturevalue("aengines" if agent else "engines")
    c: Client = request.getfixturevalue("agw" if agent else "gw")
    acked = acks(st) if agent else {}
    ref = c.post(Client.body(max_tokens=16))
    res = c.post(Client.body(max_tokens=16),
                 headers={"x-partition": "after-deltas:0", "x-partition-attempt": "1"})
    assert res.status == 200 and res.transport_error is None
    assert_same_stream(res, ref)
    j = c.journal(res.request_id)
    assert j["outcome"] == "completed" and len(j["attempts"]) == 2, j
    a1, a2 = j["attempts"]
    cut, other = replica_of(st, a1), replica_of(st, a2)
    assert cut != other and a2["admitted_at"] >= a1["ended_at"]
    fig: dict[str, Any] = {"ttft_s": round(res.ttft_s or 0, 2),
                           "retry_waited_for_previous_s": a2.get("waited_for_previous_s")}
    if agent:
        # vLLM's own evidence: the first attempt's request aborted, nothing held.
        deadline = time.monotonic() + 5
        while not e.aborted(cut, res.xrid):
            assert time.monotonic() < deadline, e.lines(cut, res.xrid)
            time.sleep(0.01)
        assert e.held(cut) == 0
        acks_now = {k: v for k, v in acks(st).items() if k not in acked}
        ack = acks_now[f"{res.request_id}/{a1['attempt_id']}"]
        assert ack["why"] in ("cancel", "fenced"), ack
        fig.update(vllm_aborted_first_attempt=True, ack=ack)
    else:
        assert not e.aborted(cut, res.xrid)  # decoded on into the void
    figure("partition_before_first_delta", "with_agent" if agent else "without_agent", fig)

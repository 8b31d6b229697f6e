"""The client hangs up; the network between Envoy and a replica breaks. Nothing is killed.

The partition is real: a proxy between Envoy and each replica (devkit.demo.partition_proxy)
stops every byte in both directions and propagates no close, so vLLM keeps decoding into the
void (its log shows no abort) while Envoy hears nothing.
"""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

from devkit.devstack import Stack

from .conftest import MEASURED, Client, Engines, Result, assert_same_stream, engine_tokens

MAX = 16


def generated_tokens(engines: Engines, name: str) -> float:
    """vLLM's own counter of generated tokens on one replica (Prometheus /metrics)."""
    with urllib.request.urlopen(engines.url(name) + "/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for m in re.finditer(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M):
        total += float(m.group(1))
    return total


def replica_of(stack: Stack, attempt: dict[str, Any]) -> str:
    """The journal names an attempt's upstream address: here a partition proxy's."""
    port = int(attempt["replica"].rpartition(":")[2])
    ports = stack.proxy_ports or stack.replica_ports
    return f"r{ports.index(port) + 1}"


def test_client_disconnect_aborts_in_vllm_and_starts_nothing(gw: Client,
                                                             engines: Engines) -> None:
    before = {n: generated_tokens(engines, n) for n in engines.names}
    closed: dict[str, float] = {}

    def hang_up(n: int, ev: object) -> str | None:
        if n >= 3:
            closed["t"] = time.monotonic()
            return "close"
        return None

    res = gw.post(Client.body(max_tokens=400), on_event=hang_up)
    assert res.status == 200 and res.transport_error == "client closed"
    got = engines.who_received(res.xrid)
    assert len(got) == 1  # one attempt, on one replica
    name = got[0]
    deadline = time.monotonic() + 5
    while not engines.aborted(name, res.xrid):
        assert time.monotonic() < deadline, engines.lines(name, res.xrid)
        time.sleep(0.01)
    MEASURED["client_close_to_vllm_abort_log_s"] = round(time.monotonic() - closed["t"], 3)
    # vLLM logs both lines with --enable-log-requests, naming the request by our x-request-id.
    lines = engines.lines(name, res.xrid)
    assert any(f"Aborted request(s) chatcmpl-{res.xrid}" in ln for ln in lines), lines
    assert any(f"Request chatcmpl-{res.xrid} aborted" in ln for ln in lines), lines
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["cause"]) == ("client_disconnected", "client")
    assert j["first_delta_sent"] is True and j["delivered_output_tokens"] >= 3
    assert j["attempt"] == 1 and len(j["attempts"]) == 1
    time.sleep(0.5)
    after = {n: generated_tokens(engines, n) for n in engines.names}
    # The engine stopped generating: far fewer than the 400 tokens asked for.
    assert after[name] - before[name] < 200, (before, after)
    MEASURED["tokens_generated_after_disconnect_at_3_of_400"] = after[name] - before[name]
    assert engines.who_received(res.xrid) == [name]  # and nothing new ran elsewhere


def test_partition_before_first_delta_is_fenced_by_envoys_close(
        gw: Client, engines: Engines, vstack: Stack) -> None:
    ref = gw.post(Client.body(max_tokens=MAX))
    assert ref.status == 200 and ref.transport_error is None
    # Attempt 1's connection is cut after vLLM's headers and role-only event crossed, before
    # any content: the gate's first-delta limit fails the attempt over. The replica's
    # liveness is uncertain, but Envoy's own entry confirms it closed the attempt, so it is
    # revoked and the retry waits for no lease (docs/fencing.md, "Envoy closed it").
    res = gw.post(Client.body(max_tokens=MAX),
                  headers={"x-partition": "after-deltas:0", "x-partition-attempt": "1"})
    assert res.status == 200 and res.transport_error is None
    assert_same_stream(res, ref)  # one complete answer, once
    j = gw.journal(res.request_id)
    assert j["outcome"] == "completed" and j["delivered_output_tokens_exact"] is True
    assert j["delivered_output_tokens"] in engine_tokens(
        Client(engines.url(replica_of(vstack, j["attempts"][-1]))), Client.body(max_tokens=MAX),
        res.text, lo=len(res.contents))
    a1, a2 = j["attempts"]
    assert a1["failure_class"] == "network_uncertain" and a1["fence"] == "revoked"
    assert a1["envoy_closed"] is True and a1["released"] is False
    assert a2["waited_for_previous_s"] < 1.0
    assert a2["admitted_at"] >= a1["ended_at"]  # never two at once
    cut, other = replica_of(vstack, a1), replica_of(vstack, a2)
    assert cut != other
    # Both replicas ran the request; the partitioned one decoded to the end into the void
    # (no abort: no close crossed the partition).
    assert engines.received(cut, res.xrid) and engines.received(other, res.xrid)
    assert not engines.aborted(cut, res.xrid)
    cuts = [c for c in vstack.proxy_log() if c["request_id"] == res.request_id]
    assert len(cuts) == 1 and cuts[0]["forwarded_deltas"] == 0
    assert cuts[0]["dropped_replica_bytes"] > 0
    MEASURED["partition_before_first_delta_ttft_s"] = round(res.ttft_s or 0, 2)


def test_partition_after_first_delta_ends_with_the_error(gw: Client, engines: Engines,
                                                         vstack: Stack) -> None:
    ref = gw.post(Client.body(max_tokens=48))
    res: Result = gw.post(Client.body(max_tokens=48), headers={"x-partition": "after-deltas:2"})
    assert res.status == 200 and res.transport_error is None
    # Two content events, a prefix of the reference text: vLLM may merge tokens into one
    # event under CPU load (' firomromrom' for ' fi', 'rom', 'rom', 'rom'), so the events
    # need not be the reference's first two.
    assert len(res.contents) == 2 and ref.text.startswith(res.text)
    err = res.error
    assert err is not None and err["code"] == "upstream_decode_interrupted"
    # Two content events; the engine's count of the tokens in them (decision 0018).
    n = err["delivered_output_tokens"]
    assert n >= 2 and err["delivered_output_tokens_exact"] is True
    assert err["partial_output"] is True
    assert err["retryable"] is False and err["request_id"] == res.request_id
    assert res.events[-1] == "[DONE]"
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["cause"], j["delivered_output_tokens"]) == (
        "upstream_decode_interrupted", "stall", n)
    assert n in engine_tokens(Client(engines.url(replica_of(vstack, j["attempts"][0]))),
                              Client.body(max_tokens=48), res.text, lo=2)
    assert len(j["attempts"]) == 1  # no second run
    assert engines.who_received(res.xrid) == [replica_of(vstack, j["attempts"][0])]

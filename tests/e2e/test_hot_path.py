"""What keeps the processor cheap stays true (decision 0007): counted by Envoy and etcd.

Not timings (those are benchmarks, `make bench`): these count messages and round trips, which
do not depend on the machine's speed.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from devkit.devstack import Stack

from .conftest import Gateway


def envoy_stats(stack: Stack, prefix: str) -> dict[str, int]:
    url = f"http://127.0.0.1:{stack.admin_port}/stats?format=json&filter=ext_proc"
    with urllib.request.urlopen(url, timeout=5) as r:
        stats: list[dict[str, Any]] = json.loads(r.read())["stats"]
    return {s["name"][len(prefix):]: int(s.get("value", 0)) for s in stats
            if s["name"].startswith(prefix) and "value" in s}


GATE = "cluster.replicas.ext_proc."
GUARD = "http.ingress.ext_proc."


def test_the_gate_leaves_the_stream_after_the_first_delta(gw: Gateway) -> None:
    """30 tokens 20 ms apart: the guard sees every one, the gate only the first few."""
    st = gw.stack
    g0, d0 = envoy_stats(st, GATE), envoy_stats(st, GUARD)
    res = gw.post(gw.body(max_tokens=30), headers={"x-replica-token-delay-ms": "20"})
    assert res.status == 200 and len(res.contents) == 30 and res.events[-1] == "[DONE]"
    time.sleep(0.3)
    g1, d1 = envoy_stats(st, GATE), envoy_stats(st, GUARD)

    def delta(a: dict[str, int], b: dict[str, int], k: str) -> int:
        return b.get(k, 0) - a.get(k, 0)

    # The processor closed the gate's stream (hand-off): Envoy counts a server half-close.
    assert delta(g0, g1, "server_half_closed") == 1
    assert delta(g0, g1, "streams_started") == 1
    # Request headers, response headers and the body messages up to the first delta; not
    # one message per token.
    assert delta(g0, g1, "stream_msgs_sent") <= 6
    # The guard saw the whole stream (at least one body message per paced token).
    assert delta(d0, d1, "stream_msgs_sent") >= 30


def test_three_etcd_round_trips_per_successful_request(gw: Gateway) -> None:
    """Intake + admission of attempt 1, the first-delta fence, the finish: counted by etcd."""
    st = gw.stack
    for _ in range(2):  # warm: the process lease and the retention lease exist
        gw.post(gw.body(max_tokens=4))
    time.sleep(0.3)
    before = st.etcd_calls()
    n = 5
    t0 = time.monotonic()
    results = [gw.post(gw.body(max_tokens=4), key=None) for _ in range(n)]
    time.sleep(0.5)  # the last finish transaction lands
    after = st.etcd_calls()
    elapsed = time.monotonic() - t0
    calls = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    for r in results:  # (read after counting: a journal read is a Txn too)
        assert r.status == 200 and len(r.contents) == 4
        assert gw.journal(r.request_id)["outcome"] == "completed"
    # Every request: exactly 3 Txn; the retry-budget exchange adds one Txn a second.
    assert 3 * n <= calls.get("Txn", 0) <= 3 * n + int(elapsed) + 1, (calls, elapsed)
    for method in ("Put", "Range", "LeaseGrant", "LeaseRevoke", "DeleteRange"):
        assert calls.get(method, 0) == 0, calls

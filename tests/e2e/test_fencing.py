"""Fencing under a real partition, the four failure classes, and infrastructure failures.

The partition is made by a proxy the tests own between Envoy and each replica
(devkit.demo.partition_proxy): bytes stop in both directions and no close crosses, so the
replica keeps decoding while Envoy hears nothing. Lease TTLs are short here so the waits
that the policy demands are visible but quick.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devkit.devstack import Stack

from .conftest import Gateway, Result

pytestmark = pytest.mark.e2e

TTL = 3
CONFIG: dict[str, Any] = {
    # The session TTL stays well above the longest etcd freeze below (~2.5 s at the fence:
    # two etcd deadlines and a retry): a freeze longer than it makes a live processor's
    # requests look orphaned, and a reader may settle one first (docs/fencing.md, "residual
    # risk"). At 3 s that happened in about 1 run in 10.
    "etcd": {"attempt_lease_ttl_s": TTL, "session_ttl_s": 8},
    "timeouts": {"first_delta_s": 2.0, "soft_first_delta_s": 0.5,
                 "stall_after_first_delta_s": 1.0, "access_log_wait_s": 0.5,
                 "fence_wait_s": 3.5, "progress_interval_s": 0.2},
    "policy": {"retry_budget": {"min_retry_concurrency": 100000}},  # budgets: test_pool.py
}
MAX = 8


@pytest.fixture(scope="module")
def fstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    wd: Path = tmp_path_factory.mktemp("fencing")
    st = Stack(workdir=wd, config=CONFIG, replicas=2, partition_proxies=True).start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture
def fgw(fstack: Stack) -> Iterator[Gateway]:
    fstack.wait_replicas_healthy()
    g = Gateway(fstack)
    yield g
    g.client.close()


def ref(g: Gateway, **kw: Any) -> Result:
    r = g.post(g.body(max_tokens=MAX, **kw))
    assert r.status == 200 and r.transport_error is None
    return r


@pytest.mark.parametrize("cut", ["after-deltas:0", "after-request"])
def test_partition_before_first_delta_is_fenced_by_envoys_close(fgw: Gateway, cut: str) -> None:
    reference = ref(fgw)
    # Attempt 1's connection is cut before its first content delta: after the headers and
    # the role event crossed (the gate's first-delta limit fires), or right after the
    # request (nothing at all comes back; Envoy's per-try timeout is the backstop).
    t0 = time.monotonic()
    res = fgw.post(fgw.body(max_tokens=MAX),
                   headers={"x-partition": cut, "x-partition-attempt": "1",
                            "x-replica-fault": "slow-first-delta:0.3"})
    took = time.monotonic() - t0
    assert res.status == 200 and res.transport_error is None
    assert res.normalized() == reference.normalized()  # one complete answer, once
    rows = fgw.attempts_logged(res.request_id, settle_s=4.0)
    # The partitioned replica kept decoding and finished: every token it wrote after the
    # cut went nowhere (its peer never closed: the FIN was partitioned too).
    assert [r["attempt"] for r in rows] == [1, 2]
    assert rows[0]["outcome"] == "completed" and rows[0]["tokens_written"] == MAX
    assert rows[0]["peer_closed"] is False
    cuts = [c for c in fgw.stack.proxy_log() if c["request_id"] == res.request_id]
    assert len(cuts) == 1 and cuts[0]["mode"] == cut.split(":")[0]
    assert cuts[0]["forwarded_deltas"] == 0 and cuts[0]["dropped_replica_bytes"] > 0
    j = fgw.journal(res.request_id)
    a1, a2 = j["attempts"]
    assert a1["failure_class"] == "network_uncertain" and a1["released"] is False
    # The replica may still be decoding, but Envoy's own entry for the attempt says it tore
    # the upstream stream down: the gate, the attempt's only way to the client, is gone, so
    # it is revoked at once and the retry waits for no lease (docs/fencing.md).
    assert a1["fence"] == "revoked" and a1["envoy_closed"] is True
    # after the headers: our own first-delta limit; before them: Envoy's per-try timeout
    if cut == "after-request":
        assert a1["envoy_cause"] == "timeout"
    assert a2["waited_for_previous_s"] < 1.0
    # Never two at once: attempt 2 was admitted only after attempt 1's `live` was gone.
    assert a2["admitted_at"] >= a1["ended_at"]
    assert a2["replica"] != a1["replica"]
    assert took < 2.0 + 0.25 + 2.0  # first_delta_s + per-try margin + the answer
    assert (j["outcome"], j["delivered_output_tokens"]) == ("completed", MAX)


@pytest.fixture(scope="module")
def expiry_gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    # The conservative policy: Envoy's close is never taken for a cancel ack.
    # A retry's wait for the old lease comes out of its own first-delta time, so that time
    # must exceed the lease TTL (the config refuses less).
    cfg = {**CONFIG, "timeouts": {**CONFIG["timeouts"], "first_delta_s": TTL + 2.0},
           "policy": {**CONFIG["policy"], "on_upstream_failure": {
               "uncertain_source_liveness": {"wait_for": "lease_expiry"}}}}
    st = Stack(workdir=tmp_path_factory.mktemp("fencing-expiry"), config=cfg, replicas=2,
               partition_proxies=True).start()
    g = Gateway(st)
    try:
        yield g
    finally:
        g.client.close()
        st.stop()


def test_with_wait_for_lease_expiry_the_retry_waits_for_the_old_lease(
        expiry_gw: Gateway) -> None:
    g = expiry_gw
    g.stack.wait_replicas_healthy()
    reference = ref(g)
    res = g.post(g.body(max_tokens=MAX), headers={
        "x-partition": "after-deltas:0", "x-partition-attempt": "1",
        "x-replica-fault": "slow-first-delta:0.3"})
    assert res.status == 200 and res.normalized() == reference.normalized()
    j = g.journal(res.request_id)
    a1, a2 = j["attempts"]
    assert a1["failure_class"] == "network_uncertain" and a1["released"] is False
    assert a1["fence"] == "expiry" and a1["envoy_closed"] is True  # heard, not trusted
    # Admitted only after the old lease ran out (renewed every TTL/3, so it expires between
    # 2/3 TTL and TTL after the attempt ended), never before.
    assert a2["waited_for_previous_s"] >= TTL * 2 / 3 - 0.5
    assert a2["admitted_at"] >= a1["ended_at"] + TTL * 2 / 3 - 0.5
    rows = g.attempts_logged(res.request_id, settle_s=4.0)
    assert sorted(r["attempt"] for r in rows) == [1, 2]
    assert (j["outcome"], j["delivered_output_tokens"]) == ("completed", MAX)


def test_attempt_held_when_envoy_dies_is_revoked_and_the_replica_sees_the_close(
        fgw: Gateway) -> None:
    # Envoy killed while the gate holds attempt 1: the gate's stream ends before the
    # first-delta limit, which no uncertain end can do (Envoy's per-try timeout is later):
    # Envoy's death closed the attempt's upstream connection with it, so nothing of it can
    # reach anyone, and it is revoked at once (docs/fencing.md). The replica confirms it.
    box: dict[str, Result] = {}
    since = time.time()
    t = threading.Thread(target=lambda: box.setdefault("r", fgw.post(
        fgw.body(max_tokens=MAX), headers={"x-replica-fault": "slow-first-delta:1.5"})))
    t.start()
    time.sleep(0.6)  # the gate holds attempt 1's headers and role event
    fgw.stack.procs["envoy"].signal(signal.SIGKILL)
    t.join(20)
    fgw.stack.restart_envoy()
    res = box["r"]
    assert res.contents == [] and res.transport_error is not None
    rid = _rid_from_replicas(fgw, since, "slow-first-delta:1.5")
    deadline = time.monotonic() + 10
    while True:
        j = fgw.journal(rid, settle_s=0.2)
        if j["attempts"] and j["attempts"][0].get("failure_class") not in (None, "pending"):
            break
        assert time.monotonic() < deadline, j
        time.sleep(0.2)
    (a1,) = j["attempts"]
    assert a1["released"] is False and a1["fence"] == "revoked", a1
    assert j["first_delta_sent"] is False
    rows = fgw.attempts_logged(rid, settle_s=3.0)
    assert len(rows) == 1 and rows[0]["peer_closed"] is True and rows[0]["tokens_written"] == 0


def _rid_from_replicas(g: Gateway, since: float, fault: str) -> str:
    """The request id of the one attempt with `fault` logged after `since` (the client
    never got headers, so only the replica knows it)."""
    deadline = time.monotonic() + 5
    while True:
        rows = [r for r in g.stack.all_replica_logs() if r["ts"] >= since
                and r["fault"] == fault]
        if rows:
            assert len(rows) == 1, rows
            return str(rows[0]["request_id"])
        assert time.monotonic() < deadline, "the replica logged no such attempt"
        time.sleep(0.1)


def test_partition_after_first_delta_ends_with_the_error(fgw: Gateway) -> None:
    reference = ref(fgw)
    res = fgw.post(fgw.body(max_tokens=MAX),
                   headers={"x-partition": "after-deltas:2", "x-replica-token-delay-ms": "50"})
    assert res.status == 200 and res.transport_error is None
    assert res.normalized()[:3] == reference.normalized()[:3]
    err = res.error
    assert err is not None and err["code"] == "upstream_decode_interrupted"
    assert err["delivered_output_tokens"] == 2 and res.events[-1] == "[DONE]"
    rows = fgw.attempts_logged(res.request_id, settle_s=3.0)
    assert len(rows) == 1  # no second attempt
    assert rows[0]["tokens_written"] == MAX and rows[0]["peer_closed"] is False
    j = fgw.journal(res.request_id)
    assert (j["outcome"], j["delivered_output_tokens"], len(j["attempts"])) == (
        "upstream_decode_interrupted", 2, 1)
    # After the first delta nothing else may ever run for this request: the attempt is
    # fenced when the request ends (its `live` key deleted), classified as uncertain.
    a = j["attempts"][0]
    assert (a["fence"], a["failure_class"], a["released"]) == (
        "ended_with_request", "network_uncertain", True)


def test_slow_but_inside_the_hard_limit_is_not_failed_over(fgw: Gateway) -> None:
    reference = ref(fgw)
    res = fgw.post(fgw.body(max_tokens=MAX), headers={"x-replica-fault": "slow-first-delta:1.0"})
    assert res.normalized() == reference.normalized()
    j = fgw.journal(res.request_id)
    assert len(j["attempts"]) == 1 and j["attempts"][0]["slow"] is True
    assert len(fgw.attempts_logged(res.request_id)) == 1


def test_overload_burst_keeps_retries_bounded(fgw: Gateway) -> None:
    n = 12
    results: list[Result] = []
    lock = threading.Lock()

    def one() -> None:
        r = fgw.post(fgw.body(max_tokens=4), headers={"x-replica-fault": "overloaded:429:0",
                                                      "x-replica-fault-attempt": "all"})
        with lock:
            results.append(r)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == n
    total = 0
    for r in results:
        assert r.status == 429  # the replica's own answer, passed through
        rows = fgw.attempts_logged(r.request_id, settle_s=1.0)
        assert [x["outcome"] for x in rows] == ["overloaded", "overloaded"]
        total += len(rows)
        j = fgw.journal(r.request_id)
        assert [a["failure_class"] for a in j["attempts"]] == ["overloaded", "overloaded"]
        assert j["outcome"] == "upstream_failed" and j["first_delta_sent"] is False
    assert total == n * 2  # max_attempts per request, never more


def test_etcd_frozen_at_the_fence_gives_a_managed_error(fgw: Gateway) -> None:
    etcd = fgw.stack.procs["etcd"]
    box: dict[str, Result] = {}

    def go() -> None:
        box["r"] = fgw.post(fgw.body(max_tokens=4),
                            headers={"x-replica-fault": "slow-first-delta:1.0"})

    t = threading.Thread(target=go)
    t.start()
    time.sleep(0.5)  # admitted, waiting for the first delta
    etcd.signal(signal.SIGSTOP)
    try:
        t.join(15)
    finally:
        etcd.signal(signal.SIGCONT)
    res = box["r"]
    assert res.status == 503 and res.contents == []
    assert res.error is not None and res.error["code"] == "journal_unavailable"
    # A fence transaction that timed out may still apply when etcd wakes; the gate takes
    # it back, so the record ends up claiming nothing the client did not see.
    deadline = time.monotonic() + 10
    while True:
        j = fgw.journal(res.request_id, settle_s=10.0)
        if not j["first_delta_sent"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert j["first_delta_sent"] is False and j["delivered_output_tokens"] == 0
    assert j["outcome"] == "upstream_failed"


def test_etcd_frozen_at_finish_still_records_the_truth(fgw: Gateway) -> None:
    etcd = fgw.stack.procs["etcd"]
    box: dict[str, Result] = {}

    def go() -> None:
        box["r"] = fgw.post(fgw.body(max_tokens=MAX),
                            headers={"x-replica-token-delay-ms": "100"})

    t = threading.Thread(target=go)
    t.start()
    time.sleep(0.4)  # released; the rest of the stream needs no etcd
    etcd.signal(signal.SIGSTOP)
    t.join(15)
    time.sleep(1.0)
    etcd.signal(signal.SIGCONT)
    res = box["r"]
    assert res.status == 200 and len(res.contents) == MAX and res.transport_error is None
    j = fgw.journal(res.request_id, settle_s=10.0)
    assert (j["outcome"], j["delivered_output_tokens"]) == ("completed", MAX)


def test_processor_killed_mid_stream_is_settled_honestly(fgw: Gateway) -> None:
    proc = fgw.stack.procs["processor"]
    box: dict[str, Result] = {}

    def go() -> None:
        box["r"] = fgw.post(fgw.body(max_tokens=60),
                            headers={"x-replica-token-delay-ms": "50"})

    t = threading.Thread(target=go)
    t.start()
    time.sleep(1.0)  # ~15-20 deltas delivered, a few progress checkpoints written
    proc.signal(signal.SIGKILL)
    t.join(15)
    proc.popen.wait(5)  # type: ignore[union-attr]
    res = box["r"]
    seen = len(res.contents)
    assert res.status == 200 and 0 < seen < 60 and res.transport_error is not None
    proc.start()
    # Its session lease and the attempt's lease run out; then the next reader settles it.
    deadline = time.monotonic() + 20
    while True:
        r = fgw.status(res.request_id)
        if r.status_code == 200 and r.json()["outcome"] is not None:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
    j = r.json()
    assert j["outcome"] == "gateway_interrupted" and j["first_delta_sent"] is True
    assert j["delivered_output_tokens_exact"] is False
    # The last checkpoint (what had been handed to Envoy then), said to be unknown.
    assert 0 <= j["delivered_output_tokens"] <= seen
    assert j["delivered_output_tokens_bound"] == "unknown"
    assert j["error"]["code"] == "gateway_interrupted" and j["error"]["retryable"] is False
    rows = fgw.attempts_logged(res.request_id)
    assert len(rows) == 1 and rows[0]["peer_closed"] is True  # upstream cancelled, no retry


def test_a_revoked_lease_stops_publishing_at_once(fgw: Gateway) -> None:
    """Revocation by someone else (an operator, another gateway) reaches the processor
    serving the attempt through its watch: it publishes nothing more."""
    import subprocess
    import sys
    from pathlib import Path

    etcdctl = str(Path(sys.executable).parent / "etcdctl")
    box: dict[str, Result] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fgw.post(
        fgw.body(max_tokens=60), headers={"x-replica-token-delay-ms": "50"})))
    t.start()
    deadline = time.monotonic() + 5
    rid = None
    while rid is None and time.monotonic() < deadline:  # find the live attempt
        out = subprocess.run([etcdctl, "--endpoints", fgw.stack.etcd_endpoint, "get",
                              "--prefix", "/llmgw/v1/live/", "--keys-only"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        rid = out[0].rsplit("/", 1)[1] if out else None
        time.sleep(0.05)
    assert rid is not None
    time.sleep(0.5)  # some deltas delivered
    subprocess.run([etcdctl, "--endpoints", fgw.stack.etcd_endpoint, "del",
                    f"/llmgw/v1/live/{rid}"], check=True, capture_output=True, timeout=10)
    revoked_at = time.monotonic()
    t.join(20)
    ended_after = time.monotonic() - revoked_at
    res = box["r"]
    assert res.request_id == rid
    # The guard learns of the revocation through the watch and ends the stream at once
    # with the terminal error (60 tokens at 50 ms would take 3 s; the watchdog 15 s).
    assert res.error is not None and res.error["code"] == "upstream_decode_interrupted"
    assert res.error["delivered_output_tokens"] == len(res.contents)
    assert 0 < len(res.contents) < 60 and ended_after < 1.0
    rows = fgw.attempts_logged(rid, settle_s=4.0)
    # The replica was cancelled (Envoy closed it) and nothing it wrote after the end of
    # the stream reached the client.
    assert len(rows) == 1 and rows[0]["tokens_written"] >= len(res.contents)
    assert rows[0]["tokens_written"] < 60 and rows[0]["peer_closed"] is True
    j = fgw.journal(rid)
    assert (j["outcome"], j["cause"]) == ("upstream_decode_interrupted", "fenced")
    log = (fgw.stack.workdir / "processor.log").read_text()
    assert "attempt fenced: its lease was revoked or replaced" in log

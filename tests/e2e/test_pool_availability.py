"""A dead, frozen or silent replica costs the pool nothing (docs/failure-classes.md, "Bounds").

Three demo replicas behind real Envoy and etcd, the processor with its default pool health,
retry budget and first-delta budget (only first_delta_s is shortened, so the bounds are
seconds). Healthy traffic, with some concurrency, while one replica is SIGKILLed and kept
down, or SIGSTOPped (the kernel still accepts its connections), or one replica reads the
request and never answers. Run twice: Envoy's round robin (no compatibility pool, as `make
run`), and a compatibility pool (the guard's override_host list, ordered by the processor's
view of health). Per request_id: the exact event list, the attempts each replica logged,
and the journal's attempts, fences and waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from devkit.devstack import Stack

from .conftest import Gateway, Result

pytestmark = pytest.mark.e2e

FIRST = 3.0  # timeouts.first_delta_s
# The documented bound for a request's wait for its first delta, with max_attempts 2:
# first_delta_total_s (2 x first_delta_s) + Envoy's per-try margin (0.25 s) + one retry
# back-off (<= 0.25 s) + the answer itself; 1.5 s of slack for this 2-core machine.
BOUND = 2 * FIRST + 1.5
MAX = 6
CONFIG: dict[str, Any] = {"timeouts": {"first_delta_s": FIRST, "soft_first_delta_s": 1.0,
                                        "stall_after_first_delta_s": 1.0}}
FP = {"weights_revision": "demo@sha256:pool", "kv_cache_dtype": "fp16"}


@pytest.fixture(scope="module", params=["round-robin", "compatibility-pool"])
def pool_stack(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    fps = [FP, FP, FP] if request.param == "compatibility-pool" else None
    st = Stack(workdir=tmp_path_factory.mktemp(f"avail-{request.param}"), config=CONFIG,
               replicas=3, fingerprints=fps).start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture
def agw(pool_stack: Stack) -> Iterator[Gateway]:
    pool_stack.wait_replicas_healthy()
    time.sleep(2.5)  # every replica passes Envoy's and the processor's health checks again
    g = Gateway(pool_stack)
    yield g
    g.client.close()


def load(gw: Gateway, n: int, concurrency: int,
         headers: dict[str, str] | None = None) -> list[tuple[Result, float, float]]:
    """n requests, `concurrency` at a time; (result, start offset, duration) each. Bounded:
    n requests, each with the client's 30 s timeout."""
    t0 = time.monotonic()
    lock = threading.Lock()
    out: list[tuple[Result, float, float]] = []

    def one(_: int) -> None:
        g = Gateway(gw.stack)
        try:
            s = time.monotonic()
            r = g.post(g.body(max_tokens=MAX), headers=headers)
            with lock:
                out.append((r, s - t0, time.monotonic() - s))
        finally:
            g.client.close()

    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(n)))
    return sorted(out, key=lambda x: x[1])


def reference(gw: Gateway) -> list[Any]:
    r = gw.post(gw.body(max_tokens=MAX))
    assert r.status == 200 and len(r.contents) == MAX
    return r.normalized()


def assert_complete(gw: Gateway, r: Result, ref: list[Any]) -> dict[str, Any]:
    assert r.status == 200 and r.transport_error is None, (r.status, r.raw[:300])
    assert r.normalized() == ref  # the one clean answer, nothing spliced, nothing extra
    j = gw.journal(r.request_id)
    assert j["outcome"] == "completed" and j["first_delta_sent"] is True
    assert j["delivered_output_tokens"] == MAX
    return j


def under(agw: Gateway, fault: str, name: str, n: int
          ) -> tuple[list[Any], list[tuple[Result, float, float]]]:
    """The reference answer, then n requests (4 at a time) while `name` is dead or frozen."""
    st = agw.stack
    ref = reference(agw)
    (st.hold_down if fault == "dead" else st.freeze)(name)
    try:
        results = load(agw, n=n, concurrency=4)
    finally:
        (st.release if fault == "dead" else st.thaw)(name)
    assert len(results) == n
    return ref, results


def test_a_dead_replica_costs_the_pool_nothing(agw: Gateway) -> None:
    st = agw.stack
    ref, results = under(agw, "dead", "r2", 60)
    dead_port = st.replica_ports[1]
    retried_late = []
    for r, start, took in results:
        j = assert_complete(agw, r, ref)
        rows = agw.attempts_logged(r.request_id, settle_s=0.5)
        # Exactly one replica ran it, a live one: the dead host never saw a byte.
        assert [x["replica"] for x in rows if x["outcome"] == "completed"] != []
        assert len(rows) == 1 and rows[0]["replica"] != "r2", rows
        assert len(j["attempts"]) <= 2
        for a in j["attempts"][:-1]:
            # A first attempt lost to the dead host: refused before any byte (no gate ran:
            # taken over), or sent on a pooled connection the kill had closed (ended at once,
            # so revoked at once); nothing waited on it.
            assert a["fence"] in ("taken_over", "revoked"), a
            assert a["ended_at"] - a.get("admitted_at", a["ended_at"]) < 1.0, a
        assert j["attempts"][-1].get("waited_for_previous_s", 0.0) < 1.0
        if len(j["attempts"]) > 1 and start > 2.0:
            retried_late.append((start, j["attempts"]))
        assert took < FIRST, (took, j)  # a refused connection costs milliseconds, not limits
    # Envoy's outlier detection / health checks (and the processor's own view, for the
    # compatibility pool) stop sending attempt 1 to the dead host within about a second.
    assert retried_late == [], retried_late
    st.wait_replicas_healthy(timeout_s=15)
    assert dead_port == st.replica_ports[1]


def test_a_frozen_replica_costs_one_bounded_wait_per_stuck_request(agw: Gateway) -> None:
    ref, results = under(agw, "frozen", "r3", 40)
    done = [x for x in results if x[0].status == 200]
    for r, _, took in results:
        assert took <= BOUND, (took, r.status, r.raw[:200])
        if r.status != 200:  # a clean, managed error; nothing was delivered
            assert r.contents == [] and r.error is not None, r.raw[:300]
            assert r.error["code"] in ("upstream_timeout", "upstream_unavailable")
    assert len(done) >= 0.97 * len(results), [(x[0].status, x[0].raw[:120]) for x in results]
    waited_on_frozen = 0
    for r, _, took in done:
        j = assert_complete(agw, r, ref)
        if len(j["attempts"]) == 2:
            a1, a2 = j["attempts"]
            waited_on_frozen += 1
            # Frozen: silent past the limit, liveness uncertain. Envoy closed the attempt
            # (its own log entry said so), so the gate revoked it: the retry did not wait
            # for the lease to expire, and the frozen replica can publish nothing.
            assert a1["failure_class"] == "network_uncertain", a1
            assert a1["fence"] == "revoked" and a1["envoy_closed"] is True, a1
            assert a2["waited_for_previous_s"] < 1.0, a2
            assert FIRST - 0.5 <= took <= FIRST + 2.0, (took, j)
        else:
            assert took < FIRST, (took, j)
    # Only the requests stuck on the frozen host before it was found out paid the wait.
    assert waited_on_frozen <= 12, waited_on_frozen
    # The frozen replica, thawed, finds its peers gone: nothing it computed reached anyone.
    time.sleep(1.0)
    for r, _, _ in done:
        rows = agw.attempts_logged(r.request_id, settle_s=0.3)
        winners = [x for x in rows if x["outcome"] == "completed" and x["replica"] != "r3"]
        assert len(winners) == 1, rows


def test_a_replica_that_never_sends_headers_is_bounded(agw: Gateway) -> None:
    ref = reference(agw)
    t = time.monotonic()
    one = agw.post(agw.body(max_tokens=MAX), headers={"x-replica-fault": "silent-before-headers",
                                                      "x-replica-fault-attempt": "1"})
    took = time.monotonic() - t
    j = assert_complete(agw, one, ref)
    assert FIRST - 0.5 <= took <= FIRST + 2.0, took  # Envoy's per-try timeout, then retry
    a1, a2 = j["attempts"]
    assert a1["failure_class"] == "network_uncertain" and a1["envoy_cause"] == "timeout"
    assert a1["fence"] == "revoked" and a2["waited_for_previous_s"] < 1.0
    # Lines are written when an attempt ends: the silent one may notice last.
    rows = sorted(agw.attempts_logged(one.request_id), key=lambda x: x["attempt"])
    assert [x["attempt"] for x in rows] == [1, 2]
    assert rows[0]["outcome"] == "stalled_peer_closed" and rows[0]["tokens_written"] == 0
    assert rows[1]["outcome"] == "completed" and rows[0]["replica"] != rows[1]["replica"]

    t = time.monotonic()
    every = agw.post(agw.body(max_tokens=MAX), headers={
        "x-replica-fault": "silent-before-headers", "x-replica-fault-attempt": "all"})
    took = time.monotonic() - t
    # Every attempt silent: the request's first-delta budget (2 x first_delta_s) ends it
    # with our error, not with Envoy's plain-text 504 and not after a second full limit.
    assert every.status == 504 and every.contents == [], every.raw[:300]
    assert every.error is not None and every.error["code"] == "upstream_timeout"
    assert every.error["request_id"] == every.request_id and every.error["retryable"] is True
    assert 2 * FIRST - 0.5 <= took <= BOUND, took
    j = agw.journal(every.request_id)
    assert j["first_delta_sent"] is False and j["outcome"] == "upstream_failed"
    assert [a["failure_class"] for a in j["attempts"]] == ["network_uncertain"] * 2
    rows = sorted(agw.attempts_logged(every.request_id), key=lambda x: x["attempt"])
    assert [x["attempt"] for x in rows] == [1, 2]
    assert all(x["tokens_written"] == 0 for x in rows)

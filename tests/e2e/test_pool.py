"""Route only where it is safe: fingerprints, the retry budget, and retry cost.

Four replicas, two fingerprints: r1, r2 share A; r3, r4 share B (they differ only in the
KV-cache dtype). The guard hands Envoy an ordered list of compatible hosts
(override_host); the gate refuses anything else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from devkit.devstack import Stack
from extproc.core.pool import Fingerprint

from .conftest import Gateway, Result

pytestmark = pytest.mark.e2e

FP_A = {"weights_revision": "demo@sha256:aaaa", "kv_cache_dtype": "fp16",
        "lora_adapters": ["sql", "legal"]}
FP_B = {**FP_A, "kv_cache_dtype": "fp8"}
CONFIG: dict[str, Any] = {
    "timeouts": {"first_delta_s": 5.0, "stall_after_first_delta_s": 1.0,
                 "access_log_wait_s": 0.5, "fence_wait_s": 12.0},
    "policy": {
        "on_upstream_failure": {"before_first_delta": {"max_attempts": 3}},
        "retry_budget": {"fraction": 0.2, "min_retry_concurrency": 3},
        "retry_cost": {"max_prompt_tokens": 1000},
    },
}
MAX = 6


@pytest.fixture(scope="module")
def pstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(workdir=tmp_path_factory.mktemp("pool"), config=CONFIG, replicas=4,
               fingerprints=[FP_A, FP_A, FP_B, FP_B]).start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture
def pgw(pstack: Stack) -> Iterator[Gateway]:
    pstack.wait_replicas_healthy()
    g = Gateway(pstack)
    yield g
    g.client.close()


def group_of(stack: Stack, name: str) -> str:
    i = int(name[1:]) - 1
    return Fingerprint.from_mapping([FP_A, FP_A, FP_B, FP_B][i]).digest


def names_for(g: Gateway, rid: str) -> list[str]:
    return [r["replica"] for r in g.attempts_logged(rid)]


def test_retry_stays_within_the_fingerprint(pgw: Gateway) -> None:
    for _ in range(3):  # a few requests so both groups get picked at least once
        res = pgw.post(pgw.body(max_tokens=MAX), headers={"x-replica-fault": "kill-before-headers"})
        assert res.status == 200 and len(res.contents) == MAX
        names = names_for(pgw, res.request_id)
        assert len(names) == 2 and names[0] != names[1]
        assert group_of(pgw.stack, names[0]) == group_of(pgw.stack, names[1])
        j = pgw.journal(res.request_id)
        fp = {a["model_revision"] for a in j["attempts"]}
        assert fp == {group_of(pgw.stack, names[0])}  # the journal names the fingerprint
        assert j["model_revision"] == group_of(pgw.stack, names[0])
        pgw.stack.wait_replicas_healthy()  # the killed replica is back for the next one


def test_whole_group_dead_gives_a_managed_error_and_never_crosses(pgw: Gateway) -> None:
    res = pgw.post(pgw.body(max_tokens=MAX), headers={
        "x-replica-fault": "kill-before-headers", "x-replica-fault-attempt": "all"})
    assert res.status == 503 and res.contents == []
    assert res.error is not None
    assert res.error["code"] in ("no_compatible_replica", "upstream_unavailable")
    names = names_for(pgw, res.request_id)
    # Both compatible replicas were tried and died; the other group never saw it.
    assert len(names) == 2 and len({group_of(pgw.stack, n) for n in names}) == 1
    j = pgw.journal(res.request_id)
    assert j["first_delta_sent"] is False and j["outcome"] == "upstream_failed"


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


def test_mass_failure_stays_within_the_retry_budget(pgw: Gateway) -> None:
    st = pgw.stack
    # Half the pool frozen, one per fingerprint: connections are accepted and requests sent
    # (a prefill may have started), nothing comes back. Every retry after it is a
    # re-prefill, charged to the budget (a refused connection would not be: test_pool_
    # availability.py). Each answer streams slowly (~1.8 s), so the re-prefills, which all
    # come first_delta_s after the requests, would overlap on the survivors without one.
    st.freeze("r1")
    st.freeze("r3")
    try:
        results: list[Result] = []
        lock = threading.Lock()

        def one() -> None:
            r = pgw.post(pgw.body(max_tokens=MAX), key=None,
                         headers={"x-replica-token-delay-ms": "300"})
            with lock:
                results.append(r)

        n = 24
        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        st.thaw("r1")
        st.thaw("r3")
    assert len(results) == n
    ok = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status != 200]
    for r in ok:  # never a truncated success
        assert len(r.contents) == MAX and r.events[-1] == "[DONE]"
    for r in refused:  # a managed error, before any delta
        assert r.contents == [] and r.error is not None
        assert r.error["code"] in ("retry_budget_exhausted", "upstream_unavailable",
                                   "upstream_timeout")
    spans: list[tuple[float, float]] = []
    for r in results:
        j = pgw.journal(r.request_id)
        deadline = time.monotonic() + 5.0
        while (any(a.get("ended_at") is None for a in j["attempts"])
               and time.monotonic() < deadline):  # a gate's record closes a moment later
            time.sleep(0.1)
            j = pgw.journal(r.request_id)
        spans += [(a["started_at"], a["ended_at"]) for a in j["attempts"] if a["attempt"] > 1]
    # Re-prefills in flight never exceed max(3, 20% of the requests in flight), and never
    # more than 24 requests were in flight: at most max(3, int(0.2 x 24)) = 4 at once.
    assert spans and max_overlap(spans) <= max(3, int(0.2 * n))
    # About half the requests met a frozen first host and their re-prefills came together:
    # some were refused, by the processor's pool-wide budget (retry_budget_exhausted) or by
    # Envoy's concurrent retry budget (its per-try timeout then ends the request:
    # upstream_timeout), always before any delta.
    assert len(refused) >= 1
    # The survivors saw each request at most once plus the admitted re-prefills.
    survivors = [x for x in st.all_replica_logs() if x["request_id"] in
                 {r.request_id for r in results} and x["replica"] in ("r2", "r4")]
    assert len(survivors) <= n + len(spans)


def test_expensive_retry_is_refused_a_cheap_one_runs(pgw: Gateway) -> None:
    long = pgw.post(pgw.body(max_tokens=MAX, prompt="word " * 1000),
                    headers={"x-replica-fault": "kill-before-headers"})
    assert long.status == 503 and long.contents == []
    assert long.error is not None and long.error["code"] == "retry_too_expensive"
    assert long.error["estimated_prompt_tokens"] > 1000
    assert len(names_for(pgw, long.request_id)) == 1  # the retry never started
    pgw.stack.wait_replicas_healthy()  # the killed replica is back before the next request
    short = pgw.post(pgw.body(max_tokens=MAX), headers={"x-replica-fault": "kill-before-headers"})
    assert short.status == 200 and len(short.contents) == MAX
    assert len(names_for(pgw, short.request_id)) == 2

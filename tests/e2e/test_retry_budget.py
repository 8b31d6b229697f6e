"""The pool-wide retry budget counts re-prefills in flight (decision 0023).

Issue 24, finding 7: a burst of failing requests used the budget's floor; seconds later, in
a quiet and healthy pool, one unrelated request whose replica died before its first delta
was refused `retry_budget_exhausted` (a count per window still held the burst). Here the
burst still meets the floor, and once it is over the next such request is re-run.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from devkit.devstack import Stack, _bin

from .conftest import Gateway, Result

pytestmark = pytest.mark.e2e

FLOOR = 3
MAX = 6
BURST = 8
# Each re-prefill streams MAX tokens this slowly (~2.4 s), so the burst's re-prefills are
# all in flight together; the burst's requests start 100 ms apart (0.7 s in all).
TOKEN_DELAY_MS = 400
CONFIG: dict[str, Any] = {
    "timeouts": {"first_delta_s": 5.0, "stall_after_first_delta_s": 2.0,
                 "access_log_wait_s": 0.5, "fence_wait_s": 12.0},
    "policy": {"retry_budget": {"fraction": 0.2, "min_retry_concurrency": FLOOR}},
}


@pytest.fixture(scope="module")
def bstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(workdir=tmp_path_factory.mktemp("budget"), config=CONFIG, replicas=2).start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture
def bgw(bstack: Stack) -> Iterator[Gateway]:
    bstack.wait_replicas_healthy()
    g = Gateway(bstack)
    yield g
    g.client.close()


def published(st: Stack) -> dict[str, Any] | None:
    """What the processor last published to etcd for the pool-wide budget."""
    assert st.cfg is not None
    key = f"{st.cfg.etcd.prefix}/budget/{st.cfg.server.gateway_id}"
    out = subprocess.run([_bin("etcdctl"), "--endpoints", st.etcd_endpoint, "get", key,
                          "--print-value-only"], capture_output=True, text=True, timeout=10)
    text = out.stdout.strip()
    return json.loads(text) if out.returncode == 0 and text else None


def wait_published(st: Stack, want: dict[str, int], timeout_s: float) -> dict[str, Any] | None:
    """Wait (bounded) until the published counts are `want`; the last value seen."""
    deadline = time.monotonic() + timeout_s
    seen = published(st)
    while seen != want and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = published(st)
    return seen


def re_prefills(g: Gateway, res: Result) -> list[dict[str, Any]]:
    return [a for a in g.journal(res.request_id)["attempts"] if a["attempt"] > 1]


def test_a_quiet_pool_re_runs_a_failed_request_after_a_burst_used_the_floor(
        bgw: Gateway) -> None:
    st = bgw.stack
    ref = bgw.post(bgw.body(max_tokens=MAX))
    assert ref.status == 200 and len(ref.contents) == MAX

    # 1. The burst: every request's first attempt fails before its first delta (an in-band
    # error after the replica answered 200, so the attempt reached a replica: its retry is
    # a re-prefill). Their re-prefills overlap: the floor admits 3, the rest are refused.
    results: dict[int, Result] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        r = bgw.post(bgw.body(max_tokens=MAX), headers={
            "x-replica-fault": "error-after-deltas:0",
            "x-replica-token-delay-ms": str(TOKEN_DELAY_MS)})
        with lock:
            results[i] = r

    threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(60)
    assert len(results) == BURST
    rerun = [r for r in results.values() if r.status == 200]
    refused = [r for r in results.values() if r.status != 200]
    for r in rerun:  # a re-run is the whole answer, from its second attempt
        assert r.normalized() == ref.normalized()
        j = bgw.journal(r.request_id)
        assert j["outcome"] == "completed" and len(j["attempts"]) == 2
    for r in refused:  # refused by the budget, before any delta
        assert r.status == 503 and r.contents == [] and r.error is not None, r.raw
        assert r.error["code"] == "retry_budget_exhausted", r.error
        assert "re-prefills in flight" in r.error["message"]
        j = bgw.journal(r.request_id)
        assert j["first_delta_sent"] is False and len(j["attempts"]) == 1
    assert len(rerun) == FLOOR and len(refused) == BURST - FLOOR  # the floor was used

    # 2. The burst is over: once the processor has seen every stream end it publishes
    # nothing in flight (bounded wait; checked below, after the request that matters).
    quiet = wait_published(st, {"requests": 0, "retries": 0}, timeout_s=5.0)

    # 3. One unrelated request whose replica dies after its headers, before any delta, in
    # a quiet pool: re-run on the other replica, the client sees one clean answer.
    st.wait_replicas_healthy()
    res = bgw.post(bgw.body(max_tokens=MAX), headers={"x-replica-fault": "kill-after-headers"})
    assert res.status == 200, res.raw
    assert res.transport_error is None
    assert res.normalized() == ref.normalized()  # the exact text and event list
    rows = bgw.attempts_logged(res.request_id)
    assert [r["attempt"] for r in rows] == [1, 2]
    assert rows[0]["outcome"] == "killed" and rows[1]["outcome"] == "completed"
    j = bgw.journal(res.request_id)
    assert j["outcome"] == "completed" and j["first_delta_sent"] is True
    assert j["attempt"] == 2 and len(j["attempts"]) == 2
    assert [a["attempt"] for a in j["attempts"]] == [1, 2]
    assert j["delivered_output_tokens"] == MAX
    assert quiet == {"requests": 0, "retries": 0}, quiet

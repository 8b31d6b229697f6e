"""Two gateways, one truth: two Envoy + processor pairs share one etcd.

Both scope requests by tenant, derived from the API key (only its digest is kept).
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from devkit.devstack import Stack

from .conftest import Gateway, Result

pytestmark = pytest.mark.e2e

BASE: dict[str, Any] = {
    "timeouts": {"first_delta_s": 5.0, "stall_after_first_delta_s": 1.0,
                 "access_log_wait_s": 0.5, "fence_wait_s": 12.0},
    "tenancy": {"api_key_header": "authorization"},
    "policy": {"retry_budget": {"min_retry_concurrency": 100000}},  # budgets: test_pool.py
}
ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    a = Stack(workdir=tmp_path_factory.mktemp("gw-a"),
              config={**BASE, "server": {"gateway_id": "gw-a"}}).start()
    try:
        b = Stack(workdir=tmp_path_factory.mktemp("gw-b"), etcd_endpoint=a.etcd_endpoint,
                  config={**BASE, "server": {"gateway_id": "gw-b"}}).start()
        try:
            yield a, b
        finally:
            b.stop()
    finally:
        a.stop()


@pytest.fixture
def gws(pair: tuple[Stack, Stack]) -> Iterator[tuple[Gateway, Gateway]]:
    for s in pair:
        s.wait_replicas_healthy()
    ga, gb = Gateway(pair[0], ALICE), Gateway(pair[1], ALICE)
    yield ga, gb
    ga.client.close()
    gb.client.close()


def _key() -> str:
    return "k-" + uuid.uuid4().hex


def test_repeat_on_the_other_gateway_while_live_is_in_progress(
        gws: tuple[Gateway, Gateway]) -> None:
    ga, gb = gws
    key = _key()
    box: dict[str, Result] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", ga.post(
        ga.body(max_tokens=30), key=key,
        headers={**ALICE, "x-replica-token-delay-ms": "50"})))
    t.start()
    time.sleep(0.6)
    again = gb.post(gb.body(max_tokens=30), key=key, headers=ALICE)
    t.join(20)
    first = box["r"]
    assert first.status == 200 and len(first.contents) == 30
    assert again.status == 409 and again.error is not None
    assert again.error["code"] == "request_in_progress" and again.error["retryable"] is True
    assert again.error["request_id"] == first.request_id
    # Only gateway A's replicas ever ran it; B started nothing.
    assert len(ga.attempts_logged(first.request_id)) == 1
    assert gb.attempts_logged(first.request_id, settle_s=0.5) == []
    j = ga.journal(first.request_id)
    assert j["outcome"] == "completed" and j["attempts"][0]["gateway_id"] == "gw-a"


def test_repeat_on_the_other_gateway_after_an_interruption(
        gws: tuple[Gateway, Gateway]) -> None:
    ga, gb = gws
    key = _key()
    first = ga.post(ga.body(max_tokens=8), key=key,
                    headers={**ALICE, "x-replica-fault": "kill-after-deltas:3"})
    assert first.transport_error is not None and len(first.contents) == 3
    ga.journal(first.request_id)
    again = gb.post(gb.body(max_tokens=8), key=key, headers=ALICE)
    assert again.status == 409
    assert again.error == {
        "message": "Generation was interrupted after part of the answer was sent",
        "type": "gateway_error", "code": "upstream_decode_interrupted",
        "request_id": first.request_id, "partial_output": True, "retryable": False,
        "delivered_output_tokens": 3, "delivered_output_tokens_exact": True}
    assert gb.attempts_logged(first.request_id, settle_s=0.5) == []
    # The status lookup answers the same from either gateway.
    ja, jb = ga.status(first.request_id).json(), gb.status(first.request_id).json()
    for j in (ja, jb):
        j.pop("attempts")
    assert ja == jb and ja["outcome"] == "upstream_decode_interrupted"


def test_repeat_on_the_other_gateway_after_success(gws: tuple[Gateway, Gateway]) -> None:
    ga, gb = gws
    key = _key()
    first = ga.post(ga.body(max_tokens=5), key=key, headers=ALICE)
    assert first.status == 200 and len(first.contents) == 5
    ga.journal(first.request_id)
    again = gb.post(gb.body(max_tokens=5), key=key, headers=ALICE)
    assert again.status == 409 and again.error is not None
    assert again.error["code"] == "request_already_completed"
    assert again.error["outcome"] == "completed"
    assert again.error["delivered_output_tokens"] == 5
    assert again.error["request_id"] == first.request_id


def test_another_tenant_never_sees_the_request(gws: tuple[Gateway, Gateway]) -> None:
    ga, gb = gws
    key = _key()
    alice = ga.post(ga.body(max_tokens=3), key=key, headers=ALICE)
    assert alice.status == 200
    ga.journal(alice.request_id)
    # Same Idempotency-Key, other tenant: a different logical request, run normally.
    bob = gb.post(gb.body(max_tokens=3), key=key, headers=BOB)
    assert bob.status == 200 and bob.request_id != alice.request_id
    assert len(bob.contents) == 3
    # Bob cannot read Alice's record; the answer is the one for an unknown id.
    r = gb.client.get(f"/v1/requests/{alice.request_id}", headers=BOB)
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
    assert "completed" not in r.text and "delivered" not in r.text
    ok = gb.client.get(f"/v1/requests/{alice.request_id}", headers=ALICE)
    assert ok.status_code == 200 and ok.json()["outcome"] == "completed"
    # No API key at all: refused before anything runs.
    anon = gb.client.post("/v1/chat/completions", json=gb.body(),
                          headers={"Authorization": ""})
    assert anon.status_code == 401 and anon.json()["error"]["code"] == "invalid_header"


def test_envoy_restarted_mid_stream(gws: tuple[Gateway, Gateway]) -> None:
    ga, _ = gws
    box: dict[str, Result] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", ga.post(
        ga.body(max_tokens=60), headers={**ALICE, "x-replica-token-delay-ms": "40"})))
    t.start()
    time.sleep(0.8)
    ga.stack.procs["envoy"].signal(signal.SIGKILL)
    t.join(20)
    res = box["r"]
    seen = len(res.contents)
    assert res.transport_error is not None and 0 < seen < 60
    ga.stack.restart_envoy()
    deadline = time.monotonic() + 10
    while True:
        r = ga.client.get(f"/v1/requests/{res.request_id}", headers=ALICE)
        if r.status_code == 200 and r.json()["outcome"] is not None:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)
    j = r.json()
    # Envoy died with bytes in flight: the guard counted what it handed to Envoy, an upper
    # bound of what the client got, and says it cannot be exact.
    assert j["outcome"] == "upstream_decode_interrupted" and j["cause"] == "unknown"
    assert j["delivered_output_tokens"] >= seen
    assert j["delivered_output_tokens_exact"] is False
    rows = ga.attempts_logged(res.request_id, settle_s=2.0)
    assert len(rows) == 1 and rows[0]["peer_closed"] is True  # the replica saw the close
    after = ga.post(ga.body(max_tokens=2), headers=ALICE)
    assert after.status == 200 and len(after.contents) == 2

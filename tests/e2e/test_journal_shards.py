"""The journal sharded over two etcd clusters (decision 0042), one of them frozen.

Real Envoy, processor, replica agents, demo replicas and TWO etcd clusters (devkit
`Stack(etcd_shards=2)`: `etcd` is shard 0, `etcd-shard1` shard 1). Each request's
Idempotency-Key is chosen so its request id lands on a known shard (`shard_of`, the same
function the processor and the agents run). While shard 1's etcd is SIGSTOPped:

- every request of shard 0 completes, whole (the agent in front of the replica found its
  attempt live on shard 0's cluster; the record is readable through the status route);
- every request of shard 1 is refused 503 `journal_unavailable`, `retryable: true`,
  within the intake's resend deadline, nothing delivered;

and once shard 1 is thawed, new requests of shard 1 complete again, their records on
shard 1 (read through the status route and directly on the cluster).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devkit.devstack import Stack
from extproc.adapters.shards import shard_of
from extproc.core.intake import DEFAULT_TENANT
from extproc.core.journal import request_id_for_key

from .conftest import Gateway, Result

pytestmark = pytest.mark.e2e

TOKENS = 5
PER_SHARD = 3
RESEND_S = 1.5  # etcd.resend_deadline_s: how long an intake tries a frozen cluster


@pytest.fixture(scope="module")
def shard_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(workdir=tmp_path_factory.mktemp("journal-shards"), replicas=2, agents=True,
               etcd_shards=2,
               config={"etcd": {"timeout_s": 0.5, "resend_deadline_s": RESEND_S}}).start()
    try:
        yield st
    finally:
        st.stop()


def _keys(shard: int, n: int) -> list[tuple[str, str]]:
    """n fresh (Idempotency-Key, request id) pairs whose request lands on `shard` of 2."""
    out: list[tuple[str, str]] = []
    while len(out) < n:
        key = "shard-" + uuid.uuid4().hex
        rid = request_id_for_key(DEFAULT_TENANT, key)
        if shard_of(rid, 2) == shard:
            out.append((key, rid))
    return out


def _complete(r: Result, rid: str) -> None:
    assert r.transport_error is None, r.transport_error
    assert r.status == 200, (r.status, r.raw[:300])
    assert r.request_id == rid
    assert len(r.contents) == TOKENS and r.events[-1] == "[DONE]", r.events


def _on_cluster(st: Stack, endpoint: str, rid: str) -> bool:
    out = subprocess.run([str(Path(sys.executable).parent / "etcdctl"), "--endpoints",
                          endpoint, "--command-timeout=3s", "get", "--prefix", "--keys-only",
                          f"/llmgw/v1/req/{rid}/"], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    return f"/llmgw/v1/req/{rid}/outcome" in out.stdout.split()


def test_a_frozen_shard_refuses_only_its_own_requests(shard_stack: Stack) -> None:
    st = shard_stack
    assert len(st.etcd_shard_endpoints) == 1
    gw = Gateway(st)
    body = gw.body(max_tokens=TOKENS)
    # Both shards serve before the freeze (and the processor's leases exist on both).
    for shard in (0, 1):
        (key, rid), = _keys(shard, 1)
        _complete(gw.post(body, key=key), rid)

    zero, one = _keys(0, PER_SHARD), _keys(1, PER_SHARD)
    st.freeze_etcd_member("etcd-shard1")
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(2 * PER_SHARD) as pool:
            futs = {rid: pool.submit(gw.post, body, None, "/v1/chat/completions", key)
                    for key, rid in zero + one}
            results = {rid: f.result(timeout=30) for rid, f in futs.items()}
        took = time.monotonic() - t0
        for _, rid in zero:
            _complete(results[rid], rid)
        for _, rid in one:
            r = results[rid]
            assert r.transport_error is None, r.transport_error
            err = r.error
            assert r.status == 503 and err is not None, (r.status, r.raw[:300])
            assert err["code"] == "journal_unavailable" and err["retryable"] is True, err
            assert r.contents == []
        # Refused within the intake's resend deadline (plus a loaded machine's slack),
        # never held until a client timeout.
        assert took < RESEND_S + 8.0, took
        # Shard 0's records are whole while shard 1 is still frozen.
        for _, rid in zero:
            rec = gw.journal(rid)
            assert (rec["outcome"], rec["delivered_output_tokens"]) == ("completed", TOKENS)
    finally:
        st.thaw_etcd_member("etcd-shard1")

    # Thawed: shard 1 serves new requests again (its leases renewed or granted anew).
    deadline = time.monotonic() + 20
    while True:
        (key, rid), = _keys(1, 1)
        r = gw.post(body, key=key)
        if r.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    _complete(r, rid)
    rec = gw.journal(rid)
    assert (rec["outcome"], rec["delivered_output_tokens"]) == ("completed", TOKENS), rec
    assert _on_cluster(st, st.etcd_shard_endpoints[0], rid)
    assert not _on_cluster(st, st.etcd_endpoint, rid)
    (_, rid0) = zero[0]
    assert _on_cluster(st, st.etcd_endpoint, rid0)
    assert not _on_cluster(st, st.etcd_shard_endpoints[0], rid0)

"""Who may call what (issue 29, docs/security.md): adversarial calls against a real stack.

Real etcd, Envoy, the processor, two demo replicas behind partition proxies and the demo
tool server, with tenancy by API key (`tenancy.api_key_header: authorization`, the chart's
default). Each test plays an attacker who knows what a client is given (the request and
attempt ids in its response headers) or more (a worker's real secret), and checks the tool
server's own execution log and the journal, not only the answer's code.
"""

from __future__ import annotations

import hashlib
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.devstack import Proc, Stack, free_port, wait_until
from extproc.adapters.ports import RandomIds
from extproc.core.journal import request_id_for_key

from .conftest import Gateway
from .test_tools import LiveAttempt, attempt_secret, executions, tool_call

pytestmark = pytest.mark.e2e

CONFIG: dict[str, Any] = {
    "etcd": {"attempt_lease_ttl_s": 3, "session_ttl_s": 3},
    # stall_after_first_delta_s leaves room for a worker's pause before its tool call.
    "timeouts": {"first_delta_s": 2.0, "soft_first_delta_s": 0.5,
                 "stall_after_first_delta_s": 8.0, "access_log_wait_s": 0.5,
                 "fence_wait_s": 3.5},
    "tools": {"max_result_bytes": 4096, "wait_s": 5.0},
    "tenancy": {"api_key_header": "authorization"},
    "policy": {"retry_budget": {"min_retry_concurrency": 100000}},  # budgets: test_pool.py
}
MAX = 8
KEY_A, KEY_B = "Bearer sk-tenant-a", "Bearer sk-tenant-b"
SECRET_HEADER = "x-gateway-attempt-secret"


@pytest.fixture(scope="module")
def sstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(workdir=tmp_path_factory.mktemp("tool-security"), config=CONFIG, replicas=2,
               partition_proxies=True, tool_server=True).start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture
def ga(sstack: Stack) -> Iterator[Gateway]:
    """Tenant A's client."""
    sstack.wait_replicas_healthy()
    g = Gateway(sstack, headers={"authorization": KEY_A})
    yield g
    g.client.close()


@pytest.fixture
def gb(sstack: Stack) -> Iterator[Gateway]:
    """Tenant B's client."""
    g = Gateway(sstack, headers={"authorization": KEY_B})
    yield g
    g.client.close()


def reference(g: Gateway, max_tokens: int) -> list[str]:
    """What an untouched request with the same body streams (the demo is deterministic)."""
    r = g.post(g.body(max_tokens=max_tokens))
    assert r.status == 200 and len(r.contents) == max_tokens, r.raw[:300]
    return r.contents


def assert_unharmed(g: Gateway, la: LiveAttempt, ref: list[str]) -> dict[str, Any]:
    """The live stream goes on to its exact expected end, one attempt, recorded complete."""
    res = la.rest()
    assert res.status == 200 and res.transport_error is None, res.raw[-300:]
    assert res.contents == ref and res.events[-1] == "[DONE]"
    j = g.journal(la.rid)
    assert j["outcome"] == "completed" and len(j["attempts"]) == 1
    assert j["attempts"][0]["attempt_id"] == la.aid
    return j


def code(r: httpx.Response) -> str | None:
    try:
        c: str = r.json()["error"]["code"]
        return c
    except (ValueError, KeyError, TypeError):
        return None


# 1 ------------------------------------------------------------------------------------


def test_the_client_listener_never_runs_a_tool_even_with_the_real_secret(
        ga: Gateway) -> None:
    """The issue's reproduction: a client posts to the tool route on the public listener
    with its own stream's ids, and here even with the attempt's real secret."""
    ref = reference(ga, 30)
    la = LiveAttempt(ga, max_tokens=30, token_delay_ms=60)
    try:
        for i, secret in enumerate((None, la.secret)):
            r = la.call(f"evil_{i}", url=ga.stack.base_url, no_secret=secret is None,
                        secret=secret)
            assert r.status_code == 404, r.text
            if r.content:  # the guard's own answer (Envoy's direct 404 has no body)
                assert code(r) == "tool_route_not_here"
            assert r.headers.get("x-tool-replayed") is None
            assert executions(ga, f"{la.rid}:evil_{i}", settle_s=0.3) == []
        assert_unharmed(ga, la, ref)
    finally:
        la.close()
    # Nothing was recorded for those call ids either: the real worker's later call runs.
    assert [e for e in ga.stack.tool_log() if e["key"].startswith(f"{la.rid}:")] == []


def test_the_tool_listener_serves_nothing_but_the_tool_route(ga: Gateway) -> None:
    """A generation sent to the tool listener is refused there and never reaches a
    replica: no journal record exists under the id its key derives."""
    key = "sec-" + uuid.uuid4().hex
    tenant = "key:" + hashlib.sha256(KEY_A.encode()).hexdigest()
    with httpx.Client(base_url=ga.stack.tool_url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=ga.body(max_tokens=MAX),
                   headers={"authorization": KEY_A, "Idempotency-Key": key})
        assert r.status_code == 404, r.text
        assert c.get("/v1/models").status_code == 404
    rid = request_id_for_key(tenant, key)
    assert ga.status(rid).status_code == 404
    assert [x for x in ga.stack.all_replica_logs() if x.get("request_id") == rid] == []


# 2 ------------------------------------------------------------------------------------


def test_no_or_a_wrong_secret_on_the_tool_listener_is_refused_and_claims_nothing(
        ga: Gateway) -> None:
    """The worker (the replica, in agent mode) streams 2 tokens, pauses 4 s, then calls the
    tool with call id `sec_2`. In the pause an attacker on the tool listener uses the live
    attempt's ids with no secret and with a wrong one: 403, nothing executed, and nothing
    recorded, since the worker's own call of the same id then executes exactly once."""
    la = LiveAttempt(ga, max_tokens=MAX, token_delay_ms=20, headers={
        "x-replica-tool-call": "sec_2@2+4.0"})
    try:
        j0 = ga.status(la.rid).json()
        assert j0["outcome"] is None and j0["attempts"][0]["attempt_id"] == la.aid
        forged = [la.call("sec_2", no_secret=True),
                  la.call("sec_2", secret="x" * len(la.secret)),
                  la.call("sec_2", secret=la.secret[:-1] + ("A" if la.secret[-1] != "A"
                                                           else "B"))]
        for r in forged:
            assert r.status_code == 403, r.text
            assert code(r) == "tool_call_unauthorized"
            # No oracle: the same answer whether the secret is absent or wrong.
            assert r.json() == forged[0].json()
        assert executions(ga, f"{la.rid}:sec_2", settle_s=0.2) == []
        res = la.rest()
    finally:
        la.close()
    assert res.status == 200 and res.transport_error is None and len(res.contents) == MAX
    rows = ga.attempts_logged(la.rid)
    assert [r["attempt"] for r in rows] == [1]
    (call,) = rows[0]["tool_calls"]
    assert (call["call_id"], call["status"], call["replayed"]) == ("sec_2", 200, False)
    assert len(executions(ga, f"{la.rid}:sec_2")) == 1
    j = ga.journal(la.rid)
    assert j["outcome"] == "completed" and len(j["attempts"]) == 1


# 3 ------------------------------------------------------------------------------------


def test_a_worker_of_one_request_cannot_call_as_another(ga: Gateway) -> None:
    ref = reference(ga, 30)
    a = LiveAttempt(ga, max_tokens=30, token_delay_ms=60)
    try:
        b = LiveAttempt(ga, max_tokens=30, token_delay_ms=60)
        try:
            assert a.secret != b.secret
            # A's worker, A's real secret, B's ids.
            r = tool_call(ga.stack.tool_url, b.rid, b.aid, "cross_1", a.secret)
            assert r.status_code == 403 and code(r) == "tool_call_unauthorized", r.text
            # A's secret with B's request id and A's attempt id: not B's attempt either.
            r = tool_call(ga.stack.tool_url, b.rid, a.aid, "cross_2", a.secret)
            assert r.status_code == 403 and code(r) == "tool_call_unauthorized", r.text
            assert executions(ga, f"{b.rid}:cross_1", settle_s=0.2) == []
            assert executions(ga, f"{b.rid}:cross_2", settle_s=0) == []
            # B's own worker still runs cross_1, once: nothing was claimed for it.
            ok = b.call("cross_1")
            assert ok.status_code == 200 and ok.headers.get("x-tool-replayed") != "true"
            assert len(executions(ga, f"{b.rid}:cross_1")) == 1
            assert_unharmed(ga, b, ref)
        finally:
            b.close()
        assert_unharmed(ga, a, ref)
    finally:
        a.close()


# 4 ------------------------------------------------------------------------------------


def test_a_fenced_attempts_worker_with_its_old_secret_is_refused(ga: Gateway) -> None:
    """Attempt 1 is partitioned after its headers and fenced when the first-delta limit
    passes; attempt 2 serves the stream. Attempt 1's worker still holds its real secret."""
    ref = reference(ga, 40)
    la = LiveAttempt(ga, max_tokens=40, token_delay_ms=100, headers={
        "x-partition": "after-deltas:0", "x-partition-attempt": "1"})
    try:
        j = ga.status(la.rid).json()
        assert [a["attempt"] for a in j["attempts"]] == [1, 2]
        aid1 = j["attempts"][0]["attempt_id"]
        assert aid1 != la.aid and j["attempts"][1]["attempt_id"] == la.aid
        old = attempt_secret(ga.stack, aid1)
        assert old != la.secret
        r = tool_call(ga.stack.tool_url, la.rid, aid1, "fenced_1", old)
        assert r.status_code == 409 and code(r) == "attempt_fenced", r.text
        assert executions(ga, f"{la.rid}:fenced_1", settle_s=0.2) == []
        # The live attempt's worker runs the same call id, once.
        ok = la.call("fenced_1")
        assert ok.status_code == 200 and ok.headers.get("x-tool-replayed") != "true"
        res = la.rest()
    finally:
        la.close()
    assert res.status == 200 and res.transport_error is None and res.contents == ref
    assert len(executions(ga, f"{la.rid}:fenced_1")) == 1
    j = ga.journal(la.rid)
    assert j["outcome"] == "completed"
    assert j["attempts"][0]["fence"] == "revoked" and j["attempts"][1]["attempt_id"] == la.aid


# 5 ------------------------------------------------------------------------------------


def test_a_secret_replayed_after_its_attempt_ended_is_refused(ga: Gateway) -> None:
    ref = reference(ga, MAX)
    la = LiveAttempt(ga, max_tokens=MAX, token_delay_ms=20)
    try:
        res = la.rest()
    finally:
        la.close()
    assert res.contents == ref
    assert ga.journal(la.rid)["outcome"] == "completed"
    for i in range(2):  # at once, and again a moment later
        r = la.call(f"late_{i}")
        assert r.status_code == 409 and code(r) == "attempt_fenced", r.text
        assert executions(ga, f"{la.rid}:late_{i}") == []
    j = ga.journal(la.rid)
    assert j["outcome"] == "completed" and len(j["attempts"]) == 1


# 6 ------------------------------------------------------------------------------------


def test_forged_upstream_only_headers_never_reach_the_replica(ga: Gateway) -> None:
    forged_aid = "att_" + "7" * 26
    forged_secret = "forged-" + uuid.uuid4().hex
    handoff = json.dumps({"attempt": 1, "attempt_id": forged_aid, "lease_id": 1})
    ref = reference(ga, MAX)
    r = ga.post(ga.body(max_tokens=MAX), headers={
        SECRET_HEADER: forged_secret, "x-gateway-attempt-id": forged_aid,
        "x-gateway-preadmitted": forged_aid, "x-gateway-attempt-offset": "5",
        "x-gateway-attempt-handoff": handoff})
    assert r.status == 200 and r.transport_error is None and r.contents == ref
    aid = r.headers["x-gateway-attempt-id"]
    assert aid != forged_aid
    # Nothing upstream-only comes back to the client.
    assert SECRET_HEADER not in r.headers and "x-gateway-attempt-handoff" not in r.headers
    assert forged_secret not in r.raw.decode()
    # The replica got the gateway's attempt and secret, not the client's.
    assert attempt_secret(ga.stack, aid) != forged_secret
    with httpx.Client(timeout=5) as c:
        for port in ga.stack.replica_ports:
            assert c.get(f"http://127.0.0.1:{port}/debug/attempts/{forged_aid}/credential"
                         ).status_code == 404
    # The replica ran Envoy's attempt 1 (the forged offset did not move it).
    rows = ga.attempts_logged(r.request_id)
    assert [x["attempt"] for x in rows] == [1]
    j = ga.journal(r.request_id)
    assert j["outcome"] == "completed"
    assert [(a["attempt"], a["attempt_id"]) for a in j["attempts"]] == [(1, aid)]
    # And the forged secret runs nothing as that attempt.
    t = tool_call(ga.stack.tool_url, r.request_id, aid, "forged_1", forged_secret)
    assert t.status_code in (403, 409) and executions(ga, f"{r.request_id}:forged_1") == []


# 7 ------------------------------------------------------------------------------------


def test_the_status_lookup_across_tenants(ga: Gateway, gb: Gateway) -> None:
    key = "shared-" + uuid.uuid4().hex
    ra = ga.post(ga.body(max_tokens=MAX), key=key)
    assert ra.status == 200 and len(ra.contents) == MAX
    mine = ga.journal(ra.request_id)
    assert mine["request_id"] == ra.request_id and mine["outcome"] == "completed"
    unknown = RandomIds().request_id()
    theirs, missing = gb.status(ra.request_id), gb.status(unknown)
    assert theirs.status_code == missing.status_code == 404
    # The same answer as an id that does not exist, up to the id itself.
    assert theirs.text.replace(ra.request_id, "ID") == missing.text.replace(unknown, "ID")
    assert set(theirs.headers) - {"date", "x-envoy-upstream-service-time"} == \
        set(missing.headers) - {"date", "x-envoy-upstream-service-time"}
    # No API key, no lookup.
    with httpx.Client(base_url=ga.stack.base_url, timeout=10) as c:
        assert c.get(f"/v1/requests/{ra.request_id}").status_code == 401
    # The same Idempotency-Key from tenant B is its own request, run on its own.
    rb = gb.post(gb.body(max_tokens=MAX), key=key)
    assert rb.status == 200 and rb.request_id != ra.request_id and rb.contents == ra.contents
    assert len(ga.attempts_logged(rb.request_id)) == 1
    assert ga.status(rb.request_id).status_code == 404
    assert ga.journal(ra.request_id)["attempts"] == mine["attempts"]  # A's record untouched



def _warnings(log: Path) -> list[str]:
    out = []
    for line in log.read_text().splitlines():
        try:
            x = json.loads(line)
        except ValueError:
            continue
        if x.get("msg", "").startswith("tenancy is off"):
            out.append(x["msg"])
    return out


def test_the_processor_says_at_start_when_tenancy_is_off(sstack: Stack) -> None:
    """Decision 0030: off stays the processor's default, and it says so once at start-up;
    with tenancy on (this stack) it says nothing."""
    assert _warnings(sstack.workdir / "processor.log") == []
    cfg = {"server": {"listen": f"127.0.0.1:{free_port()}", "gateway_id": "tenancy-off"},
           "etcd": {"endpoints": [sstack.etcd_endpoint]}}
    path = sstack.workdir / "tenancy-off.yaml"
    path.write_text(json.dumps(cfg))
    log = sstack.workdir / "tenancy-off.log"
    p = Proc("tenancy-off", [sys.executable, "-m", "extproc", "serve", "--config", str(path)],
             log)
    p.start()
    try:
        wait_until(lambda: "processor listening" in log.read_text() or not p.alive(), 30,
                   "the second processor listening")
        assert p.alive(), log.read_text()[-2000:]
        (msg,) = _warnings(log)
        assert "set tenancy.api_key_header or tenancy.header" in msg
    finally:
        p.stop()

"""Side effects happen once: the tool-call ledger, end to end.

Replicas in agent mode call a demo tool server through the gateway's tool route; the tool
server logs every execution with its key, so the tests count side effects exactly.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from devkit.devstack import Stack

from .conftest import Gateway, Result, parse_events

pytestmark = pytest.mark.e2e

CONFIG: dict[str, Any] = {
    "etcd": {"attempt_lease_ttl_s": 3, "session_ttl_s": 3},
    "timeouts": {"first_delta_s": 2.0, "soft_first_delta_s": 0.5,
                 "stall_after_first_delta_s": 1.0, "access_log_wait_s": 0.5,
                 "fence_wait_s": 3.5},
    "tools": {"max_result_bytes": 4096, "wait_s": 5.0},
    "policy": {"retry_budget": {"min_retry_concurrency": 100000}},  # budgets: test_pool.py
}
MAX = 8


@pytest.fixture(scope="module")
def tstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = Stack(workdir=tmp_path_factory.mktemp("tools"), config=CONFIG, replicas=2,
               partition_proxies=True, tool_server=True).start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture
def tgw(tstack: Stack) -> Iterator[Gateway]:
    tstack.wait_replicas_healthy()
    g = Gateway(tstack)
    yield g
    g.client.close()


def executions(g: Gateway, key: str, settle_s: float = 0.5) -> list[dict[str, Any]]:
    time.sleep(settle_s)
    return [e for e in g.stack.tool_log() if e["key"] == key]


def agent_body(g: Gateway) -> dict[str, Any]:
    return g.body(max_tokens=MAX, tools=[{"type": "function", "function": {
        "name": "demo_tool", "parameters": {"type": "object"}}}])


def test_killed_before_any_delta_the_retry_gets_the_recorded_result(tgw: Gateway) -> None:
    res = tgw.post(agent_body(tgw), headers={"x-replica-tool-call": "call_07@1",
                                             "x-replica-fault": "kill-after-compute:3"})
    assert res.status == 200 and res.transport_error is None and len(res.contents) == MAX
    rows = tgw.attempts_logged(res.request_id)
    assert [r["attempt"] for r in rows] == [1, 2]
    (c1,), (c2,) = rows[0]["tool_calls"], rows[1]["tool_calls"]
    assert (c1["status"], c1["replayed"]) == (200, False)
    assert (c2["status"], c2["replayed"]) == (200, True)
    assert c1["result"] == c2["result"]  # the second attempt got the recorded result
    ex = executions(tgw, f"{res.request_id}:call_07")
    assert len(ex) == 1  # the action ran exactly once
    assert tgw.journal(res.request_id)["outcome"] == "completed"


def test_killed_after_the_first_delta_no_second_attempt_one_execution(tgw: Gateway) -> None:
    res = tgw.post(agent_body(tgw), headers={"x-replica-tool-call": "call_08@1",
                                             "x-replica-fault": "kill-after-deltas:2"})
    assert res.transport_error is not None and len(res.contents) == 2
    rows = tgw.attempts_logged(res.request_id)
    assert len(rows) == 1 and rows[0]["outcome"] == "killed"
    assert rows[0]["tool_calls"][0]["status"] == 200
    assert len(executions(tgw, f"{res.request_id}:call_08")) == 1
    j = tgw.journal(res.request_id)
    assert (j["outcome"], j["delivered_output_tokens"]) == ("upstream_decode_interrupted", 2)


def test_a_fenced_attempt_cannot_trigger_the_side_effect(tgw: Gateway) -> None:
    # Attempt 1 is partitioned after its headers; it is fenced when the first-delta limit
    # passes (revoked once Envoy confirms it closed the attempt); it calls the tool 3 s in,
    # after the fence, while attempt 2 runs.
    res = tgw.post(agent_body(tgw), headers={
        "x-partition": "after-deltas:0", "x-partition-attempt": "1",
        "x-replica-tool-call": "call_09@0+3.0", "x-replica-tool-delay-attempt": "1"})
    assert res.status == 200 and len(res.contents) == MAX
    # Attempt 2 answered long before the partitioned attempt 1 ends (3 s + its tokens).
    deadline = time.monotonic() + 10
    while len(rows := tgw.attempts_logged(res.request_id, settle_s=1.0)) < 2:
        assert time.monotonic() < deadline, rows
        time.sleep(0.2)
    rows.sort(key=lambda r: r["attempt"])
    assert [r["attempt"] for r in rows] == [1, 2]
    a1 = rows[0]["tool_calls"][0]
    assert a1["status"] == 409 and "a fenced attempt may not trigger" in a1["result"]
    a2 = rows[1]["tool_calls"][0]
    assert (a2["status"], a2["replayed"]) == (200, False)
    ex = executions(tgw, f"{res.request_id}:call_09")
    assert len(ex) == 1  # only the live attempt's call ran; the fenced one ran nothing
    j = tgw.journal(res.request_id)
    assert j["attempts"][0]["fence"] == "revoked" and j["attempts"][0]["envoy_closed"] is True
    assert j["outcome"] == "completed"


def attempt_secret(st: Stack, aid: str, timeout_s: float = 10.0) -> str:
    """The attempt's secret as its worker holds it: asked of the demo replica that served
    the attempt (its loopback test hook, GET /debug/attempts/<id>/credential), each replica
    in turn until one knows it."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as c:
        while True:
            for port in st.replica_ports:
                try:
                    r = c.get(f"http://127.0.0.1:{port}/debug/attempts/{aid}/credential")
                except httpx.HTTPError:
                    continue  # a replica restarting after a kill
                if r.status_code == 200:
                    secret: str = r.json()["secret"]
                    return secret
            assert time.monotonic() < deadline, f"no replica knows attempt {aid}"
            time.sleep(0.1)


def tool_call(url: str, rid: str, aid: str, call_id: str, secret: str | None,
              **headers: str) -> httpx.Response:
    """One call of the demo tool as a worker makes it (the secret left out when None)."""
    h = {"x-gateway-request-id": rid, "x-gateway-attempt-id": aid,
         "x-tool-call-id": call_id, **headers}
    if secret is not None:
        h["x-gateway-attempt-secret"] = secret
    with httpx.Client(base_url=url, timeout=30) as c:
        return c.post("/tools/demo_tool", json={"q": call_id}, headers=h)


class LiveAttempt:
    """A slow stream held open, so tests can call the tool route as its live attempt's own
    worker: on the tool listener, with the secret the gateway gave the replica."""

    def __init__(self, g: Gateway, max_tokens: int = 400, token_delay_ms: int = 100,
                 headers: dict[str, str] | None = None) -> None:
        self.stack = g.stack
        self.client = httpx.Client(base_url=g.stack.base_url, timeout=30,
                                   headers=g.client.headers)
        # max_tokens: by default long enough to outlive every test using it (the fixture
        # closes it); a finished attempt is fenced.
        self.body = g.body(max_tokens=max_tokens)
        self.cm = self.client.stream(
            "POST", "/v1/chat/completions", json=self.body,
            headers={"x-replica-token-delay-ms": str(token_delay_ms), **(headers or {})})
        self.response = self.cm.__enter__()
        self.rid = self.response.headers["x-gateway-request-id"]
        self.aid = self.response.headers["x-gateway-attempt-id"]
        self.secret = attempt_secret(self.stack, self.aid)

    def call(self, call_id: str, *, secret: str | None = None, no_secret: bool = False,
             url: str | None = None, **headers: str) -> httpx.Response:
        """A tool call as this attempt (its real secret unless told another, or none)."""
        return tool_call(url or self.stack.tool_url, self.rid, self.aid, call_id,
                         None if no_secret else (secret or self.secret), **headers)

    def rest(self) -> Result:
        """Read the stream to its end: what the client got, as `Gateway.post` gives it."""
        raw = b""
        err: str | None = None
        try:
            for chunk in self.response.iter_raw():
                raw += chunk
        except httpx.HTTPError as e:
            err = f"{type(e).__name__}: {e}"
        return Result(status=self.response.status_code, headers=dict(self.response.headers),
                      raw=raw, transport_error=err, events=parse_events(raw))

    def close(self) -> None:
        self.cm.__exit__(None, None, None)
        self.client.close()


@pytest.fixture
def live(tgw: Gateway) -> Iterator[LiveAttempt]:
    la = LiveAttempt(tgw)
    yield la
    la.close()


@pytest.mark.parametrize("n", [2, 8])
def test_concurrent_duplicates_execute_once(tgw: Gateway, live: LiveAttempt, n: int) -> None:
    cid = f"dup_{n}"
    with ThreadPoolExecutor(n) as pool:
        rs = list(pool.map(lambda _: live.call(cid, **{"x-tool-delay-ms": "300"}), range(n)))
    assert [r.status_code for r in rs] == [200] * n
    assert len({r.content for r in rs}) == 1  # everyone sees the same result
    assert sorted(r.headers.get("x-tool-replayed", "false") for r in rs) == \
        ["false"] + ["true"] * (n - 1)
    assert len(executions(tgw, f"{live.rid}:{cid}")) == 1


def test_tool_failure_and_oversized_and_dead_executor(tgw: Gateway, live: LiveAttempt) -> None:
    # A failing tool's answer is recorded and replayed: never run twice silently.
    a, b = live.call("fail_1", **{"x-tool-status": "500"}), live.call("fail_1")
    assert a.status_code == b.status_code == 500 and a.content == b.content
    assert b.headers["x-tool-replayed"] == "true"
    assert len(executions(tgw, f"{live.rid}:fail_1")) == 1
    # Too large to record: delivered once, then refused (not replayable, not re-run).
    big = live.call("big_1", **{"x-tool-result-bytes": "10000"})
    assert big.status_code == 200 and len(big.content) > 10000
    again = live.call("big_1")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "tool_result_not_replayable"
    assert len(executions(tgw, f"{live.rid}:big_1")) == 1
    # The tool server dies mid-answer: the outcome is unknown and never retried.
    with pytest.raises(httpx.RemoteProtocolError):  # the caller sees a broken answer
        live.call("die_1", **{"x-tool-fault": "die-after-execute"})
    tools = tgw.stack.procs["tools"]
    tools.popen.wait(5)  # type: ignore[union-attr]
    tools.start()
    time.sleep(0.5)
    after = live.call("die_1")
    assert after.status_code == 409
    assert after.json()["error"]["code"] == "tool_call_outcome_unknown"
    assert len(executions(tgw, f"{live.rid}:die_1")) == 1


def test_etcd_frozen_briefly_and_beyond_the_timeout(tgw: Gateway, live: LiveAttempt) -> None:
    etcd = tgw.stack.procs["etcd"]
    box: dict[str, httpx.Response] = {}
    # Frozen for less than the etcd deadline (1 s): the call just waits and runs.
    t = threading.Thread(target=lambda: box.setdefault("a", live.call("frz_1")))
    etcd.signal(signal.SIGSTOP)
    t.start()
    time.sleep(0.4)
    etcd.signal(signal.SIGCONT)
    t.join(10)
    assert box["a"].status_code == 200
    assert len(executions(tgw, f"{live.rid}:frz_1")) == 1
    # Frozen beyond it: fail closed, no execution without a ledger record.
    etcd.signal(signal.SIGSTOP)
    try:
        r = live.call("frz_2")
    finally:
        etcd.signal(signal.SIGCONT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "journal_unavailable"
    assert executions(tgw, f"{live.rid}:frz_2") == []
    # Once etcd is back (and any half-applied claim taken back), the call runs once.
    deadline = time.monotonic() + 10
    while True:
        r2 = live.call("frz_2")
        if r2.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r2.status_code == 200
    assert len(executions(tgw, f"{live.rid}:frz_2")) == 1


def test_bad_tool_calls_are_refused(tgw: Gateway, live: LiveAttempt) -> None:
    c = httpx.Client(base_url=tgw.stack.tool_url, timeout=10)
    r = c.post("/tools/demo_tool", json={}, headers={"x-tool-call-id": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_header"
    # Another attempt id of the same request, with the live attempt's secret: that attempt
    # has no credential, so the call is not authorized (docs/security.md).
    r = live.call("stranger", **{"x-gateway-attempt-id": "att_" + "0" * 26})
    assert r.status_code == 403 and r.json()["error"]["code"] == "tool_call_unauthorized"
    assert executions(tgw, f"{live.rid}:stranger") == []

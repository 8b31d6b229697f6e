"""The mission's failover rules, end to end through real Envoy, etcd and replicas.

Each test compares, per request_id: the exact event list the client received, the attempts
each replica logged, and the journal record. Never just HTTP codes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from devkit.devstack import Stack

from .conftest import Gateway, Result

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["grpcio", "grpclib", "grpcio-keyless"])
def gw(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    """These rules on both gRPC stacks the processor can serve on (decision 0020), and for
    requests without an Idempotency-Key, whose intake commits while Envoy routes them
    (decision 0021)."""
    st: Stack = request.getfixturevalue("stack_grpclib" if request.param == "grpclib"
                                        else "stack")
    st.wait_replicas_healthy()
    g = Gateway(st, keyed=request.param != "grpcio-keyless")
    yield g
    g.client.close()

MAX = 8


def reference(gw: Gateway, stream: bool = True, path: str = "chat") -> Result:
    body = gw.body(stream=stream, max_tokens=MAX, path=path)
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    r = gw.post(body, path=url)
    assert r.status == 200 and r.transport_error is None
    return r


def fault(gw: Gateway, kind: str, stream: bool = True, path: str = "chat",
          **kw: object) -> Result:
    body = gw.body(stream=stream, max_tokens=MAX, path=path)
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    return gw.post(body, headers={"x-replica-fault": kind}, path=url, **kw)  # type: ignore[arg-type]


def assert_complete_after_retry(gw: Gateway, res: Result, ref: Result,
                                first_outcome: str, written_by_first: int) -> None:
    assert res.status == 200, res.raw
    assert res.transport_error is None
    assert res.normalized() == ref.normalized()  # byte-identical content, same event list
    assert len(res.contents) == MAX
    rows = gw.attempts_logged(res.request_id)
    assert [r["attempt"] for r in rows] == [1, 2]
    assert rows[0]["outcome"] == first_outcome
    assert rows[0]["tokens_written"] == written_by_first
    assert rows[1]["outcome"] == "completed" and rows[1]["fault"] is None
    assert rows[0]["replica"] != rows[1]["replica"]
    j = gw.journal(res.request_id)
    assert j["outcome"] == "completed"
    assert j["first_delta_sent"] is True
    assert j["attempt"] == 2 and len(j["attempts"]) == 2
    assert j["delivered_output_tokens"] == MAX
    assert j["retry_budget"] == 0


@pytest.mark.parametrize("kind", ["kill-before-headers", "kill-after-headers"])
def test_kill_before_first_delta_gives_one_complete_answer(gw: Gateway, kind: str) -> None:
    ref = reference(gw)
    res = fault(gw, kind)
    assert_complete_after_retry(gw, res, ref, "killed", 0)


def test_kill_after_compute_never_shows_the_fragment(gw: Gateway) -> None:
    ref = reference(gw)
    res = fault(gw, "kill-after-compute:3")
    assert_complete_after_retry(gw, res, ref, "killed", 0)
    rows = gw.attempts_logged(res.request_id)
    assert rows[0]["tokens_computed"] == 3


@pytest.mark.parametrize("n", [1, 5])
def test_kill_after_delivered_deltas_ends_with_error_and_no_retry(gw: Gateway, n: int) -> None:
    ref = reference(gw)
    key = f"kill-after-{n}-{time.time_ns()}"
    res = fault(gw, f"kill-after-deltas:{n}", key=key)
    assert res.status == 200
    # The connection was physically reset: the client gets exactly n deltas, then a
    # transport error (no byte-level hook exists to inject an event after a reset).
    assert res.transport_error is not None
    assert res.contents == ref.contents[:n]
    assert res.normalized() == ref.normalized()[: n + 1]  # role event + n deltas, nothing else
    rows = gw.attempts_logged(res.request_id)
    assert [(r["attempt"], r["outcome"], r["tokens_written"]) for r in rows] == [(1, "killed", n)]
    j = gw.journal(res.request_id)
    assert j["first_delta_sent"] is True
    assert j["delivered_output_tokens"] == n
    assert j["outcome"] == "upstream_decode_interrupted"
    assert j["cause"] == "upstream"
    assert len(j["attempts"]) == 1
    assert j["error"] == {
        "message": "Generation was interrupted after part of the answer was sent",
        "type": "server_error", "code": "upstream_decode_interrupted",
        "request_id": res.request_id, "partial_output": True, "retryable": False,
        "delivered_output_tokens": n, "delivered_output_tokens_exact": True,
    }
    assert j["delivered_output_tokens_source"] == "engine"  # the replica's running usage
    # The client repeats the request with the same Idempotency-Key: the recorded outcome,
    # never a second run.
    again = gw.post(gw.body(max_tokens=MAX), key=key)
    assert again.status == 409
    assert again.error is not None
    assert again.error["code"] == "upstream_decode_interrupted"
    assert again.error["request_id"] == res.request_id
    assert again.error["delivered_output_tokens"] == n
    assert again.error["delivered_output_tokens_exact"] is True
    assert again.error["retryable"] is False and again.error["partial_output"] is True
    assert gw.attempts_logged(res.request_id) == rows  # nothing new ran


def test_stall_after_deltas_is_ended_by_the_watchdog(gw: Gateway) -> None:
    ref = reference(gw)
    res = fault(gw, "stall-after-deltas:2")
    assert res.status == 200 and res.transport_error is None
    assert res.normalized()[:3] == ref.normalized()[:3]
    assert res.events[3] == {"error": {
        "message": "Generation was interrupted after part of the answer was sent",
        "type": "server_error", "code": "upstream_decode_interrupted",
        "request_id": res.request_id, "partial_output": True, "retryable": False,
        "delivered_output_tokens": 2, "delivered_output_tokens_exact": True}}
    assert res.events[4:] == ["[DONE]"]
    rows = gw.attempts_logged(res.request_id)
    assert len(rows) == 1
    assert rows[0]["peer_closed"] is True and rows[0]["outcome"] == "stalled_peer_closed"
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["cause"], j["delivered_output_tokens"]) == (
        "upstream_decode_interrupted", "stall", 2)


def test_in_band_error_after_deltas_is_replaced_by_ours(gw: Gateway) -> None:
    ref = reference(gw)
    res = fault(gw, "error-after-deltas:2")
    assert res.status == 200 and res.transport_error is None
    assert res.normalized()[:3] == ref.normalized()[:3]
    err = res.error
    assert err is not None and err["code"] == "upstream_decode_interrupted"
    assert err["delivered_output_tokens"] == 2
    assert "demo replica fault" not in res.raw.decode()
    assert res.events[-1] == "[DONE]" and len(res.events) == 5
    rows = gw.attempts_logged(res.request_id)
    assert [(r["attempt"], r["outcome"]) for r in rows] == [(1, "error_injected")]
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["cause"]) == ("upstream_decode_interrupted", "in-band error")


def test_in_band_error_before_any_delta_is_retried(gw: Gateway) -> None:
    ref = reference(gw)
    res = fault(gw, "error-after-deltas:0")
    assert_complete_after_retry(gw, res, ref, "error_injected", 0)


def test_client_disconnect_cancels_upstream_and_starts_nothing(gw: Gateway) -> None:
    body = gw.body(max_tokens=400)
    res = gw.post(body, headers={"x-replica-token-delay-ms": "20"}, stop_after_contents=3)
    assert res.transport_error == "client closed"
    t_closed = time.time()
    rows = gw.attempts_logged(res.request_id, settle_s=3.0)
    assert len(rows) == 1
    assert rows[0]["peer_closed"] is True and rows[0]["outcome"] == "peer_closed"
    assert rows[0]["ts"] - t_closed < 1.0  # the replica saw the close within 1 s
    assert rows[0]["tokens_written"] < 400
    j = gw.journal(res.request_id)
    assert j["outcome"] == "client_disconnected" and j["cause"] == "client"
    assert len(j["attempts"]) == 1
    assert j["delivered_output_tokens"] >= 3


def test_slow_first_delta_is_not_a_failure(gw: Gateway) -> None:
    ref = reference(gw)
    res = fault(gw, "slow-first-delta:1.5")  # the first-delta limit is 5 s in these tests
    assert res.status == 200 and res.normalized() == ref.normalized()
    rows = gw.attempts_logged(res.request_id)
    assert [(r["attempt"], r["outcome"]) for r in rows] == [(1, "completed")]
    assert gw.journal(res.request_id)["attempt"] == 1


def test_openai_sdk_raises_api_error_with_our_code(gw: Gateway) -> None:
    client = openai.OpenAI(base_url=gw.stack.base_url + "/v1", api_key="unused",
                           max_retries=0)
    got: list[str] = []
    with pytest.raises(openai.APIError) as ei:
        stream = client.chat.completions.create(
            model="demo-model", stream=True, max_tokens=MAX,
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={"x-replica-fault": "stall-after-deltas:2"})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
    body = ei.value.body
    assert isinstance(body, dict)
    assert body["code"] == "upstream_decode_interrupted"
    assert body["delivered_output_tokens"] == 2 == len(got)


@pytest.mark.parametrize("kind", ["kill-before-headers", "kill-after-deltas:3"])
def test_non_streaming_retries_until_the_body_is_complete(gw: Gateway, kind: str) -> None:
    ref = reference(gw, stream=False)
    res = fault(gw, kind, stream=False)
    assert res.status == 200 and res.transport_error is None
    assert res.normalized() == ref.normalized()
    rows = gw.attempts_logged(res.request_id)
    assert [(r["attempt"], r["outcome"], r["tokens_written"]) for r in rows] == [
        (1, "killed", 0), (2, "completed", MAX)]
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["attempt"], j["delivered_output_tokens"]) == ("completed", 2, MAX)


def test_legacy_completions_stream_counts_text_deltas(gw: Gateway) -> None:
    ref = reference(gw, path="completions")
    res = fault(gw, "kill-before-headers", path="completions")
    assert res.normalized() == ref.normalized() and len(res.contents) == MAX
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["delivered_output_tokens"], j["attempt"]) == ("completed", MAX, 2)


def test_repeat_of_a_completed_request_runs_nothing(gw: Gateway) -> None:
    key = f"done-{time.time_ns()}"
    first = gw.post(gw.body(max_tokens=4), key=key)
    assert first.status == 200 and len(first.contents) == 4
    gw.journal(first.request_id)
    again = gw.post(gw.body(max_tokens=4), key=key)
    assert again.status == 409 and again.error is not None
    assert again.error["code"] == "request_already_completed"
    assert again.error["request_id"] == first.request_id
    assert len(gw.attempts_logged(first.request_id)) == 1


def test_a_used_key_with_another_body_is_refused_and_runs_nothing(gw: Gateway) -> None:
    key = f"reused-{time.time_ns()}"
    first = gw.post(gw.body(max_tokens=4), key=key)
    assert first.status == 200 and len(first.contents) == 4
    before = gw.journal(first.request_id)
    for other in (gw.body(max_tokens=5), gw.body(max_tokens=4, prompt="another question"),
                  gw.body(max_tokens=4, temperature=0.9)):
        again = gw.post(other, key=key)
        assert again.status == 422 and again.error is not None, again.raw[:300]
        assert again.error["code"] == "idempotency_key_reused"
        assert key in again.error["message"] and again.error["request_id"] == first.request_id
        assert "delivered_output_tokens" not in again.error  # nothing of the first is told
    # The record is the first request's, untouched; no replica saw a second run.
    after = gw.journal(first.request_id)
    assert (after["outcome"], after["attempts"]) == (before["outcome"], before["attempts"])
    assert len(gw.attempts_logged(first.request_id)) == 1
    # The same request, spelled differently (key order), is still a repeat.
    respelled = dict(reversed(list(gw.body(max_tokens=4).items())))
    same = gw.post(respelled, key=key)
    assert same.status == 409 and same.error is not None
    assert same.error["code"] == "request_already_completed"


def test_every_response_carries_the_request_id(gw: Gateway) -> None:
    ok = gw.post(gw.body(max_tokens=2))
    assert ok.request_id.startswith("req_")
    bad = gw.post({"stream": "yes"})
    assert bad.status == 400 and bad.headers["x-gateway-request-id"].startswith("req_")

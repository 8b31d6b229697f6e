"""Exact delivered token counts (decision 0018), end to end through real Envoy and etcd.

The demo replica merges tokens into one event (`x-replica-tokens-per-event`), as an engine
under load does: a count of events then says less than the client got. The gateway asks the
replica for its running usage, strips it from what the client receives (the stream is the
one the client would have had without it), and reports the engine's count, said to be
exact. Where the engine gives none (Responses, Messages deltas), a configured tokenizer or
the events count, said not to be exact.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devkit.devstack import Stack

from .conftest import E2E_CONFIG, Gateway, Result, parse_events, word_tokenizer

pytestmark = pytest.mark.e2e

MAX = 12
PER = 3  # tokens per event
MERGE = {"x-replica-tokens-per-event": str(PER)}


def direct(stack: Stack, body: dict[str, Any], headers: dict[str, str],
           path: str = "/v1/chat/completions") -> Result:
    """The same request straight to a replica: the stream the client would have had."""
    port = stack.replica_ports[0]
    r = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, headers=headers, timeout=30)
    assert r.status_code == 200
    return Result(status=200, headers=dict(r.headers), raw=r.content, transport_error=None,
                  events=parse_events(r.content))


def usages(res: Result) -> list[Any]:
    return [e.get("usage") for e in res.events if isinstance(e, dict) and "usage" in e]


@pytest.mark.parametrize("path", ["chat", "completions"])
def test_the_client_gets_the_stream_it_would_have_had(gw: Gateway, path: str) -> None:
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    body = gw.body(max_tokens=MAX, path=path)
    res = gw.post(body, headers=MERGE, path=url)
    want = direct(gw.stack, body, MERGE, url)
    assert res.status == 200 and res.transport_error is None
    assert res.normalized() == want.normalized()  # no usage anywhere: it asked for none
    assert usages(res) == [] and len(res.contents) == MAX // PER
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["delivered_output_tokens"], j["delivered_output_tokens_exact"],
            j["delivered_output_tokens_source"]) == ("completed", MAX, True, "engine")


def test_a_client_asking_for_usage_gets_exactly_what_it_asked_for(gw: Gateway) -> None:
    final = gw.body(max_tokens=MAX, stream_options={"include_usage": True})
    res = gw.post(final, headers=MERGE)
    want = direct(gw.stack, final, MERGE)
    assert res.normalized() == want.normalized()
    assert usages(res) == [{"prompt_tokens": want.events[-2]["usage"]["prompt_tokens"],  # type: ignore[index]
                            "completion_tokens": MAX,
                            "total_tokens": want.events[-2]["usage"]["total_tokens"]}]  # type: ignore[index]
    both = gw.body(max_tokens=MAX, stream_options={"include_usage": True,
                                                   "continuous_usage_stats": True})
    res = gw.post(both, headers=MERGE)
    assert res.normalized() == direct(gw.stack, both, MERGE).normalized()
    running = [u["completion_tokens"] for u in usages(res)]
    assert running == [0, 3, 6, 9, 12, 12, 12]  # role, 4 merged deltas, finish, usage chunk
    assert gw.journal(res.request_id)["delivered_output_tokens"] == MAX


def test_a_kill_after_merged_deltas_reports_the_engines_count(gw: Gateway) -> None:
    key = f"merged-{time.time_ns()}"
    res = gw.post(gw.body(max_tokens=MAX), key=key,
                  headers={**MERGE, "x-replica-fault": "kill-after-deltas:2"})
    assert res.status == 200 and res.transport_error is not None
    assert len(res.contents) == 2 and usages(res) == []  # two events, six tokens
    rows = gw.attempts_logged(res.request_id)
    assert [(r["attempt"], r["outcome"], r["tokens_written"]) for r in rows] == [
        (1, "killed", 2 * PER)]
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["delivered_output_tokens"], j["delivered_output_tokens_exact"],
            j["delivered_output_tokens_source"]) == (
        "upstream_decode_interrupted", 2 * PER, True, "engine")
    assert j["error"]["delivered_output_tokens"] == 2 * PER
    assert j["error"]["delivered_output_tokens_exact"] is True
    again = gw.post(gw.body(max_tokens=MAX), key=key)
    assert again.status == 409 and again.error is not None
    assert (again.error["delivered_output_tokens"],
            again.error["delivered_output_tokens_exact"]) == (2 * PER, True)


def test_a_stall_after_merged_deltas_ends_with_the_engines_count(gw: Gateway) -> None:
    res = gw.post(gw.body(max_tokens=MAX),
                  headers={**MERGE, "x-replica-fault": "stall-after-deltas:3"})
    assert res.status == 200 and res.transport_error is None and res.events[-1] == "[DONE]"
    assert res.error is not None
    assert (res.error["code"], res.error["delivered_output_tokens"],
            res.error["delivered_output_tokens_exact"]) == (
        "upstream_decode_interrupted", 3 * PER, True)
    assert usages(res) == []


def test_responses_deltas_carry_no_count_so_events_are_counted_and_said_so(
        gw: Gateway) -> None:
    body = {"model": "demo-model", "input": "hello", "stream": True, "max_output_tokens": MAX,
            "seed": 7}
    res = gw.post(body, path="/v1/responses",
                  headers={**MERGE, "x-replica-fault": "stall-after-deltas:2"})
    failed = [e for e in res.events if isinstance(e, dict)
              and e.get("type") == "response.failed"]
    assert len(failed) == 1
    err = failed[0]["response"]["error"]
    assert (err["delivered_output_tokens"], err["delivered_output_tokens_exact"]) == (2, False)
    j = gw.journal(res.headers["x-gateway-request-id"])
    assert (j["delivered_output_tokens"], j["delivered_output_tokens_source"]) == (2, "events")
    # Complete, the answer's own usage counts it exactly.
    ok = gw.post(body, path="/v1/responses", headers=MERGE)
    j = gw.journal(ok.headers["x-gateway-request-id"])
    assert (j["outcome"], j["delivered_output_tokens"], j["delivered_output_tokens_exact"]) == (
        "completed", MAX, True)


# --- a configured tokenizer, and the option turned off ---------------------------------------


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    wd: Path = tmp_path_factory.mktemp("tok-stack")
    cfg = json.loads(json.dumps(E2E_CONFIG))
    cfg["accounting"] = {"engine_usage": False,
                         "tokenizers": {"demo-model": str(word_tokenizer(wd / "tok.json"))}}
    st = Stack(workdir=wd, config=cfg, replicas=2).start()
    try:
        st.wait_replicas_healthy()
        g = Gateway(st)
        yield g
        g.client.close()
    finally:
        st.stop()


@pytest.mark.parametrize("family", ["chat", "responses", "messages"])
def test_a_tokenizer_counts_what_was_delivered(counted: Gateway, family: str) -> None:
    if family == "chat":
        path, body = "/v1/chat/completions", counted.body(max_tokens=MAX)
    elif family == "responses":
        path, body = "/v1/responses", {"model": "demo-model", "input": "hello",
                                       "stream": True, "max_output_tokens": MAX, "seed": 7}
    else:
        path, body = "/v1/messages", {"model": "demo-model", "max_tokens": MAX, "stream": True,
                                      "messages": [{"role": "user", "content": "hello"}]}
    res = counted.post(body, path=path,
                       headers={**MERGE, "x-replica-fault": "stall-after-deltas:2"})
    rid = res.headers["x-gateway-request-id"]
    j = counted.journal(rid)
    assert (j["outcome"], j["delivered_output_tokens"], j["delivered_output_tokens_exact"],
            j["delivered_output_tokens_source"]) == (
        "upstream_decode_interrupted", 2 * PER, False, "tokenizer")
    if family == "chat":
        # engine_usage off: the replica was not asked, and chunks carry no usage.
        assert usages(res) == [] and res.error is not None
        assert res.error["delivered_output_tokens"] == 2 * PER

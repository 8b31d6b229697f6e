"""Without faults the gateway is invisible: the client gets exactly what vLLM sends.

Each request also goes straight to both replicas (no Envoy): greedy decoding gives the same
chunks on either, and the gateway's chunk list equals them. The role-only first event
(`delta: {"role": "assistant", "content": ""}`) and the usage event are not output: the
journal's `delivered_output_tokens` is exactly `max_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from .conftest import MEASURED, Client, Engines, Result, assert_same_stream, long_prompt

MAX = 24


def assert_one_clean_attempt(gw: Client, engines: Engines, res: Result, n: int,
                             stream: bool = True) -> dict[str, Any]:
    assert res.status == 200 and res.transport_error is None, res.raw[:500]
    j = gw.journal(res.request_id)
    assert j["outcome"] == "completed" and j["cause"] is None
    assert j["first_delta_sent"] is True
    # The engine's own count (decision 0018): the gateway asked vLLM for its running usage
    # and took it out again; vLLM may merge tokens into one event under CPU load, the count
    # is still the tokens'.
    assert j["delivered_output_tokens"] == n
    assert (j["delivered_output_tokens_exact"], j["delivered_output_tokens_source"]) == (
        True, "engine")
    assert j["stream"] is stream
    assert j["attempt"] == 1 and len(j["attempts"]) == 1
    assert j["attempts"][0]["failure_class"] == "completed"
    # vLLM saw the request exactly once, on one replica, and never aborted it.
    assert len(engines.who_received(res.xrid)) == 1
    assert not any(engines.aborted(name, res.xrid) for name in engines.names)
    return j


@pytest.mark.parametrize(("path", "usage"), [
    ("chat", False), ("chat", True), ("completions", False), ("completions", True)])
def test_stream_is_the_engines_own(gw: Client, engines: Engines,
                                   direct: Callable[[str], Client], path: str,
                                   usage: bool) -> None:
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
    body = Client.body(max_tokens=MAX, path=path, **extra)
    ones = [direct(name).post(body, path=url) for name in engines.names]
    for d in ones:
        assert d.status == 200 and d.transport_error is None
        assert d.events[-1] == "[DONE]"
    assert_same_stream(ones[0], ones[1])  # same text on either replica
    res = gw.post(body, path=url)
    assert_same_stream(res, ones[0])  # the gateway adds and drops nothing
    assert res.events[-1] == "[DONE]"
    if path == "chat":
        first = res.events[0]
        assert isinstance(first, dict)
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    if usage:
        last = res.events[-2]
        assert isinstance(last, dict) and last["choices"] == []
        assert last["usage"]["completion_tokens"] == MAX
    assert_one_clean_attempt(gw, engines, res, MAX)
    MEASURED.setdefault("stream_events_for_tokens", []).append([len(res.contents), MAX])


@pytest.mark.parametrize("path", ["chat", "completions"])
def test_non_streaming_body_is_the_engines_own(gw: Client, engines: Engines,
                                               direct: Callable[[str], Client],
                                               path: str) -> None:
    url = "/v1/chat/completions" if path == "chat" else "/v1/completions"
    body = Client.body(max_tokens=MAX, path=path, stream=False)
    ref = direct(engines.names[0]).post(body, path=url)
    assert ref.status == 200 and len(ref.events) == 1
    res = gw.post(body, path=url)
    assert res.normalized() == ref.normalized()
    body0 = res.events[0]
    assert isinstance(body0, dict)
    assert body0["choices"][0]["finish_reason"] == "length"
    assert body0["usage"]["completion_tokens"] == MAX
    # Non-streaming: the journal takes the count from the body's usage.
    assert_one_clean_attempt(gw, engines, res, MAX, stream=False)


def test_greedy_is_deterministic_and_measured(gw: Client, engines: Engines,
                                              direct: Callable[[str], Client]) -> None:
    """The basis of every comparison in this suite, plus the engine's own speed."""
    prompt = long_prompt()
    body = Client.body(max_tokens=64, prompt=prompt, stream_options={"include_usage": True})
    per: dict[str, Any] = {}
    texts = []
    for name in engines.names:
        runs = [direct(name).post(body) for _ in range(2)]
        for r in runs:
            assert r.status == 200 and r.events[-2]["usage"]["completion_tokens"] == 64  # type: ignore[index]
        texts += [r.text for r in runs]
        r = runs[-1]
        decode_s = r.t_end - (r.t_first_content or r.t_end)
        per[name] = {"ttft_s": round(r.ttft_s or 0, 3),
                     "decode_tok_s": round(63 / decode_s, 1) if decode_s > 0 else None,
                     "events_for_64_tokens": len(r.contents)}
    assert len(set(texts)) == 1
    usage = direct(engines.names[0]).post(Client.body(max_tokens=1, prompt=prompt,
                                                      stream=False))
    MEASURED["long_prompt_tokens"] = usage.events[0]["usage"]["prompt_tokens"]  # type: ignore[index]
    MEASURED["direct_long_prompt"] = per
    MEASURED["memory_per_replica"] = engines.memory()
    res = gw.post(body)
    assert res.text == texts[0]
    MEASURED["gateway_long_prompt_ttft_s"] = round(res.ttft_s or 0, 3)

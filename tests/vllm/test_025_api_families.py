"""The Responses (`/v1/responses`) and Anthropic Messages (`/v1/messages`) APIs of real vLLM
0.32.0 behind the gateway: a kill before the first delta is re-run invisibly (one lifecycle,
the fault-free text), a kill after it ends the stream with what was delivered and no second
run, and a replica frozen after delivery ends with the family's own terminal event.

vLLM names a Responses request by its body's `request_id` (a vLLM extension; Envoy re-sends
the same body to each attempt, so each run here sets `resp_<x-request-id>` and vLLM logs
`resp_<x-request-id>_0`); a Messages request is run as a chat completion and logged as
`chatcmpl-<x-request-id>`.

Named to run before test_03, whose SIGTERM tests leave a replica stopping: they were the
last of the run, and a replica still exiting when the next test's fixture looks is not
restarted by it (the `engines` fixture below also waits such a replica out).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from devkit.devstack import Stack

from .conftest import (
    MEASURED,
    MODEL,
    Client,
    Engines,
    Result,
    engine_tokens,
    long_prompt,
    new_xrid,
)

PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}
HEAD = {"responses": ["response.created", "response.in_progress",
                      "response.output_item.added", "response.content_part.added"],
        "messages": ["message_start", "content_block_start"]}
DELTA = {"responses": "response.output_text.delta", "messages": "content_block_delta"}
END = {"responses": "response.completed", "messages": "message_stop"}
FAMILIES = ["responses", "messages"]


def _answers(e: Engines, name: str, tries: int = 3) -> bool:
    for _ in range(tries):
        if e.healthy(name):
            return True
        time.sleep(1.0)
    return False


@pytest.fixture
def engines(vstack: Stack) -> Engines:
    """As the conftest's, but a replica alive and not answering /health (an earlier SIGTERM
    left it exiting, or hung with its engine gone) is waited out, then killed, so that
    `ensure_all_healthy` restarts it instead of waiting for it forever."""
    e = Engines(vstack)
    for name in e.names:
        if not e.proc(name).alive():
            continue
        if _answers(e, name):
            continue
        try:
            e.wait_gone(name, timeout_s=20)
        except TimeoutError:
            e.kill(name, signal.SIGKILL)
            e.wait_gone(name, timeout_s=30)
    e.ensure_all_healthy()
    return e


def body(family: str, xrid: str, max_tokens: int = 16, prompt: str = "hello there",
         stream: bool = True) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "stream": stream, "temperature": 0, "seed": 7}
    if family == "responses":
        b.update(input=prompt, max_output_tokens=max_tokens, request_id=f"resp_{xrid}")
    else:
        b.update(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
    return b


def assert_tokenizer_count(gw: Client, j: dict[str, Any], family: str, got: str,
                           events: int, max_tokens: int, key: str) -> None:
    """No running count in these families' deltas: the model's tokenizer re-encoded the
    delivered text (decision 0018), checked against the engine's own count of it."""
    assert (j["delivered_output_tokens_exact"], j["delivered_output_tokens_source"]) == (
        False, "tokenizer")
    n = j["delivered_output_tokens"]
    assert n >= events
    ask = {k: v for k, v in body(family, new_xrid(), max_tokens).items() if k != "request_id"}
    truth = engine_tokens(gw, ask, got, PATHS[family], lo=events)
    MEASURED.setdefault("tokenizer_vs_engine", {})[f"{key}-{family}"] = {
        "events": events, "tokenizer": n, "engine": sorted(truth)}
    assert n in truth


def types(res: Result) -> list[str]:
    return [str(e.get("type")) for e in res.events if isinstance(e, dict)]


def text(family: str, res: Result) -> str:
    out = []
    for e in res.events:
        if isinstance(e, dict) and e.get("type") == DELTA[family]:
            out.append(e["delta"] if family == "responses" else e["delta"].get("text", ""))
    return "".join(out)


def run(gw: Client, family: str, max_tokens: int = 16, prompt: str = "hello there",
        xrid: str | None = None, on_delta: Any = None) -> Result:
    xrid = xrid or new_xrid()
    count = [0]
    first: list[float] = []

    def cb(n: int, ev: Any) -> str | None:
        if isinstance(ev, dict) and ev.get("type") == DELTA[family]:
            count[0] += 1
            if not first:
                first.append(time.monotonic())
            if on_delta is not None:
                return on_delta(count[0])  # type: ignore[no-any-return]
        return None

    res = gw.post(body(family, xrid, max_tokens, prompt), path=PATHS[family], xrid=xrid,
                  on_event=cb)
    res.t_first_content = first[0] if first else None  # the Client counts chat chunks only
    return res


def not_rest(family: str, res: Result) -> list[str]:
    """The stream's event types, with the run of deltas as one (vLLM may coalesce tokens
    into one event under CPU load: the text is the same, the event count is not)."""
    out: list[str] = []
    for t in types(res):
        if t == DELTA[family] and out and out[-1] == t:
            continue
        out.append(t)
    return out


def reference(gw: Client, family: str, **kw: Any) -> Result:
    ref = run(gw, family, **kw)
    assert ref.status == 200 and ref.transport_error is None, ref.raw[:400]
    assert types(ref)[: len(HEAD[family])] == HEAD[family] and types(ref)[-1] == END[family]
    assert "[DONE]" not in ref.events
    return ref


def wait_received(engines: Engines, xrid: str, timeout_s: float = 15.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = engines.who_received(xrid)
        if got:
            return got[0]
        time.sleep(0.01)
    raise TimeoutError(f"no replica logged {xrid}")


@pytest.mark.parametrize("family", FAMILIES)
def test_kill_before_the_first_delta_is_rerun_invisibly(gw: Client, engines: Engines,
                                                        family: str) -> None:
    prompt = long_prompt()  # ~1000 tokens: a prefill window of about a second
    ref = reference(gw, family, max_tokens=16, prompt=prompt)
    xrid = new_xrid()
    box: dict[str, Any] = {}

    def kill_on_receipt() -> None:
        try:
            name = wait_received(engines, xrid)
            box["t"] = engines.kill(name, signal.SIGKILL)
            box["name"] = name
        except Exception as e:  # reported by the main thread
            box["error"] = e

    th = threading.Thread(target=kill_on_receipt, daemon=True)
    th.start()
    res = run(gw, family, max_tokens=16, prompt=prompt, xrid=xrid)
    th.join(20)
    assert "error" not in box, box
    killed = str(box["name"])
    survivor = next(n for n in engines.names if n != killed)
    assert res.status == 200 and res.transport_error is None, res.raw[-400:]
    # One lifecycle (never two response.created / message_start), the fault-free text.
    assert not_rest(family, res) == not_rest(family, ref)
    assert types(res).count(HEAD[family][0]) == 1
    assert text(family, res) == text(family, ref) and text(family, res)
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["attempt"], j["first_delta_sent"]) == ("completed", 2, True)
    assert j["attempts"][0]["failure_class"] == "replica_dead"
    assert j["first_delta_at"] > j["attempts"][0]["ended_at"]
    assert engines.received(killed, xrid) and engines.received(survivor, xrid)
    assert res.t_first_content is not None and res.t_first_content > float(box["t"])
    MEASURED.setdefault("api_families_kill_in_prefill_to_first_delta_s", {})[family] = round(
        res.t_first_content - float(box["t"]), 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_kill_after_the_first_delta_ends_the_stream_without_rerun(
        gw: Client, engines: Engines, family: str) -> None:
    ref = reference(gw, family, max_tokens=64)
    xrid = new_xrid()
    box: dict[str, str] = {}

    def kill_at(n: int) -> None:
        if n == 1 and "name" not in box:
            name = engines.who_received(xrid)[0]
            engines.kill(name, signal.SIGKILL)
            box["name"] = name

    res = run(gw, family, max_tokens=64, xrid=xrid, on_delta=kill_at)
    killed = box["name"]
    other = next(n for n in engines.names if n != killed)
    # What was delivered stays; then the connection is cut (a reset: no event can follow).
    assert res.status == 200 and res.transport_error is not None
    got = text(family, res)
    assert got and text(family, ref).startswith(got) and len(got) < len(text(family, ref))
    assert END[family] not in types(res) and "[DONE]" not in res.events
    delivered = types(res).count(DELTA[family])
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["cause"]) == ("upstream_decode_interrupted", "upstream")
    assert j["attempt"] == 1 and j["error"]["code"] == "upstream_decode_interrupted"
    assert j["error"]["delivered_output_tokens"] == j["delivered_output_tokens"]
    time.sleep(0.5)
    assert not engines.received(other, xrid) and engines.received(killed, xrid)
    # Asked through the gateway (non-streaming: the engine's usage), on the survivor.
    assert_tokenizer_count(gw, j, family, got, delivered, 64, "kill")


@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_after_delivery_ends_with_the_family_terminal_event(
        gw: Client, engines: Engines, family: str) -> None:
    """SIGSTOP of the replica's whole process group after 2 deltas: the connection stays
    open and silent; the stall watchdog (or the attempt's lease expiring: fenced) ends the
    stream with our terminal event in the family's shape."""
    xrid = new_xrid()
    box: dict[str, Any] = {}

    def freeze_at(n: int) -> None:
        if n == 2 and "name" not in box:
            name = engines.who_received(xrid)[0]
            p = engines.proc(name).popen
            assert p is not None
            os.killpg(p.pid, signal.SIGSTOP)
            box["name"], box["pgid"], box["t"] = name, p.pid, time.monotonic()

    try:
        res = run(gw, family, max_tokens=400, xrid=xrid, on_delta=freeze_at)
    finally:
        if "pgid" in box:
            os.killpg(box["pgid"], signal.SIGCONT)
    assert res.status == 200 and res.transport_error is None, res.raw[-400:]
    last = res.events[-1]
    assert isinstance(last, dict)
    delivered = types(res).count(DELTA[family])
    if family == "responses":
        assert last["type"] == "response.failed"
        assert last["sequence_number"] == res.events[-2]["sequence_number"] + 1  # type: ignore[index]
        assert last["response"]["id"] == f"resp_{xrid}"
        err = last["response"]["error"]
        assert res.raw.rstrip().rsplit(b"\n\n", 1)[-1].startswith(b"event: response.failed\n")
    else:
        assert last["type"] == "error"
        err = last["error"]
        assert err["type"] == "api_error"
        assert res.raw.rstrip().rsplit(b"\n\n", 1)[-1].startswith(b"event: error\n")
    assert err["code"] == "upstream_decode_interrupted"
    assert err["delivered_output_tokens"] >= delivered >= 2
    assert err["delivered_output_tokens_exact"] is False
    assert err["partial_output"] is True and err["retryable"] is False
    assert err["request_id"] == res.request_id
    assert END[family] not in types(res) and b"[DONE]" not in res.raw
    j = gw.journal(res.request_id)
    assert j["outcome"] == "upstream_decode_interrupted" and j["cause"] in ("stall", "fenced")
    assert j["delivered_output_tokens"] == err["delivered_output_tokens"]
    MEASURED.setdefault("api_families_freeze_to_terminal_s", {})[family] = round(
        res.t_end - float(box["t"]), 2)
    assert_tokenizer_count(gw, j, family, text(family, res), delivered, 400, "freeze")


@pytest.mark.parametrize("family", FAMILIES)
def test_non_streaming_is_the_engines_own(gw: Client, family: str) -> None:
    xrid = new_xrid()
    res = gw.post(body(family, xrid, 8, stream=False), path=PATHS[family], xrid=xrid)
    assert res.status == 200
    obj = res.events[0]
    assert isinstance(obj, dict) and obj["usage"]["output_tokens"] == 8
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["delivered_output_tokens"]) == ("completed", 8)

"""A replica dies, or is stopped, from outside: kill -9 of its whole process group (API
server, EngineCore, Worker, resource tracker), or SIGTERM to its API server (PID 1 of a
container). Each test needs both replicas up; the fixture restarts a stopped one first.

Before the first delivered delta a kill is re-run invisibly on the other replica; after it
the client keeps what it got and learns the stream was cut; a graceful stop is not a crash.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import pytest

from .conftest import (
    MEASURED,
    Client,
    Engines,
    Result,
    assert_same_stream,
    engine_tokens,
    long_prompt,
    new_xrid,
)


def reference(gw: Client, **kw: object) -> Result:
    r = gw.post(Client.body(**kw))  # type: ignore[arg-type]
    assert r.status == 200 and r.transport_error is None and r.events[-1] == "[DONE]"
    return r


def test_kill_during_prefill_gives_one_complete_answer(
        gw: Client, engines: Engines, direct: Callable[[str], Client]) -> None:
    prompt = long_prompt()  # ~1000 tokens: prefill is a window of a second or more
    ref = reference(gw, max_tokens=24, prompt=prompt)
    xrid = new_xrid()
    box: dict[str, object] = {}

    def kill_on_receipt() -> None:
        # vLLM logs "Received request chatcmpl-<x-request-id>" before it schedules the
        # prefill; kill that replica's whole process group at once.
        try:
            name = engines.wait_received(xrid, timeout_s=15)
            box["wall"] = time.time()
            box["t"] = engines.kill(name, signal.SIGKILL)
            box["name"] = name
        except Exception as e:  # reported by the main thread
            box["error"] = e

    th = threading.Thread(target=kill_on_receipt, daemon=True)
    th.start()
    res = gw.post(Client.body(max_tokens=24, prompt=prompt), xrid=xrid)
    th.join(20)
    assert "error" not in box, box
    killed = str(box["name"])
    survivor = next(n for n in engines.names if n != killed)
    t_kill = float(box["t"])  # type: ignore[arg-type]
    # The client never noticed: one complete answer, byte-identical to the fault-free run,
    # its first content arriving only after the kill (so the kill was before any delta).
    assert res.status == 200 and res.transport_error is None
    assert res.t_first_content is not None and res.t_first_content > t_kill
    assert_same_stream(res, ref)
    j = gw.journal(res.request_id)
    assert j["outcome"] == "completed" and j["first_delta_sent"] is True
    assert j["attempt"] == 2 and len(j["attempts"]) == 2 and j["retry_budget"] == 0
    assert j["delivered_output_tokens"] == len(res.contents)
    a1, a2 = j["attempts"]
    assert a1["failure_class"] == "replica_dead" and a1["upstream_finished"] is False
    assert a2["failure_class"] == "completed"
    assert j["first_delta_at"] > a1["ended_at"]  # nothing left attempt 1
    # vLLM's side: both replicas received it; the killed one logged nothing after.
    assert engines.received(killed, xrid) and engines.received(survivor, xrid)
    assert not engines.proc(killed).alive()
    # Failover time with a real engine vs the survivor's own time to first token.
    own = direct(survivor).post(Client.body(max_tokens=24, prompt=prompt))
    assert own.text == res.text
    MEASURED["failover_kill_in_prefill"] = {
        "kill_to_first_content_at_client_s": round(res.t_first_content - t_kill, 3),
        "kill_to_attempt1_ended_s": round(a1["ended_at"] - float(box["wall"]), 3),  # type: ignore[arg-type]
        "kill_to_retry_admitted_s": round(a2["admitted_at"] - float(box["wall"]), 3),  # type: ignore[arg-type]
        "retry_admitted_to_first_delta_s": round(j["first_delta_at"] - a2["admitted_at"], 3),
        "survivor_own_ttft_s": round(own.ttft_s or 0, 3),
        "client_ttft_total_s": round(res.ttft_s or 0, 3),
        "send_to_kill_s": round(t_kill - res.t_sent, 3),
    }


@pytest.mark.parametrize("after", [1, 5])
def test_kill_after_delivered_deltas_ends_the_stream_without_retry(
        gw: Client, engines: Engines, direct: Callable[[str], Client], after: int) -> None:
    ref = reference(gw, max_tokens=64)
    xrid = new_xrid()
    box: dict[str, str] = {}

    def kill_at(n: int, ev: object) -> str | None:
        # Right after the client read its n-th content delta: the whole process group.
        if n == after and "name" not in box:
            name = engines.who_received(xrid)[0]
            engines.kill(name, signal.SIGKILL)
            box["name"] = name
        return None

    res = gw.post(Client.body(max_tokens=64), on_event=kill_at, xrid=xrid)
    killed = box["name"]
    other = next(n for n in engines.names if n != killed)
    # The client keeps what it got (a prefix of the fault-free text), then the connection
    # is cut: no [DONE], a transport error (Envoy resets; no event can follow a reset).
    assert res.status == 200
    assert res.transport_error is not None
    assert "[DONE]" not in res.events
    got = len(res.contents)
    assert got >= after
    assert ref.text.startswith(res.text) and len(res.text) < len(ref.text)
    j = gw.journal(res.request_id)
    assert j["first_delta_sent"] is True
    assert j["outcome"] == "upstream_decode_interrupted" and j["cause"] == "upstream"
    # Exactly what reached the client, in the engine's tokens (decision 0018): asked of
    # the other replica, the max_tokens whose answer is the delivered text.
    truth = engine_tokens(direct(other), Client.body(max_tokens=64), res.text, lo=got)
    n = j["delivered_output_tokens"]
    assert n in truth and n >= got
    assert (j["delivered_output_tokens_exact"], j["delivered_output_tokens_source"]) == (
        True, "engine")
    MEASURED.setdefault("kill_after_delta_events_vs_tokens", []).append([got, n])
    assert j["attempt"] == 1 and len(j["attempts"]) == 1
    assert j["attempts"][0]["failure_class"] == "replica_dead"
    assert j["error"]["code"] == "upstream_decode_interrupted"
    assert j["error"]["delivered_output_tokens"] == n
    assert j["error"]["delivered_output_tokens_exact"] is True
    assert j["error"]["partial_output"] is True and j["error"]["retryable"] is False
    # No second run anywhere: the other replica never heard of the request.
    time.sleep(0.5)
    assert not engines.received(other, res.xrid)
    assert engines.received(killed, res.xrid)


def stream_on(gw: Client, engines: Engines, want: str, body: dict[str, object],
              at: int, act: Callable[[str], object]) -> Result:
    """Stream `body` until a request lands on replica `want` (Envoy round-robins; a request
    that lands elsewhere is hung up at once), and call `act(want)` after `at` deltas."""
    for _ in range(6):
        xrid = new_xrid()
        box: dict[str, str] = {}

        def cb(n: int, ev: object, xrid: str = xrid, box: dict[str, str] = box) -> str | None:
            if n == at and "name" not in box:
                box["name"] = engines.who_received(xrid)[0]
                if box["name"] != want:
                    return "close"
                act(want)
            return None

        res = gw.post(body, on_event=cb, xrid=xrid)
        if box.get("name") == want:
            return res
    pytest.fail(f"no request landed on {want}")


def test_sigterm_mid_stream_drains_and_is_not_a_crash(
        gw: Client, engines: Engines, direct: Callable[[str], Client]) -> None:
    """r1 runs with --shutdown-timeout 30: SIGTERM to its API server drains the stream."""
    ref = reference(gw, max_tokens=96)
    res = stream_on(gw, engines, "r1", Client.body(max_tokens=96), 3,
                    engines.terminate_leader)
    # vLLM drains: the in-flight stream finishes normally.
    assert res.status == 200 and res.transport_error is None
    assert res.events[-1] == "[DONE]" and res.error is None
    assert_same_stream(res, ref)
    j = gw.journal(res.request_id)
    assert j["outcome"] == "completed" and j["cause"] is None
    assert j["attempt"] == 1 and len(j["attempts"]) == 1
    assert j["attempts"][0]["failure_class"] == "completed"
    assert j["delivered_output_tokens"] in engine_tokens(
        direct("r2"), Client.body(max_tokens=96), res.text, lo=len(res.contents))
    assert j["delivered_output_tokens_exact"] is True
    assert not engines.aborted("r1", res.xrid)
    assert engines.who_received(res.xrid) == ["r1"]
    t0 = time.monotonic()
    engines.wait_gone("r1", timeout_s=60)  # then the replica exits by itself
    MEASURED["sigterm_drain_stream_end_to_exit_s"] = round(time.monotonic() - t0, 1)
    log = engines.log("r1")
    assert "[shutdown] API server: stopping engine client mode=drain timeout=30s" in log


def test_sigterm_with_vllm_default_never_looks_complete(
        gw: Client, engines: Engines, direct: Callable[[str], Client]) -> None:
    """r2 keeps vLLM's default --shutdown-timeout 0: SIGTERM stops the engine at once. What the
    open stream then does is a race inside vLLM; three endings were seen:

    - silence (uvicorn holds the connection ~60 s): the stall watchdog ends it;
    - vLLM's in-band `{"error": {"message": "EngineCore encountered an issue..."}}` then
      [DONE] ("failed (engine dead)"): replaced by our terminal error;
    - a last chunk with `finish_reason: "abort"` then [DONE]: a clean-looking, truncated
      stream; the gateway classifies the abort as an interruption and replaces it with
      our terminal error.
    """
    ref = reference(gw, max_tokens=200)
    marks: dict[str, float] = {}

    def term(name: str) -> None:
        marks["t"] = engines.terminate_leader(name)

    res = stream_on(gw, engines, "r2", Client.body(max_tokens=200), 3, term)
    got = len(res.contents)
    # Always: a strict prefix of the fault-free text, one attempt, nothing run elsewhere.
    assert res.status == 200 and res.transport_error is None
    assert got >= 3 and ref.text.startswith(res.text) and len(res.text) < len(ref.text)
    assert res.events[-1] == "[DONE]"
    j = gw.journal(res.request_id)
    # One attempt delivered; an earlier one may have met r1 still restarting from the
    # previous test (connection refused, before any delta): never a retry after delivery.
    assert [a["released"] for a in j["attempts"]].count(True) == 1
    n = j["delivered_output_tokens"]
    assert j["attempts"][-1]["released"] and n >= got
    deadline = time.monotonic() + 60  # r1 may still be back from the previous test
    while not engines.healthy("r1"):
        assert time.monotonic() < deadline, "r1 not healthy"
        time.sleep(0.5)
    assert n in engine_tokens(direct("r1"), Client.body(max_tokens=200), res.text, lo=got)
    assert j["delivered_output_tokens_exact"] is True
    assert engines.who_received(res.xrid) == ["r2"]
    assert "[shutdown] API server: stopping engine client mode=abort timeout=0s" in \
        engines.log("r2")
    finish = [ch.get("finish_reason") for e in res.events if isinstance(e, dict)
              for ch in e.get("choices") or []]
    assert "abort" not in finish  # never forwarded: replaced by our terminal event
    MEASURED.setdefault("sigterm_default_endings", []).append(
        {"ending": j["cause"], "to_stream_end_s": round(res.t_end - marks["t"], 2)})
    err = res.error
    assert err is not None and err["code"] == "upstream_decode_interrupted"
    assert err["delivered_output_tokens"] == n and err["retryable"] is False
    assert err["delivered_output_tokens_exact"] is True
    assert j["outcome"] == "upstream_decode_interrupted"
    assert j["cause"] in ("stall", "in-band error")
    assert "EngineCore encountered an issue" not in res.raw.decode()  # ours, not vLLM's

"""bench/peers.py's pure parts: a faulted request's one-word outcome, the summary over
repeats and the table; and the armed fault that exactly one replica of a pool takes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from bench.client import Conn, Outcome
from bench.peers import classify, render, summarize
from bench.peers_replica import take_fault


def out(**kw: Any) -> Outcome:
    o = Outcome()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


@pytest.mark.parametrize(("o", "timed_out", "word"), [
    (out(status=200, content=16, done=True), False, "complete"),
    # told: an in-band error event (even if the connection then closed), or a non-200
    (out(status=200, content=3, done=True, error_events=1), False, "clean_error"),
    (out(status=200, content=3, error_events=1, transport_error="ConnectionError"), False,
     "clean_error"),
    (out(status=503, done=False), False, "clean_error"),
    # not told
    (out(status=200, content=3, transport_error="ConnectionError: closed"), False, "cut"),
    (out(status=0, transport_error="ConnectionResetError"), False, "cut"),
    (out(status=200, content=3, done=False), False, "cut"),
    (out(status=200, content=3), True, "hang"),
    (out(status=200, content=19, done=True), False, "wrong"),  # a silent re-run from the start
    (out(status=200, content=12, done=True), False, "wrong"),  # a silent truncation
])
def test_classify(o: Outcome, timed_out: bool, word: str) -> None:
    assert classify(o, 16, timed_out) == word


def test_classify_reads_what_the_client_parsed() -> None:
    # The same parser the load uses: a stream a peer ended with an error event and [DONE].
    body = bytearray(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
                     b'data: {"error":{"message":"worker died"}}\n\ndata: [DONE]\n\n')
    o = out(status=200)
    Conn._events(body, o, 1, None, False)
    assert (o.content, o.error_events, o.done) == (1, 1, True)
    assert classify(o, 16, False) == "clean_error"


def test_client_reads_a_timestamp_moved_to_the_end_of_the_event() -> None:
    # LiteLLM re-encodes each event: "ts" comes last. The first content event is excluded.
    ev = (b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"t%d "}}],'
          b'"ts":%d}\n\n')
    body = bytearray(ev % (0, 100) + ev % (1, 900))
    o = Outcome()
    Conn._events(body, o, 1000, None, True)
    assert o.content == 2 and o.latencies_ns == [100]


def _run(side: str, rep: int, chunks: float, cpu: dict[str, float], p50: float,
         faults: dict[str, int] | None = None) -> dict[str, Any]:
    r: dict[str, Any] = {
        "side": side, "repeat": rep,
        "saturation": {"valid": True, "chunks_per_s": chunks, "cpu_us_per_chunk": cpu,
                       "requests": 10, "ok": 10},
        "ttfd": {"p50_ms": p50, "requests": 5, "ok": 4},
        "latency@2000": {"p50_ms": 0.5, "p99_ms": 2.0, "achieved_chunks_per_s": 1990.0},
        "memory": {"kib_per_stream": 40.0},
    }
    if faults is not None:
        r["faults"] = {"before": {"counts": faults}, "after": {"counts": {"cut": 2}}}
    return r


def test_summary_pairs_each_repeat_with_plain() -> None:
    runs = [_run("plain", 1, 1000.0, {"envoy": 10.0}, 1.0),
            _run("plain", 2, 2000.0, {"envoy": 12.0}, 2.0),
            _run("smg", 1, 500.0, {"gateway": 8.0, "envoy": float("nan")}, 1.5,
                 {"clean_error": 2}),
            _run("smg", 2, 1500.0, {"gateway": 9.0}, 2.0, {"clean_error": 1, "hang": 1}),
            _run("ours", 1, 800.0, {"envoy": 10.0, "processor": 40.0, "etcd": 5.0}, 3.0)]
    s = summarize(runs, ["plain", "ours", "smg"], [2000])
    assert s["smg"]["sat_chunks_s"] == [500.0, 1000.0, 1500.0]
    assert s["smg"]["sat_vs_plain"] == [0.5, 0.625, 0.75]   # per repeat, then min/med/max
    assert s["smg"]["ttfd_added_ms"] == [0.0, 0.25, 0.5]
    assert s["smg"]["cpu_us_chunk"] == [8.0, 8.5, 9.0]      # a NaN process is left out
    assert s["ours"]["cpu_us_chunk"] == [55.0, 55.0, 55.0]  # Envoy + processor + etcd
    assert s["smg"]["faults_before"]["clean_error"] == 3
    assert s["smg"]["faults_before"]["hang"] == 1
    assert s["smg"]["faults_after"]["cut"] == 4
    assert s["plain"]["faults_before"] == dict.fromkeys(s["plain"]["faults_before"], 0)
    assert s["smg"]["load_errors"] == 2  # the ttfd figure's 1 failed request, twice
    table = render({"versions": {"smg": "smg 1.13.0"}}, s, [2000])
    lines = table.splitlines()
    assert lines[1].split() == ["plain", "ours", "smg"]
    row = next(x for x in lines if x.startswith("replica killed before"))
    assert "3/4 clean error, 1/4 hang" in row and "n/a" in row  # plain had no fault run
    assert any(x.startswith("  vs plain") and "0.50/0.62/0.75" in x for x in lines)


def test_exactly_one_replica_takes_an_armed_fault(tmp_path: Path) -> None:
    arm = str(tmp_path / "fault.armed")
    assert take_fault(arm, "r1") is None  # nothing armed: every request runs clean
    Path(arm).write_text("kill-after-headers\n")
    assert take_fault(arm, "r2") == "kill-after-headers"
    assert take_fault(arm, "r1") is None  # the retry on the other replica runs clean
    assert not os.path.exists(arm)

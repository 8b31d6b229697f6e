"""Both gRPC stacks (`server.transport`, decision 0020) behind real Envoy, etcd and replicas.

The whole e2e suite runs on the default stack and test_failover.py on both; these are what
differs between them at the transport: many concurrent streams on Envoy's one connection,
and the drain of a SIGTERMed processor with a stream in flight, which must finish whole.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devkit.devstack import Stack

from .conftest import E2E_CONFIG, Gateway

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["grpcio", "grpclib"])
def tgw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Gateway]:
    cfg = {**E2E_CONFIG, "server": {"transport": request.param}}
    st = Stack(workdir=tmp_path / "stack", config=cfg, replicas=2).start()
    g = Gateway(st)
    try:
        yield g
    finally:
        g.client.close()
        st.stop()


def _log(st: Stack) -> list[dict[str, object]]:
    out = []
    for line in (st.workdir / "processor.log").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_the_processor_says_which_stack_serves(tgw: Gateway) -> None:
    want = (tgw.stack.cfg.server.transport if tgw.stack.cfg else None)
    lines = [x for x in _log(tgw.stack) if x.get("msg") == "processor listening"]
    assert [x["transport"] for x in lines] == [want]


def test_160_concurrent_streams_all_complete(tgw: Gateway) -> None:
    """160 streams at once: each a guard and a gate stream on Envoy's one connection to the
    processor, more than h2's default limit of 100 (grpclib_server raises it)."""
    ref = tgw.post(tgw.body(max_tokens=6))
    assert ref.status == 200 and ref.transport_error is None
    body = tgw.body(max_tokens=6)
    with ThreadPoolExecutor(max_workers=160) as pool:
        results = list(pool.map(lambda _: tgw.post(body, headers={
            "x-replica-token-delay-ms": "200"}), range(160)))
    assert all(r.status == 200 and r.transport_error is None for r in results), \
        [(r.status, r.transport_error) for r in results if r.status != 200][:3]
    assert all(r.normalized() == ref.normalized() for r in results)
    assert len({r.request_id for r in results}) == 160
    for r in results[::40]:  # a sample: one attempt each, completed, all 6 delivered
        j = tgw.journal(r.request_id)
        assert (j["outcome"], len(j["attempts"]), j["delivered_output_tokens"]) == (
            "completed", 1, 6)
    errors = [x for x in _log(tgw.stack) if x.get("level") in ("ERROR", "CRITICAL")]
    assert errors == []


def test_sigterm_drains_the_stream_in_flight_and_exits_zero(tgw: Gateway) -> None:
    st = tgw.stack
    ref = tgw.post(tgw.body(max_tokens=12))
    out: dict[str, object] = {}
    with ThreadPoolExecutor(max_workers=1) as pool:
        # 12 tokens at 200 ms: 2.4 s in flight, well inside the 5 s drain grace.
        fut = pool.submit(tgw.post, tgw.body(max_tokens=12),
                          {"x-replica-token-delay-ms": "200"})
        time.sleep(0.8)
        proc = st.procs["processor"]
        proc.signal(signal.SIGTERM)
        t0 = time.monotonic()
        res = fut.result(timeout=30)
        out["finished_after_s"] = time.monotonic() - t0
    assert res.status == 200 and res.transport_error is None, res.raw[-300:]
    assert res.normalized() == ref.normalized()  # the whole answer, nothing cut
    assert proc.popen is not None and proc.popen.wait(15) == 0
    log = _log(st)
    assert [x for x in log if x.get("level") in ("ERROR", "CRITICAL")] == []
    # The guard recorded the outcome before the process exited: the journal (read through a
    # new processor on the same etcd) says completed, all 12 delivered.
    st.restart_processor()
    j = tgw.journal(res.request_id)
    assert (j["outcome"], j["delivered_output_tokens"], len(j["attempts"])) == (
        "completed", 12, 1)

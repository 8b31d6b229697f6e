"""OpenTelemetry traces (with Envoy's spans in the same trace), metrics, and replay.

A real OTLP/gRPC receiver runs in the test process; the processor and Envoy export to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from devkit.devstack import Stack, free_port

from .conftest import Gateway

pytestmark = pytest.mark.e2e


class Receiver(trace_service_pb2_grpc.TraceServiceServicer,  # type: ignore[misc]
               metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.metrics: set[str] = set()
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            with self.lock:
                for rs in request.resource_spans:
                    svc = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            self.spans.append({
                                "service": svc, "name": s.name, "trace_id": s.trace_id.hex(),
                                "span_id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "attrs": {a.key: _val(a.value) for a in s.attributes},
                                "events": [e.name for e in s.events],
                                "error": s.status.code == 2})
            return trace_service_pb2.ExportTraceServiceResponse()
        with self.lock:
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        self.metrics.add(m.name)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _val(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _MetricsAdapter(metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
    def __init__(self, r: Receiver) -> None:
        self.r = r

    def Export(self, request: Any, context: Any) -> Any:
        return self.r.Export(request, context)


@pytest.fixture(scope="module")
def otel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Receiver]]:
    rec = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsAdapter(rec), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    cfg = {"timeouts": {"first_delta_s": 5.0, "stall_after_first_delta_s": 1.0,
                        "access_log_wait_s": 0.5, "fence_wait_s": 12.0},
           "telemetry": {"otlp_endpoint": f"127.0.0.1:{port}", "record_traces": "all",
                         "metrics_interval_s": 1.0},
           "policy": {"retry_budget": {"min_retry_concurrency": 100000}}}
    st = Stack(workdir=tmp_path_factory.mktemp("otel"), config=cfg).start()
    try:
        yield st, rec
    finally:
        st.stop()
        server.stop(0)


@pytest.fixture
def og(otel: tuple[Stack, Receiver]) -> Iterator[Gateway]:
    otel[0].wait_replicas_healthy()
    g = Gateway(otel[0])
    yield g
    g.client.close()


def spans_for(rec: Receiver, rid: str, attempts: int, timeout: float = 10.0
              ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    deadline = time.monotonic() + timeout
    while True:
        with rec.lock:
            req = [s for s in rec.spans if s["name"] == "llm.request"
                   and s["attrs"].get("llmgw.request_id") == rid]
            att = [s for s in rec.spans if s["name"] == "llm.attempt"
                   and s["attrs"].get("llmgw.request_id") == rid]
            if len(req) == 1 and len(att) == attempts:
                envoy = [s for s in rec.spans if s["service"] == "llm-gateway-envoy"
                         and s["trace_id"] == req[0]["trace_id"]]
                if envoy:
                    return req[0], sorted(att, key=lambda s: s["attrs"]["llmgw.attempt"]), envoy
        assert time.monotonic() < deadline, f"spans for {rid} did not arrive"
        time.sleep(0.2)


def test_clean_request_trace(og: Gateway, otel: tuple[Stack, Receiver]) -> None:
    res = og.post(og.body(max_tokens=4))
    assert res.status == 200
    req, (att,), envoy = spans_for(otel[1], res.request_id, 1)
    assert att["parent"] == req["span_id"] and att["trace_id"] == req["trace_id"]
    assert req["parent"] in {s["span_id"] for s in envoy}  # under Envoy's own span
    assert req["events"] == ["request.accepted", "first_delta.delivered"]
    # Released, handed to the guard, and ended with the request (one etcd txn).
    assert att["events"] == ["attempt.admitted", "lease.granted", "first_delta.fenced",
                             "attempt.handed_off", "lease.revoked"]
    assert req["attrs"]["llmgw.outcome"] == "completed"
    assert req["attrs"]["gen_ai.usage.output_tokens"] == 4
    assert req["attrs"]["gen_ai.request.model"] == "demo-model"
    assert 0 < req["attrs"]["gen_ai.response.time_to_first_chunk"] < 5.0  # seconds
    assert att["attrs"]["llmgw.failure_class"] == "completed"
    assert att["attrs"]["server.address"] == "127.0.0.1"
    assert not req["error"] and not att["error"]


def test_pre_delta_retry_trace(og: Gateway, otel: tuple[Stack, Receiver]) -> None:
    res = og.post(og.body(max_tokens=4), headers={"x-replica-fault": "kill-after-headers"})
    assert res.status == 200 and len(res.contents) == 4
    req, (a1, a2), _ = spans_for(otel[1], res.request_id, 2)
    assert a1["parent"] == a2["parent"] == req["span_id"]
    assert "first_delta.fenced" not in a1["events"] and "lease.revoked" in a1["events"]
    assert a1["attrs"]["llmgw.failure_class"] == "replica_dead" and a1["error"]
    assert "first_delta.fenced" in a2["events"]
    assert a1["attrs"]["llmgw.attempt_id"] != a2["attrs"]["llmgw.attempt_id"]
    assert req["attrs"]["llmgw.outcome"] == "completed"


def test_post_delta_interruption_trace(og: Gateway, otel: tuple[Stack, Receiver]) -> None:
    res = og.post(og.body(max_tokens=8), headers={"x-replica-fault": "stall-after-deltas:2"})
    assert res.error is not None
    req, (att,), _ = spans_for(otel[1], res.request_id, 1)
    assert "terminal_error.injected" in req["events"] and req["error"]
    assert req["attrs"]["llmgw.outcome"] == "upstream_decode_interrupted"
    assert req["attrs"]["gen_ai.usage.output_tokens"] == 2
    # A stalled replica may be alive (uncertain); after the first delta nothing else may
    # run, so the attempt is fenced when the request ends.
    assert att["attrs"]["llmgw.failure_class"] == "network_uncertain"
    assert att["attrs"]["llmgw.fence"] == "ended_with_request"
    assert "lease.revoked" in att["events"]


def test_metrics_are_exported(og: Gateway, otel: tuple[Stack, Receiver]) -> None:
    og.post(og.body(max_tokens=2), headers={"x-replica-fault": "kill-before-headers"})
    deadline = time.monotonic() + 10
    want = {"llmgw.retries", "llmgw.fences", "llmgw.requests"}
    while not want <= otel[1].metrics:
        assert time.monotonic() < deadline, otel[1].metrics
        time.sleep(0.3)


def _cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", *args, "--config",
                           str(stack.workdir / "extproc.yaml")],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("fault", [None, "kill-before-headers", "kill-after-compute:3",
                                   "kill-after-deltas:2", "stall-after-deltas:2",
                                   "error-after-deltas:2", "error-after-deltas:0"])
def test_replay_reproduces_the_decisions(og: Gateway, otel: tuple[Stack, Receiver],
                                         fault: str | None, tmp_path: Path) -> None:
    st = otel[0]
    res = og.post(og.body(max_tokens=6), headers={"x-replica-fault": fault} if fault else {})
    og.journal(res.request_id)
    time.sleep(0.5)  # traces are written when each stream ends
    r = _cli(st, "replay", res.request_id)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert any(x.startswith("guard:") for x in lines)
    assert all("same decisions" in x for x in lines)
    insp = json.loads(_cli(st, "inspect", res.request_id, "--events").stdout)
    assert insp["journal"]["request_id"] == res.request_id
    # Tamper with one recorded event: replay must report the divergence.
    # The last attempt is the one that produced content (or the only one).
    trace = [t for n, t in sorted(insp["traces"].items()) if n.startswith("attempt")][-1]
    full = {"format": 1, "role": trace["role"], "request_id": res.request_id,
            "params": {"max_buffer": 4 << 20}, "events": trace["event_list"],
            "decisions": trace["decisions"], "summary": trace["summary"]}
    tampered = False
    for ev in full["events"]:
        if ev["type"] == "ResponseBody" and "content" in ev["data"]:
            ev["data"] = 'data: {"error": {"message": "tampered"}}\n\n'
            tampered = True
            break
    assert tampered
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(full))
    t = _cli(st, "replay", res.request_id, "--trace-file", str(path))
    assert t.returncode == 1 and "DIVERGES" in t.stdout, t.stdout + t.stderr

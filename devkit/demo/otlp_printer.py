"""A tiny OTLP/gRPC receiver that prints each span as one line: a local trace viewer.

`make run` starts it so the quickstart shows its own traces (Envoy's and the processor's)
without installing a collector. Point `telemetry.otlp_endpoint` (and Envoy) at it.

Run: python -m devkit.demo.otlp_printer --port P [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from concurrent import futures
from typing import Any, TextIO

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _val(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Printer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            for rs in request.resource_spans:
                svc = next((a.value.string_value for a in rs.resource.attributes
                            if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        ms = (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6
                        self.out.write(json.dumps({
                            "service": svc, "span": s.name, "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                            "ms": round(ms, 3),
                            "attrs": {a.key: _val(a.value) for a in s.attributes},
                            "events": [e.name for e in s.events]}) + "\n")
            self.out.flush()
        return trace_service_pb2.ExportTraceServiceResponse()


class MetricsSink(metrics_service_pb2_grpc.MetricsServiceServicer):
    def Export(self, request: Any, context: Any) -> Any:
        return metrics_service_pb2.ExportMetricsServiceResponse()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="otlp_printer")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", help="append span lines to this file (default stdout)")
    a = ap.parse_args(argv)
    out = open(a.out, "a") if a.out else sys.stdout  # noqa: SIM115
    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        Printer(out), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(  # type: ignore[no-untyped-call]
        MetricsSink(), server)
    server.add_insecure_port(f"{a.host}:{a.port}")
    server.start()
    print(f"OTLP span printer on {a.host}:{a.port}", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(1)


if __name__ == "__main__":
    main()

"""OpenTelemetry: one span per logical request, a child span per attempt, decisions as events.

Envoy's ext_proc gRPC client carries the W3C `traceparent` of Envoy's own span in the call's
metadata; the request span takes it as parent, so Envoy's spans and ours form one trace.
The guard passes its span context to the gates in the `x-gateway-traceparent` request
header, so every attempt is a child of its request. Attribute names follow the semantic
conventions where one exists (`gen_ai.*`, `server.*`, `http.*`, `error.type`); ours are
under `llmgw.`. Export is OTLP/gRPC with a BatchSpanProcessor (the simple processor would
export on the event loop). With no endpoint configured, everything here is a no-op.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..core.config import TelemetryConfig
from ..core.headers import TRACEPARENT

TRACEPARENT_HEADER = TRACEPARENT  # gateway-owned: the guard strips a client's copy
_prop = TraceContextTextMapPropagator()


class Telemetry:
    def __init__(self, cfg: TelemetryConfig, gateway_id: str) -> None:
        self.enabled = cfg.otlp_endpoint is not None
        self._providers: list[Any] = []
        if self.enabled:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter,
            )
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            res = Resource.create({"service.name": cfg.service_name,
                                   "service.instance.id": gateway_id})
            tp = TracerProvider(resource=res)
            tp.add_span_processor(BatchSpanProcessor(
                OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=True),
                schedule_delay_millis=200))
            mp = MeterProvider(resource=res, metric_readers=[PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=cfg.otlp_endpoint, insecure=True),
                export_interval_millis=int(cfg.metrics_interval_s * 1000))])
            self._providers = [tp, mp]
            self.tracer: trace.Tracer = tp.get_tracer("extproc")
            meter = mp.get_meter("extproc")
        else:
            self.tracer = trace.NoOpTracer()
            meter = metrics.NoOpMeterProvider().get_meter("extproc")
        self.retries = meter.create_counter(
            "llmgw.retries", description="attempts after the first, by decision and reason")
        self.interruptions = meter.create_counter(
            "llmgw.interruptions", description="streams ended after the first delta, by cause")
        self.fences = meter.create_counter(
            "llmgw.fences", description="attempts fenced, by kind (revoked, expiry)")
        self.budget_used = meter.create_histogram(
            "llmgw.retry_budget.utilization", unit="1",
            description="pool-wide retries / limit at each retry decision")
        self.chunk_time = meter.create_histogram(
            "llmgw.chunk.processing_time", unit="ms",
            description="processor time per response body message (1 in 64 sampled)")
        self.outcomes = meter.create_counter("llmgw.requests", description="by outcome")
        self.chunks_seen = 0

    def parent_from(self, carrier: Mapping[str, str]) -> Context | None:
        if not self.enabled:
            return None
        ctx = _prop.extract(dict(carrier))
        span = trace.get_current_span(ctx)
        return ctx if span.get_span_context().is_valid else None

    def start(self, name: str, parent: Context | None, kind: SpanKind,
              attributes: Mapping[str, Any]) -> Span:
        if not self.enabled:
            return NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)
        return self.tracer.start_span(name, context=parent, kind=kind,
                                      attributes={k: v for k, v in attributes.items()
                                                  if v is not None})

    def traceparent(self, span: Span) -> str | None:
        if not self.enabled or not span.get_span_context().is_valid:
            return None
        carrier: dict[str, str] = {}
        _prop.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def shutdown(self) -> None:
        for p in self._providers:
            p.shutdown()


def end_span(span: Span, error: str | None = None, **attrs: Any) -> None:
    for k, v in attrs.items():
        if v is not None:
            span.set_attribute(k, v)
    if error:
        span.set_attribute("error.type", error)
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()

"""OpenTelemetry: one span per logical request, a child span per attempt, decisions as events.

Envoy's ext_proc gRPC client carries the W3C `traceparent` of Envoy's own span in the call's
metadata; the request span takes it as parent, so Envoy's spans and ours form one trace.
The guard passes its span context to the gates in the `x-gateway-traceparent` request
header, so every attempt is a child of its request. Attribute names follow the semantic
conventions where one exists (`gen_ai.*`, `server.*`, `http.*`, `error.type`); ours are
under `llmgw.`. Export is OTLP/gRPC with a BatchSpanProcessor (the simple processor would
export on the event loop). With no endpoint configured, everything here is a no-op.

Standard `OTEL_*` variables work (docs/telemetry.md, "Configuration from OTEL_*"): a value
the config file sets wins, and the variable fills what the file leaves null or at its
default. `server.metrics_listen` adds a Prometheus reader on the same instruments: the same
counters scraped at GET /metrics, from a thread of its own (never the event loop).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..core.config import ConfigError, TelemetryConfig
from ..core.headers import TRACEPARENT
from ..core.otlp import TraceExport, trace_export
from ..core.pool import Pool

TRACEPARENT_HEADER = TRACEPARENT  # gateway-owned: the guard strips a client's copy
_prop = TraceContextTextMapPropagator()
# What a stream's span is while tracing is off (`Telemetry.unrecorded`): shared.
_UNRECORDED = NonRecordingSpan(trace.INVALID_SPAN_CONTEXT)
log = logging.getLogger("extproc.telemetry")
_DEFAULTS = TelemetryConfig()
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
_CHUNK_MS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 100.0)


@dataclass(frozen=True)
class OtlpPlan:
    """What to export over OTLP, after the config file and the OTEL_* variables are merged.

    None in a field means "let the SDK read its OTEL_* variable" (it does when the argument
    is left out); a value is passed explicitly and wins.
    """

    traces: bool
    metrics: bool
    endpoint: str | None
    # Spans: where, how and how many, decided as for Envoy's tracer (core/otlp.py).
    trace_export: TraceExport | None
    metrics_insecure: bool | None
    service_name: str | None
    export_interval_ms: int | None
    span_delay_ms: int | None


def _set(env: Mapping[str, str], *names: str) -> bool:
    return any(env.get(n, "").strip() for n in names)


def otlp_plan(cfg: TelemetryConfig, env: Mapping[str, str]) -> OtlpPlan:
    """Precedence: the config file (and its EXTPROC_ overrides) first, then OTEL_*."""
    pre = "OTEL_EXPORTER_OTLP_"
    disabled = env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    ep = cfg.otlp_endpoint
    spans = trace_export(cfg, env)

    def wanted(signal: str) -> bool:
        if disabled or env.get(f"OTEL_{signal}_EXPORTER", "").strip().lower() == "none":
            return False
        return ep is not None or _set(env, pre + "ENDPOINT", f"{pre}{signal}_ENDPOINT")

    def insecure(signal: str) -> bool | None:
        # The file's bare host:port has always meant plaintext; a scheme (https:// or
        # http://) or an explicit OTEL_ insecure/certificate setting lets the SDK decide.
        if ep is None or "://" in ep or _set(env, pre + "INSECURE", f"{pre}{signal}_INSECURE",
                                             pre + "CERTIFICATE",
                                             f"{pre}{signal}_CERTIFICATE"):
            return None
        return True

    name_set = cfg.service_name != _DEFAULTS.service_name or not _set(env, "OTEL_SERVICE_NAME")
    every_set = (cfg.metrics_interval_s != _DEFAULTS.metrics_interval_s
                 or not _set(env, "OTEL_METRIC_EXPORT_INTERVAL"))
    return OtlpPlan(
        traces=spans is not None, metrics=wanted("METRICS"), endpoint=ep, trace_export=spans,
        metrics_insecure=insecure("METRICS"),
        service_name=cfg.service_name if name_set else None,
        export_interval_ms=int(cfg.metrics_interval_s * 1000) if every_set else None,
        span_delay_ms=None if _set(env, "OTEL_BSP_SCHEDULE_DELAY") else 200)


def _credentials(ca_file: str | None) -> Any:
    """TLS trusting `ca_file`, read now so that a bad path stops the start-up; None: the
    SDK's choice (OTEL_EXPORTER_OTLP_CERTIFICATE, else gRPC's default roots)."""
    if ca_file is None:
        return None
    import grpc

    try:
        with open(ca_file, "rb") as f:
            return grpc.ssl_channel_credentials(root_certificates=f.read())
    except OSError as e:
        raise ConfigError("telemetry.otlp_ca_file", f"cannot read {ca_file}: {e}") from e


class MetricsServer:
    """Prometheus text exposition at GET /metrics, served by prometheus_client's thread."""

    def __init__(self, registry: Any, addr: str) -> None:
        from prometheus_client import start_http_server

        host, _, port = addr.rpartition(":")
        self._httpd, self._thread = start_http_server(int(port), host.strip("[]"),
                                                      registry=registry)
        bound = self._httpd.server_address
        self.address = f"{host}:{bound[1]}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(2)


# The GenAI semantic conventions' advised boundaries (semconv 1.41, gen-ai-metrics.md).
_TTFC_S_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0)
_DURATION_S_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                       20.48, 40.96, 81.92)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
# Ours: attempts are few (policy.max_attempts), and the time failed attempts add before the
# one that delivers spans a quick reset (ms) to first_delta_s timeouts (s) times attempts.
_ATTEMPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10)
_ADDED_S_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                    40.0, 80.0)
NONE = "none"  # label value: no model / no replica known (a refusal before any upstream)
OTHER = "other"  # label value: beyond what the pool declares (bounded cardinality)
MAX_UNDECLARED = 32  # distinct values kept when the pool declares none, then OTHER


class Labels:
    """`model` and `replica` label values, bounded: a scrape's cardinality never follows
    what clients send.

    A model is its own value when the pool declares it (some replica's `models`), else
    `other`; a replica when the pool lists its address. With no declared models (or no
    pool), the first MAX_UNDECLARED distinct values seen keep their names, then `other`.
    """

    __slots__ = ("_models", "_pool", "_replicas", "_seen_models", "_seen_replicas")

    def __init__(self) -> None:
        self._pool: Pool | None = None
        self._models: frozenset[str] = frozenset()
        self._replicas: frozenset[str] = frozenset()
        self._seen_models: set[str] = set()
        self._seen_replicas: set[str] = set()

    def _learn(self, pool: Pool) -> None:
        if pool is not self._pool:  # a live pool is replaced whole when it changes
            self._pool = pool
            self._models = frozenset(m for r in pool.replicas for m in r.models)
            self._replicas = frozenset(r.address for r in pool.replicas)

    @staticmethod
    def _first(seen: set[str], value: str) -> str:
        if value in seen:
            return value
        if len(seen) < MAX_UNDECLARED:
            seen.add(value)
            return value
        return OTHER

    def model(self, name: str | None, pool: Pool) -> str:
        if not name:
            return NONE
        self._learn(pool)
        if self._models:
            return name if name in self._models else OTHER
        return self._first(self._seen_models, name)

    def replica(self, address: str | None, pool: Pool) -> str:
        if not address:
            return NONE
        self._learn(pool)
        if self._replicas:
            return address if address in self._replicas else OTHER
        return self._first(self._seen_replicas, address)


class Telemetry:
    def __init__(self, cfg: TelemetryConfig, gateway_id: str,
                 metrics_listen: str | None = None) -> None:
        # The SDK reads the same process environment for what the plan leaves to it.
        plan = otlp_plan(cfg, os.environ)
        self.plan = plan
        # Spans are made only when they are exported; `enabled`: anything is (per-chunk
        # timing is then sampled).
        self.tracing = plan.traces
        self.enabled = plan.traces or plan.metrics or metrics_listen is not None
        self.metrics_listen = metrics_listen
        self._providers: list[Any] = []
        self._registry: Any = None
        self._server: MetricsServer | None = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        meter = metrics.NoOpMeterProvider().get_meter("extproc")
        if self.enabled:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import MetricReader
            from opentelemetry.sdk.resources import Resource

            attrs: dict[str, str] = {"service.instance.id": gateway_id}
            if plan.service_name is not None:
                attrs["service.name"] = plan.service_name
            # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME under these.
            res = Resource.create(attrs)
            if plan.traces:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )
                from opentelemetry.sdk.trace import TracerProvider
                from opentelemetry.sdk.trace.export import BatchSpanProcessor
                from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

                spans = plan.trace_export
                assert spans is not None
                tp = TracerProvider(resource=res,
                                    sampler=ParentBased(TraceIdRatioBased(spans.ratio)))
                tp.add_span_processor(BatchSpanProcessor(
                    OTLPSpanExporter(endpoint=spans.target, insecure=not spans.tls,
                                     headers=dict(spans.headers) or None,
                                     # An OTEL_ CA file is the SDK's to read, as before.
                                     credentials=_credentials(cfg.otlp_ca_file)),
                    schedule_delay_millis=plan.span_delay_ms))
                self._providers.append(tp)
                self.tracer = tp.get_tracer("extproc")
            readers: list[MetricReader] = []
            if plan.metrics:
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                    OTLPMetricExporter,
                )
                from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

                readers.append(PeriodicExportingMetricReader(
                    OTLPMetricExporter(endpoint=plan.endpoint, insecure=plan.metrics_insecure,
                                       credentials=_credentials(cfg.otlp_ca_file)),
                    export_interval_millis=plan.export_interval_ms))
            if metrics_listen is not None:
                from opentelemetry.exporter.prometheus import PrometheusMetricReader
                from prometheus_client import CollectorRegistry
                from prometheus_client.gc_collector import GCCollector
                from prometheus_client.platform_collector import PlatformCollector
                from prometheus_client.process_collector import ProcessCollector

                # Our own registry: the process_* series plus ours, nothing another library
                # put into prometheus_client's global one.
                self._registry = CollectorRegistry()
                for c in (ProcessCollector, PlatformCollector, GCCollector):
                    c(registry=self._registry)
                readers.append(PrometheusMetricReader(registry=self._registry,
                                                      scope_info_enabled=False))
            if readers:
                from opentelemetry.sdk.metrics.view import (
                    ExplicitBucketHistogramAggregation,
                    View,
                )

                # Buckets that fit the values (the SDK's default ones start at 5 and go to
                # 10,000: every ratio and every chunk time would land in the first).
                views = [View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(
                    bounds)) for name, bounds in (
                        ("llmgw.retry_budget.utilization", _RATIO_BUCKETS),
                        ("llmgw.chunk.processing_time", _CHUNK_MS_BUCKETS),
                        ("gen_ai.client.operation.time_to_first_chunk", _TTFC_S_BUCKETS),
                        ("gen_ai.client.operation.duration", _DURATION_S_BUCKETS),
                        ("gen_ai.client.token.usage", _TOKEN_BUCKETS),
                        ("llmgw.request.attempts", _ATTEMPT_BUCKETS),
                        ("llmgw.retry.added_time", _ADDED_S_BUCKETS))]
                mp = MeterProvider(resource=res, metric_readers=readers, views=views)
                self._providers.append(mp)
                meter = mp.get_meter("extproc")
        self._meter = meter
        self.labels = Labels()
        # The OpenTelemetry GenAI conventions' client metrics (the processor is the client of
        # the replicas; a request's figures span all its attempts), with their attributes.
        self.ttfc = meter.create_histogram(
            "gen_ai.client.operation.time_to_first_chunk", unit="s",
            description="from the request's intake to its first delta handed downstream")
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration", unit="s",
            description="from the request's intake to its end, every attempt included")
        self.tokens = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="output tokens delivered to the client, per request")
        # The gateway's own failover figures, by model and replica.
        self.attempts = meter.create_histogram(
            "llmgw.request.attempts", unit="{attempt}",
            description="attempts a request took to its first delta (1: no failover)")
        self.added = meter.create_histogram(
            "llmgw.retry.added_time", unit="s",
            description="time to first delta spent before the delivering attempt began "
                        "(requests whose first attempt failed)")
        self.refusals = meter.create_counter(
            "llmgw.refusals", description="managed errors instead of an upstream, by code")
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

    def observe(self, name: str, description: str, unit: str,
                read: Callable[[], float | None]) -> None:
        """A gauge read at each collection (OTLP export or a scrape: maybe another thread).

        `read` returns None when there is nothing to report (the series is left out).
        """
        from opentelemetry.metrics import CallbackOptions, Observation

        def cb(_: CallbackOptions) -> Iterable[Observation]:
            v = read()
            return [] if v is None else [Observation(v)]

        self._meter.create_observable_gauge(name, callbacks=[cb], unit=unit,
                                            description=description)

    def serve_metrics(self) -> str | None:
        """Start the /metrics endpoint (server.metrics_listen); its bound address."""
        if self.metrics_listen is None or self._registry is None:
            return None
        try:
            self._server = MetricsServer(self._registry, self.metrics_listen)
        except OSError as e:  # named like any start-up error of the configuration
            raise ConfigError("server.metrics_listen",
                              f"cannot listen on {self.metrics_listen}: {e.strerror}") from e
        log.info("metrics listening", extra={"metrics_listen": self._server.address,
                                             "request_id": None, "attempt_id": None})
        return self._server.address

    def parent_from(self, carrier: Mapping[str, str]) -> Context | None:
        if not self.tracing:
            return None
        ctx = _prop.extract(dict(carrier))
        span = trace.get_current_span(ctx)
        return ctx if span.get_span_context().is_valid else None

    def start(self, name: str, parent: Context | None, kind: SpanKind,
              attributes: Mapping[str, Any]) -> Span:
        if not self.tracing:
            return self.unrecorded()
        return self.tracer.start_span(name, context=parent, kind=kind,
                                      attributes={k: v for k, v in attributes.items()
                                                  if v is not None})

    @staticmethod
    def unrecorded() -> Span:
        """What `start` answers while tracing is off (its attributes are never read): one
        span for all, not one per stream (it records nothing and holds nothing)."""
        return _UNRECORDED

    def traceparent(self, span: Span) -> str | None:
        if not self.tracing or not span.get_span_context().is_valid:
            return None
        carrier: dict[str, str] = {}
        _prop.inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for p in self._providers:
            p.shutdown()


def end_span(span: Span, error: str | None = None, **attrs: Any) -> None:
    if span.is_recording():  # else every call below is a no-op (tracing off, or ended)
        for k, v in attrs.items():
            if v is not None:
                span.set_attribute(k, v)
        if error:
            span.set_attribute("error.type", error)
            span.set_status(Status(StatusCode.ERROR, error))
    span.end()

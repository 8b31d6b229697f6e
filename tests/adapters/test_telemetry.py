"""Which OTLP settings win (config file or OTEL_*), and /metrics on a real socket."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from opentelemetry.trace import NonRecordingSpan
from prometheus_client.parser import text_string_to_metric_families

from devkit.devstack import free_port
from extproc.adapters.telemetry import MAX_UNDECLARED, NONE, OTHER, Labels, Telemetry, otlp_plan
from extproc.core.config import ConfigError, TelemetryConfig
from extproc.core.pool import Fingerprint, Pool, Replica

FILE = TelemetryConfig(otlp_endpoint="collector:4317")


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)


def test_nothing_configured_exports_nothing() -> None:
    p = otlp_plan(TelemetryConfig(), {})
    assert not p.traces and not p.metrics
    t = Telemetry(TelemetryConfig(), "gw-1")
    assert not t.enabled and not t.tracing


def test_the_files_bare_endpoint_stays_plaintext() -> None:
    p = otlp_plan(FILE, {})
    assert p.traces and p.metrics and p.endpoint == "collector:4317"
    assert p.trace_export is not None and not p.trace_export.tls
    assert p.trace_export.target == "collector:4317" and p.metrics_insecure is True
    assert p.service_name == "llm-failover-extproc"
    assert p.export_interval_ms == 10_000 and p.span_delay_ms == 200


def test_the_files_endpoint_wins_over_the_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4317",
           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4317"}
    assert otlp_plan(FILE, env).endpoint == "collector:4317"


@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_ENDPOINT",
                                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                                 "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"])
def test_the_environment_fills_a_null_endpoint(var: str) -> None:
    p = otlp_plan(TelemetryConfig(), {var: "http://collector:4317"})
    # The metrics SDK reads the variable itself (endpoint None) and decides TLS from its
    # scheme; spans go where Envoy's go (extproc.core.otlp), plaintext for http://.
    assert p.endpoint is None and p.metrics_insecure is None
    if p.traces:
        assert p.trace_export is not None and p.trace_export.target == "collector:4317"
        assert not p.trace_export.tls
    assert p.traces == ("METRICS" not in var)
    assert p.metrics == ("TRACES" not in var)


def test_a_scheme_or_an_otel_tls_setting_decides_tls() -> None:
    p = otlp_plan(TelemetryConfig(otlp_endpoint="https://collector:4317"), {})
    assert p.trace_export is not None and p.trace_export.tls and p.metrics_insecure is None
    p = otlp_plan(FILE, {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/ca.pem"})
    assert p.trace_export is not None and not p.trace_export.tls  # bare: plaintext still
    assert p.metrics_insecure is None
    p = otlp_plan(FILE, {"OTEL_EXPORTER_OTLP_INSECURE": "false"})
    assert p.trace_export is not None and p.trace_export.tls
    assert p.trace_export.ca_file is None
    p = otlp_plan(FILE, {"OTEL_EXPORTER_OTLP_METRICS_INSECURE": "false"})
    assert p.trace_export is not None and not p.trace_export.tls
    assert p.metrics_insecure is None


def test_exporter_none_and_sdk_disabled() -> None:
    p = otlp_plan(FILE, {"OTEL_TRACES_EXPORTER": "none"})
    assert not p.traces and p.metrics
    p = otlp_plan(FILE, {"OTEL_METRICS_EXPORTER": "None "})
    assert p.traces and not p.metrics
    p = otlp_plan(FILE, {"OTEL_SDK_DISABLED": "true"})
    assert not p.traces and not p.metrics


def test_defaults_yield_to_otel_variables_and_set_values_do_not() -> None:
    env = {"OTEL_SERVICE_NAME": "from-env", "OTEL_METRIC_EXPORT_INTERVAL": "500",
           "OTEL_BSP_SCHEDULE_DELAY": "50"}
    p = otlp_plan(FILE, env)
    assert p.service_name is None and p.export_interval_ms is None and p.span_delay_ms is None
    p = otlp_plan(TelemetryConfig(otlp_endpoint="c:4317", service_name="from-file",
                                  metrics_interval_s=2.0), env)
    assert p.service_name == "from-file" and p.export_interval_ms == 2000


def scrape(addr: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def test_metrics_endpoint_serves_the_same_instruments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")  # the file left service_name default
    addr = f"127.0.0.1:{free_port()}"
    t = Telemetry(TelemetryConfig(), "gw-9", metrics_listen=addr)
    # /metrics alone: no spans, but per-chunk timing is sampled.
    assert t.enabled and not t.tracing
    depth = [3.0]
    t.observe("llmgw.test_depth", "a test gauge", "1", lambda: depth[0])
    t.observe("llmgw.absent", "reports nothing", "s", lambda: None)
    assert t.serve_metrics() == addr
    try:
        t.retries.add(2, {"decision": "admitted"})
        t.outcomes.add(1, {"outcome": "completed"})
        t.budget_used.record(0.3)
        t.chunk_time.record(0.07)
        m = scrape(addr)
        # Buckets that fit the values (not the SDK's default 0, 5, 10, ... 10000).
        assert m["llmgw_retry_budget_utilization_bucket|le=0.25"] == 0
        assert m["llmgw_retry_budget_utilization_bucket|le=0.5"] == 1
        assert m["llmgw_chunk_processing_time_milliseconds_bucket|le=0.05"] == 0
        assert m["llmgw_chunk_processing_time_milliseconds_bucket|le=0.1"] == 1
        assert m["llmgw_retries_total|decision=admitted"] == 2
        assert m["llmgw_requests_total|outcome=completed"] == 1
        assert m["llmgw_test_depth"] == 3
        assert not any(k.startswith("llmgw_absent") for k in m)
        info = next(k for k in m if k.startswith("target_info|"))
        assert "service_instance_id=gw-9" in info and "deployment_environment=test" in info
        assert "service_name=from-env" in info
        assert "process_resident_memory_bytes" in m
        depth[0] = 0.0
        t.retries.add(1, {"decision": "admitted"})
        m = scrape(addr)
        assert m["llmgw_retries_total|decision=admitted"] == 3 and m["llmgw_test_depth"] == 0
    finally:
        t.shutdown()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{addr}/metrics", timeout=2)


def test_metrics_endpoint_that_cannot_bind_fails_at_start() -> None:
    addr = f"127.0.0.1:{free_port()}"
    a = Telemetry(TelemetryConfig(), "gw-1", metrics_listen=addr)
    b = Telemetry(TelemetryConfig(), "gw-2", metrics_listen=addr)
    a.serve_metrics()
    try:
        with pytest.raises(ConfigError) as ei:
            b.serve_metrics()
        assert ei.value.path == "server.metrics_listen" and addr in str(ei.value)
    finally:
        a.shutdown()
        b.shutdown()


def test_the_processors_sampler_is_parent_based_on_the_shared_ratio() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import Decision
    from opentelemetry.trace import SpanContext, TraceFlags, set_span_in_context

    t = Telemetry(TelemetryConfig(otlp_endpoint="127.0.0.1:1", sampling_ratio=0.0), "gw-1")
    try:
        tp = next(p for p in t._providers if isinstance(p, TracerProvider))
        tid = 0x0AF7651916CD43DD8448EB211C80319C
        # A root at ratio 0 is dropped...
        assert tp.sampler.should_sample(None, tid, "r").decision == Decision.DROP
        # ...a child of Envoy's sampled span is kept: Envoy's decision holds for the trace.
        parent = set_span_in_context(NonRecordingSpan(SpanContext(
            tid, 0xB7AD6B7169203331, is_remote=True, trace_flags=TraceFlags(1))))
        assert tp.sampler.should_sample(parent, tid, "r").decision == \
            Decision.RECORD_AND_SAMPLE
    finally:
        t.shutdown()


def _pool(*reps: tuple[str, tuple[str, ...]]) -> Pool:
    fp = Fingerprint(weights_revision="r1")
    return Pool(tuple(Replica(addr, fp, models) for addr, models in reps))


def test_model_and_replica_labels_are_bounded_by_the_pool() -> None:
    lab = Labels()
    pool = _pool(("10.0.0.1:8000", ("llama",)), ("10.0.0.2:8000", ("llama", "qwen")))
    assert lab.model("llama", pool) == "llama" and lab.model("qwen", pool) == "qwen"
    # Whatever a client writes, a model no replica declares is one value.
    assert {lab.model(f"x{i}", pool) for i in range(100)} == {OTHER}
    assert lab.replica("10.0.0.2:8000", pool) == "10.0.0.2:8000"
    assert lab.replica("10.9.9.9:1", pool) == OTHER
    assert lab.model(None, pool) == NONE and lab.replica(None, pool) == NONE
    # A live pool is replaced whole: the new one's members are labels, the old ones not.
    moved = _pool(("10.0.0.3:8000", ("qwen",)))
    assert lab.replica("10.0.0.3:8000", moved) == "10.0.0.3:8000"
    assert lab.replica("10.0.0.1:8000", moved) == OTHER
    assert lab.model("llama", moved) == OTHER


def test_labels_without_declared_models_keep_the_first_few() -> None:
    lab, pool = Labels(), Pool()
    names = {lab.model(f"m{i}", pool) for i in range(MAX_UNDECLARED + 50)}
    assert len(names) == MAX_UNDECLARED + 1 and OTHER in names
    assert lab.model("m0", pool) == "m0"  # one seen early keeps its name


def test_genai_and_failover_histograms_on_metrics() -> None:
    """The conventions' names, units and attributes as Prometheus writes them, and buckets
    that fit the values (seconds from ms to a minute; attempts 1 to 10)."""
    addr = f"127.0.0.1:{free_port()}"
    t = Telemetry(TelemetryConfig(), "gw-1", metrics_listen=addr)
    t.serve_metrics()
    try:
        sc = {"gen_ai.operation.name": "chat", "gen_ai.request.model": "llama",
              "server.address": "10.0.0.1:8000"}
        t.ttfc.record(0.03, sc)
        t.duration.record(1.5, {**sc, "error.type": "upstream_timeout"})
        t.tokens.record(40, {**sc, "gen_ai.token.type": "output"})
        t.attempts.record(2, {"model": "llama", "replica": "10.0.0.1:8000"})
        t.added.record(0.3, {"model": "llama", "replica": "10.0.0.1:8000"})
        t.refusals.add(1, {"code": "retry_budget_exhausted", "replica": "10.0.0.1:8000"})
        m = scrape(addr)

        def key(name: str, **labels: str) -> str:
            return name + "".join(f"|{k}={v}" for k, v in sorted(labels.items()))

        lab = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "llama",
               "server_address": "10.0.0.1:8000"}
        ttfc = "gen_ai_client_operation_time_to_first_chunk_seconds_bucket"
        assert m[key(ttfc, **lab, le="0.02")] == 0
        assert m[key(ttfc, **lab, le="0.04")] == 1
        dur = "gen_ai_client_operation_duration_seconds"
        assert m[key(dur + "_bucket", **lab, error_type="upstream_timeout", le="1.28")] == 0
        assert m[key(dur + "_count", **lab, error_type="upstream_timeout")] == 1
        out = {**lab, "gen_ai_token_type": "output"}
        assert m[key("gen_ai_client_token_usage_sum", **out)] == 40
        assert m[key("gen_ai_client_token_usage_bucket", **out, le="64")] == 1
        own = {"model": "llama", "replica": "10.0.0.1:8000"}
        assert m[key("llmgw_request_attempts_bucket", **own, le="1")] == 0
        assert m[key("llmgw_request_attempts_bucket", **own, le="2")] == 1
        assert m[key("llmgw_retry_added_time_seconds_bucket", **own, le="0.25")] == 0
        assert m[key("llmgw_retry_added_time_seconds_bucket", **own, le="0.5")] == 1
        assert m[key("llmgw_refusals_total", code="retry_budget_exhausted",
                     replica="10.0.0.1:8000")] == 1
    finally:
        t.shutdown()


def test_the_otel_sampler_variables_set_the_ratio_when_the_file_does_not() -> None:
    env = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
           "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    p = otlp_plan(FILE, env)
    assert p.trace_export is not None and p.trace_export.ratio == 0.1
    p = otlp_plan(TelemetryConfig(otlp_endpoint="c:4317", sampling_ratio=0.5), env)
    assert p.trace_export is not None and p.trace_export.ratio == 0.5


def test_an_unreadable_ca_file_stops_the_start_naming_the_field(tmp_path: Path) -> None:
    cfg = TelemetryConfig(otlp_endpoint="https://127.0.0.1:1",
                          otlp_ca_file=str(tmp_path / "missing-ca.crt"))
    with pytest.raises(ConfigError) as ei:
        Telemetry(cfg, "gw-1")
    assert ei.value.path == "telemetry.otlp_ca_file"


async def test_a_guarded_request_is_counted_by_its_declared_model_and_replica() -> None:
    """The observer's labels in a request's real flow (the guard session on the in-memory
    store): the pool declares the model and the replica, so both keep their names; a
    model no replica declares is refused before any upstream (replica `none`)."""
    import asyncio
    import json

    from extproc.adapters.guard import GuardSession
    from extproc.core import headers as H

    from .support import SSE_CONTENT, SSE_DONE, SSE_ROLE
    from .test_sessions import (
        CHAT,
        DOWN,
        REPLICA,
        immediate,
        proc,
        req_body,
        req_headers,
        resp_body,
        resp_headers,
        set_headers,
        start,
    )

    addr = f"127.0.0.1:{free_port()}"
    p, _ = proc({"server": {"metrics_listen": addr}, "pool": {"replicas": [
        {"address": REPLICA, "fingerprint": {"weights_revision": "r1"},
         "models": ["demo-model"]}]}})
    assert p.tel.serve_metrics() == addr
    try:
        ctx, _, task = start(GuardSession, p)
        ctx.send(req_headers(DOWN))
        (r,) = await ctx.wait_for(1)
        rid = set_headers(r, "request_headers")[H.REQUEST_ID]
        ctx.send(req_body(CHAT))
        await ctx.wait_for(2)
        ho = json.dumps({"attempt": 1, "attempt_id": "att_test_1", "replica": REPLICA,
                         "lease_id": 0, "started_at": p.clock.wall()})
        ctx.send(resp_headers({":status": "200", "content-type": "text/event-stream",
                               H.HANDOFF: ho}))
        ctx.send(resp_body(SSE_ROLE + SSE_CONTENT + SSE_CONTENT))
        ctx.send(resp_body(SSE_DONE, eos=True))
        await ctx.wait_for(5)
        ctx.close()
        await asyncio.wait_for(task, 3)
        await p.drain()
        assert rid

        rogue = json.dumps({"model": "rogue", "stream": True, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}).encode()
        ctx, _, task = start(GuardSession, p)
        ctx.send(req_headers({**DOWN, "idempotency-key": "k-2"}))
        await ctx.wait_for(1)
        ctx.send(req_body(rogue))
        (_, refused) = await ctx.wait_for(2)
        assert immediate(refused)[0] == 503  # no replica serves it
        ctx.close()
        await asyncio.wait_for(task, 3)
        await p.drain()

        m = scrape(addr)
        sc = ("|gen_ai_operation_name=chat|gen_ai_request_model=demo-model"
              f"|server_address={REPLICA}")
        assert m[f"gen_ai_client_operation_time_to_first_chunk_seconds_count{sc}"] == 1
        assert m[f"gen_ai_client_operation_duration_seconds_count{sc}"] == 1
        out = sc.replace("|server", "|gen_ai_token_type=output|server")
        assert m[f"gen_ai_client_token_usage_sum{out}"] == 2
        assert m[f"llmgw_request_attempts_bucket|le=1|model=demo-model|replica={REPLICA}"] == 1
        assert m["llmgw_requests_total|model=demo-model|outcome=completed"] == 1
        assert m["llmgw_refusals_total|code=no_compatible_replica|replica=none"] == 1
        assert not any("rogue" in k for k in m)
    finally:
        p.tel.shutdown()

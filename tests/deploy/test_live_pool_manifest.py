"""The live-pool example manifests: `extproc register` beside vLLM, and vLLM behind
`extproc agent`, each as the CLI accepts it and mounted as its config reads it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.core.membership import registration_record

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy/live-pool/vllm-with-register.yaml"


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _register_parser() -> argparse.ArgumentParser:
    """The `register` subcommand exactly as the CLI declares it (its own parser)."""
    return _sub_parser("register")


def test_the_agent_sidecar_is_a_valid_register_command() -> None:
    docs = _docs()
    cm = _kind(docs, "ConfigMap", "llama-fingerprint")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    agent = next(c for c in pod["containers"] if c["name"] == "register")
    cmd = agent["command"]
    assert cmd[:2] == ["extproc", "register"]
    args = _register_parser().parse_args(cmd[2:])
    # The downward API gives the pod IP; the registration must then be valid as written.
    assert args.address == "$(POD_IP):8000"
    assert [e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"]
            if e["name"] == "POD_IP"] == ["status.podIP"]
    fp = yaml.safe_load(cm["data"]["fingerprint.yaml"])
    rec = registration_record(args.address.replace("$(POD_IP)", "10.1.2.3"), fp, args.model)
    assert rec["fingerprint"]["weights_revision"].startswith("meta-llama/")
    # The files the command names are mounted where it looks for them.
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    assert args.config in mounts
    assert str(Path(args.fingerprint_file).parent) in mounts
    # It probes the model server it sits beside, on the port the model server serves.
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    assert args.probe == "127.0.0.1:8000"
    assert vllm["ports"][0]["containerPort"] == 8000
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True



# --- vLLM behind the replica agent (deploy/live-pool/vllm-with-agent.yaml) ------------------

AGENT_MANIFEST = ROOT / "deploy/live-pool/vllm-with-agent.yaml"
CHART = ROOT / "helm/llm-failover-extproc"


def _agent_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(AGENT_MANIFEST.read_text()) if d]


def _sub_parser(name: str) -> argparse.ArgumentParser:
    """A subcommand's parser exactly as the CLI declares it."""
    import extproc.cli as cli
    captured: dict[str, argparse.ArgumentParser] = {}
    real = argparse.ArgumentParser.parse_args

    def grab(self: argparse.ArgumentParser, args: Any = None, ns: Any = None) -> Any:
        sub = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction))
        captured[name] = sub.choices[name]
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = grab  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            cli.main([name])
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    return captured[name]


def _kind(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _port(container: dict[str, Any], name: str) -> int:
    return int(next(p["containerPort"] for p in container.get("ports", [])
                    if p["name"] == name))


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)


def test_the_agent_example_validates_against_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    lowest = chart["kubeVersion"].removeprefix(">=").removesuffix("-0")
    for kube in (lowest, "1.30.0"):
        for doc in _agent_docs():
            kv.validate(doc, kube, strict=True)


def test_vllm_runs_behind_the_agent_on_loopback() -> None:
    docs = _agent_docs()
    pod = _kind(docs, "Deployment", "llama")["spec"]["template"]["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    agent = next(c for c in pod["containers"] if c["name"] == "agent")
    cmd = agent["command"]
    assert cmd[:2] == ["extproc", "agent"]
    args = _sub_parser("agent").parse_args(cmd[2:])  # what `extproc agent --help` accepts
    assert args.engine_kind == "vllm"
    # vLLM on loopback only, on the port the agent calls; no port of its own in the pod spec.
    va = vllm["args"]
    engine_host, engine_port = _hostport(args.engine)
    assert engine_host == "127.0.0.1"
    assert va[va.index("--host") + 1] == "127.0.0.1"
    assert int(va[va.index("--port") + 1]) == engine_port
    assert "ports" not in vllm
    for probe in ("startupProbe", "livenessProbe"):
        assert f"http://127.0.0.1:{engine_port}/health" in " ".join(
            vllm[probe]["exec"]["command"])
    # The agent serves the pod's port and registers the pod IP on it.
    listen_port = _hostport(args.listen)[1]
    assert listen_port == _port(agent, "http")
    assert args.address == f"$(POD_IP):{listen_port}"
    assert [e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"]
            if e["name"] == "POD_IP"] == ["status.podIP"]
    cm = _kind(docs, "ConfigMap", "llama-fingerprint")
    fp = yaml.safe_load(cm["data"]["fingerprint.yaml"])
    rec = registration_record(args.address.replace("$(POD_IP)", "10.1.2.3"), fp, args.model)
    assert rec["address"] == f"10.1.2.3:{listen_port}"
    # Readiness on the agent's /healthz (it follows the engine's), liveness on its ops port;
    # Prometheus scrapes the ops port.
    ops_port = _hostport(args.ops)[1]
    assert ops_port == _port(agent, "agent-ops")
    assert agent["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert agent["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "agent-ops"}
    ann = _kind(docs, "Deployment", "llama")["spec"]["template"]["metadata"]["annotations"]
    assert (ann["prometheus.io/port"], ann["prometheus.io/path"]) == (str(ops_port), "/metrics")
    # The pool's Service: headless, on the agent's port (never vLLM's), and its ops port.
    svc = _kind(docs, "Service", "llama")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"app": "llama"}
    assert {(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        ("http", listen_port, "http"), ("agent-ops", ops_port, "agent-ops")}
    assert engine_port not in {p["port"] for p in svc["spec"]["ports"]}
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True


def _mounts_the_chart_s_etcd_secrets(docs: list[dict[str, Any]], name: str,
                                     config_map: str) -> tuple[Any, dict[str, Any],
                                                               dict[str, Any]]:
    """The sidecar `name` reads its config, TLS and auth files where they are mounted, from
    the Secrets the README's install creates, at the chart's own paths."""
    from extproc.core.config import load_config
    pod = _kind(docs, "Deployment", "llama")["spec"]["template"]["spec"]
    agent = next(c for c in pod["containers"] if c["name"] == name)
    args = _sub_parser(name).parse_args(agent["command"][2:])
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    # The config file and the fingerprint are mounted where the command names them.
    conf = mounts[args.config]
    assert volumes[conf["name"]]["configMap"]["name"] == config_map
    assert conf["subPath"] == Path(args.config).name
    assert str(Path(args.fingerprint_file).parent) in mounts
    raw = yaml.safe_load(_kind(docs, "ConfigMap", config_map)["data"][conf["subPath"]])
    cfg = load_config(raw)  # the processor's own loader: a wrong field fails here
    # The Secrets the README's install names (etcd.tls.secretName, etcd.auth.secretName)...
    readme = (ROOT / "README.md").read_text()
    tls_secret = re.search(r"etcd\.tls\.secretName=(\S+)", readme)
    auth_secret = re.search(r"etcd\.auth\.secretName=(\S+)", readme)
    assert tls_secret and auth_secret
    # ...mounted where the chart mounts them, with the file names its config uses.
    helpers = (CHART / "templates/_helpers.tpl").read_text()
    for vol, secret, path in (("etcd-tls", tls_secret[1], "/etc/extproc/etcd-tls"),
                              ("etcd-auth", auth_secret[1], "/etc/extproc/etcd-auth")):
        assert volumes[vol]["secret"]["secretName"] == secret
        assert mounts[path]["name"] == vol and mounts[path]["readOnly"] is True
        assert f"mountPath: {path}" in helpers
    tls, auth = cfg.etcd.tls, cfg.etcd.auth
    assert tls.enabled and auth.enabled
    for f in (tls.ca_file, tls.cert_file, tls.key_file, auth.username_file, auth.password_file):
        assert f is not None and f'"{f}"' in helpers, f  # the chart's own paths
        assert str(Path(f).parent) in mounts
    gw = yaml.safe_load((CHART / "values.yaml").read_text())["processor"]["config"]
    assert cfg.etcd.prefix == gw["etcd"]["prefix"]
    assert cfg.pool.discovery == "registry"
    assert cfg.pool.registration_ttl_s == gw["pool"]["registration_ttl_s"]
    assert cfg.pool.health_check.path == "/health"  # vLLM's, probed by the sidecar
    # The image's user reads the 0400 Secrets through the pod's fsGroup, as in the chart.
    assert pod["securityContext"]["fsGroup"] == agent["securityContext"]["runAsGroup"]
    return cfg, pod, agent


def test_the_register_sidecar_mounts_the_chart_s_etcd_secrets() -> None:
    """Issue 27: the register example named TLS and auth files it never mounted (and a
    ConfigMap of another namespace), so its sidecar could not start."""
    _mounts_the_chart_s_etcd_secrets(_docs(), "register", "extproc-register")


def test_the_register_example_validates_against_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    lowest = chart["kubeVersion"].removeprefix(">=").removesuffix("-0")
    for kube in (lowest, "1.30.0"):
        for doc in _docs():
            kv.validate(doc, kube, strict=True)


def test_the_agent_mounts_the_chart_s_etcd_secrets_where_its_config_reads_them() -> None:
    cfg, _, _ = _mounts_the_chart_s_etcd_secrets(_agent_docs(), "agent", "extproc-agent")
    # The agent also reads the gateway's live/ keys and their leases: the same TTL.
    gw = yaml.safe_load((CHART / "values.yaml").read_text())["processor"]["config"]
    assert cfg.etcd.attempt_lease_ttl_s == gw["etcd"]["attempt_lease_ttl_s"]

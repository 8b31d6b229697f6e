"""The dashboard and the alert rules, checked by a real Prometheus (Debian's 2.42 package).

`promtool check rules` and `promtool test rules` on deploy/observability; then a real
Prometheus (loopback, its own storage, a 1 s scrape) scrapes the real processor's /metrics
and Envoy's /stats/prometheus while replicas are killed before and after the first delta,
and every target of every dashboard panel must return data through Prometheus' HTTP API.
With DASHBOARD_PNG set (`make dashboard-image`) the panels' query_range results of that run
are drawn into that file. Skipped when the binaries are absent: `make prometheus`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devkit.devstack import Proc, Stack, _http_ok, free_port, wait_until

from .conftest import Gateway

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
OBS = ROOT / "deploy" / "observability"
CHART_FILES = ROOT / "helm" / "llm-failover-extproc" / "files"
RATE = "1m"  # $__rate_interval, as Grafana would set it: the whole run fits in it
# Two rounds keep the test under a minute; the picture (`make dashboard-image`) takes more,
# so that most series have grown a few times inside the rate window.
ROUNDS = int(os.environ.get("DASHBOARD_ROUNDS", "2"))
needs = pytest.mark.skipif(not (shutil.which("prometheus") and shutil.which("promtool")),
                           reason="prometheus/promtool not installed: run `make prometheus`")


def test_the_chart_ships_the_same_files() -> None:
    for name in ("dashboard.json", "alerts.rules.yaml"):
        assert (CHART_FILES / name).read_bytes() == (OBS / name).read_bytes(), name


@needs
def test_promtool_checks_and_unit_tests_the_alert_rules() -> None:
    for argv in (["check", "rules", "alerts.rules.yaml"], ["test", "rules", "alerts.test.yaml"]):
        r = subprocess.run(["promtool", *argv], cwd=OBS, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "SUCCESS" in r.stdout


def panels() -> list[dict[str, Any]]:
    dash = json.loads((OBS / "dashboard.json").read_text())
    return list(dash["panels"])


def expr_of(target: dict[str, Any]) -> str:
    return str(target["expr"]).replace("$__rate_interval", RATE)


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, tuple[str, str]]) -> None:
        self.port = free_port()
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
               "scrape_configs": [{"job_name": job, "metrics_path": path,
                                   "static_configs": [{"targets": [addr]}]}
                                  for job, (addr, path) in targets.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.proc = Proc("prometheus", [
            "prometheus", f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h", "--log.level=warn"],
            workdir / "prometheus.log")

    def start(self) -> Prometheus:
        self.proc.start()
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{self.port}/-/ready"), 30,
                   "prometheus ready")
        return self

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def targets_up(self) -> bool:
        act = self.api("targets")["activeTargets"]
        return len(act) == 2 and all(t["health"] == "up" for t in act)


@pytest.fixture(scope="module")
def pstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = {"server": {"metrics_listen": f"127.0.0.1:{free_port()}"},
           "timeouts": {"first_delta_s": 5.0, "stall_after_first_delta_s": 1.0,
                        "access_log_wait_s": 0.5, "fence_wait_s": 12.0},
           "policy": {"retry_budget": {"min_retry_concurrency": 100000}}}
    st = Stack(workdir=tmp_path_factory.mktemp("prom"), config=cfg, token_delay_ms=20).start()
    try:
        yield st
    finally:
        st.stop()


def fault_round(gw: Gateway, st: Stack) -> list[str]:
    """One of each: a clean answer; a replica killed before its first delta (before and
    after its headers) and one answering 503 (Envoy retries each elsewhere); one killed
    after 2 deltas (interrupted); one that stalls (the watchdog ends it); a repeat of the
    interrupted key (refused, 409); a body that is not JSON (refused, 400)."""
    ids = []
    ok = gw.post(gw.body(max_tokens=4))
    assert ok.status == 200 and len(ok.contents) == 4
    ids.append(ok.request_id)
    for kind in ("kill-before-headers", "kill-after-headers", "overloaded:503"):
        r = gw.post(gw.body(max_tokens=4), headers={"x-replica-fault": kind})
        assert r.status == 200 and len(r.contents) == 4, r.raw
        ids.append(r.request_id)
        st.wait_replicas_healthy()
    key = f"prom-{time.time_ns()}"
    cut = gw.post(gw.body(max_tokens=8), headers={"x-replica-fault": "kill-after-deltas:2"},
                  key=key)
    assert cut.transport_error is not None and len(cut.contents) == 2
    ids.append(cut.request_id)
    st.wait_replicas_healthy()
    stalled = gw.post(gw.body(max_tokens=8), headers={"x-replica-fault": "stall-after-deltas:2"})
    assert stalled.error is not None and stalled.error["code"] == "upstream_decode_interrupted"
    ids.append(stalled.request_id)
    again = gw.post(gw.body(max_tokens=8), key=key)
    assert again.status == 409
    bad = gw.client.post("/v1/chat/completions", content=b'{"model": "demo-model", "str')
    assert bad.status_code == 400
    for rid in ids:
        gw.journal(rid)  # the outcome is written (and counted) before we look
    return ids


@needs
def test_every_dashboard_query_returns_data_from_a_fault_run(pstack: Stack,
                                                             tmp_path: Path) -> None:
    st = pstack
    assert st.cfg is not None and st.cfg.server.metrics_listen is not None
    st.wait_replicas_healthy()
    prom = Prometheus(tmp_path, {
        "processor": (st.cfg.server.metrics_listen, "/metrics"),
        "envoy": (f"127.0.0.1:{st.admin_port}", "/stats/prometheus")}).start()
    gw = Gateway(st)
    try:
        wait_until(prom.targets_up, 20, "both targets scraped")
        t0 = time.time()
        # Rounds with scrapes between them: a counter has grown inside the window, so rates
        # and quantiles are numbers, not just series (a series is born at its first count,
        # which rate() cannot see).
        for _ in range(ROUNDS):
            fault_round(gw, st)
            wait_scraped(prom, time.time())
        empty, nan = [], []
        for p in panels():
            for t in p["targets"]:
                res = prom.query(expr_of(t))
                if not res:
                    empty.append((p["title"], t["expr"]))
                elif all(math.isnan(float(r["value"][1])) for r in res):
                    nan.append((p["title"], t["expr"]))
        assert not empty, f"panels with no data: {empty}"
        assert not nan, f"panels with only NaN: {nan}"
        # The figures mean what the panels say: every fault kind left its mark.
        causes = {r["metric"]["cause"] for r in prom.query("llmgw_interruptions_total")}
        assert {"upstream", "stall"} <= causes
        codes = {r["metric"]["code"] for r in prom.query("llmgw_refusals_total")}
        assert "upstream_decode_interrupted" in codes and "invalid_request_body" in codes
        # Three retried requests a round (killed twice, one 503), each took 2 attempts.
        retried = prom.query("sum(llmgw_request_attempts_count) - "
                             "sum(llmgw_request_attempts_bucket{le=\"1\"})")
        assert float(retried[0]["value"][1]) == 3 * ROUNDS
        added = prom.query("sum(llmgw_retry_added_time_seconds_count)")
        assert float(added[0]["value"][1]) == 3 * ROUNDS
        rep = {r["metric"]["replica"] for r in prom.query("llmgw_request_attempts_count")}
        assert rep and all(x.startswith("127.0.0.1:") for x in rep)
        models = {r["metric"]["gen_ai_request_model"]
                  for r in prom.query("gen_ai_client_operation_duration_seconds_count")}
        assert models == {"demo-model"}
        if os.environ.get("DASHBOARD_PNG"):
            render(prom, t0 - 5, time.time() + 1, Path(os.environ["DASHBOARD_PNG"]))
    finally:
        gw.client.close()
        prom.proc.stop()


def wait_scraped(prom: Prometheus, after: float) -> None:
    """Until both targets were scraped after `after` (wall clock)."""
    def done() -> bool:
        res = prom.query("min(timestamp(up))")
        return bool(res) and float(res[0]["value"][1]) > after
    wait_until(done, 10, "a scrape after the round")


def render(prom: Prometheus, start: float, end: float, out: Path) -> None:
    """Each panel's targets over the run (query_range), drawn as the dashboard lays them
    out: a rendering of the same queries, not Grafana."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = panels()
    cols = 3
    rows = math.ceil(len(ps) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 5.2, rows * 2.9))
    for ax, p in zip(axes.flat, ps, strict=False):
        for t in p["targets"]:
            data = prom.api("query_range", query=expr_of(t), start=f"{start:.3f}",
                            end=f"{end:.3f}", step="1")["result"]
            for series in data:
                xs = [float(v[0]) - start for v in series["values"]]
                ys = [float(v[1]) for v in series["values"]]
                label = str(t["legendFormat"])
                for k, v in series["metric"].items():
                    label = label.replace("{{" + k + "}}", v)
                ax.plot(xs, ys, label=label, linewidth=1.2)
        ax.set_title(f"{p['title']} [{p['fieldConfig']['defaults']['unit']}]", fontsize=9)
        ax.set_xlabel("seconds into the run", fontsize=7)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(ps):]:
        ax.axis("off")
    fig.suptitle("LLM failover gateway: the dashboard's queries over a real fault run "
                 "(Prometheus query_range, drawn by matplotlib; not Grafana)", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


HELM = next((c for c in (os.environ.get("HELM"), str(ROOT / ".venv/npm/node_modules/.bin/helm"),
                         shutil.which("helm"))
             if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


def _helm_docs(*args: str) -> list[dict[str, Any]]:
    assert HELM is not None
    r = subprocess.run([HELM, "template", "gw", str(ROOT / "helm" / "llm-failover-extproc"),
                        "--kube-version", "1.30.0",
                        # The image has no default (decision 0038).
                        "--set", "image.processor.repository=registry.example/llm-failover-extproc",
                        *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.mark.skipif(HELM is None, reason="no helm binary (make install)")
def test_the_chart_renders_the_dashboard_and_the_rules_only_when_asked() -> None:
    ci = str(ROOT / "helm" / "llm-failover-extproc" / "ci" /
             "otlp-native-sidecar-metrics-values.yaml")
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _helm_docs("-f", ci)}
    cm = docs[("ConfigMap", "gw-llm-failover-extproc-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(cm["data"]["llm-failover-extproc.json"]) == json.loads(
        (OBS / "dashboard.json").read_text())
    rule = docs[("PrometheusRule", "gw-llm-failover-extproc")]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load((OBS / "alerts.rules.yaml").read_text())
    plain = {(d["kind"], d["metadata"]["name"]) for d in _helm_docs()}
    assert not any(k == "PrometheusRule" or n.endswith("-dashboard") for k, n in plain)

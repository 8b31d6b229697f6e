"""The chart's rendered Deployment, played by `podman kube play` from the built images.

A smoke test of the chart itself: what `helm template` renders (the processor's ConfigMap and
the Deployment: the envoy-bootstrap init container, Envoy, the processor, their volumes,
securityContext and probes) runs as a pod, from localhost/llm-failover-extproc and
localhost/llm-failover-envoy (`make image`), against a real etcd and a demo replica on
loopback. A stream goes through (with an API key: the chart's default tenancy; one without
gets the clear 401); the chart's exec probe answers SERVING inside the processor
container; the chart's drain script (the processor's preStop, which podman does not run
itself) stops Envoy, and the pod then stops with every container's status 0.

podman 4.3 needs four adaptations of the rendered Deployment (`podmanize`, docs/image.md):
host network without `ports:` (podman refuses port mappings outside a bridge network, and
named probe ports resolve through them, so they become numbers), no `subPath` (podman mounts
the whole ConfigMap: the mount moves to the directory), `restartPolicy: Never` (with Always it
restarts the finished init container and then fails to remove it). Only loopback ports are
used: every port the chart opens is set to a free one with --set.
"""

from __future__ import annotations

import json
import posixpath
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from devkit.devstack import Proc, _bin, _http_ok, free_port, wait_until
from tests.e2e.test_image import IMAGE, ROOT, image_problem, podman

from .test_helm_chart import CHART, HELM, _helm

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(HELM is None, reason="no helm binary")]

ENVOY_VERSION = "1.40.0"
ENVOY_IMAGE = f"localhost/llm-failover-envoy:{ENVOY_VERSION}"
N = 6


def podmanize(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rendered ConfigMaps and Deployment, adapted to what podman 4.3 can play."""
    out = [d for d in docs if d["kind"] in ("ConfigMap", "Deployment")]
    for d in out:
        if d["kind"] != "Deployment":
            continue
        spec = d["spec"]["template"]["spec"]
        spec["restartPolicy"] = "Never"
        for c in spec.get("initContainers", []) + spec["containers"]:
            named = {p["name"]: p["containerPort"] for p in c.pop("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                for kind in ("httpGet", "tcpSocket"):
                    action = (c.get(probe) or {}).get(kind)
                    if action and isinstance(action["port"], str):
                        action["port"] = named[action["port"]]
            for m in c.get("volumeMounts", []):
                sub = m.pop("subPath", None)
                if sub is not None:
                    assert posixpath.basename(m["mountPath"]) == sub, m
                    m["mountPath"] = posixpath.dirname(m["mountPath"])
    return out


@dataclass
class PlayedPod:
    name: str
    port: int
    admin: int
    ops: int
    metrics: int
    replica_log: Path


@pytest.fixture
def played(tmp_path: Path) -> Iterator[PlayedPod]:
    reason = image_problem()
    if reason is not None:
        pytest.skip(reason)
    if podman("image", "exists", ENVOY_IMAGE, check=False).returncode != 0:
        b = subprocess.run(["make", "-s", "image"], cwd=ROOT, capture_output=True, text=True,
                           timeout=1200)
        assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    procs: list[Proc] = []
    release = "kp" + uuid.uuid4().hex[:6]
    pod = f"{release}-llm-failover-extproc-pod-0"
    try:
        cport, pport, rport = free_port(), free_port(), free_port()
        etcd = Proc("etcd", [
            _bin("etcd"), "--name", "kp-etcd", "--data-dir", str(tmp_path / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{cport}",
            "--advertise-client-urls", f"http://127.0.0.1:{cport}",
            "--listen-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-cluster", f"kp-etcd=http://127.0.0.1:{pport}",
            "--log-level", "warn", "--unsafe-no-fsync"], tmp_path / "etcd.log")
        replica_log = tmp_path / "r1.jsonl"
        replica = Proc("r1", [sys.executable, "-m", "devkit.demo.replica", "--host",
                              "127.0.0.1", "--port", str(rport), "--name", "r1",
                              "--log-file", str(replica_log)], tmp_path / "r1.log")
        for p in (etcd, replica):
            p.start()
            procs.append(p)
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{cport}/health"), 20, "etcd")
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{rport}/health"), 20, "replica")
        port, admin, ops, metrics = (free_port() for _ in range(4))
        sets = {
            "replicaCount": 1,
            "image.processor.repository": IMAGE.rsplit(":", 1)[0],
            "image.envoy.repository": ENVOY_IMAGE.rsplit(":", 1)[0],
            "image.envoy.tag": ENVOY_VERSION,
            "envoy.port": port, "envoy.adminPort": admin, "envoy.opsPort": ops,
            "metrics.processor.port": metrics,
            "etcd.endpoints[0]": f"127.0.0.1:{cport}",
            "replicas.endpoints[0].host": "127.0.0.1",
            "replicas.endpoints[0].port": rport,
        }
        args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
        r = _helm("template", release, str(CHART), "--namespace", "llm", *args)
        assert r.returncode == 0, r.stderr
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        play = tmp_path / "play.yaml"
        play.write_text(yaml.safe_dump_all(podmanize(docs), sort_keys=False))
        r2 = podman("kube", "play", "--network", "host", str(play), timeout=240, check=False)
        assert r2.returncode == 0, r2.stderr[-3000:]
        yield PlayedPod(pod, port, admin, ops, metrics, replica_log)
    finally:
        podman("pod", "rm", "--force", "--time", "5", pod, check=False, timeout=120)
        for p in reversed(procs):
            p.stop()


def _exec(pod: PlayedPod, container: str, *argv: str,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return podman("exec", f"{pod.name}-{container}", *argv, timeout=timeout, check=False)


def test_chart_pod_plays_streams_probes_and_drains(played: PlayedPod) -> None:
    probe = ["python3", "/opt/extproc/scripts/health_probe.py",
             "unix:/var/run/extproc/extproc.sock", "", "4"]
    # The init container rendered Envoy's bootstrap and exited; Envoy and the processor run.
    wait_until(lambda: _http_ok(f"http://127.0.0.1:{played.ops}/ready"), 60, "Envoy /ready")
    wait_until(lambda: _exec(played, "processor", *probe).returncode == 0, 60,
               "the chart's readiness probe in the processor container", interval_s=0.5)
    r = podman("ps", "--all", "--filter", f"pod={played.name}", "--format", "json")
    states = {c["Names"][0].removeprefix(played.name + "-"): c["State"]
              for c in json.loads(r.stdout)}
    assert states.get("envoy") == "running" and states.get("processor") == "running", states
    assert "envoy-bootstrap" not in states or states["envoy-bootstrap"] == "exited", states

    # The chart's securityContext holds: the image's user, a read-only root.
    assert _exec(played, "processor", "id", "-u").stdout.strip() == "10001"
    assert _exec(played, "envoy", "id", "-u").stdout.strip() == "10001"
    assert _exec(played, "processor", "touch", "/opt/extproc/x").returncode != 0

    # A stream through the pod's Envoy and processor, to the replica on loopback.
    # The chart's default tenancy is by API key: every request carries one.
    key = {"authorization": "Bearer kp-key"}
    with httpx.Client(base_url=f"http://127.0.0.1:{played.port}", timeout=30) as c:
        body = {"model": "demo-model", "stream": True, "max_tokens": N, "seed": 7,
                "messages": [{"role": "user", "content": "hi"}]}
        # Without one: the clear 401, and no replica sees the request.
        resp = c.post("/v1/chat/completions", json=body)
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["message"] == "header authorization is missing"
        resp = c.post("/v1/chat/completions", json=body,
                      headers={"Idempotency-Key": "kp-" + uuid.uuid4().hex, **key})
        assert resp.status_code == 200, resp.text
        rid = resp.headers["x-gateway-request-id"]
        events = [ln[len("data: "):] for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        contents = [ch["choices"][0]["delta"].get("content") for ch in chunks]
        assert len([x for x in contents if x]) == N
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 5
        while True:  # the outcome is written at stream end
            j = c.get(f"/v1/requests/{rid}", headers=key).json()
            if j["outcome"] is not None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert (j["outcome"], j["attempt"], j["delivered_output_tokens"]) == ("completed", 1, N)
    rows = [json.loads(x) for x in played.replica_log.read_text().splitlines() if x.strip()]
    assert [(r["attempt"], r["outcome"]) for r in rows] == [(1, "completed")]
    assert rows[0]["request_id"] == rid

    # The processor's preStop, as the kubelet would run it: Envoy drains and exits, status 0.
    d = _exec(played, "processor", "python3", "/opt/extproc/scripts/drain.py", "--admin",
              f"127.0.0.1:{played.admin}", "--drain-seconds", "0", "--max-stream-seconds", "10",
              "--linger-seconds", "0", "--poll-seconds", "0.2")
    assert d.returncode == 0, d.stderr
    wait_until(lambda: podman("inspect", "--format", "{{.State.Status}}",
                              f"{played.name}-envoy").stdout.strip() == "exited", 20,
               "Envoy exiting after /quitquitquit")
    # Then SIGTERM to the processor (podman pod stop): it exits cleanly.
    podman("pod", "stop", "--time", "30", played.name, timeout=60)
    for name in ("envoy", "processor"):
        got = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}",
                     f"{played.name}-{name}").stdout.split()
        assert got == ["exited", "0"], (name, got)

"""The chart's pod, run for real on loopback: what `helm template` renders, actually serving.

The two ConfigMaps the chart renders (Envoy's bootstrap, the processor's config and its two
scripts) drive a real etcd, the processor on a Unix socket, real Envoy and a demo replica.
Only what a pod gets from Kubernetes is substituted: the socket directory (the emptyDir),
loopback ports instead of 0.0.0.0, the replica and etcd addresses. Then: a stream goes
through; the exec probe sees SERVING; the preStop drain lets an open stream finish, stops
Envoy, and the processor stops cleanly on SIGTERM after it.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.devstack import Proc, _bin, _http_ok, free_port, wait_until

from .test_helm_chart import HELM, _doc

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(HELM is None, reason="no helm binary")]

SOCKET = "/var/run/extproc/extproc.sock"


@dataclass
class Pod:
    dir: Path
    socket: str
    port: int
    admin: int
    scripts: Path
    procs: dict[str, Proc]


def _retarget(boot: dict[str, Any], sock: str, port: int, admin: int, replica: int) -> None:
    boot["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": admin}
    lis = boot["static_resources"]["listeners"][0]
    lis["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": port}
    for c in boot["static_resources"]["clusters"]:
        eps = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
        if c["name"] == "replicas":
            c["type"] = "STATIC"
            eps[:] = [{"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": replica}}}}]
        elif c["name"] == "extproc":
            assert eps[0]["endpoint"]["address"]["pipe"]["path"] == SOCKET
            eps[0]["endpoint"]["address"]["pipe"]["path"] = sock


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[Pod]:
    envoy_cm = _doc(None, "ConfigMap", "-envoy")["data"]
    proc_cm = _doc(None, "ConfigMap", "-processor")["data"]
    short = Path(tempfile.mkdtemp(prefix="pod", dir="/tmp"))  # the socket emptyDir
    sock = str(short / "extproc.sock")
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    for name in ("health_probe.py", "drain.py"):
        (scripts / name).write_text(proc_cm[name])
    procs: dict[str, Proc] = {}
    try:
        cport, pport = free_port(), free_port()
        etcd = Proc("etcd", [
            _bin("etcd"), "--name", "pod-etcd", "--data-dir", str(tmp_path / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{cport}",
            "--advertise-client-urls", f"http://127.0.0.1:{cport}",
            "--listen-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}",
            "--initial-cluster", f"pod-etcd=http://127.0.0.1:{pport}",
            "--log-level", "warn", "--unsafe-no-fsync"], tmp_path / "etcd.log")
        etcd.start()
        procs["etcd"] = etcd
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{cport}/health"), 20, "etcd")

        cfg = yaml.safe_load(proc_cm["extproc.yaml"])
        assert cfg["server"]["listen"] == "unix:" + SOCKET
        cfg["server"]["listen"] = "unix:" + sock
        cfg["etcd"]["endpoints"] = [f"127.0.0.1:{cport}"]
        (tmp_path / "extproc.yaml").write_text(yaml.safe_dump(cfg))
        processor = Proc("processor", [sys.executable, "-m", "extproc", "serve", "--config",
                                       str(tmp_path / "extproc.yaml")],
                         tmp_path / "processor.log")
        processor.start()
        procs["processor"] = processor
        wait_until(lambda: Path(sock).exists() or not processor.alive(), 20, "processor socket")
        assert processor.alive(), (tmp_path / "processor.log").read_text()

        rport = free_port()
        replica = Proc("r1", [sys.executable, "-m", "extproc.demo.replica", "--host",
                              "127.0.0.1", "--port", str(rport), "--name", "r1",
                              "--log-file", str(tmp_path / "r1.jsonl")], tmp_path / "r1.log")
        replica.start()
        procs["r1"] = replica
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{rport}/health"), 20, "replica")

        port, admin = free_port(), free_port()
        boot = yaml.safe_load(envoy_cm["envoy.yaml"])
        _retarget(boot, sock, port, admin, rport)
        (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(boot))
        envoy = Proc("envoy", [_bin("envoy"), "-c", str(tmp_path / "envoy.yaml"),
                               "--disable-hot-restart", "--concurrency", "2",
                               "--base-id", str(port)], tmp_path / "envoy.log")
        envoy.start()
        procs["envoy"] = envoy
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{admin}/ready"), 20, "envoy /ready")
        yield Pod(tmp_path, sock, port, admin, scripts, procs)
    finally:
        for name in ("envoy", "r1", "processor", "etcd"):
            if name in procs:
                procs[name].stop()


def _chat(port: int, delay_ms: int = 0, max_tokens: int = 6) -> tuple[int, dict[str, str],
                                                                     bytes]:
    body = json.dumps({"model": "demo-model", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hi"}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={
            "content-type": "application/json", "x-replica-token-delay-ms": str(delay_ms)})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def test_the_rendered_pod_serves_probes_and_drains(pod: Pod) -> None:
    # The exec probe, from the ConfigMap, against the real processor.
    r = subprocess.run([sys.executable, str(pod.scripts / "health_probe.py"),
                        "unix:" + pod.socket, "", "3"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr

    # A stream through the chart's Envoy bootstrap: guard and gate on the Unix socket.
    status, headers, raw = _chat(pod.port)
    assert status == 200, raw
    assert headers.get("x-gateway-request-id")
    assert raw.rstrip().endswith(b"data: [DONE]")

    # preStop: a slow stream is open; the drain waits for it, then stops Envoy.
    out: dict[str, Any] = {}

    def slow() -> None:
        out["result"] = _chat(pod.port, delay_ms=150, max_tokens=12)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    drain = subprocess.run(
        [sys.executable, str(pod.scripts / "drain.py"), "--admin", f"127.0.0.1:{pod.admin}",
         "--drain-seconds", "0.2", "--max-stream-seconds", "20", "--linger-seconds", "0.2",
         "--poll-seconds", "0.05"], capture_output=True, text=True, timeout=60)
    t.join(10)
    assert drain.returncode == 0, drain.stderr
    status, _, raw = out["result"]
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
    envoy = pod.procs["envoy"]
    assert envoy.popen is not None
    assert envoy.popen.wait(10) == 0  # /quitquitquit: a clean exit
    # Then the kubelet's SIGTERM to the processor: it stops by itself, in time.
    proc = pod.procs["processor"]
    assert proc.popen is not None and proc.alive()
    proc.signal(signal.SIGTERM)
    assert proc.popen.wait(15) == 0, (pod.dir / "processor.log").read_text()[-2000:]
    assert "Traceback" not in (pod.dir / "processor.log").read_text()

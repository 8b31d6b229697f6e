"""The chart's pod, run for real on loopback: what `helm template` renders, actually serving.

The processor's ConfigMap (its config and its two scripts) and the envoy-bootstrap init
container's own command drive a real etcd, `extproc render-envoy` (the init container: it
writes Envoy's bootstrap), the processor on a Unix socket, real Envoy and a demo replica.
Only what a pod gets from Kubernetes is substituted, flag by flag: the socket directory (the
emptyDir), loopback ports instead of 0.0.0.0, the replica and etcd addresses. Then: a stream
goes through; the kubelet's probes (Envoy's /ready through the ops listener, the exec probe's
two services) and the scrapes (/stats/prometheus, the processor's /metrics) answer; the ops
listener refuses the admin's write endpoints; the preStop drain lets an open stream finish,
stops Envoy, and the processor stops cleanly on SIGTERM after it. The chart's default
tenancy is by API key: every request carries `Authorization: Bearer ...`, and one without
it gets the clear 401. With ci/tools-values.yaml, a demo tool server stands behind the tool
listener: the replica's tool call on the tool port runs once; the same call on the client
port is a 404 and runs nothing.
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

from devkit.devstack import Proc, _bin, _http_ok, free_port, wait_until

from .test_helm_chart import CHART, HELM, _container, _doc, _values

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(HELM is None, reason="no helm binary")]

SOCKET = "/var/run/extproc/extproc.sock"


@dataclass
class Pod:
    dir: Path
    socket: str
    port: int
    admin: int
    ops: int
    metrics: int
    tool_listen: int  # 0: the chart's tool listener is off
    scripts: Path
    procs: dict[str, Proc]
    bootstrap: dict[str, Any]
    values: str | None  # the ci values file rendered (None: the defaults)


def _chart_app_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def _init_command(sock: str, port: int, admin: int, ops: int, replica: int, cfg: Path,
                  out: Path, values: str | None = None, tool_listen: int = 0,
                  tool_server: int = 0) -> list[str]:
    """The envoy-bootstrap init container's command, its pod-only values moved to loopback."""
    v = _values(values)
    init = _container(values, "envoy-bootstrap")
    cmd = list(init["command"])
    assert cmd[:2] == ["extproc", "render-envoy"]
    pairs = list(zip(cmd[2::2], cmd[3::2], strict=True))
    (ep,) = v["replicas"]["endpoints"]
    want = {
        "--config": ("/etc/extproc/extproc.yaml", str(cfg)),
        "--listen": (f"0.0.0.0:{v['envoy']['port']}", f"127.0.0.1:{port}"),
        "--admin": (f"127.0.0.1:{v['envoy']['adminPort']}", f"127.0.0.1:{admin}"),
        "--ops": (f"0.0.0.0:{v['envoy']['opsPort']}", f"127.0.0.1:{ops}"),
        "--processor": ("unix:" + SOCKET, "unix:" + sock),
        # The image must be at least the chart's appVersion (decision 0038): this checkout is.
        "--require-version": (_chart_app_version(), _chart_app_version()),
        "--replica": (f"{ep['host']}:{ep['port']}", f"127.0.0.1:{replica}"),
    }
    if v["tools"]["enabled"]:
        want["--tool-listen"] = (f"0.0.0.0:{v['envoy']['toolPort']}",
                                 f"127.0.0.1:{tool_listen}")
        want["--tools"] = (",".join(v["tools"]["servers"]), f"127.0.0.1:{tool_server}")
    want["--out"] = ("/etc/envoy/envoy.yaml", str(out))
    assert [f for f, _ in pairs] == list(want), "a flag this test does not know: update it"
    args: list[str] = []
    for flag, val in pairs:
        assert val == want[flag][0], (flag, val)
        args += [flag, want[flag][1]]
    return [sys.executable, "-m", "extproc", "render-envoy", *args]


# The default values, the processor on grpclib (decision 0020), and the tool listener on
# (decision 0029): the same pod otherwise.
CI_TOOLS = "tools-values.yaml"
POD_VALUES = [None, "grpclib-transport-values.yaml", CI_TOOLS]
# The chart's default tenancy is by API key (processor.config.tenancy.api_key_header).
API_KEY = "Bearer pod-test-key"


@pytest.fixture(params=POD_VALUES)
def pod(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Pod]:
    values: str | None = request.param
    proc_cm = _doc(values, "ConfigMap", "-processor")["data"]
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

        port, admin, ops, metrics, rport = (free_port() for _ in range(5))
        tools_on = bool(_values(values)["tools"]["enabled"])
        tool_listen, tport = (free_port(), free_port()) if tools_on else (0, 0)
        if tools_on:
            tools = Proc("tools", [sys.executable, "-m", "devkit.demo.tool_server",
                                   "--port", str(tport),
                                   "--log-file", str(tmp_path / "tools.jsonl")],
                         tmp_path / "tools.log")
            tools.start()
            procs["tools"] = tools
            wait_until(lambda: _http_ok(f"http://127.0.0.1:{tport}/health"), 20,
                       "tool server")
        # The init container first, on the ConfigMap's config exactly as mounted.
        (tmp_path / "configmap-extproc.yaml").write_text(proc_cm["extproc.yaml"])
        boot_path = tmp_path / "envoy.yaml"
        r = subprocess.run(_init_command(sock, port, admin, ops, rport,
                                         tmp_path / "configmap-extproc.yaml", boot_path,
                                         values, tool_listen, tport),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        bootstrap = yaml.safe_load(boot_path.read_text())

        cfg = yaml.safe_load(proc_cm["extproc.yaml"])
        assert cfg["server"]["transport"] == ("grpclib" if values == POD_VALUES[1]
                                              else "grpcio")
        assert cfg["tenancy"]["api_key_header"] == "authorization"
        assert cfg["server"]["listen"] == "unix:" + SOCKET
        assert cfg["server"]["metrics_listen"] == "0.0.0.0:9464"
        cfg["server"]["listen"] = "unix:" + sock
        cfg["server"]["metrics_listen"] = f"127.0.0.1:{metrics}"
        cfg["etcd"]["endpoints"] = [f"127.0.0.1:{cport}"]
        (tmp_path / "extproc.yaml").write_text(yaml.safe_dump(cfg))
        processor = Proc("processor", [sys.executable, "-m", "extproc", "serve", "--config",
                                       str(tmp_path / "extproc.yaml")],
                         tmp_path / "processor.log")
        processor.start()
        procs["processor"] = processor
        wait_until(lambda: Path(sock).exists() or not processor.alive(), 20, "processor socket")
        assert processor.alive(), (tmp_path / "processor.log").read_text()

        replica = Proc("r1", [sys.executable, "-m", "devkit.demo.replica", "--host",
                              "127.0.0.1", "--port", str(rport), "--name", "r1",
                              "--log-file", str(tmp_path / "r1.jsonl"),
                              *(["--tool-gateway", f"http://127.0.0.1:{tool_listen}"]
                                if tools_on else [])], tmp_path / "r1.log")
        replica.start()
        procs["r1"] = replica
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{rport}/health"), 20, "replica")

        envoy = Proc("envoy", [_bin("envoy"), "-c", str(boot_path),
                               "--disable-hot-restart", "--concurrency", "2",
                               "--base-id", str(port)], tmp_path / "envoy.log")
        envoy.start()
        procs["envoy"] = envoy
        # The kubelet's readiness probe: /ready on the ops port.
        wait_until(lambda: _http_ok(f"http://127.0.0.1:{ops}/ready"), 20, "envoy ops /ready")
        yield Pod(tmp_path, sock, port, admin, ops, metrics, tool_listen, scripts, procs,
                  bootstrap, values)
    finally:
        for name in ("envoy", "r1", "tools", "processor", "etcd"):
            if name in procs:
                procs[name].stop()


def _get(port: int, path: str, method: str = "GET",
         headers: dict[str, str] | None = None, body: bytes | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def _chat(port: int, delay_ms: int = 0, max_tokens: int = 6,
          extra: dict[str, str] | None = None,
          api_key: str | None = API_KEY) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": "demo-model", "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hi"}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"content-type": "application/json", "x-replica-token-delay-ms": str(delay_ms),
               **(extra or {})}
    if api_key is not None:
        headers["authorization"] = api_key
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _replica_rows(pod: Pod, rid: str) -> list[dict[str, Any]]:
    """The replica's log once it has the row of `rid` (written as its attempt ends)."""
    path = pod.dir / "r1.jsonl"

    def rows() -> list[dict[str, Any]]:
        return [json.loads(x) for x in path.read_text().splitlines() if x] \
            if path.exists() else []
    wait_until(lambda: any(r.get("request_id") == rid for r in rows()), 10,
               f"the replica's log row of {rid}")
    return rows()


def _tool_log(pod: Pod) -> list[dict[str, Any]]:
    path = pod.dir / "tools.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []


def _tool_route_only_on_its_listener(pod: Pod) -> None:
    """The chart's tool listener (ci/tools-values.yaml): a tool call with a live attempt's
    ids on the client port is Envoy's 404 and runs nothing; the tool port serves nothing
    but the tool route; the replica's own tool call, on the tool port, runs once."""
    # A client's open stream: the ids of its live attempt come with the response headers.
    conn = http.client.HTTPConnection("127.0.0.1", pod.port, timeout=30)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps({
            "model": "demo-model", "stream": True, "max_tokens": 30,
            "messages": [{"role": "user", "content": "hi"}]}), headers={
            "content-type": "application/json", "x-replica-token-delay-ms": "100",
            "authorization": API_KEY})
        resp = conn.getresponse()
        assert resp.status == 200
        rid = resp.getheader("x-gateway-request-id") or ""
        aid = resp.getheader("x-gateway-attempt-id") or ""
        assert rid and aid
        # While it streams, the same client calls the tool route with those ids: 404.
        tool_headers = {"content-type": "application/json", "x-gateway-request-id": rid,
                        "x-gateway-attempt-id": aid, "x-tool-call-id": "evil_1",
                        "authorization": API_KEY}
        status, body = _get(pod.port, "/tools/demo_tool", "POST", tool_headers, b"{}")
        assert status == 404, body
        rest = resp.read()
    finally:
        conn.close()
    assert rest.rstrip().endswith(b"data: [DONE]"), rest[-300:]
    (row,) = [r for r in _replica_rows(pod, rid) if r["request_id"] == rid]
    assert (row["outcome"], row["tokens_written"]) == ("completed", 30), row
    # The tool port serves the tool route and nothing else: no stream there.
    status, body = _get(pod.tool_listen, "/v1/chat/completions", "POST",
                        {"content-type": "application/json", "authorization": API_KEY},
                        json.dumps({"model": "demo-model", "stream": True, "max_tokens": 2,
                                    "messages": [{"role": "user", "content": "x"}]}).encode())
    assert status == 404, body
    assert _tool_log(pod) == [], "nothing ran"
    # The worker's own call, on the tool port, runs once.
    status, headers, raw = _chat(pod.port, extra={"x-replica-tool-call": "c1@2"})
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw
    rid = headers["x-gateway-request-id"]
    (row,) = [r for r in _replica_rows(pod, rid) if r["request_id"] == rid]
    (call,) = row["tool_calls"]
    assert call["status"] == 200, call
    assert [(e["tool"], e["key"], e["execution"]) for e in _tool_log(pod)] == [
        ("demo_tool", f"{rid}:c1", 1)]


def test_the_rendered_pod_serves_probes_and_drains(pod: Pod) -> None:
    # The exec probes, from the ConfigMap, against the real processor: readiness (""),
    # and startup/liveness ("liveness"), exactly as the Deployment runs them.
    proc = _container(pod.values, "processor")
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        cmd = proc[probe]["exec"]["command"]
        assert cmd[1] == "/opt/extproc/scripts/health_probe.py"
        r = subprocess.run([sys.executable, str(pod.scripts / "health_probe.py"),
                            "unix:" + pod.socket, *cmd[3:]], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, (probe, r.stderr)

    # The ops listener: readiness and Prometheus stats, nothing else of the admin.
    status, body = _get(pod.ops, "/ready")
    assert (status, body.strip()) == (200, "LIVE")
    status, body = _get(pod.ops, "/stats/prometheus")
    assert status == 200 and "envoy_cluster_upstream_cx_total" in body
    for method, path in (("POST", "/quitquitquit"), ("POST", "/healthcheck/fail"),
                         ("GET", "/config_dump"), ("POST", "/ready")):
        assert _get(pod.ops, path, method)[0] == 404, (method, path)
    assert pod.procs["envoy"].alive()
    admin = pod.bootstrap["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1"
    # The processor's Prometheus text.
    status, body = _get(pod.metrics, "/metrics")
    assert status == 200 and "# TYPE" in body

    # A stream through the chart's Envoy bootstrap: guard and gate on the Unix socket.
    status, headers, raw = _chat(pod.port)
    assert status == 200, raw
    rid = headers.get("x-gateway-request-id")
    assert rid and raw.rstrip().endswith(b"data: [DONE]")
    # The chart's default tenancy: the status lookup is the API key's own...
    status, body = _get(pod.port, f"/v1/requests/{rid}", headers={"authorization": API_KEY})
    assert status == 200 and json.loads(body)["request_id"] == rid, body
    # ...and a request without the key gets the clear error, before any replica sees it.
    status, _, raw = _chat(pod.port, api_key=None)
    err = json.loads(raw)["error"]
    assert (status, err["code"], err["message"]) == (
        401, "invalid_header", "header authorization is missing"), raw
    assert [r["request_id"] for r in _replica_rows(pod, rid)] == [rid]
    if pod.tool_listen:
        _tool_route_only_on_its_listener(pod)

    # preStop: a slow stream is open; the drain waits for it, then stops Envoy.
    out: dict[str, Any] = {}

    def slow() -> None:
        out["result"] = _chat(pod.port, delay_ms=150, max_tokens=12)

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.5)
    drain = subprocess.Popen(
        [sys.executable, str(pod.scripts / "drain.py"), "--admin", f"127.0.0.1:{pod.admin}",
         "--drain-seconds", "0.2", "--max-stream-seconds", "20", "--linger-seconds", "0.2",
         "--poll-seconds", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The drain failed Envoy's health: the kubelet's readiness probe (ops /ready) sees
        # 503 while the open stream still runs, so the pod leaves the Service's endpoints.
        wait_until(lambda: _get(pod.ops, "/ready")[0] == 503, 10, "ops /ready 503")
        assert t.is_alive(), "the slow stream should still be open"
        _, err = drain.communicate(timeout=60)
    finally:
        if drain.poll() is None:
            drain.kill()
            drain.wait(5)
    t.join(10)
    assert drain.returncode == 0, err
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

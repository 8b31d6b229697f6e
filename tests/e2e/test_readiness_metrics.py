"""Readiness that means ready, liveness apart, /metrics, and OTEL_* settings (decision 0016).

Real etcd (started late, frozen, killed, restarted), the real processor (`python -m extproc
serve`), real Envoy and demo replicas for the metrics; a real OTLP/gRPC receiver in this
process for the OTEL_* tests.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from devkit.devstack import Proc, Stack, _bin, _http_ok, _tcp_open, free_port, wait_until

from .conftest import Gateway

pytestmark = pytest.mark.e2e

SERVING = "SERVING"
NOT_SERVING = "NOT_SERVING"
GRACE_S = 2.0


# --- real parts ----------------------------------------------------------------------


@dataclass
class Etcd:
    workdir: Path
    cport: int = field(default_factory=free_port)
    pport: int = field(default_factory=free_port)
    proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.cport}"

    def start(self, fresh: bool = True) -> None:
        data = self.workdir / "etcd-data"
        if fresh:
            shutil.rmtree(data, ignore_errors=True)
        self.proc = Proc("etcd", [
            _bin("etcd"), "--name", "rm-etcd", "--data-dir", str(data),
            "--listen-client-urls", f"http://{self.endpoint}",
            "--advertise-client-urls", f"http://{self.endpoint}",
            "--listen-peer-urls", f"http://127.0.0.1:{self.pport}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.pport}",
            "--initial-cluster", f"rm-etcd=http://127.0.0.1:{self.pport}",
            "--log-level", "warn", "--unsafe-no-fsync"], self.workdir / "etcd.log")
        self.proc.start()
        wait_until(lambda: _http_ok(f"http://{self.endpoint}/health"), 30, "etcd health")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


class Health:
    """grpc.health.v1 on the processor's socket, as the chart's probe asks it."""

    def __init__(self, addr: str) -> None:
        self.channel = grpc.insecure_channel(addr)
        self.stub = health_pb2_grpc.HealthStub(self.channel)

    def check(self, service: str) -> str:
        resp = self.stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))

    def watch(self, service: str, into: list[tuple[float, str]]) -> threading.Thread:
        """Record (monotonic time, status) for every status the server streams."""
        def run() -> None:
            try:
                for r in self.stub.Watch(health_pb2.HealthCheckRequest(service=service),
                                         timeout=60):
                    into.append((time.monotonic(),
                                 health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)))
            except grpc.RpcError:
                pass  # the server went away: the stream ends
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def close(self) -> None:
        self.channel.close()


def scrape(addr: str) -> dict[str, float]:
    """Parse the exposition: 'name|label=value|...' -> value."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        assert r.status == 200
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))] = s.value
    return out


def total(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    want = {f"{k}={v}" for k, v in labels.items()}
    return sum(v for k, v in m.items()
               if k.split("|")[0] == name and want <= set(k.split("|")[1:]))


def log_lines(path: Path, msg_prefix: str) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if str(rec.get("msg", "")).startswith(msg_prefix):
                out.append(rec)
    return out


def wait_status(h: Health, service: str, want: str, timeout_s: float) -> float:
    """Poll every 50 ms; the monotonic time `want` was first seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if h.check(service) == want:
                return time.monotonic()
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, f"{service!r} not {want} within {timeout_s}s"
        time.sleep(0.05)


# --- readiness follows etcd -----------------------------------------------------------


def test_readiness_follows_etcd_and_liveness_does_not(tmp_path: Path) -> None:
    etcd = Etcd(tmp_path)
    listen, mlisten = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    cfg = {"server": {"listen": listen, "metrics_listen": mlisten,
                      "readiness_grace_s": GRACE_S},
           "etcd": {"endpoints": [etcd.endpoint], "timeout_s": 0.5}}
    (tmp_path / "extproc.yaml").write_text(yaml.safe_dump(cfg))
    proc = Proc("processor", [sys.executable, "-m", "extproc", "serve", "--config",
                              str(tmp_path / "extproc.yaml")], tmp_path / "processor.log")
    h: Health | None = None
    try:
        # 1. The processor starts before etcd exists: it serves (fail closed per request),
        #    alive but not ready.
        proc.start()
        wait_until(lambda: _tcp_open("127.0.0.1", int(listen.rsplit(":", 1)[1]))
                   or not proc.alive(), 30, "processor port")
        assert proc.alive(), (tmp_path / "processor.log").read_text()
        h = Health(listen)
        assert h.check("") == NOT_SERVING
        assert h.check("liveness") == SERVING
        m = scrape(mlisten)
        assert m["llmgw_ready"] == 0
        assert "llmgw_etcd_last_answer_age_seconds" not in m  # never answered
        time.sleep(GRACE_S)  # nothing answers: still not ready
        assert h.check("") == NOT_SERVING and h.check("liveness") == SERVING

        # 2. etcd appears: ready without a restart.
        etcd.start()
        t_up = time.monotonic()
        t_ready = wait_status(h, "", SERVING, 15)
        ready_after = t_ready - t_up
        m = scrape(mlisten)
        assert m["llmgw_ready"] == 1
        assert 0 <= m["llmgw_etcd_last_answer_age_seconds"] <= GRACE_S

        # 3. etcd frozen (SIGSTOP: connections accepted, nothing answers): not ready after
        #    the grace, and not before half of it (the last answer is at most that old).
        assert etcd.proc is not None
        etcd.proc.signal(signal.SIGSTOP)
        t_freeze = time.monotonic()
        t_not = wait_status(h, "", NOT_SERVING, GRACE_S + 10)
        frozen_after = t_not - t_freeze
        assert frozen_after >= GRACE_S / 2, frozen_after
        assert h.check("liveness") == SERVING  # never depends on etcd
        m = scrape(mlisten)
        assert m["llmgw_ready"] == 0
        assert m["llmgw_etcd_last_answer_age_seconds"] > GRACE_S

        # 4. etcd thaws: ready again.
        etcd.proc.signal(signal.SIGCONT)
        t_thaw = time.monotonic()
        thawed_after = wait_status(h, "", SERVING, 15) - t_thaw

        # 5. etcd killed (connection refused), then restarted on its data: the same.
        etcd.proc.signal(signal.SIGKILL)
        etcd.proc.popen.wait(5)  # type: ignore[union-attr]
        t_kill = time.monotonic()
        killed_after = wait_status(h, "", NOT_SERVING, GRACE_S + 10) - t_kill
        assert killed_after >= GRACE_S / 2, killed_after
        assert h.check("liveness") == SERVING
        etcd.start(fresh=False)
        t_back = time.monotonic()
        back_after = wait_status(h, "", SERVING, 20) - t_back

        # 6. SIGTERM: readiness goes NOT_SERVING first, while liveness still says SERVING.
        ready_seen: list[tuple[float, str]] = []
        live_seen: list[tuple[float, str]] = []
        h.watch("", ready_seen)
        h.watch("liveness", live_seen)
        wait_until(lambda: ready_seen and live_seen, 10, "health watches")
        assert ready_seen[-1][1] == SERVING and live_seen[-1][1] == SERVING
        proc.signal(signal.SIGTERM)
        wait_until(lambda: ready_seen[-1][1] == NOT_SERVING, 10, "readiness NOT_SERVING")
        t_drain = ready_seen[-1][0]
        assert all(s == SERVING for t, s in live_seen if t <= t_drain), live_seen
        assert proc.popen is not None and proc.popen.wait(20) == 0
    finally:
        if h is not None:
            h.close()
        proc.stop()
        etcd.stop()

    # Every change was logged, structured, with its reason, in order.
    lines = log_lines(tmp_path / "processor.log", "readiness")
    reasons = [x["reason"] for x in lines]
    assert reasons == ["etcd_never_answered", "etcd_answering", "etcd_silent", "etcd_answering",
                       "etcd_silent", "etcd_answering", "draining"], reasons
    assert all(x["request_id"] is None and x["grace_s"] == GRACE_S for x in lines)
    silent = [x for x in lines if x["reason"] == "etcd_silent"]
    # Past the grace when decided; logged to the millisecond, so 2.0004 s reads 2.0.
    assert all(x["etcd_last_answer_age_s"] >= GRACE_S for x in silent)
    print(f"\nreadiness: ready {ready_after:.2f}s after etcd's /health, not ready "
          f"{frozen_after:.2f}s after a freeze and {killed_after:.2f}s after a kill "
          f"(grace {GRACE_S}s), ready {thawed_after:.2f}s after a thaw and {back_after:.2f}s "
          f"after a restart")


# --- /metrics through real Envoy --------------------------------------------------------


@pytest.fixture(scope="module")
def mstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = {"server": {"metrics_listen": f"127.0.0.1:{free_port()}"},
           "timeouts": {"first_delta_s": 5.0, "stall_after_first_delta_s": 1.0,
                        "access_log_wait_s": 0.5, "fence_wait_s": 12.0},
           "policy": {"retry_budget": {"min_retry_concurrency": 100000}}}
    st = Stack(workdir=tmp_path_factory.mktemp("metrics"), config=cfg, token_delay_ms=40).start()
    try:
        yield st
    finally:
        st.stop()


def test_metrics_count_requests_through_envoy(mstack: Stack) -> None:
    mstack.wait_replicas_healthy()
    assert mstack.cfg is not None and mstack.cfg.server.metrics_listen is not None
    addr = mstack.cfg.server.metrics_listen
    gw = Gateway(mstack)
    try:
        wait_until(lambda: scrape(addr)["llmgw_ready"] == 1, 10, "llmgw_ready 1")
        before = scrape(addr)
        assert before["llmgw_open_streams"] == 0
        ok = gw.post(gw.body(max_tokens=3))
        retried = gw.post(gw.body(max_tokens=3), headers={"x-replica-fault":
                                                          "kill-before-headers"})
        mstack.wait_replicas_healthy()  # the killed replica is back and seen healthy
        # Stalls after 2 deltas: the guard ends it with the terminal error event.
        cut = gw.post(gw.body(max_tokens=8), headers={"x-replica-fault":
                                                      "stall-after-deltas:2"})
        assert ok.status == 200 and len(ok.contents) == 3
        assert retried.status == 200 and len(retried.contents) == 3
        assert cut.error is not None
        for r in (ok, retried, cut):
            gw.journal(r.request_id)  # the guard counted its outcome before writing it

        # A long stream is open while we scrape: both of its ext_proc streams (gate, guard)
        # are counted, and none is left once it ended.
        seen: list[float] = []
        slow = threading.Thread(target=lambda: seen.append(
            float(len(gw.post(gw.body(max_tokens=60)).contents))), daemon=True)
        slow.start()
        wait_until(lambda: scrape(addr)["llmgw_open_streams"] >= 1, 10, "an open stream")
        slow.join(30)
        assert seen == [60.0]
        wait_until(lambda: scrape(addr)["llmgw_open_streams"] == 0, 10, "streams closed")
        after = scrape(addr)
    finally:
        gw.client.close()

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("llmgw_requests_total", outcome="completed") == 3  # ok, retried, slow
    assert delta("llmgw_requests_total", outcome="upstream_decode_interrupted") == 1
    assert delta("llmgw_retries_total", decision="admitted") == 1
    assert delta("llmgw_interruptions_total") == 1
    assert delta("llmgw_fences_total") >= 1
    assert delta("llmgw_retry_budget_utilization_count") >= 1  # at the retry decision
    assert after["llmgw_ready"] == 1
    assert 0 <= after["llmgw_etcd_last_answer_age_seconds"] < 5.0
    # The event loop's lag: sampled four times a second, the worst of the last 10 s; on
    # this light load well under the 1 s a chunk would notice.
    assert 0 <= after["llmgw_event_loop_lag_seconds"] < 1.0
    assert after["process_resident_memory_bytes"] > 0


# --- OTEL_* settings ---------------------------------------------------------------------


class Collector(trace_service_pb2_grpc.TraceServiceServicer,  # type: ignore[misc]
                metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
    """An OTLP/gRPC receiver: span resources, metric names, and the export calls' headers."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.metrics: set[str] = set()
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self),
                                                                      self.server)
        self.port = free_port()
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def Export(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.headers.append(dict(context.invocation_metadata()))
            for rs in request.resource_spans:
                res = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append({"name": s.name, "resource": res})
        return trace_service_pb2.ExportTraceServiceResponse()

    def export_metrics(self, request: Any, context: Any) -> Any:
        with self.lock:
            self.headers.append(dict(context.invocation_metadata()))
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    self.metrics.update(m.name for m in sm.metrics)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def stop(self) -> None:
        self.server.stop(0)


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):  # type: ignore[misc]
    def __init__(self, c: Collector) -> None:
        self.c = c

    def Export(self, request: Any, context: Any) -> Any:
        return self.c.export_metrics(request, context)


def _request_spans(c: Collector, timeout_s: float = 15) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        with c.lock:
            got = [s for s in c.spans if s["name"] == "llm.request"]
        if got:
            return got
        assert time.monotonic() < deadline, "no llm.request span arrived"
        time.sleep(0.2)


def test_standard_otel_env_configures_export(tmp_path: Path) -> None:
    """No telemetry section at all: OTEL_* alone turns export on, names the service, adds
    resource attributes and headers, and sets the metric interval."""
    col = Collector()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{col.port}",
           "OTEL_SERVICE_NAME": "gw-from-env",
           "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=e2e,k8s.pod.name=pod-7",
           "OTEL_EXPORTER_OTLP_HEADERS": "x-otlp-token=secret-1",
           "OTEL_METRIC_EXPORT_INTERVAL": "500"}
    st = Stack(workdir=tmp_path, config={"telemetry": {"record_traces": "none"}},
               replicas=1, processor_env=env)
    try:
        st.start()
        st.wait_replicas_healthy()
        gw = Gateway(st)
        try:
            res = gw.post(gw.body(max_tokens=2))
        finally:
            gw.client.close()
        assert res.status == 200
        span = _request_spans(col)[0]
        assert span["resource"]["service.name"] == "gw-from-env"
        assert span["resource"]["deployment.environment"] == "e2e"
        assert span["resource"]["k8s.pod.name"] == "pod-7"
        assert span["resource"]["service.instance.id"] == "gw-1"  # server.gateway_id
        # 500 ms interval: with the SDK's default (60 s) nothing would arrive in time.
        wait_until(lambda: "llmgw.requests" in col.metrics, 10, "OTLP metrics")
        with col.lock:
            assert col.headers and all(h.get("x-otlp-token") == "secret-1"
                                       for h in col.headers)
    finally:
        st.stop()
        col.stop()


def test_the_config_file_wins_over_otel_env(tmp_path: Path) -> None:
    """telemetry.otlp_endpoint and a non-default service_name beat the OTEL_* variables."""
    file_col, env_col = Collector(), Collector()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{env_col.port}",
           "OTEL_SERVICE_NAME": "gw-from-env"}
    cfg = {"telemetry": {"otlp_endpoint": f"127.0.0.1:{file_col.port}",
                         "service_name": "gw-from-file", "metrics_interval_s": 0.5,
                         "record_traces": "none"}}
    st = Stack(workdir=tmp_path, config=cfg, replicas=1, processor_env=env)
    try:
        st.start()
        st.wait_replicas_healthy()
        gw = Gateway(st)
        try:
            assert gw.post(gw.body(max_tokens=2)).status == 200
        finally:
            gw.client.close()
        ours = [s for s in _request_spans(file_col)]
        assert {s["resource"]["service.name"] for s in ours} == {"gw-from-file"}
        wait_until(lambda: "llmgw.requests" in file_col.metrics, 10, "OTLP metrics")
        time.sleep(1.0)
        with env_col.lock:
            assert not env_col.spans and not env_col.metrics
    finally:
        st.stop()
        file_col.stop()
        env_col.stop()

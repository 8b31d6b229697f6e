"""adapters/observer: logs, spans and metrics derived from what the machines decided. The end
of an attempt is one function whichever role ends it: one log line, the span's fence event,
its status (an error unless completed) and attributes, and the fence counter by a replica
label bounded by the pool. (The roles' lines in a real flow: test_sessions.py,
test_telemetry.py.)"""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from devkit.devstack import free_port
from extproc.adapters.observer import attempt_ended
from extproc.adapters.telemetry import Telemetry
from extproc.core.config import TelemetryConfig
from extproc.core.pool import pool_from_config

from .test_telemetry import scrape

REPLICA = "127.0.0.1:8001"
POOL = pool_from_config([{"address": REPLICA, "fingerprint": {"weights_revision": "r1"}}])


def _end(tel: Telemetry, span: object, failure_class: str, fence: str,
         replica: str | None = REPLICA) -> None:
    attempt_ended(tel, span, "req_1", "att_1", attempt=2, released=True,  # type: ignore[arg-type]
                  failure_class=failure_class, fence=fence, cause="upstream",
                  envoy_cause="UC", model_revision="r1", http_status=200, replica=replica,
                  pool=POOL)


def test_an_attempt_s_end_without_a_span_is_one_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="extproc")
    _end(Telemetry(TelemetryConfig(), "gw-1"), None, "replica_dead", "revoked")
    (rec,) = caplog.records
    assert rec.getMessage() == "attempt ended"
    assert (rec.request_id, rec.attempt_id, rec.attempt, rec.released,  # type: ignore[attr-defined]
            rec.failure_class, rec.fence, rec.cause) == (  # type: ignore[attr-defined]
        "req_1", "att_1", 2, True, "replica_dead", "revoked", "upstream")


def test_an_attempt_s_end_closes_its_span_and_counts_the_fence() -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer = provider.get_tracer("test")
    addr = f"127.0.0.1:{free_port()}"
    tel = Telemetry(TelemetryConfig(), "gw-1", metrics_listen=addr)
    assert tel.serve_metrics() == addr
    try:
        _end(tel, tracer.start_span("failed"), "replica_dead", "expiry")
        _end(tel, tracer.start_span("done"), "completed", "revoked", replica="10.9.9.9:1")
        failed, done = spans.get_finished_spans()
        assert [e.name for e in failed.events] == ["lease.fenced_until_expiry"]
        assert failed.status.status_code is StatusCode.ERROR
        assert failed.attributes is not None
        assert (failed.attributes["error.type"], failed.attributes["llmgw.fence"],
                failed.attributes["llmgw.envoy_cause"],
                failed.attributes["http.response.status_code"]) == (
            "replica_dead", "expiry", "UC", 200)
        assert [e.name for e in done.events] == ["lease.revoked"]
        assert done.status.status_code is not StatusCode.ERROR
        assert done.attributes is not None and "error.type" not in done.attributes
        m = scrape(addr)
        assert m[f"llmgw_fences_total|class=replica_dead|kind=expiry|replica={REPLICA}"] == 1
        # A replica the pool does not declare is not a label of its own.
        assert not any("10.9.9.9" in k for k in m)
    finally:
        tel.shutdown()


def test_with_nothing_exported_the_guard_s_figures_and_their_labels_are_skipped(
        caplog: pytest.LogCaptureFixture) -> None:
    """The first delta's and the request end's figures are the instruments' alone: with no
    metrics and no traces exported nothing is recorded, no label learnt, and the end's
    log line is the same; with something exported the labels are learnt as before."""
    from types import SimpleNamespace

    from extproc.adapters import observer
    from extproc.adapters.session import INVALID
    from extproc.core.events import Finish
    from extproc.core.journal import Outcome

    for exported in (False, True):
        tel = Telemetry(TelemetryConfig(), "gw-1")
        assert not tel.enabled
        tel.enabled = exported  # the no-op instruments either way: only the labels differ
        kept = SimpleNamespace(model="demo-model", stream=True, created_at=1.0)
        ho = SimpleNamespace(replica=REPLICA, attempt=2, started_at=2.0)
        m = SimpleNamespace(withheld=0, delivered=3, status=200)
        clock = SimpleNamespace(wall=lambda: 5.0)
        s = SimpleNamespace(kept=kept, released=SimpleNamespace(handoff=ho), rerun=None,
                            gen=SimpleNamespace(path="/v1/chat/completions"), span=INVALID,
                            rid="req_1", m=m, p=SimpleNamespace(tel=tel, pool=POOL,
                                                                clock=clock))
        caplog.clear()
        caplog.set_level(logging.INFO, logger="extproc")
        observer._first_delta(s)  # type: ignore[arg-type]
        observer._guard_finished(s, Finish(Outcome.COMPLETED, 3, None))  # type: ignore[arg-type]
        assert [r.getMessage() for r in caplog.records] == ["request finished"]
        learnt = (tel.labels._seen_models, tel.labels._pool)
        assert learnt == (({"demo-model"}, POOL) if exported else (set(), None))

"""Bad input gets a clear, documented error and runs nothing (docs/errors.md)."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from extproc.core.intake import DEFAULT_TENANT
from extproc.core.journal import request_id_for_key

from .conftest import Gateway, Result

pytestmark = pytest.mark.e2e


def _nothing_ran(gw: Gateway, rid: str) -> None:
    assert gw.attempts_logged(rid, settle_s=0.5) == []


def test_malformed_json_body(gw: Gateway) -> None:
    r = gw.client.post("/v1/chat/completions", content=b'{"model": "demo-model", "stream": tru',
                       headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_request_body" and "not valid JSON" in err["message"]
    rid = r.headers["x-gateway-request-id"]
    assert err["request_id"] == rid
    _nothing_ran(gw, rid)
    assert gw.status(rid).status_code == 404  # no journal record for a refused request


def test_json_that_is_not_an_object(gw: Gateway) -> None:
    r = gw.client.post("/v1/chat/completions", content=b"[1, 2, 3]")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_body"


def test_body_over_the_configured_limit(gw: Gateway) -> None:
    big = gw.body(prompt="x" * 70_000)  # the e2e config sets max_request_body_bytes 65536
    r = gw.client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_body_too_large"
    _nothing_ran(gw, r.headers["x-gateway-request-id"])


def test_body_over_envoys_buffer_is_refused_by_envoy(gw: Gateway) -> None:
    # Above Envoy's per-connection buffer (2x our limit, at least 1 MiB) Envoy answers
    # itself before the processor sees the body: 413, documented in docs/errors.md.
    r = gw.client.post("/v1/chat/completions", json=gw.body(prompt="x" * (3 << 20)))
    assert r.status_code == 413


@pytest.mark.parametrize("key", ["x" * 200, "has space", "tab\tkey"])
def test_invalid_idempotency_key(gw: Gateway, key: str) -> None:
    r = gw.client.post("/v1/chat/completions", json=gw.body(), headers={"Idempotency-Key": key})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_idempotency_key"


def test_unknown_and_invalid_request_ids(gw: Gateway) -> None:
    r = gw.status("req_" + "0" * 26)
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"
    r = gw.status("not-an-id")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_id"
    r = gw.client.post("/v1/requests/req_" + "0" * 26, json={})
    assert r.status_code == 405


def test_client_cannot_choose_the_gateway_request_id(gw: Gateway) -> None:
    forged = "req_" + "1" * 26
    res = gw.post(gw.body(max_tokens=2), headers={"x-gateway-request-id": forged})
    assert res.status == 200 and res.request_id != forged
    rows = gw.attempts_logged(res.request_id)
    assert len(rows) == 1 and rows[0]["request_id"] == res.request_id


def test_etcd_frozen_gives_a_managed_error_before_anything_runs(gw: Gateway) -> None:
    etcd = gw.stack.procs["etcd"]
    etcd.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = gw.client.post("/v1/chat/completions", json=gw.body(max_tokens=2))
        took = time.monotonic() - t0
    finally:
        etcd.signal(signal.SIGCONT)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "journal_unavailable" and err["retryable"] is True
    # Bounded by the intake's deadline (it is sent again until then: decision 0026) plus
    # one call's, never a hang.
    assert gw.stack.cfg is not None
    assert took < gw.stack.cfg.etcd.resend_deadline_s + gw.stack.cfg.etcd.timeout_s + 1.0
    _nothing_ran(gw, r.headers["x-gateway-request-id"])
    ok = gw.post(gw.body(max_tokens=2))  # and it recovers by itself
    assert ok.status == 200 and len(ok.contents) == 2


def test_a_fresh_request_goes_upstream_only_once_recorded(gw: Gateway) -> None:
    """Without an Idempotency-Key the body goes on while the intake commits (decision
    0021); with etcd frozen for a moment, no replica sees the request until it is recorded,
    and then it completes as usual."""
    etcd = gw.stack.procs["etcd"]
    warm = gw.post(gw.body(max_tokens=2), key=None)  # the process lease exists, as in use
    assert warm.status == 200
    gw.attempts_logged(warm.request_id)
    before = len(gw.stack.all_replica_logs())
    done: list[Result] = []
    t = threading.Thread(target=lambda: done.append(gw.post(gw.body(max_tokens=2), key=None)))
    etcd.signal(signal.SIGSTOP)
    try:
        t.start()
        time.sleep(0.6)  # well inside the intake's etcd deadline (etcd.timeout_s)
        assert not done
        assert len(gw.stack.all_replica_logs()) == before  # nothing ran upstream
    finally:
        etcd.signal(signal.SIGCONT)
    t.join(10)
    (res,) = done
    assert res.status == 200 and len(res.contents) == 2, res.raw[:300]
    rows = gw.attempts_logged(res.request_id)
    assert [(r["attempt"], r["outcome"]) for r in rows] == [(1, "completed")]
    j = gw.journal(res.request_id)
    assert (j["outcome"], j["attempt"], j["delivered_output_tokens"]) == ("completed", 1, 2)


def test_a_client_that_leaves_during_its_intake_gets_a_finished_record(gw: Gateway) -> None:
    """The client gives up while etcd is frozen in the intake; once etcd thaws the record
    commits, and it is finished from Envoy's cause, not left in progress. Nothing ran and
    nothing was delivered, so a repeat of the key runs it (decision 0027): once."""
    etcd = gw.stack.procs["etcd"]
    warm = gw.post(gw.body(max_tokens=2))
    assert warm.status == 200
    key = f"left-{time.time_ns()}"
    rid = request_id_for_key(DEFAULT_TENANT, key)
    etcd.signal(signal.SIGSTOP)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(gw.stack.base_url + "/v1/chat/completions", json=gw.body(max_tokens=2),
                       headers={"Idempotency-Key": key}, timeout=0.3)
        time.sleep(0.2)  # Envoy resets the guard's stream; the intake is still in etcd
    finally:
        etcd.signal(signal.SIGCONT)
    j = gw.journal(rid, settle_s=5.0)
    assert (j["outcome"], j["delivered_output_tokens"]) == ("client_disconnected", 0), j
    _nothing_ran(gw, rid)
    again = gw.post(gw.body(max_tokens=2), key=key)
    assert again.status == 200 and again.request_id == rid and len(again.contents) == 2
    assert [(r["attempt"], r["outcome"]) for r in gw.attempts_logged(rid)] == [
        (1, "completed")]
    after = gw.journal(rid)
    assert (after["outcome"], after["runs"]) == ("completed", 2), after
    assert after["history"][0]["outcome"]["outcome"] == "client_disconnected"


def test_processor_restart(gw: Gateway) -> None:
    proc = gw.stack.procs["processor"]
    proc.signal(signal.SIGKILL)
    proc.popen.wait(5)  # type: ignore[union-attr]
    # Fail closed: with the processor gone Envoy refuses rather than serve unguarded.
    r = gw.client.post("/v1/chat/completions", json=gw.body(max_tokens=2))
    assert r.status_code == 500
    proc.start()
    deadline = time.monotonic() + 15
    while True:
        res = gw.post(gw.body(max_tokens=2))
        if res.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert res.status == 200 and len(res.contents) == 2
    assert gw.journal(res.request_id)["outcome"] == "completed"

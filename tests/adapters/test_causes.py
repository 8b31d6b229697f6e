"""adapters/causes: Envoy's access-log entries and the streams that wait for them meet
halfway, in whichever order they come; the response flags become one coarse cause; only the
replicas cluster's per-attempt entries speak of attempts."""

from __future__ import annotations

import asyncio

from extproc.adapters.causes import NO_GATE, REPLICA_CLUSTER, CauseRegistry, cause_of
from extproc.core import headers as H
from extproc.gen.envoy.data.accesslog.v3 import accesslog_pb2 as al

from .support import FakeClock, FakeTimers, idle


def entry(headers: dict[str, str], *, upstream: bool = False, cluster: str = REPLICA_CLUSTER,
          flag: str | None = None, body_bytes: int = 0, status: int = 200,
          address: str = "") -> al.HTTPAccessLogEntry:
    e = al.HTTPAccessLogEntry()
    e.request.request_headers.update(headers)
    e.response.response_body_bytes = body_bytes
    e.response.response_code.value = status
    cp = e.common_properties
    if upstream:
        cp.access_log_type = al.UpstreamEnd
        cp.upstream_cluster = cluster
    if address:
        cp.upstream_remote_address.socket_address.address = address
        cp.upstream_remote_address.socket_address.port_value = 8001
    if flag:
        setattr(cp.response_flags, flag, True)
    return e


def test_flags_map_to_client_timeout_upstream_or_unknown() -> None:
    assert cause_of(entry({}, flag="downstream_remote_reset")) == "client"
    assert cause_of(entry({}, flag="stream_idle_timeout")) == "timeout"
    assert cause_of(entry({}, flag="upstream_remote_reset")) == "upstream"
    assert cause_of(entry({}, flag="no_healthy_upstream")) == "upstream"
    assert cause_of(entry({})) == "unknown"


async def test_an_entry_before_the_wait_is_kept_for_it_and_taken_once() -> None:
    timers = FakeTimers(FakeClock())
    reg = CauseRegistry(timers=timers)
    reg.offer(entry({H.REQUEST_ID: "req_1"}, flag="downstream_connection_termination",
                    body_bytes=17))
    assert reg.seen("req_1")
    assert await reg.wait("req_1", 1.0) == ("client", 17, 200)
    assert not reg.seen("req_1")  # taken: a second wait hears nothing ...
    again = asyncio.ensure_future(reg.wait("req_1", 0.01))
    await idle()
    assert not again.done() and timers.advance(0.01) == 1  # ... for its whole bound
    assert await again is None


async def test_a_wait_before_the_entry_is_answered_when_it_comes() -> None:
    reg = CauseRegistry()
    waiting = asyncio.ensure_future(reg.wait("req_2", 5.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    reg.offer(entry({H.REQUEST_ID: "req_2"}, flag="upstream_connection_failure",
                    body_bytes=3, status=502))  # Envoy's own reply: its status is said
    assert await waiting == ("upstream", 3, 502)
    assert not reg.seen("req_2")  # handed over, not also kept


async def test_the_guards_wait_ends_on_the_timers_port_not_the_loops_clock() -> None:
    timers = FakeTimers(FakeClock())
    reg = CauseRegistry(timers=timers)
    silent = asyncio.ensure_future(reg.wait("req_3", 0.5))
    await asyncio.sleep(0)
    timers.advance(0.4)
    await asyncio.sleep(0)
    assert not silent.done()  # no real time passes: only the fake clock's
    timers.advance(0.2)
    assert await silent is None
    answered = asyncio.ensure_future(reg.wait("req_4", 0.5))
    await asyncio.sleep(0)
    reg.offer(entry({H.REQUEST_ID: "req_4"}, flag="downstream_remote_reset", body_bytes=5))
    assert await answered == ("client", 5, 200)
    assert timers.pending() == 0  # its deadline cancelled, not left to fire


async def test_a_wait_given_up_leaves_no_deadline_and_the_entry_is_kept() -> None:
    timers = FakeTimers(FakeClock())
    reg = CauseRegistry(timers=timers)
    waiting = asyncio.ensure_future(reg.wait("req_5", 0.5))
    await asyncio.sleep(0)
    assert timers.pending() == 1
    waiting.cancel()  # the stream's end task was cancelled mid-wait
    await asyncio.sleep(0)
    assert waiting.cancelled() and timers.pending() == 0
    reg.offer(entry({H.REQUEST_ID: "req_5"}, flag="downstream_remote_reset"))
    assert reg.seen("req_5")  # nobody took it: kept for a later wait


def test_expect_answers_once_with_the_cause_or_with_none_when_envoy_is_silent() -> None:
    timers = FakeTimers(FakeClock())
    reg = CauseRegistry(timers=timers)
    heard: list[tuple[str, int] | None] = []
    reg.expect("att_1", 0.5, heard.append)
    reg.offer(entry({H.ATTEMPT_ID: "att_1"}, upstream=True, flag="upstream_remote_reset",
                    body_bytes=9))
    assert timers.pending() == 0  # its timer was cancelled, not left to fire
    timers.advance(1.0)
    assert heard == [("upstream", 9, 200)]  # no second answer
    reg.expect("att_2", 0.5, heard.append)
    timers.advance(0.4)
    assert heard == [("upstream", 9, 200)]
    timers.advance(0.2)
    assert heard == [("upstream", 9, 200), None]
    reg.offer(entry({H.ATTEMPT_ID: "att_2"}, upstream=True))  # late: kept, not answered
    assert heard == [("upstream", 9, 200), None] and reg.seen("att_2")


def test_expect_after_the_entry_answers_at_once() -> None:
    reg = CauseRegistry(timers=FakeTimers(FakeClock()))
    reg.offer(entry({H.REQUEST_ID: "req_3"}, flag="duration_timeout"))
    heard: list[tuple[str, int] | None] = []
    reg.expect("req_3", 1.0, heard.append)
    assert heard == [("timeout", 0, 200)]


def test_only_the_replicas_cluster_speaks_of_attempts_and_of_replica_health() -> None:
    seen: list[tuple[str, str, int]] = []
    reg = CauseRegistry(on_attempt=lambda *a: seen.append(a))
    # A tool call made by the attempt carries its attempt id too: not the attempt's end.
    reg.offer(entry({H.ATTEMPT_ID: "att_t"}, upstream=True, cluster="tools",
                    flag="upstream_remote_reset", address="127.0.0.1"))
    assert not reg.seen("att_t") and seen == []
    reg.offer(entry({H.ATTEMPT_ID: "att_r"}, upstream=True, status=503,
                    flag="upstream_remote_reset", address="127.0.0.1"))
    assert reg.seen("att_r") and seen == [("127.0.0.1:8001", "upstream", 503)]


def test_a_preadmitted_attempt_no_gate_saw_is_known_by_its_own_key() -> None:
    reg = CauseRegistry()
    reg.offer(entry({H.PREADMITTED: "att_p"}, upstream=True,
                    flag="upstream_connection_failure"))
    assert reg.no_gate_ran("att_p") and reg.seen(NO_GATE + "att_p")
    assert not reg.no_gate_ran("att_other")


def test_an_entry_without_our_id_is_dropped_and_the_early_ones_are_bounded() -> None:
    reg = CauseRegistry(keep=2)
    reg.offer(entry({}))  # no request id: nothing to match it on
    for i in range(3):
        reg.offer(entry({H.REQUEST_ID: f"req_{i}"}))
    assert [reg.seen(f"req_{i}") for i in range(3)] == [False, True, True]

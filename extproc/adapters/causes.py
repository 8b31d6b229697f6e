"""Why a stream ended, from Envoy's own gRPC access-log service.

No ext_proc hook exists between an upstream reset and the filter's teardown, and both a
client disconnect and an upstream death look like "the gRPC stream ended" to us. Envoy
knows the difference (response flags DC vs UPE/UC/...), and tells it through the access
log, usually 0-6 ms after our stream ends, sometimes before. Entries are matched on our
request id header, which the access-log config adds to each entry.

A downstream entry also says how much of the response body Envoy sent to the client
(`response.response_body_bytes`): the guard counts delivery from it (decision 0025).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from ..core.headers import ATTEMPT_ID, PREADMITTED, REQUEST_ID
from ..gen.envoy.data.accesslog.v3 import accesslog_pb2 as al
from .timers import LoopTimers, TimerHandle, Timers

# What Envoy's word says: the cause, the response body bytes it sent and the response
# status (0: none), or None (silence).
Heard = tuple[str, int, int] | None

REPLICA_CLUSTER = "replicas"  # the cluster name extproc.envoy_config renders
NO_GATE = "nogate:"  # key prefix of a pre-admitted attempt that no gate ever saw

_CLIENT_FLAGS = ("downstream_connection_termination", "downstream_remote_reset")
_TIMEOUT_FLAGS = ("upstream_request_timeout", "stream_idle_timeout", "duration_timeout",
                  "upstream_max_stream_duration_reached")
_UPSTREAM_FLAGS = ("upstream_connection_termination", "upstream_remote_reset",
                   "upstream_connection_failure", "upstream_protocol_error",
                   "upstream_overflow", "no_healthy_upstream", "upstream_retry_limit_exceeded",
                   "local_reset")


def cause_of(entry: al.HTTPAccessLogEntry) -> str:
    """Map Envoy's response flags to our coarse cause: client, timeout, upstream, unknown."""
    f = entry.common_properties.response_flags
    if any(getattr(f, n) for n in _CLIENT_FLAGS):
        return "client"
    if any(getattr(f, n) for n in _TIMEOUT_FLAGS):
        return "timeout"
    if any(getattr(f, n) for n in _UPSTREAM_FLAGS):
        return "upstream"
    return "unknown"


def body_bytes_sent(entry: al.HTTPAccessLogEntry) -> int:
    """The response body bytes Envoy's connection manager passed to the client's codec,
    after every filter (the guard's too): chunked framing and headers not included.

    Measured on Envoy 1.40 (tests/e2e/test_delivery.py): equal to the body the client read,
    byte for byte, in every run, and it leaves out a chunk the guard answered after an
    upstream reset had destroyed the stream. `common_properties.downstream_wire_bytes_sent`
    counts the same bytes plus headers and chunk framing, so it cannot be compared with
    the guard's body offsets.
    """
    return int(entry.response.response_body_bytes)


class CauseRegistry:
    """Meets access-log entries and guard streams halfway, in whichever order they come."""

    def __init__(self, keep: int = 10000, ttl_s: float = 30.0,
                 on_attempt: Callable[[str, str, int], None] | None = None,
                 timers: Timers | None = None) -> None:
        # on_attempt(replica address, cause, HTTP status) for every per-attempt entry of the
        # replicas cluster, attempts that never reached a gate included (pool health).
        self.on_attempt = on_attempt
        # key -> (cause, response body bytes sent, response status, arrival time)
        self._early: OrderedDict[str, tuple[str, int, int, float]] = OrderedDict()
        # key -> who expects its entry (a role's AwaitCause) and its deadline, answered once
        self._expecting: dict[str, tuple[Callable[[Heard], None], TimerHandle]] = {}
        self._timers: Timers = timers or LoopTimers()
        self._keep = keep
        self._ttl = ttl_s

    def offer(self, entry: al.HTTPAccessLogEntry) -> None:
        """Downstream entries are keyed by request id, per-attempt (upstream) ones by attempt id."""
        hdrs = entry.request.request_headers
        if entry.common_properties.access_log_type == al.UpstreamEnd:
            if entry.common_properties.upstream_cluster != REPLICA_CLUSTER:
                # e.g. a tool call made by the attempt carries its attempt id too: its entry
                # says nothing about how the attempt ended (found by the fault sweep).
                return
            if self.on_attempt is not None:
                sa = entry.common_properties.upstream_remote_address.socket_address
                if sa.address:
                    self.on_attempt(f"{sa.address}:{sa.port_value}", cause_of(entry),
                                    entry.response.response_code.value)
            rid = hdrs.get(ATTEMPT_ID)
            if not rid and hdrs.get(PREADMITTED):
                # No gate ran for this attempt (its upstream filters never started, e.g. the
                # connection was refused): it never reached a replica.
                rid = NO_GATE + hdrs[PREADMITTED]
        else:
            rid = hdrs.get(REQUEST_ID)
        if not rid:
            return
        got = (cause_of(entry), body_bytes_sent(entry), entry.response.response_code.value)
        expected = self._expecting.pop(rid, None)
        if expected is not None:
            expected[1].cancel()
            expected[0](got)
            return
        now = time.monotonic()
        self._early[rid] = (*got, now)
        while self._early and (len(self._early) > self._keep
                               or now - next(iter(self._early.values()))[3] > self._ttl):
            self._early.popitem(last=False)

    def seen(self, rid: str) -> bool:
        """An entry for `rid` arrived and nobody took it yet (does not consume it)."""
        return rid in self._early

    def no_gate_ran(self, attempt_id: str) -> bool:
        """Envoy's entry says the pre-admitted attempt `attempt_id` never reached a gate."""
        return self.seen(NO_GATE + attempt_id)

    def expect(self, rid: str, timeout_s: float, answer: Callable[[Heard], None]) -> None:
        """The one wait for Envoy's word: call `answer` once, with the cause and the
        response body bytes Envoy sent (`body_bytes_sent`) from `rid`'s entry (at once if
        it came already), or with None if Envoy said nothing within `timeout_s` (on the
        Timers port, so a hermetic test moves a fake clock instead of sleeping)."""
        early = self._early.pop(rid, None)
        if early is not None:
            answer(early[:3])
            return

        def timed_out() -> None:
            if self._expecting.pop(rid, None) is not None:
                answer(None)
        self._expecting[rid] = (answer, self._timers.start(timeout_s, timed_out))

    async def wait(self, rid: str, timeout_s: float) -> Heard:
        """`expect`, awaited (the guard's AwaitCause is answered within its batch)."""
        fut: asyncio.Future[Heard] = asyncio.get_running_loop().create_future()
        self.expect(rid, timeout_s, fut.set_result)
        try:
            return await fut
        except asyncio.CancelledError:
            if (gone := self._expecting.pop(rid, None)) is not None:
                gone[1].cancel()  # nobody waits any more: no deadline left behind
            raise

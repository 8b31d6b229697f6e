"""Tell failure from slowness: classify how an attempt ended, and how to fence it.

The mission's four situations (dead replica, broken network, overload, client gone) map
to the policy's branches. Inputs are what the gate saw itself plus the cause Envoy reported
for this attempt (its per-attempt access-log entry): see docs/failure-classes.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureClass(StrEnum):
    COMPLETED = "completed"
    REPLICA_DEAD = "replica_dead"  # connection refused/reset/closed by the replica
    NETWORK_UNCERTAIN = "network_uncertain"  # no bytes within the limit; may still decode
    OVERLOADED = "overloaded"  # 429/503 answered by the replica: alive, busy
    CLIENT_GONE = "client_gone"
    ENDED_BY_GATEWAY = "ended_by_gateway"  # we failed it on purpose; the replica answered
    REPLICA_ERROR = "replica_error"  # the replica answered an error status: alive, done


class Fence(StrEnum):
    REVOKE = "revoked"  # confirmed: delete the lease now, a retry may start at once
    EXPIRE = "expiry"  # unconfirmed: mark fenced, stop renewing, let the lease run out


@dataclass(frozen=True, slots=True)
class AttemptEnd:
    released: bool  # its first delta was fenced and released to the client
    upstream_finished: bool  # the replica sent its whole response
    failed_on_purpose: bool  # the gate answered 503 itself (in-band error, garbage, fence lost)
    http_status: int  # response status the replica sent (0: none)
    cause: str  # Envoy's per-attempt cause: upstream | timeout | client | unknown
    timed_out: bool = False  # the gate's own first-delta limit failed it


def classify(end: AttemptEnd) -> FailureClass:
    if end.upstream_finished and (end.released or end.http_status not in (0, 200)):
        if end.http_status in (429, 503):
            return FailureClass.OVERLOADED
        return FailureClass.COMPLETED
    if end.timed_out and not end.upstream_finished:
        # Headers came, then silence past the limit: slow, stuck or partitioned; not known
        # to be dead, so it is fenced by expiry.
        return FailureClass.NETWORK_UNCERTAIN
    if end.failed_on_purpose:
        # The replica answered (an error event, garbage, or we lost the fence): it is alive
        # and reachable, and Envoy's close of the connection reaches it.
        return FailureClass.ENDED_BY_GATEWAY
    if end.http_status in (429, 503):
        return FailureClass.OVERLOADED
    if end.http_status >= 400:
        # It answered (Envoy may reset the rest to retry elsewhere): reachable and alive,
        # its request is over. Never the uncertain branch (found by the fault sweep).
        return FailureClass.REPLICA_ERROR
    if end.cause == "client":
        return FailureClass.CLIENT_GONE
    if end.cause == "upstream":
        return FailureClass.REPLICA_DEAD
    # A timeout with no (complete) answer, or no word from Envoy at all: the replica may be
    # partitioned and still decoding. Never assume it is dead.
    return FailureClass.NETWORK_UNCERTAIN


def fence_for(cls: FailureClass, envoy_closed: bool) -> Fence:
    """policy.uncertain_source_liveness: wait for lease expiry unless the end is confirmed.

    `envoy_closed`: Envoy's own per-attempt access-log entry for this attempt arrived, so
    Envoy has torn the attempt's upstream stream down. Only this processor's gate could
    release that attempt's bytes, and the gate is gone; its tool calls are refused by the
    fenced `live` value. So even a replica that may still be decoding (partitioned, stuck)
    can no longer publish: revoking is a fence (docs/fencing.md, "Envoy closed it"). With
    no word from Envoy (the ext_proc stream or Envoy itself lost), the publisher's state is
    unknown: the lease must expire.
    """
    if cls is FailureClass.NETWORK_UNCERTAIN and not envoy_closed:
        return Fence.EXPIRE
    return Fence.REVOKE

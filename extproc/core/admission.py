"""May this attempt run, and for how long may it stay silent? Decided here, executed by the gate.

Admission is the policy's `before_first_delta.require` list made concrete: the attempt
count, the compatibility fingerprint, the request's whole first-delta budget, and for a
*re-prefill* the retry cost and the pool-wide retry budget. An attempt that follows only
attempts that never reached a replica (Envoy could not connect, so no gate ran and no byte
reached any GPU) is not a re-prefill: it is the request's first real run, and the retry
budget never refuses a first run (decision 0010). Whether the etcd journal then admits it
(nothing delivered, the previous attempt fenced) is the store's transaction.

The deadline tells the gate when the attempt's silence ends it: the per-attempt limit, or
the request's remaining budget if that comes first; `final` says that passing it ends the
request with `upstream_timeout` instead of a retry. Pure: time comes in as numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from .budget import RetryBudget
from .errors import (
    GatewayError,
    attempts_exhausted,
    budget_exhausted,
    no_compatible_replica,
    too_expensive,
    upstream_timeout,
    upstream_unavailable,
)
from .failure import Fence

# An attempt that would have less than this left of the request's budget is not started:
# it could not produce a first delta in time, and it would cost a prefill.
MIN_ATTEMPT_S = 0.5


@dataclass(frozen=True, slots=True)
class AttemptRequest:
    request_id: str
    attempt: int  # Envoy's attempt count (attempts that never reached a gate included)
    max_attempts: int
    # An earlier attempt of this request reached a replica (its gate let it go upstream).
    reached_before: bool
    # Seconds since the guard accepted the request, and the request's whole budget.
    elapsed_s: float
    total_first_delta_s: float
    first_delta_s: float
    fence_wait_s: float
    # The fingerprint this request needs and the one the pool declares for this replica
    # (None when there is no compatibility pool).
    want_fingerprint: str | None = None
    replica_fingerprint: str | None = None
    replica: str | None = None
    prompt_tokens: int = 0
    max_prompt_tokens: int = 0  # 0: no retry-cost limit
    # How many earlier attempts of this request reached a replica. Given, max_attempts
    # counts only those (an attempt whose connection was refused spends none, decision
    # 0024); None: Envoy's attempt count is the count.
    reached_count: int | None = None
    attempt_id: str = ""  # the budget counts a re-prefill under it until its end


@dataclass(frozen=True, slots=True)
class Admitted:
    counts_as_retry: bool  # a re-prefill, charged to the retry budget
    # How long the journal may wait for the previous attempt's fence (revoke or expiry).
    fence_wait_s: float
    # From the end of admission: the first-delta deadline of this attempt ...
    deadline_s: float
    # ... and whether passing it ends the request (no attempt left or no budget left).
    final: bool


def decide(req: AttemptRequest, budget: RetryBudget, now: float) -> Admitted | GatewayError:
    rid = req.request_id
    counted = req.attempt if req.reached_count is None else req.reached_count + 1
    if req.reached_count is not None and counted > req.max_attempts:
        # Envoy's spare attempts (pool.unreached_attempts) are for connections that never
        # reached a replica; this one would be a run beyond max_attempts. Nothing was
        # delivered and nothing more runs: the client may try again.
        return upstream_unavailable(
            rid, f"{req.reached_count} attempts reached a replica, max_attempts "
                 f"{req.max_attempts}")
    if counted > req.max_attempts:
        return attempts_exhausted(rid, req.attempt, req.max_attempts)
    if req.want_fingerprint and req.replica_fingerprint != req.want_fingerprint:
        # Defense in depth: Envoy's host list holds only compatible replicas, but whatever
        # picked this host, a cross-fingerprint attempt never runs.
        return no_compatible_replica(
            rid, f"replica {req.replica} has fingerprint {req.replica_fingerprint}, this "
            f"request needs {req.want_fingerprint}")
    remaining = req.total_first_delta_s - req.elapsed_s
    if req.attempt > 1 and remaining < MIN_ATTEMPT_S:
        return upstream_timeout(rid, req.elapsed_s, req.attempt - 1)
    retry = req.attempt > 1 and req.reached_before
    if retry:
        limit = req.max_prompt_tokens
        if limit and req.prompt_tokens > limit:
            return too_expensive(rid, req.prompt_tokens, limit)
        decision = budget.try_retry(now, req.attempt_id or f"{rid}#{req.attempt}", rid)
        if not decision.allowed:
            return budget_exhausted(rid, decision.retries, decision.requests, decision.limit)
    # The fence wait comes out of this attempt's own time: it may not eat all of it.
    window = min(req.first_delta_s, remaining)
    fence_wait = max(0.0, min(req.fence_wait_s, window - MIN_ATTEMPT_S))
    final = counted >= req.max_attempts or remaining <= req.first_delta_s
    return Admitted(counts_as_retry=retry, fence_wait_s=fence_wait, deadline_s=window,
                    final=final)


def envoy_retries(status: int, final: bool) -> bool:
    """Whether Envoy should retry a response that came back from a replica (its own
    non-200, passed through) or that the gate failed on purpose (503): 5xx and 429, as
    before, but never after the last attempt that counts (`final`). Envoy's retry policy
    retries a response only when the gate marks it (RETRY_HEADER), so the spare attempts
    for refused connections (pool.unreached_attempts) are never spent on a re-run."""
    return not final and (status >= 500 or status == 429)


# The response header by which the gate asks Envoy to retry (retry_policy.retriable_headers).
RETRY_HEADER = "x-gateway-retry"


def retry_after_s(value: str | None, limit_s: float) -> float | None:
    """A replica's Retry-After in seconds (delta-seconds only), capped at `limit_s`."""
    if not value:
        return None
    try:
        s = float(value.strip())
    except ValueError:
        return None
    if s != s or s < 0:  # NaN or negative
        return None
    return min(s, limit_s)


# --- the journal's admission, once its compare failed ----------------------------------

TAKE_OVER = "take_over"  # attempt 1 never reached a gate: replace its `live` (decision 0007)
WAIT = "wait"  # another attempt still holds `live`: wait for its revocation or expiry
# An earlier attempt's first delta was fenced but its release never left Envoy: take the
# `delivery` back, fence that attempt, then admit (decision 0057).
RECLAIM = "reclaim"
# The refusals, by reason. Nothing ran for the request in the first and the last: a repeat
# of its key may run it (`refusal_retryable`).
UNKNOWN_REQUEST = "unknown request (no journal record)"
DELIVERED = "first delta already sent: no second attempt"
NOT_FENCED = "previous attempt is not fenced (lease still live)"


def refusal_retryable(reason: str) -> bool:
    """Whether a client refused for `reason` may send the request again: yes when no
    attempt of it delivered anything (the record is unknown, or the previous attempt's
    lease had not lapsed in time: its repeat waits for it, then runs); no once a first
    delta was sent or the attempt number was taken."""
    return reason in (UNKNOWN_REQUEST, NOT_FENCED)


def after_failed_admission(*, attempt: int, has_meta: bool, delivered: bool,
                           attempt_taken: bool, live_never_started: bool, waited_s: float,
                           fence_wait_s: float, release_lost: bool = False) -> str:
    """What a journal store does when its admission transaction's compare failed: refuse
    (the reason), take over a never-started attempt 1, reclaim a release that never left,
    or wait for `live` to go. Every store (etcd, in memory) asks this, so they refuse alike.

    `release_lost`: `delivery` names an earlier attempt of this request, and `live` names
    that attempt, its fenced mark, or nothing. A gate runs for attempt n only because
    Envoy's router retried, and the router retries only while it has sent nothing of the
    response downstream; so the earlier attempt's released headers never reached the
    client, and its `delivery` records a first delta that never left (decision 0057)."""
    if not has_meta:
        return UNKNOWN_REQUEST
    if delivered and release_lost and not attempt_taken:
        return RECLAIM
    if delivered:
        return DELIVERED
    if attempt_taken:
        return f"attempt {attempt} was already admitted"
    if live_never_started:
        return TAKE_OVER
    if waited_s >= fence_wait_s:
        return NOT_FENCED
    return WAIT


def release_lost(delivered_by: tuple[int, str] | None, live: str | None, attempt: int,
                 attempt_id: str, fenced_prefix: str = "fenced:") -> bool:
    """Whether a `delivery` found by attempt `attempt`'s admission is a release that never
    left (see `after_failed_admission`): written by an earlier attempt (by number and id,
    `journal.delivered_by`), with `live` still that attempt's, its fenced mark, or gone
    (its process's lease lapsed). Anything else (no readable `delivery`, a later attempt's,
    `live` held by a third attempt) is refused as delivered."""
    if delivered_by is None:
        return False
    n, aid = delivered_by
    if aid == attempt_id or n >= attempt:
        return False
    return live is None or live in (aid, fenced_prefix + aid)


def lost_release_fence(cancel_ack: bool) -> Fence:
    """How a reclaimed attempt is fenced. Envoy retried only after it closed the earlier
    attempt's upstream stream (a reset it saw, or its own per-try timeout's reset): that
    is Envoy's confirmed close, which `cancel_ack_or_lease_expiry` takes as the cancel's
    acknowledgement (revoke now); under `lease_expiry` the attempt's `live` is marked
    fenced and the new attempt waits for its lease to run out, as for any uncertain end."""
    return Fence.REVOKE if cancel_ack else Fence.EXPIRE


def admission_poll_s(waited_s: float, fence_wait_s: float) -> float:
    """How long to wait for `live` to go before asking again. The watch wakes the waiter
    when it goes; polls cover a lost watch and the access-log entry of an attempt that never
    started (it arrives within ~50 ms): often at first, then every 250 ms."""
    return min(0.02 if waited_s < 0.5 else 0.25, max(0.0, fence_wait_s - waited_s))

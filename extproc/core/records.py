"""The journal's records, built once, and the plan for an attempt's end.

Every record the processor writes about an attempt or a request's outcome is assembled
here from plain facts, so the gate, the guard and `extproc replay` agree on its fields, and
the decisions about an attempt's end (revoke at once, wait for Envoy's word, which fence)
are made here, not in the adapters. Times are passed in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .failure import AttemptEnd, FailureClass, Fence, classify, fence_for
from .journal import key_digest, tenant_digest

# --- their JSON -------------------------------------------------------------------------


def one_shot(enc: json.JSONEncoder) -> Callable[[Any], str]:
    """`enc.encode`, the same text, without what it does per call: `encode` builds its C
    encoder (and a dict for the circular check) for every value; this one is built once,
    with no circular check (records are trees of plain values; a value nested too deep
    still raises RecursionError). Where the C part is absent, `enc.encode` itself."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None or enc.indent is not None:
        return enc.encode
    c = make(None, enc.default,
             json.encoder.encode_basestring_ascii if enc.ensure_ascii
             else json.encoder.encode_basestring,
             None, enc.key_separator, enc.item_separator, enc.sort_keys, enc.skipkeys,
             enc.allow_nan)
    join = "".join
    return lambda obj: join(c(obj, 0))


# --- the request ----------------------------------------------------------------------


def request_meta(*, request_id: str, tenant: str, idempotency_key: str | None, endpoint: str,
                 max_attempts: int, gateway_id: str, envoy_request_id: str | None,
                 created_at: float, body_meta: Mapping[str, Any],
                 route: tuple[str, list[str]] | None) -> dict[str, Any]:
    """The request's record as the intake writes it (tenant and key as digests only)."""
    rec: dict[str, Any] = {
        "request_id": request_id, "tenant": tenant_digest(tenant),
        "idempotency_key_sha256": key_digest(idempotency_key) if idempotency_key else None,
        "endpoint": endpoint, "max_attempts": max_attempts, "gateway_id": gateway_id,
        "envoy_request_id": envoy_request_id, "created_at": created_at, **body_meta}
    if route is not None:
        rec["fingerprint"], rec["hosts"] = route[0], list(route[1])
    return rec


def outcome(*, outcome: str, delivered_output_tokens: int, cause: str | None,
            finished_at: float, gateway_id: str, exact: bool = True,
            source: str = "events", bound: str | None = None) -> dict[str, Any]:
    """`exact` / `source`: whether the count is the engine's own, and what it counted
    (decision 0018). The count is of what reached the client's connection (decision 0025):
    `partial_output` says whether any of the answer did. `bound: "upper"`: Envoy did not
    say what it sent (its access-log entry never came), so the count is of what the guard
    handed to Envoy, at most what the client got: never called exact."""
    rec: dict[str, Any] = {"outcome": outcome, "delivered_output_tokens": delivered_output_tokens,
                           "delivered_output_tokens_exact": exact,
                           "delivered_output_tokens_source": source,
                           "partial_output": delivered_output_tokens > 0 and outcome != "completed",
                           "cause": cause, "finished_at": finished_at, "gateway_id": gateway_id}
    if bound is not None:
        rec["delivered_output_tokens_bound"] = bound
        rec["delivered_output_tokens_exact"] = False
    return rec

# --- attempt records ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptFacts:
    """What the gate knows of its attempt once admitted."""

    attempt: int
    attempt_id: str
    replica: str | None
    gateway_id: str
    started_at: float  # wall clock, the attempt's start (before any fence wait)
    waited_for_previous_s: float = 0.0
    model_revision: str | None = None
    slow: bool = False

    def admission(self) -> dict[str, Any]:
        """Written by the admission transaction (etcd adds `admitted_at`)."""
        return {"attempt": self.attempt, "attempt_id": self.attempt_id,
                "replica": self.replica, "gateway_id": self.gateway_id,
                "started_at": self.started_at, "model_revision": self.model_revision}

    def base(self) -> dict[str, Any]:
        return {**self.admission(),
                "admitted_at": round(self.started_at + self.waited_for_previous_s, 6),
                "slow": self.slow,
                "waited_for_previous_s": round(self.waited_for_previous_s, 4)}

    def handoff(self, lease_id: int) -> dict[str, Any]:
        """What the gate hands the guard at release (the attempt's record so far)."""
        return {**self.base(), "lease_id": lease_id}

    def fence(self, at: float) -> dict[str, Any]:
        return {"attempt": self.attempt, "attempt_id": self.attempt_id,
                "replica": self.replica, "model_revision": self.model_revision, "at": at}


def first_attempt(attempt_id: str, gateway_id: str, at: float,
                  attempt: int = 1) -> dict[str, Any]:
    """Attempt 1, admitted with the request in the guard's intake transaction (or a re-run's
    first attempt, admitted in its re-open: numbered after the last one, decision 0027)."""
    return {"attempt": attempt, "attempt_id": attempt_id, "gateway_id": gateway_id,
            "admitted_at": at, "admitted_with_request": True}


def refused_first_attempt(attempt_id: str, replica: str | None, at: float,
                          code: str, attempt: int = 1) -> dict[str, Any]:
    """Attempt 1 pre-admitted by the guard and refused by its gate: `live` is given back."""
    return {"attempt": attempt, "attempt_id": attempt_id, "replica": replica, "ended_at": at,
            "refused": code, "fence": str(Fence.REVOKE)}


def taken_over_first_attempt(attempt_id: str, at: float, attempt: int = 1) -> dict[str, Any]:
    """Attempt 1, admitted with the request, that no gate ever ran (Envoy could not connect:
    no byte reached a replica), as the next attempt's admission closes it (decision 0007)."""
    return {"attempt": attempt, "attempt_id": attempt_id, "released": False, "ended_at": at,
            "failure_class": "never_started", "fence": "taken_over"}


def lost_release_end(admitted: Mapping[str, Any], delivery: Mapping[str, Any], *,
                     fence: str, at: float, by: str) -> dict[str, Any]:
    """The record of an attempt whose fenced release never left Envoy (decision 0057),
    written by whoever took its `delivery` back (`by`: the admission of a retry, its
    attempt id, or the request's end): its admission record, when its first delta was
    fenced, and how it was fenced."""
    rec = {**admitted, **{k: delivery[k] for k in ("attempt", "attempt_id") if k in delivery}}
    rec.update({"released": False, "release_lost": True, "first_delta_fenced_at":
                delivery.get("at"), "ended_at": at, "failure_class": "release_lost",
                "fence": fence, "reclaimed_by": by})
    return rec


# --- an attempt's end -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EndFacts:
    released: bool
    upstream_finished: bool
    timed_out: bool  # the gate's own first-delta deadline ended it
    failed_on_purpose: bool  # the gate answered 503 itself
    http_status: int  # what the replica answered (0: nothing)
    elapsed_s: float  # since the attempt started
    first_delta_s: float


@dataclass(frozen=True, slots=True)
class EndPlan:
    handed_off: bool  # released: the guard ends it with the request
    # Ended before the first-delta limit and not by us: Envoy's per-try timeout (the only
    # uncertain end Envoy makes, just past first_delta_s) cannot be the cause, so the end is
    # confirmed (a reset, a refused connection, the client or Envoy gone): revoke before
    # Envoy's entry arrives; a retry waits for nothing but this transaction.
    revoke_now: bool
    # An end that may leave the replica decoding needs Envoy's word that it closed it.
    needs_cause: bool


def plan_end(f: EndFacts) -> EndPlan:
    if f.released:
        return EndPlan(handed_off=True, revoke_now=False, needs_cause=False)
    needs = (not f.failed_on_purpose or f.timed_out) and f.http_status in (0, 200)
    early = needs and not f.timed_out and f.elapsed_s < f.first_delta_s
    return EndPlan(handed_off=False, revoke_now=early, needs_cause=needs)


@dataclass(frozen=True, slots=True)
class Settled:
    failure_class: FailureClass
    fence: Fence
    cause: str  # Envoy's cause, "unknown" (no entry), or "n/a" (not asked)
    envoy_closed: bool
    # The replica's agent acknowledged the cancel (its evidence; decision 0034), and whether
    # that acknowledgement is what fenced the attempt (else it only adds evidence).
    engine_ack: Mapping[str, Any] | None = None
    fenced_by_ack: bool = False


def settle_end(f: EndFacts, plan: EndPlan, entry: str | None,
               cancel_ack: bool = True,
               engine_ack: Mapping[str, Any] | None = None) -> Settled:
    """Class and fence once Envoy's per-attempt entry arrived (`entry`) or did not (None).

    `cancel_ack` is policy.uncertain_source_liveness.wait_for: with
    `cancel_ack_or_lease_expiry`, Envoy's confirmed close is the cancel ack (docs/fencing.md);
    with `lease_expiry`, an uncertain end always waits for the lease.

    `engine_ack`: the replica's agent acknowledged the cancel (the engine let go, and the
    agent stops a fenced attempt's bytes at the source): under `cancel_ack_or_lease_expiry`
    an end that would wait for the lease is revoked on it (decision 0034).
    """
    cause, closed = "n/a", True
    if plan.needs_cause:
        cause, closed = (entry or "unknown"), entry is not None
    cls = classify(AttemptEnd(released=f.released, upstream_finished=f.upstream_finished,
                              failed_on_purpose=f.failed_on_purpose,
                              http_status=f.http_status, cause=cause, timed_out=f.timed_out))
    fence = Fence.REVOKE if plan.revoke_now else fence_for(cls, closed and cancel_ack)
    by_ack = engine_ack is not None and cancel_ack and fence is Fence.EXPIRE
    if by_ack:
        fence = Fence.REVOKE
    return Settled(cls, fence, cause, closed, engine_ack, by_ack)


def attempt_end(base: Mapping[str, Any], f: EndFacts, s: Settled, ended_at: float,
                lease_ttl_s: int) -> dict[str, Any]:
    rec = {**base, "released": False, "upstream_finished": f.upstream_finished,
           "http_status": f.http_status, "ended_at": ended_at,
           "failure_class": str(s.failure_class), "envoy_cause": s.cause,
           "fence": str(s.fence), "envoy_closed": s.envoy_closed}
    if s.fence is Fence.EXPIRE:
        rec["lease_expires_by"] = round(ended_at + lease_ttl_s, 3)
    if s.engine_ack is not None:
        # `cancel_ack`: the acknowledgement fenced it; `engine_ack`: evidence only.
        rec["cancel_ack" if s.fenced_by_ack else "engine_ack"] = dict(s.engine_ack)
    return rec


def pending_revoke(base: Mapping[str, Any], ended_at: float) -> dict[str, Any]:
    """The record written with an early revoke, before Envoy's entry completes it."""
    return {**base, "released": False, "ended_at": ended_at, "fence": str(Fence.REVOKE),
            "failure_class": "pending"}


def released_end(handoff: Mapping[str, Any], *, upstream_finished: bool, cause: str | None,
                 ended_at: float) -> tuple[FailureClass, dict[str, Any]]:
    """The record of an attempt the guard owned after release, when the request ended."""
    envoy = {"client": "client", "upstream": "upstream"}.get(cause or "", "unknown")
    cls = classify(AttemptEnd(
        released=True, upstream_finished=upstream_finished,
        failed_on_purpose=cause in ("in-band error", "malformed event"),
        http_status=200, cause=envoy, timed_out=cause == "stall"))
    rec = {k: v for k, v in handoff.items() if k != "lease_id"}
    rec.update({"ended_at": ended_at, "released": True, "upstream_finished": upstream_finished,
                "http_status": 200, "failure_class": str(cls), "envoy_cause": cause or "n/a",
                # After the first delta nothing else may run; the request's end deletes
                # `live` (docs/fencing.md).
                "fence": "ended_with_request"})
    return cls, rec


def end_trace(f: EndFacts, entry: str | None, cancel_ack: bool,
              s: Settled) -> dict[str, Any]:
    """What an attempt's trace keeps of its end: the inputs and the verdict."""
    out = {"facts": asdict(f), "entry": entry, "cancel_ack": cancel_ack,
           "failure_class": str(s.failure_class), "fence": str(s.fence), "cause": s.cause,
           "envoy_closed": s.envoy_closed}
    if s.engine_ack is not None:
        out["engine_ack"] = dict(s.engine_ack)
    return out


def replay_end(rec: Mapping[str, Any]) -> str | None:
    """Decide a recorded end again; None if the core decides as it did, else what differs."""
    f = EndFacts(**rec["facts"])
    ack = rec.get("engine_ack")
    s = settle_end(f, plan_end(f), rec.get("entry"), bool(rec.get("cancel_ack", True)),
                   ack if isinstance(ack, Mapping) else None)
    got = {"failure_class": str(s.failure_class), "fence": str(s.fence), "cause": s.cause,
           "envoy_closed": s.envoy_closed}
    want = {k: rec.get(k) for k in got}
    return None if got == want else f"end plan differs: recorded {want}, decided {got}"

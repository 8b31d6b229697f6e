"""The per-logical-request journal: what it holds, and how a record is assembled.

The record lives in etcd as a few keys, each written by exactly one party at one moment
(no read-modify-write, so no lost updates between the guard and the gates):

  meta            written once by the guard when the request is accepted
  attempts/<n>    written by the gate that admitted attempt n (and again when it ends)
  live            the current attempt id, attached to that attempt's lease: the fence
  delivery        created by the fence transaction when the first delta is released
  outcome         written by the guard when the downstream stream ends

`first_delta_sent` is the existence of `delivery`: it is recorded before the bytes leave.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from . import errors
from .errors import ErrorCode, GatewayError, bad_request, decode_interrupted


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


class Outcome(StrEnum):
    COMPLETED = "completed"
    UPSTREAM_DECODE_INTERRUPTED = "upstream_decode_interrupted"
    CLIENT_DISCONNECTED = "client_disconnected"
    UPSTREAM_FAILED = "upstream_failed"  # nothing delivered and no attempt succeeded
    REFUSED = "refused"  # a managed error before any delta
    # The processor serving the stream died (its session lease expired) before recording
    # an outcome; settled by whoever looks at the record next.
    GATEWAY_INTERRUPTED = "gateway_interrupted"


REQUEST_ID_RE = re.compile(r"^req_[0-9a-z]{26}$")
_B32 = "0123456789abcdefghjkmnpqrstvwxyz"  # Crockford alphabet, lower case


def _b32(data: bytes, n: int) -> str:
    """n base32 characters of `data` read as a big-endian number of exactly 5n bits.

    Longer input keeps its top 5n bits; shorter input is zero-padded at the top (a 16-byte
    ULID in 26 characters has two leading zero bits, as in the ULID spec).
    """
    value = int.from_bytes(data, "big")
    have, want = len(data) * 8, 5 * n
    if have > want:
        value >>= have - want
    return "".join(_B32[(value >> (5 * (n - 1 - i))) & 31] for i in range(n))


def request_id_for_key(tenant: str, idempotency_key: str) -> str:
    """A repeat with the same key (same tenant) lands on the same journal record."""
    digest = hashlib.sha256(tenant.encode() + b"\0" + idempotency_key.encode()).digest()
    return "req_" + _b32(digest, 26)


def new_request_id(now_ms: int | None = None, rand: bytes | None = None) -> str:
    """A time-ordered id (ULID layout) for requests without an Idempotency-Key."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    rnd = os.urandom(10) if rand is None else rand
    return "req_" + _b32(ms.to_bytes(6, "big") + rnd, 26)


def tenant_digest(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class JournalView:
    """The assembled record, as operators and the status endpoint see it."""

    request_id: str
    meta: Mapping[str, Any]
    attempts: tuple[Mapping[str, Any], ...] = ()
    live_attempt_id: str | None = None
    delivery: Mapping[str, Any] | None = None
    outcome: Mapping[str, Any] | None = None
    progress: Mapping[str, Any] | None = None
    guard: str | None = None  # the processor serving it; gone if that processor died
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def first_delta_sent(self) -> bool:
        return self.delivery is not None

    @property
    def phase(self) -> Phase:
        if self.outcome is not None:
            return Phase.DONE
        return Phase.DECODE if self.first_delta_sent else Phase.PREFILL

    @property
    def outcome_value(self) -> Outcome | None:
        if self.outcome is None:
            return None
        return Outcome(self.outcome["outcome"])

    @property
    def delivered_output_tokens(self) -> int:
        if self.outcome is not None:
            return int(self.outcome.get("delivered_output_tokens", 0))
        return 0

    def to_dict(self) -> dict[str, Any]:
        last = self.attempts[-1] if self.attempts else None
        max_attempts = int(self.meta.get("max_attempts", 1))
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "phase": str(self.phase),
            "attempt": int(last["attempt"]) if last else 0,
            "attempt_id": last["attempt_id"] if last else None,
            "first_delta_sent": self.first_delta_sent,
            "delivered_output_tokens": self.delivered_output_tokens,
            "model": self.meta.get("model"),
            "model_revision": (self.delivery or {}).get("model_revision")
            or (last or {}).get("model_revision"),
            "retry_budget": max(0, max_attempts - len(self.attempts)),
            "outcome": self.outcome["outcome"] if self.outcome else None,
            "cause": self.outcome.get("cause") if self.outcome else None,
            "stream": self.meta.get("stream"),
            "envoy_request_id": self.meta.get("envoy_request_id"),
            "created_at": self.meta.get("created_at"),
            "first_delta_at": (self.delivery or {}).get("at"),
            "finished_at": self.outcome.get("finished_at") if self.outcome else None,
            "attempts": [dict(a) for a in self.attempts],
        }
        for k in ("delivered_output_tokens_exact", "delivered_output_tokens_source",
                  "delivered_output_tokens_bound", "partial_output"):
            if self.outcome is not None and k in self.outcome:
                d[k] = self.outcome[k]
        err = self.client_error()
        if err is not None:
            d["error"] = err.body()["error"]
        return d

    def client_error(self) -> GatewayError | None:
        """The structured error the client is owed for this record, if any."""
        if self.outcome_value is Outcome.UPSTREAM_DECODE_INTERRUPTED:
            exact = (self.outcome or {}).get("delivered_output_tokens_exact")
            return decode_interrupted(self.request_id, self.delivered_output_tokens,
                                      exact if isinstance(exact, bool) else None)
        if self.outcome_value is Outcome.GATEWAY_INTERRUPTED:
            exact = bool((self.outcome or {}).get("delivered_output_tokens_exact", True))
            return errors.gateway_interrupted(self.request_id, self.first_delta_sent,
                                              self.delivered_output_tokens, exact)
        return None

    @property
    def orphaned(self) -> bool:
        """No outcome, no processor serving it, no live attempt: its processor died."""
        return self.outcome is None and self.guard is None and self.live_attempt_id is None


def orphan_outcome(view: JournalView, now: float) -> dict[str, Any]:
    """The outcome recorded for a request whose processor died mid-flight.

    Before the fence nothing was released, so "0 delivered" is exact. After it, the last
    progress checkpoint is a lower bound of what the client received: said so, not hidden.
    """
    if not view.first_delta_sent:
        return {"outcome": str(Outcome.GATEWAY_INTERRUPTED), "delivered_output_tokens": 0,
                "delivered_output_tokens_exact": True, "cause": "processor_lost",
                "finished_at": now}
    seen = int((view.progress or {}).get("delivered_output_tokens", 1))
    return {"outcome": str(Outcome.GATEWAY_INTERRUPTED),
            "delivered_output_tokens": max(1, seen),
            "delivered_output_tokens_exact": False, "cause": "processor_lost",
            "finished_at": now}


def repeat_answer(view: JournalView, request_digest: str = "",
                  key: str | None = None) -> GatewayError:
    """What a repeat of a request (same Idempotency-Key) gets: never a second run.

    A repeat must be the same request: a different one under the key is refused, before
    anything of the first is told. Records written before digests were kept have none and
    are answered as repeats.
    """
    rid = view.request_id
    kept = view.meta.get("request_digest")
    if kept and request_digest and kept != request_digest:
        return errors.idempotency_key_reused(rid, key or "")
    oc = view.outcome_value
    if oc is None:
        return errors.request_in_progress(rid, str(view.phase))
    if oc in (Outcome.UPSTREAM_DECODE_INTERRUPTED, Outcome.GATEWAY_INTERRUPTED):
        err = view.client_error()
        assert err is not None
        return errors.repeat_of(err)
    if oc is Outcome.COMPLETED:
        return errors.request_already_completed(rid, view.delivered_output_tokens)
    return errors.request_already_finished(rid, str(oc), view.delivered_output_tokens)


def validate_request_id(rid: str) -> GatewayError | None:
    if not REQUEST_ID_RE.match(rid):
        return bad_request(ErrorCode.INVALID_REQUEST_ID,
                           "request id must look like req_ followed by 26 base32 characters")
    return None


def assemble(request_id: str, entries: Iterable[tuple[str, bytes]],
             live: str | None) -> JournalView | None:
    """The view of one request from its keys under `req/<id>/` (name relative to that
    prefix, raw value) and its `live` value: what every journal store returns from get()."""
    meta: dict[str, Any] | None = None
    attempts: list[dict[str, Any]] = []
    delivery = outcome = progress = None
    guard: str | None = None
    for name, raw in entries:
        if name == "guard":
            guard = raw.decode()
            continue
        val = json.loads(raw)
        if name == "meta":
            meta = val
        elif name.startswith("attempts/"):
            attempts.append(val)
        elif name == "delivery":
            delivery = val
        elif name == "outcome":
            outcome = val
        elif name == "progress":
            progress = val
    if meta is None:
        return None
    attempts.sort(key=lambda a: int(a.get("attempt", 0)))
    return JournalView(request_id=request_id, meta=meta, attempts=tuple(attempts),
                       live_attempt_id=live, delivery=delivery, outcome=outcome,
                       progress=progress, guard=guard)

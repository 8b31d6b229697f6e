"""The per-logical-request journal: what it holds, and how a record is assembled.

The record lives in etcd as a few keys, each written by exactly one party at one moment
(no read-modify-write, so no lost updates between the guard and the gates):

  meta            written once by the guard when the request is accepted
  attempts/<n>    written by the gate that admitted attempt n (and again when it ends)
  live            the current attempt id, attached to that attempt's lease: the fence
  delivery        created by the fence transaction when the first delta is released
  outcome         written by the guard when the downstream stream ends
  history/<n>     run n's end, moved here when a repeat runs the request again, which is
                  allowed only while nothing was delivered (decision 0027)

`first_delta_sent` is the existence of `delivery`: it is recorded before the bytes leave.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
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
_B32_PAIRS = tuple(a + b for a in _B32 for b in _B32)  # 10 bits -> two characters
_PAIR_SHIFTS: dict[int, tuple[int, ...]] = {}  # per length: where each pair's bits start


def _b32(data: bytes, n: int) -> str:
    """n base32 characters of `data` read as a big-endian number of exactly 5n bits.

    Longer input keeps its top 5n bits; shorter input is zero-padded at the top (a 16-byte
    ULID in 26 characters has two leading zero bits, as in the ULID spec).
    """
    value = int.from_bytes(data, "big")
    have, want = len(data) * 8, 5 * n
    if have > want:
        value >>= have - want
    # Two characters per lookup, from a table of every pair (13 lookups for an id, not 26).
    shifts = _PAIR_SHIFTS.get(n)
    if shifts is None:
        shifts = _PAIR_SHIFTS[n] = tuple(range(want - want % 10 - 10, -1, -10))
    head = _B32[value >> (want - want % 10)] if n % 2 else ""  # an odd count's first
    return head + "".join([_B32_PAIRS[(value >> s) & 1023] for s in shifts])


def request_id_for_key(tenant: str, idempotency_key: str) -> str:
    """A repeat with the same key (same tenant) lands on the same journal record."""
    digest = hashlib.sha256(tenant.encode() + b"\0" + idempotency_key.encode()).digest()
    return "req_" + _b32(digest, 26)


def new_request_id(now_ms: int, rand: bytes) -> str:
    """A time-ordered id (ULID layout) for requests without an Idempotency-Key, from the time
    and the randomness the Ids port passes in (the core reads neither)."""
    return "req_" + _b32(now_ms.to_bytes(6, "big") + rand, 26)


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
    # The earlier runs of the key, each ended with nothing delivered (history/NNN, decision
    # 0027), oldest first; empty while the request has run once.
    history: tuple[Mapping[str, Any], ...] = ()

    @property
    def first_delta_sent(self) -> bool:
        return self.delivery is not None

    @property
    def runs(self) -> int:
        """How many times this logical request was started (1 + its re-runs)."""
        return 1 + len(self.history)

    @property
    def run_first_attempt(self) -> int:
        """The journal number of the current run's first attempt (attempts go on across
        runs: a re-run's first attempt follows the last attempt of the run before)."""
        if not self.history:
            return 1
        return int(self.history[-1].get("last_attempt", 0)) + 1

    @property
    def last_attempt(self) -> int:
        """The highest attempt number recorded (0: none)."""
        return max((int(a.get("attempt", 0)) for a in self.attempts), default=0)

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
            # max_attempts holds per run (per HTTP request): what is left of the current one.
            "retry_budget": max(0, max_attempts - sum(
                1 for a in self.attempts
                if int(a.get("attempt", 0)) >= self.run_first_attempt)),
            "outcome": self.outcome["outcome"] if self.outcome else None,
            "cause": self.outcome.get("cause") if self.outcome else None,
            "stream": self.meta.get("stream"),
            "envoy_request_id": self.meta.get("envoy_request_id"),
            "created_at": self.meta.get("created_at"),
            "first_delta_at": (self.delivery or {}).get("at"),
            "finished_at": self.outcome.get("finished_at") if self.outcome else None,
            "attempts": [dict(a) for a in self.attempts],
            "runs": self.runs,
            "history": [dict(h) for h in self.history],
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

    Before the fence nothing was released, so "0 delivered" is exact. After it, nobody
    knows: the last progress checkpoint is what the guard had handed to Envoy then, which
    may not all have left (decision 0025), and the stream may have gone on after it (to its
    very end: a complete answer whose outcome write was still waiting for etcd when the
    process died). The count is the checkpoint's (0 without one), said to be unknown.
    """
    if not view.first_delta_sent:
        return {"outcome": str(Outcome.GATEWAY_INTERRUPTED), "delivered_output_tokens": 0,
                "delivered_output_tokens_exact": True, "cause": "processor_lost",
                "finished_at": now}
    seen = int((view.progress or {}).get("delivered_output_tokens", 0))
    return {"outcome": str(Outcome.GATEWAY_INTERRUPTED),
            "delivered_output_tokens": max(0, seen),
            "delivered_output_tokens_exact": False,
            "delivered_output_tokens_bound": "unknown", "cause": "processor_lost",
            "finished_at": now}


def repeat_answer(view: JournalView, request_digest: str = "",
                  key: str | None = None) -> GatewayError:
    """What a repeat of a request (same Idempotency-Key) gets from the journal, when it does
    not run again (`answer_repeat` decides that first).

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


# --- a key whose request ended with nothing delivered runs again (decision 0027) ---------

# How many times one Idempotency-Key may be started: the first run and up to MAX_RUNS - 1
# re-runs. It bounds the record (each run adds its attempts and a history entry) and the
# prefills one key can cost; past it a repeat is answered from the journal, as before 0027.
MAX_RUNS = 5

# The ends after which a repeat may run the request again, provided nothing was delivered
# (no `delivery` key), no attempt may still be running (no `live` key) and the upstream did
# not refuse the request itself (a 4xx other than 408 and 429):
#   upstream_failed      no attempt produced an answer: a replica died, reset, answered
#                        5xx/429, timed out, or the gateway refused a further attempt
#                        (budget, retry cost, fingerprint, journal): the pool's failure;
#   client_disconnected  the client left before its first delta: its repeat is how it
#                        asks for the answer it never got;
#   gateway_interrupted  the processor serving it died before the fence (first_delta_sent
#                        false: nothing left the gateway);
#   refused              a managed error before any delta.
# Never: completed (answered 409 request_already_completed) and upstream_decode_interrupted
# (a delivered answer is never run twice): both are answered from the journal.
RERUNNABLE = frozenset({Outcome.UPSTREAM_FAILED, Outcome.CLIENT_DISCONNECTED,
                        Outcome.GATEWAY_INTERRUPTED, Outcome.REFUSED})
# Statuses that say the request itself was refused, not the pool: the same body gets the
# same answer, so a repeat is answered from the journal.
_REQUEST_FAULT = range(400, 500)
_NOT_REQUEST_FAULT = (408, 429)


def _status_of(cause: Any) -> int | None:
    """The HTTP status an outcome's cause names ("http 503"), if it names one."""
    if isinstance(cause, str) and cause.startswith("http "):
        try:
            return int(cause[5:])
        except ValueError:
            return None
    return None


def rerun_blocker(view: JournalView, max_runs: int = MAX_RUNS) -> str | None:
    """Why a repeat of this record may not run the request again; None when it may.

    The journal's own question: may this input go to a replica again? Only while nothing
    was delivered, nothing of the request may still run, and its last run ended for a
    reason that was not the request's own.
    """
    oc = view.outcome_value
    if oc is None:
        return "it has no outcome yet"
    if view.first_delta_sent:
        return "its first delta was sent"
    if oc not in RERUNNABLE:
        return f"it ended {oc}"
    outcome = view.outcome or {}
    if view.delivered_output_tokens > 0 or outcome.get("partial_output") is True:
        return "part of its answer was delivered"
    status = _status_of(outcome.get("cause"))
    if status in _REQUEST_FAULT and status not in _NOT_REQUEST_FAULT:
        return f"the upstream refused the request itself ({outcome.get('cause')})"
    if view.runs >= max_runs:
        return f"it ran {view.runs} times (at most {max_runs} per key)"
    if view.live_attempt_id is not None:
        return "an attempt of it may still be running"
    return None


@dataclass(frozen=True, slots=True)
class Rerun:
    """A repeat that runs again as the same logical request (same request_id, same body):
    its attempts go on from the last one recorded, and the re-open is conditioned on the
    outcome as read (`outcome`), so two repeats cannot both re-open it."""

    request_id: str
    run: int  # this run's number: 2 for the first re-run
    first_attempt: int  # the journal number of its first attempt
    ended_first_attempt: int  # the ended run's first attempt
    outcome: Mapping[str, Any]

    @property
    def attempt_offset(self) -> int:
        """Added to Envoy's attempt count (from 1 per HTTP request) to name an attempt."""
        return self.first_attempt - 1

    def history(self, at: float, gateway_id: str,
                envoy_request_id: str | None) -> dict[str, Any]:
        """`history/<run-1>`: the ended run, kept when the request runs again, so the status
        lookup shows every run and its end."""
        return {"run": self.run - 1, "first_attempt": self.ended_first_attempt,
                "last_attempt": self.first_attempt - 1, "outcome": dict(self.outcome),
                "reopened_at": at, "reopened_by": gateway_id,
                "next_envoy_request_id": envoy_request_id}


def answer_repeat(view: JournalView, request_digest: str = "", key: str | None = None,
                  max_runs: int = MAX_RUNS) -> GatewayError | Rerun:
    """A repeat of a known request (same Idempotency-Key): what it gets, or that it runs.

    A different request under the key is refused first (422). A record that ended with
    nothing delivered, for a reason not the request's own, runs again (`Rerun`); one whose
    attempt may still be running is told so (409, retryable) and runs once it is fenced.
    Everything else is answered from the journal (`repeat_answer`).
    """
    rid = view.request_id
    kept = view.meta.get("request_digest")
    if kept and request_digest and kept != request_digest:
        return errors.idempotency_key_reused(rid, key or "")
    why = rerun_blocker(view, max_runs)
    if why is None:
        return Rerun(request_id=rid, run=view.runs + 1, first_attempt=view.last_attempt + 1,
                     ended_first_attempt=view.run_first_attempt, outcome=view.outcome or {})
    if (view.live_attempt_id is not None and view.outcome is not None
            and rerun_blocker(replace(view, live_attempt_id=None), max_runs) is None):
        return errors.request_fence_pending(rid, _fence_expiry(view))
    return repeat_answer(view, request_digest, key)


def _fence_expiry(view: JournalView) -> float | None:
    """When the `fenced:` marker left in `live` lapses, if its attempt's record says."""
    live = view.live_attempt_id or ""
    aid = live[len("fenced:"):] if live.startswith("fenced:") else live
    for a in view.attempts:
        if a.get("attempt_id") == aid and isinstance(a.get("lease_expires_by"), int | float):
            return float(a["lease_expires_by"])
    return None


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
    history: list[dict[str, Any]] = []
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
        elif name.startswith("history/"):
            history.append(val)
        elif name == "delivery":
            delivery = val
        elif name == "outcome":
            outcome = val
        elif name == "progress":
            progress = val
    if meta is None:
        return None
    attempts.sort(key=lambda a: int(a.get("attempt", 0)))
    history.sort(key=lambda h: int(h.get("run", 0)))
    return JournalView(request_id=request_id, meta=meta, attempts=tuple(attempts),
                       live_attempt_id=live, delivery=delivery, outcome=outcome,
                       progress=progress, guard=guard, history=tuple(history))


def own_write(raw: bytes | None, attempt_id: str) -> bool:
    """A record found where a conditioned write of ours meant to put one (the fence's
    `delivery`) is our own earlier try, applied although its answer was lost, when it names
    this very attempt id (decision 0026)."""
    if raw is None:
        return False
    try:
        value = json.loads(raw)
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("attempt_id") == attempt_id


def delivered_by(raw: bytes | None) -> tuple[int, str] | None:
    """The attempt (journal number, id) a `delivery` record names; None if it names none
    readably (then nothing may be inferred from it)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    n, aid = value.get("attempt"), value.get("attempt_id")
    if not isinstance(n, int) or isinstance(n, bool) or not isinstance(aid, str) or not aid:
        return None
    return n, aid

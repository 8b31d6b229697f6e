"""The hand-off: the one record that crosses from a gate's stream to its request's guard.

At release the gate's attempt becomes the guard's to end (its record, its fence). What the
guard needs is frozen here, once: the attempt's record so far, the lease its `live` key hangs
on, and (in the same process only) the gate's trace up to the release. No live machine, no
mutable object crosses streams. The header form (`x-gateway-attempt-handoff`) carries every
field but the trace, so a guard in another process can still end the attempt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .records import one_shot

# json.dumps with options builds its encoder on every call; this one is built once (and
# its C encoder too: records.one_shot).
_COMPACT = one_shot(json.JSONEncoder(separators=(",", ":")))


@dataclass(frozen=True, slots=True)
class TraceSnapshot:
    """A machine's trace as it stood at one moment: what `core.replay.record` stores."""

    role: str
    request_id: str
    params: Mapping[str, Any]
    events: tuple[Mapping[str, Any], ...]
    decisions: tuple[str, ...]
    summary: Mapping[str, Any]
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class HandOff:
    """A released attempt, as the gate hands it to the guard of the same request."""

    attempt: int  # the journal's number (decision 0027)
    attempt_id: str
    replica: str | None
    gateway_id: str
    started_at: float  # wall clock, the attempt's start (before any fence wait)
    admitted_at: float
    waited_for_previous_s: float
    model_revision: str | None
    slow: bool
    lease_id: int  # the lease the attempt's `live` key hangs on (0: none known)
    # The gate's trace up to its release; in-process only (never in the header).
    trace: TraceSnapshot | None = None

    def record(self) -> dict[str, Any]:
        """The attempt's record so far (the admission's fields and the gate's timings)."""
        return {"attempt": self.attempt, "attempt_id": self.attempt_id,
                "replica": self.replica, "gateway_id": self.gateway_id,
                "started_at": self.started_at, "model_revision": self.model_revision,
                "admitted_at": self.admitted_at, "slow": self.slow,
                "waited_for_previous_s": self.waited_for_previous_s}

    def header(self) -> str:
        """The header form: the record and the lease id, as compact JSON."""
        return _COMPACT({**self.record(), "lease_id": self.lease_id})

    @classmethod
    def from_record(cls, rec: Mapping[str, Any], lease_id: int,
                    trace: TraceSnapshot | None = None) -> HandOff:
        return cls(attempt=int(rec["attempt"]), attempt_id=str(rec["attempt_id"]),
                   replica=_opt_str(rec.get("replica")),
                   gateway_id=str(rec.get("gateway_id", "")),
                   started_at=float(rec.get("started_at", 0.0)),
                   admitted_at=float(rec.get("admitted_at", 0.0)),
                   waited_for_previous_s=float(rec.get("waited_for_previous_s", 0.0)),
                   model_revision=_opt_str(rec.get("model_revision")),
                   slow=bool(rec.get("slow", False)), lease_id=lease_id, trace=trace)

    @classmethod
    def from_header(cls, value: str | None) -> HandOff | None:
        """The record a header carries; None if absent or unreadable."""
        if not value:
            return None
        try:
            rec = json.loads(value)
            return cls.from_record(rec, int(rec.get("lease_id") or 0))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)

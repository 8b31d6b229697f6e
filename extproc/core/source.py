"""The source fence: what the replica agent decides for one attempt it forwards (issue 26).

The agent (adapters/agent.py) sits between Envoy and the engine. Per tracked attempt it
forwards the engine's bytes only while the attempt is live (its `live/<rid>` key names it,
no cancel was written, and the local lease deadline has not passed), and once any of that
stops it stops forwarding at once, aborts the request at the engine, and acknowledges the
abort only on the engine's own evidence. This module is that decision as a table and a
small state object; it does no I/O and reads no clock (the adapter passes `now`).

  FORWARDING --fenced|cancel|lease_deadline|downstream_gone|engine_died--> ABORTING
  ABORTING   --evidence--> ACKED        ABORTING --no evidence within the bound--> NO_EVIDENCE
  FORWARDING --engine_ended--> ENDED (a normal end: nothing to abort, nothing to ack)

Forwarding holds back at most one unfinished SSE event, so that when the engine dies the
response can be ended well-formed: the events already sent, then one in-band error event
(the gateway's guard turns an error after delivery into `upstream_decode_interrupted`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from .families import CHAT, Family
from .sse import EventKind, SseDecoder

__all__ = ["TABLE", "Do", "Input", "LeaseView", "Phase", "SourceFence", "Why",
           "engine_error_event", "lease_margin"]


class Phase(enum.Enum):
    FORWARDING = "forwarding"
    ABORTING = "aborting"
    ACKED = "acked"
    NO_EVIDENCE = "no_evidence"
    ENDED = "ended"


class Why(enum.Enum):
    """Why forwarding stopped (the ack's `why`)."""

    FENCED = "fenced"
    CANCEL = "cancel"
    DOWNSTREAM_GONE = "downstream_gone"
    LEASE_DEADLINE = "lease_deadline"
    ENGINE_DIED = "engine_died"


class Input(enum.Enum):
    FENCED = "fenced"  # live/<rid> deleted or naming another attempt
    CANCEL = "cancel"  # cancel/<rid>/<aid> written
    LEASE_DEADLINE = "lease_deadline"  # now >= the local deadline
    DOWNSTREAM_GONE = "downstream_gone"  # Envoy's connection closed
    ENGINE_DIED = "engine_died"  # the engine's connection broke mid-response
    ENGINE_ENDED = "engine_ended"  # the engine's response ended well
    EVIDENCE = "evidence"  # the engine let go (its metrics, its connection)
    NO_EVIDENCE = "no_evidence"  # the bound passed without it


class Do(enum.Enum):
    NOTHING = "nothing"
    ABORT = "abort"  # stop forwarding, reset downstream, abort at the engine, confirm
    ABORT_QUIET = "abort_quiet"  # the same, downstream already gone: nothing to reset
    END_DOWNSTREAM = "end_downstream"  # engine died: in-band end or reset, then confirm
    WRITE_ACK = "write_ack"
    FINISH = "finish"  # forget the attempt


_STOPS = {Input.FENCED: Why.FENCED, Input.CANCEL: Why.CANCEL,
          Input.LEASE_DEADLINE: Why.LEASE_DEADLINE,
          Input.DOWNSTREAM_GONE: Why.DOWNSTREAM_GONE, Input.ENGINE_DIED: Why.ENGINE_DIED}


def _table() -> dict[tuple[Phase, Input], tuple[Phase, Do]]:
    t: dict[tuple[Phase, Input], tuple[Phase, Do]] = {}
    for phase in Phase:
        for inp in Input:
            t[(phase, inp)] = (phase, Do.NOTHING)  # default: too late to matter
    f = Phase.FORWARDING
    for inp in (Input.FENCED, Input.CANCEL, Input.LEASE_DEADLINE):
        t[(f, inp)] = (Phase.ABORTING, Do.ABORT)
    t[(f, Input.DOWNSTREAM_GONE)] = (Phase.ABORTING, Do.ABORT_QUIET)
    t[(f, Input.ENGINE_DIED)] = (Phase.ABORTING, Do.END_DOWNSTREAM)
    t[(f, Input.ENGINE_ENDED)] = (Phase.ENDED, Do.FINISH)
    t[(Phase.ABORTING, Input.EVIDENCE)] = (Phase.ACKED, Do.WRITE_ACK)
    t[(Phase.ABORTING, Input.NO_EVIDENCE)] = (Phase.NO_EVIDENCE, Do.FINISH)
    return t


# (phase, input) -> (next phase, what the adapter does). Every pair has a row.
TABLE: dict[tuple[Phase, Input], tuple[Phase, Do]] = _table()


def lease_margin(ttl_s: float) -> float:
    """docs/fencing.md: the local deadline ends `min(1 s, TTL/5)` before etcd's."""
    return min(1.0, ttl_s / 5.0)


@dataclass
class LeaseView:
    """One etcd lease as the agent sees it: a local deadline, refreshed once per TTL/3.

    `sent` is when the time-to-live question was sent (monotonic): etcd's answer is at
    least as old as that, so `sent + remaining - margin` can only be early, never late.
    Lease 0 (a key without a lease) has no deadline.
    """

    lease: int
    ttl_s: float
    deadline: float = float("inf")
    asked_at: float | None = None

    def refresh_due(self, now: float) -> bool:
        if self.lease == 0:
            return False
        return self.asked_at is None or now - self.asked_at >= self.ttl_s / 3.0

    def answered(self, sent: float, remaining_s: float) -> None:
        """etcd's time-to-live answer to a question sent at `sent`; <= 0: the lease is gone."""
        self.asked_at = sent
        if self.lease == 0:
            return
        self.deadline = (sent + remaining_s - lease_margin(self.ttl_s)
                         if remaining_s > 0 else sent)

    def valid(self, now: float) -> bool:
        return now < self.deadline


def engine_error_event(family: Family, message: str) -> bytes:
    """The in-band end of a stream whose engine died after content left: one ERROR event
    in the family's shape (what core/guard.py takes as an error after delivery) and, for
    the families that have one, the `[DONE]` sentinel."""
    err = {"type": "engine_interrupted", "message": message, "code": 502}
    if family.has_done:
        body = json.dumps({"error": err}, separators=(",", ":")).encode()
        return b"data: " + body + b"\n\ndata: [DONE]\n\n"
    body = json.dumps({"type": "error", "error": err}, separators=(",", ":")).encode()
    return b"event: error\ndata: " + body + b"\n\n"


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one engine chunk becomes: bytes to send now, whether the first content event
    just left, and the stop it caused (None: none)."""

    out: bytes
    first_content: bool
    stop: Do | None = None


@dataclass
class SourceFence:
    """One tracked attempt at the agent: its phase, what it forwarded, why it stopped."""

    request_id: str
    attempt_id: str
    lease: LeaseView
    family: Family = CHAT
    sse: bool = True  # a 200 text/event-stream response: events are classified and held
    phase: Phase = Phase.FORWARDING
    why: Why | None = None
    stopped_at: float | None = None
    content_events: int = 0  # CONTENT events forwarded
    bytes_forwarded: int = 0
    bytes_stopped: int = 0  # engine bytes not forwarded because of the fence
    first_content_at: float | None = None
    terminal_sent: bool = False  # the engine's own end ([DONE], an error event) went out
    _held: bytes = b""
    _decoder: SseDecoder | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._decoder = self.family.decoder() if self.sse else None

    def response(self, sse: bool, family: Family) -> None:
        """The engine's response headers arrived: classify its events (an SSE 200) or
        pass its body through unheld (anything else)."""
        self.sse, self.family = sse, family
        self._decoder = family.decoder() if sse else None

    @property
    def ended(self) -> bool:
        """The engine's response ended well (its connection may be re-used)."""
        return self.phase is Phase.ENDED

    # --- inputs ----------------------------------------------------------------------

    def step(self, inp: Input, now: float) -> Do:
        nxt, do = TABLE[(self.phase, inp)]
        if self.phase is Phase.FORWARDING and inp in _STOPS:
            self.why = _STOPS[inp]
            self.stopped_at = now
            self.bytes_stopped += len(self._held)
            self._held = b""
        self.phase = nxt
        return do

    def live_changed(self, value: bytes | None, now: float) -> Do:
        """`live/<rid>` now holds `value` (None: deleted): fenced unless it names us."""
        if value is not None and value == self.attempt_id.encode():
            return Do.NOTHING
        return self.step(Input.FENCED, now)

    def check(self, now: float) -> Do:
        """The local deadline, without a chunk (the adapter's timer)."""
        if self.phase is Phase.FORWARDING and not self.lease.valid(now):
            return self.step(Input.LEASE_DEADLINE, now)
        return Do.NOTHING

    def chunk(self, data: bytes, now: float) -> Chunk:
        """An engine chunk: forwarded only while FORWARDING and before the deadline; an
        SSE response's unfinished last event is held until its end arrives."""
        if self.phase is not Phase.FORWARDING:
            self.bytes_stopped += len(data)
            return Chunk(b"", False)
        if not self.lease.valid(now):
            do = self.step(Input.LEASE_DEADLINE, now)
            self.bytes_stopped += len(data)
            return Chunk(b"", False, do)
        dec = self._decoder
        if dec is None:
            self.bytes_forwarded += len(data)
            return Chunk(data, False)
        buf = self._held + data if self._held else data
        events = dec.feed(data)
        pending = len(dec.pending())
        out = buf[: len(buf) - pending] if pending else buf
        self._held = buf[len(buf) - pending:] if pending else b""
        first = False
        for e in events:
            if e.kind is EventKind.CONTENT:
                if self.content_events == 0:
                    first = True
                    self.first_content_at = now
                self.content_events += e.content_units
            elif e.kind is EventKind.DONE or e.kind is EventKind.ERROR:
                self.terminal_sent = True
        self.bytes_forwarded += len(out)
        return Chunk(out, first)

    def engine_ended(self, now: float) -> tuple[bytes, Do]:
        """The engine's response ended well: the held bytes (an unterminated last event
        counts, as the decoder's `finish` says) and FINISH."""
        if self.phase is not Phase.FORWARDING:
            return b"", Do.NOTHING
        tail, self._held = self._held, b""
        if self._decoder is not None:
            for e in self._decoder.finish():
                if e.kind is EventKind.CONTENT:
                    self.content_events += e.content_units
        self.bytes_forwarded += len(tail)
        return tail, self.step(Input.ENGINE_ENDED, now)

    def engine_died(self, now: float) -> tuple[bytes | None, Do]:
        """The engine's connection broke: (the bytes that end the response well-formed,
        None to reset the downstream connection as the engine's death would) and the do.

        In-band only after a content event left (before it the gateway may still re-run
        the attempt, so the death must look like one) and only for an SSE response; after
        the engine's own end ([DONE] or its error event) nothing is added."""
        if self.phase is not Phase.FORWARDING:
            return None, Do.NOTHING
        do = self.step(Input.ENGINE_DIED, now)
        if self.sse and self.terminal_sent:
            return b"", do
        if self.sse and self.content_events > 0:
            return engine_error_event(self.family, "the model server's connection broke "
                                      "mid-stream"), do
        return None, do

    def ack(self, now: float, evidence: str, wall: float) -> dict[str, object] | None:
        """The engine let go: the ack's JSON fields (None if not ABORTING)."""
        if self.phase is not Phase.ABORTING or self.stopped_at is None or self.why is None:
            return None
        self.step(Input.EVIDENCE, now)
        return {"at": wall, "evidence": evidence,
                "abort_ms": round((now - self.stopped_at) * 1000.0, 3),
                "why": self.why.value}

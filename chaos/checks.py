"""What one request's client saw, judged against the contract and the journal: pure.

No sockets, no clock, no files: `check(transcript)` takes what was sent, what came back,
the reference answer, the journal record and the repeats of its Idempotency-Key, and
returns the breaks. The harness's self-test (tests/chaos/test_checks.py) feeds it stitched,
non-prefix and disagreeing transcripts and expects each break. The SSE reading here is the
harness's own, deliberately not the gateway's decoder: a shared bug must not hide itself.

Break kinds (docs/chaos.md says what each means):
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

BREAK_KINDS: dict[str, str] = {
    "not_prefix": "the text the client received is not a prefix of the reference answer",
    "incomplete_answer": "an answer presented as complete whose text is not the whole "
                         "reference answer",
    "two_lifecycles": "more than one answer's lifecycle in one response (stitched)",
    "event_after_end": "events after the stream's terminal event",
    "no_terminal": "a stream that ended cleanly without a terminal event",
    "undocumented_cut": "a stream cut where no documented cut applies",
    "hang": "the request was not over within its bound",
    "undocumented_error": "an error answer that is not a documented gateway error "
                          "(no request id, unknown shape or code)",
    "terminal_disagrees": "our terminal event's fields disagree with what the client read",
    "record_missing": "the client was answered for a request the journal does not know",
    "record_unsettled": "the journal record has no outcome after the settle phase",
    "journal_disagrees": "the journal's outcome or delivered count disagrees with what the "
                         "client received",
    "rerun_after_delivery": "an attempt admitted or run after the first delivery",
    "key_stuck": "repeating the Idempotency-Key once etcd is whole does not bring the "
                 "request to an end",
    "repeat_disagrees": "a repeat's answer disagrees with the journal",
    "retryable_key_refused": "a keyed request that ended retryable with nothing delivered "
                             "is refused when repeated",
    "healthy_replica_passed_over": "a request without a fault of its own answered \"no "
                                   "replica served it\" while a replica was serving "
                                   "throughout (and its attempt budget was not spent on "
                                   "failing replicas)",
}
__doc__ = (__doc__ or "") + "".join(f"\n- `{k}`: {v}" for k, v in BREAK_KINDS.items()) + "\n"

FAMILIES = ("chat", "completions", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses", "messages": "/v1/messages"}
# Every code the gateway answers with itself (extproc/core/errors.py, docs/errors.md).
KNOWN_CODES = frozenset({
    "upstream_decode_interrupted", "gateway_interrupted", "upstream_unavailable",
    "upstream_timeout", "request_in_progress", "request_already_completed",
    "request_already_finished", "request_not_found", "invalid_request_id",
    "invalid_request_body", "request_body_too_large", "missing_idempotency_key",
    "invalid_idempotency_key", "idempotency_key_reused", "invalid_header",
    "attempt_not_admitted", "retry_budget_exhausted", "journal_unavailable",
    "upstream_response_too_large", "upstream_malformed_response", "attempt_fenced",
    "retry_too_expensive", "no_compatible_replica", "tool_call_in_progress",
    "tool_call_outcome_unknown", "tool_result_not_replayable",
})
REPEAT_CODES = frozenset({"request_in_progress", "request_already_completed",
                          "request_already_finished", "idempotency_key_reused"})
INTERRUPTED_OUTCOMES = frozenset({"upstream_decode_interrupted", "gateway_interrupted"})
# The answers that say no replica could serve the request (docs/errors.md): every attempt
# failed or none could start (`upstream_unavailable`), the first delta never came in time
# (`upstream_timeout`), no replica in the pool fits (`no_compatible_replica`), or the retry
# budget refused the retry that was needed (`retry_budget_exhausted`).
NO_REPLICA_CODES = frozenset({"upstream_unavailable", "upstream_timeout",
                              "no_compatible_replica", "retry_budget_exhausted"})


@dataclass(frozen=True)
class Spec:
    """What one client request sent."""

    family: str
    stream: bool
    prompt: str
    seed: int
    max_tokens: int
    key: str | None = None
    fault: str | None = None
    fault_attempt: str | None = None
    token_delay_ms: int = 0

    @property
    def path(self) -> str:
        return PATHS[self.family]

    def body(self) -> dict[str, Any]:
        b: dict[str, Any] = {"model": "demo-model", "stream": self.stream, "seed": self.seed}
        if self.family == "chat":
            b.update(messages=[{"role": "user", "content": self.prompt}],
                     max_tokens=self.max_tokens)
        elif self.family == "completions":
            b.update(prompt=self.prompt, max_tokens=self.max_tokens)
        elif self.family == "responses":
            b.update(input=self.prompt, max_output_tokens=self.max_tokens)
        else:
            b.update(messages=[{"role": "user", "content": self.prompt}],
                     max_tokens=self.max_tokens)
        return b

    def headers(self, with_fault: bool = True) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.key is not None:
            h["Idempotency-Key"] = self.key
        if with_fault and self.fault is not None:
            h["x-replica-fault"] = self.fault
            if self.fault_attempt is not None:
                h["x-replica-fault-attempt"] = self.fault_attempt
        if self.token_delay_ms:
            h["x-replica-token-delay-ms"] = str(self.token_delay_ms)
        return h

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "stream": self.stream, "prompt": self.prompt,
                "seed": self.seed, "max_tokens": self.max_tokens, "key": self.key,
                "fault": self.fault, "fault_attempt": self.fault_attempt,
                "token_delay_ms": self.token_delay_ms}


@dataclass
class Seen:
    """What the client received for one send: status, headers, the body as read."""

    status: int
    headers: dict[str, str]
    body: str
    transport_error: str | None = None
    started_at: float = 0.0  # wall clock
    elapsed_s: float = 0.0
    timed_out: bool = False

    @property
    def request_id(self) -> str:
        return self.headers.get("x-gateway-request-id", "")

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "headers": self.headers, "body": self.body,
                "transport_error": self.transport_error, "started_at": self.started_at,
                "elapsed_s": round(self.elapsed_s, 4), "timed_out": self.timed_out}


@dataclass(frozen=True)
class ReplicaTimeline:
    """One replica over a run (wall clock), as the harness recorded it."""

    name: str
    address: str  # host:port, as Envoy and the journal's attempts name it
    # The sampler's view: (time, the process alive and accepting connections), in order.
    samples: tuple[tuple[float, bool], ...]
    # The stack's own acts on it: (time, `restarted` | `held_down` | `released` | `frozen`
    # | `thawed`); `restarted` is the supervisor finding it dead (a request's kill fault).
    events: tuple[tuple[float, str], ...] = ()
    # Envoy's health_flags for it (admin /clusters), each time they changed.
    envoy: tuple[tuple[float, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address,
                "serving": [[round(a, 3), round(b, 3)] for a, b in serving_intervals(self)],
                "down": _runs(self.samples, False),
                "events": [[round(t, 3), e] for t, e in self.events],
                "envoy": [[round(t, 3), f] for t, f in self.envoy]}


# A supervisor restart at t: the process died at most this long before (its 50 ms poll,
# with slack for a loaded machine).
RESTART_DEATH_S = 0.25
# Two samples further apart than this leave the time between them unknown (not serving).
MAX_SAMPLE_GAP_S = 0.5
# Envoy's view counts when its sampled health_flags held this long either side of a
# request's start (two sampling rounds: a change between samples is seen late).
ENVOY_SLACK_S = 0.2


def _runs(samples: tuple[tuple[float, bool], ...], want: bool,
          max_gap_s: float = MAX_SAMPLE_GAP_S) -> list[list[float]]:
    """[first, last] of each run of consecutive samples equal to `want`, no gap wider
    than `max_gap_s` inside a run."""
    out: list[list[float]] = []
    prev: float | None = None
    for t, ok in samples:
        if ok is want:
            if out and prev is not None and out[-1][1] == prev and t - prev <= max_gap_s:
                out[-1][1] = t
            else:
                out.append([t, t])
        prev = t
    return [[round(a, 3), round(b, 3)] for a, b in out]


def serving_intervals(tl: ReplicaTimeline) -> list[tuple[float, float]]:
    """The closed intervals in which the replica is known to have been serving: every
    sample in them saw the process alive and accepting (no gap wider than
    MAX_SAMPLE_GAP_S), and no freeze, hold-down or supervisor restart fell in them."""
    up: list[tuple[float, float]] = []
    prev: float | None = None
    for t, ok in tl.samples:
        if ok and up and prev is not None and up[-1][1] == prev and t - prev <= \
                MAX_SAMPLE_GAP_S:
            up[-1] = (up[-1][0], t)
        elif ok:
            up.append((t, t))
        prev = t
    # Windows known not serving: frozen..thawed, held_down..released (open-ended when the
    # heal never came), and the moments before each restart.
    holes: list[tuple[float, float]] = []
    opened: dict[str, float] = {}
    for t, e in tl.events:
        if e in ("frozen", "held_down"):
            opened.setdefault(e, t)
        elif e in ("thawed", "released"):
            start = opened.pop("frozen" if e == "thawed" else "held_down", None)
            if start is not None:
                holes.append((start, t))
        elif e == "restarted":
            holes.append((t - RESTART_DEATH_S, t))
    holes += [(start, float("inf")) for start in opened.values()]
    for h0, h1 in holes:
        cut: list[tuple[float, float]] = []
        for a, b in up:
            if b < h0 or a > h1:
                cut.append((a, b))
                continue
            if a < h0:
                cut.append((a, h0))
            if b > h1:
                cut.append((h1, b))
        up = cut
    return [(a, b) for a, b in up if b > a]


@dataclass
class Availability:
    """Every replica's timeline over a run, and what the rule needs of the gateway's
    config: Envoy's health-check lag and the attempt budget."""

    replicas: tuple[ReplicaTimeline, ...]
    # (unhealthy + healthy threshold) x interval + timeout: how long Envoy's view of a
    # replica may lag behind its death or its restart (devkit Stack.health_settle_s).
    lag_s: float
    max_attempts: int
    serving: dict[str, list[tuple[float, float]]] = field(init=False)

    def __post_init__(self) -> None:
        self.serving = {r.address: serving_intervals(r) for r in self.replicas}

    def serving_throughout(self, t0: float, t1: float) -> list[str]:
        """The addresses of the replicas serving for the whole of [t0, t1]."""
        return [addr for addr, ivs in self.serving.items()
                if any(a <= t0 and t1 <= b for a, b in ivs)]

    def envoy_healthy_around(self, address: str, at: float,
                             slack_s: float = ENVOY_SLACK_S) -> bool:
        """Envoy's sampled view called the replica healthy over [at - slack, at + slack]:
        healthy at the last change before it, and no change within it."""
        tl = next((r for r in self.replicas if r.address == address), None)
        if tl is None:
            return False
        before = [f for t, f in tl.envoy if t <= at - slack_s]
        changed = any(at - slack_s < t <= at + slack_s for t, _ in tl.envoy)
        return bool(before) and before[-1] == "healthy" and not changed

    def healthy_for(self, t0: float, t1: float) -> dict[str, str]:
        """The replicas a request over [t0, t1] had to go to, each with why: serving
        since `lag_s` before it (Envoy's checks must have seen it by then), or serving
        throughout it while Envoy's own view called it healthy as it began."""
        out = {addr: f"serving since {self.lag_s:g} s before"
               for addr in self.serving_throughout(t0 - self.lag_s, t1)}
        for addr in self.serving_throughout(t0 - ENVOY_SLACK_S, t1):
            if addr not in out and self.envoy_healthy_around(addr, t0):
                out[addr] = "serving, and healthy in Envoy's view as it began"
        return out

    def name_of(self, address: str) -> str:
        return next((r.name for r in self.replicas if r.address == address), address)

    def envoy_flags_at(self, address: str, at: float) -> str:
        """Envoy's last sampled health_flags for the replica at or before `at`."""
        tl = next((r for r in self.replicas if r.address == address), None)
        last = "unknown"
        for t, f in (tl.envoy if tl is not None else ()):
            if t > at:
                break
            last = f
        return last

    def to_dict(self) -> dict[str, Any]:
        return {"lag_s": self.lag_s, "max_attempts": self.max_attempts,
                "replicas": [r.to_dict() for r in self.replicas]}


@dataclass
class Transcript:
    """One request, end to end, as the harness keeps it."""

    index: int
    spec: Spec
    seen: Seen
    reference: list[str]  # the reference answer's tokens, in order
    hang_bound_s: float
    request_id: str = ""  # from the header, or derived from the key
    record: dict[str, Any] | None = None
    record_status: int = 0  # the status lookup's HTTP status (0: not looked up)
    repeats: list[Seen] = field(default_factory=list)
    # A processor was killed or down while this request ran (its documented cuts apply).
    processor_fault: bool = False
    # A processor was killed at or after this request's start: its record may have been
    # settled `gateway_interrupted` by another reader (the guard's outcome write, or the
    # whole stream, died with the process; docs/failure-classes.md).
    processor_killed_after_start: bool = False
    # The journal's cluster for this request (its shard's) had lost its quorum while it
    # ran: nothing can be journaled, so an attempt failed at its fence or admission is the
    # documented cost (docs/failure-classes.md), not a replica passed over.
    journal_down: bool = False
    # The replicas' timeline over the run (shared by every transcript of it); None: the
    # `healthy_replica_passed_over` check is not made.
    availability: Availability | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "request_id": self.request_id,
                "spec": self.spec.to_dict(), "seen": self.seen.to_dict(),
                "reference": "".join(self.reference), "hang_bound_s": self.hang_bound_s,
                "record_status": self.record_status, "record": self.record,
                "repeats": [r.to_dict() for r in self.repeats],
                "processor_fault": self.processor_fault,
                "processor_killed_after_start": self.processor_killed_after_start,
                "journal_down": self.journal_down}


@dataclass(frozen=True)
class Break:
    kind: str
    detail: str

    def __post_init__(self) -> None:
        if self.kind not in BREAK_KINDS:
            raise ValueError(f"unknown break kind {self.kind!r}")


# --- reading what came back -------------------------------------------------------------


def parse_sse(text: str) -> list[tuple[str | None, Any]]:
    """Complete SSE events as (event name, data): JSON when it parses, else the string.

    An event counts once its blank line arrived: a cut in the middle of an event leaves
    that event out, as a client would.
    """
    out: list[tuple[str | None, Any]] = []
    text = text.replace("\r\n", "\n")
    blocks = text.split("\n\n")
    for block in blocks[:-1]:  # the last piece has no blank line after it yet
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith(":") or not line:
                continue
            fname, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if fname == "event":
                name = value
            elif fname == "data":
                data.append(value)
        if not data and name is None:
            continue
        raw = "\n".join(data)
        try:
            out.append((name, json.loads(raw)))
        except ValueError:
            out.append((name, raw))
    return out


def _error_object(obj: Any) -> dict[str, Any] | None:
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        err: dict[str, Any] = obj["error"]
        return err
    return None


@dataclass
class View:
    """A response read the way the contract describes it."""

    outcome: str  # complete | interrupted | cut | unended | error | hang
    units: list[str]
    starts: int = 0  # lifecycle starts (role event, response.created, message_start)
    ends: int = 0  # answer ends (finish_reason chunk, response.completed, message_stop)
    after_end: int = 0
    error: dict[str, Any] | None = None  # our terminal error / the error answer's object
    events: list[tuple[str | None, Any]] = field(default_factory=list)
    detail: str = ""

    @property
    def text(self) -> str:
        return "".join(self.units)


def _unary_text(family: str, obj: Any) -> tuple[str | None, str]:
    """The text of a non-streaming answer, or None with the reason it is not one."""
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    try:
        if family == "chat":
            if obj.get("error"):
                return None, "error in a 200 body"
            return str(obj["choices"][0]["message"]["content"] or ""), ""
        if family == "completions":
            if obj.get("error"):
                return None, "error in a 200 body"
            return str(obj["choices"][0]["text"] or ""), ""
        if family == "responses":
            if obj.get("error") or obj.get("status") in ("failed", "cancelled"):
                return None, f"status {obj.get('status')} / error in a 200 body"
            parts = [c.get("text", "") for item in obj.get("output") or []
                     for c in item.get("content") or [] if c.get("type") == "output_text"]
            return "".join(parts), ""
        if obj.get("type") == "error" or obj.get("error"):
            return None, "error in a 200 body"
        return "".join(c.get("text", "") for c in obj.get("content") or []
                       if c.get("type") == "text"), ""
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        return None, f"unreadable body: {type(e).__name__}: {e}"


def _stream_view(family: str, events: list[tuple[str | None, Any]]) -> View:
    v = View(outcome="unended", units=[], events=events)
    ended = False  # a terminal event (complete or ours) was seen
    done_seen = False
    for name, data in events:
        if ended and not (family in ("chat", "completions") and data == "[DONE]"
                          and not done_seen):
            v.after_end += 1
            continue
        if family in ("chat", "completions"):
            if data == "[DONE]":
                done_seen = True
                ended = True
                if v.outcome == "unended":
                    v.outcome = "complete" if v.ends else "unended"
                continue
            if v.outcome == "interrupted":  # only [DONE] may follow our error event
                v.after_end += 1
                continue
            err = _error_object(data)
            if err is not None:
                v.error = err
                v.outcome = "interrupted"
                continue
            if not isinstance(data, dict):
                v.detail = "a non-JSON event"
                continue
            for ch in data.get("choices") or []:
                delta = ch.get("delta") or {}
                if family == "chat" and delta.get("role"):
                    v.starts += 1
                piece = delta.get("content") if family == "chat" else ch.get("text")
                if piece:
                    v.units.append(str(piece))
                if ch.get("finish_reason") is not None:
                    v.ends += 1
            continue
        kind = name or (data.get("type") if isinstance(data, dict) else None)
        d = data if isinstance(data, dict) else {}
        if family == "responses":
            if kind == "response.created":
                v.starts += 1
            elif kind == "response.output_text.delta":
                if d.get("delta"):
                    v.units.append(str(d["delta"]))
            elif kind in ("response.completed", "response.incomplete"):
                v.ends += 1
                v.outcome, ended = "complete", True
            elif kind == "response.failed":
                v.error = _error_object(d.get("response") or {})
                v.outcome, ended = "interrupted", True
            elif kind == "error":
                v.error = d if "code" in d else _error_object(d)
                v.outcome, ended = "interrupted", True
        else:
            if kind == "message_start":
                v.starts += 1
            elif kind == "content_block_delta":
                text = (d.get("delta") or {}).get("text")
                if text:
                    v.units.append(str(text))
            elif kind == "message_stop":
                v.ends += 1
                v.outcome, ended = "complete", True
            elif kind == "error":
                v.error = _error_object(d)
                v.outcome, ended = "interrupted", True
    if family == "chat" and v.starts == 0 and v.units:
        v.starts = 1  # a stream without a role event still is one lifecycle
    if family == "completions":
        v.starts = max(v.ends, 1 if v.units else 0)
    if family in ("chat", "completions") and v.outcome == "interrupted" and not done_seen:
        v.detail = "our error event without the [DONE] after it"
    return v


def view(spec: Spec, seen: Seen) -> View:
    """Classify what the client received."""
    if seen.timed_out:
        v = view(spec, Seen(seen.status, seen.headers, seen.body, "timed out"))
        v.outcome = "hang"
        return v
    ctype = seen.headers.get("content-type", "")
    if seen.status != 200:
        try:
            obj = json.loads(seen.body) if seen.body else None
        except ValueError:
            obj = None
        return View(outcome="error", units=[], error=_error_object(obj),
                    detail="" if obj is not None else f"body not JSON: {seen.body[:120]!r}")
    if ctype.startswith("text/event-stream"):
        v = _stream_view(spec.family, parse_sse(seen.body))
        if seen.transport_error is not None:
            v.outcome = "cut"
        return v
    if seen.transport_error is not None:
        return View(outcome="cut", units=[], detail=seen.transport_error)
    try:
        obj = json.loads(seen.body)
    except ValueError:
        return View(outcome="unended", units=[], detail="200 body is not JSON")
    text, why = _unary_text(spec.family, obj)
    if text is None:
        return View(outcome="error", units=[], error=_error_object(obj), detail=why)
    return View(outcome="complete", units=[text] if text else [], starts=1, ends=1)


# --- the checks -------------------------------------------------------------------------


def _units_delivered(spec: Spec, v: View, reference: list[str]) -> int:
    """Content units the client read: events (streams; one token each from the demo),
    or the whole answer's tokens (a complete non-streaming body)."""
    if spec.stream:
        return len(v.units)
    return len(reference) if v.outcome == "complete" else 0


def _passed_through(seen: Seen, record: dict[str, Any] | None) -> bool:
    """A replica's own 429/503 answer that Envoy passed on after the last attempt was
    refused too: the journal says so (`upstream_failed`, `cause: http <status>`,
    docs/failure-classes.md, "overloaded")."""
    return (seen.status in (429, 503) and bool(seen.request_id) and record is not None
            and record.get("outcome") == "upstream_failed"
            and record.get("cause") == f"http {seen.status}")


def _check_answer(spec: Spec, seen: Seen, reference: list[str], hang_bound_s: float,
                  processor_fault: bool, out: list[Break], what: str = "",
                  record: dict[str, Any] | None = None) -> View:
    """The checks on one answer alone (a first send or a repeat that ran)."""
    v = view(spec, seen)
    ref = "".join(reference)
    pre = f"{what}: " if what else ""
    if not ref.startswith(v.text):
        out.append(Break("not_prefix", f"{pre}received {v.text!r}, reference {ref!r}"))
    if v.outcome == "complete" and v.text != ref:
        out.append(Break("incomplete_answer",
                         f"{pre}complete answer {v.text!r} is not the reference {ref!r}"))
    if v.starts > 1 or v.ends > 1:
        out.append(Break("two_lifecycles",
                         f"{pre}{v.starts} lifecycle starts, {v.ends} answer ends"))
    if v.after_end:
        out.append(Break("event_after_end", f"{pre}{v.after_end} event(s) after the end"))
    if v.outcome == "hang" or seen.elapsed_s > hang_bound_s:
        out.append(Break("hang", f"{pre}over after {seen.elapsed_s:.1f} s "
                                 f"(bound {hang_bound_s:.1f} s)"
                                 + (": the client gave up" if seen.timed_out else "")))
    if v.outcome == "unended":
        out.append(Break("no_terminal", f"{pre}status {seen.status}, ended without a "
                                        f"terminal event{': ' + v.detail if v.detail else ''}"))
    if v.outcome == "interrupted":
        err = v.error or {}
        n = _units_delivered(spec, v, reference)
        bad = []
        if err.get("code") not in INTERRUPTED_OUTCOMES:
            bad.append(f"code {err.get('code')!r}")
        if err.get("retryable") is not False:
            bad.append(f"retryable {err.get('retryable')!r}")
        if err.get("delivered_output_tokens") != n:
            bad.append(f"delivered_output_tokens {err.get('delivered_output_tokens')!r} "
                       f"but the client read {n}")
        if err.get("partial_output") is not (n > 0):
            bad.append(f"partial_output {err.get('partial_output')!r} after {n} units")
        if v.detail:
            bad.append(v.detail)
        if bad:
            out.append(Break("terminal_disagrees", pre + "; ".join(bad)))
    if v.outcome == "error":
        code = (v.error or {}).get("code")
        if processor_fault and seen.status in (500, 502, 503):
            pass  # Envoy fails closed while its processor is down (docs/errors.md)
        elif not seen.request_id:
            out.append(Break("undocumented_error",
                             f"{pre}status {seen.status} without x-gateway-request-id"
                             f" (body {seen.body[:160]!r})"))
        elif code not in KNOWN_CODES and not _passed_through(seen, record):
            out.append(Break("undocumented_error",
                             f"{pre}status {seen.status}, code {code!r}"
                             + (f" ({v.detail})" if v.detail else "")))
    return v


def _check_no_rerun(rec: dict[str, Any], out: list[Break]) -> None:
    """Nothing re-run after delivery: one released attempt, none admitted after the
    fence."""
    attempts = rec.get("attempts") or []
    released = [a for a in attempts if a.get("released")]
    if len(released) > 1:
        out.append(Break("rerun_after_delivery",
                         f"{len(released)} attempts released: "
                         f"{[a.get('attempt') for a in released]}"))
    fence_at = rec.get("first_delta_at")
    if isinstance(fence_at, int | float):
        for a in attempts:
            at = a.get("admitted_at") or a.get("started_at")
            if isinstance(at, int | float) and at > fence_at:
                out.append(Break("rerun_after_delivery",
                                 f"attempt {a.get('attempt')} admitted {at - fence_at:.3f} s "
                                 f"after the first delivery"))


def _check_record(t: Transcript, v: View, out: list[Break]) -> None:
    rec, spec = t.record, t.spec
    n = _units_delivered(spec, v, t.reference)
    err = v.error or {}
    if rec is None:
        if t.record_status == 404 and (n > 0 or v.outcome == "complete"):
            out.append(Break("record_missing",
                             f"the client read {n} units ({v.outcome}); lookup 404"))
        elif (t.record_status == 404 and v.outcome == "error" and not t.processor_fault
              and err.get("code") not in ("journal_unavailable", None)):
            # (With its processor killed, a request may die before its intake commits:
            # Envoy fails closed, nothing ran, there is nothing to record.)
            out.append(Break("record_missing",
                             f"answered {t.seen.status} {err.get('code')}; lookup 404"))
        return
    outcome = rec.get("outcome")
    delivered = rec.get("delivered_output_tokens")
    exact = rec.get("delivered_output_tokens_exact", True)
    sent = rec.get("first_delta_sent")
    if (outcome == "gateway_interrupted" and rec.get("cause") == "processor_lost"
            and rec.get("delivered_output_tokens_bound") == "unknown" and exact is False):
        # Settled by another reader after the processor died with the request unfinished
        # in etcd: the record says it does not know what left. Documented, and only with a
        # processor killed at or after the request's start.
        if not (t.processor_killed_after_start or t.processor_fault):
            out.append(Break("journal_disagrees", "settled processor_lost, but no processor "
                                                  "was killed after the request started"))
        _check_no_rerun(rec, out)
        return
    if outcome is None:
        out.append(Break("record_unsettled", f"phase {rec.get('phase')}, no outcome "
                                             f"(the client saw {v.outcome})"))
    bad: list[str] = []
    if v.outcome == "complete":
        if outcome is not None and outcome != "completed":
            bad.append(f"outcome {outcome} for a complete answer")
        if delivered != len(t.reference) and outcome is not None:
            bad.append(f"delivered_output_tokens {delivered}, the client read "
                       f"{len(t.reference)}")
        if not sent:
            bad.append("first_delta_sent false for a complete answer")
    elif v.outcome == "interrupted":
        if outcome is not None and outcome not in INTERRUPTED_OUTCOMES:
            bad.append(f"outcome {outcome} for an interrupted stream")
        if outcome is not None and delivered != n:
            bad.append(f"delivered_output_tokens {delivered}, the client read {n}")
    elif v.outcome == "cut":
        if outcome == "completed":
            bad.append("outcome completed for a cut stream")
        if outcome is not None and n > 0 and not sent:
            bad.append(f"first_delta_sent false, the client read {n} units")
        if (outcome is not None and isinstance(delivered, int) and exact is True
                and delivered != n):
            bad.append(f"delivered_output_tokens {delivered} (exact), the client "
                       f"read {n}")
    elif v.outcome == "error":
        # A client answered with another status than 200 got no attempt's release: a fence
        # that committed for one is taken back, by the retry's admission or with the
        # outcome (decision 0057), unless the processor died before either could.
        if (sent and t.seen.status != 200 and outcome is not None
                and not t.processor_fault):
            bad.append(f"first_delta_sent true, the client got {t.seen.status} "
                       f"{err.get('code')}: a release that never left is taken back")
        # A 200 whose body is an error keeps the fence (`first_delta_sent: true`) with
        # nothing delivered (decision 0025).
        elif sent and not (outcome in (None, "upstream_failed") and delivered == 0):
            bad.append(f"first_delta_sent true with {delivered} delivered and outcome "
                       f"{outcome}, the client got {t.seen.status} {err.get('code')} and "
                       f"no content")
        if outcome in ("completed", "upstream_decode_interrupted"):
            bad.append(f"outcome {outcome}, the client got {t.seen.status} {err.get('code')}")
        if "no journal record" in str(err.get("message", "")):
            bad.append(f"the answer says {err.get('message')!r}, the journal has the record")
    if bad:
        out.append(Break("journal_disagrees", "; ".join(bad)))
    _check_no_rerun(rec, out)


def _check_repeats(t: Transcript, v: View, out: list[Break]) -> None:
    if t.spec.key is None:
        return
    if not t.repeats:
        out.append(Break("key_stuck", "never repeated (the harness could not ask)"))
        return
    rec = t.record or {}
    delivered_before = bool(rec.get("first_delta_sent")) or v.outcome in (
        "complete", "interrupted") or (v.outcome == "cut" and len(v.units) > 0)
    first_err = v.error or {}
    for i, r in enumerate(t.repeats, 1):
        what = f"repeat {i}"
        rv = view(t.spec, r)
        code = (rv.error or {}).get("code")
        if r.status == 200:
            if delivered_before:
                out.append(Break("rerun_after_delivery",
                                 f"{what} ran again (200) though the first send was "
                                 f"{v.outcome} with delivery recorded"))
            _check_answer(t.spec, r, t.reference, t.hang_bound_s, False, out, what)
        elif r.status == 422:
            out.append(Break("repeat_disagrees", f"{what}: 422 {code} for the same body"))
        elif r.status == 409 and code == "request_already_completed":
            if rec and rec.get("outcome") != "completed":
                out.append(Break("repeat_disagrees",
                                 f"{what}: already completed, the record says "
                                 f"{rec.get('outcome')}"))
        elif r.status == 409 and code in INTERRUPTED_OUTCOMES:
            if rec and rec.get("outcome") not in INTERRUPTED_OUTCOMES:
                out.append(Break("repeat_disagrees",
                                 f"{what}: {code}, the record says {rec.get('outcome')}"))
            elif rec and (rv.error or {}).get("delivered_output_tokens") != \
                    rec.get("delivered_output_tokens"):
                out.append(Break("repeat_disagrees",
                                 f"{what}: delivered "
                                 f"{(rv.error or {}).get('delivered_output_tokens')}, "
                                 f"the record {rec.get('delivered_output_tokens')}"))
        elif (r.status == 409 and code == "request_already_finished"
              and not delivered_before and v.outcome == "error"
              and first_err.get("retryable") is True
              and first_err.get("partial_output") is not True):
            out.append(Break("retryable_key_refused",
                             f"{what}: request_already_finished (outcome "
                             f"{rec.get('outcome')}), though the first answer was "
                             f"{t.seen.status} {first_err.get('code')}, retryable, "
                             f"nothing delivered"))
    last = t.repeats[-1]
    lcode = (view(t.spec, last).error or {}).get("code")
    if last.status == 409 and lcode == "request_in_progress":
        out.append(Break("key_stuck", f"{len(t.repeats)} repeats, the last still 409 "
                                      f"request_in_progress"))
    elif last.status in (0, 500, 502, 503) and lcode in (None, "journal_unavailable"):
        out.append(Break("key_stuck", f"{len(t.repeats)} repeats, the last "
                                      f"{last.status} {lcode or last.transport_error}"))


def _reached(a: dict[str, Any]) -> bool:
    """An attempt that reached a replica: named one, ran a gate (not a connection Envoy
    could not open, `never_started`; not one its own gate refused)."""
    return bool(a.get("replica")) and a.get("failure_class") != "never_started" \
        and not a.get("refused")


def no_replica_verdict(t: Transcript, v: View | None = None) -> tuple[str, str] | None:
    """How a fault-free "no replica served it" answer is judged (None: not one, or no
    timeline): `no_record`, `no_replica_serving` (none served for the request's whole
    window extended back by Envoy's health-check lag), `budget_spent_on_failing_replicas`
    (every attempt the budget allows reached a replica that was failing), or
    `journal_down` (its journal cluster had no quorum while it ran: whatever failed, the
    gateway could not run it, decision 0060) or `passed_over` with the reason (docs/chaos.md,
    decision 0060). A replica the request
    had to go to: serving (alive, accepting, not frozen, not held down) for its whole
    window and either since Envoy's health-check lag before it, or with Envoy's own
    sampled view calling it healthy as the request began."""
    av = t.availability
    v = v or view(t.spec, t.seen)
    if av is None or t.spec.fault is not None or t.processor_fault or v.outcome != "error":
        return None
    code = (v.error or {}).get("code")
    if code not in NO_REPLICA_CODES:
        return None
    if t.record is None:  # record_missing says so; the attempts are what this rule reads
        return "no_record", ""
    if t.journal_down:
        return "journal_down", ""
    t0 = t.seen.started_at
    healthy = av.healthy_for(t0, t0 + t.seen.elapsed_s)
    if not healthy:
        return "no_replica_serving", ""
    attempts = [a for a in t.record.get("attempts") or [] if isinstance(a, dict)]
    reached = [a for a in attempts if _reached(a)]
    to_healthy = [a for a in reached if a.get("replica") in healthy]
    names = ", ".join(f"{av.name_of(h)} ({why}; Envoy: {av.envoy_flags_at(h, t0)})"
                      for h, why in healthy.items())
    tried = "; ".join(f"attempt {a.get('attempt')} -> {av.name_of(str(a.get('replica')))} "
                      f"{a.get('failure_class')}/{a.get('envoy_cause')}" for a in reached)
    if to_healthy:
        a = to_healthy[0]
        return "passed_over", (f"{t.seen.status} {code}: attempt {a.get('attempt')} went to "
                               f"{av.name_of(str(a.get('replica')))}, serving throughout, "
                               f"and failed ({a.get('failure_class')}/"
                               f"{a.get('envoy_cause')}); serving: {names}; attempts: "
                               f"{tried or 'none'}")
    if len(reached) < av.max_attempts:
        return "passed_over", (f"{t.seen.status} {code} with {len(reached)} of "
                               f"{av.max_attempts} attempts reaching a replica, while "
                               f"serving throughout: {names}; attempts: {tried or 'none'}")
    return "budget_spent_on_failing_replicas", ""


def _check_passed_over(t: Transcript, v: View, out: list[Break]) -> None:
    """`healthy_replica_passed_over`: a request with no fault of its own and no processor
    fault, answered with a "no replica served it" code, while at least one replica was
    serving for the request's whole window extended back by Envoy's health-check lag, and
    the record shows either an attempt sent to such a replica that failed, or fewer
    attempts reaching a replica than the budget (`max_attempts`): the budget was not spent
    on replicas that were failing."""
    verdict = no_replica_verdict(t, v)
    if verdict is not None and verdict[0] == "passed_over":
        out.append(Break("healthy_replica_passed_over", verdict[1]))


def check(t: Transcript) -> list[Break]:
    """Every break of one request, in a stable order."""
    out: list[Break] = []
    v = _check_answer(t.spec, t.seen, t.reference, t.hang_bound_s, t.processor_fault, out,
                      record=t.record)
    if v.outcome == "cut":
        # Documented: a reset after delivery; the processor down; or a released first
        # delta that never left, recorded as such (decision 0025: the fence kept, nothing
        # delivered).
        documented = len(v.units) > 0 or t.processor_fault or (
            t.record is not None and t.record.get("first_delta_sent") is True
            and t.record.get("outcome") in ("upstream_failed", *INTERRUPTED_OUTCOMES)
            and t.record.get("delivered_output_tokens") == 0)
        if not documented:
            out.append(Break("undocumented_cut",
                             f"status {t.seen.status}, cut after {len(v.units)} content "
                             f"units with no processor fault: {t.seen.transport_error}"))
    if v.outcome == "error" and v.error is not None \
            and v.error.get("code") in REPEAT_CODES:
        out.append(Break("undocumented_error",
                         f"a fresh key answered as a repeat: {v.error.get('code')}"))
    _check_record(t, v, out)
    _check_repeats(t, v, out)
    _check_passed_over(t, v, out)
    return out


def client_outcome(t: Transcript) -> str:
    """A short label of what the client got, for the summary table."""
    v = view(t.spec, t.seen)
    if v.outcome == "error":
        return f"error:{t.seen.status}:{(v.error or {}).get('code', '-')}"
    if v.outcome == "interrupted":
        return f"interrupted:{(v.error or {}).get('code', '-')}"
    if v.outcome == "cut":
        return "cut:after-content" if v.units else "cut:no-content"
    return v.outcome

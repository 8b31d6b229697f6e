"""The tool route's machine (core.tool_route): its rows one by one, then every interleaving
of store answers, timers, the tool server's response and the stream's close.

Pure: no I/O and no sleeps; time is what the events carry.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from extproc.core.credentials import digest
from extproc.core.errors import ErrorCode
from extproc.core.headers import ATTEMPT_SECRET
from extproc.core.tool_route import (
    FIRST_PAUSE_S,
    MAX_PAUSE_S,
    RECORD_BEFORE_END_S,
    ROWS,
    WAIT_TIMER,
    Action,
    Answer,
    AnswerReplay,
    Claim,
    ClaimAnswered,
    ContinueRequestBody,
    CredentialRead,
    Event,
    Forward,
    HeadersSeen,
    LedgerRead,
    PassBody,
    PassResponseHeaders,
    ProtocolViolation,
    ReadCredential,
    ReadLedger,
    Record,
    Recorded,
    RecordLater,
    RequestBodySeen,
    ResponseBodySeen,
    ResponseHeadersSeen,
    RouteState,
    StartTimer,
    StoreDown,
    StreamClosed,
    TimerFired,
    ToolRoute,
    UndoClaimLater,
    Why,
    arrows,
)

from .exhaustive import Chooser, every

RID = "req_" + "a" * 26
AID = "att_" + "b" * 26
SECRET = "s" * 43
KEY = f"{RID}:call_1"
WALL = 1_700_000_000.0


def hdrs(**kw: str) -> dict[str, str]:
    h = {":method": "POST", ":path": "/tools/demo_tool", "x-gateway-request-id": RID,
         "x-gateway-attempt-id": AID, "x-tool-call-id": "call_1", ATTEMPT_SECRET: SECRET}
    h.update(kw)
    return h


def route(wait_s: float = 1.0, max_result_bytes: int = 64) -> ToolRoute:
    return ToolRoute("/tools/", wait_s, max_result_bytes)


def claiming() -> tuple[ToolRoute, Claim]:
    m = route()
    assert m.handle(HeadersSeen(hdrs())) == [ReadCredential(RID, AID)]
    (claim,) = m.handle(CredentialRead(digest(SECRET), 7, WALL))
    assert isinstance(claim, Claim)
    return m, claim


def forwarding() -> ToolRoute:
    m, _ = claiming()
    (fwd,) = m.handle(ClaimAnswered(True, None, True, True, 5.0))
    assert fwd == Forward({"idempotency-key": KEY}, (ATTEMPT_SECRET,))
    return m


def done(body: bytes = b'{"ok":1}', **kw: Any) -> dict[str, Any]:
    e = {"key": KEY, "tool": "demo_tool", "state": "done", "attempt_id": AID, "status": 200,
         "headers": {"content-type": "application/json"},
         "body_b64": base64.b64encode(body).decode()}
    e.update(kw)
    return e


RUNNING = {"key": KEY, "tool": "demo_tool", "state": "running", "attempt_id": "att_other"}


def only(actions: list[Action]) -> Action:
    assert len(actions) == 1, actions
    return actions[0]


# --- the rows ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [{":method": "GET"}, {":path": "/tools/a/b"},
                                 {"x-gateway-request-id": "nope"}, {"x-tool-call-id": ""}])
def test_a_malformed_call_is_answered_and_reads_nothing(bad: dict[str, str]) -> None:
    m = route()
    a = only(m.handle(HeadersSeen(hdrs(**bad))))
    assert isinstance(a, Answer) and a.why is Why.BAD_REQUEST
    assert a.error.http_status in (400, 405) and m.state is RouteState.REFUSED


def test_no_secret_and_a_wrong_one_get_the_same_403_and_nothing_is_claimed() -> None:
    m = route()
    h = hdrs()
    del h[ATTEMPT_SECRET]
    none = only(m.handle(HeadersSeen(h)))
    assert isinstance(none, Answer) and none.why is Why.NO_CREDENTIAL
    bodies = set()
    for stored in (digest("x" * 43), None, SECRET):  # another secret, none, the raw secret
        m = route()
        m.handle(HeadersSeen(hdrs()))
        a = only(m.handle(CredentialRead(stored, 3, WALL)))
        assert isinstance(a, Answer) and a.why is Why.UNAUTHORIZED
        assert (a.error.http_status, a.error.code) == (403, ErrorCode.TOOL_CALL_UNAUTHORIZED)
        bodies.add(a.error.json_bytes())
    assert bodies == {none.error.json_bytes()}  # one answer: no oracle


def test_the_matching_credential_claims_with_its_revision_and_a_running_entry() -> None:
    m, claim = claiming()
    assert (claim.key, claim.request_id, claim.attempt_id, claim.credential_rev) == (
        KEY, RID, AID, 7)
    assert dict(claim.entry) == {"key": KEY, "tool": "demo_tool", "state": "running",
                                 "attempt_id": AID, "started_at": WALL}
    assert SECRET not in json.dumps(claim.entry) and SECRET not in repr(m.call)


def test_the_claimed_call_is_forwarded_without_its_secret() -> None:
    m = forwarding()
    assert m.state is RouteState.FORWARDING
    assert only(m.handle(RequestBodySeen())) == ContinueRequestBody()


def test_a_fenced_attempt_is_409() -> None:
    m, _ = claiming()
    a = only(m.handle(ClaimAnswered(False, done(), False, False, 5.0)))
    assert isinstance(a, Answer) and a.why is Why.FENCED
    assert (a.error.http_status, a.error.code) == (409, ErrorCode.ATTEMPT_FENCED)


def test_a_recorded_result_is_replayed_as_it_was() -> None:
    m, _ = claiming()
    a = only(m.handle(ClaimAnswered(False, done(b"hello"), True, False, 5.0)))
    assert isinstance(a, AnswerReplay) and m.state is RouteState.REPLAYED
    assert (a.replay.status, a.replay.body) == (200, b"hello")
    assert a.replay.headers == {"content-type": "application/json", "x-tool-replayed": "true"}


@pytest.mark.parametrize("existing,alive,code", [
    (done(truncated=True, size=99, sha256="ab"), False, ErrorCode.TOOL_RESULT_NOT_REPLAYABLE),
    (RUNNING, False, ErrorCode.TOOL_CALL_OUTCOME_UNKNOWN),  # its executor died
    ({**RUNNING, "state": "unknown", "reason": "gone"}, True, ErrorCode.TOOL_CALL_OUTCOME_UNKNOWN),
])
def test_a_repeat_without_a_result_to_give_is_refused(existing: dict[str, Any], alive: bool,
                                                      code: ErrorCode) -> None:
    m, _ = claiming()
    a = only(m.handle(ClaimAnswered(False, existing, True, alive, 5.0)))
    assert isinstance(a, Answer) and a.why is Why.REFUSED and a.error.code is code


def test_a_running_call_is_waited_for_on_timers_then_replayed() -> None:
    m, _ = claiming()
    assert only(m.handle(ClaimAnswered(False, RUNNING, True, True, 5.0))) == StartTimer(
        WAIT_TIMER, FIRST_PAUSE_S)
    assert only(m.handle(TimerFired(WAIT_TIMER))) == ReadLedger(KEY)
    assert only(m.handle(LedgerRead(RUNNING, True, 5.02))) == StartTimer(WAIT_TIMER, 0.02)
    assert only(m.handle(TimerFired(WAIT_TIMER))) == ReadLedger(KEY)
    # An entry that vanished keeps the last one seen; the executor's marker still says.
    assert only(m.handle(LedgerRead(None, True, 5.05))) == StartTimer(WAIT_TIMER, 0.04)
    m.handle(TimerFired(WAIT_TIMER))
    a = only(m.handle(LedgerRead(done(b"r"), False, 5.1)))
    assert isinstance(a, AnswerReplay) and a.replay.body == b"r"


def test_the_wait_is_bounded_by_wait_s_on_the_clock_the_events_carry() -> None:
    m = route(wait_s=1.0)
    m.handle(HeadersSeen(hdrs()))
    m.handle(CredentialRead(digest(SECRET), 7, WALL))
    pauses = []
    a = only(m.handle(ClaimAnswered(False, RUNNING, True, True, 100.0)))
    now = 100.0
    while isinstance(a, StartTimer):
        pauses.append(a.seconds)
        now += a.seconds + 0.001  # the read takes a moment
        m.handle(TimerFired(WAIT_TIMER))
        a = only(m.handle(LedgerRead(RUNNING, True, now)))
    assert isinstance(a, Answer) and a.why is Why.IN_PROGRESS
    assert a.error.code is ErrorCode.TOOL_CALL_IN_PROGRESS
    assert pauses[:5] == [0.01, 0.02, 0.04, 0.08, 0.16] and max(pauses) == MAX_PAUSE_S
    assert now <= 100.0 + 1.0 and now + MAX_PAUSE_S > 100.0 + 1.0 - 0.01


def test_with_no_wait_a_running_call_is_in_progress_at_once() -> None:
    m = route(wait_s=0.0)
    m.handle(HeadersSeen(hdrs()))
    m.handle(CredentialRead(digest(SECRET), 7, WALL))
    a = only(m.handle(ClaimAnswered(False, RUNNING, True, True, 1.0)))
    assert isinstance(a, Answer) and a.why is Why.IN_PROGRESS


@pytest.mark.parametrize("where", ["credential", "claim", "read"])
def test_an_unavailable_ledger_fails_closed(where: str) -> None:
    m = route()
    m.handle(HeadersSeen(hdrs()))
    if where != "credential":
        (claim,) = m.handle(CredentialRead(digest(SECRET), 7, WALL))
    if where == "read":
        m.handle(ClaimAnswered(False, RUNNING, True, True, 1.0))
        m.handle(TimerFired(WAIT_TIMER))
    out = m.handle(StoreDown("etcd away"))
    a = out[0]
    assert isinstance(a, Answer) and a.why is Why.UNAVAILABLE
    assert (a.error.http_status, a.error.code) == (503, ErrorCode.JOURNAL_UNAVAILABLE)
    # An unconfirmed claim may still apply: taken back (and only then).
    assert out[1:] == ([UndoClaimLater(KEY, claim.entry)] if where == "claim" else [])


def test_the_result_is_recorded_before_the_caller_sees_its_end() -> None:
    m = forwarding()
    hd = {":status": "201", "content-type": "application/json", "server": "x"}
    assert m.handle(ResponseHeadersSeen(hd, False, WALL + 1)) == [
        PassResponseHeaders((ATTEMPT_SECRET,))]
    assert m.handle(ResponseBodySeen(b'{"a":', False, WALL + 1)) == [PassBody(b'{"a":', False)]
    rec = only(m.handle(ResponseBodySeen(b"1}", True, WALL + 2)))
    assert isinstance(rec, Record) and rec.limit_s == RECORD_BEFORE_END_S
    assert rec.entry["state"] == "done" and rec.entry["status"] == 201
    assert rec.entry["finished_at"] == WALL + 2 and rec.entry["size"] == 7
    assert base64.b64decode(rec.entry["body_b64"]) == b'{"a":1}'
    assert rec.entry["headers"] == {"content-type": "application/json"}
    assert m.handle(Recorded(True)) == [PassBody(b"1}", True)]
    assert m.state is RouteState.RECORDED and m.handle(StreamClosed(WALL)) == []


def test_a_record_that_did_not_land_goes_on_in_the_background() -> None:
    m = forwarding()
    m.handle(ResponseHeadersSeen({":status": "200"}, False, WALL))
    rec = only(m.handle(ResponseBodySeen(b"x", True, WALL)))
    assert isinstance(rec, Record)
    assert m.handle(Recorded(False)) == [RecordLater(KEY, rec.entry, "record a tool result"),
                                         PassBody(b"x", True)]


def test_headers_that_end_the_response_record_it() -> None:
    m = forwarding()
    out = m.handle(ResponseHeadersSeen({":status": "204"}, True, WALL))
    assert out[0] == PassResponseHeaders((ATTEMPT_SECRET,))
    assert isinstance(out[1], Record) and out[1].entry["status"] == 204
    assert m.handle(Recorded(True)) == []


def test_a_result_over_the_limit_is_recorded_by_digest() -> None:
    m = ToolRoute("/tools/", 1.0, 4)
    m.handle(HeadersSeen(hdrs()))
    m.handle(CredentialRead(digest(SECRET), 7, WALL))
    m.handle(ClaimAnswered(True, None, True, True, 1.0))
    m.handle(ResponseHeadersSeen({":status": "200"}, False, WALL))
    rec = only(m.handle(ResponseBodySeen(b"123456", True, WALL)))
    assert isinstance(rec, Record) and rec.entry["truncated"] is True
    assert "body_b64" not in rec.entry


def test_a_call_closed_mid_result_is_recorded_unknown() -> None:
    m = forwarding()
    m.handle(ResponseHeadersSeen({":status": "200"}, False, WALL))
    m.handle(ResponseBodySeen(b"part", False, WALL))
    rec = only(m.handle(StreamClosed(WALL + 3)))
    assert isinstance(rec, Record) and rec.entry["state"] == "unknown"
    assert rec.entry["finished_at"] == WALL + 3 and m.state is RouteState.UNKNOWN
    assert m.handle(Recorded(True)) == [] and m.handle(StreamClosed(WALL)) == []


def test_a_stream_gone_while_claiming_takes_the_claim_back() -> None:
    m, claim = claiming()
    assert m.handle(StreamClosed(WALL)) == [UndoClaimLater(KEY, claim.entry)]
    # Its answer, if it still comes, changes nothing: the take-back is on its way.
    assert m.handle(ClaimAnswered(True, None, True, True, 1.0)) == []


def test_a_stream_gone_while_recording_keeps_recording() -> None:
    m = forwarding()
    m.handle(ResponseHeadersSeen({":status": "200"}, False, WALL))
    rec = only(m.handle(ResponseBodySeen(b"x", True, WALL)))
    assert isinstance(rec, Record)
    assert m.handle(StreamClosed(WALL)) == [RecordLater(KEY, rec.entry, "record a tool result")]


def test_a_pair_with_no_row_is_a_protocol_violation() -> None:
    m = route()
    with pytest.raises(ProtocolViolation):
        m.handle(ResponseBodySeen(b"x", False, WALL))


def test_arrows_draw_every_state_reached() -> None:
    drawn = "\n".join(arrows())
    for st in RouteState:
        if st is not RouteState.NEW:
            assert f"> {st}" in drawn or f"| {st}" in drawn, st
    assert {s for s, _ in ROWS} == set(RouteState)


# --- properties: every interleaving -----------------------------------------------------


@dataclass
class World(Chooser):
    """Plays the store, the timers, the tool server and the stream, one choice at a time."""

    choices: list[int]
    at: int = 0
    mono: float = 10.0
    log: list[tuple[Event, list[Action]]] = field(default_factory=list)
    closed: bool = False

    def answer(self, a: Action) -> Event | None:
        if isinstance(a, ReadCredential):
            opts: list[Callable[[], Event]] = [
                lambda: CredentialRead(digest(SECRET), 7, WALL),
                lambda: CredentialRead(digest("z" * 43), 7, WALL),
                lambda: CredentialRead(None, 0, WALL),
                lambda: StoreDown("away")]
        elif isinstance(a, Claim):
            opts = [lambda: ClaimAnswered(True, None, True, True, self.mono),
                    lambda: ClaimAnswered(False, None, False, False, self.mono),
                    lambda: ClaimAnswered(False, done(), True, False, self.mono),
                    lambda: ClaimAnswered(False, RUNNING, True, True, self.mono),
                    lambda: ClaimAnswered(False, RUNNING, True, False, self.mono),
                    lambda: StoreDown("away")]
        elif isinstance(a, ReadLedger):
            self.mono += 0.05
            opts = [lambda: LedgerRead(done(), False, self.mono),
                    lambda: LedgerRead(RUNNING, True, self.mono),
                    lambda: LedgerRead(None, True, self.mono),
                    lambda: LedgerRead(RUNNING, False, self.mono),
                    lambda: StoreDown("away")]
        elif isinstance(a, StartTimer):
            self.mono += a.seconds
            return TimerFired(a.kind)
        elif isinstance(a, Record) and a.limit_s is not None:
            opts = [lambda: Recorded(True), lambda: Recorded(False)]
        elif isinstance(a, Record):
            return Recorded(True)
        else:
            return None
        return opts[self.choose(len(opts))]()

    def response(self) -> list[Event]:
        """What the tool server sends once the call is forwarded."""
        shape = self.choose(3)
        if shape == 0:
            return [ResponseHeadersSeen({":status": "200"}, True, WALL)]
        chunks = [ResponseBodySeen(b"ab", False, WALL)] * (shape - 1)
        return [ResponseHeadersSeen({":status": "200"}, False, WALL), *chunks,
                ResponseBodySeen(b"c", True, WALL)]


ENVOYS = (ResponseHeadersSeen, ResponseBodySeen, RequestBodySeen)


def play(world: World) -> ToolRoute:
    m = route(wait_s=0.3)
    queue: list[Event] = [HeadersSeen(hdrs())]
    while queue:
        ev = queue.pop(0)
        if not world.closed and world.log and world.choose(2):
            # The stream goes now; the answer in flight (if any) still comes after it.
            # Envoy sends nothing after it; a store answer or a timer in flight still comes.
            world.closed = True
            queue = [e for e in [ev, *queue] if not isinstance(e, ENVOYS)]
            ev = StreamClosed(WALL)
        acts = m.handle(ev)
        world.log.append((ev, acts))
        for a in acts:
            nxt = world.answer(a)
            if nxt is not None:
                queue.append(nxt)
        if not queue and not world.closed and m.state is RouteState.FORWARDING:
            queue += world.response()
    if not world.closed:
        world.closed = True
        world.log.append((StreamClosed(WALL), m.handle(StreamClosed(WALL))))
    return m


def every_run() -> list[World]:
    return every(World, play)


RUNS = every_run()


def test_the_interleavings_are_many_and_none_breaks_the_table() -> None:
    # Every run above completed (no pair without a row) and every state was visited.
    assert len(RUNS) > 150
    seen = set()
    for w in RUNS:
        m = route(wait_s=0.3)
        for ev, _ in w.log:
            m.handle(ev)
            seen.add(m.state)
    assert seen == set(RouteState) - {RouteState.NEW}


def test_every_run_answers_the_caller_at_most_once_and_always_if_it_stayed() -> None:
    for w in RUNS:
        answers = [a for _, acts in w.log for a in acts
                   if isinstance(a, (Forward, Answer, AnswerReplay))]
        early_close = any(isinstance(ev, StreamClosed) for ev, _ in w.log[:-1])
        assert len(answers) <= 1, w.choices
        assert early_close or len(answers) == 1, w.choices


def test_nothing_is_forwarded_or_claimed_without_the_live_attempts_credential() -> None:
    for w in RUNS:
        matched = claimed = False
        for ev, acts in w.log:
            if isinstance(ev, CredentialRead) and acts and isinstance(acts[0], Claim):
                matched = ev.stored == digest(SECRET)
                assert matched, w.choices
            if isinstance(ev, ClaimAnswered) and ev.claimed and acts:
                claimed = True
            for a in acts:
                if isinstance(a, (Claim, ReadLedger)):
                    assert matched, w.choices
                if isinstance(a, Forward):
                    assert matched and claimed, w.choices
                assert SECRET not in repr(a), w.choices


def test_a_claim_that_may_have_applied_is_never_left_running() -> None:
    for w in RUNS:
        acts = [a for _, aa in w.log for a in aa]
        if not any(isinstance(a, Claim) for a in acts):
            continue
        # The claim's own answer: the event after the one that sent it.
        i = next(i for i, (_, aa) in enumerate(w.log) if any(isinstance(a, Claim) for a in aa))
        answer = w.log[i + 1][0] if i + 1 < len(w.log) else None
        later = [ev for ev, _ in w.log[i + 1:]]
        may_apply = (not any(isinstance(ev, ClaimAnswered) for ev in later)
                     or isinstance(answer, StoreDown)
                     or any(isinstance(ev, ClaimAnswered) and ev.claimed for ev in later))
        forwarded = any(isinstance(a, Forward) for a in acts)
        if not may_apply:
            continue
        settled = [a for a in acts if isinstance(a, (Record, RecordLater, UndoClaimLater))]
        assert settled, w.choices
        if forwarded:
            # What it executed is recorded: its result, or unknown.
            assert any(isinstance(a, (Record, RecordLater)) for a in settled), w.choices
        else:
            assert any(isinstance(a, UndoClaimLater) for a in settled), w.choices


def test_the_last_chunk_reaches_the_caller_only_after_its_record_answered() -> None:
    for w in RUNS:
        recorded = False
        for ev, acts in w.log:
            recorded = recorded or isinstance(ev, Recorded)
            for a in acts:
                if isinstance(a, PassBody) and a.end_of_stream:
                    assert recorded, w.choices


def test_the_wait_stays_within_wait_s() -> None:
    for w in RUNS:
        waited = sum(a.seconds for _, acts in w.log for a in acts if isinstance(a, StartTimer))
        assert waited <= 0.3, w.choices


def test_a_trace_re_decides_the_same_way() -> None:
    for w in RUNS[::7]:
        m = route(wait_s=0.3)
        assert [m.handle(ev) for ev, _ in w.log] == [acts for _, acts in w.log], w.choices

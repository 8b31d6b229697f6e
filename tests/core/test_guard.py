"""The guard's rows for the intake order (decision 0021), the take-over of a hand-off and a
response that is not (yet) ours; then every interleaving of the intake's answer, Envoy's
response messages, the stream's close and Envoy's word on why it ended.

Pure: no I/O, no sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from extproc.core.errors import journal_unavailable, request_in_progress
from extproc.core.events import (
    Accepted,
    Action,
    AnswerBody,
    AwaitCause,
    AwaitIntake,
    CauseLearned,
    Event,
    Finish,
    IntakeFailed,
    OpenIntake,
    PassAside,
    PassHeaders,
    Refuse,
    RegisterIntake,
    RequestBodySeen,
    RequestHeadersSeen,
    RequestOpened,
    ResponseBody,
    ResponseHeaders,
    Send,
    State,
    StreamClosed,
    TakeOver,
)
from extproc.core.guard import GuardMachine
from extproc.core.journal import Outcome
from extproc.core.replay import event_from_record

RID = "req_0123456789abcdefghjkmnpqrs"
SSE = "text/event-stream"
HANDOFF = '{"attempt":1,"attempt_id":"att_x","lease_id":7}'
REFUSED = request_in_progress(RID, "prefill")


def body_seen(keyed: bool) -> tuple[GuardMachine, list[Action]]:
    m = GuardMachine.new(RID, 15.0, at_request=True)
    assert m.handle(RequestHeadersSeen("generation")) == []
    return m, m.handle(RequestBodySeen(None, keyed=keyed))


def test_a_key_less_body_goes_on_while_its_intake_commits_and_gates_wait_for_it() -> None:
    m, acts = body_seen(keyed=False)
    assert acts == [OpenIntake(), RegisterIntake(), AnswerBody(), AwaitIntake()]
    assert m.state is State.GUARD_OPENING
    assert m.handle(RequestOpened(True)) == [Accepted()]
    assert m.state is State.GUARD_WAITING and m.accepted


def test_a_keyed_body_waits_for_its_intake_before_going_on() -> None:
    m, acts = body_seen(keyed=True)
    assert acts == [OpenIntake(), AwaitIntake()]
    assert m.handle(RequestOpened(True)) == [Accepted(), AnswerBody()]
    assert m.state is State.GUARD_WAITING


def test_a_keyed_repeat_is_answered_by_the_guard() -> None:
    m, _ = body_seen(keyed=True)
    assert m.handle(RequestOpened(False, REFUSED)) == [Refuse(REFUSED)]
    assert m.state is State.GUARD_ASIDE and not m.accepted


def test_a_key_less_intake_that_fails_is_answered_by_its_gate() -> None:
    err = journal_unavailable(RID)
    m, _ = body_seen(keyed=False)
    assert m.handle(RequestOpened(False, err)) == [IntakeFailed(err)]
    assert m.state is State.GUARD_ASIDE
    # The gate's error comes back through the guard's response path, untouched.
    assert m.handle(ResponseHeaders(503, "application/json", ours=True)) == [PassAside()]
    assert m.handle(ResponseBody(b"{}", True)) == [Send(b"{}", True)]
    assert m.handle(StreamClosed()) == []


def test_the_released_attempt_is_taken_over_before_its_headers_go_on() -> None:
    m, _ = body_seen(keyed=False)
    m.handle(RequestOpened(True))
    assert m.handle(ResponseHeaders(200, SSE, handoff=HANDOFF)) == [TakeOver(HANDOFF),
                                                                     PassHeaders()]


@pytest.mark.parametrize("status,handoff", [(200, None), (503, HANDOFF), (429, None)])
def test_no_take_over_without_a_released_attempt(status: int, handoff: str | None) -> None:
    m, _ = body_seen(keyed=False)
    m.handle(RequestOpened(True))
    acts = m.handle(ResponseHeaders(status, SSE, handoff=handoff))
    assert not any(isinstance(a, TakeOver) for a in acts)


def test_a_response_that_is_not_a_request_of_ours_passes_and_is_not_traced() -> None:
    m = GuardMachine.new(RID, 15.0, at_request=True)
    m.handle(RequestHeadersSeen("passthrough"))
    assert m.handle(ResponseHeaders(200, "application/json", handoff=HANDOFF)) == [PassAside()]
    assert m.handle(ResponseBody(b"x" * 100, True)) == [Send(b"x" * 100, True)]
    assert len(m.trace) == 1  # the headers' classification only


def test_the_new_fields_survive_a_trace() -> None:
    m, _ = body_seen(keyed=True)
    m.handle(RequestOpened(False, REFUSED))
    evs = [event_from_record(r) for r in m.trace]
    assert evs[1] == RequestBodySeen(None, keyed=True)
    opened = evs[2]
    assert isinstance(opened, RequestOpened) and opened.error is not None
    assert (opened.error.code, opened.error.http_status) == (REFUSED.code, REFUSED.http_status)
    m2, _ = body_seen(keyed=False)
    m2.handle(RequestOpened(True))
    m2.handle(ResponseHeaders(200, SSE, handoff=HANDOFF))
    assert event_from_record(m2.trace[-1]) == ResponseHeaders(200, SSE, handoff=HANDOFF)


# --- properties: every interleaving -----------------------------------------------------


class NeedChoice(Exception):
    def __init__(self, n: int) -> None:
        self.n = n


@dataclass
class Run:
    keyed: bool
    accept: bool
    choices: list[int]
    at: int = 0
    log: list[tuple[Event, list[Action]]] = field(default_factory=list)

    def choose(self, n: int) -> int:
        if self.at == len(self.choices):
            raise NeedChoice(n)
        c = self.choices[self.at]
        self.at += 1
        return c


def play(run: Run) -> GuardMachine:
    """After the body: the intake's answer, Envoy's response (headers, two body messages)
    and the stream's close come in any order; Envoy's word comes when it is awaited."""
    m, acts = body_seen(run.keyed)
    run.log.append((RequestBodySeen(None, keyed=run.keyed), acts))
    answered = closed = awaiting_cause = False
    headers = bodies = 0
    while True:
        options: list[Event] = []
        if not answered:
            options.append(RequestOpened(True) if run.accept else RequestOpened(False, REFUSED))
        if not closed:
            if not headers:
                options.append(ResponseHeaders(200, SSE, handoff=HANDOFF))
            elif bodies < 2:
                options.append(ResponseBody(b"", bodies == 1))
            options.append(StreamClosed())
        if awaiting_cause:
            options.append(CauseLearned("client", 0))
        if not options:
            break
        ev = options[run.choose(len(options))]
        if isinstance(ev, RequestOpened):
            answered = True
        elif isinstance(ev, ResponseHeaders):
            headers = 1
        elif isinstance(ev, ResponseBody):
            bodies += 1
        elif isinstance(ev, StreamClosed):
            closed = True
        elif isinstance(ev, CauseLearned):
            awaiting_cause = False
        acts = m.handle(ev)
        awaiting_cause = awaiting_cause or any(isinstance(a, AwaitCause) for a in acts)
        run.log.append((ev, acts))
    return m


def every_run() -> list[Run]:
    runs: list[Run] = []
    for keyed in (False, True):
        for accept in (False, True):
            stack: list[list[int]] = [[]]
            while stack:
                prefix = stack.pop()
                r = Run(keyed, accept, list(prefix))
                try:
                    play(r)
                except NeedChoice as need:
                    stack += [[*prefix, i] for i in range(need.n)]
                    continue
                runs.append(r)
    return runs


RUNS = every_run()


def actions(r: Run) -> list[Action]:
    return [a for _, acts in r.log for a in acts]


def test_every_interleaving_has_a_row() -> None:
    assert len(RUNS) > 50  # each completed: no (state, event) pair without a row


def test_the_body_goes_on_once_and_a_keyed_one_only_after_its_intake_accepted() -> None:
    for r in RUNS:
        acts = actions(r)
        assert acts.count(OpenIntake()) == 1
        bodies = [i for i, a in enumerate(acts) if isinstance(a, AnswerBody)]
        if not r.keyed:
            # Before the wait, after the gates can find the intake to wait for.
            assert bodies == [2] and acts[:4] == [OpenIntake(), RegisterIntake(), AnswerBody(),
                                                  AwaitIntake()], r.choices
            continue
        assert RegisterIntake() not in acts
        opened = [i for i, (ev, _) in enumerate(r.log) if isinstance(ev, RequestOpened)]
        closed_first = any(isinstance(ev, StreamClosed) for ev, _ in r.log[:opened[0]])
        if r.accept and not closed_first:
            assert len(bodies) == 1 and isinstance(acts[bodies[0] - 1], Accepted), r.choices
        else:
            assert bodies == [], r.choices


def test_a_refused_intake_is_answered_once_by_the_right_role() -> None:
    for r in RUNS:
        acts = actions(r)
        if r.accept:
            assert not any(isinstance(a, (Refuse, IntakeFailed)) for a in acts), r.choices
            continue
        closed_first = isinstance(next(ev for ev, _ in r.log if isinstance(
            ev, (RequestOpened, StreamClosed))), StreamClosed)
        refuse = [a for a in acts if isinstance(a, Refuse)]
        failed = [a for a in acts if isinstance(a, IntakeFailed)]
        if closed_first:
            assert refuse == failed == [], r.choices  # nobody left to answer
        elif r.keyed:
            assert refuse == [Refuse(REFUSED)] and failed == [], r.choices
        else:
            assert failed == [IntakeFailed(REFUSED)] and refuse == [], r.choices
        assert not any(isinstance(a, (Accepted, Finish, TakeOver)) for a in acts), r.choices


def test_an_accepted_request_is_finished_exactly_once_whatever_the_order() -> None:
    for r in RUNS:
        finishes = [a for a in actions(r) if isinstance(a, Finish)]
        assert len(finishes) == (1 if r.accept else 0), r.choices
        if finishes and not any(isinstance(a, TakeOver) for a in actions(r)):
            # No released attempt was ours: nothing reached the client from it.
            assert finishes[0].delivered_output_tokens == 0, r.choices


def test_only_an_accepted_request_takes_over_and_stamps_its_headers() -> None:
    for r in RUNS:
        accepted = False
        for ev, acts in r.log:
            accepted = accepted or Accepted() in acts or (
                isinstance(ev, RequestOpened) and ev.accepted)
            for a in acts:
                if isinstance(a, (TakeOver, PassHeaders)):
                    assert accepted and isinstance(ev, ResponseHeaders), r.choices
            if isinstance(ev, ResponseHeaders):
                assert acts in ([PassAside()], [PassHeaders()],
                                [TakeOver(HANDOFF), PassHeaders()]), r.choices
        if any(isinstance(a, TakeOver) for a in actions(r)):
            # The attempt taken over ends with the request: its record is settled.
            assert [a.outcome for a in actions(r) if isinstance(a, Finish)] in (
                [Outcome.CLIENT_DISCONNECTED], [Outcome.COMPLETED],
                [Outcome.UPSTREAM_FAILED]), r.choices


def test_a_trace_re_decides_the_same_way() -> None:
    for r in RUNS[::5]:
        m = GuardMachine.new(RID, 15.0, at_request=True)
        m.handle(RequestHeadersSeen("generation"))
        assert [m.handle(ev) for ev, _ in r.log] == [acts for _, acts in r.log], r.choices

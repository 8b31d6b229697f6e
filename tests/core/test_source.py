"""The source fence (core/source.py): its table, the lease deadline, and every order of
engine chunks and stop inputs, exhaustively (tests/core/exhaustive.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from extproc.core.families import CHAT, MESSAGES
from extproc.core.source import (
    TABLE,
    Do,
    Input,
    LeaseView,
    Phase,
    SourceFence,
    Why,
    engine_error_event,
    lease_margin,
)
from extproc.core.sse import EventKind, SseDecoder

from .exhaustive import Chooser, every

AID = "att_1"
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
C1 = b'data: {"choices":[{"index":0,"delta":{"content":"He"}}]}\n\n'
C2 = b'data: {"choices":[{"index":0,"delta":{"content":"llo"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
# The engine's chunks: the role event, the first content event split in two, the second
# content event with [DONE] in one chunk.
CHUNKS = [ROLE, C1[:20], C1[20:], C2 + DONE]
STREAM = b"".join(CHUNKS)


def fence(deadline: float = 100.0) -> SourceFence:
    return SourceFence("req_1", AID, LeaseView(7, 10.0, deadline=deadline))


# --- the table ---------------------------------------------------------------------------


def test_table_has_a_row_for_every_phase_and_input() -> None:
    assert len(TABLE) == len(Phase) * len(Input)


def test_table_rows() -> None:
    f = Phase.FORWARDING
    assert TABLE[(f, Input.FENCED)] == (Phase.ABORTING, Do.ABORT)
    assert TABLE[(f, Input.CANCEL)] == (Phase.ABORTING, Do.ABORT)
    assert TABLE[(f, Input.LEASE_DEADLINE)] == (Phase.ABORTING, Do.ABORT)
    assert TABLE[(f, Input.DOWNSTREAM_GONE)] == (Phase.ABORTING, Do.ABORT_QUIET)
    assert TABLE[(f, Input.ENGINE_DIED)] == (Phase.ABORTING, Do.END_DOWNSTREAM)
    assert TABLE[(f, Input.ENGINE_ENDED)] == (Phase.ENDED, Do.FINISH)
    assert TABLE[(Phase.ABORTING, Input.EVIDENCE)] == (Phase.ACKED, Do.WRITE_ACK)
    assert TABLE[(Phase.ABORTING, Input.NO_EVIDENCE)] == (Phase.NO_EVIDENCE, Do.FINISH)
    # Evidence never acks what is not being aborted; a second stop changes nothing.
    assert TABLE[(f, Input.EVIDENCE)] == (f, Do.NOTHING)
    for inp in Input:
        if inp not in (Input.EVIDENCE, Input.NO_EVIDENCE):
            assert TABLE[(Phase.ABORTING, inp)] == (Phase.ABORTING, Do.NOTHING)
    for end in (Phase.ACKED, Phase.NO_EVIDENCE, Phase.ENDED):
        for inp in Input:
            assert TABLE[(end, inp)] == (end, Do.NOTHING)


# --- the lease's local deadline ----------------------------------------------------------


def test_margin_is_min_of_one_second_and_a_fifth() -> None:
    assert lease_margin(10.0) == 1.0
    assert lease_margin(2.0) == pytest.approx(0.4)


def test_deadline_from_the_time_the_question_was_sent() -> None:
    lv = LeaseView(7, 10.0)
    assert lv.refresh_due(0.0)
    lv.answered(50.0, 6.0)  # asked at 50, etcd said 6 s left
    assert lv.deadline == 55.0
    assert lv.valid(54.999) and not lv.valid(55.0)
    assert not lv.refresh_due(53.3) and lv.refresh_due(50.0 + 10.0 / 3)
    lv.answered(60.0, 0.0)  # the lease is gone
    assert not lv.valid(60.0)


def test_a_key_without_a_lease_has_no_deadline() -> None:
    lv = LeaseView(0, 10.0)
    lv.answered(1.0, 0.0)
    assert lv.valid(1e9) and not lv.refresh_due(1e9)


def test_chunk_after_the_deadline_is_not_forwarded() -> None:
    f = fence(deadline=5.0)
    assert f.chunk(ROLE, 4.9).out == ROLE
    c = f.chunk(C1, 5.0)
    assert (c.out, c.stop, f.why, f.bytes_stopped) == (b"", Do.ABORT, Why.LEASE_DEADLINE,
                                                       len(C1))


def test_live_changed() -> None:
    f = fence()
    assert f.live_changed(AID.encode(), 1.0) is Do.NOTHING
    assert f.live_changed(b"fenced:" + AID.encode(), 2.0) is Do.ABORT
    assert (f.why, f.stopped_at, f.phase) == (Why.FENCED, 2.0, Phase.ABORTING)


def test_ack_fields() -> None:
    f = fence()
    f.chunk(ROLE + C1, 1.0)
    f.step(Input.CANCEL, 2.0)
    assert f.ack(2.0405, "engine_connection_closed", 1700.0) == {
        "at": 1700.0, "evidence": "engine_connection_closed", "abort_ms": 40.5,
        "why": "cancel"}
    assert f.phase is Phase.ACKED
    assert f.ack(3.0, "again", 1701.0) is None


def test_engine_error_event_per_family() -> None:
    chat = engine_error_event(CHAT, "m")
    assert [e.kind for e in SseDecoder().feed(chat)] == [EventKind.ERROR, EventKind.DONE]
    msg = engine_error_event(MESSAGES, "m")
    assert [e.kind for e in SseDecoder(classify=MESSAGES.classify).feed(msg)] == [
        EventKind.ERROR]


def test_non_sse_response_passes_unheld() -> None:
    f = SourceFence("r", AID, LeaseView(0, 10.0), sse=False)
    assert f.chunk(b'{"partial', 1.0).out == b'{"partial'
    out, do = f.engine_died(2.0)
    assert (out, do) == (None, Do.END_DOWNSTREAM)


# --- every order ---------------------------------------------------------------------------

RUNS = 4891  # every complete run of `play` (a change of the game changes it)
STOPS = [Input.FENCED, Input.CANCEL, Input.LEASE_DEADLINE, Input.DOWNSTREAM_GONE,
         Input.ENGINE_DIED]


@dataclass
class Run(Chooser):
    choices: list[int]
    at: int = 0
    f: SourceFence = field(default_factory=fence)
    now: float = 0.0
    fed: int = 0  # chunks fed
    sent: list[bytes] = field(default_factory=list)  # forwarded, per call
    firsts: list[int] = field(default_factory=list)  # indexes in `sent` flagged first
    end: bytes | None = None  # the in-band end the agent wrote
    reset: bool = False
    stops: list[Input] = field(default_factory=list)
    dos: list[Do] = field(default_factory=list)
    evidence_at: float | None = None
    ended_well: bool = False


def play(r: Run) -> None:
    """Up to 8 steps; each a chunk, a stop input, the engine's end, or (while aborting)
    evidence or the bound passing (other phases' answers to those are the table's rows).
    An ended run stops choosing."""
    for _ in range(8):
        r.now += 1.0
        nxt = "chunk" if r.fed < len(CHUNKS) else "engine_end"
        options: list[str | Input]
        if r.f.phase is Phase.FORWARDING:
            options = [nxt, *STOPS, "quit"]
        elif r.f.phase is Phase.ABORTING:
            # A later stop stands for every one (the table's rows say they all do nothing).
            options = [nxt, Input.CANCEL, "evidence", "no_evidence", "quit"]
        else:
            return
        pick = options[r.choose(len(options))]
        if pick == "quit":
            return
        if pick == "chunk":
            c = r.f.chunk(CHUNKS[r.fed], r.now)
            r.fed += 1
            r.sent.append(c.out)
            if c.first_content:
                r.firsts.append(len(r.sent) - 1)
        elif pick == "engine_end":
            tail, do = r.f.engine_ended(r.now)
            r.sent.append(tail)
            r.dos.append(do)
            r.ended_well = do is Do.FINISH
        elif pick == "evidence":
            if r.f.ack(r.now, "x", 0.0) is not None:
                r.evidence_at = r.now
        elif pick == "no_evidence":
            r.dos.append(r.f.step(Input.NO_EVIDENCE, r.now))
        else:
            assert isinstance(pick, Input)
            inp = pick
            if r.f.phase is Phase.FORWARDING:
                r.stops.append(inp)
            if inp is Input.LEASE_DEADLINE:
                r.f.lease.deadline = r.now  # the clock reached it
                r.dos.append(r.f.check(r.now))
            elif inp is Input.FENCED:
                r.dos.append(r.f.live_changed(None, r.now))
            elif inp is Input.ENGINE_DIED:
                end, do = r.f.engine_died(r.now)
                r.dos.append(do)
                if do is Do.END_DOWNSTREAM:
                    r.end, r.reset = end, end is None
            else:
                r.dos.append(r.f.step(inp, r.now))


def test_every_order() -> None:
    runs = every(lambda ch: Run(ch), play)
    assert len(runs) == RUNS
    for r in runs:
        out = b"".join(r.sent)
        events = SseDecoder().feed(out)
        # Forwarded bytes are the stream's prefix, cut only at event boundaries.
        assert STREAM.startswith(out)
        assert b"".join(e.raw for e in events) == out
        # The first stop decides why; nothing is forwarded after it.
        first_stop = r.stops[0] if r.stops else None
        stopped = r.f.why is not None
        if stopped:
            assert r.f.phase in (Phase.ABORTING, Phase.ACKED, Phase.NO_EVIDENCE)
            assert first_stop is not None and r.f.why.value == first_stop.value
            assert r.f.bytes_forwarded + r.f.bytes_stopped == len(
                b"".join(CHUNKS[: r.fed]))
            assert r.f.bytes_forwarded == len(out)
        else:
            assert r.f.phase in (Phase.FORWARDING, Phase.ENDED)
        if r.f.phase is Phase.ENDED:
            assert out == STREAM and r.f.why is None  # ended before any stop
        # The first-content notice: once, exactly when the first content event left.
        contents = [i for i, s in enumerate(r.sent)
                    if any(e.kind is EventKind.CONTENT for e in SseDecoder().feed(
                        b"".join(r.sent[: i + 1])))]
        assert r.firsts == contents[:1]
        assert r.f.content_events == sum(e.content_units for e in events
                                         if e.kind is EventKind.CONTENT)
        # Acked only after a stop, on evidence.
        if r.f.phase is Phase.ACKED:
            assert r.evidence_at is not None and stopped
        # The engine's death: in-band after content, a reset before it.
        if r.f.why is Why.ENGINE_DIED:
            if out.endswith(DONE):  # the engine's own end already left: nothing added
                assert r.end == b"" and not r.reset
            elif r.f.content_events > 0:
                assert r.end == engine_error_event(CHAT, "the model server's connection "
                                                   "broke mid-stream")
                whole = [e.kind for e in SseDecoder().feed(out + r.end)]
                assert whole[-2:] == [EventKind.ERROR, EventKind.DONE]
                assert whole.count(EventKind.DONE) == 1
            else:
                assert r.reset and r.end is None
        else:
            assert r.end is None and not r.reset

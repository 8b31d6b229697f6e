"""Delivery is what Envoy sent the client, not what the guard handed it (decision 0025).

The guard machine keeps, per content event it forwards, the body offset of its last byte;
when a stream ends without its end, Envoy's access-log entry says how many body bytes it
sent, and only the events wholly within them count as delivered.
"""

from __future__ import annotations

import json
from typing import Any

from extproc.core import records
from extproc.core.events import (
    AwaitCause,
    CauseLearned,
    Finish,
    ResponseBody,
    ResponseHeaders,
    StopTimers,
    StreamClosed,
    TimerFired,
    TimerKind,
)
from extproc.core.guard import (
    MARK_STRIDE,
    MARKS_KEPT,
    GuardMachine,
)
from extproc.core.journal import JournalView, Outcome
from extproc.core.replay import record, replay
from extproc.core.sse import encode_event
from extproc.core.usage import UsageMode

RID = "req_0123456789abcdefghjkmnpqrs"


def chunk(delta: dict[str, Any], usage: int | None = None) -> bytes:
    obj: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk",
                           "choices": [{"index": 0, "delta": delta}]}
    if usage is not None:
        obj["usage"] = {"prompt_tokens": 3, "total_tokens": 3 + usage,
                        "completion_tokens": usage}
    return encode_event(obj)


ROLE = chunk({"role": "assistant", "content": ""})


def content(text: str, usage: int | None = None) -> bytes:
    return chunk({"content": text}, usage)


def guard(max_buffer: int = 4 << 20) -> GuardMachine:
    m = GuardMachine.new(RID, 15.0, max_buffer)
    m.handle(ResponseHeaders(200, "text/event-stream"))
    return m


def sent(m: GuardMachine, *chunks: bytes) -> int:
    """Feed each chunk as one body message; the body bytes the guard handed Envoy."""
    before, handed = m.sent, 0
    for c in chunks:
        for a in m.handle(ResponseBody(c, False)):
            if hasattr(a, "data"):
                handed += len(a.data)
    assert m.sent == before + handed
    return m.sent


def ended(m: GuardMachine, cause: str, body_bytes: int | None) -> Finish:
    assert m.handle(StreamClosed()) == [StopTimers(), AwaitCause()]
    [f] = m.handle(CauseLearned(cause, body_bytes))
    assert isinstance(f, Finish)
    return f


def test_every_byte_sent_counts_every_event() -> None:
    m = guard()
    n = sent(m, ROLE, content("a"), content("b"), content("c"))
    assert ended(m, "upstream", n) == Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 3,
                                             "upstream", exact=False, source="events")
    assert m.withheld == 0


def test_a_released_first_delta_envoy_never_wrote_is_no_delivery() -> None:
    # Finding 2 of issue 24: the role event went out, the first delta was handed to Envoy
    # and counted, then the upstream reset destroyed the stream before Envoy wrote it.
    m = guard()
    m.usage_mode = UsageMode.STRIP_ALL
    sent(m, ROLE, content("a", usage=1))
    assert m.delivered == 1 and m.engine_tokens == 1
    f = ended(m, "upstream", len(ROLE))
    assert f == Finish(Outcome.UPSTREAM_FAILED, 0, "upstream", exact=True, source="events")
    assert m.withheld == 1
    rec = records.outcome(outcome=str(f.outcome), delivered_output_tokens=0, cause=f.cause,
                          finished_at=1.0, gateway_id="gw", exact=f.exact, source=f.source,
                          bound=f.bound)
    assert rec["delivered_output_tokens"] == 0 and rec["partial_output"] is False
    assert "delivered_output_tokens_bound" not in rec


def test_the_engine_count_is_the_one_of_the_last_event_envoy_sent() -> None:
    m = guard()
    m.usage_mode = UsageMode.STRIP_ALL
    # Each event carries two tokens (an engine merging under load): the count is the
    # engine's as of the last event sent, not a count of events.
    sent(m, ROLE, content("a b", usage=2), content("c d", usage=4))
    upto_second = m.sent
    sent(m, content("e f", usage=6))
    f = ended(m, "upstream", upto_second)
    assert f == Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 4, "upstream", exact=True,
                       source="engine")
    assert m.withheld == 1


def test_an_event_cut_in_the_middle_is_not_delivered() -> None:
    m = guard()
    first = sent(m, ROLE, content("a"))
    # Two events in one body message: Envoy's count ends inside the second.
    both = content("b") + content("c")
    sent(m, both)
    f = ended(m, "upstream", first + len(content("b")) + 5)
    assert f.delivered_output_tokens == 2 and f.outcome is Outcome.UPSTREAM_DECODE_INTERRUPTED


def test_client_gone_counts_what_envoy_sent_too() -> None:
    m = guard()
    upto = sent(m, ROLE, content("a"))
    sent(m, content("b"))
    f = ended(m, "client", upto)
    assert f == Finish(Outcome.CLIENT_DISCONNECTED, 1, "client", exact=False, source="events")


def test_no_entry_means_an_upper_bound_never_exact() -> None:
    m = guard()
    m.usage_mode = UsageMode.STRIP_ALL
    sent(m, ROLE, content("a", usage=1), content("b", usage=2))
    f = ended(m, "unknown", None)
    assert f == Finish(Outcome.UPSTREAM_DECODE_INTERRUPTED, 2, "unknown", exact=False,
                       source="engine", bound="upper")
    rec = records.outcome(outcome=str(f.outcome), delivered_output_tokens=2, cause=f.cause,
                          finished_at=1.0, gateway_id="gw", exact=f.exact, source=f.source,
                          bound=f.bound)
    assert rec["delivered_output_tokens_bound"] == "upper"
    assert rec["delivered_output_tokens_exact"] is False and rec["partial_output"] is True
    view = JournalView(RID, {"max_attempts": 2}, outcome=rec, delivery={"at": 1.0})
    d = view.to_dict()
    assert d["delivered_output_tokens_bound"] == "upper" and d["partial_output"] is True
    assert d["error"]["delivered_output_tokens_exact"] is False


def test_no_entry_and_nothing_forwarded_is_exactly_nothing() -> None:
    m = guard()
    sent(m, ROLE)
    f = ended(m, "unknown", None)
    assert f == Finish(Outcome.UPSTREAM_FAILED, 0, "unknown", exact=True, source="events")


def test_a_terminal_event_of_our_own_counts_what_we_wrote_before_it() -> None:
    # The guard's own end (stall, fence, in-band error) is a clean end of stream: Envoy
    # is not asked, the count is what preceded the terminal event (decision 0025).
    m = guard()
    sent(m, ROLE, content("a"), content("b"))
    [f, send] = m.handle(TimerFired(TimerKind.STALL))
    assert isinstance(f, Finish) and f.delivered_output_tokens == 2 and f.bound is None
    assert m.sent == sum(len(c) for c in (ROLE, content("a"), content("b"))) + len(send.data)


def test_marks_of_a_long_stream_are_folded_and_a_cut_below_them_is_an_upper_bound() -> None:
    m = guard(max_buffer=1000)
    ev = content("x")
    n = MARKS_KEPT + 10
    sent(m, ROLE, *([ev] * n))
    assert len(m.marks) < MARK_STRIDE * MARKS_KEPT  # folded: memory stays bounded
    assert m.floor[0] > 0 and m.marks[0] > m.floor[0]
    # Envoy's count within the kept marks: exact to the event.
    m2 = guard(max_buffer=1000)
    sent(m2, ROLE, *([ev] * n))
    f = ended(m2, "upstream", m2.sent - len(ev))
    assert f.delivered_output_tokens == n - 1 and f.bound is None
    # Below every kept mark: the oldest count kept, said to be an upper bound.
    f = ended(m, "upstream", len(ROLE) + len(ev))
    assert f.delivered_output_tokens == m.floor[1] and f.bound == "upper"
    assert f.exact is False


def test_a_trace_with_envoys_count_replays() -> None:
    m = guard()
    upto = sent(m, ROLE, content("a"))
    sent(m, content("b"))
    ended(m, "upstream", upto)
    tr = json.loads(json.dumps(record(m, {}, 1 << 20)))
    assert tr["events"][-1] == {"type": "CauseLearned", "cause": "upstream", "body_bytes": upto,
                                "heard": True, "wall": 0.0, "status": None}
    assert replay(tr).ok
    # A trace kept before the count existed replays as "Envoy did not say".
    del tr["events"][-1]["body_bytes"]
    assert not replay(tr).ok  # the decision differs: not silently the same

"""Random SSE streams, randomly split, and a trace's replay: what the gate's and the guard's
property tests feed their machines (a helper, not a test module)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from extproc.core.gate import GateMachine
from extproc.core.guard import GuardMachine
from extproc.core.replay import event_from_record
from extproc.core.sse import DONE_EVENT, EventKind, SseDecoder, SseEvent, encode_event

RID = "req_0123456789abcdefghjkmnpqrs"
SSE = "text/event-stream"
STALL = 15.0
UPSTREAM_ERROR_MARK = b"engine_dead"

KINDS = ("role", "content", "content2", "empty", "comment", "usage", "error", "malformed",
         "done")


def _delta(delta: dict[str, Any], **extra: Any) -> bytes:
    return encode_event({"id": "c", "object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": delta, **extra}]})


def atom(kind: str, i: int) -> bytes:
    if kind == "role":
        return _delta({"role": "assistant", "content": ""})
    if kind == "content":
        return _delta({"content": f"t{i}"})
    if kind == "content2":  # two choices: two content units in one event
        return encode_event({"choices": [{"index": 0, "delta": {"content": f"t{i}a"}},
                                         {"index": 1, "delta": {"content": f"t{i}b"}}]})
    if kind == "empty":
        return _delta({}, finish_reason=None)
    if kind == "comment":
        return b": keep-alive\n\n"
    if kind == "usage":
        return encode_event({"choices": [], "usage": {"completion_tokens": i}})
    if kind == "error":
        return encode_event({"error": {"message": "boom", "code": "engine_dead"}})
    if kind == "malformed":
        return b'data: {"choices": [{"delta"\n\n'
    assert kind == "done"
    return DONE_EVENT


@dataclass
class Stream:
    kinds: list[str]
    chunks: list[bytes]
    eos: bool  # the last chunk carries end_of_stream (else the stream is cut)

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    kinds = draw(st.lists(st.sampled_from(KINDS), max_size=14))
    data = b"".join(atom(k, i) for i, k in enumerate(kinds))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds)]
    eos = draw(st.booleans()) or draw(st.booleans())  # mostly complete streams
    return Stream(kinds, chunks, eos)


def decode(data: bytes, final: bool = True) -> list[SseEvent]:
    d = SseDecoder()
    return d.feed(data) + (d.finish() if final else [])


def texts(events: list[SseEvent]) -> list[str]:
    out: list[str] = []
    for e in events:
        if e.kind is EventKind.CONTENT:
            for ch in json.loads(e.data)["choices"]:
                out.append(ch["delta"]["content"])
    return out


# --- replay -------------------------------------------------------------------------------

def replay(m: GateMachine | GuardMachine) -> GateMachine | GuardMachine:
    fresh: GateMachine | GuardMachine
    if isinstance(m, GateMachine):
        fresh = GateMachine.new(m.request_id, params=m.params)
    else:
        fresh = GuardMachine.new(m.request_id, m.stall_after_first_delta_s, m.max_buffer)
    # The trace must survive being stored as JSON.
    for rec in json.loads(json.dumps(m.trace)):
        fresh.handle(event_from_record(rec))
    return fresh


def assert_replays(m: GateMachine | GuardMachine) -> None:
    fresh = replay(m)
    assert fresh.decisions == m.decisions
    assert fresh.state is m.state
    assert fresh.trace == m.trace


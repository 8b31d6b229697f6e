"""The fault sweep behind replica agents (issue 26): a short fixed-seed slice in `make test`.

Each demo replica sits behind `extproc agent`; the static pool names the agents
(`agent: {version: 1}`), so the gateway hears their word. A fault kills the engine, the agent
lives: after a delivered delta the client must get the exact prefix and the in-band
`upstream_decode_interrupted`, never a cut; before it, one re-run on the other replica. The
partition cases need agents behind partition proxies in devkit.devstack: until it has them
they skip with its reason. `make sweep-agents` runs every kind at every index.

The checker's own half runs first, without a stack: it must flag a transport cut after an
engine death behind an agent (the sweep without agents accepts that cut).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from devkit.sweep.harness import (
    KINDS,
    MAX_TOKENS,
    Case,
    ClientView,
    Evidence,
    SweepEnv,
    Unsupported,
    check,
    known_issue,
    parse_sse,
    reference_tokens,
)

SLICE = [Case(kind, i, stream, agents=True) for kind, i, stream in [
    ("engine-dies", 0, True), ("engine-dies", 2, True), ("engine-dies", 20, True),
    ("engine-dies", 0, False), ("reset-after-deltas", 2, True),
    ("tool-kill-deltas", 1, True), ("kill-after-compute", 2, True),
    ("kill-before-headers", 0, True), ("error-after-deltas", 0, True),
    ("stall-after-deltas", 2, True), ("client-disconnect", 2, True),
    ("partition", 0, True), ("partition", 3, True), ("partition", 0, False),
]]


@pytest.mark.e2e
@pytest.mark.parametrize("case", SLICE, ids=str)
def test_fault_behind_agent(sweep_env: SweepEnv, case: Case) -> None:
    try:
        res = sweep_env.run(case)
    except Unsupported as e:
        pytest.skip(str(e))
    if (known := known_issue(res)) is not None:
        pytest.xfail(f"known product issue: {known}\n{res.report()}")
    assert not res.violations, res.report()


# --- the checker alone: a cut after an engine death is a violation only with agents --------

def _events(k: int, cut: bool) -> tuple[bytes, list[Any]]:
    """A stream of the reference answer: its normalized events, and the bytes a client got
    when it was cut after k deltas (cut) or ended with the terminal event."""
    toks = reference_tokens(7)
    role = {"object": "chat.completion.chunk", "model": "demo-model",
            "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    content = [{"object": "chat.completion.chunk", "model": "demo-model",
                "choices": [{"index": 0, "delta": {"content": t}}]} for t in toks]
    fin = {"object": "chat.completion.chunk", "model": "demo-model",
           "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    ref: list[Any] = [role, *content, fin, "[DONE]"]
    sent: list[Any] = [role, *content[:k]]
    if not cut:
        sent += [{"error": {"code": "upstream_decode_interrupted", "retryable": False,
                            "partial_output": True, "delivered_output_tokens": k,
                            "request_id": "req_x"}}, "[DONE]"]
    raw = b"".join(b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode())
                   + b"\n\n" for e in sent)
    return raw, ref


def _evidence(agents: bool, cut: bool) -> Evidence:
    k = 2
    raw, ref = _events(k, cut)
    view = ClientView(status=200, headers={"x-gateway-attempt-id": "a1"}, raw=raw,
                      transport_error="RemoteProtocolError: peer closed" if cut else None)
    evs, tail = parse_sse(raw)
    err = None if cut else json.loads(raw.split(b"\n\n")[1 + k][6:])["error"]
    journal = {"outcome": "upstream_decode_interrupted", "first_delta_sent": True,
               "delivered_output_tokens": k, "stream": True, "error": err,
               "attempts": [{"attempt": 1, "attempt_id": "a1", "admitted_at": 1.0,
                             "ended_at": 2.0, "released": True, "fence": "revoked"}]}
    case = Case("engine-dies" if agents else "kill-after-deltas", k, True, agents=agents)
    return Evidence(case, KINDS[case.kind], "req_x", view, evs, tail, None, journal,
                    [journal], [{"attempt": 1, "replica": "r1", "outcome": "killed"}], [], [],
                    ref)


def test_checker_flags_a_cut_after_an_engine_death_only_behind_an_agent() -> None:
    assert MAX_TOKENS > 2
    violations, category, k = check(_evidence(agents=True, cut=True))
    assert k == 2 and category == "violation"
    assert [v.invariant for v in violations] == ["I2", "I2"], violations
    assert "cut" in violations[0].message and "no upstream_decode_interrupted" in \
        violations[1].message
    # The same cut without an agent is the documented clean error (the pod died whole).
    assert check(_evidence(agents=False, cut=True))[:2] == ([], "clean_error")
    # Behind an agent, the in-band terminal event is the clean error.
    assert check(_evidence(agents=True, cut=False))[:2] == ([], "clean_error")

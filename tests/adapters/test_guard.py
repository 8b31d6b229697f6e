"""adapters/guard: a plain executor of core.guard's machine. Every action the machine can
answer with is carried out, as a codec write or a port call (the session ignores an action
it has no entry for, so a missing entry would drop it silently), but for the two the
observer alone writes down; and one port call, the status lookup, end to end on the
hermetic harness. (Both sessions played as Envoy plays them: test_sessions.py.)"""

from __future__ import annotations

import ast
import json
import typing
from pathlib import Path

import pytest

from extproc.adapters.guard import GuardSession
from extproc.adapters.session import INVALID
from extproc.core import events as E

from .support import idle
from .test_sessions import CHAT, DOWN, immediate, proc, req_body, req_headers, start

CORE_GUARD = Path(E.__file__).with_name("guard.py")
# Said by the rows for the record and the logs only (adapters/guard.py says why).
OBSERVED_ONLY = {"IntakeFailed", "UnreadableHandOff"}


def _actions_named_in_core_guard() -> set[str]:
    actions = {c.__name__ for c in typing.get_args(E.Action)}
    named = set()
    for n in ast.walk(ast.parse(CORE_GUARD.read_text())):
        if isinstance(n, ast.Name) and n.id in actions:
            named.add(n.id)
        elif isinstance(n, ast.Attribute) and n.attr in actions:
            named.add(n.attr)
    return named


def test_every_action_of_the_guard_s_rows_has_an_executor() -> None:
    handled = {t.__name__ for t in (*GuardSession.WRITES, *GuardSession.ACTS)}
    named = _actions_named_in_core_guard()
    assert len(named) > 10  # the scan found the rows' vocabulary
    assert named - handled == OBSERVED_ONLY
    assert not OBSERVED_ONLY & handled
    assert not set(GuardSession.WRITES) & set(GuardSession.ACTS)  # one way each


async def _lookup(rid: str, down: bool) -> tuple[int, dict[str, typing.Any]]:
    p, store = proc()
    store.unavailable = down
    ctx, _, task = start(GuardSession, p)
    ctx.send(req_headers({":method": "GET", ":path": f"/v1/requests/{rid}"}, eos=True))
    (r,) = await ctx.wait_for(1)
    ctx.close()
    await task
    return immediate(r)


@pytest.mark.parametrize(("down", "status", "code"), [
    (False, 404, "request_not_found"), (True, 503, "journal_unavailable")])
async def test_a_status_lookup_is_answered_from_the_journal(down: bool, status: int,
                                                           code: str) -> None:
    rid = "req_0123456789abcdefghjkmnpqrs"
    got_status, body = await _lookup(rid, down)
    assert (got_status, body["error"]["code"], body["error"]["request_id"]) == (status, code,
                                                                                rid)


async def test_the_body_sent_upstream_is_held_no_longer_than_its_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway asks the engine for its running usage by rewriting the body (core.usage):
    the rewritten body goes out in the body's answer and is then let go, with the intake's
    own copy once it wrote the record (decision 0055); an open stream holds the prompt's
    size otherwise."""
    prepared, p, ctx, s, task, r = await _body_answered(monkeypatch)
    sent = r.request_body.response.body_mutation.body
    assert json.loads(sent)["stream_options"]["include_usage"] is True
    assert json.loads(sent)["messages"] == json.loads(CHAT)["messages"]
    assert s.intake is None and s.kept is not None  # the session's own copy: let go
    assert prepared and prepared[0].meta.upstream_body is None  # and the intake's
    assert prepared[0].meta.body_bytes == len(CHAT)  # the rest of what it read stays
    await idle()
    assert s._tx is not None and s._tx.prep is None and s._tx.cred == ""
    ctx.close()
    await task
    await p.drain()


async def _body_answered(monkeypatch: pytest.MonkeyPatch) -> tuple[typing.Any, ...]:
    """A guard stream past its request body's answer, each `Prepared` it made captured:
    (prepared, processor, Envoy's side, session, its task, the body's answer)."""
    prepared = _capture(monkeypatch)
    p, _ = proc()
    ctx, s, task = start(GuardSession, p)
    ctx.send(req_headers(DOWN))
    await ctx.wait_for(1)
    ctx.send(req_body(CHAT))
    r = (await ctx.wait_for(2))[1]
    return prepared, p, ctx, s, task, r


def _slots(o: object) -> list[object]:
    return [getattr(o, n) for c in type(o).__mro__ for n in getattr(c, "__slots__", ())
            if hasattr(o, n)]


async def test_an_open_stream_holds_nothing_its_intake_wrote(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the body is answered and the intake wrote the record, the open stream holds
    neither the intake's `Prepared` nor its record or attempt 1 (decision 0055): only what
    is read later (`Kept`), the same values."""
    prepared, p, ctx, s, task, _ = await _body_answered(monkeypatch)
    await idle()
    (prep,) = prepared
    held = _slots(s) + _slots(s._tx)
    assert not [v for v in held if v is prep or v is prep.record or v is prep.first
                or v is prep.meta]
    k = s.kept
    assert k is not None and (k.model, k.stream, k.created_at, k.aid1) == (
        prep.meta.model, prep.meta.stream, prep.record["created_at"],
        prep.first["attempt_id"])
    assert k.fingerprint == (prep.route[0] if prep.route else None)
    assert s.aid1 == prep.first["attempt_id"]
    ctx.close()
    await task
    await p.drain()


def _capture(monkeypatch: pytest.MonkeyPatch) -> list[typing.Any]:
    """Each `Prepared` the guard's ReadBody makes, kept by the test."""
    from extproc.adapters import guard

    got: list[typing.Any] = []
    real = guard.G.read_body

    def read_body(*a: typing.Any, **kw: typing.Any) -> typing.Any:
        prep, ev = real(*a, **kw)
        got.append(prep)
        return prep, ev

    monkeypatch.setattr(guard.G, "read_body", read_body)
    return got


async def test_open_streams_of_one_model_share_its_name_and_an_unrecorded_span(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What an accepted stream keeps of its body (`Kept`) names its model with the one
    interned string, not the parsed body's copy each: the same text; and with tracing off
    its span is one shared span that records nothing (decision 0059)."""
    got = []
    for _ in range(2):
        prepared, p, ctx, s, task, _ = await _body_answered(monkeypatch)
        await idle()
        got.append((s.kept, prepared[0].meta.model, s.span))
        ctx.close()
        await task
        await p.drain()
    (ka, ma, sa), (kb, mb, sb) = got
    assert ka.model == ma == kb.model == mb == json.loads(CHAT)["model"]
    assert ma is not mb  # each body parsed its own
    assert ka.model is kb.model
    # Tracing off: the stream's span records nothing, one for all streams; it is not the
    # session's "no span yet" (INVALID), so the span is not started again.
    assert sa is sb and sa is not INVALID and not sa.is_recording()

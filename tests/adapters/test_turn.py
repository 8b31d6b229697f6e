"""A stream's lock (session.Turn): one holder, waiters served in the order they asked,
cancellation never losing or duplicating the turn. It replaced asyncio.Lock on the message
path, so it must keep that lock's contract."""

from __future__ import annotations

import asyncio

import pytest

from extproc.adapters.session import Turn

from .support import idle


async def _holder(turn: Turn, name: str, log: list[str], go: asyncio.Event) -> None:
    async with turn:
        log.append(f"{name} in")
        await go.wait()
        log.append(f"{name} out")


async def test_one_holder_at_a_time_in_the_order_they_asked() -> None:
    turn, log, go = Turn(), [], asyncio.Event()
    assert turn.take() and not turn.take()  # held: nobody else takes it
    tasks = [asyncio.ensure_future(_holder(turn, n, log, go)) for n in "abc"]
    await idle()
    assert log == []  # all three wait
    turn.release()
    await idle()
    assert log == ["a in"] and turn.held
    assert not turn.take()  # handed over: a message cannot overtake a waiter
    go.set()
    await asyncio.gather(*tasks)
    assert log == ["a in", "a out", "b in", "b out", "c in", "c out"]
    assert not turn.held and turn.take()


async def test_a_waiter_cancelled_while_waiting_is_skipped() -> None:
    turn, log, go = Turn(), [], asyncio.Event()
    turn.take()
    a, b = (asyncio.ensure_future(_holder(turn, n, log, go)) for n in "ab")
    await idle()
    a.cancel()
    await idle()
    turn.release()
    go.set()
    await b
    assert log == ["b in", "b out"] and a.cancelled() and not turn.held


async def test_a_waiter_cancelled_once_handed_the_turn_passes_it_on() -> None:
    turn, log, go = Turn(), [], asyncio.Event()
    turn.take()
    a, b = (asyncio.ensure_future(_holder(turn, n, log, go)) for n in "ab")
    await idle()
    turn.release()  # a is handed the turn, and cancelled before it runs
    a.cancel()
    go.set()
    await b
    with pytest.raises(asyncio.CancelledError):
        await a
    assert log == ["b in", "b out"] and not turn.held


async def test_an_error_inside_releases_it() -> None:
    turn = Turn()

    async def boom() -> None:
        async with turn:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        await boom()
    assert not turn.held and turn.take()

"""bench/instructions.py's pure parts: reading callgrind's dumps and dividing by the units."""

from __future__ import annotations

import pytest

from bench.instructions import Counts, event, per_unit, phase_totals, read_dump, short, table


def dump(label: str | None, total: int) -> str:
    """The lines of a callgrind dump these functions read (3.19's layout)."""
    trigger = f"Client Request: {label}" if label else "Program termination"
    return (f"# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\npid: 7\n"
            f"cmd: python -m bench.instructions\npart: 2\n\ndesc: I1 cache:\n"
            f"desc: Timerange: Basic block 1 - 2\ndesc: Trigger: {trigger}\n\n"
            f"positions: line\nevents: Ir\nsummary: {total}\n\nfl=(1) a.c\nfn=(1) f\n"
            f"0 {total}\n\ntotals: {total}\n")


def test_a_dump_gives_its_label_and_total() -> None:
    assert read_dump(dump("chunk", 123456)) == ("chunk", 123456)
    assert read_dump(dump(None, 9)) == (None, 9)
    with pytest.raises(ValueError, match="not a callgrind dump"):
        read_dump("events: Ir\n")


def test_phases_sum_by_label_and_the_exit_dump_is_left_out() -> None:
    got = phase_totals([dump("start", 10), dump("chunk", 200), dump("chunk", 50),
                        dump("end", 7), dump(None, 10_000), dump("warmup", 99)])
    assert got == {"start": 10, "chunk": 250, "end": 7}


def test_per_unit_divides_starts_and_ends_by_requests_and_chunks_by_both() -> None:
    c = per_unit({"start": 1000, "chunk": 6000, "end": 300}, requests=10, chunks=3)
    assert c == Counts(start=100.0, chunk=200.0, end=30.0)
    with pytest.raises(ValueError, match="chunk"):
        per_unit({"start": 1, "end": 1}, 1, 1)
    with pytest.raises(ValueError, match="positive"):
        per_unit({"start": 1, "chunk": 1, "end": 1}, 0, 1)


def test_the_table_gives_ratios_to_the_floor() -> None:
    ours, floor = Counts(500.0, 250.0, 60.0), Counts(100.0, 125.0, 20.0)
    t = table(ours, floor)
    assert "| chunk | 250 | 125 | x2.00 |" in t
    assert "| request start (to first delta) | 500 | 100 | x5.00 |" in t
    t = table(ours, floor, compiled=Counts(400.0, 200.0, 50.0))
    assert "| chunk | 250 | 125 | x2.00 | 200 | x1.60 |" in t


def test_callgrind_annotate_names_are_shortened() -> None:
    assert short("(23.31%)  /tmp/py/Python/ceval.c:_PyEval_EvalFrameDefault'2 "
                 "[/root/lib/libpython3.11.so.1.0]") == \
        "(23.31%)  _PyEval_EvalFrameDefault'2  ceval.c  libpython3.11.so.1.0"
    assert short("( 0.53%)  ???:encode_message [/x/_message.abi3.so]") == \
        "( 0.53%)  encode_message  ???  _message.abi3.so"


def test_the_driver_s_events_take_the_guard_s_fast_path_as_the_demo_replica_s_do() -> None:
    # The per-chunk count is only the demo's if its events are classified the same way:
    # matched whole by the fast regex, with and without the running usage.
    from extproc.core import sse

    for usage in (False, True):
        for role in (False, True):
            ev = event(7, usage, role)
            assert sse._FAST_ONE.fullmatch(ev), ev
    assert b'"completion_tokens":7' in event(7, True) and b"usage" not in event(7, False)


def test_both_sides_play_through_the_real_servicer_without_valgrind() -> None:
    """The driver imports the processor as it is laid out today and plays whole requests
    (each one's answers checked by `Request.check`): a moved class fails here, not in a
    benchmark run weeks later."""
    import asyncio

    from bench.instructions import play

    marks: list[str] = []
    for side in ("ours", "floor"):
        asyncio.run(play(side, 2, 3, 1, marks.append, lambda: None))
    assert marks == ["start", "chunk", "end"] * 2


def test_the_bench_sets_the_collector_as_serve_does_and_gives_it_back() -> None:
    """Counted with the thresholds `server.serve` sets (start-up objects frozen, young ones
    collected every 20,000 allocations), not the interpreter's default; the test process's
    own collector is as it was after a play."""
    import asyncio
    import gc
    import inspect

    from bench.instructions import GC_THRESHOLDS, play
    from extproc.adapters import server

    src = inspect.getsource(server.serve)
    assert "gc.freeze()" in src
    assert f"gc.set_threshold({GC_THRESHOLDS[0]:_}, {GC_THRESHOLDS[1]}, {GC_THRESHOLDS[2]})" \
        in src
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    seen: list[tuple[int, int, int]] = []
    asyncio.run(play("floor", 1, 1, 0, lambda _l: seen.append(gc.get_threshold()),
                     lambda: None))
    assert seen == [GC_THRESHOLDS] * 3
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen


def test_a_part_counts_a_coroutine_only_while_it_runs_and_nested_calls_once() -> None:
    """`--part` on a coroutine function: collection on at each of its steps, off while it
    waits; a recursive call inside it toggles nothing more."""
    import asyncio
    import sys
    import types

    from bench.instructions import wrap_part

    mod = types.ModuleType("_hb_part_probe")
    log: list[str] = []

    async def rec(n: int) -> int:
        log.append(f"run{n}")
        if n == 0:
            await asyncio.sleep(0)  # waits: not counted
            log.append("back")
            return 0
        return 1 + await mod.rec(n - 1)

    def plain(x: int) -> int:
        log.append("plain")
        return mod.plain(x - 1) if x else 7

    mod.rec, mod.plain = rec, plain  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        wrap_part(f"{mod.__name__}:rec", lambda: log.append("T"))
        assert asyncio.run(mod.rec(2)) == 2
        assert log == ["T", "run2", "run1", "run0", "T", "T", "back", "T"]
        log.clear()
        wrap_part(f"{mod.__name__}:plain", lambda: log.append("T"))
        assert mod.plain(2) == 7
        assert log == ["T", "plain", "plain", "plain", "T"]
    finally:
        del sys.modules[mod.__name__]

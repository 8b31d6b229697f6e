"""The retry budget (re-prefills in flight) and the prompt's cost estimate."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core.budget import RetryBudget, estimate_prompt_tokens

# --- the retry budget: re-prefills in flight (decision 0023), on a fake clock ------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> float:
        self.t += s
        return self.t


def budget(fraction: float = 0.2, floor: int = 3, expiry_s: float = 600.0) -> RetryBudget:
    return RetryBudget(fraction, floor, expiry_s)


def start_requests(b: RetryBudget, n: int, now: float, prefix: str = "r") -> list[str]:
    rids = [f"{prefix}{i}" for i in range(n)]
    for rid in rids:
        b.request_started(rid, now, f"run-{rid}")
    return rids


def test_the_floor_bounds_re_prefills_in_flight() -> None:
    clock, b = FakeClock(), budget(floor=3)
    rids = start_requests(b, 10, clock())  # 20% of 10 = 2 < the floor of 3
    got = [b.try_retry(clock(), f"a{i}", rids[i]) for i in range(4)]
    assert [d.allowed for d in got] == [True, True, True, False]
    assert [(d.retries, d.requests, d.limit) for d in got] == [
        (1, 10, 3), (2, 10, 3), (3, 10, 3), (3, 10, 3)]
    assert b.snapshot(clock()) == (10, 3)


def test_a_quiet_pool_always_has_a_retry_after_a_burst_is_over() -> None:
    # Finding 7 (issue 24): a burst of 12 failing requests used the floor; once they are
    # over, a request seconds later in a quiet pool is re-run, whenever it comes.
    clock, b = FakeClock(), budget(fraction=0.2, floor=10)
    rids = start_requests(b, 12, clock())
    verdicts = [b.try_retry(clock.advance(0.01), f"burst-{i}", rid)
                for i, rid in enumerate(rids)]
    assert sum(v.allowed for v in verdicts) == 10  # storm protection: 2 refused
    clock.advance(0.5)
    for i, rid in enumerate(rids):
        if verdicts[i].allowed:
            b.retry_ended(f"burst-{i}")  # the re-prefills finished ...
        b.request_ended(rid, f"run-{rid}")  # ... and so did their requests
    assert b.snapshot(clock()) == (0, 0)
    for after in (0.0, 0.1, 8.0):  # right after, or 8 s later: never refused
        clock.advance(after)
        b.request_started(f"quiet-{after}", clock(), "q")
        d = b.try_retry(clock(), f"quiet-a-{after}", f"quiet-{after}")
        assert d.allowed and (d.retries, d.requests, d.limit) == (1, 1, 10)
        b.request_ended(f"quiet-{after}", "q")


def test_the_percentage_of_requests_in_flight() -> None:
    clock, b = FakeClock(), budget(fraction=0.2, floor=3)
    rids = start_requests(b, 30, clock())  # 20% of 30 = 6 > the floor
    assert [b.try_retry(clock(), f"a{i}", rids[i]).allowed for i in range(7)] == [
        True] * 6 + [False]
    assert b.last is not None and b.last.limit == 6
    # Fewer requests in flight: the limit shrinks with them (the floor stays).
    for rid in rids[10:]:
        b.request_ended(rid, f"run-{rid}")
    d = b.try_retry(clock(), "late", rids[0])
    assert not d.allowed and (d.retries, d.requests, d.limit) == (6, 10, 3)
    # More: it grows.
    start_requests(b, 40, clock(), prefix="more")
    assert b.try_retry(clock(), "late", rids[0]).allowed  # 20% of 50 = 10 > 6 in flight


def test_a_retry_ends_at_its_attempts_end_idempotently() -> None:
    clock, b = FakeClock(), budget(floor=2)
    start_requests(b, 2, clock())
    assert b.try_retry(clock(), "a1", "r0").allowed
    assert b.try_retry(clock(), "a2", "r1").allowed
    assert not b.try_retry(clock(), "a3", "r1").allowed
    b.retry_ended("a1")  # the gate: failed before release
    b.retry_ended("a1")  # said twice: counted once
    b.retry_ended("never-counted")  # a first attempt, or a refused one: ignored
    assert b.snapshot(clock()) == (2, 1)
    assert b.try_retry(clock(), "a3", "r1").allowed
    assert not b.try_retry(clock(), "a4", "r1").allowed


def test_asking_again_for_a_counted_attempt_counts_it_once() -> None:
    clock, b = FakeClock(), budget(floor=2)
    start_requests(b, 1, clock())
    assert b.try_retry(clock(), "a1", "r0").allowed
    again = b.try_retry(clock(), "a1", "r0")
    assert again.allowed and again.retries == 1
    assert b.snapshot(clock()) == (1, 1)


def test_the_request_end_ends_its_re_prefills_the_released_one_too() -> None:
    clock, b = FakeClock(), budget(floor=2)
    start_requests(b, 2, clock())
    assert b.try_retry(clock(), "a2", "r0").allowed  # released: the gate never ends it
    assert b.try_retry(clock(), "b2", "r1").allowed
    b.request_ended("r0", "run-r0")  # the guard's stream is over
    assert b.snapshot(clock()) == (1, 1)
    b.retry_ended("a2")  # a late end of the same attempt changes nothing
    assert b.snapshot(clock()) == (1, 1)
    assert b.try_retry(clock(), "c2", "r1").allowed


def test_another_run_of_the_same_request_id_is_told_apart() -> None:
    # A repeat (same Idempotency-Key) answered 409 while the first run is in flight, or a
    # later run of the request: ending one never ends the other.
    clock, b = FakeClock(), budget(floor=1)
    b.request_started("r", clock(), "run-1")
    assert b.try_retry(clock(), "a2", "r").allowed
    b.request_started("r", clock(), "run-2")  # counted once: the first run is in flight
    b.request_ended("r", "run-2")
    b.request_ended("r", "")
    assert b.snapshot(clock()) == (1, 1)
    b.request_ended("r", "run-1")
    assert b.snapshot(clock()) == (0, 0)


def test_an_end_that_never_comes_expires() -> None:
    clock, b = FakeClock(), budget(floor=1, expiry_s=60.0)
    b.request_started("r0", clock(), "x")
    assert b.try_retry(clock(), "lost", "r0").allowed  # its end is never reported
    clock.advance(59.9)
    b.request_started("r1", clock(), "y")
    assert not b.try_retry(clock(), "next", "r1").allowed  # still counted
    clock.advance(0.1)  # 60 s after its start: dropped
    d = b.try_retry(clock(), "next", "r1")
    assert d.allowed and (d.retries, d.requests) == (1, 1)  # r0 expired too, r1 did not
    assert b.retries.expired == 1 and b.requests.expired == 1
    b.request_ended("r0", "x")  # the lost end arriving late changes nothing
    assert b.snapshot(clock()) == (1, 1)
    clock.advance(60.0)
    assert b.snapshot(clock()) == (0, 0)


def test_pool_wide_the_other_gateways_counts_add_up() -> None:
    clock, b = FakeClock(), budget(fraction=0.2, floor=3)
    start_requests(b, 10, clock())
    b.others = {"gw-2": (90, 0)}  # 100 requests in flight pool-wide: limit 20
    assert b.try_retry(clock(), "a1", "r0").limit == 20
    b.others = {"gw-2": (90, 19), "gw-3": (0, 0)}  # 19 + our 1 = 20 in flight
    d = b.try_retry(clock(), "a2", "r1")
    assert not d.allowed and (d.retries, d.requests, d.limit) == (20, 100, 20)
    b.others = {"gw-2": (0, 3)}  # a quiet pool, another gateway's 3 in flight use the floor
    assert not b.try_retry(clock(), "a2", "r1").allowed
    b.others = {}
    assert b.try_retry(clock(), "a2", "r1").allowed
    # What this gateway publishes is its own counts only.
    assert b.snapshot(clock()) == (10, 2)


def test_a_zero_budget_refuses_every_re_prefill() -> None:
    clock, b = FakeClock(), budget(fraction=0.0, floor=0)
    start_requests(b, 100, clock())
    d = b.try_retry(clock(), "a", "r0")
    assert not d.allowed and d.limit == 0


@settings(max_examples=400)
@given(st.lists(st.tuples(st.sampled_from(["start", "end", "retry", "retry_end", "tick"]),
                          st.integers(0, 7), st.floats(0.0, 40.0)), max_size=80),
       st.integers(0, 4), st.floats(0.0, 1.0))
def test_budget_invariants(ops: list[tuple[str, int, float]], floor: int,
                           fraction: float) -> None:
    # Against a plain model: re-prefills in flight never exceed the limit at admission,
    # a quiet pool (nothing in flight) always admits one if the floor is at least 1, and
    # counts match the model's.
    clock, b = FakeClock(), RetryBudget(fraction, floor, 60.0)
    reqs: dict[str, float] = {}
    rets: dict[str, tuple[float, str]] = {}
    for n, (op, i, dt) in enumerate(ops):
        now = clock.advance(dt)
        for k in [k for k, t in reqs.items() if t <= now - 60.0]:
            del reqs[k]
        for k in [k for k, (t, _) in rets.items() if t <= now - 60.0]:
            del rets[k]
        rid = f"r{i}"
        if op == "start":
            b.request_started(rid, now, "run")
            reqs.setdefault(rid, now)
        elif op == "end":
            b.request_ended(rid, "run")
            reqs.pop(rid, None)
            for k in [k for k, (_, r) in rets.items() if r == rid]:
                del rets[k]
        elif op == "retry":
            aid = f"a{n}"
            quiet = not rets
            limit = max(floor, int(fraction * len(reqs)))
            d = b.try_retry(now, aid, rid)
            assert d.allowed == (len(rets) + 1 <= limit)
            assert d.limit == limit and d.requests == len(reqs)
            if quiet and floor >= 1:
                assert d.allowed
            if d.allowed:
                rets[aid] = (now, rid)
                assert d.retries == len(rets) <= limit
        elif op == "retry_end":
            aid = sorted(rets)[i % len(rets)] if rets else "none"
            b.retry_ended(aid)
            rets.pop(aid, None)
        assert b.snapshot(now) == (len(reqs), len(rets))


def test_prompt_token_estimate() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 400},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 40}]}]}
    assert estimate_prompt_tokens(body, 4.0) == 110 + 8
    assert estimate_prompt_tokens({"prompt": "z" * 80}, 4.0) == 20

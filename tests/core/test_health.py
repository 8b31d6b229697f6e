"""Pool health: passive ejection and active probes, pure, no sockets (decision 0010)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from extproc.core.health import HealthPolicy, HostHealth

HOSTS = ["a:1", "b:1", "c:1"]


# --- health ---------------------------------------------------------------------------


def test_consecutive_failures_eject_and_the_ejection_grows() -> None:
    h = HostHealth(HealthPolicy(consecutive_failures=2, base_ejection_s=5, max_ejection_s=12))
    assert h.attempt_failed("a:1", 0.0) is False and h.healthy("a:1", 0.0)
    assert h.attempt_failed("a:1", 0.1) is True
    assert not h.healthy("a:1", 0.2) and h.healthy("a:1", 5.2)
    assert h.order(HOSTS, 1.0) == ["b:1", "c:1", "a:1"]
    assert h.order(HOSTS, 5.2) == HOSTS
    # Failing again after the ejection: twice as long, then capped.
    h.attempt_failed("a:1", 6.0)
    assert h.attempt_failed("a:1", 6.1) is True
    assert not h.healthy("a:1", 16.0) and h.healthy("a:1", 16.2)
    h.attempt_failed("a:1", 20.0)
    h.attempt_failed("a:1", 20.1)
    assert not h.healthy("a:1", 32.0) and h.healthy("a:1", 32.2)  # 12 s cap, not 15


def test_a_success_resets_the_count() -> None:
    h = HostHealth(HealthPolicy(consecutive_failures=2))
    h.attempt_failed("a:1", 0.0)
    h.attempt_succeeded("a:1", 0.1)
    assert h.attempt_failed("a:1", 0.2) is False and h.healthy("a:1", 0.3)


def test_probes_mark_down_and_bring_back_at_once() -> None:
    h = HostHealth(HealthPolicy(unhealthy_threshold=2, healthy_threshold=1, base_ejection_s=60))
    h.probed("b:1", False, 0.0)
    assert h.healthy("b:1", 0.0)
    h.probed("b:1", False, 1.0)
    assert not h.healthy("b:1", 1.0) and not h.healthy("b:1", 1000.0)
    h.attempt_failed("b:1", 1.1)
    h.attempt_failed("b:1", 1.2)  # also ejected for 60 s
    h.probed("b:1", True, 2.0)  # a restarted pod: back at once, the ejection forgiven
    assert h.healthy("b:1", 2.0) and h.order(HOSTS, 2.0) == HOSTS


def test_a_good_probe_lifts_a_passive_ejection() -> None:
    h = HostHealth(HealthPolicy(consecutive_failures=1, base_ejection_s=60))
    h.attempt_failed("c:1", 0.0)
    assert not h.healthy("c:1", 1.0)
    h.probed("c:1", True, 1.0)
    assert h.healthy("c:1", 1.0)


@given(st.lists(st.tuples(st.sampled_from(HOSTS), st.sampled_from(["fail", "ok", "up", "down"]),
                          st.floats(0, 5)), max_size=40),
       st.permutations(HOSTS), st.floats(0, 300))
def test_order_is_a_permutation_healthy_first(events: list[tuple[str, str, float]],
                                              hosts: list[str], at: float) -> None:
    h = HostHealth(HealthPolicy())
    now = 0.0
    for addr, what, dt in events:
        now += dt
        if what == "fail":
            h.attempt_failed(addr, now)
        elif what == "ok":
            h.attempt_succeeded(addr, now)
        else:
            h.probed(addr, what == "up", now)
    out = h.order(hosts, now + at)
    assert sorted(out) == sorted(hosts)  # never drops a host
    good = [a for a in hosts if h.healthy(a, now + at)]
    assert out[:len(good)] == good  # healthy ones first, in the request's rotation

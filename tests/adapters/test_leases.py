"""adapters/leases: the process lease's local deadline always falls before etcd's, an
attempt's permission has one owner of its loss (said once, to every listener, even one that
comes late), and a live key's subscriber hears only changes of its own attempt's key."""

from __future__ import annotations

import pytest

from extproc.adapters.leases import AttemptLease, LiveListeners, ProcessLease


def test_the_local_deadline_runs_from_the_send_minus_the_margin() -> None:
    p = ProcessLease(lease_id=7, ttl_s=10, deadline=109.0, margin_s=1.0)
    assert p.valid(108.9) and not p.valid(109.0)
    p.renewed(sent_at=200.0, ttl_s=10)
    assert p.deadline == 209.0  # sent at 200: etcd started its TTL later than that
    p.lost()
    assert not p.valid(0.0)
    p.renewed(sent_at=300.0, ttl_s=10)  # a late keep-alive does not bring a lost lease back
    assert not p.valid(300.0)


def test_an_attempt_loses_its_permission_once_and_every_listener_hears_why() -> None:
    a = AttemptLease(ProcessLease(1, 10, deadline=1e9))
    heard: list[str] = []
    a.on_lost(heard.append)
    a.on_lost(lambda why: heard.append("second:" + why))
    assert a.valid(0.0) and not a.revoked
    assert a.lose("revoked") is True
    assert a.lose("expired") is False  # only the call that ended it
    assert heard == ["revoked", "second:revoked"] and a.lost_because == "revoked"
    a.on_lost(lambda why: heard.append("late:" + why))  # registered after: told at once
    assert heard[-1] == "late:revoked"
    assert not a.valid(0.0)


def test_a_failing_listener_does_not_keep_the_others_from_hearing() -> None:
    a = AttemptLease(ProcessLease(1, 10, deadline=1e9))
    heard: list[str] = []

    def boom(_: str) -> None:
        raise RuntimeError("listener bug")
    a.on_lost(boom)
    a.on_lost(heard.append)
    assert a.lose("fenced")
    assert heard == ["fenced"]


def test_an_attempt_is_valid_only_while_its_process_lease_is() -> None:
    a = AttemptLease(ProcessLease(3, 6, deadline=50.0))
    assert (a.lease_id, a.ttl_s) == (3, 6)
    assert a.valid(49.0) and not a.valid(50.0)


def test_a_subscriber_hears_only_changes_from_its_own_attempt() -> None:
    ll = LiveListeners()
    mine: list[str | None] = []
    anyone: list[str | None] = []
    ll.subscribe("req_1", mine.append, mine="att_2")
    off = ll.subscribe("req_1", anyone.append)
    # The previous attempt's revocation, delivered late: not a revocation of att_2.
    ll.fire("req_1", None, prev="att_1", prev_known=True)
    assert mine == [] and anyone == [None]
    ll.fire("req_1", "att_3", prev="att_2", prev_known=True)
    assert mine == ["att_3"]
    # Not knowing what it replaced, the store tells everyone: deafness would be unsafe.
    ll.fire("req_1", None)
    assert mine == ["att_3", None]
    off()
    ll.fire("req_1", "x")
    assert anyone == [None, "att_3", None]
    ll.fire("req_other", "y")
    assert mine == ["att_3", None, "x"]


@pytest.mark.parametrize("twice", [False, True])
def test_unsubscribing_forgets_the_key(twice: bool) -> None:
    ll = LiveListeners()
    off = ll.subscribe("req_1", lambda _: None)
    off()
    if twice:
        off()  # harmless
    assert ll._by_rid == {}

"""Live pool membership, pure: what a registration means and when the agent acts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from extproc.core.membership import (
    Agent,
    AgentAction,
    AgentPolicy,
    RegistrationError,
    endpoints,
    normalize_address,
    parse_registration,
    pool_from_registrations,
    registration_record,
)

FP = {"weights_revision": "m@sha256:1", "kv_cache_dtype": "fp16"}


def _raw(**over: Any) -> bytes:
    rec: dict[str, Any] = {"address": "10.0.0.7:8000", "fingerprint": FP, "models": ["m"],
                           "agent": "node/1"}
    rec.update(over)
    return json.dumps({k: v for k, v in rec.items() if v is not None}).encode()


@pytest.mark.parametrize("given, canonical", [
    ("10.0.0.7:8000", "10.0.0.7:8000"),
    ("[::1]:8000", "[::1]:8000"),
    ("[0:0::1]:80", "[::1]:80"),
    ("127.000.0.1:1", None),  # leading zeros are not an IP literal in Python >= 3.9.5
])
def test_addresses_are_ip_literals_in_envoys_spelling(given: str, canonical: str | None) -> None:
    if canonical is None:
        with pytest.raises(RegistrationError):
            normalize_address(given)
    else:
        assert normalize_address(given)[2] == canonical


@pytest.mark.parametrize("bad", ["vllm-0.vllm:8000", "10.0.0.7", "10.0.0.7:0",
                                 "10.0.0.7:70000", "10.0.0.7:http", ":8000"])
def test_a_name_or_a_bad_port_is_refused(bad: str) -> None:
    with pytest.raises(RegistrationError, match="address"):
        normalize_address(bad)


def test_the_record_an_agent_writes_parses_back_to_the_same_replica() -> None:
    rec = registration_record("10.0.0.7:8000", FP, ["m"], agent="node/1")
    rep = parse_registration("10.0.0.7:8000", json.dumps(rec).encode())
    assert rep.address == "10.0.0.7:8000" and rep.models == ("m",)
    assert rep.fingerprint.weights_revision == "m@sha256:1"
    assert rep.fingerprint.kv_cache_dtype == "fp16"


@pytest.mark.parametrize("fp, problem", [
    ({}, "weights_revision"),
    ({"weights_revision": "x", "colour": "red"}, "colour"),
    ({"weights_revision": "x", "tensor_parallel_size": 0}, "tensor_parallel_size"),
])
def test_an_agent_refuses_a_bad_fingerprint_before_etcd(fp: dict[str, Any], problem: str) -> None:
    with pytest.raises(RegistrationError, match=problem):
        registration_record("10.0.0.7:8000", fp)


@pytest.mark.parametrize("raw, problem", [
    (b"{not json", "not JSON"),
    (b"[1]", "JSON object"),
    (_raw(extra=1), "unknown registration field"),
    (_raw(address=None), "address missing"),
    (_raw(address="10.0.0.8:8000"), "another address"),
    (_raw(fingerprint=None), "fingerprint missing"),
    (_raw(fingerprint={"weights_revision": ""}), "weights_revision"),
    (_raw(models="m"), "models"),
    (_raw(address="vllm-0:8000"), "IP literal"),
])
def test_a_bad_registration_is_refused_naming_why(raw: bytes, problem: str) -> None:
    with pytest.raises(RegistrationError, match=problem):
        parse_registration("10.0.0.7:8000", raw)


def test_the_pool_leaves_out_what_does_not_parse_and_says_so() -> None:
    good2 = _raw(address="10.0.0.2:8000")
    pool, refused = pool_from_registrations({
        "10.0.0.7:8000": _raw(), "10.0.0.2:8000": good2, "10.0.0.9:8000": b"junk"})
    assert [r.address for r in pool.replicas] == ["10.0.0.2:8000", "10.0.0.7:8000"]
    assert len(refused) == 1 and refused[0].startswith("10.0.0.9:8000")
    assert endpoints(pool) == [("10.0.0.2", 8000), ("10.0.0.7", 8000)]
    # Both carry the same fingerprint: one compatible group, a retry may cross them.
    assert list(pool.groups("m").values()) == [["10.0.0.2:8000", "10.0.0.7:8000"]]
    empty, none = pool_from_registrations({})
    assert not empty.enabled and none == []


def test_different_fingerprints_never_share_a_group() -> None:
    other = _raw(address="10.0.0.2:8000", fingerprint={"weights_revision": "m@sha256:2"})
    pool, _ = pool_from_registrations({"10.0.0.7:8000": _raw(), "10.0.0.2:8000": other})
    assert sorted(map(len, pool.groups("m").values())) == [1, 1]


# --- the agent ---------------------------------------------------------------------------

POLICY = AgentPolicy(ttl_s=9, healthy_threshold=2, unhealthy_threshold=3)


def _run(agent: Agent, steps: list[tuple[float, bool, bool | None]]
         ) -> list[AgentAction | None]:
    """(time, probe ok, outcome of the action if one is taken) -> the actions taken."""
    out = []
    for now, ok, outcome in steps:
        a = agent.probed(ok, now)
        out.append(a)
        if a is not None:
            agent.done(a, outcome, now)
    return out


def test_registers_after_the_healthy_threshold_and_keeps_alive_three_times_per_ttl() -> None:
    a = Agent(POLICY)
    acts = _run(a, [(0, True, None), (1, True, True), (2, True, None), (3, True, None),
                    (4, True, True), (5, True, None), (7, True, True)])
    R, K = AgentAction.REGISTER, AgentAction.KEEP_ALIVE
    assert acts == [None, R, None, None, K, None, K]
    assert a.registered


def test_withdraws_only_after_the_unhealthy_threshold() -> None:
    a = Agent(POLICY)
    _run(a, [(0, True, None), (0.5, True, True)])
    acts = _run(a, [(1, False, None), (2, False, None), (3, False, True)])
    assert acts == [None, None, AgentAction.DEREGISTER]
    assert not a.registered
    # Back: registered again after healthy_threshold good probes, a new registration.
    assert _run(a, [(4, True, None), (5, True, True)]) == [None, AgentAction.REGISTER]


def test_one_good_probe_resets_the_failures() -> None:
    a = Agent(POLICY)
    _run(a, [(0, True, None), (0.5, True, True)])
    acts = _run(a, [(1, False, None), (2, False, None), (2.5, True, None), (3, False, None),
                    (3.5, False, None)])
    assert AgentAction.DEREGISTER not in acts and a.registered


def test_a_failing_server_keeps_its_lease_alive_until_judged() -> None:
    # Failing probes below the threshold must not let the registration lapse by neglect.
    a = Agent(AgentPolicy(ttl_s=3, healthy_threshold=1, unhealthy_threshold=100))
    _run(a, [(0, True, True)])
    acts = _run(a, [(1.5, False, True)])
    assert acts == [AgentAction.KEEP_ALIVE]


def test_a_lapsed_lease_is_registered_again_and_an_unanswered_one_is_kept() -> None:
    a = Agent(AgentPolicy(ttl_s=3, healthy_threshold=1, unhealthy_threshold=2))
    _run(a, [(0, True, True)])
    assert _run(a, [(1, True, None)]) == [AgentAction.KEEP_ALIVE]  # etcd did not answer
    assert a.registered
    assert _run(a, [(2, True, False)]) == [AgentAction.KEEP_ALIVE]  # etcd: lease gone
    assert not a.registered
    assert _run(a, [(3, True, True)]) == [AgentAction.REGISTER]


def test_an_unanswered_registration_is_not_made() -> None:
    a = Agent(AgentPolicy(ttl_s=3, healthy_threshold=1, unhealthy_threshold=2))
    assert _run(a, [(0, True, None), (1, True, True)]) == [AgentAction.REGISTER] * 2


def test_stopping_withdraws_only_what_is_registered() -> None:
    a = Agent(POLICY)
    assert a.stop() is None
    _run(a, [(0, True, None), (1, True, True)])
    assert a.stop() is AgentAction.DEREGISTER


def test_every_probe_sequence_keeps_the_agent_consistent() -> None:
    """Exhaustive over 8 probes x outcomes: never withdraws unregistered, never registers
    twice without a loss in between, and its state matches the last outcome."""
    import itertools
    p = AgentPolicy(ttl_s=3, healthy_threshold=2, unhealthy_threshold=2)
    for probes in itertools.product([True, False], repeat=8):
        for outcomes in itertools.product([True, False, None], repeat=2):
            a = Agent(p)
            i = 0
            for t, ok in enumerate(probes):
                was = a.registered
                act = a.probed(ok, float(t))
                if act is None:
                    continue
                assert (act is AgentAction.REGISTER) == (not was)
                res = outcomes[i % 2]
                i += 1
                a.done(act, res, float(t))
                if act is AgentAction.DEREGISTER:
                    assert not a.registered
                elif act is AgentAction.REGISTER:
                    assert a.registered == bool(res)
                else:
                    assert a.registered == (res is not False)

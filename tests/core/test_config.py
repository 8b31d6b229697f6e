"""Configuration: the defaults, the mission's policy verbatim, and errors naming their field."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from extproc.core.config import (
    Config,
    ConfigError,
    Policy,
    apply_env_overrides,
    load_config,
)

# The policy exactly as MISSION.md ("The policy: short and strict") states it.
MISSION_POLICY = """
on_upstream_failure:
  before_first_delta:
    require: [source_attempt_fenced, retry_budget_available]
    action: retry_prefill_on_healthy_replica
    max_attempts: 2
  after_first_delta:
    action: terminate_stream
    client_error: upstream_decode_interrupted
    automatic_retry: false
  uncertain_source_liveness:
    action: fence_source_attempt
    wait_for: cancel_ack_or_lease_expiry
    then: retry_only_if_no_delta_was_sent
"""


def mission() -> dict[str, Any]:
    return {"policy": yaml.safe_load(MISSION_POLICY)}


def with_value(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of `base` (the mission's policy by default) with one dotted path set."""
    raw = copy.deepcopy(base if base is not None else mission())
    *parents, leaf = path.split(".")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return raw


def test_defaults_are_valid() -> None:
    for raw in (None, {}):
        cfg = load_config(raw)
        assert cfg == Config()
    cfg = Config()
    assert cfg.policy.max_attempts == 2
    assert cfg.policy.after_first_delta.automatic_retry is False
    assert cfg.policy.after_first_delta.client_error == "upstream_decode_interrupted"
    assert "source_attempt_fenced" in cfg.policy.before_first_delta.require
    assert cfg.timeouts.fence_wait_s >= cfg.etcd.attempt_lease_ttl_s
    assert cfg.idempotency.required is False and cfg.tenancy.header is None


def test_the_missions_policy_loads_as_written() -> None:
    cfg = load_config(mission())
    assert cfg.policy == Policy()
    b = cfg.policy.before_first_delta
    assert b.require == ("source_attempt_fenced", "retry_budget_available")
    assert b.action == "retry_prefill_on_healthy_replica"
    assert b.max_attempts == 2
    u = cfg.policy.uncertain_source_liveness
    assert (u.action, u.wait_for, u.then) == (
        "fence_source_attempt", "cancel_ack_or_lease_expiry", "retry_only_if_no_delta_was_sent")


def test_a_full_valid_configuration() -> None:
    raw = mission()
    raw.update({
        "server": {"listen": "unix:/run/extproc.sock", "gateway_id": "gw-7",
                   "log_level": "DEBUG"},
        "etcd": {"endpoints": ["etcd-0:2379", "10.0.0.2:2379"], "timeout_s": 0.5,
                 "prefix": "/gw", "attempt_lease_ttl_s": 5, "journal_retention_s": 3600},
        "timeouts": {"first_delta_s": 60, "stall_after_first_delta_s": 2.5,
                     "access_log_wait_s": 0, "fence_wait_s": 5},
        "limits": {"max_request_body_bytes": 2048, "max_idempotency_key_length": 64,
                   "max_buffered_response_bytes": 8192},
        "idempotency": {"required": True},
        "tenancy": {"header": "X-Tenant"},
    })
    raw["policy"]["on_upstream_failure"]["before_first_delta"]["max_attempts"] = 10
    cfg = load_config(raw)
    assert cfg.etcd.endpoints == ("etcd-0:2379", "10.0.0.2:2379")
    assert cfg.timeouts.first_delta_s == 60.0 and isinstance(cfg.timeouts.first_delta_s, float)
    assert cfg.tenancy.header == "x-tenant"  # header names are compared lower-case
    assert cfg.idempotency.required is True
    assert cfg.policy.max_attempts == 10


POLICY = "policy.on_upstream_failure"
BAD: list[tuple[str, Any, str]] = [
    # (dotted path to set, value, the path the message must start with)
    (f"{POLICY}.after_first_delta.automatic_retry", True,
     f"{POLICY}.after_first_delta.automatic_retry"),
    (f"{POLICY}.after_first_delta.automatic_retry", "no",
     f"{POLICY}.after_first_delta.automatic_retry"),
    (f"{POLICY}.after_first_delta.action", "retry_prefill_on_healthy_replica",
     f"{POLICY}.after_first_delta.action"),
    (f"{POLICY}.after_first_delta.client_error", "upstream_error",
     f"{POLICY}.after_first_delta.client_error"),
    (f"{POLICY}.before_first_delta.max_attempts", 0,
     f"{POLICY}.before_first_delta.max_attempts"),
    (f"{POLICY}.before_first_delta.max_attempts", 11,
     f"{POLICY}.before_first_delta.max_attempts"),
    (f"{POLICY}.before_first_delta.max_attempts", True,
     f"{POLICY}.before_first_delta.max_attempts"),
    (f"{POLICY}.before_first_delta.max_attempts", 2.0,
     f"{POLICY}.before_first_delta.max_attempts"),
    (f"{POLICY}.before_first_delta.require", ["retry_budget_available"],
     f"{POLICY}.before_first_delta.require"),
    (f"{POLICY}.before_first_delta.require", ["source_attempt_fenced"],
     f"{POLICY}.before_first_delta.require"),
    (f"{POLICY}.before_first_delta.action", "terminate_request",
     f"{POLICY}.before_first_delta.action"),
    (f"{POLICY}.uncertain_source_liveness.then", "terminate_request",
     f"{POLICY}.uncertain_source_liveness.then"),
    (f"{POLICY}.before_first_delta.require", [],
     f"{POLICY}.before_first_delta.require"),
    (f"{POLICY}.before_first_delta.require", ["source_attempt_fenced", "vibes"],
     f"{POLICY}.before_first_delta.require[1]"),
    (f"{POLICY}.before_first_delta.require", ["source_attempt_fenced", 3],
     f"{POLICY}.before_first_delta.require[1]"),
    (f"{POLICY}.before_first_delta.action", "continue_decode",
     f"{POLICY}.before_first_delta.action"),
    (f"{POLICY}.before_first_delta.colour", "blue", f"{POLICY}.before_first_delta.colour"),
    (f"{POLICY}.uncertain_source_liveness.wait_for", "heartbeat_timeout",
     f"{POLICY}.uncertain_source_liveness.wait_for"),
    (f"{POLICY}.uncertain_source_liveness.then", "retry",
     f"{POLICY}.uncertain_source_liveness.then"),
    (f"{POLICY}.after_first_delta", ["terminate_stream"], f"{POLICY}.after_first_delta"),
    (f"{POLICY}.extra_rule", {}, f"{POLICY}.extra_rule"),
    ("policy.on_upstream_failur", {}, "policy.on_upstream_failur"),
    ("etcd.endpoints", ["localhost"], "etcd.endpoints[0]"),
    ("etcd.endpoints", ["a:1", "b:http"], "etcd.endpoints[1]"),
    ("etcd.endpoints", [":2379"], "etcd.endpoints[0]"),
    ("etcd.endpoints", [], "etcd.endpoints"),
    ("etcd.endpoints", [""], "etcd.endpoints[0]"),
    ("etcd.prefix", "llmgw", "etcd.prefix"),
    ("etcd.prefix", "/llmgw/", "etcd.prefix"),
    ("etcd.attempt_lease_ttl_s", 1, "etcd.attempt_lease_ttl_s"),
    ("etcd.timeout_s", 0, "etcd.timeout_s"),
    ("timeouts.first_delta_s", -1, "timeouts.first_delta_s"),
    ("timeouts.first_delta_s", "30s", "timeouts.first_delta_s"),
    ("timeouts.stall_after_first_delta_s", 0, "timeouts.stall_after_first_delta_s"),
    ("timeouts.fence_wait_s", 5, "timeouts.fence_wait_s"),  # < the default lease TTL 10
    ("timeouts.access_log_wait_s", 11, "timeouts.access_log_wait_s"),
    ("limits.max_request_body_bytes", 10, "limits.max_request_body_bytes"),
    ("limits.max_idempotency_key_length", 4096, "limits.max_idempotency_key_length"),
    ("idempotency.required", "yes", "idempotency.required"),
    ("tenancy.header", "", "tenancy.header"),
    ("server.log_level", "TRACE", "server.log_level"),
    ("server.listen", "", "server.listen"),
    ("server.port", 50051, "server.port"),
    ("bogus", 1, "bogus"),
]


@pytest.mark.parametrize(("path", "value", "named"), BAD,
                         ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_an_invalid_value_names_its_dotted_path(path: str, value: Any, named: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(with_value(path, value))
    assert exc.value.path == named
    assert str(exc.value).startswith(named + ": ")


@pytest.mark.parametrize("section", ["server", "etcd", "policy"])
def test_a_section_that_is_not_a_mapping(section: str) -> None:
    with pytest.raises(ConfigError, match=f"^{section}: must be a mapping"):
        load_config({section: "yes"})


def test_root_that_is_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"^<root>: "):
        load_config(["server"])  # type: ignore[arg-type]


def test_fence_wait_relative_to_the_lease_ttl() -> None:
    ok = load_config({"etcd": {"attempt_lease_ttl_s": 20}, "timeouts": {"fence_wait_s": 20}})
    assert ok.timeouts.fence_wait_s == 20.0
    with pytest.raises(ConfigError, match=r"^timeouts\.fence_wait_s: .*\(20\)"):
        load_config({"etcd": {"attempt_lease_ttl_s": 20}, "timeouts": {"fence_wait_s": 19.9}})


def test_require_must_list_what_is_enforced() -> None:
    # Both requirements are always enforced, so a list without one would not mean it.
    with pytest.raises(ConfigError, match="re-prefill storm"):
        load_config(with_value(f"{POLICY}.before_first_delta.require",
                               ["source_attempt_fenced"]))
    with pytest.raises(ConfigError, match="max_attempts: 1"):
        load_config(with_value(f"{POLICY}.before_first_delta.action", "terminate_request"))
    cfg = load_config(with_value(f"{POLICY}.uncertain_source_liveness.wait_for",
                                 "lease_expiry"))
    assert cfg.policy.uncertain_source_liveness.wait_for == "lease_expiry"


# --- environment overrides ----------------------------------------------------------------


def test_env_overrides_numbers_and_lists() -> None:
    raw = mission()
    env = {"EXTPROC_TIMEOUTS__FIRST_DELTA_S": "7", "EXTPROC_ETCD__ENDPOINTS": "a:1, b:2",
           "EXTPROC_IDEMPOTENCY__REQUIRED": "true", "EXTPROC_TENANCY__HEADER": "null",
           "PATH": "/usr/bin", "EXTPROC_NOSECTION": "x"}
    merged = apply_env_overrides(raw, env)
    assert merged["timeouts"] == {"first_delta_s": 7}
    assert "nosection" not in merged and "PATH" not in merged
    cfg = load_config(merged)
    assert cfg.timeouts.first_delta_s == 7.0
    assert cfg.etcd.endpoints == ("a:1", "b:2")
    assert cfg.idempotency.required is True
    assert cfg.tenancy.header is None
    assert cfg.policy == Policy()


def test_env_overrides_do_not_mutate_the_input() -> None:
    raw = {"timeouts": {"first_delta_s": 30}}
    before = copy.deepcopy(raw)
    merged = apply_env_overrides(raw, {"EXTPROC_TIMEOUTS__FIRST_DELTA_S": "7.5"})
    assert raw == before
    assert merged["timeouts"]["first_delta_s"] == 7.5


def test_env_override_errors_still_name_the_field() -> None:
    merged = apply_env_overrides({}, {"EXTPROC_TIMEOUTS__FIRST_DELTA_S": "-3"})
    with pytest.raises(ConfigError, match=r"^timeouts\.first_delta_s: "):
        load_config(merged)
    merged = apply_env_overrides({}, {"EXTPROC_TIMEOUTS__NOPE": "1"})
    with pytest.raises(ConfigError, match=r"^timeouts\.nope: unknown field"):
        load_config(merged)


@pytest.mark.parametrize("name", ["EXTPROC_A__B__C", "EXTPROC___X", "EXTPROC_X__",
                                  "EXTPROC_POLICY__ON_UPSTREAM_FAILURE__X"])
def test_a_malformed_override_name_is_rejected(name: str) -> None:
    with pytest.raises(ConfigError) as exc:
        apply_env_overrides({}, {name: "1"})
    assert exc.value.path == name


def test_an_override_of_a_scalar_section_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"^server: "):
        apply_env_overrides({"server": "x"}, {"EXTPROC_SERVER__LISTEN": "1.2.3.4:1"})


def test_a_numeric_looking_string_override() -> None:
    cfg = load_config(apply_env_overrides({}, {"EXTPROC_SERVER__GATEWAY_ID": "7"}))
    assert cfg.server.gateway_id == "7"


def test_override_into_an_empty_yaml_section() -> None:
    raw = yaml.safe_load("etcd:\n")
    assert load_config(raw).etcd.endpoints == ("127.0.0.1:2379",)
    cfg = load_config(apply_env_overrides(raw, {"EXTPROC_ETCD__ENDPOINTS": "e:1"}))
    assert cfg.etcd.endpoints == ("e:1",)


def test_lease_expiry_policy_needs_first_delta_time_for_the_wait() -> None:
    raw = with_value(f"{POLICY}.uncertain_source_liveness.wait_for", "lease_expiry")
    raw["timeouts"] = {"first_delta_s": 10.0}
    with pytest.raises(ConfigError, match=r"^timeouts\.first_delta_s: must be >= "
                                          r"etcd\.attempt_lease_ttl_s \+ 1 \(11\)"):
        load_config(raw)
    raw["timeouts"] = {"first_delta_s": 11.0}
    assert load_config(raw).timeouts.first_delta_s == 11.0

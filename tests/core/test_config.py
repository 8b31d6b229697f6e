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
    ("server.transport", "grpc", "server.transport"),
    ("server.transport", "", "server.transport"),
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


def test_the_transport_defaults_to_grpcio_and_takes_grpclib_from_file_or_env() -> None:
    assert load_config({}).server.transport == "grpcio"
    assert load_config({"server": {"transport": "grpclib"}}).server.transport == "grpclib"
    raw = apply_env_overrides({}, {"EXTPROC_SERVER__TRANSPORT": "grpclib"})
    assert load_config(raw).server.transport == "grpclib"


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


# --- server.readiness_grace_s and server.metrics_listen (decision 0016) ----------------


def test_readiness_and_metrics_defaults() -> None:
    s = load_config({}).server
    assert s.readiness_grace_s == 5.0
    assert s.metrics_listen is None


@pytest.mark.parametrize("addr", ["127.0.0.1:9090", "0.0.0.0:1", "[::1]:65535",
                                  "metrics.example:9464", "[::]:9090"])
def test_metrics_listen_accepts_host_port(addr: str) -> None:
    cfg = load_config({"server": {"metrics_listen": addr, "readiness_grace_s": 0.5}})
    assert cfg.server.metrics_listen == addr
    assert cfg.server.readiness_grace_s == 0.5


@pytest.mark.parametrize("addr", ["9090", ":9090", "127.0.0.1:", "127.0.0.1:0",
                                  "127.0.0.1:65536", "::1:9090", "[::1:9090", "[]:9090",
                                  "unix:/tmp/m.sock", "127.0.0.1:http", 9090, ""])
def test_metrics_listen_rejects_what_is_not_host_port(addr: Any) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"server": {"metrics_listen": addr}})
    assert ei.value.path == "server.metrics_listen"


def test_metrics_listen_must_not_be_the_grpc_listener() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"server": {"listen": "127.0.0.1:50051",
                                "metrics_listen": "127.0.0.1:50051"}})
    assert ei.value.path == "server.metrics_listen" and "server.listen" in str(ei.value)


@pytest.mark.parametrize("grace", [0.4, 0, -1, 601, "5s", True, None])
def test_readiness_grace_bounds(grace: Any) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config({"server": {"readiness_grace_s": grace}})
    assert ei.value.path == "server.readiness_grace_s"


def test_readiness_and_metrics_from_env_overrides() -> None:
    raw = apply_env_overrides({}, {"EXTPROC_SERVER__METRICS_LISTEN": "0.0.0.0:9464",
                                   "EXTPROC_SERVER__READINESS_GRACE_S": "2.5"})
    s = load_config(raw).server
    assert s.metrics_listen == "0.0.0.0:9464" and s.readiness_grace_s == 2.5
    # null switches the endpoint off again
    raw = apply_env_overrides({"server": {"metrics_listen": "127.0.0.1:9090"}},
                              {"EXTPROC_SERVER__METRICS_LISTEN": "null"})
    assert load_config(raw).server.metrics_listen is None


def test_live_pool_discovery() -> None:
    assert load_config({}).pool.discovery == "static"
    cfg = load_config({"pool": {"discovery": "registry", "registration_ttl_s": 5}})
    assert cfg.pool.discovery == "registry" and cfg.pool.registration_ttl_s == 5
    with pytest.raises(ConfigError, match=r"pool\.discovery"):
        load_config({"pool": {"discovery": "kubernetes"}})
    with pytest.raises(ConfigError, match=r"pool\.registration_ttl_s"):
        load_config({"pool": {"discovery": "registry", "registration_ttl_s": 1}})
    # Replicas in the file and replicas registering themselves: one source, never both.
    with pytest.raises(ConfigError, match=r"pool\.replicas.*registry"):
        load_config({"pool": {"discovery": "registry", "replicas": [
            {"address": "10.0.0.1:8000", "fingerprint": {"weights_revision": "w"}}]}})


# --- etcd TLS, auth and endpoints (decision 0013) ---------------------------------------


def test_etcd_tls_and_auth_defaults_are_off() -> None:
    e = load_config({}).etcd
    assert not e.tls.enabled and e.tls.ca_file is None and e.tls.cert_file is None
    assert e.tls.key_file is None and e.tls.server_name is None
    assert not e.auth.enabled and e.auth.username_file is None and e.auth.password_file is None


def test_etcd_tls_and_auth_in_full() -> None:
    e = load_config({"etcd": {
        "tls": {"enabled": True, "ca_file": "/etc/extproc/etcd-tls/ca.crt",
                "cert_file": "/etc/extproc/etcd-tls/tls.crt",
                "key_file": "/etc/extproc/etcd-tls/tls.key", "server_name": "etcd.internal"},
        "auth": {"username_file": "/etc/extproc/etcd-auth/username",
                 "password_file": "/etc/extproc/etcd-auth/password"}}}).etcd
    assert e.tls.enabled and e.tls.ca_file == "/etc/extproc/etcd-tls/ca.crt"
    assert e.tls.cert_file == "/etc/extproc/etcd-tls/tls.crt"
    assert e.tls.key_file == "/etc/extproc/etcd-tls/tls.key"
    assert e.tls.server_name == "etcd.internal"
    assert e.auth.enabled and e.auth.username_file == "/etc/extproc/etcd-auth/username"
    assert e.auth.password_file == "/etc/extproc/etcd-auth/password"
    # TLS with the system's roots and no client certificate is valid too.
    assert load_config({"etcd": {"tls": {"enabled": True}}}).etcd.tls.ca_file is None


@pytest.mark.parametrize(("etcd", "named", "says"), [
    ({"tls": {"enabled": True, "cert_file": "/c"}}, "etcd.tls.key_file",
     "must be set with etcd.tls.cert_file"),
    ({"tls": {"enabled": True, "key_file": "/k"}}, "etcd.tls.cert_file",
     "must be set with etcd.tls.key_file"),
    ({"tls": {"ca_file": "/ca"}}, "etcd.tls.enabled", "must be true when etcd.tls.ca_file"),
    ({"tls": {"enabled": False, "cert_file": "/c", "key_file": "/k"}}, "etcd.tls.enabled",
     "must be true when etcd.tls.cert_file"),
    ({"tls": {"server_name": "x"}}, "etcd.tls.enabled", "must be true when etcd.tls.server_name"),
    ({"tls": {"enabled": "yes"}}, "etcd.tls.enabled", "must be true or false"),
    ({"tls": {"enabled": True, "ca_file": ""}}, "etcd.tls.ca_file", "non-empty string"),
    ({"tls": {"enabled": True, "ca": "/x"}}, "etcd.tls.ca", "unknown field"),
    ({"tls": "on"}, "etcd.tls", "must be a mapping"),
    ({"auth": {"username_file": "/u"}}, "etcd.auth.password_file",
     "must be set with etcd.auth.username_file"),
    ({"auth": {"password_file": "/p"}}, "etcd.auth.username_file",
     "must be set with etcd.auth.password_file"),
    ({"auth": {"username": "root"}}, "etcd.auth.username", "unknown field"),
])
def test_etcd_tls_and_auth_errors_name_the_field(etcd: dict[str, Any], named: str,
                                                 says: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({"etcd": etcd})
    assert exc.value.path == named and says in exc.value.problem


@pytest.mark.parametrize("ep", ["127.0.0.1:2379", "[::1]:2379", "[fd00::12]:2379",
                                "etcd-0.etcd.llm.svc:2379", "localhost:1"])
def test_etcd_endpoints_ipv4_ipv6_and_names(ep: str) -> None:
    eps = ("10.0.0.1:2379", ep, "etcd.example:2379")
    assert load_config({"etcd": {"endpoints": list(eps)}}).etcd.endpoints == eps


@pytest.mark.parametrize(("ep", "says"), [
    ("https://etcd:2379", "without a scheme"),
    ("::1:2379", "IPv6 address goes in brackets"),
    ("[::1:2379", "must be [IPv6]:port"),
    ("[]:2379", "must be [IPv6]:port"),
    ("etcd", "must be host:port"),
    ("etcd:0", "must be host:port"),
    ("etcd:70000", "must be host:port"),
])
def test_etcd_endpoint_errors_name_the_entry(ep: str, says: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({"etcd": {"endpoints": ["127.0.0.1:2379", ep]}})
    assert exc.value.path == "etcd.endpoints[1]" and says in exc.value.problem


def test_etcd_tls_and_auth_are_set_in_the_file_not_by_env_overrides() -> None:
    # Overrides reach section fields only (EXTPROC_SECTION__FIELD); nested sections such as
    # etcd.tls are set in the file (docs/configuration.md), endpoints by env as ever.
    with pytest.raises(ConfigError):
        apply_env_overrides({}, {"EXTPROC_ETCD__TLS__ENABLED": "true"})
    cfg = load_config(apply_env_overrides(
        {"etcd": {"tls": {"enabled": True}}},
        {"EXTPROC_ETCD__ENDPOINTS": "etcd-0.etcd:2379,[::1]:2379,10.0.0.7:2379"}))
    assert cfg.etcd.endpoints == ("etcd-0.etcd:2379", "[::1]:2379", "10.0.0.7:2379")
    assert cfg.etcd.tls.enabled


# --- the first-delta budget and the pool's health checks --------------------------------


def test_config_first_delta_total_and_pool_health() -> None:
    c = load_config({})
    assert c.timeouts.total_first_delta_s(c.policy.max_attempts) == 60.0
    assert c.policy.retry_budget.min_retry_concurrency == 10
    assert c.pool.health_check.path == "/health" and c.pool.outlier_detection.enabled
    c = load_config({"timeouts": {"first_delta_s": 5, "first_delta_total_s": 7}})
    assert c.timeouts.total_first_delta_s(2) == 7.0
    for raw, field in [
        ({"timeouts": {"first_delta_s": 5, "first_delta_total_s": 4}},
         "timeouts.first_delta_total_s"),
        ({"pool": {"health_check": {"path": "health"}}}, "pool.health_check.path"),
        ({"pool": {"health_check": {"interval": 1}}}, "pool.health_check.interval"),
        ({"pool": {"outlier_detection": {"consecutive_local_origin_failure": 0}}},
         "pool.outlier_detection.consecutive_local_origin_failure"),
        ({"pool": {"outlier_detection": {"base_ejection_time_s": 10,
                                         "max_ejection_time_s": 5}}},
         "pool.outlier_detection.max_ejection_time_s"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(raw)
        assert e.value.path == field


# --- the retry budget (decision 0023) -------------------------------------------------


def test_budget_config_defaults_and_keys() -> None:
    rb = load_config({}).policy.retry_budget
    assert (rb.fraction, rb.min_retry_concurrency, rb.in_flight_expiry_s) == (0.2, 10, 600.0)
    rb = load_config({"policy": {"retry_budget": {
        "fraction": 0.5, "min_retry_concurrency": 0, "in_flight_expiry_s": 30}}}
    ).policy.retry_budget
    assert (rb.fraction, rb.min_retry_concurrency, rb.in_flight_expiry_s) == (0.5, 0, 30.0)


@pytest.mark.parametrize(("key", "says"), [
    ("min_retries", "replaced by min_retry_concurrency"),
    ("window_s", "removed: the budget counts re-prefills in flight"),
])
def test_the_per_window_keys_are_refused_naming_what_replaced_them(key: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config({"policy": {"retry_budget": {key: 10}}})
    assert e.value.path == f"policy.retry_budget.{key}" and says in e.value.problem
    assert "decision 0023" in e.value.problem


@pytest.mark.parametrize(("raw", "path"), [
    ({"fraction": 1.5}, "policy.retry_budget.fraction"),
    ({"min_retry_concurrency": -1}, "policy.retry_budget.min_retry_concurrency"),
    ({"min_retry_concurrency": 2.5}, "policy.retry_budget.min_retry_concurrency"),
    ({"in_flight_expiry_s": 5}, "policy.retry_budget.in_flight_expiry_s"),
    ({"in_flight_expiry_s": 20}, "policy.retry_budget.in_flight_expiry_s"),  # < first_delta_s
    ({"bogus": 1}, "policy.retry_budget.bogus"),
])
def test_budget_config_errors_name_the_field(raw: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config({"policy": {"retry_budget": raw}, "timeouts": {"first_delta_s": 25}})
    assert e.value.path == path


def test_etcd_shards_absent_is_one_cluster_the_section_itself() -> None:
    cfg = load_config({"etcd": {"endpoints": ["10.0.0.1:2379"]}}).etcd
    assert cfg.shards == () and cfg.clusters() == (cfg,)
    assert load_config({"etcd": {"endpoints": ["10.0.0.1:2379"], "shards": []}}).etcd == cfg


def test_etcd_shards_take_their_connection_and_the_sections_other_fields() -> None:
    cfg = load_config({"etcd": {
        "endpoints": ["10.0.0.1:2379"], "prefix": "/gw", "timeout_s": 0.5,
        "attempt_lease_ttl_s": 7,
        "shards": [{"endpoints": ["10.0.1.1:2379", "10.0.1.2:2379"]},
                   {"endpoints": ["etcd-c:2379"],
                    "tls": {"enabled": True, "ca_file": "/ca-c"},
                    "auth": {"username_file": "/u", "password_file": "/p"}}]}}).etcd
    c0, c1, c2 = cfg.clusters()
    assert c0 is cfg
    assert c1.endpoints == ("10.0.1.1:2379", "10.0.1.2:2379") and not c1.tls.enabled
    assert c2.endpoints == ("etcd-c:2379",)
    assert c2.tls.ca_file == "/ca-c" and c2.auth.username_file == "/u"
    for c in (c1, c2):
        assert (c.prefix, c.timeout_s, c.attempt_lease_ttl_s, c.shards) == ("/gw", 0.5, 7, ())


@pytest.mark.parametrize(("shards", "named", "says"), [
    ("etcd-b:2379", "etcd.shards", "must be a list"),
    ([{}], "etcd.shards[0].endpoints", "must be set"),
    (["etcd-b:2379"], "etcd.shards[0]", "must be a mapping"),
    ([{"endpoints": ["etcd-b:2379"]}, {"endpoints": ["etcd-c"]}],
     "etcd.shards[1].endpoints[0]", "must be host:port"),
    ([{"endpoints": ["etcd-b:2379", "127.0.0.1:2379"]}], "etcd.shards[0].endpoints[1]",
     "already a member of etcd.endpoints's cluster"),
    ([{"endpoints": ["etcd-b:2379"]}, {"endpoints": ["etcd-b:2379"]}],
     "etcd.shards[1].endpoints[0]", "already a member of etcd.shards[0]'s cluster"),
    ([{"endpoints": ["etcd-b:2379"], "prefix": "/x"}], "etcd.shards[0].prefix",
     "unknown field"),
    ([{"endpoints": ["etcd-b:2379"], "tls": {"ca_file": "/ca"}}],
     "etcd.shards[0].tls.enabled", "must be true when etcd.shards[0].tls.ca_file"),
    ([{"endpoints": ["etcd-b:2379"], "auth": {"username_file": "/u"}}],
     "etcd.shards[0].auth.password_file", "must be set with etcd.shards[0].auth.username_file"),
])
def test_etcd_shards_errors_name_the_field(shards: Any, named: str, says: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config({"etcd": {"shards": shards}})
    assert exc.value.path == named and says in exc.value.problem

"""One validated configuration, the failover policy included.

Pure: it takes an already-parsed mapping (the CLI parses YAML and env overrides) so the
rules can be tested without files. Every error names the field by its dotted path, because
an operator reading a crash loop at 3 a.m. needs to know which line to fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .pool import FingerprintError, pool_from_config


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the field's dotted path."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


# --- the mission's policy -------------------------------------------------------------

BEFORE_REQUIRES = frozenset({"source_attempt_fenced", "retry_budget_available"})


@dataclass(frozen=True)
class BeforeFirstDelta:
    require: tuple[str, ...] = ("source_attempt_fenced", "retry_budget_available")
    action: str = "retry_prefill_on_healthy_replica"
    max_attempts: int = 2


@dataclass(frozen=True)
class AfterFirstDelta:
    action: str = "terminate_stream"
    client_error: str = "upstream_decode_interrupted"
    automatic_retry: bool = False


@dataclass(frozen=True)
class UncertainSourceLiveness:
    action: str = "fence_source_attempt"
    wait_for: str = "cancel_ack_or_lease_expiry"
    then: str = "retry_only_if_no_delta_was_sent"


@dataclass(frozen=True)
class RetryBudgetConfig:
    # Envoy's semantics, pool-wide (decision 0023): re-prefills in flight stay within
    # max(min_retry_concurrency, fraction x requests in flight).
    fraction: float = 0.2
    # Re-prefills that may always be in flight: a quiet pool can always fail over (one
    # frozen replica of three costs about one re-prefill per concurrent client before it
    # is found out: decision 0010).
    min_retry_concurrency: int = 10
    # An entry whose end never came (a lost end) stops counting this long after its start.
    in_flight_expiry_s: float = 600.0


# The per-window keys of decision 0010, refused at start-up with what replaced them.
RETRY_BUDGET_REPLACED = {
    "min_retries": "replaced by min_retry_concurrency: the budget counts re-prefills in "
                   "flight, not per window (decision 0023)",
    "window_s": "removed: the budget counts re-prefills in flight, not per window; an entry "
                "whose end never came stops counting after in_flight_expiry_s "
                "(decision 0023)",
}


@dataclass(frozen=True)
class RetryCostConfig:
    # Refuse a re-prefill estimated above this many prompt tokens (0: no limit).
    max_prompt_tokens: int = 0
    chars_per_token: float = 4.0


@dataclass(frozen=True)
class Policy:
    before_first_delta: BeforeFirstDelta = field(default_factory=BeforeFirstDelta)
    after_first_delta: AfterFirstDelta = field(default_factory=AfterFirstDelta)
    uncertain_source_liveness: UncertainSourceLiveness = field(
        default_factory=UncertainSourceLiveness
    )
    retry_budget: RetryBudgetConfig = field(default_factory=RetryBudgetConfig)
    retry_cost: RetryCostConfig = field(default_factory=RetryCostConfig)

    @property
    def max_attempts(self) -> int:
        return self.before_first_delta.max_attempts


# --- the rest of the configuration ------------------------------------------------------


@dataclass(frozen=True)
class EtcdTlsConfig:
    # TLS to etcd (decision 0013). Off: plaintext, and every other field must be unset.
    enabled: bool = False
    # CA bundle that etcd's server certificates must chain to; None: the system's roots.
    ca_file: str | None = None
    # Our client certificate and its key (etcd --client-cert-auth): both or neither.
    cert_file: str | None = None
    key_file: str | None = None
    # The name checked in every endpoint's certificate instead of the endpoint's own host.
    server_name: str | None = None


@dataclass(frozen=True)
class EtcdAuthConfig:
    # etcd user and password, each in a file (a Kubernetes Secret's `username` and
    # `password` keys as mounted): both or neither. Re-read at every authentication.
    username_file: str | None = None
    password_file: str | None = None

    @property
    def enabled(self) -> bool:
        return self.username_file is not None


@dataclass(frozen=True)
class EtcdConfig:
    # host:port each: IPv4 literals, [IPv6] literals or DNS names, in any mix.
    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    # Every etcd call carries this deadline: a frozen etcd must never hang a stream.
    timeout_s: float = 1.0
    # A request's intake (its record and attempt 1, one transaction) is sent again, to the
    # next member, until this much time has passed: etcd elects a new leader within about
    # one election timeout (1 s by default) plus a campaign, and a frozen member holds each
    # call for `timeout_s`. Safe to send again: a record that is already ours is success.
    resend_deadline_s: float = 3.0
    prefix: str = "/llmgw/v1"
    attempt_lease_ttl_s: int = 10
    journal_retention_s: int = 86400
    # The processor's own liveness lease: if it dies, its requests' `guard` keys vanish
    # and their records are settled as gateway_interrupted by the next reader.
    session_ttl_s: int = 15
    tls: EtcdTlsConfig = field(default_factory=EtcdTlsConfig)
    auth: EtcdAuthConfig = field(default_factory=EtcdAuthConfig)
    # More etcd clusters for the journal, sharded by request id (decision 0042): this
    # section is shard 0 (it also keeps the pool-wide keys), shards[i] is shard i + 1, each
    # with its own endpoints, TLS and auth and this section's other fields. Empty: one
    # cluster. The count is fixed for a deployment (changing it moves requests' records).
    shards: tuple[EtcdConfig, ...] = ()

    def clusters(self) -> tuple[EtcdConfig, ...]:
        """Every shard's connection, shard 0 (this section) first."""
        return (self, *self.shards)


@dataclass(frozen=True)
class TimeoutsConfig:
    # Hard limit on time to the first content delta, per attempt (Envoy's per_try_timeout).
    # Deliberately not short: a slow replica is not a dead one.
    first_delta_s: float = 30.0
    # After the first delta, silence longer than this ends the stream with the terminal
    # error event (the guard's watchdog).
    stall_after_first_delta_s: float = 15.0
    # How long the journal waits for Envoy's access-log entry naming the termination cause.
    access_log_wait_s: float = 0.5
    # Upper bound on waiting for an old attempt's lease to go before admitting a retry.
    fence_wait_s: float = 12.0
    # Soft expectation on time to the first delta: exceeding it is logged and recorded
    # (`slow: true`) but is NOT a failure; only first_delta_s fails an attempt over.
    soft_first_delta_s: float = 5.0
    # How often the guard checkpoints the delivered count while streaming (0: never).
    progress_interval_s: float = 2.0
    # The whole request's wait for its first delta, across every attempt (null: max_attempts
    # x first_delta_s). Once it has passed, the client gets `upstream_timeout` and no
    # further attempt starts (docs/failure-classes.md, "Bounds").
    first_delta_total_s: float | None = None
    # After a replica's agent said the attempt's first content delta left the replica
    # (decision 0034), how long the gate waits for it to arrive before it fails the attempt
    # as path lost (0: off). Only this positive evidence fails early; a slow replica whose
    # agent said nothing still has first_delta_s.
    source_grace_s: float = 0.5

    def total_first_delta_s(self, max_attempts: int) -> float:
        if self.first_delta_total_s is not None:
            return self.first_delta_total_s
        return self.first_delta_s * max_attempts


@dataclass(frozen=True)
class LimitsConfig:
    max_request_body_bytes: int = 1_048_576
    max_idempotency_key_length: int = 128
    max_buffered_response_bytes: int = 4_194_304


@dataclass(frozen=True)
class IdempotencyConfig:
    required: bool = False


@dataclass(frozen=True)
class TenancyConfig:
    # Request header naming the tenant; None means one tenant ("default").
    header: str | None = None
    # Or: a header carrying an API key (e.g. authorization); the tenant is its SHA-256.
    api_key_header: str | None = None


@dataclass(frozen=True)
class ToolsConfig:
    # Requests under this path prefix are server-side tool calls (the ledger applies).
    path_prefix: str = "/tools/"
    # Ledger entries expire with an etcd lease of this TTL (see docs/tools.md).
    ledger_ttl_s: int = 86400
    # Results up to this size are recorded and replayed; larger ones by digest only.
    max_result_bytes: int = 1_048_576
    # How long a duplicate waits for the first call's result before "in progress".
    wait_s: float = 10.0


@dataclass(frozen=True)
class AccountingConfig:
    """How `delivered_output_tokens` is counted (decision 0018)."""

    # Ask the engine for its running count on streaming chat / completions requests
    # (stream_options.continuous_usage_stats, vLLM and SGLang) and strip it from the chunks
    # the client did not ask for; off: content events are counted (exact: false).
    engine_usage: bool = True
    # model name -> a Hugging Face `tokenizer.json`, for streams whose engine gives no
    # running count (Responses, Messages): the delivered text is re-encoded. Needs the
    # `tokenizer` extra.
    tokenizers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class TelemetryConfig:
    # OTLP/gRPC collector for traces and metrics: "https://host:port" (TLS),
    # "http://host:port" or a bare "host:port" (plaintext); None: OTEL_EXPORTER_OTLP_*
    # decide, or telemetry is off (docs/telemetry.md).
    otlp_endpoint: str | None = None
    # The CA bundle to verify an https:// collector by (Envoy and the processor);
    # None: OTEL_EXPORTER_OTLP_CERTIFICATE, else the system's roots.
    otlp_ca_file: str | None = None
    # Head sampling of the traces that start at the gateway, 0..1; a client's traceparent
    # decides for its own trace (parent-based, Envoy and the processor alike). At 1.0, the
    # default, OTEL_TRACES_SAMPLER(_ARG) may set it instead.
    sampling_ratio: float = 1.0
    service_name: str = "llm-failover-extproc"
    # Which event traces to keep in etcd for `extproc replay`: failures | all | none.
    record_traces: str = "failures"
    # Per machine, in memory while its stream is open (decision 0009): the whole history of
    # a typical request up to and past its first delta; raise it to debug long streams.
    max_trace_bytes: int = 16384
    metrics_interval_s: float = 10.0


@dataclass(frozen=True)
class HealthCheckConfig:
    # Active HTTP health checks of every replica: Envoy's on the replicas cluster, and the
    # processor's own on the compatibility pool's hosts (it orders override_host lists).
    enabled: bool = True
    path: str = "/health"  # vLLM and SGLang serve it
    interval_s: float = 1.0
    timeout_s: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1


@dataclass(frozen=True)
class OutlierDetectionConfig:
    # Envoy's outlier detection on the replicas cluster, local-origin errors split out, and
    # the processor's passive view of the same evidence (extproc.core.health).
    enabled: bool = True
    # Refused, reset or timed-out attempts in a row before a host is ejected. One: a frozen
    # host's first per-try timeout ejects it (decision 0024); a live host that failed once
    # is back at its next good health check.
    consecutive_local_origin_failure: int = 1
    # 5xx answered by the replica (or by the gate for it) in a row; 429 never counts.
    consecutive_5xx: int = 5
    interval_s: float = 1.0
    base_ejection_time_s: float = 5.0
    max_ejection_time_s: float = 60.0
    max_ejection_percent: int = 50


@dataclass(frozen=True)
class PoolConfig:
    # Replicas and their compatibility fingerprints (extproc.core.pool). Empty: one
    # undifferentiated pool (Envoy's round robin, any replica may serve a retry).
    replicas: tuple[Any, ...] = ()
    health_check: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    outlier_detection: OutlierDetectionConfig = field(default_factory=OutlierDetectionConfig)
    # static: the replicas above (or Envoy's own list); registry: replicas register
    # themselves in etcd (`extproc register`), the processor serves them to Envoy over EDS.
    discovery: str = "static"
    # A registration lapses this long after its agent stopped renewing it (docs/pool-membership.md).
    registration_ttl_s: int = 10
    # Envoy's panic threshold on the replicas cluster, percent: below this share of healthy
    # hosts Envoy balances over every host, healthy or not. 0: never; one healthy replica
    # takes all the traffic while it has room (decision 0024).
    healthy_panic_threshold: float = 0.0
    # Attempts Envoy may make beyond policy.max_attempts for attempts that never reached a
    # replica (connection refused: no byte sent); they do not count against max_attempts.
    unreached_attempts: int = 2


@dataclass(frozen=True)
class ServerConfig:
    # "host:port" for TCP, or "unix:/path" for a Unix domain socket.
    listen: str = "127.0.0.1:50051"
    gateway_id: str = "gw-1"
    log_level: str = "INFO"
    # Readiness (gRPC health service ""): NOT_SERVING until etcd first answered, and again
    # once it has not answered for longer than this (docs/decisions/0016).
    readiness_grace_s: float = 5.0
    # "host:port" serving Prometheus text exposition at GET /metrics; None: no endpoint.
    metrics_listen: str | None = None
    # The gRPC stack serving Envoy: "grpcio" (grpc.aio) or "grpclib" (pure asyncio over h2).
    # Same services, same behaviour; grpclib costs less per message (decision 0020).
    transport: str = "grpcio"


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    idempotency: IdempotencyConfig = field(default_factory=IdempotencyConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    policy: Policy = field(default_factory=Policy)
    accounting: AccountingConfig = field(default_factory=AccountingConfig)


# --- validation -----------------------------------------------------------------------


class _Reader:
    """Reads one mapping section, remembering which keys were consumed."""

    def __init__(self, raw: object, path: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(path or "<root>", f"must be a mapping, got {type(raw).__name__}")
        self.raw: Mapping[str, Any] = raw
        self.path = path
        self.used: set[str] = set()

    def _p(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def section(self, key: str) -> _Reader:
        self.used.add(key)
        return _Reader(self.raw.get(key), self._p(key))

    def str_(self, key: str, default: str, choices: frozenset[str] | None = None) -> str:
        self.used.add(key)
        v = self.raw.get(key, default)
        if isinstance(v, int | float) and not isinstance(v, bool):
            v = str(v)  # e.g. gateway_id: 7, or a numeric env override
        if not isinstance(v, str) or not v:
            raise ConfigError(self._p(key), f"must be a non-empty string, got {v!r}")
        if choices is not None and v not in choices:
            raise ConfigError(self._p(key), f"must be one of {sorted(choices)}, got {v!r}")
        return v

    def opt_str(self, key: str, default: str | None) -> str | None:
        self.used.add(key)
        v = self.raw.get(key, default)
        if v is None:
            return None
        if not isinstance(v, str) or not v:
            raise ConfigError(self._p(key), f"must be a non-empty string or null, got {v!r}")
        return v

    def opt_float(self, key: str, default: float | None, lo: float, hi: float) -> float | None:
        if self.raw.get(key, default) is None:
            self.used.add(key)
            return None
        return self.float_(key, default if default is not None else lo, lo, hi)

    def bool_(self, key: str, default: bool) -> bool:
        self.used.add(key)
        v = self.raw.get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(self._p(key), f"must be true or false, got {v!r}")
        return v

    def int_(self, key: str, default: int, lo: int, hi: int) -> int:
        self.used.add(key)
        v = self.raw.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(self._p(key), f"must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise ConfigError(self._p(key), f"must be between {lo} and {hi}, got {v}")
        return v

    def float_(self, key: str, default: float, lo: float, hi: float) -> float:
        self.used.add(key)
        v = self.raw.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ConfigError(self._p(key), f"must be a number, got {v!r}")
        if not lo <= float(v) <= hi:
            raise ConfigError(self._p(key), f"must be between {lo} and {hi}, got {v}")
        return float(v)

    def str_list(self, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        self.used.add(key)
        v = self.raw.get(key, list(default))
        if isinstance(v, str):
            v = [s.strip() for s in v.split(",") if s.strip()]
        if not isinstance(v, list | tuple) or not v:
            raise ConfigError(self._p(key), f"must be a non-empty list of strings, got {v!r}")
        for i, item in enumerate(v):
            if not isinstance(item, str) or not item:
                raise ConfigError(f"{self._p(key)}[{i}]",
                                  f"must be a non-empty string, got {item!r}")
        return tuple(v)

    def done(self) -> None:
        unknown = sorted(set(self.raw) - self.used)
        if unknown:
            raise ConfigError(self._p(unknown[0]), "unknown field")


def _policy(outer: _Reader) -> Policy:
    # The mission's YAML verbatim: policy.on_upstream_failure.{before,after,uncertain...}.
    r = outer.section("on_upstream_failure")
    b = r.section("before_first_delta")
    require = b.str_list("require", BeforeFirstDelta.require)
    for i, item in enumerate(require):
        if item not in BEFORE_REQUIRES:
            raise ConfigError(
                f"{b.path}.require[{i}]", f"must be one of {sorted(BEFORE_REQUIRES)}, got {item!r}"
            )
    for needed, why in (("source_attempt_fenced",
                         "retrying without a fence is how two live attempts happen"),
                        ("retry_budget_available",
                         "without the budget a mass failure becomes a re-prefill storm")):
        # Both are always enforced: a list without one would say something that is not so.
        if needed not in require:
            raise ConfigError(f"{b.path}.require", f"must include {needed}: {why}")
    action = b.str_("action", BeforeFirstDelta.action)
    if action != BeforeFirstDelta.action:
        hint = " (to never retry, set max_attempts: 1)" if action == "terminate_request" else ""
        raise ConfigError(f"{b.path}.action",
                          f"must be {BeforeFirstDelta.action!r}, got {action!r}{hint}")
    before = BeforeFirstDelta(
        require=require, action=action,
        max_attempts=b.int_("max_attempts", BeforeFirstDelta.max_attempts, 1, 10),
    )
    b.done()
    a = r.section("after_first_delta")
    after = AfterFirstDelta(
        action=a.str_("action", AfterFirstDelta.action, frozenset({AfterFirstDelta.action})),
        client_error=a.str_("client_error", AfterFirstDelta.client_error,
                            frozenset({AfterFirstDelta.client_error})),
        automatic_retry=a.bool_("automatic_retry", AfterFirstDelta.automatic_retry),
    )
    if after.automatic_retry:
        # No verified decode-state transfer exists: a retry here would stitch two runs.
        raise ConfigError(f"{a.path}.automatic_retry",
                          "must be false: a re-run after delivery would stitch two generations")
    a.done()
    u = r.section("uncertain_source_liveness")
    unc = UncertainSourceLiveness(
        action=u.str_("action", UncertainSourceLiveness.action,
                      frozenset({UncertainSourceLiveness.action})),
        # cancel_ack_or_lease_expiry: Envoy's confirmed close of the attempt counts as the
        # cancel ack (docs/fencing.md); lease_expiry: an uncertain end always waits.
        wait_for=u.str_("wait_for", UncertainSourceLiveness.wait_for,
                        frozenset({"cancel_ack_or_lease_expiry", "lease_expiry"})),
        then=u.str_("then", UncertainSourceLiveness.then,
                    frozenset({UncertainSourceLiveness.then})),
    )
    u.done()
    r.done()
    rb = outer.section("retry_budget")
    for old, what in RETRY_BUDGET_REPLACED.items():
        if old in rb.raw:
            raise ConfigError(f"{rb.path}.{old}", what)
    budget = RetryBudgetConfig(
        fraction=rb.float_("fraction", RetryBudgetConfig.fraction, 0.0, 1.0),
        min_retry_concurrency=rb.int_("min_retry_concurrency",
                                      RetryBudgetConfig.min_retry_concurrency, 0, 1_000_000),
        in_flight_expiry_s=rb.float_("in_flight_expiry_s",
                                     RetryBudgetConfig.in_flight_expiry_s, 10.0, 86400.0),
    )
    rb.done()
    rc = outer.section("retry_cost")
    cost = RetryCostConfig(
        max_prompt_tokens=rc.int_("max_prompt_tokens", RetryCostConfig.max_prompt_tokens, 0,
                                  10_000_000),
        chars_per_token=rc.float_("chars_per_token", RetryCostConfig.chars_per_token, 0.5,
                                  32.0),
    )
    rc.done()
    outer.done()
    return Policy(before_first_delta=before, after_first_delta=after,
                  uncertain_source_liveness=unc, retry_budget=budget, retry_cost=cost)


def _check_metrics_listen(addr: str, listen: str) -> None:
    # TCP only (Prometheus scrapes over HTTP): an IPv4 or DNS host, or an [IPv6] literal.
    host, sep, port = addr.rpartition(":")
    if host.startswith("[") != host.endswith("]"):
        host = ""
    if (not sep or not host or host == "[]" or not port.isdigit()
            or not 1 <= int(port) <= 65535 or ("[" not in host and ":" in host)):
        raise ConfigError("server.metrics_listen",
                          f"must be host:port (port 1-65535, [IPv6] in brackets), got {addr!r}")
    if addr == listen:
        raise ConfigError("server.metrics_listen", f"must differ from server.listen ({listen})")


def _etcd_tls(r: _Reader) -> EtcdTlsConfig:
    tls = EtcdTlsConfig(
        enabled=r.bool_("enabled", EtcdTlsConfig.enabled),
        ca_file=r.opt_str("ca_file", EtcdTlsConfig.ca_file),
        cert_file=r.opt_str("cert_file", EtcdTlsConfig.cert_file),
        key_file=r.opt_str("key_file", EtcdTlsConfig.key_file),
        server_name=r.opt_str("server_name", EtcdTlsConfig.server_name),
    )
    r.done()
    if (tls.cert_file is None) != (tls.key_file is None):
        given, missing = (("cert_file", "key_file") if tls.key_file is None
                          else ("key_file", "cert_file"))
        raise ConfigError(f"{r.path}.{missing}",
                          f"must be set with {r.path}.{given} (a client certificate and its "
                          "key go together)")
    if not tls.enabled:
        for name in ("ca_file", "cert_file", "key_file", "server_name"):
            if getattr(tls, name) is not None:
                # Set but ignored would dial etcd in plaintext while the file says TLS.
                raise ConfigError(f"{r.path}.enabled",
                                  f"must be true when {r.path}.{name} is set")
    return tls


def _etcd_auth(r: _Reader) -> EtcdAuthConfig:
    auth = EtcdAuthConfig(username_file=r.opt_str("username_file", None),
                          password_file=r.opt_str("password_file", None))
    r.done()
    if (auth.username_file is None) != (auth.password_file is None):
        given, missing = (("username_file", "password_file") if auth.password_file is None
                          else ("password_file", "username_file"))
        raise ConfigError(f"{r.path}.{missing}", f"must be set with {r.path}.{given}")
    return auth


def _etcd_shards(e: _Reader, main: EtcdConfig) -> tuple[EtcdConfig, ...]:
    """etcd.shards: each a cluster's endpoints, TLS and auth; the rest is the section's."""
    e.used.add("shards")
    raw = e.raw.get("shards")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("etcd.shards", f"must be a list of clusters, got {raw!r}")
    shards = []
    seen = {ep: "etcd.endpoints" for ep in main.endpoints}
    for i, item in enumerate(raw):
        r = _Reader(item, f"etcd.shards[{i}]")
        if "endpoints" not in r.raw:
            raise ConfigError(f"etcd.shards[{i}].endpoints", "must be set (a cluster's members)")
        shard = replace(main, endpoints=r.str_list("endpoints", main.endpoints),
                        tls=_etcd_tls(r.section("tls")), auth=_etcd_auth(r.section("auth")),
                        shards=())
        r.done()
        for j, ep in enumerate(shard.endpoints):
            _check_etcd_endpoint(f"etcd.shards[{i}].endpoints[{j}]", ep)
            if ep in seen:
                # Two shards on one cluster would each think they own its requests' keys.
                raise ConfigError(f"etcd.shards[{i}].endpoints[{j}]",
                                  f"{ep} is already a member of {seen[ep]}'s cluster")
            seen[ep] = f"etcd.shards[{i}]"
        shards.append(shard)
    return tuple(shards)


def _check_etcd_endpoint(path: str, ep: str) -> None:
    # host:port, the host an IPv4 literal, a DNS name or an [IPv6] literal.
    if "://" in ep:
        raise ConfigError(path, f"must be host:port without a scheme (TLS is "
                                f"etcd.tls.enabled), got {ep!r}")
    host, sep, port = ep.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(path, f"must be host:port, got {ep!r}")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3 or "]" in host[:-1]:
            raise ConfigError(path, f"must be [IPv6]:port, got {ep!r}")
    elif ":" in host or "]" in host:
        raise ConfigError(path, f"an IPv6 address goes in brackets ([::1]:2379), got {ep!r}")


def load_config(raw: Mapping[str, Any] | None) -> Config:
    """Validate a parsed configuration mapping; raise ConfigError naming the field."""
    root = _Reader(raw or {}, "")
    s = root.section("server")
    server = ServerConfig(
        listen=s.str_("listen", ServerConfig.listen),
        gateway_id=s.str_("gateway_id", ServerConfig.gateway_id),
        log_level=s.str_("log_level", ServerConfig.log_level,
                         frozenset({"DEBUG", "INFO", "WARNING", "ERROR"})),
        readiness_grace_s=s.float_("readiness_grace_s", ServerConfig.readiness_grace_s,
                                   0.5, 600.0),
        metrics_listen=s.opt_str("metrics_listen", ServerConfig.metrics_listen),
        transport=s.str_("transport", ServerConfig.transport,
                         frozenset({"grpcio", "grpclib"})),
    )
    if server.metrics_listen is not None:
        _check_metrics_listen(server.metrics_listen, server.listen)
    s.done()
    e = root.section("etcd")
    etcd = EtcdConfig(
        endpoints=e.str_list("endpoints", EtcdConfig.endpoints),
        timeout_s=e.float_("timeout_s", EtcdConfig.timeout_s, 0.05, 30.0),
        resend_deadline_s=e.float_("resend_deadline_s", EtcdConfig.resend_deadline_s,
                                   0.05, 60.0),
        prefix=e.str_("prefix", EtcdConfig.prefix),
        attempt_lease_ttl_s=e.int_("attempt_lease_ttl_s", EtcdConfig.attempt_lease_ttl_s, 2, 600),
        journal_retention_s=e.int_("journal_retention_s", EtcdConfig.journal_retention_s,
                                   60, 30 * 86400),
        session_ttl_s=e.int_("session_ttl_s", EtcdConfig.session_ttl_s, 3, 600),
        tls=_etcd_tls(e.section("tls")),
        auth=_etcd_auth(e.section("auth")),
    )
    if not etcd.prefix.startswith("/") or etcd.prefix.endswith("/"):
        raise ConfigError("etcd.prefix",
                          f"must start with '/' and not end with '/', got {etcd.prefix!r}")
    for i, ep in enumerate(etcd.endpoints):
        _check_etcd_endpoint(f"etcd.endpoints[{i}]", ep)
    if etcd.resend_deadline_s < etcd.timeout_s:
        raise ConfigError("etcd.resend_deadline_s",
                          f"must be at least etcd.timeout_s ({etcd.timeout_s}), got "
                          f"{etcd.resend_deadline_s}")
    etcd = replace(etcd, shards=_etcd_shards(e, etcd))
    e.done()
    t = root.section("timeouts")
    timeouts = TimeoutsConfig(
        first_delta_s=t.float_("first_delta_s", TimeoutsConfig.first_delta_s, 0.5, 3600.0),
        stall_after_first_delta_s=t.float_("stall_after_first_delta_s",
                                           TimeoutsConfig.stall_after_first_delta_s, 0.2, 3600.0),
        access_log_wait_s=t.float_("access_log_wait_s", TimeoutsConfig.access_log_wait_s,
                                   0.0, 10.0),
        fence_wait_s=t.float_("fence_wait_s", TimeoutsConfig.fence_wait_s, 0.0, 600.0),
        soft_first_delta_s=t.float_("soft_first_delta_s", TimeoutsConfig.soft_first_delta_s,
                                    0.0, 3600.0),
        progress_interval_s=t.float_("progress_interval_s",
                                     TimeoutsConfig.progress_interval_s, 0.0, 3600.0),
        first_delta_total_s=t.opt_float("first_delta_total_s",
                                        TimeoutsConfig.first_delta_total_s, 0.5, 36000.0),
        source_grace_s=t.float_("source_grace_s", TimeoutsConfig.source_grace_s, 0.0, 3600.0),
    )
    if (timeouts.first_delta_total_s is not None
            and timeouts.first_delta_total_s < timeouts.first_delta_s):
        raise ConfigError("timeouts.first_delta_total_s",
                          f"must be >= timeouts.first_delta_s ({timeouts.first_delta_s})")
    if timeouts.source_grace_s >= timeouts.first_delta_s:
        raise ConfigError("timeouts.source_grace_s",
                          f"must be < timeouts.first_delta_s ({timeouts.first_delta_s}), or 0 "
                          f"(off), got {timeouts.source_grace_s}")
    if timeouts.soft_first_delta_s > timeouts.first_delta_s:
        raise ConfigError("timeouts.soft_first_delta_s",
                          f"must be <= timeouts.first_delta_s ({timeouts.first_delta_s})")
    t.done()
    lim = root.section("limits")
    limits = LimitsConfig(
        max_request_body_bytes=lim.int_("max_request_body_bytes",
                                        LimitsConfig.max_request_body_bytes, 1024, 64 << 20),
        max_idempotency_key_length=lim.int_("max_idempotency_key_length",
                                            LimitsConfig.max_idempotency_key_length, 8, 1024),
        max_buffered_response_bytes=lim.int_("max_buffered_response_bytes",
                                             LimitsConfig.max_buffered_response_bytes,
                                             4096, 256 << 20),
    )
    lim.done()
    idr = root.section("idempotency")
    idem = IdempotencyConfig(required=idr.bool_("required", IdempotencyConfig.required))
    idr.done()
    ten = root.section("tenancy")
    th = ten.opt_str("header", TenancyConfig.header)
    tk = ten.opt_str("api_key_header", TenancyConfig.api_key_header)
    if th is not None and tk is not None:
        raise ConfigError("tenancy.api_key_header", "set either header or api_key_header")
    tenancy = TenancyConfig(header=th.lower() if th else None,
                            api_key_header=tk.lower() if tk else None)
    ten.done()
    tl = root.section("tools")
    tools = ToolsConfig(
        path_prefix=tl.str_("path_prefix", ToolsConfig.path_prefix),
        ledger_ttl_s=tl.int_("ledger_ttl_s", ToolsConfig.ledger_ttl_s, 60, 30 * 86400),
        max_result_bytes=tl.int_("max_result_bytes", ToolsConfig.max_result_bytes, 0,
                                 64 << 20),
        wait_s=tl.float_("wait_s", ToolsConfig.wait_s, 0.0, 600.0),
    )
    if not (tools.path_prefix.startswith("/") and tools.path_prefix.endswith("/")):
        raise ConfigError("tools.path_prefix",
                          f"must start and end with '/', got {tools.path_prefix!r}")
    tl.done()
    te = root.section("telemetry")
    telemetry = TelemetryConfig(
        otlp_endpoint=te.opt_str("otlp_endpoint", TelemetryConfig.otlp_endpoint),
        otlp_ca_file=te.opt_str("otlp_ca_file", TelemetryConfig.otlp_ca_file),
        sampling_ratio=te.float_("sampling_ratio", TelemetryConfig.sampling_ratio, 0.0, 1.0),
        service_name=te.str_("service_name", TelemetryConfig.service_name),
        record_traces=te.str_("record_traces", TelemetryConfig.record_traces,
                              frozenset({"failures", "all", "none"})),
        max_trace_bytes=te.int_("max_trace_bytes", TelemetryConfig.max_trace_bytes,
                                1024, 64 << 20),
        metrics_interval_s=te.float_("metrics_interval_s", TelemetryConfig.metrics_interval_s,
                                     0.5, 3600.0),
    )
    if telemetry.otlp_endpoint is not None:
        from .otlp import split_endpoint  # otlp imports this module
        try:
            otlp_ep = split_endpoint(telemetry.otlp_endpoint)
        except ValueError as e:
            raise ConfigError("telemetry.otlp_endpoint", str(e)) from None
        if telemetry.otlp_ca_file is not None and otlp_ep.scheme != "https":
            raise ConfigError("telemetry.otlp_ca_file",
                              "needs an https:// telemetry.otlp_endpoint (or null, for "
                              f"OTEL_EXPORTER_OTLP_ENDPOINT), got {telemetry.otlp_endpoint!r}")
    te.done()
    pl = root.section("pool")
    pl.used.add("replicas")
    reps = pl.raw.get("replicas") or []
    if not isinstance(reps, list):
        raise ConfigError("pool.replicas", "must be a list")
    try:
        pool_from_config(reps)  # validated here, built by the processor
    except FingerprintError as e:
        path, _, problem = str(e).partition(": ")
        raise ConfigError(path, problem) from e
    hc = pl.section("health_check")
    d_hc = HealthCheckConfig()
    health = HealthCheckConfig(
        enabled=hc.bool_("enabled", d_hc.enabled),
        path=hc.str_("path", d_hc.path),
        interval_s=hc.float_("interval_s", d_hc.interval_s, 0.1, 300.0),
        timeout_s=hc.float_("timeout_s", d_hc.timeout_s, 0.05, 60.0),
        unhealthy_threshold=hc.int_("unhealthy_threshold", d_hc.unhealthy_threshold, 1, 100),
        healthy_threshold=hc.int_("healthy_threshold", d_hc.healthy_threshold, 1, 100),
    )
    if not health.path.startswith("/"):
        raise ConfigError("pool.health_check.path", f"must start with '/', got {health.path!r}")
    hc.done()
    od = pl.section("outlier_detection")
    d_od = OutlierDetectionConfig()
    outlier = OutlierDetectionConfig(
        enabled=od.bool_("enabled", d_od.enabled),
        consecutive_local_origin_failure=od.int_(
            "consecutive_local_origin_failure", d_od.consecutive_local_origin_failure, 1, 1000),
        consecutive_5xx=od.int_("consecutive_5xx", d_od.consecutive_5xx, 1, 1000),
        interval_s=od.float_("interval_s", d_od.interval_s, 0.1, 300.0),
        base_ejection_time_s=od.float_("base_ejection_time_s", d_od.base_ejection_time_s,
                                       0.1, 3600.0),
        max_ejection_time_s=od.float_("max_ejection_time_s", d_od.max_ejection_time_s,
                                      0.1, 86400.0),
        max_ejection_percent=od.int_("max_ejection_percent", d_od.max_ejection_percent, 0, 100),
    )
    if outlier.max_ejection_time_s < outlier.base_ejection_time_s:
        raise ConfigError("pool.outlier_detection.max_ejection_time_s",
                          f"must be >= base_ejection_time_s ({outlier.base_ejection_time_s})")
    od.done()
    discovery = pl.str_("discovery", PoolConfig.discovery, frozenset({"static", "registry"}))
    if discovery == "registry" and reps:
        raise ConfigError("pool.replicas", "must be empty with discovery: registry (the "
                          "replicas register themselves: docs/pool-membership.md)")
    pool = PoolConfig(replicas=tuple(reps), health_check=health, outlier_detection=outlier,
                      discovery=discovery,
                      registration_ttl_s=pl.int_("registration_ttl_s",
                                                 PoolConfig.registration_ttl_s, 2, 300),
                      healthy_panic_threshold=pl.float_(
                          "healthy_panic_threshold", PoolConfig.healthy_panic_threshold,
                          0.0, 100.0),
                      unreached_attempts=pl.int_("unreached_attempts",
                                                 PoolConfig.unreached_attempts, 0, 10))
    pl.done()
    policy = _policy(root.section("policy"))
    accounting = _accounting(root.section("accounting"))
    root.done()
    if (policy.uncertain_source_liveness.wait_for == "lease_expiry"
            and timeouts.first_delta_s < etcd.attempt_lease_ttl_s + 1.0):
        # Every uncertain end then waits for its lease, inside the retry's own first-delta
        # time (decision 0010): with less, no such retry could ever start.
        raise ConfigError("timeouts.first_delta_s",
                          f"must be >= etcd.attempt_lease_ttl_s + 1 "
                          f"({etcd.attempt_lease_ttl_s + 1}) with "
                          f"uncertain_source_liveness.wait_for: lease_expiry")
    if policy.retry_budget.in_flight_expiry_s < timeouts.first_delta_s:
        # A re-prefill still waiting for its first delta would stop counting.
        raise ConfigError("policy.retry_budget.in_flight_expiry_s",
                          f"must be >= timeouts.first_delta_s ({timeouts.first_delta_s})")
    if etcd.attempt_lease_ttl_s > timeouts.fence_wait_s and timeouts.fence_wait_s > 0:
        # A retry may have to wait out the old lease; waiting less than its TTL would refuse
        # retries that are perfectly safe a moment later.
        raise ConfigError("timeouts.fence_wait_s",
                          f"must be >= etcd.attempt_lease_ttl_s ({etcd.attempt_lease_ttl_s})")
    return Config(server=server, etcd=etcd, timeouts=timeouts, limits=limits,
                  idempotency=idem, tenancy=tenancy, tools=tools, pool=pool,
                  telemetry=telemetry, policy=policy, accounting=accounting)


def _accounting(ac: _Reader) -> AccountingConfig:
    engine = ac.bool_("engine_usage", AccountingConfig.engine_usage)
    ac.used.add("tokenizers")
    raw = ac.raw.get("tokenizers") or {}
    if not isinstance(raw, Mapping):
        raise ConfigError("accounting.tokenizers",
                          "must be a mapping of model name to tokenizer.json path")
    pairs: list[tuple[str, str]] = []
    for model, path in raw.items():
        if not isinstance(model, str) or not model:
            raise ConfigError("accounting.tokenizers", f"model names must be non-empty "
                              f"strings, got {model!r}")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"accounting.tokenizers.{model}",
                              f"must be a tokenizer.json path, got {path!r}")
        pairs.append((model, path))
    ac.done()
    return AccountingConfig(engine_usage=engine, tokenizers=tuple(pairs))


def apply_env_overrides(raw: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Overlay EXTPROC_<SECTION>__<FIELD>=value variables onto a parsed config.

    Values are parsed as YAML scalars by the caller-provided parser-free rule: ints, floats,
    true/false and null are recognised; anything else stays a string. Lists are comma-separated.
    """
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    for name, value in sorted(env.items()):
        if not name.startswith("EXTPROC_") or "__" not in name:
            continue
        parts = [p.lower() for p in name[len("EXTPROC_"):].split("__")]
        if len(parts) != 2 or not all(parts):
            raise ConfigError(name, "environment override must look like EXTPROC_SECTION__FIELD")
        section, key = parts
        if out.get(section) is None:
            out[section] = {}  # an empty YAML section (`etcd:`) reads as None
        target = out[section]
        if not isinstance(target, dict):
            raise ConfigError(section, "cannot override a field of a non-mapping section")
        target[key] = _scalar(value)
    return out


def _scalar(text: str) -> object:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text

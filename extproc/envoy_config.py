"""Render the Envoy bootstrap that pairs with a processor configuration.

Envoy's timeouts and retry counts must agree with the processor's policy (max_attempts
becomes num_retries, the first-delta limit becomes per_try_timeout, the stall watchdog must
fire before any Envoy idle timeout), so they are derived from one Config instead of being
kept in sync by hand. `plain=True` renders the same listener and cluster with no ext_proc
at all: the baseline the benchmarks compare against. Requires Envoy >= 1.34 (upstream HTTP
filters with ext_proc, FULL_DUPLEX_STREAMED); verified on 1.40.0.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .core.admission import RETRY_HEADER
from .core.config import Config
from .core.headers import (
    ATTEMPT_ID,
    ENVOY_ATTEMPT_COUNT,
    ENVOY_REPLY,
    PREADMITTED,
    REQUEST_ID,
    ROLE_METADATA,
)
from .core.otlp import SYSTEM_CA_FILE, TraceExport, trace_export


@dataclass(frozen=True)
class Topology:
    listen: tuple[str, int] = ("127.0.0.1", 10000)
    admin: tuple[str, int] = ("127.0.0.1", 9901)
    processor: str = "127.0.0.1:50051"  # host:port or unix:/path
    replicas: tuple[tuple[str, int], ...] = (("127.0.0.1", 8001), ("127.0.0.1", 8002))
    access_log_path: str | None = None
    # Tool servers behind the tool route (cfg.tools.path_prefix); none: no tool route.
    tools: tuple[tuple[str, int], ...] = ()
    # The workers' listener: the tool route is served here and only here (decision 0029).
    # Required with `tools`; the client listener answers the tool prefix with 404.
    tool_listen: tuple[str, int] | None = None
    # The operators' listener: only GET /ready and GET /stats/prometheus, routed to the
    # admin (which then needs to listen on loopback only); none: no such listener.
    ops: tuple[str, int] | None = None


def _t(name: str) -> str:
    return "type.googleapis.com/" + name


def _dur(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _addr(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def replica_cluster_type(replicas: Sequence[tuple[str, int]]) -> str:
    """STATIC for addresses; a name (e.g. a headless Service) is resolved by DNS, and every
    address it resolves to is one host (STRICT_DNS)."""
    return "STATIC" if all(is_ip(h) for h, _ in replicas) else "STRICT_DNS"


def _processor_address(target: str) -> dict[str, Any]:
    if target.startswith("unix:"):
        return {"pipe": {"path": target[len("unix:"):]}}
    host, _, port = target.rpartition(":")
    return _addr(host, int(port))


def _grpc_service(role: str) -> dict[str, Any]:
    # No `timeout`: it would be a deadline on the whole gRPC stream, i.e. on the LLM stream.
    return {
        "envoy_grpc": {"cluster_name": "extproc"},
        "initial_metadata": [{"key": ROLE_METADATA, "value": role}],
    }


def _grpc_access_log(log_name: str, headers: list[str]) -> dict[str, Any]:
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": _t("envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"),
            "common_config": {
                "log_name": log_name,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": "extproc"}},
                "buffer_size_bytes": 0,
                "buffer_flush_interval": "0.05s",
            },
            "additional_request_headers_to_log": headers,
        },
    }


def _http2() -> dict[str, Any]:
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": _t("envoy.extensions.upstreams.http.v3.HttpProtocolOptions"),
        "explicit_http_config": {"http2_protocol_options": {}},
    }}


def _listener_ext_proc(cfg: Config, role: str) -> dict[str, Any]:
    """The ext_proc filter of a downstream listener: the guard's on the client listener,
    the same with role `tools` on the workers' tool listener."""
    typed: dict[str, Any] = {
        "@type": _t("envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"),
        "grpc_service": _grpc_service(role),
        "failure_mode_allow": False,
    }
    if role == "guard":
        # The guard writes override_host's ordered host list into envoy.lb.
        typed["metadata_options"] = {"receiving_namespaces": {"untyped": ["envoy.lb"]}}
    # The guard answers from memory or after one bounded etcd call, except a repeated tool
    # call, which waits up to tools.wait_s for the one executing it: Envoy must not cut
    # that wait short with its own 504.
    typed["message_timeout"] = _dur(max(2.0, cfg.etcd.timeout_s * 3,
                                        cfg.tools.wait_s + 2 * cfg.etcd.timeout_s))
    typed["processing_mode"] = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SEND",
    }
    return {"name": "envoy.filters.http.ext_proc", "typed_config": typed}


def _check_tools(topo: Topology) -> None:
    if not topo.tools and topo.tool_listen is None:
        return
    if not topo.tools:
        raise ValueError("a tool listener (tool_listen, --tool-listen) needs the tool "
                         "servers behind it (tools, --tools host:port)")
    if topo.tool_listen is None:
        raise ValueError("tool servers (tools, --tools) need their own listener "
                         "(tool_listen, --tool-listen host:port): the tool route is never "
                         "served on the client listener (decision 0029)")
    taken = {"the client listener": topo.listen, "the admin": topo.admin,
             **({"the ops listener": topo.ops} if topo.ops is not None else {})}
    for what, addr in taken.items():
        if addr[1] == topo.tool_listen[1] and (
                addr[0] == topo.tool_listen[0]
                or "0.0.0.0" in (addr[0], topo.tool_listen[0])
                or "::" in (addr[0], topo.tool_listen[0])):
            raise ValueError(f"the tool listener {topo.tool_listen[0]}:{topo.tool_listen[1]} "
                             f"must not share its port with {what}")


def tool_listener(cfg: Config, topo: Topology, access_logs: list[dict[str, Any]],
                  tracing: dict[str, Any] | None) -> dict[str, Any]:
    """The workers' listener: the tool route (cfg.tools.path_prefix -> the `tools` cluster,
    never retried by Envoy: the ledger decides what runs) behind an ext_proc filter of
    role `tools`; any other path is a 404. Clients are never given this address."""
    assert topo.tool_listen is not None
    routes: list[dict[str, Any]] = [
        {"match": {"prefix": cfg.tools.path_prefix},
         "route": {"cluster": "tools", "timeout": "60s",
                   "retry_policy": {"num_retries": 0}}},
        {"match": {"prefix": "/"}, "direct_response": {"status": 404}},
    ]
    hcm: dict[str, Any] = {
        "@type": _t("envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager"),
        "stat_prefix": "tools",
        "codec_type": "AUTO",
        "request_timeout": "0s",
        "access_log": access_logs,
        "http_filters": [
            _listener_ext_proc(cfg, "tools"),
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": _t("envoy.extensions.filters.http.router.v3.Router")}}],
        **({"tracing": tracing} if tracing else {}),
        "local_reply_config": local_reply_config(),
        "route_config": {"name": "tools", "virtual_hosts": [{
            "name": "tools", "domains": ["*"], "routes": routes}]},
    }
    return {
        "name": "tools",
        "address": _addr(*topo.tool_listen),
        # Cells (decision 0019) share this port as they share the client listener's.
        "enable_reuse_port": True,
        "per_connection_buffer_limit_bytes": max(1 << 20,
                                                 2 * cfg.limits.max_request_body_bytes),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": hcm}]}],
    }


# Envoy's per-try timeout fires this long after the gate's own first-delta limit, so the
# gate (which knows more) normally decides, and Envoy only ends what the gate cannot.
PER_TRY_MARGIN_S = 0.25


def health_checks(cfg: Config) -> list[dict[str, Any]]:
    hc = cfg.pool.health_check
    if not hc.enabled:
        return []
    return [{
        "timeout": _dur(hc.timeout_s), "interval": _dur(hc.interval_s),
        "unhealthy_threshold": hc.unhealthy_threshold,
        "healthy_threshold": hc.healthy_threshold,
        # A host Envoy has not yet checked is not assumed healthy for a full interval.
        "no_traffic_interval": _dur(hc.interval_s),
        "http_health_check": {"path": hc.path},
    }]


def outlier_detection(cfg: Config) -> dict[str, Any] | None:
    od = cfg.pool.outlier_detection
    if not od.enabled:
        return None
    return {
        # Refused, reset and timed-out attempts are counted apart from the replica's own
        # 5xx: a dead or frozen host is ejected after a couple of attempts, not five.
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": od.consecutive_local_origin_failure,
        "enforcing_consecutive_local_origin_failure": 100,
        "consecutive_5xx": od.consecutive_5xx,
        "enforcing_consecutive_5xx": 100,
        # 502/503/504 answered by a live replica (e.g. overloaded 503) are in consecutive_5xx;
        # not ejected twice over.
        "enforcing_consecutive_gateway_failure": 0,
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "interval": _dur(od.interval_s),
        "base_ejection_time": _dur(od.base_ejection_time_s),
        "max_ejection_time": _dur(od.max_ejection_time_s),
        "max_ejection_percent": od.max_ejection_percent,
    }


def render(cfg: Config, topo: Topology, plain: bool = False,
           env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`env`: the OTEL_* variables Envoy's tracer follows as the processor does (default:
    this process's environment: the chart's render init container has the processor's)."""
    if not plain:
        _check_tools(topo)
    t = cfg.timeouts
    attempts = cfg.policy.max_attempts
    # The whole pre-delta budget, across retries, plus the post-delta watchdog: Envoy's own
    # idle timeout must never fire first (it would end the stream with no error event).
    idle = t.first_delta_s * attempts + t.stall_after_first_delta_s + 30.0
    access_logs: list[dict[str, Any]] = []
    if topo.access_log_path:
        access_logs.append({
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": _t("envoy.extensions.access_loggers.file.v3.FileAccessLog"),
                "path": topo.access_log_path,
                "log_format": {"json_format": {
                    "ts": "%START_TIME%", "rid": f"%REQ({REQUEST_ID})%",
                    "envoy_rid": "%REQ(X-REQUEST-ID)%", "path": "%REQ(:PATH)%",
                    "status": "%RESPONSE_CODE%", "flags": "%RESPONSE_FLAGS%",
                    "details": "%RESPONSE_CODE_DETAILS%",
                    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
                    "upstream": "%UPSTREAM_HOST%", "duration_ms": "%DURATION%",
                }},
            },
        })
    # The tool listener shares the file log only: the guard's log feeds its termination
    # causes, which concern the replicas' streams (decision 0004).
    access_logs_file = list(access_logs)
    if not plain:
        access_logs.append(_grpc_access_log("guard", [REQUEST_ID]))
    filters: list[dict[str, Any]] = []
    if not plain:
        filters.append(_listener_ext_proc(cfg, "guard"))
    router: dict[str, Any] = {"@type": _t("envoy.extensions.filters.http.router.v3.Router")}
    if not plain:
        # One entry per attempt: how each attempt ended (UF/UC/UPE: dead; UT: timed out,
        # liveness uncertain). The gate's fence decision waits for it (decision 0004).
        # An attempt whose upstream filters never ran (e.g. connection refused) has no
        # attempt id, only the guard's pre-admission header: decision 0007.
        router["upstream_log"] = [_grpc_access_log("gate", [REQUEST_ID, ATTEMPT_ID,
                                                            ENVOY_ATTEMPT_COUNT, PREADMITTED])]
    filters.append({"name": "envoy.filters.http.router", "typed_config": router})

    retry_policy: dict[str, Any] = {
        # 5xx includes the gate's own `:status: 503` for an attempt it fails on purpose.
        # 429 is overload, not death: retried on another host within max_attempts, after
        # the replica's Retry-After (capped) instead of Envoy's 10 ms back-off.
        "retry_on": "reset,connect-failure,refused-stream,5xx,retriable-status-codes",
        "retriable_status_codes": [429],
        "rate_limited_retry_back_off": {
            "reset_headers": [{"name": "retry-after", "format": "SECONDS"}],
            "max_interval": _dur(min(10.0, t.first_delta_s)),
        },
        # max_attempts counts attempts that reached a replica; an attempt whose connection
        # was refused (no byte sent, no gate ran) is one of pool.unreached_attempts more.
        # The gate stops Envoy at the last real attempt (decision 0024).
        "num_retries": attempts - 1 + cfg.pool.unreached_attempts,
        # The gate enforces first_delta_s itself from the attempt's start (a retry's wait
        # for the previous attempt's fence comes out of it). A replica that never sends
        # headers leaves the gate nothing to answer: this per-try timeout, a moment after
        # the gate's limit, resets such an attempt and retries (docs/failure-classes.md).
        "per_try_timeout": _dur(t.first_delta_s + PER_TRY_MARGIN_S),
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": _t("envoy.extensions.retry.host."
                                         "previous_hosts.v3.PreviousHostsPredicate")},
        }],
        "host_selection_retry_max_attempts": 5,
        "retry_back_off": {"base_interval": "0.010s", "max_interval": "0.250s"},
    }
    if not plain:
        # With the processor, a response that came back (the replica's own 5xx/429, or the
        # gate's 503) is retried only when the gate marks it: never after the last attempt
        # that counts, so the spare attempts above serve refused connections only.
        retry_policy["retry_on"] = "reset,connect-failure,refused-stream,retriable-headers"
        del retry_policy["retriable_status_codes"]
        retry_policy["retriable_headers"] = [{"name": RETRY_HEADER, "present_match": True}]
    routes: list[dict[str, Any]] = []
    if not plain:
        routes.append({"match": {"prefix": "/v1/requests/"},
                       "direct_response": {"status": 404}})
    if topo.tools and not plain:
        # The tool route is the workers' (tool_listener): a client asking for it here gets
        # a 404 from Envoy itself, whatever the processor does (decision 0029).
        routes.append({"match": {"prefix": cfg.tools.path_prefix},
                       "direct_response": {"status": 404}})
    routes.append({"match": {"prefix": "/"},
                   "route": {"cluster": "replicas", "timeout": "0s",
                             "retry_policy": retry_policy}})

    export = None if plain else trace_export(cfg.telemetry,
                                             os.environ if env is None else env)
    tracing: dict[str, Any] | None = None
    if export is not None:
        # Envoy's own spans go to the same collector, sampled alike (core/otlp.py); its
        # ext_proc calls carry their traceparent to the processor: both sides form one trace.
        tracing = {"provider": {"name": "envoy.tracers.opentelemetry", "typed_config": {
            "@type": _t("envoy.config.trace.v3.OpenTelemetryConfig"),
            "grpc_service": {"envoy_grpc": {"cluster_name": "otel",
                                            "authority": export.target},
                             "timeout": "1s",
                             **({"initial_metadata": [{"key": k, "value": v}
                                                      for k, v in export.headers]}
                                if export.headers else {})},
            "service_name": "llm-gateway-envoy",
            # OTEL_RESOURCE_ATTRIBUTES from Envoy's environment, as the processor's SDK reads
            # it: both sides' spans carry the same resource (e.g. k8s.pod.name).
            "resource_detectors": [{
                "name": "envoy.tracers.opentelemetry.resource_detectors.environment",
                "typed_config": {"@type": _t(
                    "envoy.extensions.tracers.opentelemetry.resource_detectors.v3."
                    "EnvironmentResourceDetectorConfig")}}],
            "sampler": parent_based_sampler(export.ratio)}},
            # Envoy 1.40 applies the connection manager's decision over a parent's sampled
            # flag: it must say yes to every request, and the sampler above decides.
            "random_sampling": {"value": 100}}
    hcm: dict[str, Any] = {
        "@type": _t("envoy.extensions.filters.network.http_connection_manager.v3."
                    "HttpConnectionManager"),
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "stream_idle_timeout": _dur(idle),
        "request_timeout": "0s",
        "access_log": access_logs,
        "http_filters": filters,
        **({"tracing": tracing} if tracing else {}),
        **({} if plain else {"local_reply_config": local_reply_config()}),
        "route_config": {"name": "local", "virtual_hosts": [{
            "name": "gateway", "domains": ["*"], "include_request_attempt_count": True,
            "routes": routes}]},
    }
    replica_opts: dict[str, Any] = {
        "@type": _t("envoy.extensions.upstreams.http.v3.HttpProtocolOptions"),
        "explicit_http_config": {"http_protocol_options": {}},
    }
    if not plain:
        replica_opts["http_filters"] = [
            {"name": "envoy.filters.http.ext_proc", "typed_config": {
                "@type": _t("envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"),
                "grpc_service": _grpc_service("gate"),
                "failure_mode_allow": False,
                # The gate holds the response headers until the first delta is fenced: the
                # message timeout must outlast the first-delta limit (per_try_timeout fires
                # first and retries; an ext_proc timeout would be a 504 with no retry).
                "message_timeout": _dur(t.first_delta_s + t.fence_wait_s + 5.0),
                "max_message_timeout": _dur(t.first_delta_s + t.fence_wait_s + 60.0),
                "processing_mode": {
                    "request_header_mode": "SEND",
                    "response_header_mode": "SEND",
                    "request_body_mode": "NONE",
                    "response_body_mode": "STREAMED",
                    "request_trailer_mode": "SKIP",
                    "response_trailer_mode": "SKIP",
                },
                "send_body_without_waiting_for_header_response": True,
                "request_attributes": ["upstream.address"],
            }},
            {"name": "envoy.filters.http.upstream_codec", "typed_config": {
                "@type": _t("envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec")}},
        ]
    rb = cfg.policy.retry_budget
    replica_cluster: dict[str, Any] = {
        "name": "replicas",
        "type": replica_cluster_type(topo.replicas),
        "connect_timeout": "1s",
        "circuit_breakers": {"thresholds": [{
            # Envoy's default allows only 3 concurrent retries (UO under load). Envoy's own
            # retry budget, with the policy's numbers, bounds concurrent retries per Envoy;
            # the processor's bounds re-prefills in flight across gateways (decision 0023).
            "retry_budget": {"budget_percent": {"value": rb.fraction * 100},
                             "min_retry_concurrency": max(1, rb.min_retry_concurrency)},
            "max_connections": 100000, "max_pending_requests": 100000,
            "max_requests": 100000}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": replica_opts},
        "load_assignment": {"cluster_name": "replicas", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _addr(h, p)}} for h, p in topo.replicas]}]},
    }
    live = cfg.pool.discovery == "registry" and not plain
    if live:
        # A live pool (decision 0014): the processor serves the registered replicas over
        # EDS on the extproc cluster. A registration withdrawn or lapsed removes its host at
        # once, even while it still passes health checks (its streams in flight go on).
        del replica_cluster["load_assignment"]
        replica_cluster["type"] = "EDS"
        replica_cluster["eds_cluster_config"] = {
            "service_name": "replicas",
            "eds_config": {
                "resource_api_version": "V3",
                "initial_fetch_timeout": "10s",
                "api_config_source": {
                    "api_type": "GRPC", "transport_api_version": "V3",
                    "set_node_on_first_message_only": True,
                    "grpc_services": [{"envoy_grpc": {"cluster_name": "extproc"}}]}}}
        replica_cluster["ignore_health_on_host_removal"] = True
    # Pool health in Envoy's own terms, the same with or without the processor (the plain
    # side of the benchmarks is this exact cluster with no ext_proc). Below the panic
    # threshold Envoy would balance over every host, dead ones included (decision 0024).
    # A health change reaches the load balancer at once: Envoy's default 1 s merge window
    # kept sending every request to a host that had just died while the one back up got
    # none (503 after four refused connections; decision 0061).
    replica_cluster["common_lb_config"] = {
        "healthy_panic_threshold": {"value": cfg.pool.healthy_panic_threshold},
        "update_merge_window": "0s"}
    hcs = health_checks(cfg)
    if hcs:
        replica_cluster["health_checks"] = hcs
    od = outlier_detection(cfg)
    if od is not None:
        replica_cluster["outlier_detection"] = od
    if (cfg.pool.replicas or live) and not plain:
        # The guard lists compatible hosts in order; attempt n takes the n-th. Requests
        # without a list (e.g. /v1/models) fall back to round robin.
        replica_cluster["load_balancing_policy"] = {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": _t("envoy.extensions.load_balancing_policies.override_host.v3."
                            "OverrideHost"),
                "override_host_sources": [{"metadata": {
                    "key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}],
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": _t("envoy.extensions.load_balancing_policies."
                                                "round_robin.v3.RoundRobin")}}}]},
            }}}]}
    else:
        replica_cluster["lb_policy"] = "ROUND_ROBIN"
    clusters: list[dict[str, Any]] = [replica_cluster]
    if export is not None:
        clusters.append(otel_cluster(export))
    if topo.tools and not plain:
        clusters.append({
            # A name (e.g. a Service) is resolved by DNS, as for the replicas.
            "name": "tools", "type": replica_cluster_type(topo.tools), "connect_timeout": "1s",
            "lb_policy": "ROUND_ROBIN",
            "load_assignment": {"cluster_name": "tools", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _addr(h, p)}} for h, p in topo.tools]}]},
        })
    if not plain:
        clusters.append({
            "name": "extproc",
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": _http2(),
            # Envoy 1.40.0 segfaults when an ext_proc side stream of the upstream gate
            # crosses its buffer's high watermark (the processor falling behind under
            # saturation): 6 crashes in 12 saturation runs with the default 1 MiB, 0 in 16
            # with 64 MiB (decision 0008). Bounded: one connection per Envoy worker.
            "per_connection_buffer_limit_bytes": 64 << 20,
            "circuit_breakers": {"thresholds": [{
                "max_requests": 1000000, "max_pending_requests": 1000000,
                "max_connections": 1000}]},
            "load_assignment": {"cluster_name": "extproc", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _processor_address(topo.processor)}}]}]},
        })
    listeners: list[dict[str, Any]] = [{
        "name": "gateway",
        "address": _addr(*topo.listen),
        # Envoy's Linux default, made explicit: cells (decision 0019) are several Envoys
        # bound to this one port, the kernel spreading new connections among them.
        "enable_reuse_port": True,
        "per_connection_buffer_limit_bytes": max(1 << 20,
                                                 2 * cfg.limits.max_request_body_bytes),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": hcm}]}],
    }]
    if topo.tools and not plain:
        listeners.append(tool_listener(cfg, topo, access_logs_file, tracing))
    if topo.ops is not None:
        listeners.append(ops_listener(topo.ops))
        clusters.append(admin_cluster(topo.admin))
    boot: dict[str, Any] = {
        "admin": {"address": _addr(*topo.admin)},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }
    if live:
        # An xDS client must name itself; the processor serves every node the same pool.
        boot = {"node": {"id": "llm-gateway", "cluster": "llm-gateway"}, **boot}
    return boot


def parent_based_sampler(ratio: float) -> dict[str, Any]:
    """Envoy's OpenTelemetry sampler as the processor's SDK samples: a parent's sampled
    flag decides; a root is kept at `ratio` (parts per million)."""
    ns = "envoy.extensions.tracers.opentelemetry.samplers.v3."
    return {"name": "envoy.tracers.opentelemetry.samplers.parent_based", "typed_config": {
        "@type": _t(ns + "ParentBasedSamplerConfig"),
        "wrapped_sampler": {
            "name": "envoy.tracers.opentelemetry.samplers.trace_id_ratio_based",
            "typed_config": {
                "@type": _t(ns + "TraceIdRatioBasedSamplerConfig"),
                "sampling_percentage": {"numerator": round(ratio * 1_000_000),
                                        "denominator": "MILLION"}}}}}


def otel_cluster(export: TraceExport) -> dict[str, Any]:
    """The collector Envoy's tracer exports to: plaintext, or TLS verified against the
    configured CA (else the system bundle) and the endpoint's own name."""
    ep = export.endpoint
    cluster: dict[str, Any] = {
        "name": "otel", "type": "STRICT_DNS", "connect_timeout": "1s",
        "typed_extension_protocol_options": _http2(),
        "load_assignment": {"cluster_name": "otel", "endpoints": [{
            "lb_endpoints": [{"endpoint": {"address": _addr(ep.host, ep.port)}}]}]}}
    if export.tls:
        ip = is_ip(ep.host)
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _t("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"),
                # SNI carries DNS names only (RFC 6066); the certificate is checked either way.
                **({} if ip else {"sni": ep.host}),
                "common_tls_context": {
                    "alpn_protocols": ["h2"],
                    "validation_context": {
                        "trusted_ca": {"filename": export.ca_file or SYSTEM_CA_FILE},
                        "match_typed_subject_alt_names": [{
                            "san_type": "IP_ADDRESS" if ip else "DNS",
                            "matcher": {"exact": ep.host}}]}}}}
    return cluster


# Envoy's own replies that mean "no replica answered": no healthy host, refused or reset
# before headers with every retry spent, overflow, or its per-try timeout on the last try.
LOCAL_REPLY_FLAGS_UNAVAILABLE = ("UH", "UF", "UO", "URX", "UC", "LR", "UR", "UPE", "NC")
LOCAL_REPLY_FLAGS_TIMEOUT = ("UT",)
# Set on those replies, so the guard (when it still sees the response) gives the request's
# API family its own error shape (docs/errors.md); the value is Envoy's response flags.
ENVOY_REPLY_HEADER = ENVOY_REPLY


def _local_reply_mapper(flags: tuple[str, ...], code: str, what: str) -> dict[str, Any]:
    body = {"error": {
        "message": f"no replica produced an answer ({what}: %LOCAL_REPLY_BODY%)",
        "type": "server_error",
        "code": code,
        "request_id": f"%REQ({REQUEST_ID})%",
        "partial_output": False,
        "retryable": True,
    }}
    return {
        "filter": {"and_filter": {"filters": [
            {"status_code_filter": {"comparison": {
                "op": "GE", "value": {"default_value": 500, "runtime_key": "llmgw_lr_min"}}}},
            {"response_flag_filter": {"flags": list(flags)}}]}},
        "headers_to_add": [
            {"header": {"key": REQUEST_ID, "value": f"%REQ({REQUEST_ID})%"},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
            {"header": {"key": ENVOY_REPLY_HEADER, "value": "%RESPONSE_FLAGS%"},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        "body_format_override": {"json_format": body,
                                 "content_type": "application/json"},
    }


def local_reply_config() -> dict[str, Any]:
    """Envoy's own 5xx (it made the reply itself: no host answered) in the gateway's error
    shape, with the request's id in a header and in the body, so every client can look its
    request up (GET /v1/requests/<id>). The gateway's own errors (the guard's and the gate's
    ImmediateResponses) carry no upstream response flag and pass unchanged."""
    return {"mappers": [
        _local_reply_mapper(LOCAL_REPLY_FLAGS_TIMEOUT, "upstream_timeout",
                            "Envoy's upstream timeout"),
        _local_reply_mapper(LOCAL_REPLY_FLAGS_UNAVAILABLE, "upstream_unavailable",
                            "Envoy's local reply"),
    ]}


# What the operators' listener serves of the admin interface: read-only, nothing else.
OPS_PATHS = ("/ready", "/stats/prometheus")


def ops_listener(addr: tuple[str, int]) -> dict[str, Any]:
    """Readiness and Prometheus stats for kubelets and scrapers, on their own listener.

    The admin interface itself stays on loopback: anyone who reaches it can POST
    /quitquitquit or /healthcheck/fail. Its own stat prefix keeps probes and scrapes out of
    http.ingress.*, which the drain counts (helm/llm-failover-extproc/files/drain.py).
    """
    routes: list[dict[str, Any]] = [
        {"match": {"path": p, "headers": [{"name": ":method",
                                           "string_match": {"exact": "GET"}}]},
         "route": {"cluster": "admin", "timeout": "5s"}}
        for p in OPS_PATHS]
    routes.append({"match": {"prefix": "/"}, "direct_response": {"status": 404}})
    return {
        "name": "ops",
        "address": _addr(*addr),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": _t("envoy.extensions.filters.network.http_connection_manager.v3."
                            "HttpConnectionManager"),
                "stat_prefix": "ops",
                "codec_type": "AUTO",
                "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                    "@type": _t("envoy.extensions.filters.http.router.v3.Router")}}],
                "route_config": {"name": "ops", "virtual_hosts": [{
                    "name": "ops", "domains": ["*"], "routes": routes}]},
            }}]}],
    }


def admin_cluster(admin: tuple[str, int]) -> dict[str, Any]:
    return {"name": "admin", "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "admin", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _addr(*admin)}}]}]}}


def parse_hostport(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {s!r}")
    return host.strip("[]"), int(port)


def replicas_from(items: Sequence[str]) -> tuple[tuple[str, int], ...]:
    return tuple(parse_hostport(s) for s in items)

"""Generate helm/llm-failover-extproc/values.schema.json (a test checks it is current).

The processor.config part mirrors extproc/core/config.py (sections, fields, ranges, choices);
tests/deploy/test_helm_chart.py also checks its field names against the Config dataclasses.

    python helm/tools/gen_values_schema.py > helm/llm-failover-extproc/values.schema.json
"""

from __future__ import annotations

import json
from typing import Any

Json = dict[str, Any]


def obj(props: Json, required: list[str] | None = None) -> Json:
    d: Json = {"type": "object", "additionalProperties": False, "properties": props}
    # Helm deletes keys set to null, so a nullable key cannot be required.
    d["required"] = ([k for k, v in props.items() if "null" not in v.get("type", [])]
                     if required is None else required)
    return d


def num(lo: float, hi: float, desc: str | None = None) -> Json:
    d: Json = {"type": "number", "minimum": lo, "maximum": hi}
    if desc:
        d["description"] = desc
    return d


def integer(lo: int, hi: int, desc: str | None = None) -> Json:
    d: Json = {"type": "integer", "minimum": lo, "maximum": hi}
    if desc:
        d["description"] = desc
    return d


def enum(*vals: str, desc: str | None = None) -> Json:
    d: Json = {"type": "string", "enum": list(vals)}
    if desc:
        d["description"] = desc
    return d


nullable_str = {"type": ["string", "null"], "minLength": 1}
port = {"type": "integer", "minimum": 1, "maximum": 65535}
image = obj({
    # No minLength: the template's `required` names the value to set (a clearer message).
    "repository": {"type": "string", "description": "image repository (required, non-empty)"},
    "tag": {"type": "string", "description": "\"\" = the chart's appVersion"},
    "pullPolicy": enum("Always", "IfNotPresent", "Never"),
})
k8s_obj = {"type": "object"}
k8s_list = {"type": "array", "items": {"type": "object"}}
resources = obj({
    "requests": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
    "limits": {"type": "object", "additionalProperties": {"type": ["string", "number"]}},
}, required=[])


def probe() -> Json:
    return obj({"periodSeconds": integer(1, 3600), "timeoutSeconds": integer(1, 3600),
                "failureThreshold": integer(1, 1000)})



# Mirrors extproc/core/config.py (ranges and choices); the processor re-validates at start.
proc_config = obj({
    "server": obj({
        "gateway_id": {"type": "string", "minLength": 1,
                       "description": "overridden per pod by the pod name"},
        "log_level": enum("DEBUG", "INFO", "WARNING", "ERROR"),
        "readiness_grace_s": num(0.5, 600.0, "readiness goes NOT_SERVING when etcd has not "
                                 "answered for longer than this"),
        "transport": enum("grpcio", "grpclib",
                          desc="the gRPC stack serving Envoy (decision 0020)"),
    }),
    "etcd": obj({
        "timeout_s": num(0.05, 30.0, "deadline of every etcd call"),
        "resend_deadline_s": num(0.05, 60.0, "intake, admission and fence sent again until then"),
        "prefix": {"type": "string", "pattern": "^/.*[^/]$"},
        "attempt_lease_ttl_s": integer(2, 600),
        "journal_retention_s": integer(60, 30 * 86400),
        "session_ttl_s": integer(3, 600),
    }),
    "timeouts": obj({
        "first_delta_s": num(0.5, 3600.0),
        "stall_after_first_delta_s": num(0.2, 3600.0),
        "access_log_wait_s": num(0.0, 10.0),
        "fence_wait_s": num(0.0, 600.0),
        "soft_first_delta_s": num(0.0, 3600.0),
        "progress_interval_s": num(0.0, 3600.0),
        "source_grace_s": num(0.0, 3600.0, "a replica agent's first-content word with nothing "
                                           "arrived this long after: path lost (0: off; "
                                           "< first_delta_s; decision 0034)"),
        "first_delta_total_s": {
            "type": ["number", "null"], "minimum": 0.5, "maximum": 36000.0,
            "description": "whole-request wait for the first delta, all attempts; "
                           "null = max_attempts x first_delta_s; >= first_delta_s"},
    }),
    "limits": obj({
        "max_request_body_bytes": integer(1024, 64 << 20),
        "max_idempotency_key_length": integer(8, 1024),
        "max_buffered_response_bytes": integer(4096, 256 << 20),
    }),
    "idempotency": obj({"required": {"type": "boolean"}}),
    "tenancy": obj({"header": nullable_str, "api_key_header": nullable_str}),
    "tools": obj({
        "path_prefix": {"type": "string", "pattern": "^/(.*/)?$"},
        "ledger_ttl_s": integer(60, 30 * 86400),
        "max_result_bytes": integer(0, 64 << 20),
        "wait_s": num(0.0, 600.0),
    }),
    "telemetry": obj({
        "otlp_endpoint": {**nullable_str,
                          # extproc/core/otlp.py's split_endpoint, as a pattern.
                          "pattern": r"^(https?://(\[[^\]/]+\]|[^:/\[\]\s]+):[0-9]{1,5}(/.*)?"
                                     r"|(\[[^\]/]+\]|[^:/\[\]\s]+):[0-9]{1,5})$",
                          "description": "https://host:port (TLS), http://host:port or "
                                         "host:port (plaintext); null: OTEL_EXPORTER_OTLP_*"},
        "otlp_ca_file": {**nullable_str, "description": "CA bundle for an https:// collector "
                                                        "(the chart sets it from otlpCa)"},
        "sampling_ratio": num(0.0, 1.0, "head sampling of traces that start at the gateway, "
                                        "parent-based (Envoy and the processor)"),
        "service_name": {"type": "string", "minLength": 1},
        "record_traces": {"enum": ["failures", "all", "none"]},
        "max_trace_bytes": integer(1024, 64 << 20),
        "metrics_interval_s": num(0.5, 3600.0),
    }),
    "pool": obj({
        "replicas": {
            "type": "array",
            "description": "replicas and compatibility fingerprints; "
                           "non-empty enables override_host",
            "items": obj({
                "address": {"type": "string", "pattern": "^.+:[0-9]+$",
                            "description": "host:port as Envoy reports upstream.address"},
                "models": {"type": "array", "items": {"type": "string"}},
                "fingerprint": obj({
                    "weights_revision": {"type": "string", "minLength": 1},
                    "quantization": {"type": "string"},
                    "tokenizer_hash": {"type": "string"},
                    "chat_template_hash": {"type": "string"},
                    "attention": {"type": "string"},
                    "kv_cache_dtype": {"type": "string"},
                    "tensor_parallel_size": integer(1, 1 << 20),
                    "pipeline_parallel_size": integer(1, 1 << 20),
                    "kv_block_size": integer(1, 1 << 20),
                    "lora_adapters": {"type": "array", "items": {"type": "string"}},
                }, required=["weights_revision"]),
            }, required=["address", "fingerprint"]),
        },
        "health_check": obj({
            "enabled": {"type": "boolean",
                        "description": "Envoy's health_checks on the replicas cluster and "
                                       "the processor's own probes"},
            "path": {"type": "string", "pattern": "^/"},
            "interval_s": num(0.1, 300.0, "also Envoy's no_traffic_interval"),
            "timeout_s": num(0.05, 60.0),
            "unhealthy_threshold": integer(1, 100),
            "healthy_threshold": integer(1, 100),
        }),
        "outlier_detection": obj({
            "enabled": {"type": "boolean",
                        "description": "Envoy's outlier_detection on the replicas cluster"},
            "consecutive_local_origin_failure": integer(1, 1000),
            "consecutive_5xx": integer(1, 1000),
            "interval_s": num(0.1, 300.0),
            "base_ejection_time_s": num(0.1, 3600.0),
            "max_ejection_time_s": num(0.1, 86400.0, "must be >= base_ejection_time_s"),
            "max_ejection_percent": integer(0, 100),
        }),
        "discovery": enum("static", "registry",
                          desc="registry: replicas register in etcd (`extproc register`), "
                               "served to Envoy over EDS; pool.replicas must then be empty"),
        "registration_ttl_s": integer(2, 300),
        "healthy_panic_threshold": num(0.0, 100.0),
        "unreached_attempts": integer(0, 10),
    }),
    "policy": obj({"on_upstream_failure": obj({
        "before_first_delta": obj({
            # Two distinct items out of these two: both, in any order.
            "require": {"type": "array", "minItems": 2, "uniqueItems": True,
                        "items": enum("source_attempt_fenced", "retry_budget_available"),
                        "description": "must include source_attempt_fenced and "
                                       "retry_budget_available"},
            "action": {"const": "retry_prefill_on_healthy_replica"},
            "max_attempts": integer(1, 10, "becomes Envoy's num_retries + 1"),
        }),
        "after_first_delta": obj({
            "action": {"const": "terminate_stream"},
            "client_error": {"const": "upstream_decode_interrupted"},
            "automatic_retry": {
                "const": False,
                "description": "a re-run after delivery would stitch two generations"},
        }),
        "uncertain_source_liveness": obj({
            "action": {"const": "fence_source_attempt"},
            "wait_for": enum("cancel_ack_or_lease_expiry", "lease_expiry"),
            "then": {"const": "retry_only_if_no_delta_was_sent"},
        }),
    }),
        "retry_budget": obj({
            "fraction": num(0.0, 1.0, "re-prefills / requests in flight, pool-wide"),
            "min_retry_concurrency": integer(0, 1_000_000, "re-prefills always allowed in "
                                             "flight (min_retries and window_s are gone: "
                                             "decision 0023)"),
            "in_flight_expiry_s": num(10.0, 86400.0),
        }),
        "retry_cost": obj({
            "max_prompt_tokens": integer(0, 10_000_000),
            "chars_per_token": num(0.5, 32.0),
        }),
    }),
    "accounting": obj({
        "engine_usage": {"type": "boolean",
                         "description": "ask the engine for its running token count on "
                                        "streams (stream_options.continuous_usage_stats)"},
        # A map, like otelEnv: no "properties", so the field-name test stops here.
        "tokenizers": {"type": "object", "propertyNames": {"minLength": 1},
                       "additionalProperties": {"type": "string", "minLength": 1},
                       "description": "model name -> tokenizer.json path in the processor "
                                      "container (needs the `tokenizer` extra)"},
    }),
})

schema = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "llm-failover-extproc chart values",
    **obj({
        "replicaCount": integer(1, 1000),
        # "" or a DNS label (the chart appends -processor, -metrics, -tools).
        "nameOverride": {"type": "string", "maxLength": 55,
                         "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
                         "description": "replaces the chart's name in resource names"},
        "fullnameOverride": {"type": "string", "maxLength": 55,
                             "pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
                             "description": "the resources' name prefix, as is"},
        "image": obj({"envoy": image, "processor": image}),
        "imagePullSecrets": k8s_list,
        "replicas": obj({"endpoints": {
            # Empty only with a live pool (pool.discovery: registry); lfe.validate says so.
            "type": "array",
            "description": "the upstream model servers; each individually addressable "
                           "(empty with processor.config.pool.discovery: registry)",
            "items": obj({"host": {"type": "string", "minLength": 1,
                                   "pattern": "^[A-Za-z0-9.:_-]+$"},
                          "port": port})}}),
        "etcd": obj({
            "endpoints": {"type": "array", "minItems": 1,
                          "items": {"type": "string", "pattern": "^[^:\\s]+:[0-9]+$"}},
            "tls": obj({"enabled": {"type": "boolean"}, "secretName": nullable_str,
                        "caCert": {"type": "boolean",
                                   "description": "the Secret has ca.crt (false: system roots)"},
                        "clientCert": {"type": "boolean",
                                       "description": "the Secret has tls.crt and tls.key"},
                        "serverName": nullable_str}),
            "auth": obj({"enabled": {"type": "boolean"}, "secretName": nullable_str}),
            "shards": {"type": "array",
                       "description": "more etcd clusters for the journal, sharded by request "
                                      "id (decision 0042); each uses the TLS and auth above",
                       "items": obj({"endpoints": {
                           "type": "array", "minItems": 1,
                           "items": {"type": "string", "pattern": "^[^:\\s]+:[0-9]+$"}}})},
        }),
        "envoy": obj({
            "port": port,
            "adminPort": {**port, "description": "admin, on 127.0.0.1 only"},
            "opsPort": {**port, "description": "GET /ready and /stats/prometheus only"},
            "toolPort": {**port, "description": "the tool listener (with tools.enabled)"},
            "concurrency": integer(1, 256),
            "logLevel": enum("trace", "debug", "info", "warning", "warn", "error",
                             "critical", "off"),
            "resources": resources,
            "readinessProbe": probe(), "livenessProbe": probe(),
        }),
        "processor": obj({
            "command": {"type": "array", "minItems": 1, "items": {"type": "string"}},
            "renderEnvoyCommand": {
                "type": "array", "minItems": 1, "items": {"type": "string"},
                "description": "`extproc render-envoy` in the processor image"},
            "nativeSidecar": {"type": "boolean",
                              "description": "the processor as a native sidecar (k8s >= 1.29)"},
            "python": {"type": "string", "minLength": 1},
            "extraEnv": k8s_list,
            "extraVolumes": {**k8s_list, "description": "pod volumes for the processor's "
                             "extraVolumeMounts (e.g. accounting.tokenizers files)"},
            "extraVolumeMounts": {**k8s_list, "description": "mounts into the processor "
                                  "container"},
            "resources": resources,
            "probes": obj({"periodSeconds": integer(1, 3600),
                           "timeoutSeconds": integer(2, 3600),
                           "failureThreshold": integer(1, 1000),
                           "startupFailureThreshold": integer(1, 10000)}),
            "config": proc_config,
        }),
        "shutdown": obj({
            "drainSeconds": integer(0, 3600),
            "maxStreamSeconds": integer(0, 86400),
            "processorLingerSeconds": integer(0, 600),
            "processorStopSeconds": integer(0, 600),
            "envoyPreStop": enum("sleep", "exec"),
        }),
        "terminationGracePeriodSeconds": {"type": ["integer", "null"], "minimum": 1},
        "otlpCa": obj({"secretName": {**nullable_str, "description":
                                      "Secret with ca.crt for an https:// OTLP collector: "
                                      "mounted in the processor and Envoy"}}),
        "otelEnv": {"type": "object", "propertyNames": {"pattern": "^OTEL_[A-Z0-9_]+$"},
                    "additionalProperties": {"type": "string"},
                    "description": "OTEL_* environment of the processor (Envoy: "
                                   "OTEL_RESOURCE_ATTRIBUTES)"},
        "metrics": obj({
            "processor": obj({"enabled": {"type": "boolean"}, "port": port}),
            "podAnnotations": {"type": "boolean"},
            "serviceMonitor": obj({
                "enabled": {"type": "boolean"},
                "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            }),
            "dashboard": obj({
                "enabled": {"type": "boolean",
                            "description": "a ConfigMap with the Grafana dashboard"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"},
                           "description": "the Grafana sidecar's label (grafana_dashboard)"},
                "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
            }),
            "prometheusRule": obj({
                "enabled": {"type": "boolean",
                            "description": "a PrometheusRule with the alert rules"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            }),
        }),
        "tools": obj({
            "enabled": {"type": "boolean",
                        "description": "the tool route on its own listener and Service"},
            "servers": {"type": "array",
                        "description": "the tool servers (host:port); required when enabled",
                        "items": {"type": "string", "pattern": "^[^:\\s]+:[0-9]+$"}},
            "servicePort": port,
            "networkPolicyFrom": {**k8s_list, "description": "the model servers' pods: the "
                                  "only peers admitted to the tool port"},
        }),
        "service": obj({"type": enum("ClusterIP", "NodePort", "LoadBalancer"),
                        "port": port,
                        "annotations": {"type": "object",
                                        "additionalProperties": {"type": "string"}}}),
        "podDisruptionBudget": obj({
            "enabled": {"type": "boolean"},
            "minAvailable": {"type": ["integer", "string", "null"]},
            "maxUnavailable": {"type": ["integer", "string", "null"]},
        }),
        "networkPolicy": obj({"enabled": {"type": "boolean"}, "from": k8s_list,
                              "metricsFrom": k8s_list}),
        "serviceAccount": obj({"create": {"type": "boolean"}, "name": nullable_str,
                               "annotations": {"type": "object",
                                               "additionalProperties": {"type": "string"}}}),
        "podSecurityContext": k8s_obj,
        "securityContext": k8s_obj,
        "podAnnotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "podLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
        "tolerations": k8s_list,
        "affinity": k8s_obj,
        "topologySpreadConstraints": k8s_list,
        "priorityClassName": nullable_str,
    }),
}
if __name__ == "__main__":
    print(json.dumps(schema, indent=2))

{{/*
The Envoy bootstrap: a line-for-line port of extproc/envoy_config.py render() (not plain),
for --listen 0.0.0.0:envoy.port --admin 0.0.0.0:envoy.adminPort
--processor unix:<socket> --replica host:port... and the processor config the chart renders.
tests/deploy/test_helm_chart.py renders both for every values file and requires them equal
(the one allowed difference: a replica given by name makes the cluster STRICT_DNS, which
the Python renderer cannot express yet). Change one, change the other.
*/}}
{{- define "lfe.envoyBootstrap" -}}
{{- $c := .Values.processor.config -}}
{{- $t := $c.timeouts -}}
{{- $attempts := int $c.policy.on_upstream_failure.before_first_delta.max_attempts -}}
{{- $first := float64 $t.first_delta_s -}}
{{- $fence := float64 $t.fence_wait_s -}}
{{- /* envoy_config.PER_TRY_MARGIN_S: Envoy's per-try timeout fires this long after the gate's own first-delta limit */ -}}
{{- $perTry := addf $first 0.25 -}}
{{- $hc := $c.pool.health_check -}}
{{- $od := $c.pool.outlier_detection -}}
{{- $stall := float64 $t.stall_after_first_delta_s -}}
{{- $idle := addf (mulf $first $attempts) $stall 30.0 -}}
{{- $etcdT := float64 $c.etcd.timeout_s -}}
{{- $guardTimeout := maxf 2.0 (mulf $etcdT 3) (addf (float64 $c.tools.wait_s) (mulf $etcdT 2)) -}}
{{- $bufLimit := max 1048576 (mul 2 (int64 $c.limits.max_request_body_bytes)) -}}
{{- $dnsNeeded := false -}}
{{- range .Values.replicas.endpoints -}}
{{- if not (or (regexMatch "^[0-9]{1,3}(\\.[0-9]{1,3}){3}$" .host) (contains ":" .host)) -}}
{{- $dnsNeeded = true -}}
{{- end -}}
{{- end -}}
admin:
  address:
    socket_address:
      address: 0.0.0.0
      port_value: {{ int .Values.envoy.adminPort }}
static_resources:
  listeners:
  - name: gateway
    address:
      socket_address:
        address: 0.0.0.0
        port_value: {{ int .Values.envoy.port }}
    per_connection_buffer_limit_bytes: {{ $bufLimit }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          '@type': type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          codec_type: AUTO
          stream_idle_timeout: {{ printf "%.3fs" $idle }}
          request_timeout: 0s
          access_log:
          - name: envoy.access_loggers.http_grpc
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig
              common_config:
                log_name: guard
                transport_api_version: V3
                grpc_service:
                  envoy_grpc:
                    cluster_name: extproc
                buffer_size_bytes: 0
                buffer_flush_interval: 0.05s
              additional_request_headers_to_log:
              - x-gateway-request-id
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc:
                  cluster_name: extproc
                initial_metadata:
                - key: x-extproc-role
                  value: guard
              failure_mode_allow: false
              metadata_options:
                receiving_namespaces:
                  untyped:
                  - envoy.lb
              message_timeout: {{ printf "%.3fs" $guardTimeout }}
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: BUFFERED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SKIP
                response_trailer_mode: SEND
          - name: envoy.filters.http.router
            typed_config:
              '@type': type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
              upstream_log:
              - name: envoy.access_loggers.http_grpc
                typed_config:
                  '@type': type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig
                  common_config:
                    log_name: gate
                    transport_api_version: V3
                    grpc_service:
                      envoy_grpc:
                        cluster_name: extproc
                    buffer_size_bytes: 0
                    buffer_flush_interval: 0.05s
                  additional_request_headers_to_log:
                  - x-gateway-request-id
                  - x-gateway-attempt-id
                  - x-envoy-attempt-count
                  - x-gateway-preadmitted
          route_config:
            name: local
            virtual_hosts:
            - name: gateway
              domains:
              - '*'
              include_request_attempt_count: true
              routes:
              - match:
                  prefix: /v1/requests/
                direct_response:
                  status: 404
              - match:
                  prefix: /
                route:
                  cluster: replicas
                  timeout: 0s
                  retry_policy:
                    retry_on: reset,connect-failure,refused-stream,5xx,retriable-status-codes
                    retriable_status_codes:
                    - 429
                    rate_limited_retry_back_off:
                      reset_headers:
                      - name: retry-after
                        format: SECONDS
                      max_interval: {{ printf "%.3fs" (minf 10.0 $first) }}
                    num_retries: {{ sub $attempts 1 }}
                    per_try_timeout: {{ printf "%.3fs" $perTry }}
                    retry_host_predicate:
                    - name: envoy.retry_host_predicates.previous_hosts
                      typed_config:
                        '@type': type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate
                    host_selection_retry_max_attempts: 5
                    retry_back_off:
                      base_interval: 0.010s
                      max_interval: 0.250s
  clusters:
  - name: replicas
    type: {{ ternary "STRICT_DNS" "STATIC" $dnsNeeded }}
    connect_timeout: 1s
    {{- if $c.pool.replicas }}
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            '@type': type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - metadata:
                key: envoy.lb
                path:
                - key: x-gateway-destination-endpoint
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    '@type': type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
    {{- else }}
    lb_policy: ROUND_ROBIN
    {{- end }}
    circuit_breakers:
      thresholds:
      - retry_budget:
          budget_percent:
            value: {{ mulf (float64 $c.policy.retry_budget.fraction) 100 }}
          min_retry_concurrency: {{ max 1 (int64 $c.policy.retry_budget.min_retries) }}
        max_connections: 100000
        max_pending_requests: 100000
        max_requests: 100000
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        '@type': type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http_protocol_options: {}
        http_filters:
        - name: envoy.filters.http.ext_proc
          typed_config:
            '@type': type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
            grpc_service:
              envoy_grpc:
                cluster_name: extproc
              initial_metadata:
              - key: x-extproc-role
                value: gate
            failure_mode_allow: false
            message_timeout: {{ printf "%.3fs" (addf $first $fence 5.0) }}
            max_message_timeout: {{ printf "%.3fs" (addf $first $fence 60.0) }}
            processing_mode:
              request_header_mode: SEND
              response_header_mode: SEND
              request_body_mode: NONE
              response_body_mode: STREAMED
              request_trailer_mode: SKIP
              response_trailer_mode: SKIP
            send_body_without_waiting_for_header_response: true
            request_attributes:
            - upstream.address
        - name: envoy.filters.http.upstream_codec
          typed_config:
            '@type': type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec
    load_assignment:
      cluster_name: replicas
      endpoints:
      - lb_endpoints:
        {{- range .Values.replicas.endpoints }}
        - endpoint:
            address:
              socket_address:
                address: {{ .host | quote }}
                port_value: {{ int .port }}
        {{- end }}
    {{- if $hc.enabled }}
    health_checks:
    - timeout: {{ printf "%.3fs" (float64 $hc.timeout_s) }}
      interval: {{ printf "%.3fs" (float64 $hc.interval_s) }}
      unhealthy_threshold: {{ int $hc.unhealthy_threshold }}
      healthy_threshold: {{ int $hc.healthy_threshold }}
      no_traffic_interval: {{ printf "%.3fs" (float64 $hc.interval_s) }}
      http_health_check:
        path: {{ $hc.path | quote }}
    {{- end }}
    {{- if $od.enabled }}
    outlier_detection:
      split_external_local_origin_errors: true
      consecutive_local_origin_failure: {{ int $od.consecutive_local_origin_failure }}
      enforcing_consecutive_local_origin_failure: 100
      consecutive_5xx: {{ int $od.consecutive_5xx }}
      enforcing_consecutive_5xx: 100
      enforcing_consecutive_gateway_failure: 0
      enforcing_success_rate: 0
      enforcing_local_origin_success_rate: 0
      interval: {{ printf "%.3fs" (float64 $od.interval_s) }}
      base_ejection_time: {{ printf "%.3fs" (float64 $od.base_ejection_time_s) }}
      max_ejection_time: {{ printf "%.3fs" (float64 $od.max_ejection_time_s) }}
      max_ejection_percent: {{ int $od.max_ejection_percent }}
    {{- end }}
  - name: extproc
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        '@type': type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          http2_protocol_options: {}
    per_connection_buffer_limit_bytes: 67108864
    circuit_breakers:
      thresholds:
      - max_requests: 1000000
        max_pending_requests: 1000000
        max_connections: 1000
    load_assignment:
      cluster_name: extproc
      endpoints:
      - lb_endpoints:
        - endpoint:
            address:
              pipe:
                path: {{ include "lfe.socket" . }}
{{- end -}}

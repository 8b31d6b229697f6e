{{/*
The processor config's cross-field rules (extproc/core/config.py, load_config), checked at
`helm template/install` instead of in a crash-looping pod. The schema checks each field
alone; these need two. Every message is `processor.config: ` followed by the very line
`extproc check-config` prints for the same config (tests/deploy/test_install.py compares
them), in load_config's order, so the first one reported is the same too.
*/}}

{{/* A number as Python prints a float: 3 -> 3.0, 0.5 -> 0.5. */}}
{{- define "lfe.pyfloat" -}}
{{- $f := float64 . -}}
{{- if eq $f (floor $f) -}}{{- printf "%.1f" $f -}}{{- else -}}{{- printf "%v" $f -}}{{- end -}}
{{- end -}}

{{- define "lfe.configFail" -}}
{{- fail (printf "processor.config: config error: %s" .) -}}
{{- end -}}

{{- define "lfe.validateProcessorConfig" -}}
{{- $c := .Values.processor.config -}}
{{- $e := $c.etcd -}}
{{- $t := $c.timeouts -}}
{{- $fd := float64 $t.first_delta_s -}}
{{- $fds := include "lfe.pyfloat" $t.first_delta_s -}}
{{- $ttl := int $e.attempt_lease_ttl_s -}}
{{- if lt (float64 $e.resend_deadline_s) (float64 $e.timeout_s) -}}
{{- include "lfe.configFail" (printf "etcd.resend_deadline_s: must be at least etcd.timeout_s (%s), got %s" (include "lfe.pyfloat" $e.timeout_s) (include "lfe.pyfloat" $e.resend_deadline_s)) -}}
{{- end -}}
{{- if and (not (kindIs "invalid" $t.first_delta_total_s)) (lt (float64 ($t.first_delta_total_s | default 0)) $fd) -}}
{{- include "lfe.configFail" (printf "timeouts.first_delta_total_s: must be >= timeouts.first_delta_s (%s)" $fds) -}}
{{- end -}}
{{- if ge (float64 $t.source_grace_s) $fd -}}
{{- include "lfe.configFail" (printf "timeouts.source_grace_s: must be < timeouts.first_delta_s (%s), or 0 (off), got %s" $fds (include "lfe.pyfloat" $t.source_grace_s)) -}}
{{- end -}}
{{- if gt (float64 $t.soft_first_delta_s) $fd -}}
{{- include "lfe.configFail" (printf "timeouts.soft_first_delta_s: must be <= timeouts.first_delta_s (%s)" $fds) -}}
{{- end -}}
{{- if and (not (kindIs "invalid" $c.tenancy.header)) (not (kindIs "invalid" $c.tenancy.api_key_header)) -}}
{{- include "lfe.configFail" "tenancy.api_key_header: set either header or api_key_header" -}}
{{- end -}}
{{- $te := $c.telemetry -}}
{{- if and (not (kindIs "invalid" $te.otlp_endpoint)) (or (not (kindIs "invalid" $te.otlp_ca_file)) .Values.otlpCa.secretName) (not (hasPrefix "https://" (toString $te.otlp_endpoint))) -}}
{{- include "lfe.configFail" (printf "telemetry.otlp_ca_file: needs an https:// telemetry.otlp_endpoint (or null, for OTEL_EXPORTER_OTLP_ENDPOINT), got '%s'" $te.otlp_endpoint) -}}
{{- end -}}
{{- $od := $c.pool.outlier_detection -}}
{{- if lt (float64 $od.max_ejection_time_s) (float64 $od.base_ejection_time_s) -}}
{{- include "lfe.configFail" (printf "pool.outlier_detection.max_ejection_time_s: must be >= base_ejection_time_s (%s)" (include "lfe.pyfloat" $od.base_ejection_time_s)) -}}
{{- end -}}
{{- if and (eq (toString $c.pool.discovery) "registry") $c.pool.replicas -}}
{{- include "lfe.configFail" "pool.replicas: must be empty with discovery: registry (the replicas register themselves: docs/pool-membership.md)" -}}
{{- end -}}
{{- if and (eq (toString $c.policy.on_upstream_failure.uncertain_source_liveness.wait_for) "lease_expiry") (lt $fd (float64 (add $ttl 1))) -}}
{{- include "lfe.configFail" (printf "timeouts.first_delta_s: must be >= etcd.attempt_lease_ttl_s + 1 (%d) with uncertain_source_liveness.wait_for: lease_expiry" (add $ttl 1)) -}}
{{- end -}}
{{- if lt (float64 $c.policy.retry_budget.in_flight_expiry_s) $fd -}}
{{- include "lfe.configFail" (printf "policy.retry_budget.in_flight_expiry_s: must be >= timeouts.first_delta_s (%s)" $fds) -}}
{{- end -}}
{{- if and (gt (float64 $ttl) (float64 $t.fence_wait_s)) (gt (float64 $t.fence_wait_s) 0.0) -}}
{{- include "lfe.configFail" (printf "timeouts.fence_wait_s: must be >= etcd.attempt_lease_ttl_s (%d)" $ttl) -}}
{{- end -}}
{{- end -}}

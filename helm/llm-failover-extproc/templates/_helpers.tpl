{{/* Names and labels. */}}
{{- define "lfe.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "lfe.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "lfe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lfe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "lfe.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "lfe.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "lfe.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "lfe.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The one place the processor's socket lives (a shared emptyDir). */}}
{{- define "lfe.socketDir" -}}/var/run/extproc{{- end -}}
{{- define "lfe.socket" -}}{{ include "lfe.socketDir" . }}/extproc.sock{{- end -}}

{{- define "lfe.image" -}}
{{- $repo := required "image.<container>.repository is required: the image to run" .img.repository -}}
{{- printf "%s:%s" $repo (default .chart.AppVersion .img.tag) -}}
{{- end -}}

{{/*
Checks that need more than one value (the schema checks each value alone).
Included by the Deployment, so `helm template` fails with these messages.
*/}}
{{- define "lfe.validate" -}}
{{- $v := .Values -}}
{{- if not $v.replicas.endpoints -}}
{{- fail "replicas.endpoints is required: list the model servers (host, port) Envoy may send attempts to" -}}
{{- end -}}
{{- if not $v.etcd.endpoints -}}
{{- fail "etcd.endpoints is required: the etcd client endpoints (host:port) holding the journal" -}}
{{- end -}}
{{- if gt (len $v.etcd.endpoints) 1 -}}
{{- range $i, $ep := $v.etcd.endpoints -}}
{{- if not (regexMatch "^[0-9]{1,3}(\\.[0-9]{1,3}){3}:[0-9]+$" $ep) -}}
{{- fail (printf "etcd.endpoints[%d]: %q: with more than one endpoint every endpoint must be an IPv4 address (the processor dials ipv4:a,b,...); give one DNS name instead (e.g. the etcd client Service) and gRPC balances over all its addresses" $i $ep) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $v.etcd.tls.enabled -}}
{{- $_ := required "etcd.tls.secretName is required when etcd.tls.enabled is true: a Secret with ca.crt (and tls.crt, tls.key for client-certificate auth)" $v.etcd.tls.secretName -}}
{{- end -}}
{{- if $v.etcd.auth.enabled -}}
{{- $_ := required "etcd.auth.secretName is required when etcd.auth.enabled is true: a Secret with username and password" $v.etcd.auth.secretName -}}
{{- end -}}
{{- if and $v.podDisruptionBudget.enabled (kindIs "invalid" $v.podDisruptionBudget.minAvailable) (kindIs "invalid" $v.podDisruptionBudget.maxUnavailable) -}}
{{- fail "podDisruptionBudget: set minAvailable or maxUnavailable (minAvailable wins when both are set), or enabled: false" -}}
{{- end -}}
{{- $min := include "lfe.minGraceSeconds" . | int -}}
{{- if not (kindIs "invalid" $v.terminationGracePeriodSeconds) -}}
{{- if lt (int $v.terminationGracePeriodSeconds) $min -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be at least %d = shutdown.drainSeconds + shutdown.maxStreamSeconds + shutdown.processorLingerSeconds + shutdown.processorStopSeconds + 5, or the kubelet kills streams the drain promised to let finish" (int $v.terminationGracePeriodSeconds) $min) -}}
{{- end -}}
{{- end -}}
{{- if eq (int $v.envoy.port) (int $v.envoy.adminPort) -}}
{{- fail "envoy.port and envoy.adminPort must differ" -}}
{{- end -}}
{{- end -}}

{{- define "lfe.minGraceSeconds" -}}
{{- $s := .Values.shutdown -}}
{{- add (int $s.drainSeconds) (int $s.maxStreamSeconds) (int $s.processorLingerSeconds) (int $s.processorStopSeconds) 5 -}}
{{- end -}}

{{- define "lfe.graceSeconds" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- include "lfe.minGraceSeconds" . -}}
{{- else -}}
{{- int .Values.terminationGracePeriodSeconds -}}
{{- end -}}
{{- end -}}

{{/* The processor's config file: values' processor.config plus what the chart owns. */}}
{{- define "lfe.processorConfig" -}}
{{- $cfg := deepCopy .Values.processor.config -}}
{{- $_ := set $cfg.server "listen" (printf "unix:%s" (include "lfe.socket" .)) -}}
{{- $_ := set $cfg.etcd "endpoints" .Values.etcd.endpoints -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Names and labels. */}}
{{- define "lfe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* fullnameOverride, else <release>-<name> (just <release> when it holds the name). The
longest suffix the chart adds is "-processor" (a ConfigMap) and "-metrics"/"-tools"
(Services, DNS labels of at most 63): the name is cut to 63 - 8 = 55 so they fit. */}}
{{- define "lfe.fullname" -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- $full := "" -}}
{{- if .Values.fullnameOverride -}}
{{- $full = .Values.fullnameOverride -}}
{{- else if contains $name .Release.Name -}}
{{- $full = .Release.Name -}}
{{- else -}}
{{- $full = printf "%s-%s" .Release.Name $name -}}
{{- end -}}
{{- $full | trunc 55 | trimSuffix "-" -}}
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

{{/* No default processor repository: the project publishes no image under a public name, and
a guessed one is an ImagePullBackOff (decision 0038). */}}
{{- define "lfe.image" -}}
{{- $repo := required (printf "image.%s.repository is required: the %s image to run (docs/helm.md, \"Install\"; `make image` builds one)" .name .name) .img.repository -}}
{{- printf "%s:%s" $repo (default .chart.AppVersion .img.tag) -}}
{{- end -}}

{{/*
Checks that need more than one value (the schema checks each value alone).
Included by the Deployment, so `helm template` fails with these messages.
*/}}
{{- define "lfe.validate" -}}
{{- include "lfe.validateProcessorConfig" . -}}
{{- $v := .Values -}}
{{- if eq (toString $v.processor.config.pool.discovery) "registry" -}}
{{- if $v.replicas.endpoints -}}
{{- fail "replicas.endpoints must be empty (set it to []) with processor.config.pool.discovery: registry: the model servers register themselves (docs/pool-membership.md)" -}}
{{- end -}}
{{- else if not $v.replicas.endpoints -}}
{{- fail "replicas.endpoints is required: list the model servers (host, port) Envoy may send attempts to" -}}
{{- end -}}
{{- if not $v.etcd.endpoints -}}
{{- fail "etcd.endpoints is required: the etcd client endpoints (host:port) holding the journal" -}}
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
{{- $kube := .Capabilities.KubeVersion.Version -}}
{{- if and (eq $v.shutdown.envoyPreStop "sleep") (semverCompare "<1.30.0-0" $kube) -}}
{{- fail (printf "shutdown.envoyPreStop=sleep needs Kubernetes >= 1.30 (the kubelet's sleep action), this is %s: use exec, or pass --kube-version to helm template" $kube) -}}
{{- end -}}
{{- if and $v.processor.nativeSidecar (semverCompare "<1.29.0-0" $kube) -}}
{{- fail (printf "processor.nativeSidecar=true needs Kubernetes >= 1.29 (init containers with restartPolicy: Always), this is %s: set it false, or pass --kube-version to helm template" $kube) -}}
{{- end -}}
{{- if $v.tools.enabled -}}
{{- if not $v.tools.servers -}}
{{- fail "tools.servers is required when tools.enabled is true: the tool servers (host:port) behind the tool route" -}}
{{- end -}}
{{- if and $v.networkPolicy.enabled (not $v.tools.networkPolicyFrom) -}}
{{- fail "tools.networkPolicyFrom is required when tools.enabled and networkPolicy.enabled are true: the model servers' pods (NetworkPolicyPeer list), the only ones admitted to the tool port" -}}
{{- end -}}
{{- end -}}
{{- $ports := list (int $v.envoy.port) (int $v.envoy.adminPort) (int $v.envoy.opsPort) -}}
{{- if $v.metrics.processor.enabled -}}{{- $ports = append $ports (int $v.metrics.processor.port) -}}{{- end -}}
{{- if $v.tools.enabled -}}{{- $ports = append $ports (int $v.envoy.toolPort) -}}{{- end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail (printf "envoy.port, envoy.adminPort, envoy.opsPort, metrics.processor.port (when enabled) and envoy.toolPort (when tools.enabled) must all differ: %v" $ports) -}}
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
{{- $m := .Values.metrics.processor -}}
{{- $_ := set $cfg.server "metrics_listen" (ternary (printf "0.0.0.0:%d" (int $m.port)) nil $m.enabled) -}}
{{- $tls := .Values.etcd.tls -}}
{{- if $tls.enabled -}}
{{- $t := dict "enabled" true "ca_file" nil "cert_file" nil "key_file" nil "server_name" $tls.serverName -}}
{{- if $tls.caCert -}}{{- $_ := set $t "ca_file" "/etc/extproc/etcd-tls/ca.crt" -}}{{- end -}}
{{- if $tls.clientCert -}}
{{- $_ := set $t "cert_file" "/etc/extproc/etcd-tls/tls.crt" -}}
{{- $_ := set $t "key_file" "/etc/extproc/etcd-tls/tls.key" -}}
{{- end -}}
{{- $_ := set $cfg.etcd "tls" $t -}}
{{- end -}}
{{- if .Values.otlpCa.secretName -}}
{{- $_ := set $cfg.telemetry "otlp_ca_file" "/etc/extproc/otlp-ca/ca.crt" -}}
{{- end -}}
{{- if .Values.etcd.auth.enabled -}}
{{- $_ := set $cfg.etcd "auth" (dict "username_file" "/etc/extproc/etcd-auth/username" "password_file" "/etc/extproc/etcd-auth/password") -}}
{{- end -}}
{{- /* The journal's other clusters (decision 0042): each with the main etcd's TLS and auth. */ -}}
{{- if .Values.etcd.shards -}}
{{- $shards := list -}}
{{- range .Values.etcd.shards -}}
{{- $s := dict "endpoints" .endpoints -}}
{{- if hasKey $cfg.etcd "tls" -}}{{- $_ := set $s "tls" $cfg.etcd.tls -}}{{- end -}}
{{- if hasKey $cfg.etcd "auth" -}}{{- $_ := set $s "auth" $cfg.etcd.auth -}}{{- end -}}
{{- $shards = append $shards $s -}}
{{- end -}}
{{- $_ := set $cfg.etcd "shards" $shards -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* `extproc render-envoy` as the envoy-bootstrap init container runs it. */}}
{{- define "lfe.renderEnvoyCommand" -}}
{{- $v := .Values -}}
{{- $cmd := concat $v.processor.renderEnvoyCommand (list
      "--config" "/etc/extproc/extproc.yaml"
      "--listen" (printf "0.0.0.0:%d" (int $v.envoy.port))
      "--admin" (printf "127.0.0.1:%d" (int $v.envoy.adminPort))
      "--ops" (printf "0.0.0.0:%d" (int $v.envoy.opsPort))
      "--processor" (printf "unix:%s" (include "lfe.socket" .))
      "--require-version" .Chart.AppVersion) -}}
{{- range $v.replicas.endpoints -}}
{{- $cmd = concat $cmd (list "--replica" (printf "%s:%d" .host (int .port))) -}}
{{- end -}}
{{- if $v.tools.enabled -}}
{{- $cmd = concat $cmd (list "--tool-listen" (printf "0.0.0.0:%d" (int $v.envoy.toolPort)) "--tools" (join "," $v.tools.servers)) -}}
{{- end -}}
{{- $cmd = concat $cmd (list "--out" "/etc/envoy/envoy.yaml") -}}
{{- toYaml $cmd -}}
{{- end -}}

{{/* OTEL_* settings (values.otelEnv), as env entries. */}}
{{- define "lfe.otelEnv" -}}
{{- range $k, $val := .Values.otelEnv }}
- name: {{ $k }}
  value: {{ $val | quote }}
{{- end }}
{{- end -}}

{{/* Envoy reads only OTEL_RESOURCE_ATTRIBUTES (its tracer's environment resource detector). */}}
{{- define "lfe.envoyOtelEnv" -}}
{{- with .Values.otelEnv.OTEL_RESOURCE_ATTRIBUTES }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The processor's environment; also the render init container's (so EXTPROC_* overrides
reach Envoy's bootstrap exactly as they reach the processor). */}}
{{- define "lfe.processorEnv" -}}
# One gateway id per pod: the journal tells gateways sharing etcd apart.
- name: EXTPROC_SERVER__GATEWAY_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
{{- include "lfe.otelEnv" . }}
{{- with .Values.processor.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The processor container (a main container, or a native sidecar in initContainers). */}}
{{- define "lfe.processorContainer" -}}
{{- $ := .ctx -}}
{{- $p := $.Values.processor.probes -}}
{{- $m := $.Values.metrics -}}
- name: processor
  image: {{ include "lfe.image" (dict "img" $.Values.image.processor "chart" $.Chart "name" "processor") | quote }}
  imagePullPolicy: {{ $.Values.image.processor.pullPolicy }}
  command:
    {{- toYaml $.Values.processor.command | nindent 4 }}
  env:
    {{- include "lfe.processorEnv" $ | nindent 4 }}
  {{- if $m.processor.enabled }}
  ports:
    - name: metrics
      containerPort: {{ int $m.processor.port }}
      protocol: TCP
  {{- end }}
  # Startup and liveness: the process answers (service "liveness", never etcd's fault).
  # Readiness: service "", SERVING only while etcd answers (server.readiness_grace_s).
  startupProbe:
    exec:
      command: {{ toJson .live }}
    periodSeconds: 2
    timeoutSeconds: {{ int $p.timeoutSeconds }}
    failureThreshold: {{ int $p.startupFailureThreshold }}
  readinessProbe:
    exec:
      command: {{ toJson .ready }}
    periodSeconds: {{ int $p.periodSeconds }}
    timeoutSeconds: {{ int $p.timeoutSeconds }}
    failureThreshold: {{ int $p.failureThreshold }}
  livenessProbe:
    exec:
      command: {{ toJson .live }}
    periodSeconds: {{ mul 2 (int $p.periodSeconds) }}
    timeoutSeconds: {{ int $p.timeoutSeconds }}
    failureThreshold: {{ int $p.failureThreshold }}
  resources:
    {{- toYaml $.Values.processor.resources | nindent 4 }}
  securityContext:
    {{- toYaml $.Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: processor-config
      mountPath: /etc/extproc/extproc.yaml
      subPath: extproc.yaml
      readOnly: true
    - name: processor-scripts
      mountPath: /opt/extproc/scripts
      readOnly: true
    - name: extproc-socket
      mountPath: {{ include "lfe.socketDir" $ }}
    - name: processor-tmp
      mountPath: /tmp
    {{- if $.Values.etcd.tls.enabled }}
    - name: etcd-tls
      mountPath: /etc/extproc/etcd-tls
      readOnly: true
    {{- end }}
    {{- if $.Values.etcd.auth.enabled }}
    - name: etcd-auth
      mountPath: /etc/extproc/etcd-auth
      readOnly: true
    {{- end }}
    {{- if $.Values.otlpCa.secretName }}
    - name: otlp-ca
      mountPath: /etc/extproc/otlp-ca
      readOnly: true
    {{- end }}
    {{- with $.Values.processor.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* The drain (files/drain.py) as a preStop: the processor's, or the drain container's. */}}
{{- define "lfe.drainLifecycle" -}}
{{- $s := .Values.shutdown -}}
lifecycle:
  preStop:
    exec:
      command:
        - {{ .Values.processor.python }}
        - /opt/extproc/scripts/drain.py
        - --admin
        - {{ printf "127.0.0.1:%d" (int .Values.envoy.adminPort) | quote }}
        - --drain-seconds
        - {{ $s.drainSeconds | int | quote }}
        - --max-stream-seconds
        - {{ $s.maxStreamSeconds | int | quote }}
        - --linger-seconds
        - {{ $s.processorLingerSeconds | int | quote }}
{{- end -}}

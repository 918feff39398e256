{{/*
Names. The prefix is truncated to 40 characters so that "<prefix>-<component>" plus a
StatefulSet's ordinal and revision hash stay within Kubernetes' 63-character limits.
*/}}
{{- define "sluice.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluice.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>"; call with (dict "root" $ "component" "router"). */}}
{{- define "sluice.componentName" -}}
{{- printf "%s-%s" (include "sluice.fullname" .root) .component -}}
{{- end -}}

{{- define "sluice.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels of every resource; call with (dict "root" $ "component" "router"). */}}
{{- define "sluice.labels" -}}
helm.sh/chart: {{ include "sluice.chart" .root }}
{{ include "sluice.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: sluice
{{- end -}}

{{- define "sluice.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluice.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "sluice.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sluice.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "sluice.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
etcd endpoints for --etcd: the bundled etcd's client Service, or the external list.
Discovery is how the router finds workers in a cluster, so one of the two is required.
*/}}
{{- define "sluice.etcdEndpoints" -}}
{{- if and .Values.etcd.enabled .Values.etcd.external.endpoints -}}
{{- fail "etcd: set etcd.enabled=false to use etcd.external.endpoints (or clear the list to use the bundled etcd)" -}}
{{- else if .Values.etcd.enabled -}}
{{- printf "http://%s:%d" (include "sluice.componentName" (dict "root" . "component" "etcd")) (int .Values.etcd.clientPort) -}}
{{- else if .Values.etcd.external.endpoints -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- fail "etcd: the router finds workers through etcd; set etcd.enabled=true (bundled) or etcd.external.endpoints" -}}
{{- end -}}
{{- end -}}

{{/* storageClassName of a claim: "" → the default class (omitted), "-" → no class. */}}
{{- define "sluice.storageClass" -}}
{{- if eq . "-" }}
storageClassName: ""
{{- else if . }}
storageClassName: {{ . | quote }}
{{- end -}}
{{- end -}}

{{/* Environment of every sluice container. */}}
{{- define "sluice.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: RUST_LOG
  value: {{ .Values.logLevel | quote }}
- name: SLUICE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- if .Values.tls.enabled }}
- name: SLUICE_TLS_DIR
  value: {{ include "sluice.tlsDir" . | quote }}
- name: SLUICE_TLS_SERVER_NAME
  value: {{ include "sluice.tlsServerName" . | quote }}
- name: SLUICE_TLS_RELOAD_MS
  value: {{ .Values.tls.reloadMs | int | toString | quote }}
{{- else }}
# TLS is off (tls.enabled=false): plaintext on the pod network is an explicit choice.
- name: SLUICE_INSECURE_PLAINTEXT
  value: "true"
{{- end }}
{{- with .Values.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.pod.name=$(POD_NAME),k8s.namespace.name={{ $.Release.Namespace }}"
{{- end }}
{{- end -}}

{{/* UCX environment of the pods that move KV (prefill, decode, kvstore). */}}
{{- define "sluice.ucxEnv" -}}
- name: UCX_TLS
  value: {{ .Values.workers.ucx.tls | quote }}
{{- with .Values.workers.ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- range $name, $value := .Values.workers.ucx.env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{/* The model volume (read-only). */}}
{{- define "sluice.modelVolume" -}}
- name: model
{{- $v := .Values.model.volume }}
{{- if eq $v.type "hostPath" }}
  hostPath:
    path: {{ $v.hostPath.path | quote }}
    type: {{ $v.hostPath.type }}
{{- else if eq $v.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ include "sluice.componentName" (dict "root" . "component" "model") }}
    readOnly: true
{{- else if eq $v.type "existingClaim" }}
{{- if not $v.existingClaim }}
{{- fail "model.volume.existingClaim: name the claim holding the model (model.volume.type=existingClaim)" }}
{{- end }}
  persistentVolumeClaim:
    claimName: {{ $v.existingClaim }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "sluice.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
{{- with .Values.model.volume.subPath }}
  subPath: {{ . }}
{{- end }}
{{- end -}}

{{/* Arguments every service takes: --model, --model-name. */}}
{{- define "sluice.modelArgs" -}}
{{- $args := list "--model" .Values.model.path -}}
{{- with .Values.model.name -}}
{{- $args = concat $args (list "--model-name" .) -}}
{{- end -}}
{{- toJson $args -}}
{{- end -}}

{{/* prometheus.io/* pod annotations for annotation-based scraping. */}}
{{- define "sluice.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | int | toString | quote }}
prometheus.io/path: /metrics
{{- if .root.Values.tls.enabled }}
prometheus.io/scheme: https
{{- end }}
{{- end }}
{{- end -}}

{{/* ---------------------------------------------------------------- TLS (docs/security.md) */}}

{{/* Where every pod mounts the certificate Secret. */}}
{{- define "sluice.tlsDir" -}}
/etc/sluice/tls
{{- end -}}

{{/* http or https, for the URLs services dial each other by. */}}
{{- define "sluice.scheme" -}}
{{- if .Values.tls.enabled }}https{{ else }}http{{ end -}}
{{- end -}}

{{/* The Secret holding tls.crt, tls.key and ca.crt. */}}
{{- define "sluice.tlsSecretName" -}}
{{- if eq .Values.tls.source "existingSecret" -}}
{{- required "tls.existingSecret: name the Secret with tls.crt, tls.key and ca.crt (tls.source=existingSecret)" .Values.tls.existingSecret -}}
{{- else -}}
{{- include "sluice.componentName" (dict "root" . "component" "tls") -}}
{{- end -}}
{{- end -}}

{{/*
The name services check each other's certificates for (--tls-server-name): peers found in
etcd are dialed by pod IP, which no certificate names. It is never looked up in DNS.
*/}}
{{- define "sluice.tlsServerName" -}}
{{- printf "%s.%s.sluice.internal" (include "sluice.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* DNS names of the certificate (JSON list): the peer name, every Service, localhost. */}}
{{- define "sluice.tlsDnsNames" -}}
{{- $names := list (include "sluice.tlsServerName" .) "localhost" -}}
{{- range $c := list "router" "prefill" "decode" "kvstore" -}}
{{- $svc := include "sluice.componentName" (dict "root" $ "component" $c) -}}
{{- $names = concat $names (list $svc (printf "%s.%s" $svc $.Release.Namespace) (printf "%s.%s.svc" $svc $.Release.Namespace) (printf "*.%s.%s.svc" $svc $.Release.Namespace)) -}}
{{- end -}}
{{- concat $names .Values.tls.extraDnsNames | uniq | toJson -}}
{{- end -}}

{{- define "sluice.tlsVolume" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  secret:
    secretName: {{ include "sluice.tlsSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* The whole Secret as a directory (no subPath), so a renewal reaches the files. */}}
{{- define "sluice.tlsMount" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  mountPath: {{ include "sluice.tlsDir" . }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
A probe's action; call with (dict "root" $ "port" 50061 "service" "sluice.v1.Prefill").
Kubernetes' native gRPC probes speak plaintext only: with TLS the probe runs
`sluice health`, which dials TLS and presents the pod's certificate (internal ports
require one).
*/}}
{{- define "sluice.probeAction" -}}
{{- if .root.Values.tls.enabled -}}
exec:
  command:
    - sluice
    - health
    - --addr
    - {{ printf "https://127.0.0.1:%d" (int .port) }}
    {{- with .service }}
    - --service
    - {{ . }}
    {{- end }}
{{- else -}}
grpc:
  port: {{ int .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* A PodDisruptionBudget; call with (dict "root" $ "component" "router" "pdb" .Values.router.pdb). */}}
{{- define "sluice.pdb" -}}
{{- if .pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "sluice.componentName" . }}
  labels:
    {{- include "sluice.labels" . | nindent 4 }}
spec:
  {{- if hasKey .pdb "minAvailable" }}
  minAvailable: {{ .pdb.minAvailable }}
  {{- else }}
  maxUnavailable: {{ .pdb.maxUnavailable }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "sluice.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* `--kvstore <url>` for the services that use the prefix store, when it is deployed. */}}
{{- define "sluice.kvstoreArgs" -}}
{{- if .Values.kvstore.enabled -}}
{{- list "--kvstore" (printf "%s://%s:%d" (include "sluice.scheme" .) (include "sluice.componentName" (dict "root" . "component" "kvstore")) (int .Values.kvstore.port)) | toJson -}}
{{- else -}}
[]
{{- end -}}
{{- end }}

{{/*
GPUs a prefill or decode pod requests: the role's `gpus` when set, else
workers.gpusPerWorker; none when the workers compute on the CPU.
dict "root" $ "v" <role values>
*/}}
{{- define "sluice.workerGpus" -}}
{{- if eq .root.Values.workers.device "cpu" -}}0
{{- else if kindIs "invalid" .v.gpus -}}{{ int .root.Values.workers.gpusPerWorker }}
{{- else -}}{{ int .v.gpus }}
{{- end -}}
{{- end -}}

{{/*
The worker's device flags for its GPUs (a JSON list): --device for one (or the CPU),
--devices cuda:0,…,cuda:N-1 for several; refuses pools that do not split over them.
dict "root" $ "v" <role values> "role" "prefill"|"decode"
*/}}
{{- define "sluice.deviceArgs" -}}
{{- $n := int (include "sluice.workerGpus" .) -}}
{{- $device := .root.Values.workers.device -}}
{{- if and (ne $device "cpu") (eq $n 0) -}}
{{- fail (printf "%s.gpus is 0 but workers.device is %s: request GPUs or set workers.device to cpu" .role $device) -}}
{{- end -}}
{{- if le $n 1 -}}
{{- if eq $device "cuda" -}}{{- $device = "cuda:0" -}}{{- end -}}
{{- list "--device" $device | toJson -}}
{{- else -}}
{{- range $flag := list "maxPages" "maxSequences" -}}
{{- if ne (mod (int (index $.v $flag)) $n) 0 -}}
{{- fail (printf "%s.%s (%d) must be a multiple of the %d GPUs a %s pod spans (each GPU holds an equal share)" $.role $flag (int (index $.v $flag)) $n $.role) -}}
{{- end -}}
{{- end -}}
{{- $devices := list -}}
{{- range $i := until $n -}}{{- $devices = append $devices (printf "cuda:%d" $i) -}}{{- end -}}
{{- list "--devices" (join "," $devices) | toJson -}}
{{- end -}}
{{- end -}}

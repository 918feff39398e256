{{/*
A KV-moving service (prefill or decode worker, kvstore): a headless Service (stable DNS
for StatefulSets, scrape target for the ServiceMonitor) and a Deployment or StatefulSet.

Call with (dict "root" $ "component" "prefill" "v" .Values.prefill "binary" "prefill-worker"
"args" (list ...role flags...) "healthService" "sluice.v1.Prefill" "kind" "Deployment"
"gpus" 1 "claims" (list ...volumeClaimTemplates...) "mounts" (list ...) "volumes" (list ...)
"discovery" true).

The gRPC port is fixed (--listen 0.0.0.0:<port>) and advertised from the pod IP
(--advertise http://$(POD_IP):<port>), which is what the worker registers in etcd.
*/}}
{{- define "sluice.worker" -}}
{{- $root := .root -}}
{{- $v := .v -}}
{{- $name := include "sluice.componentName" . -}}
{{- $port := int $v.port -}}
{{- $metricsPort := int $v.metricsPort -}}
{{- $hostNetwork := $root.Values.workers.hostNetwork -}}
{{- $drain := int (default 30 $v.drainTimeoutS) -}}
{{- $args := list "--listen" (printf "0.0.0.0:%d" $port) -}}
{{- if ne .discovery false -}}
{{- /* Workers register in etcd; the kvstore is found through its Service instead. */ -}}
{{- $args = concat $args (list "--advertise" (printf "%s://$(POD_IP):%d" (include "sluice.scheme" $root) $port)) -}}
{{- $args = concat $args (list "--etcd" (include "sluice.etcdEndpoints" $root) "--cluster" $root.Values.clusterName) -}}
{{- end -}}
{{- $args = concat $args .args (list "--metrics-listen" (printf "0.0.0.0:%d" $metricsPort)) $v.extraArgs -}}
{{- /* Extended resources (GPU, RDMA) go into both requests and limits. */ -}}
{{- $resources := deepCopy (default dict $v.resources) -}}
{{- $requests := deepCopy (default dict $resources.requests) -}}
{{- $limits := deepCopy (default dict $resources.limits) -}}
{{- if gt (int (default 0 .gpus)) 0 -}}
{{- $_ := set $requests $root.Values.workers.gpuResourceName (int .gpus) -}}
{{- $_ := set $limits $root.Values.workers.gpuResourceName (int .gpus) -}}
{{- end -}}
{{- if $root.Values.workers.rdma.enabled -}}
{{- $_ := set $requests $root.Values.workers.rdma.resourceName (int $root.Values.workers.rdma.count) -}}
{{- $_ := set $limits $root.Values.workers.rdma.resourceName (int $root.Values.workers.rdma.count) -}}
{{- end -}}
{{- $_ := set $resources "requests" $requests -}}
{{- $_ := set $resources "limits" $limits -}}
{{- $securityContext := deepCopy $root.Values.securityContext -}}
{{- if $root.Values.workers.rdma.enabled -}}
{{- /* Registering KV memory with an RDMA NIC pins it (RLIMIT_MEMLOCK). */ -}}
{{- $caps := deepCopy (default dict $securityContext.capabilities) -}}
{{- $_ := set $caps "add" (append (default list $caps.add) "IPC_LOCK" | uniq) -}}
{{- $_ := set $securityContext "capabilities" $caps -}}
{{- end -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "sluice.labels" . | nindent 4 }}
    sluice.io/scrape: "true"
spec:
  clusterIP: None
  selector:
    {{- include "sluice.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $port }}
      targetPort: grpc
      {{- if not $root.Values.tls.enabled }}
      appProtocol: kubernetes.io/h2c
      {{- end }}
    - name: metrics
      port: {{ $metricsPort }}
      targetPort: metrics
---
apiVersion: apps/v1
kind: {{ .kind }}
metadata:
  name: {{ $name }}
  labels:
    {{- include "sluice.labels" . | nindent 4 }}
spec:
  replicas: {{ int $v.replicas }}
  {{- if eq .kind "StatefulSet" }}
  serviceName: {{ $name }}
  podManagementPolicy: Parallel
  {{- end }}
  selector:
    matchLabels:
      {{- include "sluice.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "sluice.selectorLabels" . | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with merge (dict) (default dict $v.podAnnotations) (include "sluice.scrapeAnnotations" (dict "root" $root "port" $metricsPort) | fromYaml) }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "sluice.serviceAccountName" $root }}
      # Service links would put <SERVICE>_PORT variables into the environment; the
      # services read SLUICE_* variables as flag fallbacks, so keep it clean.
      enableServiceLinks: false
      {{- if $hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      # Drain (--drain-timeout-s) plus time to deregister and exit.
      terminationGracePeriodSeconds: {{ add $drain 30 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $root.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "sluice.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: [{{ .binary | quote }}]
          args:
            {{- toYaml $args | nindent 12 }}
          env:
            {{- include "sluice.commonEnv" $root | nindent 12 }}
            {{- include "sluice.ucxEnv" $root | nindent 12 }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $metricsPort }}
              protocol: TCP
          # grpc.health.v1 (natively, or with `sluice health` over TLS). Liveness asks for
          # the server (""); readiness for the service, which reports NOT_SERVING while draining.
          startupProbe:
            {{- include "sluice.probeAction" (dict "root" $root "port" $port) | nindent 12 }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: {{ max 1 (div (int $v.startupTimeoutSeconds) 10) }}
          livenessProbe:
            {{- include "sluice.probeAction" (dict "root" $root "port" $port) | nindent 12 }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 6
          readinessProbe:
            {{- include "sluice.probeAction" (dict "root" $root "port" $port "service" .healthService) | nindent 12 }}
            periodSeconds: 5
            timeoutSeconds: 5
            failureThreshold: 2
          resources:
            {{- toYaml $resources | nindent 12 }}
          {{- with $securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- if .model }}
            {{- include "sluice.modelMount" $root | nindent 12 }}
            {{- end }}
            - name: dshm
              mountPath: /dev/shm
            - name: tmp
              mountPath: /tmp
            {{- with include "sluice.tlsMount" $root }}{{ . | nindent 12 }}{{ end }}
            {{- with .mounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- if .model }}
        {{- include "sluice.modelVolume" $root | nindent 8 }}
        {{- end }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $root.Values.workers.shmSize }}
        - name: tmp
          emptyDir: {}
        {{- with include "sluice.tlsVolume" $root }}{{ . | nindent 8 }}{{ end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
  {{- with .claims }}
  volumeClaimTemplates:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{ include "sluice.pdb" (dict "root" $root "component" .component "pdb" $v.pdb) }}
{{- end -}}

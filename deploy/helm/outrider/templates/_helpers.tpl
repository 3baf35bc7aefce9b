{{/*
Chart name, truncated to the 63 characters a label value allows.
*/}}
{{- define "outrider.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: release-chart, or the release name when it already holds the chart
name. Components append "-coordinator", "-target" or "-draft", so keep room.
*/}}
{{- define "outrider.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Name of one component's objects. Call with (dict "root" $ "component" "target").
*/}}
{{- define "outrider.componentName" -}}
{{- printf "%s-%s" (include "outrider.fullname" .root) .component }}
{{- end }}

{{/*
Labels of every object.
*/}}
{{- define "outrider.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "outrider.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: outrider
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of one component. Call with (dict "root" $ "component" "target").
*/}}
{{- define "outrider.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outrider.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
All labels of one component's objects.
*/}}
{{- define "outrider.componentLabels" -}}
{{ include "outrider.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Whether a draft-worker pool is deployed: "true", or "" (false in an if).
It is, with drafting on (draft.enabled), for the drafters that run a model
(model, int4, gguf, early-exit, eagle). The prompt-lookup and suffix drafters run in the
coordinator (--prompt-lookup, --suffix-decoding), with no draft pod.
*/}}
{{- define "outrider.draftWorker" -}}
{{- if and .Values.draft.enabled (not (has .Values.draft.drafter (list "prompt-lookup" "suffix"))) }}true{{ end }}
{{- end }}

{{/*
Whether the coordinator drafts by suffix decoding: "true", or "". It does for
the suffix drafter, and beside a drafter that runs a model with
draft.suffixDecoding (each round drafting by whichever pays).
*/}}
{{- define "outrider.suffixDecoding" -}}
{{- if and .Values.draft.enabled (or (eq .Values.draft.drafter "suffix") (and .Values.draft.suffixDecoding (include "outrider.draftWorker" .))) }}true{{ end }}
{{- end }}

{{/*
The ServiceAccount the coordinator runs as.
*/}}
{{- define "outrider.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "outrider.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference.
*/}}
{{- define "outrider.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Names `outrider models fetch` knows (outrider.model_specs.EMBEDDED_MODELS; a test
keeps the two in step). A model given by one of these names is converted into
the cache by an init container before the service starts.
*/}}
{{- define "outrider.embeddedModels" -}}
smollm2-135m-instruct
{{- end }}

{{/*
The embedded model a component needs fetched, or "" when it needs none.
Call with (dict "model" MODEL "uses" BOOL); an empty model means the default
model, which is embedded.
*/}}
{{- define "outrider.fetchedModel" -}}
{{- if .uses }}
{{- $model := default "smollm2-135m-instruct" .model }}
{{- if has $model (splitList "\n" (include "outrider.embeddedModels" .)) }}
{{- $model }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Init container that converts an embedded model into the cache volume.
Call with (dict "root" $ "model" NAME).
*/}}
{{- define "outrider.fetchInitContainer" -}}
- name: fetch-model
  image: {{ include "outrider.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  args: ["models", "fetch", {{ .model | quote }}]
  env:
    - name: OUTRIDER_CACHE_DIR
      value: /var/cache/outrider
  securityContext:
    {{- toYaml .root.Values.containerSecurityContext | nindent 4 }}
  resources:
    {{- toYaml .root.Values.models.fetch.resources | nindent 4 }}
  volumeMounts:
    - name: cache
      mountPath: /var/cache/outrider
    - name: tmp
      mountPath: /tmp
{{- end }}

{{/*
Environment every service shares: where it listens, logging, caches, metrics,
and how long it drains on SIGTERM (5 s inside the pod's termination grace
period, so that it exits before the kubelet's SIGKILL).
Call with (dict "root" $ "port" PORT "grace" TERMINATION_GRACE_SECONDS).
*/}}
{{- define "outrider.commonEnv" -}}
- name: OUTRIDER_HOST
  value: {{ .root.Values.listenHost | quote }}
- name: OUTRIDER_PORT
  value: {{ .port | quote }}
- name: OUTRIDER_SHUTDOWN_GRACE_S
  value: {{ max 0 (sub (int .grace) 5) | quote }}
- name: OUTRIDER_LOG_LEVEL
  value: {{ .root.Values.logLevel | quote }}
- name: OUTRIDER_CACHE_DIR
  value: /var/cache/outrider
- name: HF_HOME
  value: /var/cache/outrider/huggingface
{{- if .root.Values.metrics.enabled }}
- name: OUTRIDER_METRICS_PORT
  value: {{ .root.Values.metrics.port | quote }}
{{- end }}
{{- with .root.Values.models.hubToken.secretName }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.root.Values.models.hubToken.key }}
{{- end }}
{{- end }}

{{/*
Serving TLS of a service from the Secret mounted at /etc/outrider/tls.
Call with (dict "requireClientCert" BOOL).
*/}}
{{- define "outrider.serverTlsEnv" -}}
- name: OUTRIDER_TLS_CERT
  value: /etc/outrider/tls/tls.crt
- name: OUTRIDER_TLS_KEY
  value: /etc/outrider/tls/tls.key
{{- if .requireClientCert }}
- name: OUTRIDER_TLS_CLIENT_CA
  value: /etc/outrider/tls/ca.crt
{{- end }}
{{- end }}

{{/*
The gRPC probes of a service. Plaintext: Kubernetes' native grpc probe against
grpc.health.v1 (overall status ""). TLS: an exec probe, because the kubelet's
grpc probe cannot speak TLS. Call with
(dict "root" $ "port" PORT "probes" .Values.X.probes "tls" BOOL "clientCert" BOOL "serverName" NAME).
*/}}
{{- define "outrider.probes" -}}
{{- $handler := dict "grpc" (dict "port" (int .port)) }}
{{- if .tls }}
{{- $command := list "python" "-m" "outrider.probe" "--port" (toString .port) "--tls-ca" "/etc/outrider/tls/ca.crt" "--server-name" .serverName }}
{{- if .clientCert }}
{{- $command = concat $command (list "--tls-cert" "/etc/outrider/tls/tls.crt" "--tls-key" "/etc/outrider/tls/tls.key") }}
{{- end }}
{{- $handler = dict "exec" (dict "command" $command) }}
{{- end }}
startupProbe:
  {{- toYaml (merge (dict) $handler .probes.startup) | nindent 2 }}
livenessProbe:
  {{- toYaml (merge (dict) $handler .probes.liveness) | nindent 2 }}
readinessProbe:
  {{- toYaml (merge (dict) $handler .probes.readiness) | nindent 2 }}
{{- end }}

{{/*
The device a worker pool runs its model on (OUTRIDER_DEVICE): the pool's
device value when set, else cuda when the pool requests GPUs (the device
plugin shows the container only its own, so cuda is the first of them) and
cpu when it requests none. Call with a pool's values.
*/}}
{{- define "outrider.workerDevice" -}}
{{- if .device }}
{{- .device }}
{{- else if gt (int .gpu.count) 0 }}
{{- "cuda" }}
{{- else }}
{{- "cpu" }}
{{- end }}
{{- end }}

{{/*
GPUs per pod of a GPU pool: gpu.count, or tensorParallelSize when it is
larger (one GPU a rank). Call with a pool's values.
*/}}
{{- define "outrider.workerGpus" -}}
{{- max (int .gpu.count) (int .tensorParallelSize) }}
{{- end }}

{{/*
Container resources plus the GPUs of a worker pool. Call with a pool's values.
*/}}
{{- define "outrider.workerResources" -}}
{{- $resources := deepCopy (default (dict) .resources) }}
{{- if gt (int .gpu.count) 0 }}
{{- $gpus := dict .gpu.resourceName (include "outrider.workerGpus" . | int) }}
{{- $_ := set $resources "limits" (merge (default (dict) $resources.limits) $gpus) }}
{{- $_ := set $resources "requests" (merge (default (dict) $resources.requests) $gpus) }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
Scheduling and pod-level settings a component's values carry. Call with a
component's values.
*/}}
{{- define "outrider.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
terminationGracePeriodSeconds: {{ .terminationGracePeriodSeconds }}
{{- end }}

{{/*
Volumes of every pod: the writable cache and /tmp (the root filesystem is
read-only), and the optional read-only models volume.
*/}}
{{- define "outrider.volumes" -}}
- name: cache
  emptyDir:
    {{- with .Values.models.cache.medium }}
    medium: {{ . }}
    {{- end }}
    sizeLimit: {{ .Values.models.cache.sizeLimit }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- with .Values.models.volume }}
- name: models
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "outrider.volumeMounts" -}}
- name: cache
  mountPath: /var/cache/outrider
- name: tmp
  mountPath: /tmp
{{- if .Values.models.volume }}
- name: models
  mountPath: {{ .Values.models.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
The container ports of a service: grpc, and metrics when enabled.
*/}}
{{- define "outrider.containerPorts" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
{{- if .root.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .root.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end }}

{{/*
In-cluster DNS name of a component's Service, the name TLS certificates are
verified against by the exec probe.
*/}}
{{- define "outrider.serviceHost" -}}
{{- printf "%s.%s.svc" (include "outrider.componentName" .) .root.Release.Namespace }}
{{- end }}

{{/*
The Deployment of a worker pool (target or draft): the two differ only in
their values and in the flags of their role, passed as roleEnv (YAML).
Call with (dict "root" $ "component" "target" "values" .Values.target
"usesModel" BOOL "roleEnv" YAML).
*/}}
{{- define "outrider.workerDeployment" -}}
{{- $root := .root }}
{{- $values := .values }}
{{- $component := dict "root" $root "component" .component }}
{{- $tls := $root.Values.tls }}
{{- $fetch := include "outrider.fetchedModel" (dict "model" $values.model "uses" .usesModel) }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "outrider.componentName" $component }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "outrider.componentLabels" $component | nindent 4 }}
spec:
  replicas: {{ $values.replicas }}
  {{- with $values.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "outrider.selectorLabels" $component | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "outrider.selectorLabels" $component | nindent 8 }}
        {{- with $values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $values.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      # Workers never call the Kubernetes API: no token in their pods.
      automountServiceAccountToken: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- include "outrider.scheduling" $values | trim | nindent 6 }}
      {{- if $fetch }}
      initContainers:
        {{- include "outrider.fetchInitContainer" (dict "root" $root "model" $fetch) | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "outrider.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - serve
            - {{ .component }}
            {{- with $values.extraArgs }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          env:
            {{- include "outrider.commonEnv" (dict "root" $root "port" $values.port "grace" $values.terminationGracePeriodSeconds) | nindent 12 }}
            {{- if and .usesModel $values.model }}
            - name: OUTRIDER_MODEL
              value: {{ $values.model | quote }}
            {{- end }}
            - name: OUTRIDER_DEVICE
              value: {{ include "outrider.workerDevice" $values | quote }}
            - name: OUTRIDER_DTYPE
              value: {{ $values.dtype | quote }}
            - name: OUTRIDER_THREADS
              value: {{ int $values.threads | quote }}
            {{- if gt (int $values.tensorParallelSize) 1 }}
            - name: OUTRIDER_TENSOR_PARALLEL_SIZE
              value: {{ int $values.tensorParallelSize | quote }}
            {{- end }}
            {{- if gt (int $values.maxTokensPerStep) 0 }}
            - name: OUTRIDER_MAX_TOKENS_PER_STEP
              value: {{ int $values.maxTokensPerStep | quote }}
            {{- end }}
            {{- if gt (int $values.maxPrefillTokens) 0 }}
            - name: OUTRIDER_MAX_PREFILL_TOKENS
              value: {{ int $values.maxPrefillTokens | quote }}
            {{- end }}
            {{- if $values.enforceEager }}
            - name: OUTRIDER_ENFORCE_EAGER
              value: "true"
            {{- end }}
            {{- if not $values.prefixCaching }}
            - name: OUTRIDER_ENABLE_PREFIX_CACHING
              value: "false"
            {{- end }}
            - name: OUTRIDER_MAX_SESSIONS
              value: {{ int $values.maxSessions | quote }}
            {{- if gt (int $values.maxCachedTokens) 0 }}
            - name: OUTRIDER_MAX_CACHED_TOKENS
              value: {{ int $values.maxCachedTokens | quote }}
            {{- end }}
            {{- if $values.trustRemoteCode }}
            - name: OUTRIDER_TRUST_REMOTE_CODE
              value: "true"
            {{- end }}
            {{- with .roleEnv }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- if $tls.enabled }}
            {{- include "outrider.serverTlsEnv" (dict "requireClientCert" $tls.workers.requireClientCert) | nindent 12 }}
            {{- end }}
            {{- with $values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            {{- include "outrider.containerPorts" (dict "root" $root "port" $values.port) | nindent 12 }}
          {{- include "outrider.probes" (dict "root" $root "port" $values.port "probes" $values.probes "tls" $tls.enabled "clientCert" $tls.workers.requireClientCert "serverName" (include "outrider.serviceHost" $component)) | trim | nindent 10 }}
          resources:
            {{- include "outrider.workerResources" $values | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            {{- include "outrider.volumeMounts" $root | nindent 12 }}
            {{- if gt (int $values.tensorParallelSize) 1 }}
            # the ranks' shared memory (NCCL's buffers between GPUs of the pod)
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            {{- if $tls.enabled }}
            - name: tls
              mountPath: /etc/outrider/tls
              readOnly: true
            {{- end }}
      volumes:
        {{- include "outrider.volumes" $root | nindent 8 }}
        {{- if gt (int $values.tensorParallelSize) 1 }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $values.sharedMemorySize }}
        {{- end }}
        {{- if $tls.enabled }}
        - name: tls
          secret:
            secretName: {{ required "tls.workers.secretName is required when tls.enabled" $tls.workers.secretName }}
        {{- end }}
{{- end }}

{{/*
The headless Service of a worker pool: no virtual IP and no load balancing.
The coordinator reads its EndpointSlices and opens each session on one ready
pod (sessions are sticky). Call with (dict "root" $ "component" "target" "values" .Values.target).
*/}}
{{- define "outrider.workerService" -}}
{{- $component := dict "root" .root "component" .component }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "outrider.componentName" $component }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "outrider.componentLabels" $component | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "outrider.selectorLabels" $component | nindent 4 }}
  ports:
    - name: grpc
      port: {{ .values.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if .root.Values.metrics.enabled }}
    - name: metrics
      port: {{ .root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- end }}
{{- end }}

{{/*
A component's PodDisruptionBudget. Call with (dict "root" $ "component" NAME "values" VALUES).
*/}}
{{- define "outrider.pdb" -}}
{{- $component := dict "root" .root "component" .component }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "outrider.componentName" $component }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "outrider.componentLabels" $component | nindent 4 }}
spec:
  maxUnavailable: {{ .values.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "outrider.selectorLabels" $component | nindent 6 }}
{{- end }}

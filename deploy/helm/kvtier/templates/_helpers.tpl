{{- define "kvtier.name" -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}{{- end }}
{{- define "kvtier.labels" -}}
app.kubernetes.io/name: {{ ternary "llm-engine" "kvtier-node" (eq .Values.mode "sidecar") }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: kvtier
{{- end }}
{{- /* The kvtier-sidecar library's context for this release: every kvtier container,
volume and engine setting comes from the library's templates with it. */ -}}
{{- define "kvtier.context" -}}
{{- $ctx := include "kvtier-sidecar.context" (dict "values" .Values "name" (include "kvtier.name" .)) | fromYaml -}}
{{- $_ := set $ctx "configMapName" (printf "%s-kvtier" (include "kvtier.name" .)) -}}
{{- $_ := set $ctx "namespace" .Values.engine.namespace -}}
{{- $_ := set $ctx "engineStopSeconds" .Values.engine.stopSeconds -}}
{{- if eq .Values.mode "sidecar" }}
{{- $_ := set $ctx "extraVolumeMounts" (list (dict "name" "dshm" "mountPath" "/dev/shm")) -}}
{{- else }}
{{- $_ := set $ctx "role" "daemon" -}}
{{- end }}
{{- toYaml $ctx }}
{{- end }}
{{- define "kvtier.hostGiB" -}}{{ mul .Values.kvtier.hostSizeGiB .Values.kvtier.maxPools }}{{- end }}
{{- define "kvtier.gpuUtil" -}}
{{- $free := subf .Values.gpu.totalGiB (mulf .Values.gpu.deviceSizeGiB .Values.kvtier.maxPools) .Values.gpu.cudaContextGiB -}}
{{- divf (floor (mulf (subf (divf $free .Values.gpu.totalGiB) .Values.gpu.utilizationMargin) 100)) 100 -}}
{{- end }}
{{- /* Pod template metadata and scheduling, both modes. */ -}}
{{- define "kvtier.podMetadata" -}}
labels:
  {{- include "kvtier.labels" . | nindent 2 }}
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  # A changed option rolls the pods.
  checksum/kvtier-config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
  {{- with .Values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
{{- define "kvtier.scheduling" -}}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := .Values.tolerations }}
{{- if .Values.gpu.enabled }}
{{- $tolerations = append $tolerations (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
{{- end }}
{{- with $tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- if and (eq .Values.mode "sidecar") .Values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- range .Values.topologySpreadConstraints }}
  {{- $c := deepCopy . }}
  {{- if not (hasKey $c "labelSelector") }}
  {{- $_ := set $c "labelSelector" (dict "matchLabels" (include "kvtier.labels" $ | fromYaml)) }}
  {{- end }}
  - {{ toYaml $c | nindent 4 | trim }}
  {{- end }}
{{- end }}
{{- end }}

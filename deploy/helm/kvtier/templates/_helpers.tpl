{{- define "kvtier.name" -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}{{- end }}
{{- define "kvtier.labels" -}}
app.kubernetes.io/name: llm-engine
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: kvtier
{{- end }}
{{- define "kvtier.hostGiB" -}}{{ mul .Values.kvtier.hostSizeGiB .Values.kvtier.maxPools }}{{- end }}
{{- define "kvtier.memoryGiB" -}}{{ add (mul .Values.kvtier.hostSizeGiB .Values.kvtier.maxPools) .Values.kvtier.memoryOverheadGiB }}{{- end }}
{{- define "kvtier.grace" -}}{{ add .Values.engine.stopSeconds (mul 2 .Values.kvtier.drainTimeoutSeconds) 15 }}{{- end }}
{{- define "kvtier.gpuUtil" -}}
{{- $free := subf .Values.gpu.totalGiB (mulf .Values.gpu.deviceSizeGiB .Values.kvtier.maxPools) .Values.gpu.cudaContextGiB -}}
{{- divf (floor (mulf (subf (divf $free .Values.gpu.totalGiB) .Values.gpu.utilizationMargin) 100)) 100 -}}
{{- end }}

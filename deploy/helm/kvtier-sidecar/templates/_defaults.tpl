{{- /*
The settings every template here reads, with their defaults: the same keys, with the same
defaults, as deploy/helm/kvtier/values.yaml (tests/deploy/test_helm_chart.py checks that
they agree). An including chart passes its own block; what it leaves out comes from here.
*/ -}}
{{- define "kvtier-sidecar.defaults" -}}
mode: sidecar
image:
  kvtier: {repository: your-registry/kvtier, tag: "0.1.0", pullPolicy: IfNotPresent}
  kvtierCuda: {repository: your-registry/kvtier, tag: "0.1.0-cuda"}
kvtier:
  hostSizeGiB: 8
  diskSizeGiB: 200
  maxPools: 1
  drainTimeoutSeconds: 30
  memoryOverheadGiB: 2
  cpu: {request: "2", limit: "4"}
config:
  policy: frecency
  fsync: batch
  io_depth: 16
warmRestart:
  enabled: true
  window: 5m
  resources:
    requests: {cpu: 50m, memory: 64Mi}
    limits: {memory: 64Mi}
metrics:
  port: 9188
events:
  enabled: false
  port: 5557
  endpoint: ""
tokens:
  enabled: false
  secretName: kvtier-tokens
gpu:
  enabled: false
  deviceSizeGiB: 8
cache:
  mode: volumeClaimTemplate
  hostPath: {path: /mnt/nvme/kvtier}
  emptyDir: {sizeLimit: 200Gi}
node:
  socketDir: /var/run/kvtier
  cacheDir: /var/lib/kvtier
  prepareDirs: true
{{- end }}

{{- /*
The context every other template takes: include "kvtier-sidecar.context" (dict "values"
.Values.kvtier "name" "my-engine") | fromYaml. `values` is your block (any subset of the
defaults above), `name` prefixes the objects the templates name (the tokens Secret is
yours, named by tokens.secretName).
*/ -}}
{{- define "kvtier-sidecar.context" -}}
{{- $spec := include "kvtier-sidecar.merge" (list (include "kvtier-sidecar.defaults" . | fromYaml) (.values | default dict)) | fromYaml -}}
{{- if not (has $spec.mode (list "sidecar" "node")) }}
{{- fail (printf "kvtier mode is %q: use sidecar (one daemon per engine pod) or node (one per node, a DaemonSet)" $spec.mode) }}
{{- end }}
{{- if not (has $spec.cache.mode (list "volumeClaimTemplate" "hostPath" "emptyDir")) }}
{{- fail "cache.mode is volumeClaimTemplate, hostPath or emptyDir" }}
{{- end }}
{{- if and $spec.gpu.enabled (eq $spec.mode "node") }}
{{- fail "gpu.enabled needs mode sidecar: the device tier shares the engine pod's GPU claim" }}
{{- end }}
{{- toYaml (dict "spec" $spec "name" (required "kvtier-sidecar.context needs a name" .name)) }}
{{- end }}

{{- /* (list base over): base with over's keys deep-merged over it, as YAML. Unlike sprig's
mergeOverwrite it keeps a false, 0 or "" that `over` sets (warmRestart.enabled: false). */ -}}
{{- define "kvtier-sidecar.merge" -}}
{{- $out := deepCopy (index . 0) -}}
{{- range $k, $v := index . 1 }}
{{- if and (kindIs "map" $v) (kindIs "map" (index $out $k)) }}
{{- $_ := set $out $k (include "kvtier-sidecar.merge" (list (index $out $k) $v) | fromYaml) }}
{{- else }}
{{- $_ := set $out $k $v }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{- /*
The kvtier containers. Every template takes the context of "kvtier-sidecar.context"
(`spec`, `name`), optionally with `configMapName` (the daemon reads its options from that
ConfigMap, made of "kvtier-sidecar.daemonEnv", instead of inline env) and
`extraVolumeMounts` (more mounts for the daemon, e.g. a shared /dev/shm).
*/ -}}

{{- define "kvtier-sidecar.socketDir" -}}/run/kvtier{{- end }}
{{- define "kvtier-sidecar.keeperSocket" -}}/run/kvtier-keeper/keeper.sock{{- end }}
{{- define "kvtier-sidecar.memoryGiB" -}}
{{- add (mul .spec.kvtier.hostSizeGiB .spec.kvtier.maxPools) .spec.kvtier.memoryOverheadGiB }}
{{- end }}

{{- /* A value as the daemon reads it from its environment: whole numbers without an exponent. */ -}}
{{- define "kvtier-sidecar.envValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) }}{{ int64 . }}{{ else }}{{ . }}{{ end }}
{{- end }}

{{- /* The daemon's options as KVTIER_* variables (a map): what the chart derives, then `config`. */ -}}
{{- define "kvtier-sidecar.daemonEnv" -}}
{{- $s := .spec -}}
KVTIER_SOCKET: {{ include "kvtier-sidecar.socketDir" . }}/kvtier.sock
KVTIER_CACHE_DIR: /var/cache/kvtier
KVTIER_HOST_SIZE: {{ printf "%dGiB" (int $s.kvtier.hostSizeGiB) | quote }}
KVTIER_DISK_SIZE: {{ printf "%dGiB" (int $s.kvtier.diskSizeGiB) | quote }}
KVTIER_MAX_POOLS: {{ $s.kvtier.maxPools | quote }}
KVTIER_DRAIN_TIMEOUT: {{ printf "%ds" (int $s.kvtier.drainTimeoutSeconds) | quote }}
KVTIER_METRICS_PORT: {{ $s.metrics.port | quote }}
KVTIER_METRICS_HOST: "0.0.0.0"
{{- if $s.warmRestart.enabled }}
KVTIER_KEEPER_SOCKET: {{ include "kvtier-sidecar.keeperSocket" . }}
{{- else }}
KVTIER_WARM_RESTART_WINDOW: "0"
{{- end }}
{{- if $s.events.enabled }}
{{- if include "kvtier-sidecar.eventsBound" . }}
KVTIER_EVENTS: {{ printf "tcp://*:%d" (int $s.events.port) | quote }}
{{- else }}
KVTIER_EVENTS: {{ $s.events.endpoint | quote }}
{{- if hasPrefix "tcp://" $s.events.endpoint }}
KVTIER_EVENTS_CONNECT: "true"
{{- end }}
{{- end }}
{{- end }}
{{- if $s.tokens.enabled }}
KVTIER_AUTH: tokens
KVTIER_TOKENS_FILE: /etc/kvtier/tokens/tokens.toml
{{- end }}
{{- if $s.gpu.enabled }}
KVTIER_DEVICE_SIZE: {{ printf "%dGiB" (int $s.gpu.deviceSizeGiB) | quote }}
KVTIER_GPU: "0"
{{- end }}
{{- range $k, $v := $s.config }}
{{ printf "KVTIER_%s" (upper $k) }}: {{ include "kvtier-sidecar.envValue" $v | quote }}
{{- end }}
{{- end }}

{{- /* "true" when the daemon binds the events port (events on, no endpoint to dial): the
pod then has the port `kv-events` for routers to connect to. */ -}}
{{- define "kvtier-sidecar.eventsBound" -}}
{{- if and .spec.events.enabled (not .spec.events.endpoint) }}true{{ end }}
{{- end }}

{{- define "kvtier-sidecar.image" -}}
{{- $img := ternary .spec.image.kvtierCuda .spec.image.kvtier .spec.gpu.enabled -}}
{{ printf "%s:%s" $img.repository $img.tag }}
{{- end }}

{{- /* The daemon's and the keeper's: the image's user, nothing the daemon does not need. */ -}}
{{- define "kvtier-sidecar.securityContext" -}}
runAsNonRoot: true
runAsUser: 10001  # the images' kvtier user (deploy/images/Dockerfile)
runAsGroup: 2000
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{- /* Who this kvtier is, for the events' topic placeholders ({pod_ip}, {node}, ...). */ -}}
{{- define "kvtier-sidecar.identityEnv" -}}
- name: KVTIER_POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: KVTIER_NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
- name: KVTIER_POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
{{- end }}

{{- /* The arena keeper (warm restart): holds the host arenas' descriptors while the daemon's
container restarts. A native sidecar declared before the daemon, so it starts first and
stops last. */ -}}
{{- define "kvtier-sidecar.keeperContainer" -}}
{{- $s := .spec -}}
- name: kvtier-keeper
  image: {{ include "kvtier-sidecar.image" . | quote }}
  imagePullPolicy: {{ $s.image.kvtier.pullPolicy }}
  restartPolicy: Always
  args: [keeper, --socket, {{ include "kvtier-sidecar.keeperSocket" . }}, --window, {{ $s.warmRestart.window | quote }}]
  resources: {{- toYaml $s.warmRestart.resources | nindent 4 }}
  securityContext: {{- include "kvtier-sidecar.securityContext" . | nindent 4 }}
  # The daemon starts once the keeper's socket is there.
  startupProbe:
    exec: {command: [test, -S, {{ include "kvtier-sidecar.keeperSocket" . }}]}
    periodSeconds: 1
    failureThreshold: 30
  volumeMounts:
    - {name: keeper, mountPath: /run/kvtier-keeper}
{{- end }}

{{- /* Node mode: the hostPath directories belong to root when the kubelet creates them; hand
them to the daemon's uid and group (2770) before it starts. */ -}}
{{- define "kvtier-sidecar.prepareDirsContainer" -}}
- name: kvtier-dirs
  image: {{ include "kvtier-sidecar.image" . | quote }}
  imagePullPolicy: {{ .spec.image.kvtier.pullPolicy }}
  command: [install, -d, -o, "10001", -g, "2000", -m, "2770", {{ include "kvtier-sidecar.socketDir" . }}, /var/cache/kvtier]
  resources:
    requests: {cpu: 10m, memory: 16Mi}
    limits: {memory: 16Mi}
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    readOnlyRootFilesystem: true
    allowPrivilegeEscalation: false
    capabilities: {drop: [ALL], add: [CHOWN, FOWNER]}
    seccompProfile: {type: RuntimeDefault}
  volumeMounts:
    - {name: kvtier-run, mountPath: {{ include "kvtier-sidecar.socketDir" . }}}
    - {name: kvtier-cache, mountPath: /var/cache/kvtier}
{{- end }}

{{- /* The daemon. In sidecar mode a native sidecar (restartPolicy Always: started before the
engine, stopped after it); in node mode the DaemonSet pod's main container. */ -}}
{{- define "kvtier-sidecar.daemonContainer" -}}
{{- $s := .spec -}}
{{- $sidecar := eq $s.mode "sidecar" -}}
- name: kvtier
  image: {{ include "kvtier-sidecar.image" . | quote }}
  imagePullPolicy: {{ $s.image.kvtier.pullPolicy }}
  {{- if $sidecar }}
  restartPolicy: Always
  {{- end }}
  # The image's ENTRYPOINT is `kvtier`.
  args: ["serve"]
  {{- if .configMapName }}
  envFrom:
    - configMapRef: {name: {{ .configMapName }}}
  {{- end }}
  env:
    {{- include "kvtier-sidecar.identityEnv" . | nindent 4 }}
    {{- if not .configMapName }}
    {{- range $k, $v := include "kvtier-sidecar.daemonEnv" . | fromYaml }}
    - {name: {{ $k }}, value: {{ $v | quote }}}
    {{- end }}
    {{- end }}
  ports:
    - {name: metrics, containerPort: {{ $s.metrics.port }}}
    {{- if include "kvtier-sidecar.eventsBound" . }}
    - {name: kv-events, containerPort: {{ $s.events.port }}}
    {{- end }}
  resources:
    # host_size x max_pools of memfd pages + overhead; requests = limits
    {{- $mem := include "kvtier-sidecar.memoryGiB" . }}
    requests: {cpu: {{ $s.kvtier.cpu.request | quote }}, memory: {{ $mem }}Gi, ephemeral-storage: 1Gi}
    limits: {cpu: {{ $s.kvtier.cpu.limit | quote }}, memory: {{ $mem }}Gi, ephemeral-storage: 1Gi}
    {{- if $s.gpu.enabled }}
    claims: [{name: gpu}]
    {{- end }}
  securityContext: {{- include "kvtier-sidecar.securityContext" . | nindent 4 }}
  startupProbe:
    httpGet: {path: /readyz, port: metrics}
    periodSeconds: 2
    failureThreshold: 90
  readinessProbe:
    httpGet: {path: /readyz, port: metrics}
    periodSeconds: 5
    failureThreshold: 2
  livenessProbe:
    httpGet: {path: /healthz, port: metrics}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 6
  volumeMounts:
    - {name: kvtier-run, mountPath: {{ include "kvtier-sidecar.socketDir" . }}}
    {{- if and $sidecar (eq $s.cache.mode "hostPath") }}
    - {name: kvtier-cache, mountPath: /var/cache/kvtier, subPathExpr: $(KVTIER_POD_NAME)}
    {{- else }}
    - {name: kvtier-cache, mountPath: /var/cache/kvtier}
    {{- end }}
    - {name: kvtier-tmp, mountPath: /tmp}
    {{- if $s.warmRestart.enabled }}
    - {name: keeper, mountPath: /run/kvtier-keeper}
    {{- end }}
    {{- if $s.tokens.enabled }}
    - {name: kvtier-tokens, mountPath: /etc/kvtier/tokens, readOnly: true}
    {{- end }}
    {{- with .extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{- /* The pod's kvtier init containers, in order: (node mode) the directories, the keeper,
(sidecar mode) the daemon. Put them first in the engine pod's initContainers. */ -}}
{{- define "kvtier-sidecar.initContainers" -}}
{{- if and (eq .spec.mode "node") .spec.node.prepareDirs }}
{{ include "kvtier-sidecar.prepareDirsContainer" . }}
{{- end }}
{{- if .spec.warmRestart.enabled }}
{{ include "kvtier-sidecar.keeperContainer" . }}
{{- end }}
{{- if eq .spec.mode "sidecar" }}
{{ include "kvtier-sidecar.daemonContainer" . }}
{{- end }}
{{- end }}

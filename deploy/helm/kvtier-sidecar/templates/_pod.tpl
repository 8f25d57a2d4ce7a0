{{- /*
The engine pod's side: volumes, the pod's security context, the engine container's env,
mounts and --kv-transfer-config. Same context as the containers' templates.
*/ -}}

{{- /* The pod's volumes for kvtier. Sidecar mode: everything the daemon and the keeper mount,
except `kvtier-cache` with cache.mode volumeClaimTemplate (a StatefulSet's claim template of
that name: yours). Node mode: with `role: daemon` the DaemonSet pod's; with `role: engine`
(an engine pod on a node-wide daemon) only the host's socket directory and the token. */ -}}
{{- define "kvtier-sidecar.volumes" -}}
{{- $s := .spec -}}
{{- $daemonPod := or (eq $s.mode "sidecar") (eq (.role | default "engine") "daemon") -}}
{{- if eq $s.mode "node" }}
- name: kvtier-run
  hostPath: {path: {{ $s.node.socketDir }}, type: DirectoryOrCreate}
{{- else }}
- name: kvtier-run
  emptyDir: {medium: Memory, sizeLimit: 16Mi}
{{- end }}
{{- if $daemonPod }}
- name: kvtier-tmp
  emptyDir: {sizeLimit: 256Mi}
{{- if $s.warmRestart.enabled }}
- name: keeper
  emptyDir: {medium: Memory, sizeLimit: 1Mi}
{{- end }}
{{- if eq $s.mode "node" }}
- name: kvtier-cache
  hostPath: {path: {{ $s.node.cacheDir }}, type: DirectoryOrCreate}
{{- else if eq $s.cache.mode "hostPath" }}
- name: kvtier-cache
  hostPath: {path: {{ $s.cache.hostPath.path }}, type: Directory}
{{- else if eq $s.cache.mode "emptyDir" }}
- name: kvtier-cache
  emptyDir: {{- toYaml $s.cache.emptyDir | nindent 4 }}
{{- end }}
{{- if $s.tokens.enabled }}
- name: kvtier-tokens
  secret:
    secretName: {{ $s.tokens.secretName }}
    defaultMode: 0440
    items: [{key: tokens.toml, path: tokens.toml}]
{{- end }}
{{- end }}
{{- if and $s.tokens.enabled (or (eq $s.mode "sidecar") (ne (.role | default "engine") "daemon")) }}
- name: kvtier-engine-token
  secret:
    secretName: {{ $s.tokens.secretName }}
    defaultMode: 0440
    items: [{key: engine.token, path: token}]
{{- end }}
{{- end }}

{{- /* The pod's securityContext: group 2000 owns the sockets (0660) and the cache. */ -}}
{{- define "kvtier-sidecar.podSecurityContext" -}}
fsGroup: 2000
fsGroupChangePolicy: OnRootMismatch
supplementalGroups: [2000]
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{- /* The engine container's env: where the daemon is. */ -}}
{{- define "kvtier-sidecar.engineEnv" -}}
- {name: KVTIER_TARGET, value: {{ printf "unix://%s/kvtier.sock" (include "kvtier-sidecar.socketDir" .) }}}
{{- end }}

{{- /* The engine container's mounts: the socket directory at the daemon's path (the daemon
names its handoff socket by path), and its token. */ -}}
{{- define "kvtier-sidecar.engineVolumeMounts" -}}
- {name: kvtier-run, mountPath: {{ include "kvtier-sidecar.socketDir" . }}}
{{- if .spec.tokens.enabled }}
- {name: kvtier-engine-token, mountPath: /etc/kvtier/engine-token, readOnly: true}
{{- end }}
{{- end }}

{{- /* vLLM's --kv-transfer-config (JSON) for the kvtier connector; `namespace` in the context
is the kvtier namespace the engine uses. */ -}}
{{- define "kvtier-sidecar.kvTransferConfig" -}}
{{- $extra := dict "target" (printf "unix://%s/kvtier.sock" (include "kvtier-sidecar.socketDir" .)) "namespace" (required "kvtier-sidecar.kvTransferConfig needs a namespace" .namespace) }}
{{- if .spec.tokens.enabled }}
{{- $_ := set $extra "token_file" "/etc/kvtier/engine-token/token" }}
{{- end }}
{{- toJson (dict "kv_connector" "KVTierConnector" "kv_connector_module_path" "kvtier_client.integrations.vllm" "kv_role" "kv_both" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" $extra) }}
{{- end }}

{{- /* terminationGracePeriodSeconds: the engine's stop (`engineStopSeconds` in the context,
30 by default) + drain_timeout (leases) + drain_timeout (the copy to disk) + 15 s. */ -}}
{{- define "kvtier-sidecar.terminationGracePeriodSeconds" -}}
{{- add (ternary .engineStopSeconds 30 (hasKey . "engineStopSeconds")) (mul 2 .spec.kvtier.drainTimeoutSeconds) 15 }}
{{- end }}

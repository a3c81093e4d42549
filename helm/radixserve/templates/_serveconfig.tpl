{{/*
The Ray Serve config (RayService serveConfigV2): the application `serve run cluster.app:deployment`
starts, with ClusterArgs from the values. ClusterArgs rejects keys of the other mode, so only the
chosen mode's keys are rendered. The API / admin keys are not here: ClusterArgs reads them from the
pods' environment (RADIXSERVE_API_KEY / RADIXSERVE_ADMIN_KEY, from the Secret).

`deployments:` overrides only ray_actor_options of the pool deployments, adding the pool's custom
resource (radixserve_<pool>) to the num_cpus / num_gpus the builder sets from the same values
(num_gpus: replica.numGpus x tensorParallelSize, every rank's GPU in the one replica actor). Serve
replaces ray_actor_options as a whole, so the override repeats them (tests/test_helm.py checks the
override against the builder's own options).
*/}}
{{- define "radixserve.autoscalingArgs" -}}
min_replicas: {{ .minReplicas }}
max_replicas: {{ .maxReplicas }}
target_waiting_per_replica: {{ .targetWaitingPerReplica }}
target_kv_usage: {{ .targetKvUsage }}
upscale_delay_s: {{ .upscaleDelayS }}
downscale_delay_s: {{ .downscaleDelayS }}
{{- if not (kindIs "invalid" .ttftTargetMs) }}
ttft_target_ms: {{ .ttftTargetMs }}
{{- end }}
{{- if not (kindIs "invalid" .itlTargetMs) }}
itl_target_ms: {{ .itlTargetMs }}
{{- end }}
{{- end }}

{{- define "radixserve.serveArgs" -}}
{{- $v := .Values }}
{{- $args := dict "mode" $v.mode "policy" $v.policy "num_cpus" $v.replica.numCpus }}
{{- $_ := set $args "num_gpus" (include "radixserve.replicaGpus" . | int) }}
{{- $_ := set $args "tensor_parallel_size" (include "radixserve.tensorParallelSize" . | int) }}
{{- with $v.model.path }}{{ $_ := set $args "model" . }}{{ end }}
{{- with $v.model.servedName }}{{ $_ := set $args "served_model_name" . }}{{ end }}
{{- if eq $v.mode "disaggregated" }}
{{- $_ := set $args "prefill_workers" $v.pools.prefill.replicas }}
{{- $_ := set $args "decode_workers" $v.pools.decode.replicas }}
{{- $_ := set $args "kv_transfer" $v.kvTransfer.backend }}
{{- $_ := set $args "kv_transfer_timeout_s" $v.kvTransfer.timeoutS }}
{{- if $v.pools.prefill.autoscaling.enabled }}
{{- $_ := set $args "prefill_autoscaling" (include "radixserve.autoscalingArgs" $v.pools.prefill.autoscaling | fromYaml) }}
{{- end }}
{{- if $v.pools.decode.autoscaling.enabled }}
{{- $_ := set $args "decode_autoscaling" (include "radixserve.autoscalingArgs" $v.pools.decode.autoscaling | fromYaml) }}
{{- end }}
{{- else }}
{{- $_ := set $args "workers" $v.pools.unified.replicas }}
{{- if $v.pools.unified.autoscaling.enabled }}
{{- $_ := set $args "autoscaling" (include "radixserve.autoscalingArgs" $v.pools.unified.autoscaling | fromYaml) }}
{{- end }}
{{- end }}
{{- range $key, $value := $v.serveArgs }}
{{- $_ := set $args $key $value }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{- define "radixserve.serveConfig" -}}
{{- $v := .Values }}
{{- $overrides := list }}
{{- range $pool, $deployment := include "radixserve.pools" . | fromYaml }}
{{- $resources := dict (include "radixserve.poolResource" $pool) 1 }}
{{- $options := dict "num_cpus" $v.replica.numCpus "num_gpus" (include "radixserve.replicaGpus" $ | int) "resources" $resources }}
{{- $overrides = append $overrides (dict "name" $deployment "ray_actor_options" $options) }}
{{- end }}
{{- $app := dict "name" "radixserve" "route_prefix" "/" "import_path" "cluster.app:deployment" }}
{{- $_ := set $app "args" (include "radixserve.serveArgs" . | fromYaml) }}
{{- $_ := set $app "deployments" $overrides }}
{{- $config := dict "proxy_location" $v.serve.proxyLocation "applications" (list $app) }}
{{- $_ := set $config "http_options" (dict "host" "0.0.0.0" "port" $v.serve.port) }}
{{- toYaml $config }}
{{- end }}

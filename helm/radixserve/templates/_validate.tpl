{{/*
Rules values.schema.json cannot express; each failure names the values to change.
Included once, at the top of rayservice.yaml.
*/}}
{{- define "radixserve.validate" -}}
{{- $v := .Values }}
{{- if eq $v.mode "disaggregated" }}
{{- $prefillTp := int $v.pools.prefill.tensorParallelSize }}
{{- $decodeTp := int $v.pools.decode.tensorParallelSize }}
{{- if ne $prefillTp $decodeTp }}
{{- fail (printf "pools.prefill.tensorParallelSize (%d) and pools.decode.tensorParallelSize (%d) must be equal in mode: disaggregated (ClusterArgs has one tensor_parallel_size: KV moves from each prefill rank to the same decode rank)" $prefillTp $decodeTp) }}
{{- end }}
{{- end }}
{{- range $pool, $deployment := include "radixserve.pools" . | fromYaml }}
{{- $p := index $v.pools $pool }}
{{- $tp := int $p.tensorParallelSize }}
{{- if and (gt $tp 1) (gt (int $v.replica.numGpus) 1) }}
{{- fail (printf "replica.numGpus (%v) is GPUs per tensor-parallel rank: each rank uses one, so set it to 1 (or 0 for CPU) with pools.%s.tensorParallelSize %d" $v.replica.numGpus $pool $tp) }}
{{- end }}
{{- if and $p.autoscaling.enabled (gt (int $p.autoscaling.minReplicas) (int $p.autoscaling.maxReplicas)) }}
{{- fail (printf "pools.%s.autoscaling: minReplicas (%v) must not exceed maxReplicas (%v)" $pool $p.autoscaling.minReplicas $p.autoscaling.maxReplicas) }}
{{- end }}
{{- if and (not (kindIs "invalid" $p.maxPods)) $p.autoscaling.enabled }}
{{- $minPods := include "radixserve.ceilDiv" (dict "a" $p.autoscaling.minReplicas "b" $p.replicasPerPod) | int }}
{{- if lt (int $p.maxPods) $minPods }}
{{- fail (printf "pools.%s.maxPods (%v) is below the %d pods that autoscaling.minReplicas needs" $pool $p.maxPods $minPods) }}
{{- end }}
{{- end }}
{{- end }}
{{- $managed := dict
  "mode" "mode" "model" "model.path" "served_model_name" "model.servedName" "policy" "policy"
  "num_cpus" "replica.numCpus" "num_gpus" "replica.numGpus (per rank)"
  "tensor_parallel_size" "pools.<pool>.tensorParallelSize"
  "workers" "pools.unified.replicas" "prefill_workers" "pools.prefill.replicas" "decode_workers" "pools.decode.replicas"
  "autoscaling" "pools.unified.autoscaling" "prefill_autoscaling" "pools.prefill.autoscaling"
  "decode_autoscaling" "pools.decode.autoscaling"
  "kv_transfer" "kvTransfer.backend" "kv_transfer_timeout_s" "kvTransfer.timeoutS"
  "api_key" "auth.apiKey (kept in a Secret)" "admin_api_key" "auth.adminKey (kept in a Secret)" }}
{{- range $key, $_ := $v.serveArgs }}
{{- if hasKey $managed $key }}
{{- fail (printf "serveArgs.%s: the chart sets this ClusterArgs field; set %s instead" $key (index $managed $key)) }}
{{- end }}
{{- end }}
{{- if and $v.auth.apiKey (eq $v.auth.apiKey $v.auth.adminKey) }}
{{- fail "auth.adminKey must differ from auth.apiKey" }}
{{- end }}
{{- if and $v.auth.existingSecret (or $v.auth.apiKey $v.auth.adminKey) }}
{{- fail "auth.existingSecret is set: leave auth.apiKey and auth.adminKey empty (the keys come from that Secret)" }}
{{- end }}
{{- end }}

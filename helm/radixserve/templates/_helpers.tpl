{{/* Names and labels. */}}
{{- define "radixserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-radixserve, or fullnameOverride. KubeRay derives <fullname>-head-svc etc. from it,
     so it is kept to 40 characters. */}}
{{- define "radixserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "radixserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radixserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "radixserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "radixserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "radixserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "radixserve.secretName" -}}
{{- default (printf "%s-keys" (include "radixserve.fullname" .)) .Values.auth.existingSecret }}
{{- end }}

{{/* The pools of the chosen mode, in order: pool name -> Serve deployment name. */}}
{{- define "radixserve.pools" -}}
{{- if eq .Values.mode "disaggregated" }}
prefill: Prefill
decode: Decode
{{- else }}
unified: Worker
{{- end }}
{{- end }}

{{/* Ray custom resource that pins a pool's replicas to its worker group. */}}
{{- define "radixserve.poolResource" -}}
{{- printf "radixserve_%s" . }}
{{- end }}

{{/* ceil(a / b) for positive integers: (dict "a" a "b" b). */}}
{{- define "radixserve.ceilDiv" -}}
{{- $a := int .a }}{{ $b := int .b }}
{{- div (add $a (sub $b 1)) $b }}
{{- end }}

{{/* The tensor-parallel size of the mode's pools (ClusterArgs tensor_parallel_size, one for all
     pools): unified's, or prefill's in disaggregated mode (_validate.tpl keeps prefill and decode
     equal there). */}}
{{- define "radixserve.tensorParallelSize" -}}
{{- $pool := ternary "prefill" "unified" (eq .Values.mode "disaggregated") }}
{{- int (index .Values.pools $pool).tensorParallelSize }}
{{- end }}

{{/* GPUs one worker replica reserves: replica.numGpus per tensor-parallel rank (ClusterArgs num_gpus,
     the Serve replica's num_gpus). */}}
{{- define "radixserve.replicaGpus" -}}
{{- mul (int .Values.replica.numGpus) (include "radixserve.tensorParallelSize" . | int) }}
{{- end }}

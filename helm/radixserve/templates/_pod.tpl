{{/* Pod parts shared by the head and the worker groups. */}}

{{/* Environment of every Ray container: the keys (from the Secret), the KV-transfer transport, extraEnv. */}}
{{- define "radixserve.env" -}}
{{- if or .Values.auth.apiKey .Values.auth.adminKey .Values.auth.existingSecret }}
- name: RADIXSERVE_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "radixserve.secretName" . }}, key: api-key, optional: true}
- name: RADIXSERVE_ADMIN_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "radixserve.secretName" . }}, key: admin-key, optional: true}
{{- end }}
{{- range $name, $value := .Values.kvTransfer.env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Whether a pod gets a memory-backed /dev/shm: (dict "root" $ "ranks" <tensor-parallel size>).
     The ranks of a tensor-parallel replica share host memory through /dev/shm (NCCL, PyTorch), and
     a container's own is 64 MiB; skipped when extraVolumeMounts mount /dev/shm themselves. */}}
{{- define "radixserve.devShm" -}}
{{- $own := false }}
{{- range .root.Values.extraVolumeMounts }}{{ if eq (trimSuffix "/" .mountPath) "/dev/shm" }}{{ $own = true }}{{ end }}{{ end }}
{{- if and (gt (int .ranks) 1) (not $own) }}true{{ end }}
{{- end }}

{{/* Pod spec fields besides containers: (dict "root" $ "spec" <head or pool values> "shm" <devShm>). */}}
{{- define "radixserve.podSpecCommon" -}}
{{- $v := .root.Values }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with $v.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .spec.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $volumes := default list $v.extraVolumes }}
{{- if .shm }}
{{- $volumes = append $volumes (dict "name" "dshm" "emptyDir" (dict "medium" "Memory")) }}
{{- end }}
{{- with $volumes }}
volumes:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container fields shared by head and workers: image, env, mounts, security context:
     (dict "root" $ "shm" <devShm>). */}}
{{- define "radixserve.containerCommon" -}}
{{- $v := .root.Values }}
image: {{ include "radixserve.image" .root }}
imagePullPolicy: {{ $v.image.pullPolicy }}
{{- with (include "radixserve.env" .root | trim) }}
env:
  {{- . | nindent 2 }}
{{- end }}
{{- $mounts := default list $v.extraVolumeMounts }}
{{- if .shm }}
{{- $mounts = append $mounts (dict "name" "dshm" "mountPath" "/dev/shm") }}
{{- end }}
{{- with $mounts }}
volumeMounts:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.containerSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod annotations: the pool's own, plus a checksum of the keys so that changing them rolls the
     cluster (RayService brings up a new RayCluster, then switches traffic). */}}
{{- define "radixserve.podAnnotations" -}}
{{- $ann := deepCopy (default dict .spec.podAnnotations) }}
{{- if not .root.Values.auth.existingSecret }}
{{- $_ := set $ann "checksum/keys" (printf "%s/%s" .root.Values.auth.apiKey .root.Values.auth.adminKey | sha256sum) }}
{{- end }}
{{- toYaml $ann }}
{{- end }}

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

{{/* Pod spec fields besides containers: (dict "root" $ "spec" <head or pool values>). */}}
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
{{- with $v.extraVolumes }}
volumes:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Container fields shared by head and workers: image, env, mounts, security context. */}}
{{- define "radixserve.containerCommon" -}}
image: {{ include "radixserve.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- with (include "radixserve.env" . | trim) }}
env:
  {{- . | nindent 2 }}
{{- end }}
{{- with .Values.extraVolumeMounts }}
volumeMounts:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.containerSecurityContext }}
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

{{/* Names and labels. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The model: the volume every pod mounts at /models, the path inside it, the name clients send. */}}
{{- define "tandem.modelPath" -}}
{{- if .Values.model.path -}}{{ printf "/models/%s" (trimPrefix "/" .Values.model.path) }}{{- else -}}/models{{- end -}}
{{- end -}}

{{- define "tandem.servedModelName" -}}
{{- if .Values.model.servedModelName -}}{{ .Values.model.servedModelName }}
{{- else if .Values.model.path -}}{{ base .Values.model.path | trimSuffix ".gguf" }}
{{- else -}}model{{- end -}}
{{- end -}}

{{- define "tandem.modelClaimName" -}}
{{- if eq .Values.model.source "pvc" -}}{{ .Values.model.pvc.claimName }}
{{- else -}}{{ include "tandem.fullname" . }}-model{{- end -}}
{{- end -}}

{{- define "tandem.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "image" }}
  image:
    reference: {{ .Values.model.image.reference | quote }}
    pullPolicy: {{ .Values.model.image.pullPolicy }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ include "tandem.modelClaimName" . }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* The registry: Redis's address, and the password's Secret. */}}
{{- define "tandem.redisAddress" -}}
{{- if .Values.redis.embedded.enabled -}}{{ include "tandem.fullname" . }}-redis:6379
{{- else -}}{{ .Values.redis.external.address }}{{- end -}}
{{- end -}}

{{- define "tandem.redisDatabase" -}}
{{- if .Values.redis.embedded.enabled -}}0{{- else -}}{{ .Values.redis.external.database }}{{- end -}}
{{- end -}}

{{- define "tandem.redisSecretName" -}}
{{- default (printf "%s-redis" (include "tandem.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* The registry URL, with the password from REDIS_PASSWORD (Kubernetes expands $(VAR) in args). */}}
{{- define "tandem.registryURL" -}}
redis://:$(REDIS_PASSWORD)@{{ include "tandem.redisAddress" . }}/{{ include "tandem.redisDatabase" . }}
{{- end -}}

{{- define "tandem.redisPasswordEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.redisSecretName" . }}
      key: {{ .Values.redis.auth.secretKey }}
{{- end -}}

{{/* The cluster KV store's URL for the nodes' --kv-store: the chart's mooncake_master, an external one, or "". */}}
{{- define "tandem.kvStoreURL" -}}
{{- $store := .Values.kvTiers.store -}}
{{- if $store.embedded.enabled -}}mooncake://{{ include "tandem.fullname" . }}-kv-store:{{ $store.embedded.port }}
{{- else if $store.external.address -}}mooncake://{{ $store.external.address }}{{- end -}}
{{- end -}}

{{/* Container security: what every Tandem container gets. */}}
{{- define "tandem.restrictedContainerSecurity" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
Names, labels and small computed values shared by the templates. Every resource is named
<fullname>-<component> and labelled with app.kubernetes.io/component, so selectors never overlap between the
router, the replicas, the autoscaler and Redis.
*/}}

{{- define "shoal.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "shoal.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of one component's resources: (dict "root" $ "component" "router"). */}}
{{- define "shoal.componentName" -}}
{{- printf "%s-%s" (include "shoal.fullname" .root | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{- define "shoal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shoal.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "shoal.labels" -}}
{{ include "shoal.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: shoal
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* An image reference from {repository, tag, digest}: the digest pins it when set; the tag defaults to appVersion. */}}
{{- define "shoal.image" -}}
{{- $tag := default .root.Chart.AppVersion .image.tag }}
{{- if .image.digest }}
{{- printf "%s:%s@%s" .image.repository $tag .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{/* The autoscaler runs from the router image unless its own repository is set. */}}
{{- define "shoal.autoscalerImage" -}}
{{- $image := .Values.autoscaling.shoal.image }}
{{- if $image.repository }}
{{- include "shoal.image" (dict "root" . "image" $image) }}
{{- else }}
{{- include "shoal.image" (dict "root" . "image" .Values.router.image) }}
{{- end }}
{{- end }}

{{- define "shoal.adminSecretName" -}}
{{- default (include "shoal.componentName" (dict "root" . "component" "admin")) .Values.adminToken.existingSecret }}
{{- end }}

{{/* PromQL label matchers selecting this release's routers: (dict "root" $ "selector" <override>); the default
is the namespace and service labels a ServiceMonitor gives their series. */}}
{{- define "shoal.routerMetricSelector" -}}
{{- default (printf "namespace=%q,service=%q" .root.Release.Namespace (include "shoal.componentName" (dict "root" .root "component" "router"))) .selector }}
{{- end }}

{{- define "shoal.leaseName" -}}
{{- default (include "shoal.componentName" (dict "root" . "component" "autoscaler")) .Values.autoscaling.shoal.leaseName }}
{{- end }}

{{/* The model argument of the engine: a folder on the model volume, or a name (`demo`, a Hugging Face repo id). */}}
{{- define "shoal.modelRef" -}}
{{- if .Values.model.path }}
{{- printf "%s/%s" (.Values.model.storage.mountPath | trimSuffix "/") (.Values.model.path | trimPrefix "/") }}
{{- else }}
{{- .Values.model.name }}
{{- end }}
{{- end }}

{{/* The claim of the model volume (model.storage.kind pvc): an existing one, or the one the chart creates. */}}
{{- define "shoal.modelClaimName" -}}
{{- default (include "shoal.componentName" (dict "root" . "component" "replica")) .Values.model.storage.pvc.existingClaim }}
{{- end }}

{{/* The model name clients send: model.servedName, else the model's name (Shoal's demo model serves as
shoal-demo, its own default). */}}
{{- define "shoal.servedModelName" -}}
{{- if .Values.model.servedName }}
{{- .Values.model.servedName }}
{{- else if and (eq .Values.replicas.engine "shoal") (eq .Values.model.name "demo") }}
{{- "shoal-demo" }}
{{- else }}
{{- .Values.model.name }}
{{- end }}
{{- end }}

{{/* The Redis mode in effect: `auto` is `bundled` when more than one router pod can run (they share one view of
the fleet through it) and `none` otherwise. */}}
{{- define "shoal.redisMode" -}}
{{- $mode := .Values.redis.mode }}
{{- if eq $mode "auto" }}
{{- $mode = ternary "bundled" "none" (or .Values.router.autoscaling.enabled (gt (int .Values.router.replicas) 1)) }}
{{- end }}
{{- $mode }}
{{- end }}

{{/* Whether this release runs Redis itself or points at one (`mode`, for the pods at hand): the URL's source. */}}
{{- define "shoal.redisUrlEnv" -}}
{{- if eq .mode "bundled" }}
- name: {{ .name }}
  value: {{ printf "redis://%s:6379/0" (include "shoal.componentName" (dict "root" .root "component" "redis")) | quote }}
{{- else if eq .mode "external" }}
{{- if .root.Values.redis.external.existingSecret }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .root.Values.redis.external.existingSecret }}
      key: {{ .root.Values.redis.external.existingSecretKey }}
{{- else }}
- name: {{ .name }}
  value: {{ required "redis.external.url or redis.external.existingSecret is required when redis.mode is external" .root.Values.redis.external.url | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* Seconds a replica's preStop may wait for its in-flight requests: the router's limit on a whole request. */}}
{{- define "shoal.replicaDrainSeconds" -}}
{{- .Values.router.config.limits.request_timeout_s | ceil | int }}
{{- end }}

{{/* Checks the values schema cannot express (it cannot compare two values), and checks across sections whose
schema error would not name the value that asks for them. */}}
{{- define "shoal.validate" -}}
{{- if lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas) }}
{{- fail "autoscaling.maxReplicas must be at least autoscaling.minReplicas" }}
{{- end }}
{{- if and .Values.router.autoscaling.enabled (lt (int .Values.router.autoscaling.maxReplicas) (int .Values.router.autoscaling.minReplicas)) }}
{{- fail "router.autoscaling.maxReplicas must be at least router.autoscaling.minReplicas" }}
{{- end }}
{{- $limit := int (.Values.router.config.hold.max_in_flight_per_replica | default 0) }}
{{- $routers := ternary .Values.router.autoscaling.minReplicas .Values.router.replicas .Values.router.autoscaling.enabled | int }}
{{- if and (eq .Values.autoscaling.mode "hpa") (gt $limit 0) (ge (float64 .Values.autoscaling.targetRequestsPerReplica) (float64 (mul $limit $routers))) }}
{{- fail (printf "autoscaling.targetRequestsPerReplica (%v) must be below router.config.hold.max_in_flight_per_replica x routers (%d) in hpa mode: the HPA's metric, requests in flight per replica, cannot pass that, and requests held at the routers are not in it, so the HPA would never scale up" .Values.autoscaling.targetRequestsPerReplica (mul $limit $routers)) }}
{{- end }}
{{- if .Values.router.mountModelVolume }}
{{- if ne .Values.model.storage.kind "pvc" }}
{{- fail (printf "router.mountModelVolume needs model.storage.kind pvc, not %s (name other volumes in router.extraVolumes)" .Values.model.storage.kind) }}
{{- end }}
{{- if and (not .Values.model.storage.pvc.existingClaim) (not (has .Values.model.storage.pvc.accessMode (list "ReadOnlyMany" "ReadWriteMany"))) }}
{{- fail (printf "router.mountModelVolume: routers and replicas may run on different nodes, so the claim the chart creates needs model.storage.pvc.accessMode ReadOnlyMany or ReadWriteMany, not %s" .Values.model.storage.pvc.accessMode) }}
{{- end }}
{{- end }}
{{- if and (eq .Values.model.storage.kind "hostPath") .Values.model.storage.readOnly (not .Values.model.path) (ne .Values.replicas.engine "shoal") }}
{{- fail "model.storage.kind hostPath with a read-only mount needs model.path (the folder of the weights)" }}
{{- end }}
{{- end }}

{{/* Release-scoped name, at most 40 characters so that "<name>-shard-node-N" fits DNS. */}}
{{- define "ragcluster.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ragcluster.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "shard-node"). */}}
{{- define "ragcluster.selector" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ragcluster.image" -}}
{{ printf "%s/%s:%s" .ctx.Values.image.repository .component (default .ctx.Chart.AppVersion .ctx.Values.image.tag) }}
{{- end -}}

{{/* Stable DNS name of pod i of a StatefulSet behind its headless Service. */}}
{{- define "ragcluster.podHost" -}}
{{- $f := include "ragcluster.fullname" .ctx -}}
{{- printf "%s-%s-%d.%s-%s-headless.%s.svc" $f .component .i $f .component .ctx.Release.Namespace -}}
{{- end -}}

{{/* Pod anti-affinity by mode ("hard", "soft", "none"). */}}
{{- define "ragcluster.antiAffinity" -}}
{{- if eq .mode "hard" }}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "ragcluster.selector" . | nindent 10 }}
{{- else if eq .mode "soft" }}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "ragcluster.selector" . | nindent 12 }}
{{- end }}
{{- end -}}

{{- define "ragcluster.metricsAnnotations" -}}
{{- if .ctx.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* The models volume (a claim or a host directory). */}}
{{- define "ragcluster.modelsVolume" -}}
- name: models
{{- if .Values.models.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ .Values.models.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{/* Security settings shared by every pod: the images run as user 10001. */}}
{{- define "ragcluster.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "ragcluster.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: [ALL]
{{- end -}}

{{/* gRPC health probes (grpc.health.v1, native Kubernetes gRPC probes). */}}
{{- define "ragcluster.probes" -}}
startupProbe:
  grpc: { port: {{ .port }} }
  periodSeconds: 5
  failureThreshold: 60
readinessProbe:
  grpc: { port: {{ .port }} }
  periodSeconds: 5
livenessProbe:
  grpc: { port: {{ .port }} }
  periodSeconds: 10
  failureThreshold: 6
{{- end -}}

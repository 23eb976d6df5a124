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

{{/* gRPC health probes (grpc.health.v1): native Kubernetes gRPC probes, or `ragctl health`
over mutual TLS (native probes cannot do TLS). Call with (dict "ctx" $ "port" 7100). */}}
{{- define "ragcluster.probeAction" -}}
{{- if .ctx.Values.tls.enabled }}
exec:
  command: ["/usr/local/bin/ragctl", "health", "https://127.0.0.1:{{ .port }}", "--tls-ca", "/etc/ragcluster-tls/ca.crt", "--tls-cert", "/etc/ragcluster-tls/tls.crt", "--tls-key", "/etc/ragcluster-tls/tls.key"]
{{- else }}
grpc: { port: {{ .port }} }
{{- end }}
{{- end -}}

{{- define "ragcluster.probes" -}}
startupProbe:
  {{- include "ragcluster.probeAction" . | nindent 2 }}
  periodSeconds: 5
  failureThreshold: 60
readinessProbe:
  {{- include "ragcluster.probeAction" . | nindent 2 }}
  periodSeconds: 5
livenessProbe:
  {{- include "ragcluster.probeAction" . | nindent 2 }}
  periodSeconds: 10
  failureThreshold: 6
{{- end -}}

{{/* TLS (and, for coordinators, bootstrap key) Secret mounts and volumes. */}}
{{- define "ragcluster.secretMounts" -}}
{{- if .ctx.Values.tls.enabled }}
- { name: tls, mountPath: /etc/ragcluster-tls, readOnly: true }
{{- end }}
{{- if and .auth .ctx.Values.auth.enabled }}
- { name: auth, mountPath: /etc/ragcluster-auth, readOnly: true }
{{- end }}
{{- end -}}

{{- define "ragcluster.secretVolumes" -}}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .ctx.Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if and .auth .ctx.Values.auth.enabled }}
- name: auth
  secret:
    secretName: {{ .ctx.Values.auth.adminKeySecret }}
    defaultMode: 0440
    items:
      - { key: admin-key, path: admin-key }
{{- end }}
{{- end -}}

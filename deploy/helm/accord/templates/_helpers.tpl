{{/* Names. */}}
{{- define "accord.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "accord.coordinatorName" -}}
{{- printf "%s-coordinator" (include "accord.fullname" .) -}}
{{- end -}}

{{- define "accord.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "accord.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The coordinator address the sidecars dial (matches the TLS SAN). */}}
{{- define "accord.coordinatorAddress" -}}
{{- printf "%s.%s.svc:%d" (include "accord.coordinatorName" .) .Release.Namespace (int .Values.coordinator.ports.grpc) -}}
{{- end -}}

{{/* Relays (values: relay): the StatefulSet and its headless Service share a name. */}}
{{- define "accord.relayName" -}}
{{- printf "%s-relay" (include "accord.fullname" .) -}}
{{- end -}}

{{/* The relay a trainer pod's sidecar dials; JOB_COMPLETION_INDEX is expanded by its shell. */}}
{{- define "accord.relayAddressForPod" -}}
{{- printf "%s-$((JOB_COMPLETION_INDEX / %d)).%s.%s.svc:%d" (include "accord.relayName" .) (int .Values.relay.nodesPerRelay) (include "accord.relayName" .) .Release.Namespace (int .Values.relay.port) -}}
{{- end -}}

{{- define "accord.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag -}}
{{- end -}}

{{/* Labels. */}}
{{- define "accord.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: accord
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "accord.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
Flags shared by both daemons. Each flag also has an environment variable
ACCORD_<FLAG NAME IN UPPER CASE>; the chart passes flags so that `kubectl
describe` shows the effective configuration.
*/}}
{{- define "accord.commonArgs" -}}
- --log_level={{ .Values.logLevel }}
- --deadline={{ .Values.deadline }}
- --max_message_bytes={{ int64 .Values.limits.maxMessageBytes }}
{{- if .Values.tls.enabled }}
- --tls_cert=/etc/accord/tls/tls.crt
- --tls_key=/etc/accord/tls/tls.key
- --tls_ca=/etc/accord/tls/ca.crt
{{- else }}
- --plaintext
{{- end }}
{{- end -}}

{{/* The restricted pod security profile for accord's own containers. */}}
{{- define "accord.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

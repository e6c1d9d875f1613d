{{/* Names, labels and shared fragments. */}}

{{- define "tierckpt.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tierckpt.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "tierckpt.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "tierckpt.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* A component's resource name: <fullname>-<component>, at most 63 characters. */}}
{{- define "tierckpt.component" -}}
{{- printf "%s-%s" (include "tierckpt.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tierckpt.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tierckpt.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tierckpt.labels" -}}
{{ include "tierckpt.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: tierckpt
{{- end -}}

{{- define "tierckpt.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "tierckpt.operatorServiceAccount" -}}
{{- default (include "tierckpt.component" (dict "root" . "component" "operator")) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{- define "tierckpt.replicatorServiceAccount" -}}
{{- default (include "tierckpt.component" (dict "root" . "component" "replicator")) .Values.replicator.serviceAccount.name -}}
{{- end -}}

{{/* The Secret holding the replicators' bearer token (key "token"). */}}
{{- define "tierckpt.tokenSecret" -}}
{{- default (include "tierckpt.component" (dict "root" . "component" "token")) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The tierckpt CA: its Secret (certificate and key, read by the operator only) and its ConfigMap
(the certificate alone, read by every replicator). */}}
{{- define "tierckpt.ca" -}}
{{- include "tierckpt.component" (dict "root" . "component" "ca") -}}
{{- end -}}

{{/* The operator's node certificate signing endpoint (a Service in front of every operator replica). */}}
{{- define "tierckpt.issuerService" -}}
{{- include "tierckpt.component" (dict "root" . "component" "issuer") -}}
{{- end -}}

{{/* Legacy shared-token mode, only when asked for by name; its options without it are an error. */}}
{{- define "tierckpt.tokenMode" -}}
{{- if eq .Values.auth.mode "token" -}}
true
{{- else if or .Values.auth.token .Values.auth.existingSecret -}}
{{- fail "auth.token and auth.existingSecret belong to the legacy auth.mode: token (one shared token, one trust domain for the whole cluster): set auth.mode: token explicitly to use it, or leave them empty for mutual TLS" -}}
{{- end -}}
{{- end -}}

{{- define "tierckpt.webhookService" -}}
{{- include "tierckpt.component" (dict "root" . "component" "webhook") -}}
{{- end -}}

{{- define "tierckpt.webhookCertSecret" -}}
{{- include "tierckpt.component" (dict "root" . "component" "webhook-tls") -}}
{{- end -}}

{{/* The host directory that holds the ramdisk mount point (mounted into the DaemonSet). */}}
{{- define "tierckpt.ramdiskParent" -}}
{{- dir (clean .Values.ramdisk.hostPath) -}}
{{- end -}}

{{/* Container securityContext for everything that runs unprivileged and without root. */}}
{{- define "tierckpt.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

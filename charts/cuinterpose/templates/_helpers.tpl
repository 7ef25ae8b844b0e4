{{/* Chart name, fullname (release-chart, 63 chars), labels and the image reference. */}}
{{- define "cuinterpose.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "cuinterpose.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "cuinterpose.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "cuinterpose.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cuinterpose.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cuinterpose.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "cuinterpose.labels" -}}
{{ include "cuinterpose.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "cuinterpose.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "cuinterpose.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "cuinterpose.image" -}}
{{- printf "%s@%s" .Values.image.repository (required "image.digest is required" .Values.image.digest) -}}
{{- end -}}

{{- /* The probes' command: `cuinterpose-agent health` against config.listenAddress (a wildcard
TCP host becomes localhost; TCP presents the TLS Secret's certificate), as a flow list. */ -}}
{{- define "cuinterpose.healthCommand" -}}
{{- $addr := .Values.config.listenAddress | replace "0.0.0.0:" "localhost:" | replace "[::]:" "localhost:" -}}
{{- if hasPrefix "unix:" .Values.config.listenAddress -}}
["cuinterpose-agent", "health", "--agent", {{ $addr | quote }}]
{{- else -}}
["cuinterpose-agent", "health", "--agent", {{ $addr | quote }}, "--tls-ca", "/etc/cuinterpose/tls/ca.crt", "--tls-cert", "/etc/cuinterpose/tls/tls.crt", "--tls-key", "/etc/cuinterpose/tls/tls.key"]
{{- end -}}
{{- end -}}

{{- /* The agent's snapshotDir in an object store: s3://BUCKET or s3://BUCKET/PREFIX. */ -}}
{{- define "cuinterpose.objectStoreRoot" -}}
{{- $o := .Values.objectStore -}}
{{- if $o.prefix -}}
{{- printf "s3://%s/%s" $o.bucket $o.prefix -}}
{{- else -}}
{{- printf "s3://%s" $o.bucket -}}
{{- end -}}
{{- end -}}

{{- define "rankscope.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The objects' name prefix: the release name, or release-chart when the release's name lacks the chart's. */}}
{{- define "rankscope.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Selector labels of one component; called with (dict "ctx" $ "component" "agent"). */}}
{{- define "rankscope.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rankscope.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "rankscope.labels" -}}
{{ include "rankscope.selectorLabels" . }}
app.kubernetes.io/part-of: rankscope
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version }}
{{- end }}

{{- define "rankscope.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "rankscope.tokenSecret" -}}
{{- .Values.token.existingSecret | default (printf "%s-token" (include "rankscope.fullname" .)) }}
{{- end }}

{{/* The agents' headless Service, as the analyzer resolves it each window. */}}
{{- define "rankscope.agentsUrl" -}}
dns+http://{{ include "rankscope.fullname" . }}-agent.{{ .Release.Namespace }}.svc:{{ .Values.agent.port }}
{{- end }}

{{/*
Names and labels shared by every template.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, else the release name (plus the chart
name unless the release name contains it). Truncated so that "<fullname>-operator-metrics"
still fits a DNS label.
*/}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* helm.sh/chart label value. */}}
{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" . }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- end }}

{{/* Labels that select the release's objects. */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of the operator's objects, and those selecting its pods. */}}
{{- define "kvroute.operator.labels" -}}
{{ include "kvroute.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvroute.operator.selectorLabels" -}}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Name of the operator's objects. */}}
{{- define "kvroute.operator.fullname" -}}
{{- printf "%s-operator" (include "kvroute.fullname" .) }}
{{- end }}

{{/* The operator's ServiceAccount (with serviceAccount.create=false it must exist). */}}
{{- define "kvroute.serviceAccountName" -}}
{{- default (include "kvroute.operator.fullname" .) .Values.serviceAccount.name }}
{{- end }}

{{/* The image of the operator (and, by default, of the pickers it runs). */}}
{{- define "kvroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "kvroute.pickerImage" -}}
{{- .Values.operator.pickerImage | default (include "kvroute.image" .) }}
{{- end }}

{{/* Checks the schema cannot express (relations between values). */}}
{{- define "kvroute.validate" -}}
{{- $le := .Values.operator.leaderElection }}
{{- if and (gt (int .Values.operator.replicas) 1) (not $le.enabled) }}
{{- fail "operator.replicas > 1 needs operator.leaderElection.enabled: without it every replica reconciles" }}
{{- end }}
{{- if ge (int $le.leaseGrace) (int $le.leaseDuration) }}
{{- fail "operator.leaderElection.leaseGrace must be less than leaseDuration" }}
{{- end }}
{{- end }}

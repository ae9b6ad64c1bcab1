{{/* The chart name, or nameOverride. */}}
{{- define "tuc.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The base name of every object: fullnameOverride, else the release name when it already contains the
chart name (`helm install talos-upgrade-controller` gives the kustomize base's names), else
<release>-<chart>.
*/}}
{{- define "tuc.fullname" -}}
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

{{/* Labels of every object. */}}
{{- define "tuc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tuc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ include "tuc.tag" . | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: talos-upgrade-controller
{{- end }}

{{/* What the Service, the ServiceMonitor and the PodDisruptionBudgets select: the pods of every shard. */}}
{{- define "tuc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tuc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: controller
{{- end }}

{{/* The image tag: image.tag, else the chart's appVersion. */}}
{{- define "tuc.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "tuc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tuc.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Where the release catalog ConfigMap is mounted, and the file in it. */}}
{{- define "tuc.releaseCatalogDir" -}}
/etc/talos-upgrade-controller
{{- end }}

{{/* The release catalog file's text, from the object or the text in releaseCatalog ("" when unset). */}}
{{- define "tuc.releaseCatalog" -}}
{{- if kindIs "string" .Values.releaseCatalog }}
{{- .Values.releaseCatalog }}
{{- else if .Values.releaseCatalog }}
{{- toYaml .Values.releaseCatalog }}
{{- end }}
{{- end }}

{{/*
The Deployments to render: one per shard, or one (no shard) watching every cluster. Each is a dict of
name (the Deployment's and its Lease's), shard ("" for none) and labelSelector, as JSON (include returns
text).
*/}}
{{- define "tuc.deployments" -}}
{{- $fullname := include "tuc.fullname" . }}
{{- $deployments := list }}
{{- $seen := dict }}
{{- range .Values.shards }}
{{- if hasKey $seen .name }}
{{- fail (printf "shards: the name %q is used twice; each shard needs a name of its own (its Deployment and Lease are named after it)" .name) }}
{{- end }}
{{- $_ := set $seen .name true }}
{{- $deployments = append $deployments (dict "name" (printf "%s-%s" $fullname .name) "shard" .name "labelSelector" .labelSelector) }}
{{- else }}
{{- $deployments = append $deployments (dict "name" $fullname "shard" "" "labelSelector" "") }}
{{- end }}
{{- toJson $deployments }}
{{- end }}

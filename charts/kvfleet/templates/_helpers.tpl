{{/* The labels every object of the install carries (the same as manifests/). */}}
{{- define "kvfleet.labels" -}}
app.kubernetes.io/name: kvfleet-operator
app.kubernetes.io/part-of: kvfleet
{{- end }}

{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: kvfleet-operator
{{- end }}

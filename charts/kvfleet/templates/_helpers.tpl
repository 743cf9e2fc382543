{{/* The labels every object of the install carries (the same as manifests/); the instance
     label tells two installs apart (values.name). */}}
{{- define "kvfleet.labels" -}}
app.kubernetes.io/name: kvfleet-operator
app.kubernetes.io/instance: {{ .Values.name }}
app.kubernetes.io/part-of: kvfleet
{{- end }}

{{/* What the metrics Service and the ServiceMonitor select: this install's objects only. */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: kvfleet-operator
app.kubernetes.io/instance: {{ .Values.name }}
{{- end }}

{{/* The Deployment's selector, which Kubernetes never lets change: the default install keeps
     the one installs had before the instance label; another install adds its instance. */}}
{{- define "kvfleet.deploymentSelector" -}}
app.kubernetes.io/name: kvfleet-operator
{{- if ne .Values.name "kvfleet-operator" }}
app.kubernetes.io/instance: {{ .Values.name }}
{{- end }}
{{- end }}

{{- define "kvmesh.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvmesh
{{- end -}}

{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kvmesh.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvmesh.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs on the namespaces it watches; nothing more. */}}
{{- define "kvmesh.operatorRules" -}}
- apiGroups: [serving.kvmesh.io]
  resources: [inferencedeployments]
  verbs: [get, list, watch]
- apiGroups: [serving.kvmesh.io]
  resources: [inferencedeployments/status]
  verbs: [patch]
# Children carry ownerReferences with blockOwnerDeletion, which clusters with
# the OwnerReferencesPermissionEnforcement admission plugin only allow to
# principals that may update the owner's finalizers.
- apiGroups: [serving.kvmesh.io]
  resources: [inferencedeployments/finalizers]
  verbs: [update]
# Server-side apply: patch, and create for a child that does not exist yet.
# No update or delete of the fixed children: removal is the garbage collector's job.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch]
{{- if .Values.rbac.gatewayObjects }}
# spec.router.mode gateway: the InferencePool and HTTPRoute, deleted by the operator when the spec
# stops asking for them (they are not always rendered).
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, create, patch, delete]
{{- end }}
# Each deployment's internal token: created once (never patched), read to authenticate drains.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
# kopf reports handler failures, and the autoscaler its scaling, as Events on the object.
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# The autoscaler lists a pool's pods (to scrape and drain them) and marks the
# drained victim with controller.kubernetes.io/pod-deletion-cost. No create, no delete.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, patch]
{{- end -}}

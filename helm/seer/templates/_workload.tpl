{{/*
One Seer component: a Deployment (stateless) or a StatefulSet with a volume claim per pod (buffer,
kvstore: RocksDB), plus its headless Service (clients balance over the pod addresses themselves;
gRPC keeps long-lived connections, so kube-proxy balancing per connection would pin them).
Called with (dict "root" $ "component" "<name>" "stateful" <bool>).
*/}}
{{- define "seer.workload" -}}
{{- $root := .root -}}
{{- $c := .component -}}
{{- $svc := index $root.Values $c -}}
{{- $name := include "seer.name" . -}}
{{- $isWorker := eq $c "worker" -}}
{{- /* The model volume: workers load it, the buffer reads its tokenizer and config. */ -}}
{{- $modelVolume := and (or $isWorker (eq $c "buffer")) $root.Values.worker.modelVolume -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "seer.labels" . | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "seer.selectorLabels" . | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $svc.port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    - name: metrics
      port: {{ $svc.metricsPort }}
      targetPort: metrics
      protocol: TCP
---
apiVersion: apps/v1
kind: {{ if .stateful }}StatefulSet{{ else }}Deployment{{ end }}
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "seer.labels" . | nindent 4 }}
spec:
  replicas: {{ $svc.replicas }}
  {{- if .stateful }}
  serviceName: {{ $name }}
  podManagementPolicy: Parallel
  {{- else if has $c (list "buffer" "scheduler" "draft") }}
  strategy:
    # One active replica: the old pod must be gone before the new one opens the same state (buffer,
    # scheduler), or serves the same groups (draft: a surge pod would take the new connections, so
    # a group's siblings would be indexed on two pods and draft from half of each other).
    type: Recreate
  {{- end }}
  selector:
    matchLabels:
      {{- include "seer.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "seer.labels" . | nindent 8 }}
        {{- with $root.Values.global.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        {{- with $root.Values.global.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        seer.dev/config-hash: {{ toJson $svc.config | sha256sum | trunc 16 | quote }}
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      {{- /* hasKey, not `default`: 0 (kill at once) is a value the schema allows, and `default`
      took it for unset and wrote 30. */}}
      terminationGracePeriodSeconds: {{ hasKey $svc "terminationGracePeriodSeconds" | ternary $svc.terminationGracePeriodSeconds 30 }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $root.Values.global.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $svc.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $svc.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $tolerations := $svc.tolerations | default list -}}
      {{- if and $isWorker $svc.gpu.enabled }}
      {{- $tolerations = append $tolerations (dict "key" $svc.gpu.resourceName "operator" "Exists" "effect" "NoSchedule") }}
      {{- end }}
      {{- with $tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $c }}
          image: {{ include "seer.image" (dict "root" $root "svc" $svc "component" $c) | quote }}
          imagePullPolicy: {{ $svc.image.pullPolicy | default $root.Values.global.imagePullPolicy }}
          ports:
            - name: grpc
              containerPort: {{ $svc.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $svc.metricsPort }}
              protocol: TCP
          env:
            {{- include "seer.env" . | nindent 12 }}
          {{- include "seer.probes" . | nindent 10 }}
          resources:
            {{- $res := deepCopy ($svc.resources | default dict) -}}
            {{- if and $isWorker $svc.gpu.enabled -}}
            {{- $limits := $res.limits | default dict -}}
            {{- $_ := set $limits $svc.gpu.resourceName (int $svc.gpu.count) -}}
            {{- $_ := set $res "limits" $limits -}}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            {{- if $isWorker }}
            {{- /* The root filesystem is read-only: JIT caches under $HOME (Triton's ~/.triton,
            torch inductor, FlashInfer; SGLang compiles kernels at start) need a writable home.
            The images keep nothing there (models are under /opt/seer). */}}
            - name: home
              mountPath: /home/seer
            {{- end }}
            {{- if .stateful }}
            - name: data
              mountPath: /var/lib/seer/{{ $c }}
            {{- else if eq $c "scheduler" }}
            - name: state
              mountPath: /var/lib/seer/scheduler
            {{- end }}
            {{- if and $isWorker $svc.shm.enabled }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            {{- if $modelVolume }}
            - name: model
              mountPath: {{ $root.Values.worker.modelMountPath }}
              readOnly: true
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        {{- if eq $c "scheduler" }}
        - name: state
          emptyDir: {}
        {{- end }}
        {{- if $isWorker }}
        - name: home
          emptyDir: {}
        {{- end }}
        {{- if and $isWorker $svc.shm.enabled }}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $svc.shm.sizeLimit }}
        {{- end }}
        {{- if $modelVolume }}
        - name: model
          {{- toYaml $root.Values.worker.modelVolume | nindent 10 }}
        {{- end }}
  {{- if .stateful }}
  volumeClaimTemplates:
    - metadata:
        name: data
        labels:
          {{- include "seer.selectorLabels" . | nindent 10 }}
      spec:
        accessModes:
          {{- toYaml $svc.persistence.accessModes | nindent 10 }}
        {{- /* Quoted: a bare `-` is invalid YAML and on/yes/no would be booleans. "" (the default)
        leaves the key out, so the cluster's default StorageClass provisions the volume; "-" is the
        Helm convention for storageClassName: "" (no dynamic provisioning: bind a pre-made PV). */}}
        {{- with $svc.persistence.storageClassName }}
        storageClassName: {{ eq . "-" | ternary "" . | quote }}
        {{- end }}
        resources:
          requests:
            storage: {{ $svc.persistence.size }}
  {{- end }}
{{- if $svc.pdb.enabled }}
{{- /* One of the two: values.yaml sets one per component and Helm merges the user's on top, so
`--set buffer.pdb.maxUnavailable=1` kept the default minAvailable: 1, which took precedence and
blocked every eviction of the single buffer pod (node drains hang). Unset one with null. */}}
{{- if and (hasKey $svc.pdb "minAvailable") (hasKey $svc.pdb "maxUnavailable") }}
{{- fail (printf "%s.pdb: minAvailable and maxUnavailable are both set; a PodDisruptionBudget takes one (set the other to null)" $c) }}
{{- end }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "seer.labels" . | nindent 4 }}
spec:
  {{- if hasKey $svc.pdb "minAvailable" }}
  minAvailable: {{ $svc.pdb.minAvailable }}
  {{- else }}
  {{- /* hasKey, not `default`: maxUnavailable 0 (no voluntary eviction) is a valid choice. */}}
  maxUnavailable: {{ hasKey $svc.pdb "maxUnavailable" | ternary $svc.pdb.maxUnavailable 1 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "seer.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

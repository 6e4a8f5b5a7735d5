{{/*
The one pod template both node roles use. Called with (dict "root" $ "role" "prefill"|"decode"); the role's values
block is .root.Values.<role> (the two blocks have one schema).
*/}}
{{- define "tandem.nodeDeployment" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $v := index $root.Values $role -}}
{{- $kv := $root.Values.kvTransfer -}}
{{- $rdma := $kv.rdma.enabled -}}
{{- $name := printf "%s-%s" (include "tandem.fullname" $root) $role -}}
{{- $ctx := dict "root" $root "component" $role -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" $ctx | nindent 4 }}
  {{- if $v.autoscaling.enabled }}
  annotations:
    # `tandem scale` reads it: with KEDA on, it sets the ScaledObject's paused-replicas instead of the scale
    tandem.dev/scaled-object: {{ $name }}
  {{- end }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 3
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" $ctx | nindent 6 }}
  strategy:
    # a new node joins before an old one drains: a rollout never lowers the pool's capacity
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  template:
    metadata:
      labels:
        {{- include "tandem.labels" $ctx | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ include "tandem.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- with $v.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- if $rdma }}
        runAsNonRoot: false
        {{- else }}
        runAsNonRoot: true
        runAsUser: 10001
        runAsGroup: 10001
        fsGroup: 10001
        {{- end }}
        seccompProfile:
          type: RuntimeDefault
      {{- if eq $root.Values.model.source "download" }}
      initContainers:
        # the download Job writes this marker last: a node never loads a half-copied model
        - name: wait-for-model
          image: {{ include "tandem.image" (dict "root" $root "image" $root.Values.image.engine) }}
          imagePullPolicy: {{ $root.Values.image.engine.pullPolicy }}
          command: ["/bin/sh", "-c", "until [ -f /models/.tandem-download-complete ]; do echo waiting for the model download Job; sleep 10; done"]
          securityContext:
            {{- include "tandem.restrictedContainerSecurity" $root | nindent 12 }}
          resources:
            requests: {cpu: 10m, memory: 16Mi}
            limits: {cpu: 100m, memory: 64Mi}
          volumeMounts:
            - {name: model, mountPath: /models, readOnly: true}
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "tandem.image" (dict "root" $root "image" $root.Values.image.engine) }}
          imagePullPolicy: {{ $root.Values.image.engine.pullPolicy }}
          {{- if $rdma }}
          # RDMA pins the KV pool: with too small a locked-memory limit registration fails later and obscurely,
          # so the node refuses to start with a message saying what to change
          command:
            - /bin/sh
            - -c
            - |
              limit="$(ulimit -l)"
              if [ "$limit" != unlimited ] && [ "$limit" -lt {{ $kv.rdma.minLockedMemoryKiB | int64 }} ]; then
                echo "tandem: RDMA needs at least {{ $kv.rdma.minLockedMemoryKiB | int64 }} KiB of locked memory (ulimit -l), this container has ${limit} KiB: raise the container runtime's memlock limit (e.g. containerd's LimitMEMLOCK=infinity) or lower kvTransfer.rdma.minLockedMemoryKiB" >&2
                exit 78
              fi
              exec python -m {{ $role }}_node "$@"
            - {{ $role }}_node
          {{- else }}
          command: ["python", "-m", "{{ $role }}_node"]
          {{- end }}
          args:
            - --model={{ include "tandem.modelPath" $root }}
            - --host=0.0.0.0
            - --port={{ $v.port }}
            - --advertise-address=$(POD_IP):{{ $v.port }}
            - --node-id=$(POD_NAME)
            - --registry={{ include "tandem.registryURL" $root }}
            - --drain-timeout={{ $v.drain.timeoutSeconds }}
            - --metrics-port={{ $v.metricsPort }}
            {{- if gt (int $v.parallelism.tensor) 1 }}
            - --tensor-parallel-size={{ $v.parallelism.tensor }}
            {{- end }}
            {{- /* flags, not the settings ConfigMap: they size the process's memory, so a change rolls the pods
            with the resources it needs */}}
            {{- if gt (float64 $root.Values.kvTiers.offloadingSizeGiB) 0.0 }}
            - --kv-offloading-size={{ $root.Values.kvTiers.offloadingSizeGiB }}
            {{- end }}
            {{- with include "tandem.kvStoreURL" $root }}
            - --kv-store={{ . }}
            - --kv-store-segment-size={{ $root.Values.kvTiers.store.segmentSizeGiB }}
            {{- end }}
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "tandem.fullname" $root }}-settings
          env:
            - name: POD_NAME
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
            - name: POD_IP
              valueFrom: {fieldRef: {fieldPath: status.podIP}}
            # the registry record's pod UID (settings/env.py)
            - name: TANDEM_POD_UID
              valueFrom: {fieldRef: {fieldPath: metadata.uid}}
            {{- include "tandem.redisPasswordEnv" $root | nindent 12 }}
            {{- if and (eq $kv.backend "nixl") $kv.nixl.ucxTls }}
            - name: UCX_TLS
              value: {{ $kv.nixl.ucxTls | quote }}
            {{- end }}
            {{- range $key, $value := $kv.extraEnv }}
            - name: {{ $key }}
              value: {{ $value | quote }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - {name: grpc, containerPort: {{ $v.port }}, protocol: TCP}
            - {name: metrics, containerPort: {{ $v.metricsPort }}, protocol: TCP}
          # the standard gRPC health service on the node's port (node_common/health.py)
          startupProbe:
            grpc: {port: {{ $v.port }}, service: tandem.liveness}
            {{- toYaml $v.probes.startup | nindent 12 }}
          readinessProbe:
            grpc: {port: {{ $v.port }}, service: ""}
            {{- toYaml $v.probes.readiness | nindent 12 }}
          livenessProbe:
            grpc: {port: {{ $v.port }}, service: tandem.liveness}
            {{- toYaml $v.probes.liveness | nindent 12 }}
          lifecycle:
            # the drain: SIGTERM makes the node leave the registry and finish its requests (node_common/server.py);
            # the hook waits for it, inside terminationGracePeriodSeconds (> drain.timeoutSeconds)
            preStop:
              exec:
                command: ["/bin/sh", "-c", "kill -TERM 1; while kill -0 1 2>/dev/null; do sleep 1; done"]
          securityContext:
            {{- if $rdma }}
            allowPrivilegeEscalation: false
            privileged: false
            readOnlyRootFilesystem: true
            runAsNonRoot: false
            runAsUser: 0
            capabilities:
              drop: [ALL]
              # pinning memory for RDMA registration
              add: [IPC_LOCK]
            seccompProfile:
              type: RuntimeDefault
            {{- else }}
            {{- include "tandem.restrictedContainerSecurity" $root | nindent 12 }}
            {{- end }}
          resources:
            {{- $limits := deepCopy (default dict $v.resources.limits) -}}
            {{- if gt (int $v.gpu.count) 0 }}
            {{- $_ := set $limits $v.gpu.resourceName (int $v.gpu.count) }}
            {{- end }}
            {{- if and $rdma $kv.rdma.resourceName }}
            {{- $_ := set $limits $kv.rdma.resourceName (int $kv.rdma.resourceCount) }}
            {{- end }}
            {{- with $v.resources.requests }}
            requests:
              {{- toYaml . | nindent 14 }}
            {{- end }}
            {{- with $limits }}
            limits:
              {{- toYaml . | nindent 14 }}
            {{- end }}
          volumeMounts:
            - {name: model, mountPath: /models, readOnly: true}
            - {name: shm, mountPath: /dev/shm}
            - {name: tmp, mountPath: /tmp}
      volumes:
        {{- include "tandem.modelVolume" $root | nindent 8 }}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSize }}
        # the root filesystem is read-only: caches (Triton kernels, torch) go here
        - name: tmp
          emptyDir: {}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* Names, labels, images and the SEER_* environment shared by every workload. */}}

{{- define "seer.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<component>": the workload and its headless Service (DNS names). */}}
{{- define "seer.name" -}}
{{- printf "%s-%s" (include "seer.fullname" .root) .component -}}
{{- end -}}

{{- define "seer.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "seer.labels" -}}
{{ include "seer.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: seer
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* "<registry>/<repository>:<tag>". Called with (dict "root" $ "svc" <values block> "component" <name>). */}}
{{- define "seer.image" -}}
{{- $g := .root.Values.global -}}
{{- $img := .svc.image -}}
{{- /* A tag written as a YAML number reaches the template as a float64 (or an int64 from --set):
20240101 printed as 2.0240101e+07 and 1.10 as 1.1, an image that does not exist (ErrImagePull).
The schema says string; this also covers a render with schema validation skipped. */ -}}
{{- range $key, $tag := dict (printf "%s.image.tag" .component) $img.tag "global.imageTag" $g.imageTag -}}
{{- if not (or (kindIs "invalid" $tag) (kindIs "string" $tag)) -}}
{{- fail (printf "%s: must be a string (got the %s %v); quote it in the values file (tag: \"1.10\") or use --set-string, since a number loses its form (1.10 becomes 1.1, 20240101 becomes 2.0240101e+07)" $key (kindOf $tag) $tag) -}}
{{- end -}}
{{- end -}}
{{- $repo := $img.repository -}}
{{- if $g.imageRegistry -}}{{- $repo = printf "%s/%s" (trimSuffix "/" $g.imageRegistry) $repo -}}{{- end -}}
{{- printf "%s:%s" $repo (toString ($img.tag | default $g.imageTag | default .root.Chart.AppVersion)) -}}
{{- end -}}

{{/* Where the images hold the embedded model: the worker image its weights, the buffer image its
tokenizer (docker/Dockerfile); values.yaml's model.dir default. */}}
{{- define "seer.imageModelDir" -}}
/opt/seer/models/SmolLM2-135M-Instruct
{{- end -}}

{{/* In-cluster address of a component's gRPC port through its headless Service. */}}
{{- define "seer.address" -}}
{{- $svc := index .root.Values .component -}}
{{- printf "%s.%s.svc:%v" (include "seer.name" .) .root.Release.Namespace $svc.port -}}
{{- end -}}

{{/* Bytes of a Kubernetes quantity ("50Gi", "1.5T", "500M"; the schema's pattern). */}}
{{- define "seer.quantityBytes" -}}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" . -}}
{{- $units := dict "" 1.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 -}}
{{- mulf (float64 $num) (index $units (trimPrefix $num .)) | int64 -}}
{{- end -}}

{{/* Every kvstore replica by its stable StatefulSet DNS name: pages shard by page-key hash. */}}
{{- define "seer.kvAddresses" -}}
{{- $name := include "seer.name" (dict "root" .root "component" "kvstore") -}}
{{- $kv := .root.Values.kvstore -}}
{{- $out := list -}}
{{- range $i := until (int $kv.replicas) -}}
{{- $out = append $out (printf "%s-%d.%s.%s.svc:%v" $name $i $name $.root.Release.Namespace $kv.port) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{- /* The kvstore's SSD budget (its ssd_bytes) in bytes, as a whole number: kvstore.config.ssd_bytes
when given, else 0.4 x kvstore.persistence.size (RocksDB's files reach ~2.4x ssd_bytes under churn,
services/kvstore/README.md). One definition for the env it is wired into (seer.env) and the checks
against the volume and the WAL reserve (seer.validate). The root context. A given value is taken as
it is: seer.validate refuses one that is not a whole number before using this. */ -}}
{{- define "seer.kvSsdBytes" -}}
{{- $kv := .Values.kvstore -}}
{{- if hasKey $kv.config "ssd_bytes" -}}
{{- /* Leading zeros dropped: sprig's int64 reads "034359738" as octal (0: 8 and 9 are no octal
digits), Python's int() as 34359738. */ -}}
{{- regexReplaceAll "^0+([0-9])" (toJson (index $kv.config "ssd_bytes") | trimAll "\"") "${1}" -}}
{{- else -}}
{{- int64 (mulf (float64 (include "seer.quantityBytes" $kv.persistence.size)) 0.4) -}}
{{- end -}}
{{- end -}}

{{- /* A whole number of bytes from a component's config map, as a decimal string the templates'
int64 reads as Python's int() does (leading zeros dropped: sprig reads "010" as octal 8); the
default (the service's own, services/<component>/config.py) when the key is unset. Fails naming
<path>.<key> on anything else: a quantity ("4Mi"), a sign, a fraction, or more than 18 digits
(past int64, where sprig's int64 gives 0). Called with (dict "config" <map> "key" <field> "path"
"kvstore.config" "default" <int>). */ -}}
{{- define "seer.configBytes" -}}
{{- if hasKey .config .key -}}
{{- $raw := toJson (index .config .key) | trimAll "\"" -}}
{{- if not (regexMatch "^[0-9]+$" $raw) -}}
{{- fail (printf "%s.%s: a whole number of bytes (got %s)" .path .key $raw) -}}
{{- end -}}
{{- $digits := regexReplaceAll "^0+([0-9])" $raw "${1}" -}}
{{- if gt (len $digits) 18 -}}
{{- fail (printf "%s.%s: %s bytes is past what the chart's checks can count (18 digits)" .path .key $raw) -}}
{{- end -}}
{{- $digits -}}
{{- else -}}
{{- .default -}}
{{- end -}}
{{- end -}}

{{/*
SEER_* environment of one component: bind address and ports, the wiring the chart owns, then the
user's `config` map (which may not override the wiring: that fails at render).
*/}}
{{- define "seer.env" -}}
{{- $root := .root -}}
{{- $c := .component -}}
{{- $svc := index $root.Values $c -}}
{{- $prefix := printf "SEER_%s_" (upper $c) -}}
{{- $wired := dict "host" "0.0.0.0" "port" (toString $svc.port) "metrics_port" (toString $svc.metricsPort) -}}
{{- if eq $c "buffer" -}}
{{- $_ := set $wired "data_dir" "/var/lib/seer/buffer" -}}
{{- /* The buffer tokenizes prompt_text and checks token ids against the workers' model: with a
model volume it reads model.dir from it (else its image's SmolLM2 tokenizer, or buffer.config.model_dir;
seer.validate refuses another model.dir with neither). */ -}}
{{- if $root.Values.worker.modelVolume -}}{{- $_ := set $wired "model_dir" $root.Values.model.dir -}}{{- end -}}
{{- if $root.Values.scheduler.enabled -}}{{- $_ := set $wired "scheduler_address" (include "seer.address" (dict "root" $root "component" "scheduler")) -}}{{- end -}}
{{- else if eq $c "scheduler" -}}
{{- $_ := set $wired "buffer_address" (include "seer.address" (dict "root" $root "component" "buffer")) -}}
{{- /* Dispatch epochs stay above the old process's after a restart, whatever the node's clock says
(services/scheduler/epochs.py). The file is on the pod's "state" emptyDir: it outlives a container
restart (a crash), not the pod; a new pod starts from the wall clock. */ -}}
{{- $_ := set $wired "epoch_file" "/var/lib/seer/scheduler/epochs" -}}
{{- else if eq $c "draft" -}}
{{- /* A restarted draft server refills its history drafts from the buffer's durable history. */ -}}
{{- $_ := set $wired "buffer_address" (include "seer.address" (dict "root" $root "component" "buffer")) -}}
{{- else if eq $c "kvstore" -}}
{{- $_ := set $wired "data_dir" "/var/lib/seer/kvstore" -}}
{{- /* The SSD budget follows the volume: RocksDB's files reach ~2.4x ssd_bytes under churn
(services/kvstore/README.md), so 0.4 x persistence.size unless config.ssd_bytes says otherwise
(seer.validate checks that one against the volume). */ -}}
{{- if not (hasKey $svc.config "ssd_bytes") -}}
{{- $_ := set $wired "ssd_bytes" (include "seer.kvSsdBytes" $root) -}}
{{- end -}}
{{- else if eq $c "worker" -}}
{{- $_ := set $wired "scheduler_address" (include "seer.address" (dict "root" $root "component" "scheduler")) -}}
{{- $_ := set $wired "model_dir" $root.Values.model.dir -}}
{{- $_ := set $wired "engine" $svc.engine -}}
{{- if $svc.gpu.enabled -}}{{- $_ := set $wired "device" "cuda" -}}{{- end -}}
{{- if and $root.Values.draft.enabled (gt (int $root.Values.draft.replicas) 0) -}}{{- $_ := set $wired "draft_address" (include "seer.address" (dict "root" $root "component" "draft")) -}}{{- end -}}
{{- if $root.Values.kvstore.enabled -}}{{- $_ := set $wired "kv_addresses" (include "seer.kvAddresses" (dict "root" $root)) -}}{{- end -}}
{{- end -}}
{{- range $k, $v := $svc.config -}}
{{- if hasKey $wired $k -}}
{{- fail (printf "%s.config.%s: set by the chart (%s); use the chart's own value for it" $c $k (printf "%s%s" $prefix (upper $k))) -}}
{{- end -}}
{{- end }}
- name: SEER_TRACING
  value: {{ $root.Values.global.tracing | quote }}
{{- if eq $c "worker" }}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: SEER_WORKER_WORKER_ID
  value: "$(POD_NAME)"
- name: SEER_WORKER_ADVERTISE_ADDRESS
  value: "$(POD_IP):{{ $svc.port }}"
{{- end }}
{{- range $k := keys $wired | sortAlpha }}
- name: {{ printf "%s%s" $prefix (upper $k) }}
  value: {{ index $wired $k | toString | quote }}
{{- end }}
{{- range $k := keys $svc.config | sortAlpha }}
{{- $val := index $svc.config $k }}
- name: {{ printf "%s%s" $prefix (upper $k) }}
  {{- /* Numbers from a values file are float64: toString would write 107374182400 as
  1.073741824e+11, which an int field refuses; toJson writes 107374182400 (and 0.9, true). */}}
  value: {{ (kindIs "string" $val) | ternary $val (toJson $val) | quote }}
{{- end }}
{{- with $root.Values.global.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Native gRPC probes (grpc.health.v1); the startup probe covers model loading. */}}
{{- define "seer.probes" -}}
{{- $svc := index .root.Values .component -}}
startupProbe:
  grpc:
    port: {{ $svc.port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ $svc.startupFailureThreshold | default 30 }}
readinessProbe:
  grpc:
    port: {{ $svc.port }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ $svc.port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/*
Render-time checks with messages that name the value: a wrong value fails `helm install`/`template`,
not the first rollout. values.schema.json covers types and ranges; these cover relations.
*/}}
{{- define "seer.validate" -}}
{{- $v := .Values -}}
{{- range $c := list "buffer" "scheduler" "worker" -}}
{{- $svc := index $v $c -}}
{{- if not $svc.enabled -}}
{{- fail (printf "%s.enabled: the %s is required; Seer cannot run a rollout without it" $c $c) -}}
{{- end -}}
{{- if lt (int $svc.replicas) 1 -}}
{{- fail (printf "%s.replicas: must be >= 1 (got %v); the %s is required" $c $svc.replicas $c) -}}
{{- end -}}
{{- end -}}
{{- range $c := list "buffer" "scheduler" -}}
{{- if gt (int (index $v $c).replicas) 1 -}}
{{- fail (printf "%s.replicas: must be 1 (got %v); the %s is logically central (one active replica)" $c (index $v $c).replicas $c) -}}
{{- end -}}
{{- end -}}
{{- if not $v.model.dir -}}
{{- fail "model.dir: required; the directory (inside the worker container) holding the model's safetensors, config.json and tokenizer.json" -}}
{{- end -}}
{{- if not (hasPrefix "/" $v.model.dir) -}}
{{- fail (printf "model.dir: must be an absolute path inside the worker container (got %q)" $v.model.dir) -}}
{{- end -}}
{{- if and (eq $v.worker.engine "sglang") (not $v.worker.gpu.enabled) -}}
{{- fail "worker.engine: sglang needs a GPU; set worker.gpu.enabled=true (and the seer-worker-gpu image) or use engine=reference" -}}
{{- end -}}
{{- $mount := trimSuffix "/" $v.worker.modelMountPath -}}
{{- if and $v.worker.modelVolume (not (or (eq (trimSuffix "/" $v.model.dir) $mount) (hasPrefix (printf "%s/" $mount) $v.model.dir))) -}}
{{- fail (printf "model.dir: %q is not under worker.modelMountPath %q where worker.modelVolume is mounted" $v.model.dir $v.worker.modelMountPath) -}}
{{- end -}}
{{- /* The CPU image under any registry prefix: an equality check against "seer-worker" let
"registry.example.com/seer-worker" (CPU-only torch) through with gpu.enabled. Only the known CPU
image is refused: a custom CUDA image under another name stays allowed. */ -}}
{{- if and $v.worker.gpu.enabled (regexMatch "(^|/)seer-worker$" $v.worker.image.repository) -}}
{{- fail (printf "worker.image.repository: worker.gpu.enabled needs the CUDA image (seer-worker-gpu, or a custom CUDA one), got %q: seer-worker holds a CPU-only torch and the worker would exit at start with device cuda" $v.worker.image.repository) -}}
{{- end -}}
{{- $gpuImage := regexMatch "(^|/)seer-worker-gpu$" $v.worker.image.repository -}}
{{- /* docker/Dockerfile.gpu bakes no model: without a mounted one the GPU worker renders cleanly,
then exits at start (model.dir missing) and crash-loops. */ -}}
{{- $gpuWorker := or $v.worker.gpu.enabled $gpuImage -}}
{{- if and $gpuWorker (not $v.worker.modelVolume) -}}
{{- fail (printf "worker.modelVolume: required for a GPU worker (worker.gpu.enabled or the seer-worker-gpu image, which holds no model); without it model.dir %q does not exist in the container and the worker crash-loops at start. Mount the model, e.g. --set-json 'worker.modelVolume={\"persistentVolumeClaim\":{\"claimName\":\"models\"}}', and set model.dir inside worker.modelMountPath (%s)" $v.model.dir $v.worker.modelMountPath) -}}
{{- end -}}
{{- /* The buffer tokenizes prompt_text and bounds token ids with the workers' model. Its image holds
only the embedded model's tokenizer, at the default model.dir; another model reaches it through
worker.modelVolume (seer.env wires model.dir then). Another model baked into a custom worker image
is not in the buffer image: the buffer would tokenize with the wrong vocabulary, silently. */ -}}
{{- $imageModel := include "seer.imageModelDir" . -}}
{{- if and (ne (trimSuffix "/" $v.model.dir) $imageModel) (not $v.worker.modelVolume) (not (hasKey $v.buffer.config "model_dir")) -}}
{{- fail (printf "model.dir: %q is not the images' embedded model (%s) and there is no worker.modelVolume, so the buffer would tokenize prompts with the embedded model's vocabulary, not the workers'. Mount the model (worker.modelVolume: the buffer mounts it too) or point buffer.config.model_dir at the same model's tokenizer in the buffer image" $v.model.dir $imageModel) -}}
{{- end -}}
{{- range $k := list "worker_id" "advertise_address" -}}
{{- if hasKey $v.worker.config $k -}}
{{- fail (printf "worker.config.%s: set by the chart (SEER_WORKER_%s: the pod's name / IP, one per replica); remove it" $k (upper $k)) -}}
{{- end -}}
{{- end -}}
{{- if and $v.kvstore.enabled (hasKey $v.kvstore.config "ssd_bytes") -}}
{{- $raw := toJson (index $v.kvstore.config "ssd_bytes") | trimAll "\"" -}}
{{- if not (regexMatch "^[0-9]+$" $raw) -}}
{{- fail (printf "kvstore.config.ssd_bytes: a whole number of bytes (got %s; a quantity like 100Gi is the volume's unit, kvstore.persistence.size)" $raw) -}}
{{- end -}}
{{- $ssd := float64 (include "seer.kvSsdBytes" .) -}}
{{- $vol := float64 (include "seer.quantityBytes" $v.kvstore.persistence.size) -}}
{{- if gt (mulf $ssd 2.5) $vol -}}
{{- fail (printf "kvstore.config.ssd_bytes: %.0f needs a volume of about 2.5x (%.0f bytes: RocksDB's files reach ~2.4x ssd_bytes under churn, services/kvstore/README.md); kvstore.persistence.size is %s (%.0f bytes). Raise the size or leave ssd_bytes unset (0.4 x the volume)" $ssd (mulf $ssd 2.5) $v.kvstore.persistence.size $vol) -}}
{{- end -}}
{{- end -}}
{{- /* The kvstore reserves RocksDB's WAL cap, max(32 MiB, ssd_write_buffer_bytes / 2;
ssd_write_buffer_bytes' default is 64 MiB, services/kvstore/config.py), out of ssd_bytes and refuses to start (a crash loop)
when nothing is left for pages: fail at render instead, naming the value that decides. */ -}}
{{- if $v.kvstore.enabled -}}
{{- /* The byte counts the checks below use; an unset (or nulled) key is the service's default
(services/kvstore/config.py), not values.yaml's. Checked in KvStoreConfig.validate's order, so both
refuse a config naming the same field. */ -}}
{{- $kvc := $v.kvstore.config -}}
{{- $dram := int64 (include "seer.configBytes" (dict "config" $kvc "key" "dram_bytes" "path" "kvstore.config" "default" 2147483648)) -}}
{{- $wb := int64 (include "seer.configBytes" (dict "config" $kvc "key" "ssd_write_buffer_bytes" "path" "kvstore.config" "default" 67108864)) -}}
{{- $largest := int64 (include "seer.configBytes" (dict "config" $kvc "key" "max_page_message_bytes" "path" "kvstore.config" "default" 4194304)) -}}
{{- $positive := dict "ssd_write_buffer_bytes" $wb "max_page_message_bytes" $largest -}}
{{- range $k := list "ssd_write_buffer_bytes" "max_page_message_bytes" -}}
{{- $n := index $positive $k -}}
{{- if le $n 0 -}}
{{- fail (printf "kvstore.config.%s: must be > 0, got %d; the kvstore would refuse to start" $k $n) -}}
{{- end -}}
{{- end -}}
{{- $reserve := max 33554432 (div $wb 2) -}}
{{- $ssdBytes := int64 (include "seer.kvSsdBytes" .) -}}
{{- if hasKey $v.kvstore.config "ssd_bytes" -}}
{{- if le $ssdBytes $reserve -}}
{{- fail (printf "kvstore.config.ssd_bytes: must be > %d, the RocksDB WAL cap the kvstore reserves out of it (max(32 MiB, ssd_write_buffer_bytes / 2), ssd_write_buffer_bytes %d), got %d; the kvstore would refuse to start. Raise ssd_bytes or lower kvstore.config.ssd_write_buffer_bytes" $reserve $wb $ssdBytes) -}}
{{- end -}}
{{- else -}}
{{- if le $ssdBytes $reserve -}}
{{- fail (printf "kvstore.persistence.size: %s gives ssd_bytes %d (0.4 x the volume), not above the RocksDB WAL cap the kvstore reserves out of it (%d: max(32 MiB, ssd_write_buffer_bytes / 2), ssd_write_buffer_bytes %d); the kvstore would refuse to start. Raise the size (more than 2.5 x %d bytes) or lower kvstore.config.ssd_write_buffer_bytes" $v.kvstore.persistence.size $ssdBytes $reserve $wb $reserve) -}}
{{- end -}}
{{- end -}}
{{- /* The largest page a Put may carry (max_page_message_bytes, default 4 MiB) must fit the SSD page
budget (ssd_bytes less the WAL cap) or the DRAM tier (dram_bytes, default 2 GiB): the kvstore
refuses to start otherwise (KvStoreConfig.check_largest_page_fits; such a page went straight to SSD
and every Put of it was refused there). A budget below it beside a DRAM tier that holds it is valid
(a kvstore run on DRAM). */ -}}
{{- $budget := sub $ssdBytes $reserve -}}
{{- if lt (max $budget $dram) $largest -}}
{{- $why := printf "holds no page of kvstore.config.max_page_message_bytes (%d), the largest a Put may carry, and neither does kvstore.config.dram_bytes (%d): every Put of a page larger than both would be refused, so the kvstore refuses to start" $largest $dram -}}
{{- $lower := "or lower kvstore.config.max_page_message_bytes to the model's page size" -}}
{{- if hasKey $kvc "ssd_bytes" -}}
{{- fail (printf "kvstore.config.ssd_bytes: its page budget (%d bytes: %d less the WAL cap %d) %s. Raise kvstore.config.ssd_bytes to at least %d or kvstore.config.dram_bytes to at least %d, %s" $budget $ssdBytes $reserve $why (add $reserve $largest) $largest $lower) -}}
{{- else -}}
{{- fail (printf "kvstore.persistence.size: %s gives ssd_bytes %d (0.4 x the volume), whose page budget (%d bytes: less the WAL cap %d) %s. Raise the size (more than 2.5 x %d bytes) or kvstore.config.dram_bytes to at least %d, %s" $v.kvstore.persistence.size $ssdBytes $budget $reserve $why (add $reserve $largest) $largest $lower) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

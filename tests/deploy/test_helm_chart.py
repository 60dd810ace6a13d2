"""The Helm chart, rendered offline through Helm's Go SDK (helm-python-sdk), linted, and every object
validated with kubernetes-validate; wrong values must fail at render with a message naming them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from deploy_render import CHART, KUBE_VERSIONS, SERVICES, config_fields, render

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

# Value sets a user would plausibly install with.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "gpu-production": {
        "global": {"imageRegistry": "registry.example.com/seer/", "imageTag": "1.2.3", "tracing": "otlp",
                   "extraEnv": [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel:4317"}]},
        # The GPU image holds no model: it is mounted (the buffer mounts it too).
        "model": {"dir": "/models/qwen3-8b"},
        "worker": {"replicas": 8, "engine": "sglang", "image": {"repository": "seer-worker-gpu"},
                   "gpu": {"enabled": True, "count": 1},
                   "modelVolume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                   "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}],
                   "config": {"max_batch_size": 256, "dtype": "bfloat16", "speculation": True}},
        # Unquoted byte counts: YAML numbers reach the templates as float64 (see the env test).
        "kvstore": {"replicas": 3, "persistence": {"size": "500Gi", "storageClassName": "local-nvme"},
                    "config": {"ssd_bytes": 107374182400, "dram_bytes": 34359738368}},
        "scheduler": {"config": {"policy": "seer_history", "chunk_size": 8192}},
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "no-draft-replicas": {"draft": {"replicas": 0}, "kvstore": {"persistence": {"size": "1.5Ti"}}},
    "minimal-no-draft-no-kv": {
        "draft": {"enabled": False},
        "kvstore": {"enabled": False},
        "worker": {"replicas": 1, "pdb": {"enabled": False}},
    },
    "model-volume": {
        "model": {"dir": "/models/qwen2-7b"},
        "worker": {"modelVolume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}},
    },
}


def _by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _env(obj: dict[str, Any]) -> dict[str, str]:
    container = obj["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_render_and_validate_every_object(chart: Any, name: str) -> None:
    objects = render(chart, VALUE_SETS[name])
    assert objects, "the chart rendered nothing"
    validated = 0
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            # A CRD kubernetes-validate has no schema for: check the fields the operator needs.
            assert obj["kind"] == "ServiceMonitor"
            assert obj["spec"]["endpoints"][0]["port"] == "metrics"
            assert obj["spec"]["selector"]["matchLabels"]
            continue
        for version in KUBE_VERSIONS:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}: {e}")
        validated += 1
    assert validated >= 6  # at least a Service and a workload for buffer, scheduler and worker


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint_strict(name: str) -> None:
    report = helm.lint(str(CHART), VALUE_SETS[name], strict=True, kube_version="v1.33.0")
    errors = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
    assert not errors, errors


def test_default_topology(chart: Any) -> None:
    objects = render(chart)
    sts = _by_kind(objects, "StatefulSet")
    deps = _by_kind(objects, "Deployment")
    assert set(sts) == {"seer-buffer", "seer-kvstore"}
    assert set(deps) == {"seer-scheduler", "seer-draft", "seer-worker"}
    for s in sts.values():
        claim = s["spec"]["volumeClaimTemplates"][0]
        assert claim["spec"]["resources"]["requests"]["storage"]
        mounts = s["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        assert any(m["name"] == claim["metadata"]["name"] for m in mounts)
        assert s["spec"]["serviceName"] == s["metadata"]["name"]
    services = _by_kind(objects, "Service")
    assert set(services) == {f"seer-{s}" for s in SERVICES}
    assert all(s["spec"]["clusterIP"] == "None" for s in services.values()), "client-side balancing needs headless"
    pdbs = _by_kind(objects, "PodDisruptionBudget")
    assert "seer-worker" in pdbs
    # One active replica each: no surge pod beside the old one (for the draft server, a group's
    # siblings would be indexed on two pods, which the headless Service balances between).
    for single in ("seer-scheduler", "seer-draft"):
        assert deps[single]["spec"]["strategy"]["type"] == "Recreate", single
    assert "strategy" not in deps["seer-worker"]["spec"]
    # A restarted draft server refills its history drafts from the buffer.
    assert _env(deps["seer-draft"])["SEER_DRAFT_BUFFER_ADDRESS"] == "seer-buffer.rollout.svc:50051"
    assert not _by_kind(objects, "ServiceMonitor")
    for obj in [*sts.values(), *deps.values()]:
        pod = obj["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == container["ports"][0]["containerPort"], probe


def test_scheduler_keeps_its_epoch_floor_on_a_writable_volume(chart: Any) -> None:
    """The root filesystem is read-only: the epoch file (services/scheduler/epochs.py) must be on a
    mounted volume, or every reserve fails and a restart may reuse lower dispatch epochs."""
    dep = _by_kind(render(chart), "Deployment")["seer-scheduler"]
    path = _env(dep)["SEER_SCHEDULER_EPOCH_FILE"]
    pod = dep["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    directory = path.rsplit("/", 1)[0]
    assert directory in mounts, f"{path} is not on a mounted volume: {mounts}"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts[directory]]
    with pytest.raises(Exception, match="epoch_file"):
        render(chart, {"scheduler": {"config": {"epoch_file": "/tmp/x"}}})


def test_worker_gpu_values(chart: Any) -> None:
    objects = render(chart, VALUE_SETS["gpu-production"])
    worker = _by_kind(objects, "Deployment")["seer-worker"]
    pod = worker["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert worker["spec"]["replicas"] == 8
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"] == "registry.example.com/seer/seer-worker-gpu:1.2.3"
    assert {t["key"] for t in pod["tolerations"]} == {"dedicated", "nvidia.com/gpu"}
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 300
    # A read-only root filesystem, but a writable $HOME for the JIT caches (Triton, inductor).
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    home = next(m for m in container["volumeMounts"] if m["mountPath"] == "/home/seer")
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == home["name"])
    env = _env(worker)
    assert env["SEER_WORKER_DEVICE"] == "cuda"
    assert env["SEER_WORKER_ENGINE"] == "sglang"
    assert env["SEER_WORKER_DTYPE"] == "bfloat16"
    assert env["SEER_WORKER_MAX_BATCH_SIZE"] == "256"
    # One address per kvstore replica, by stable StatefulSet pod DNS name.
    kv_addresses = env["SEER_WORKER_KV_ADDRESSES"].split(",")
    assert kv_addresses == [f"seer-kvstore-{i}.seer-kvstore.rollout.svc:50054" for i in range(3)]
    assert _by_kind(objects, "ServiceMonitor")["seer"]["metadata"]["labels"]["release"] == "prometheus"


def test_disabled_components_are_not_wired(chart: Any) -> None:
    objects = render(chart, VALUE_SETS["minimal-no-draft-no-kv"])
    names = {o["metadata"]["name"] for o in objects}
    assert not {"seer-draft", "seer-kvstore"} & names
    env = _env(_by_kind(objects, "Deployment")["seer-worker"])
    assert "SEER_WORKER_DRAFT_ADDRESS" not in env and "SEER_WORKER_KV_ADDRESSES" not in env
    assert env["SEER_WORKER_SCHEDULER_ADDRESS"] == "seer-scheduler.rollout.svc:50052"
    # draft.replicas 0 disables it too (the schema says so): no address of a Service without pods.
    env = _env(_by_kind(render(chart, VALUE_SETS["no-draft-replicas"]), "Deployment")["seer-worker"])
    assert "SEER_WORKER_DRAFT_ADDRESS" not in env


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_env_loads_into_its_service_config(chart: Any, name: str) -> None:
    """Every workload's SEER_* environment is accepted by its service's own config loader (a value
    the service refuses would crash-loop the pod). Numbers from a values file are float64 in the
    templates: toString rendered 107374182400 as 1.073741824e+11, which an int field refuses."""
    from services.common.config import load
    from services.common.server import ServiceConfig
    from services.kvstore.config import KvStoreConfig

    objects = render(chart, VALUE_SETS[name])
    loaded = 0
    for obj in [*_by_kind(objects, "StatefulSet").values(), *_by_kind(objects, "Deployment").values()]:
        service = obj["metadata"]["name"].removeprefix("seer-")
        module = __import__(f"services.{service}.config", fromlist=["_"])
        (cls,) = [c for c in vars(module).values()
                  if isinstance(c, type) and issubclass(c, ServiceConfig) and c is not ServiceConfig]
        env = {k: v.replace("$(POD_NAME)", "seer-worker-0").replace("$(POD_IP)", "10.0.0.5")
               for k, v in _env(obj).items()}
        cfg = load(cls, service, argv=[], env=env)
        if service == "kvstore":
            assert isinstance(cfg, KvStoreConfig)
            claim = obj["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
            assert 2.5 * cfg.ssd_bytes <= _quantity(claim), (cfg.ssd_bytes, claim)  # README: ~2.4x under churn
        loaded += 1
    assert loaded >= 3


def _quantity(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    for unit, mult in units.items():
        if q.endswith(unit):
            return float(q[: -len(unit)]) * mult
    return float(q)


def test_a_model_volume_may_be_the_model_dir_itself(chart: Any) -> None:
    """model.dir equal to the mount path (the volume's root is the model) renders; only a dir that
    merely shares the mount's prefix (/models-big under /models) fails (BAD_VALUES)."""
    for d in ("/models", "/models/"):
        objects = render(chart, {"model": {"dir": d}, "worker": {"modelVolume": {"emptyDir": {}}}})
        assert _env(_by_kind(objects, "Deployment")["seer-worker"])["SEER_WORKER_MODEL_DIR"] == d


def test_kvstore_ssd_budget_follows_its_volume(chart: Any) -> None:
    """Unset, ssd_bytes is 0.4 x the volume (RocksDB's files reach ~2.4x ssd_bytes under churn:
    services/kvstore/README.md); the default 50Gi volume with the service's own 32 GiB default
    would overflow it. Set, it must fit (BAD_VALUES)."""
    env = _env(_by_kind(render(chart), "StatefulSet")["seer-kvstore"])
    assert env["SEER_KVSTORE_SSD_BYTES"] == str(int(0.4 * 50 * 2**30))
    env = _env(_by_kind(render(chart, VALUE_SETS["no-draft-replicas"]), "StatefulSet")["seer-kvstore"])
    assert env["SEER_KVSTORE_SSD_BYTES"] == str(int(0.4 * 1.5 * 2**40))
    env = _env(_by_kind(render(chart, VALUE_SETS["gpu-production"]), "StatefulSet")["seer-kvstore"])
    assert env["SEER_KVSTORE_SSD_BYTES"] == "107374182400"


def test_kvstore_ssd_budget_above_the_wal_reserve_renders_and_loads(chart: Any) -> None:
    """The chart's check agrees with the kvstore's own (KvStoreConfig.validate): one byte above the WAL
    reserve renders and the service accepts it; the reserve itself fails at render (BAD_VALUES holds
    the cases that rendered before and crash-looped: a 64Mi volume, a 4 GiB write buffer)."""
    from services.common.config import load
    from services.kvstore.config import KvStoreConfig
    from services.kvstore.ssd import MIN_WAL_BYTES

    for config in ({"ssd_bytes": MIN_WAL_BYTES + 1},
                   {"ssd_bytes": (1 << 30) + 1, "ssd_write_buffer_bytes": 2 << 30}):
        env = _env(_by_kind(render(chart, {"kvstore": {"config": config}}), "StatefulSet")["seer-kvstore"])
        assert load(KvStoreConfig, "kvstore", argv=[], env=env).ssd_page_bytes() == 1
    with pytest.raises(helm.HelmError, match="must be > 33554432"):
        render(chart, {"kvstore": {"config": {"ssd_bytes": MIN_WAL_BYTES}}})


def test_kvstore_without_a_tier_for_the_largest_page_fails_at_render(chart: Any) -> None:
    """Before: no DRAM tier beside a 1-byte SSD page budget rendered, and the kvstore refused to
    start (KvStoreConfig.check_largest_page_fits): a crash loop. The render fails now, naming
    ssd_bytes and the same ways out as the service's own message."""
    from services.common.config import ConfigError, load
    from services.kvstore.config import KvStoreConfig

    config = {"dram_bytes": "0", "ssd_bytes": 33554433}
    with pytest.raises(helm.HelmError) as info:
        render(chart, {"kvstore": {"config": config}})
    message = str(info.value)
    assert "kvstore.config.ssd_bytes: its page budget (1 bytes: 33554433 less the WAL cap 33554432)" in message
    with pytest.raises(ConfigError) as refused:
        load(KvStoreConfig, "kvstore", argv=[], env={f"SEER_KVSTORE_{k.upper()}": str(v) for k, v in config.items()})
    assert refused.value.field == "ssd_bytes"
    # The same ways out, with the same numbers.
    for way in ("ssd_bytes to at least 37748736", "dram_bytes to at least 4194304", "lower kvstore.config.max_page"):
        assert way in message, message
        assert way.replace("kvstore.config.", "") in str(refused.value), str(refused.value)


MiB = 1 << 20
_UNSET = object()  # the key left out of the override: values.yaml's default (dram_bytes "2147483648")
# (ssd_bytes, dram_bytes, max_page_message_bytes, ssd_write_buffer_bytes); None nulls the key (the
# service's default), _UNSET leaves the chart's. 32 MiB is the WAL cap with the default 64 MiB buffer,
# 64 MiB with a 128 MiB one; 4 MiB is max_page_message_bytes' default.
_SSD = (_UNSET, 32 * MiB + 1, 36 * MiB - 1, "0037748736", 64 * MiB + 4 * MiB)
_DRAM = (_UNSET, None, "0", 4 * MiB - 1)
_LARGEST = (_UNSET, 4 * MiB - 1, 8 * MiB, 0)
_WRITE_BUFFER = (_UNSET, 128 * MiB, "0")


def test_kvstore_chart_and_service_agree_on_the_page_tiers(chart: Any) -> None:
    """Over a grid of the four values that decide whether the largest page fits a tier (the chart's
    defaults, the 1-byte page budget beside the default DRAM tier of the WAL-reserve test, each
    bound and one byte off, a leading zero sprig would read as octal), the chart renders exactly
    the configs KvStoreConfig.validate() accepts, a refused one naming the field the service names."""
    import itertools

    from services.common.config import ConfigError, load
    from services.kvstore.config import KvStoreConfig

    names = ("ssd_bytes", "dram_bytes", "max_page_message_bytes", "ssd_write_buffer_bytes")
    chart_dram = "2147483648"  # values.yaml's kvstore.config.dram_bytes
    disagreements: list[str] = []
    rendered = 0
    for combo in itertools.product(_SSD, _DRAM, _LARGEST, _WRITE_BUFFER):
        config = {k: v for k, v in zip(names, combo, strict=True) if v is not _UNSET}
        # The service's view of the same values, built without the chart: unset ssd_bytes is the
        # chart's 0.4 x the default 50Gi volume, unset dram_bytes values.yaml's.
        env = {"SEER_KVSTORE_SSD_BYTES": str(int(0.4 * 50 * 2**30)), "SEER_KVSTORE_DRAM_BYTES": chart_dram}
        env.update({f"SEER_KVSTORE_{k.upper()}": str(v) for k, v in config.items() if v is not None})
        if config.get("dram_bytes", chart_dram) is None:
            del env["SEER_KVSTORE_DRAM_BYTES"]
        try:
            load(KvStoreConfig, "kvstore", argv=[], env=env)
            refused: ConfigError | None = None
        except ConfigError as e:
            refused = e
        try:
            objects = render(chart, {"kvstore": {"config": config}})
        except helm.HelmError as e:
            if refused is None:
                disagreements.append(f"{config}: the chart refused what the service accepts: {e}")
            elif f"kvstore.config.{refused.field}:" not in str(e):
                disagreements.append(f"{config}: the service names {refused.field}, the chart: {e}")
            continue
        rendered += 1
        if refused is not None:
            disagreements.append(f"{config}: rendered what the service refuses: {refused}")
            continue
        # What the chart rendered is what the service loads (and accepts).
        kv_env = _env(_by_kind(objects, "StatefulSet")["seer-kvstore"])
        cfg = load(KvStoreConfig, "kvstore", argv=[], env=kv_env)
        assert (cfg.ssd_bytes, cfg.dram_bytes) == (int(env["SEER_KVSTORE_SSD_BYTES"]),
                                                   int(env.get("SEER_KVSTORE_DRAM_BYTES", 2 << 30))), config
    assert not disagreements, "\n".join(disagreements)
    # Both outcomes are covered, the chart's defaults and the 1-byte page budget among the rendered.
    assert 0 < rendered < len(_SSD) * len(_DRAM) * len(_LARGEST) * len(_WRITE_BUFFER)
    render(chart)
    render(chart, {"kvstore": {"config": {"ssd_bytes": 32 * MiB + 1}}})


def test_buffer_reads_the_workers_model(chart: Any) -> None:
    """The buffer tokenizes prompt_text and bounds token ids with the served model: it gets the same
    model.dir as the workers, and the model volume when there is one."""
    objects = render(chart, VALUE_SETS["model-volume"])
    buffer = _by_kind(objects, "StatefulSet")["seer-buffer"]
    worker = _by_kind(objects, "Deployment")["seer-worker"]
    assert _env(buffer)["SEER_BUFFER_MODEL_DIR"] == _env(worker)["SEER_WORKER_MODEL_DIR"] == "/models/qwen2-7b"
    for obj in (buffer, worker):
        pod = obj["spec"]["template"]["spec"]
        assert any(v["name"] == "model" and "persistentVolumeClaim" in v for v in pod["volumes"])
        mounts = pod["containers"][0]["volumeMounts"]
        assert any(m["name"] == "model" and m["mountPath"] == "/models" and m["readOnly"] for m in mounts)
    # Without a volume the buffer keeps its image's tokenizer (a custom worker image's model is not
    # in the buffer image), unless buffer.config.model_dir says otherwise.
    defaults = render(chart)
    buffer = _by_kind(defaults, "StatefulSet")["seer-buffer"]
    assert "SEER_BUFFER_MODEL_DIR" not in _env(buffer)
    assert not any(v["name"] == "model" for v in buffer["spec"]["template"]["spec"]["volumes"])
    own = render(chart, {"buffer": {"config": {"model_dir": "/tok"}}})
    assert _env(_by_kind(own, "StatefulSet")["seer-buffer"])["SEER_BUFFER_MODEL_DIR"] == "/tok"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_env_names_are_real_config_fields(chart: Any, name: str) -> None:
    """Every SEER_<SERVICE>_* variable the chart sets is a field of that service's config dataclass
    (a stale name would make the pod crash-loop on 'unknown variable')."""
    objects = render(chart, VALUE_SETS[name])
    checked = 0
    for obj in [*_by_kind(objects, "StatefulSet").values(), *_by_kind(objects, "Deployment").values()]:
        service = obj["metadata"]["name"].removeprefix("seer-")
        fields = config_fields(service)
        if fields is None:
            continue
        prefix = f"SEER_{service.upper()}_"
        unknown = {k for k in _env(obj) if k.startswith(prefix) and k[len(prefix):].lower() not in fields}
        assert not unknown, f"{service}: {sorted(unknown)} are not fields of its config"
        checked += 1
    assert checked >= 1


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"worker": {"replicas": 0}}, "/worker/replicas"),
    ({"scheduler": {"replicas": 0}}, "/scheduler/replicas"),
    ({"buffer": {"replicas": 2}}, "/buffer/replicas"),
    ({"draft": {"replicas": 2}}, "/draft/replicas"),
    ({"model": {"dir": ""}}, "/model/dir"),
    ({"model": {"dir": "models/smol"}}, "/model/dir"),
    ({"worker": {"enabled": False}}, "worker.enabled"),
    ({"buffer": {"enabled": False}}, "buffer.enabled"),
    ({"worker": {"engine": "sglang"}}, "worker.engine"),
    ({"worker": {"config": {"model_dir": "/elsewhere"}}}, "worker.config.model_dir"),
    ({"worker": {"replica": 3}}, "replica"),
    ({"worker": {"config": {"Max-Batch": 3}}}, "Max-Batch"),
    ({"kvstore": {"persistence": {"size": "lots"}}}, "/kvstore/persistence/size"),
    ({"model": {"dir": "/data/m"}, "worker": {"modelVolume": {"emptyDir": {}}}}, "worker.modelMountPath"),
    ({"model": {"dir": "/models-big/m"}, "worker": {"modelVolume": {"emptyDir": {}}}}, "worker.modelMountPath"),
    ({"worker": {"gpu": {"enabled": True}}}, "worker.image.repository"),
    # The CPU image under a registry prefix: an equality check with "seer-worker" let it through.
    ({"worker": {"gpu": {"enabled": True}, "image": {"repository": "registry.example.com/seer-worker"}}},
     "worker.image.repository: worker.gpu.enabled needs the CUDA image"),
    ({"worker": {"config": {"worker_id": "w"}}}, "worker.config.worker_id"),
    ({"worker": {"config": {"advertise_address": "w:1"}}}, "worker.config.advertise_address"),
    ({"kvstore": {"config": {"ssd_bytes": 34359738368}}}, "kvstore.config.ssd_bytes"),
    ({"kvstore": {"config": {"ssd_bytes": "34359738368"}}}, "kvstore.config.ssd_bytes"),
    ({"kvstore": {"config": {"ssd_bytes": "10Gi"}}}, "kvstore.config.ssd_bytes: a whole number"),
    # An SSD budget not above the WAL cap the kvstore reserves out of it: rendered, then crash-looped.
    ({"kvstore": {"persistence": {"size": "64Mi"}}}, "kvstore.persistence.size: 64Mi gives ssd_bytes 26843545"),
    ({"kvstore": {"config": {"ssd_bytes": 1 << 30, "ssd_write_buffer_bytes": 4 << 30}}},
     "kvstore.config.ssd_bytes: must be > 2147483648"),
    ({"kvstore": {"config": {"ssd_write_buffer_bytes": "4Gi"}}}, "kvstore.config.ssd_write_buffer_bytes"),
    # Neither the SSD page budget nor DRAM holds the largest page: rendered, then refused at start.
    ({"kvstore": {"config": {"dram_bytes": "0", "ssd_bytes": 33554433}}},
     "kvstore.config.ssd_bytes: its page budget (1 bytes"),
    ({"kvstore": {"config": {"dram_bytes": "0"}, "persistence": {"size": "85Mi"}}},
     "kvstore.persistence.size: 85Mi gives ssd_bytes 35651584 (0.4 x the volume), whose page budget"),
    ({"kvstore": {"config": {"dram_bytes": "2Gi"}}}, "kvstore.config.dram_bytes: a whole number"),
    ({"kvstore": {"config": {"max_page_message_bytes": 0}}}, "kvstore.config.max_page_message_bytes: must be > 0"),
    ({"kvstore": {"config": {"ssd_write_buffer_bytes": "0"}}}, "kvstore.config.ssd_write_buffer_bytes: must be > 0"),
    # Numeric tags: 20240101 rendered seer-buffer:2.0240101e+07 and 1.10 seer-buffer:1.1.
    ({"global": {"imageTag": 20240101}}, "/global/imageTag"),
    ({"buffer": {"image": {"tag": 1.10}}}, "/buffer/image/tag"),
    # The GPU image bakes no model: rendered cleanly, then crash-looped on the missing model.dir.
    ({"worker": {"gpu": {"enabled": True}, "image": {"repository": "seer-worker-gpu"}, "engine": "sglang"}},
     "worker.modelVolume: required for a GPU worker"),
    ({"worker": {"image": {"repository": "registry.example.com/seer-worker-gpu"}}}, "worker.modelVolume"),
    # Another model with no volume: the buffer kept its image's SmolLM2 tokenizer (wrong vocabulary).
    ({"model": {"dir": "/opt/models/qwen"}}, "buffer.config.model_dir"),
]


@pytest.mark.parametrize(("values", "needle"), BAD_VALUES, ids=[n for _, n in BAD_VALUES])
def test_bad_values_fail_at_render_naming_the_value(chart: Any, values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm.HelmError) as info:
        render(chart, values)
    assert needle in str(info.value), str(info.value)


def test_zero_is_a_value_not_unset(chart: Any) -> None:
    """Before: `| default` took 0 for unset: terminationGracePeriodSeconds 0 rendered 30 and
    pdb.maxUnavailable 0 rendered 1 (the schema allows both)."""
    objects = render(chart, {"worker": {"terminationGracePeriodSeconds": 0, "pdb": {"maxUnavailable": 0}}})
    worker = _by_kind(objects, "Deployment")["seer-worker"]
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 0
    assert _by_kind(objects, "PodDisruptionBudget")["seer-worker"]["spec"] == {
        "maxUnavailable": 0, "selector": worker["spec"]["selector"]}
    # Unset still means the chart's defaults.
    objects = render(chart, {})
    assert _by_kind(objects, "Deployment")["seer-scheduler"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 30
    assert _by_kind(objects, "PodDisruptionBudget")["seer-worker"]["spec"]["maxUnavailable"] == 1


def test_pdb_with_both_bounds_fails_naming_them(chart: Any) -> None:
    """Before: `--set buffer.pdb.enabled=true,buffer.pdb.maxUnavailable=1` merged with the default
    minAvailable: 1, which the template preferred: a budget that never allows evicting the one
    buffer pod, so every node drain hung, with the user's maxUnavailable silently ignored."""
    with pytest.raises(helm.HelmError, match=r"buffer\.pdb: minAvailable and maxUnavailable"):
        render(chart, {"buffer": {"pdb": {"enabled": True, "maxUnavailable": 1}}})
    # Nulling the default picks the user's bound.
    objects = render(chart, {"buffer": {"pdb": {"enabled": True, "minAvailable": None, "maxUnavailable": 1}}})
    assert _by_kind(objects, "PodDisruptionBudget")["seer-buffer"]["spec"]["maxUnavailable"] == 1


def test_a_numeric_tag_fails_even_without_the_schema(chart: Any, tmp_path: Path) -> None:
    """The schema refuses a numeric tag (BAD_VALUES); the template refuses it too, naming the key, for
    a render with schema validation skipped (`helm template --skip-schema-validation`), where it
    rendered seer-buffer:2.0240101e+07. Quoted numeric tags keep their form."""
    bare = tmp_path / "seer"
    shutil.copytree(CHART, bare)
    (bare / "values.schema.json").unlink()
    with helm.Chart.load(str(bare)) as unchecked:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"global": {"imageTag": 20240101}}, "global.imageTag: must be a string"),
            ({"worker": {"image": {"tag": 1.10}}}, "worker.image.tag: must be a string"),
        ]
        for values, needle in cases:
            with pytest.raises(helm.HelmError) as info:
                render(unchecked, values)
            assert needle in str(info.value), str(info.value)
    objects = render(chart, {"global": {"imageTag": "20240101"}, "worker": {"image": {"tag": "1.10"}}})
    images = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["image"]
              for o in objects if o["kind"] in ("StatefulSet", "Deployment")}
    assert images["seer-buffer"] == "seer-buffer:20240101"
    assert images["seer-worker"] == "seer-worker:1.10"


def test_another_model_reaches_the_buffer(chart: Any) -> None:
    """model.dir other than the images' embedded model: with a volume the buffer gets it (see
    test_buffer_reads_the_workers_model); without one only an explicit buffer.config.model_dir
    renders (BAD_VALUES: the buffer would tokenize with the embedded model's vocabulary)."""
    objects = render(chart, {"model": {"dir": "/opt/models/qwen"},
                             "buffer": {"config": {"model_dir": "/opt/tok/qwen"}}})
    assert _env(_by_kind(objects, "StatefulSet")["seer-buffer"])["SEER_BUFFER_MODEL_DIR"] == "/opt/tok/qwen"
    assert _env(_by_kind(objects, "Deployment")["seer-worker"])["SEER_WORKER_MODEL_DIR"] == "/opt/models/qwen"
    # The default path, written with a trailing slash, is still the embedded model.
    render(chart, {"model": {"dir": "/opt/seer/models/SmolLM2-135M-Instruct/"}})


@pytest.mark.parametrize(("storage_class", "expected"), [
    ("fast-nvme", "fast-nvme"),
    ("-", ""),       # the Helm convention for storageClassName: "" (no dynamic provisioning)
    ("on", "on"),    # unquoted, YAML read it as the boolean true
    ("", None),      # unset: the cluster's default StorageClass
])
def test_storage_class_name_is_a_string(chart: Any, storage_class: str, expected: str | None) -> None:
    """Before: rendered unquoted, "-" was invalid YAML (render error), "on"/"yes" became booleans
    (invalid objects), and storageClassName: "" could not be rendered at all."""
    objects = render(chart, {"buffer": {"persistence": {"storageClassName": storage_class}},
                             "kvstore": {"persistence": {"storageClassName": storage_class}}})
    for name, sts in _by_kind(objects, "StatefulSet").items():
        claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
        assert claim.get("storageClassName") == expected, (name, claim)
        kv.validate(sts, KUBE_VERSIONS[0], strict=True)

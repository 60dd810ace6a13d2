"""Builds a Worker from a WorkerConfig: the engine, the draft client, the planner, the KV client.

Each collaborator is optional and imported lazily, so a worker without a draft server or KV pool
does not import their clients, and an SGLang worker does not import the reference engine.
"""

from __future__ import annotations

from pathlib import Path

from services.common.log import get_logger, kv
from services.worker.config import WorkerConfig
from services.worker.core import DraftSource, KVPool, SpecPlanner, Worker, version_name, weights_id
from services.worker.engine import Engine

log = get_logger(__name__)


def resolve_model_dir(cfg: WorkerConfig) -> Path:
    if cfg.model_dir:
        return Path(cfg.model_dir)
    from services.worker.model.prepare import ensure_model

    return ensure_model()


def model_family(cfg: WorkerConfig) -> str:
    """The KV namespace family: the model directory's name (all workers of a model share it)."""
    from services.common.model_paths import default_model_dir

    name = Path(cfg.model_dir or default_model_dir()).name
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).lower() or "model"


def build_engine(cfg: WorkerConfig) -> Engine:
    model_dir = resolve_model_dir(cfg)
    # Named by the weights too (core.weights_id), as a LoadWeights names its source's.
    version = version_name(cfg.policy_version, model_family(cfg), weights_id(str(model_dir)))
    if cfg.engine == "sglang":
        from services.worker.engines.sglang.engine import SGLangEngine

        return SGLangEngine.from_config(cfg, model_dir, version)
    import torch

    from services.worker.engines.reference.engine import ReferenceEngine

    return ReferenceEngine.from_dir(
        model_dir,
        device=cfg.device,
        dtype=getattr(torch, cfg.dtype),
        page_size=cfg.page_size,
        num_pages=cfg.num_kv_pages or None,
        kv_memory_bytes=None if cfg.num_kv_pages else cfg.kv_memory_mb * 1024 * 1024,
        max_batch_size=cfg.max_batch_size,
        model_version=version,
        num_threads=cfg.num_threads or None,
        tune_malloc=cfg.tune_malloc,
    )


def build_draft(cfg: WorkerConfig) -> DraftSource | None:
    if not cfg.speculation:
        return None
    from services.worker.draft_client import DraftClient

    return DraftClient(cfg.draft_address or None, memory_budget_bytes=cfg.draft_mirror_budget_mb << 20)


def build_planner(cfg: WorkerConfig) -> SpecPlanner | None:
    if not cfg.speculation:
        return None
    from services.worker.adaptive import AdaptiveSpeculation

    # No table path: the adaptive module's default (the last `seer profile`, else built in).
    return AdaptiveSpeculation(
        cfg.spec_table or None, gamma_max=cfg.gamma_max, min_gain=cfg.spec_min_gain,
        calibrated_min_gain=cfg.spec_calibrated_min_gain, pad_cost=cfg.spec_pad_cost,
        explore_budget=cfg.spec_explore_budget, guard_steps=cfg.spec_guard_steps,
        guard_backoff=cfg.spec_guard_backoff, control_interval=cfg.spec_control_interval,
    )


def build_kv(cfg: WorkerConfig) -> KVPool | None:
    if not cfg.kv_addresses:
        return None
    from services.worker.kv_client import KVClient

    # One admission per RunChunk stream may fetch at once: the client's fetch pools are sized for
    # them (threads start lazily; capped, so a 256-stream GPU worker with many replicas does not
    # allow thousands), so concurrent fetches do not queue behind calls to a hung replica.
    fetches = min(64, cfg.sized_for_batch().stream_limit())
    return KVClient(list(cfg.kv_addresses), max_concurrent_fetches=fetches)


def build_worker(cfg: WorkerConfig, worker_id: str, engine: Engine | None = None) -> Worker:
    source = ""
    if engine is None:
        engine = build_engine(cfg)
        source = str(resolve_model_dir(cfg))
    worker = Worker(
        engine,
        worker_id=worker_id,
        policy_version=cfg.policy_version,
        draft=build_draft(cfg),
        planner=build_planner(cfg),
        kv_pool=build_kv(cfg),
        # SGLang drafts inside its own scheduler (the SEER plugin); the worker's draft client then
        # only registers groups and appends tokens.
        speculation=cfg.speculation and cfg.engine != "sglang",
        gamma_max=cfg.gamma_max,
        draft_width=cfg.draft_width,
        multipath_max_batch=cfg.multipath_max_batch,
        group_ttl_seconds=cfg.group_ttl_seconds,
        kv_offload=cfg.kv_offload,
        engine_name=cfg.engine,
        model_family=model_family(cfg),
        weights_source=source,
        step_clock=cfg.spec_step_clock,
    )
    log.info("worker built", extra=kv(worker_id=worker_id, engine=cfg.engine, speculation=cfg.speculation,
                                      draft=cfg.draft_address or "-", kv=",".join(cfg.kv_addresses) or "-"))
    return worker

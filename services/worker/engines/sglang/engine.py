"""SGLangEngine: the Engine interface over SGLang 0.5.23 (pinned; the production backend on GPUs).

SGLang runs its own scheduler loop in a subprocess, so this adapter maps the step-based interface
onto SGLang's streaming requests: add_request starts a streamed generate with the request's token
prefix, step() returns the token deltas that arrived since the last call (per request, merged), and
the worker's loop stays the same as with the reference engine.

What SGLang does natively and this adapter only configures:
- speculation: the SEER algorithm (services.worker.engines.sglang.plugin) drafts from the Seer
  draft server inside SGLang's scheduler and verifies with NGRAM's tree verification, so the
  `drafts` argument of step() is ignored here (SGLang cannot take per-step drafts from outside);
- the KV pool: HiCache with the L3 backend services.worker.engines.sglang.storage writes pages
  through to the Seer KV store and prefetches a request's stored prefix on admission, so
  export_kv / import_kv move nothing (the store is already in the loop);
- weights: load_weights = pause_generation, update_weights_from_disk(flush_cache=False), flush_cache,
  continue_generation; the
  weights' family (model + weights id) and policy version are the request's extra key (HiCache
  salts page keys with it) and the L3 namespace (through a version file the storage backend
  reads), so pages of other weights are never reused.

sglang is imported lazily: importing this module never needs it (CI has no GPU and no sglang).
Every SGLang name used here is checked against the pinned wheel's source by
tests/worker/test_sglang_api.py; citations below are sglang 0.5.23 file:line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import queue
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.log import get_logger, kv
from services.worker.engine import (
    Draft,
    Engine,
    EngineStats,
    FinishReason,
    GenerateRequest,
    KVLayout,
    KVPages,
    SamplingParams,
    StepOutput,
)
from services.worker.engines.sglang import pages, plugin

if TYPE_CHECKING:
    from services.worker.config import WorkerConfig

log = get_logger(__name__)

# Attempt numbers of SGLang request ids (_Live.rid), unique in the process.
_ATTEMPTS = itertools.count(1)

# How long load_weights waits for SGLang (pause, load from disk, flush, continue) before giving up:
# a large checkpoint takes minutes to read, but a hung scheduler must not hold the worker's lock
# (and the LoadWeights RPC) forever. Below the caller's own deadline: the scheduler's LoadWeights
# RPC runs under its drain_timeout (300 s by default, services/scheduler/config.py, links.py), and
# the worker drains its chunks inside that too. Past the caller's deadline nobody hears the answer,
# so a longer wait only holds the worker's lock. (The engine interface carries no deadline, so the
# gRPC context's time_remaining cannot reach here.)
LOAD_TIMEOUT_S = 240.0
# How long SGLang may defer the post-load cache flush until its scheduler is idle (an aborted
# request still runs one decode pass, managers/scheduler.py:5798-5812).
FLUSH_TIMEOUT_S = 30.0
# SGLang's message when the weights went in but its flush was refused (weight_updater.py:127-132):
# the weights ARE loaded.
_LOADED_NOT_FLUSHED = "Weights were updated, but"
# Its message when loading failed after weights were written (model_runner / weight_updater
# update_weights_from_disk): the "rollback" reloads the new path, so nothing was restored.
_ROLLED_BACK = "Rolling back to original weights"

# How often stats() refreshes SGLang's queue length at most. It is read from the load snapshot the
# scheduler publishes (managers/load_snapshot.py: a shared-memory slot per DP rank under a blocking
# file lock, fcntl.flock, :285-296). The scheduler writes it after every prefill batch and when idle,
# but after only every load_snapshot_publish_interval-th decode batch (15 by default, arg_groups/
# fields/observability.py:86-89; scheduler.py:871-888, 5082, 5260, 5322), so the waiting count lags
# by up to that many decode steps. One read in flight, in a thread (the lock is the scheduler's too:
# never taken on the event loop), and stats() answers with the last value at once.
LOADS_INTERVAL_S = 0.5
# How long shutdown waits for the loop's tasks (generate streams, a load read, SGLang's own) to end
# once cancelled, and then for the loop's thread: bounded, as the process is exiting.
SHUTDOWN_TIMEOUT_S = 5.0

# SGLang's attention backend for the worker (unset: SGLang's default, or flashinfer for draft trees).
ENV_ATTENTION_BACKEND = "SEER_SGLANG_ATTENTION_BACKEND"

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}


# SGLang's sampling_seed is an int64 (validated in [-2**63, 2**63 - 1], sampling/sampling_params.py:308;
# an int64 tensor, sampling/sampling_batch_info.py:157-171); Seer seeds are uint64.
SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF


class MissingLogprobs(ValueError):
    """SGLang streamed tokens without their logprobs (RL needs one per token)."""


def sampling_dict(s: SamplingParams, max_new_tokens: int) -> dict[str, Any]:
    """SGLang's sampling_params for one request (top_k 0 = off is -1 in SGLang). The seed is
    honoured only when SGLang runs with enable_deterministic_inference (sampling_batch_info.py:157-171
    builds seeds only then); otherwise SGLang samples unseeded."""
    out: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": False,
    }
    if s.seed is not None:
        out["sampling_seed"] = int(s.seed) & SEED_MASK
    return out


def parse_policy_version(model_version: str) -> int:
    """'family@v3' or 'v3' -> 3."""
    tail = model_version.rsplit("@", 1)[-1]
    if not tail.startswith("v") or not tail[1:].isdigit():
        raise ValueError(f"version: {model_version!r} is not '<family>@v<N>' or 'v<N>'")
    return int(tail[1:])


def _family_of(model_version: str) -> str:
    """'family@v3' -> 'family'; 'family@<weights id>@v3' -> 'family-<weights id>' (the KV namespace
    and HiCache's extra key take one '@' before the version); 'v3' -> 'model'. A LoadWeights from
    another source changes it (the weights id), as the reference engine's version name does
    (core.version_name); SGLang's HiCache backend, in its own process, reads it from the version
    file (pages.VersionFile)."""
    return model_version.rsplit("@", 1)[0].replace("@", "-") if "@" in model_version else "model"


def scheduler_info(sgl: Any) -> Mapping[str, Any]:
    """The scheduler's init info (Scheduler.get_init_info, managers/scheduler.py:1937-1948:
    max_total_num_tokens, max_req_input_len, ...), which 0.5.23 keeps at
    Engine._scheduler_init_result.scheduler_infos[0] (entrypoints/engine.py:345); a scheduler_info
    mapping is read first. Empty when neither is there."""
    info: Any = getattr(sgl, "scheduler_info", None)
    if isinstance(info, Mapping):
        return info
    sir = getattr(sgl, "_scheduler_init_result", None)
    infos = getattr(sir, "scheduler_infos", None) or [{}]
    return infos[0] if isinstance(infos[0], Mapping) else {}


def served_context(sgl: Any, max_position_embeddings: int) -> int:
    """The longest request (input + max_new_tokens) SGLang serves whole. Its scheduler enforces
    max_req_len = min(context_len - 1, kv_capacity - 1) and max_req_input_len = max_req_len - 5
    (managers/tp_worker.py:568-572): an input of max_req_input_len tokens or more is aborted
    (managers/utils.py:272), and max_new_tokens is clipped to max_req_len - input - 1 without a word
    (scheduler.py:2710-2716). input + max_new_tokens <= max_req_input_len keeps clear of both (the
    worker then splits near-context requests itself instead of looping CHUNK -> ABORTED).
    max_position_embeddings when SGLang does not say (the tokenizer manager holds the same value,
    entrypoints/engine.py:1399)."""
    limit = scheduler_info(sgl).get("max_req_input_len")
    if limit is None:
        limit = getattr(getattr(sgl, "tokenizer_manager", None), "max_req_input_len", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return max_position_embeddings
    return min(max_position_embeddings, limit)


def kv_pool_pages(sgl: Any, page_size: int, max_context: int, max_batch: int) -> int:
    """SGLang's KV pool in pages: max_total_num_tokens (scheduler_info) / page_size. The scheduler
    refuses a worker registering 0 pages, so when it is unknown this falls back to room for every
    batch slot at the full context (optimistic: SGLang retracts requests itself when it runs out)."""
    tokens = int(scheduler_info(sgl).get("max_total_num_tokens") or 0)
    if tokens <= 0:
        log.warning("SGLang's KV pool size is unknown; assuming every batch slot holds a full context",
                    extra=kv(max_context=max_context, max_batch=max_batch))
        tokens = max_context * max(1, max_batch)
    return max(1, tokens // page_size)


def server_kwargs(cfg: WorkerConfig, model_dir: Path, family: str, version_file: str,
                  attention_backend: str | None = None) -> dict[str, Any]:
    """sglang.Engine(**kwargs) for a worker config (SGLang's ServerArgs field names). attention_backend:
    SGLang's, None = its default (a draft tree on paged KV needs flashinfer: see
    plugin.tree_attention_backend)."""
    kw: dict[str, Any] = {
        "model_path": str(model_dir),
        "dtype": cfg.dtype,
        "page_size": cfg.page_size,
        "max_running_requests": cfg.max_batch_size,
        "skip_tokenizer_init": True,
        "log_level": "error",
    }
    if cfg.speculation and cfg.gamma_max > 0:
        kw.update(speculative_algorithm=plugin.ALGORITHM, **plugin.ngram_server_args(cfg.gamma_max, cfg.draft_width))
        attention_backend = plugin.tree_attention_backend(cfg.draft_width, cfg.page_size, attention_backend)
    if attention_backend:
        kw["attention_backend"] = attention_backend
    if cfg.kv_addresses:
        kw.update(
            enable_hierarchical_cache=True,
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps({
                "backend_name": "seer",
                "module_path": "services.worker.engines.sglang.storage",
                "class_name": "SeerHiCacheStorage",
                "kv_addresses": list(cfg.kv_addresses),
                "family": family,
                "policy_version": cfg.policy_version,
                "version_file": version_file,
                # SGLang uses batch_get_v1 / batch_set_v1 (whole pages by host index) for a dynamic
                # backend only with this flag; else batch_get / batch_set (cache_controller.py:646-665).
                "interface_v1": 1,
            }),
        )
    return kw


def _update_message(result: Any) -> str:
    """The message of an update_weights_from_disk result ((success, message, ...) or an object)."""
    if isinstance(result, tuple):
        return str(result[1]) if len(result) > 1 else ""
    return str(getattr(result, "message", ""))


def _update_succeeded(result: Any) -> bool:
    """Whether update_weights_from_disk loaded the weights. 0.5.23 returns (success, message,
    num_paused_requests) (managers/tokenizer_manager.py:2288-2320). success=False with SGLang's
    "Weights were updated, but ... not flushed" message (weight_updater.py:127-132) is a success:
    the new weights are in, only its flush was refused."""
    if isinstance(result, tuple):
        ok, message = bool(result[0]), str(result[1]) if len(result) > 1 else ""
    else:
        ok, message = bool(getattr(result, "success", True)), str(getattr(result, "message", ""))
    return ok or message.startswith(_LOADED_NOT_FLUSHED)


@dataclass(frozen=True)
class StreamDelta:
    token_ids: list[int]
    logprobs: list[float]
    reason: FinishReason | None
    total: int  # completion tokens so far
    # The SEER plugin's counts for this output's tokens (its per-output-token values, which come
    # with every output; see stream_delta), not SGLang's final-output-only speculation counts.
    accepted: int  # draft tokens accepted among them
    proposed: int  # real draft tokens proposed for them


# What an attempt that failed, or whose stream ended without a finish reason, reports: no tokens and
# an abort. Shared; its (empty) lists are only ever read.
_ABORTED = StreamDelta([], [], FinishReason.ABORTED, 0, 0, 0)


def stream_delta(out: Mapping[str, Any], reported: int) -> StreamDelta:
    """The new tokens of one streamed SGLang output (BatchTokenIDOutput with skip_tokenizer_init,
    managers/tokenizer_manager.py:2674-2708). Tokens come from out["output_ids"]: cumulative by
    default, the delta with incremental_streaming_output; the cumulative completion_tokens count
    says which are new either way. Logprobs come from meta_info["output_token_logprobs"] ((logprob,
    token id, text) entries, cumulative or sliced alike); SGLang 0.5.23 fills them under speculation
    too (batch_result_processor.py:1161-1170), but a token without its logprob is an error
    (MissingLogprobs), never a silently shorter list. SGLang's own speculation counts
    (spec_num_correct_drafts, spec_num_proposed_drafts) are in the final output only
    (tokenizer_manager.py:2742-2756), and its spec_num_proposed_drafts is its verify block capacity,
    verify steps x (num_draft_tokens - 1) (tokenizer_manager.py:3156-3158), padding included. The
    counts reported are the SEER plugin's instead: the real draft tokens of each verify step and the
    accepted ones among them, which it files in customized_info one value per output token
    (plugin.record_step) and SGLang accumulates into meta_info[plugin.DRAFT_INFO_KEY] (the whole
    list by default, the chunk's slice with incremental_streaming_output). As with logprobs, the
    values of the new tokens are the list's last `fresh` ones in either mode, so each chunk reports
    the drafts of its own tokens (the final output alone carried only its own slice when streaming
    incrementally). Without them (not SEER's worker), no drafts are reported rather than the block
    capacity."""
    meta: Mapping[str, Any] = out.get("meta_info") or {}
    # Only the last `fresh` entries of each list are new; SGLang streams them cumulatively by
    # default, so the lists are sliced before anything is converted or copied (converting whole
    # lists made every request O(n^2) on the SGLang loop thread).
    raw_ids = out.get("output_ids") or []
    total = int(meta.get("completion_tokens", reported + len(raw_ids)))
    fresh = max(total - reported, 0)
    if fresh > len(raw_ids):
        raise MissingLogprobs(f"output_ids: {len(raw_ids)} tokens for {fresh} new completion tokens")
    new = [int(t) for t in raw_ids[len(raw_ids) - fresh:]] if fresh else []
    entries = meta.get("output_token_logprobs") or []
    if len(entries) < fresh:
        raise MissingLogprobs(f"output_token_logprobs: {len(entries)} entries for {fresh} new tokens")
    lps = list(entries[len(entries) - fresh:]) if fresh else []
    for k, (e, t) in enumerate(zip(lps, new, strict=True)):
        if int(e[1]) != t:
            raise MissingLogprobs(f"output_token_logprobs[{k}]: token {e[1]} is not the output token {t}")
    fr = meta.get("finish_reason")
    reason = _FINISH.get(str(fr.get("type", "")), FinishReason.STOP) if isinstance(fr, dict) else None
    drafts = meta.get(plugin.DRAFT_INFO_KEY) or []
    # A shorter list (or none) only without SEER's worker or for an ungrouped request (never
    # drafted for, so it has no list): open_step_info files a grouped request's list before the
    # prefill's token is streamed, so every output carries its value. The values present are the
    # newest tokens'.
    mine = list(drafts[len(drafts) - min(fresh, len(drafts)):]) if fresh else []
    accepted, proposed = plugin.draft_totals(mine)
    return StreamDelta(new, [float(e[0]) for e in lps], reason, total, accepted, proposed)


def attempt_rid(attempt: int, request_id: str) -> str:
    """SGLang's id of one attempt: '<attempt>#<request id>'. SGLang's scheduler aborts every request
    whose rid STARTS WITH the aborted one (req.rid.startswith(recv_req.rid), managers/scheduler.py:
    5688, 5798): with '<request id>#<attempt>' the abort of 'r#1' also hit a live retry 'r#12'.
    These ids are prefix-free: the digits before the first '#' decide the attempt, and attempt
    numbers are unique in the process, so one id is a prefix of another only if they are equal."""
    return f"{attempt}#{request_id}"


@dataclass
class _Live:
    req: GenerateRequest
    # SGLang's id of this attempt (attempt_rid): an attempt number plus the request id. SGLang
    # refuses an id it still holds ("Duplicate request ID detected", managers/tokenizer_manager.py:
    # 3836), and after an abort it holds it until the scheduler's abort output comes back, so a
    # retry of the same request on this worker (group affinity makes that the usual place) would
    # fail at once.
    rid: str = ""
    tokens: list[int] = field(default_factory=list)
    reported: int = 0  # completion tokens already turned into step outputs
    # The generate task (run_coroutine_threadsafe's future): abort cancels it. SGLang's abort_request
    # alone is lost while the task has not run yet (the rid is unknown to the tokenizer manager
    # until generate_request starts, tokenizer_manager.py:926 and 2246-2253): a zombie request
    # generating to max_new_tokens.
    task: concurrent.futures.Future[None] | None = None


class SGLangEngine(Engine):
    def __init__(self, server_args: Mapping[str, Any], *, model_dir: Path, model_version: str,
                 version_file: str, env: Mapping[str, str] | None = None) -> None:
        from services.worker.model.config import ModelConfig

        self._mc = ModelConfig.from_dir(model_dir)
        self._model_dir = model_dir
        self._version = model_version
        self._family = _family_of(model_version)
        self._version_file = pages.VersionFile(version_file)
        self._version_file.write(parse_policy_version(model_version), self._family)
        self._page_size = int(server_args.get("page_size", 16))
        self._dtype = str(server_args.get("dtype", "bfloat16"))
        self._max_batch = int(server_args.get("max_running_requests", 0) or 0)
        # Read by the SEER plugin in SGLang's processes (spawned: they inherit the environment).
        self._speculation = server_args.get("speculative_algorithm") == plugin.ALGORITHM
        os.environ.update({**(env or {}), plugin.ENV_VOCAB_SIZE: str(self._mc.vocab_size),
                           plugin.ENV_SPECULATION: "1" if self._speculation else "0"})
        # (the attempt, its output): the attempt, not the request id, so that outputs of an aborted
        # attempt never reach a later one of the same id.
        self._out: queue.SimpleQueue[tuple[_Live, StreamDelta]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._lock = threading.Lock()
        # Set when a weight load was given up on or failed after writing weights: SGLang's weights
        # are of unknown version, so every request is answered ABORTED and no further load is
        # tried. The worker reads it (Engine.broken) after the failed load and turns its health
        # NOT_SERVING at once, so that the orchestrator restarts it.
        self._broken: str | None = None
        self._stats = {"prefill": 0, "cached": 0, "generated": 0, "steps": 0}
        # SGLang's waiting requests, as its last load snapshot read said (_read_loads).
        self._waiting = 0
        self._loads_at = float("-inf")  # when the last read was started (monotonic)
        self._loads_busy = False  # a read is in flight on the loop
        self._loads_warned = False
        # Set by shutdown (under _lock): nothing is scheduled on the loop after it, so no coroutine
        # is created that the stopped loop would never run.
        self._closed = False
        self._t0 = time.monotonic()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-loop", daemon=True)
        self._thread.start()
        self._sgl = self._call(self._create(dict(server_args)))
        self._max_context = served_context(self._sgl, int(self._mc.max_position_embeddings))
        self._total_pages = kv_pool_pages(self._sgl, self._page_size, self.max_context, self._max_batch)

    @classmethod
    def from_config(cls, cfg: WorkerConfig, model_dir: Path, model_version: str) -> SGLangEngine:
        family = _family_of(model_version)
        version_file = os.path.join(tempfile.mkdtemp(prefix="seer-sglang-"), "policy_version")
        env = {plugin.ENV_DRAFT_ADDRESS: cfg.draft_address, plugin.ENV_DRAFT_WIDTH: str(cfg.draft_width),
               plugin.ENV_GROUP_TTL: str(cfg.group_ttl_seconds)}
        backend = os.environ.get(ENV_ATTENTION_BACKEND) or None
        return cls(server_kwargs(cfg, model_dir, family, version_file, backend), model_dir=model_dir,
                   model_version=model_version, version_file=version_file, env=env)

    # -- the asyncio side ----------------------------------------------------------------------

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _create(self, kwargs: dict[str, Any]) -> Any:
        """sglang.Engine on the sglang-loop thread, inside its running loop, where its tokenizer
        manager's handle loop then lives (Engine._ensure_event_loop takes the running loop,
        entrypoints/engine.py:1404-1414). Off the main thread is supported by the pinned version:
        it installs its SIGQUIT handler only on the main thread (engine.py:1969), as the tokenizer
        manager its signal handlers (tokenizer_manager.py:2453); 0.5.4/0.5.6 raised ValueError."""
        import sglang  # type: ignore[import-not-found]

        if self._speculation:
            # SGLang's load_plugins() calls the entry point in every process (the scheduler's
            # registration is what counts); this covers a source checkout without the entry point
            # installed, for this process only.
            plugin.register()
        return sglang.Engine(**kwargs)

    async def _generate(self, live: _Live) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput  # type: ignore[import-not-found]

        # One turn of the loop before SGLang sees the request: an abort posted right behind
        # add_request cancels the task here (the cancel comes one callback after the task's start),
        # so the request never reaches SGLang; later, the cancel lands inside generate_request.
        await asyncio.sleep(0)
        req = live.req
        prefix = list(req.prompt_token_ids) + list(req.output_token_ids)
        obj = GenerateReqInput(
            input_ids=prefix,
            sampling_params={
                **sampling_dict(req.sampling, req.max_new_tokens),
                # The plugin drafts and appends for the Seer request (not SGLang's attempt id), at
                # response positions (SGLang counts output from this attempt's prefix).
                # Group values as the worker registers them: the first registration on the server
                # wins (a different prompt key or prompt is refused), and its size decides when the
                # group is complete.
                # The size as the job carries it: 0 = unknown (never turned into 1: the draft server
                # would complete the group at its first finished response). The submission (and,
                # without one, the dispatch epoch) tells the draft server this attempt's run from an
                # old one under a reused group id.
                "custom_params": plugin.custom_params(req.group_id, req.prompt_key, req.group_size,
                                                      req.is_probe, request_id=req.request_id,
                                                      output_offset=len(req.output_token_ids),
                                                      epoch=req.dispatch_epoch, submit_seq=req.submit_seq,
                                                      policy_version=req.policy_version),
            },
            return_logprob=True,
            # -1: logprobs of the output tokens only (managers/scheduler.py:3260-3264). SGLang
            # aborts a request whose logprob_start_len exceeds its input (scheduler.py:3275), and
            # 0.5.4-0.5.6 already at equal: len(prefix) aborted every chunk there.
            logprob_start_len=-1,
            stream=True,
            rid=live.rid,
            extra_key=pages.extra_key(self._family, parse_policy_version(self._version)),
        )
        rid = req.request_id
        try:
            async for out in self._sgl.tokenizer_manager.generate_request(obj, None):
                meta = out.get("meta_info", {})
                d = stream_delta(out, live.reported)
                live.reported = d.total
                if d.reason is not None and "cached_tokens" in meta:
                    self._stats["cached"] += int(meta["cached_tokens"])
                    self._stats["prefill"] += len(prefix) - int(meta["cached_tokens"])
                self._out.put((live, d))
                reason = d.reason
                if reason is not None:
                    return
        except Exception as e:  # surface as an aborted request; the worker reports it
            log.warning("sglang generate failed: %s", e, extra=kv(request_id=rid))
            self._out.put((live, _ABORTED))
            return
        # The stream ended without a finish reason (SGLang's contract is one on its last output):
        # with nothing queued the request would stay live here and its chunk would never end.
        log.warning("sglang stream ended without a finish reason", extra=kv(request_id=rid, tokens=live.reported))
        self._out.put((live, _ABORTED))

    def _poll_loads(self) -> None:
        """Starts a read of SGLang's queue length on the loop unless one is in flight or the last
        started under LOADS_INTERVAL_S ago; never waits for it."""
        now = time.monotonic()
        with self._lock:
            if (self._loads_busy or now - self._loads_at < LOADS_INTERVAL_S or self._broken is not None
                    or self._closed):  # shut down: the read would never run
                return
            self._loads_busy, self._loads_at = True, now
            # Scheduled under the lock that shutdown takes to set _closed: a read is either queued
            # on the loop before shutdown's cancel-everything (and cancelled by it) or never made.
            # (Only a queued callback: nothing runs here, so holding the lock is cheap.)
            coro = self._read_loads()
            try:
                asyncio.run_coroutine_threadsafe(coro, self._loop)
            except RuntimeError:  # the loop is closed: keep the last value
                coro.close()  # never awaited: closed here, not left to warn at garbage collection
                self._loads_busy = False

    async def _read_loads(self) -> None:
        """What TokenizerManager.get_loads() answers (managers/tokenizer_control_mixin.py:1001-1029:
        load_snapshot_reader.read_all(); its include= is ignored in 0.5.23), read in a thread:
        read_all takes the snapshot's blocking file lock, which would stall every request's stream
        on the loop while the scheduler holds it. One LoadSnapshot per scheduler (DP rank);
        num_waiting_reqs counts its waiting queue(s), requests admitted to SGLang but not yet running
        (scheduler_components/load_inquirer.py:141, load_snapshot.py:202). An empty answer (no
        snapshot published yet) keeps the last value; a failure is logged once and keeps it too."""
        try:
            loads = await asyncio.to_thread(self._sgl.tokenizer_manager.load_snapshot_reader.read_all)
            if loads:
                waiting = sum(max(0, int(getattr(ld, "num_waiting_reqs", 0) or 0)) for ld in loads)
                with self._lock:
                    self._waiting = waiting
        except Exception as e:
            if not self._loads_warned:
                self._loads_warned = True
                log.warning("SGLang's load snapshot could not be read; stats keep the last waiting count",
                            extra=kv(error=str(e)))
        finally:
            with self._lock:
                self._loads_busy = False

    # -- Engine --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self._mc.vocab_size)

    @property
    def max_context(self) -> int:
        # What SGLang's scheduler serves whole (served_context), not the model's position limit.
        return self._max_context

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self._mc.eos_token_ids)

    @property
    def model_version(self) -> str:
        return self._version

    @property
    def kv_layout(self) -> KVLayout:
        mc = self._mc
        return KVLayout(dtype=self._dtype, page_size=self._page_size,
                        num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                        layout="sglang")

    @property
    def broken(self) -> str | None:
        # Set (once, under _lock) by a load that timed out or failed after writing weights; a str
        # read needs no lock.
        return self._broken

    def add_request(self, req: GenerateRequest) -> None:
        if not req.request_id:
            raise ValueError("request_id: must not be empty")
        if not req.prompt_token_ids:
            raise ValueError("prompt_token_ids: must not be empty")
        for name, ids in (("prompt_token_ids", req.prompt_token_ids), ("output_token_ids", req.output_token_ids)):
            for i, t in enumerate(ids):
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"{name}[{i}]: token id {t} is outside the vocabulary [0, {self.vocab_size})")
        req.sampling.validate(self.vocab_size)
        total = len(req.prompt_token_ids) + len(req.output_token_ids) + req.max_new_tokens
        if req.max_new_tokens <= 0 or total > self.max_context:
            raise ValueError(f"max_new_tokens: {req.max_new_tokens} does not fit the context {self.max_context}")
        with self._lock:
            if req.request_id in self._live:
                raise ValueError(f"request_id: {req.request_id!r} is already live")
            live = self._live[req.request_id] = _Live(req, attempt_rid(next(_ATTEMPTS), req.request_id))
            if self._broken is not None or self._closed:
                # What a failed generate looks like (never a raise: the worker counts engine aborts
                # and its canary to tell a broken engine from a bad request).
                self._out.put((live, _ABORTED))
                return
            live.task = asyncio.run_coroutine_threadsafe(self._generate(live), self._loop)

    def step(self, drafts: Mapping[str, Draft] | None = None) -> list[StepOutput]:
        # Drafts are made inside SGLang by the SEER plugin; see the module docstring.
        merged: dict[str, StepOutput] = {}
        try:
            items = [self._out.get(timeout=0.01)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._out.get_nowait())
            except queue.Empty:
                break
        for live, d in items:
            toks, reason = d.token_ids, d.reason
            rid = live.req.request_id
            with self._lock:
                if self._live.get(rid) is not live:
                    # Aborted; and if the request was added again since (a retry of the same id on
                    # this worker), that is another attempt: its generate task reports its own
                    # outputs, these are the old one's (tokens queued before the abort reached
                    # SGLang, and SGLang's final "abort").
                    continue
                live.tokens += toks
                if reason is not None:
                    del self._live[rid]
            o = merged.setdefault(rid, StepOutput(rid, [], []))
            o.token_ids += toks
            o.logprobs += d.logprobs
            # The drafts of this output's tokens (stream_delta): a step's counts come with the
            # output that carries its first token.
            o.num_accepted += d.accepted
            o.num_draft_tokens += d.proposed
            if reason is not None:
                o.finished, o.finish_reason = True, reason
        self._stats["steps"] += 1
        self._stats["generated"] += sum(len(o.token_ids) for o in merged.values())
        return list(merged.values())

    def abort(self, request_id: str) -> bool:
        with self._lock:
            live = self._live.pop(request_id, None)
        if live is not None:
            # Cancelling the task: one not started yet never runs; one inside generate_request gets
            # CancelledError there, and SGLang aborts the request it dispatched
            # (_release_req_states_on_failure, tokenizer_manager.py:958-967, 3850-3869). abort_request
            # too, for a request SGLang holds (a no-op for an rid it does not know).
            if live.task is not None:
                live.task.cancel()
            self._loop.call_soon_threadsafe(self._sgl.tokenizer_manager.abort_request, live.rid)
        return live is not None

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    def request_tokens(self, request_id: str) -> tuple[int, ...]:
        with self._lock:
            live = self._live[request_id]
            return live.req.prompt_token_ids + live.req.output_token_ids + tuple(live.tokens)

    def export_kv(self, token_ids: Sequence[int], start_page: int = 0) -> KVPages:
        # HiCache writes pages through to the KV store itself; nothing to hand over.
        if start_page < 0:
            raise ValueError(f"start_page: must be >= 0, got {start_page}")
        return KVPages(self._version, self.kv_layout, (), (), ())

    def import_kv(self, pages_: KVPages) -> int:
        if pages_.model_version != self._version:
            raise ValueError(f"model_version: pages are of {pages_.model_version!r}, the engine runs {self._version!r}")
        if pages_.first_page < 0:
            raise ValueError(f"first_page: must be >= 0, got {pages_.first_page}")
        return 0  # HiCache prefetches stored prefixes from L3 on admission

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        return 0  # known only after admission (reported per request as cached_tokens)

    def load_weights(self, path: str | None, version: str) -> None:
        from sglang.srt.managers import io_struct  # type: ignore[import-not-found]

        if self._broken is not None:
            raise RuntimeError(f"load_weights: the engine is broken ({self._broken}); restart the worker")
        if self.has_unfinished():
            raise RuntimeError("load_weights: requests are live; drain them first")
        v = parse_policy_version(version)
        tm = self._sgl.tokenizer_manager
        timeout = LOAD_TIMEOUT_S

        async def switch() -> tuple[Any, Any]:
            # TokenizerManager.pause_generation(obj) / continue_generation(obj)
            # (managers/tokenizer_manager.py:2267-2286; io_struct.py:1927-1955). mode "abort" (the
            # default, explicit here) aborts what runs: nothing of ours, load_weights refuses while
            # requests are live; the pause keeps new ones out until the weights are in and flushed.
            await tm.pause_generation(io_struct.PauseGenerationReqInput(mode="abort"))
            try:
                # flush_cache=False: SGLang's own flush (the default, io_struct.py:1990) needs an idle
                # scheduler (scheduler.py:5518-5520), and an attempt aborted just before still runs
                # one decode pass (scheduler.py:5798-5812). Refused, it failed the whole call with the
                # new weights already in (weight_updater.py:120-160): the worker then kept the old
                # version, family and version file while SGLang served the new weights.
                obj = io_struct.UpdateWeightFromDiskReqInput(model_path=path or str(self._model_dir), load_format=None,
                                                             flush_cache=False)
                result = await tm.update_weights_from_disk(obj, None)
                flushed: Any = None
                if _update_succeeded(result):
                    # Deferred by SGLang until its scheduler is idle, up to timeout_s
                    # (scheduler_components/flush_wrapper.py:22-36; tokenizer_control_mixin.py:325).
                    try:
                        flushed = await tm.flush_cache(timeout_s=FLUSH_TIMEOUT_S)
                    except Exception as e:  # the weights are in either way
                        flushed = e
            except asyncio.CancelledError:
                # Given up on by load_weights' timeout: SGLang may be mid-load, its weights neither
                # the old nor the new version. Resuming would serve them under the old version's
                # name, extra key and namespace: it stays paused and the engine is broken.
                raise
            except BaseException:
                await tm.continue_generation(io_struct.ContinueGenerationReqInput())
                raise
            await tm.continue_generation(io_struct.ContinueGenerationReqInput())
            return result, flushed

        fut = asyncio.run_coroutine_threadsafe(switch(), self._loop)
        try:
            # Only the wait's own timeout is caught here: a TimeoutError raised inside switch() (an
            # OSError since 3.11, as concurrent.futures.TimeoutError is an alias of it) is SGLang's
            # failure and propagates as it is.
            done, _ = concurrent.futures.wait([fut], timeout)
        except BaseException:
            fut.cancel()
            raise
        if not done:
            fut.cancel()
            with self._lock:
                self._broken = f"SGLang did not finish loading {version!r} in {timeout:.0f}s; it is left paused"
            log.error("SGLang weight load timed out: SGLang is left paused with weights of unknown version and the "
                      "engine is broken (requests are aborted until the worker restarts)",
                      extra=kv(version=version, timeout_s=timeout))
            # Not a TimeoutError: that is an OSError, which the worker reports as a bad source.
            raise RuntimeError(f"load_weights: SGLang did not finish loading {version!r} in {timeout:.0f}s; "
                               "its weights are unknown and the engine is broken")
        result, flushed = fut.result()
        if not _update_succeeded(result):
            if _ROLLED_BACK in _update_message(result):
                # SGLang failed while writing the new weights in place; its "rollback" re-reads
                # model_config.model_path, which it set to the NEW path before loading
                # (ModelRunner.update_weights_from_disk), so the weights are now some mix of the
                # new checkpoint. Not a refusal (the scheduler keeps a refusing worker serving the
                # old version): the engine is broken and the worker must restart.
                with self._lock:
                    self._broken = f"SGLang failed mid-load of {version!r}; its weights are unknown"
                log.error("SGLang failed while loading weights in place; the engine is broken (requests are "
                          "aborted until the worker restarts)", extra=kv(version=version, result=str(result)))
                raise RuntimeError(f"load_weights: SGLang failed mid-load of {version!r} and its rollback reloads "
                                   f"the new path: weights unknown, the engine is broken ({result})")
            raise ValueError(f"path: SGLang refused the weights: {result}")
        if not getattr(flushed, "success", False):
            # Pages of the old weights stay in SGLang's radix cache until evicted; they are never
            # matched: requests carry the new extra key (per-extra-key radix roots) and L3 pages sit
            # under the new namespace. Memory only, not correctness.
            log.warning("SGLang did not flush its cache after the weight update; old pages are evicted on demand",
                        extra=kv(version=version, flush=str(flushed)))
        # The weights are in: switch everything that names them, whatever the flush did. The new
        # weights' family before the version: requests salt their pages with both (extra_key) and
        # the backend files them under both (namespace).
        self._family = _family_of(version)
        self._version_file.write(v, self._family)
        self._version = version
        if path:
            self._model_dir = Path(path)

    def stats(self) -> EngineStats:
        ps = self._page_size
        with self._lock:
            # A live request is either running in SGLang or in its waiting queue; the snapshot can
            # lag the live set, so neither count goes below 0 or above it.
            waiting = min(self._waiting, len(self._live))
            running = len(self._live) - waiting
            # SGLang does not expose its pool's free pages here: estimate them from the live
            # requests' contexts (its radix cache holds the rest, and it evicts that on demand).
            used = sum(-(-(len(v.req.prompt_token_ids) + len(v.req.output_token_ids) + len(v.tokens)) // ps)
                       for v in self._live.values())
        # For the next call, after this one's counts are taken: it answers with the last read at
        # once (started before the counts, a fast read could land in between, or not).
        self._poll_loads()
        elapsed = max(time.monotonic() - self._t0, 1e-6)
        return EngineStats(
            total_pages=self._total_pages, free_pages=max(0, self._total_pages - used), page_size=ps,
            running=running, waiting=waiting,
            tokens_per_second=self._stats["generated"] / elapsed, model_version=self._version,
            prefill_tokens=self._stats["prefill"], cached_tokens=self._stats["cached"],
            generated_tokens=self._stats["generated"], steps=self._stats["steps"],
            max_batch_size=self._max_batch, max_context=self.max_context,
        )

    def shutdown(self) -> None:
        """SGLang's Engine.shutdown kills the whole process tree under this process
        (kill_process_tree(os.getpid(), include_parent=False), entrypoints/engine.py:1491), not only
        its own children: nothing else the worker process started as a child survives it.

        Then the loop is torn down as asyncio.run does: every task still on it (a load read that
        stats() just started, generate streams, SGLang's own) is cancelled and waited for (bounded),
        and the loop stopped and closed. Stopping it outright left such a task pending, or its
        coroutine queued and never started ("coroutine SGLangEngine._read_loads was never awaited")."""
        with self._lock:
            first, self._closed = not self._closed, True
        try:
            self._sgl.shutdown()
        finally:
            if first:
                self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_all() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for t in tasks:
                t.cancel()
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=SHUTDOWN_TIMEOUT_S)
                if pending:
                    log.warning("SGLang's event loop stops with tasks that ignored their cancel",
                                extra=kv(tasks=len(pending)))

        try:
            self._call(cancel_all(), SHUTDOWN_TIMEOUT_S + 1.0)
        except Exception as e:  # shutting down either way
            log.warning("SGLang's event loop tasks could not be cancelled", extra=kv(error=repr(e)))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(SHUTDOWN_TIMEOUT_S)
        if not self._thread.is_alive():  # a running loop cannot be closed
            self._loop.close()

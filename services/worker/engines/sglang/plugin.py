"""The SEER speculative algorithm for SGLang 0.5.23 (pinned): grouped drafts from the Seer draft
server, verified by SGLang's own NGRAM tree verification (lossless for any draft content).

How SGLang reaches it (every citation is sglang 0.5.23's source):
- SGLang runs `load_plugins()` in every process it starts (the engine, engine.py:286; the scheduler
  subprocess, managers/scheduler.py:6323), which calls each entry point of the group
  `sglang.srt.plugins` (plugins/__init__.py:29). pyproject.toml declares ours:

    [project.entry-points."sglang.srt.plugins"]
    seer = "services.worker.engines.sglang.plugin:register"

  A registration made only in the worker's own process would be lost: the scheduler is a spawned
  subprocess. `register()` registers only when the worker configured speculation
  (ENV_SPECULATION=1, inherited by SGLang's subprocesses), so with speculation off nothing of
  sglang is imported here. If SGLANG_PLUGINS is set, it must name "seer".
- `SpeculativeAlgorithm.register(name, supports_overlap=..., validate_server_args=...,
  spec_class=...)` (speculative/spec_info.py:67) is the registry; the function
  register_speculative_algorithm of 0.5.6 was removed. Our spec class (a CustomSpecAlgo,
  speculative/spec_registry.py:25) answers is_ngram() True, so SGLang's NGRAM verify paths
  (NgramVerifyInput, CUDA-graph dummies, no draft KV) treat SEER exactly like NGRAM, and its
  handle_server_args applies what arg_groups/speculative_hook.py:_handle_ngram applies to the
  string "NGRAM" only (mixed chunk off, topk = tree width, num_steps). supports_overlap=False:
  SGLang then requires disable_overlap_schedule=True (spec_registry.py:134-141), which the worker
  passes, so req.output_ids is complete when drafts are prepared (ngram_worker.py:237-243).
- validate_server_args refuses a tree (draft width > 1) on paged KV (page_size > 1) unless the
  attention backend is flashinfer, as _handle_ngram does for NGRAM (speculative_hook.py:1356-1366).

The worker class subclasses NGRAMWorker and replaces only where drafts come from: instead of the
n-gram corpus, an embedded DraftClient (the local mirror of the groups' suffix indexes, synced from
the draft server; Seer section 4) proposes a tree per request, AdaptiveSpeculation (Seer Algorithm
1) sizes it, and services.worker.engines.sglang.drafts packs it into NGRAM's block format (root =
last verified token, BFS order, padding, ancestor mask): `_prepare_draft_tokens(batch)` returns
(tokens, mask) as NGRAMWorker's does (ngram_worker.py:232). The mirror learns a step's tokens at
the next step's prepare, where they are in req.output_ids (NGRAM's `_update_ngram_corpus` runs
inside forward, before result processing appends them, and is a no-op here), and a request's last
tokens at SGLang's finish hook (note_request_finished; else when it leaves the batch finished);
the planner learns acceptance from
`on_verify_complete_cpu` (see SeerDraftWorker). Verification samples (eagle_sample,
ngram_worker.py:479), so
T > 0 is lossless, and per-token logprobs are computed for speculative batches
(compute_spec_logprobs, ngram_worker.py:517; managers/scheduler_components/
batch_result_processor.py:1161-1170).

Per-request metadata comes in SamplingParams.custom_params (set by SGLangEngine.add_request):
seer_group_id, seer_prompt_key, seer_group_size (0 = unknown, as the job carries it), seer_is_probe,
seer_request_id (SGLang's rid is one attempt of it), seer_output_offset (how much of the response
this attempt's input already holds), seer_dispatch_epoch (the attempt's RunChunkRequest
dispatch epoch, carried by its draft registrations as the worker's own are) and seer_submit_seq
(the buffer's submission of its batch, RunChunkRequest.submit_seq, 0 = unknown: carried by the
registrations too, it tells a resubmitted batch id's new run from the old one's retry whatever the
epochs). Process-wide settings
come from the environment the worker sets before starting SGLang: SEER_SGLANG_SPECULATION,
SEER_SGLANG_DRAFT_ADDRESS, SEER_SGLANG_DRAFT_WIDTH, SEER_SGLANG_GROUP_TTL, SEER_SGLANG_VOCAB_SIZE.

The draft client's side is DraftBridge (pure; tested without SGLang): it keys the mirror by the
Seer request id at response positions, so a request's chunks and attempts extend one response,
and it resumes the mirror's copy from the committed output when it first sees an attempt (what an
abandoned attempt streamed is dropped, what earlier chunks elsewhere produced is filled in).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

ALGORITHM = "SEER"
# "1" when the worker configured speculation: the entry point registers SEER only then.
ENV_SPECULATION = "SEER_SGLANG_SPECULATION"
ENV_DRAFT_ADDRESS = "SEER_SGLANG_DRAFT_ADDRESS"
ENV_DRAFT_WIDTH = "SEER_SGLANG_DRAFT_WIDTH"
ENV_GROUP_TTL = "SEER_SGLANG_GROUP_TTL"
# The served model's vocabulary size: draft tokens outside it are dropped before they reach the GPU.
ENV_VOCAB_SIZE = "SEER_SGLANG_VOCAB_SIZE"

# The key of SEER's per-step draft counts in SGLang's Req.customized_info (see record_step).
DRAFT_INFO_KEY = "seer_drafts"

_registered: Any = None


class RequestMeta(NamedTuple):
    """What the plugin knows of one SGLang request; an empty group_id means no drafting."""

    group_id: str = ""
    prompt_key: str = ""
    # 0 = unknown: the draft server then never completes the group on its own. Turned into 1, the
    # group completed at its first finished response (the follower's RegisterGroup set the size).
    group_size: int = 0
    is_probe: bool = False
    request_id: str = ""  # the Seer request ("" = SGLang's rid)
    output_offset: int = 0  # response tokens already in the attempt's input (a resumed chunk)
    epoch: int = 0  # the attempt's dispatch epoch (0 = unordered)
    submit_seq: int = 0  # the buffer's submission of the request's batch (0 = unknown)
    # The chunk's policy version (None = unknown): the group's history iteration on the draft server.
    policy_version: int | None = None


def _version(raw: Any) -> int | None:
    """seer_policy_version as sent: absent, None or negative (a worker without it) is unknown."""
    if raw is None:
        return None
    v = int(raw)
    return v if v >= 0 else None


def request_meta(custom_params: dict[str, Any] | None) -> RequestMeta:
    p = custom_params or {}
    return RequestMeta(str(p.get("seer_group_id", "")), str(p.get("seer_prompt_key", "")),
                       max(0, int(p.get("seer_group_size", 0) or 0)), bool(p.get("seer_is_probe", False)),
                       str(p.get("seer_request_id", "")), max(0, int(p.get("seer_output_offset", 0) or 0)),
                       max(0, int(p.get("seer_dispatch_epoch", 0) or 0)),
                       max(0, int(p.get("seer_submit_seq", 0) or 0)), _version(p.get("seer_policy_version")))


def custom_params(group_id: str, prompt_key: str, group_size: int, is_probe: bool, *, request_id: str = "",
                  output_offset: int = 0, epoch: int = 0, submit_seq: int = 0,
                  policy_version: int | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "seer_group_id": group_id, "seer_prompt_key": prompt_key, "seer_group_size": group_size,
        "seer_is_probe": is_probe, "seer_request_id": request_id, "seer_output_offset": output_offset,
        "seer_dispatch_epoch": epoch, "seer_submit_seq": submit_seq}
    if policy_version is not None:
        # Left out when unknown: 0 is the first policy version, not "unset".
        params["seer_policy_version"] = policy_version
    return params


def record_step(req: Any, proposed: int, accepted: int, tokens: int) -> None:
    """Files one verify step's real draft counts on SGLang's Req, for the worker's process.

    SGLang reports spec_num_proposed_drafts = verify steps x (num_draft_tokens - 1), the block
    capacity with SEER's padding (tokenizer_manager.py:3156-3158); only this process knows how many
    of a block's slots were drafts. Req.customized_info (schedule_batch.py:1340) is SGLang's channel
    for per-token values: the output streamer sends customized_info[key][sent:len(output_ids)] with
    each output (output_streamer.py:688-708), the tokenizer manager accumulates them into
    meta_info[key] (tokenizer_manager.py:2812-2821) and, with incremental_streaming_output, slices
    that by token position (_slice_streaming_output_meta_info, :364-374). So the list must line up
    with output_ids, one value per token: the pair goes at the step's first new token (len(output_ids)
    now: on_verify_complete_cpu runs before the step's tokens are appended, batch_result_processor.py:
    804 vs 1046) and None at each of its other `tokens` - 1 (the step appends accept_lens = accepted
    drafts + 1 tokens, :817, 1046). A list shorter than output_ids lost the pairs of a stream's later
    chunks (the slice came back empty). A stop inside the step needs no cap here: SGLang sends only
    output_ids[:finished_len] (output_ids_through_stop, output_streamer.py:490, schedule_batch.py:
    1511), which keeps the step's first token (finished_len > len(output_ids) before the step), and
    slices the values to it; a step that appended fewer tokens (grammar truncation) leaves extra
    Nones that the next step's entry overwrites (it goes at len(output_ids) again)."""
    info = getattr(req, "customized_info", None)
    if info is None:
        info = req.customized_info = {}
    values = info.setdefault(DRAFT_INFO_KEY, [])
    at = len(req.output_ids)
    del values[at:]
    values.extend([None] * (at - len(values)))  # tokens no verify step filed (the prefill's)
    values.append((int(proposed), int(accepted)))
    values.extend([None] * max(int(tokens) - 1, 0))


def open_step_info(req: Any) -> None:
    """Gives a request its draft list before its prefill's token is streamed: None for each token
    so far and the one the prefill adds. The streamer sends a key only once the Req has it
    (output_streamer.py:688), so a list first filed at the first verify step missed the outputs
    before it on the tokenizer side, and with incremental_streaming_output, which slices the
    accumulated list by token offset, every later chunk's values were shifted off their tokens.
    An extra None (a prefill chunk adds no token) is overwritten by the next record_step. For
    grouped requests only, as record_step: an ungrouped one has no drafts and no list."""
    info = getattr(req, "customized_info", None)
    if info is None:
        info = req.customized_info = {}
    values = info.setdefault(DRAFT_INFO_KEY, [])
    values.extend([None] * (len(req.output_ids) + 1 - len(values)))


def _grouped(req: Any) -> bool:
    """Whether SEER drafts for an SGLang request (its custom_params name a group)."""
    return bool(request_meta(getattr(req.sampling_params, "custom_params", None)).group_id)


def draft_totals(values: Sequence[Any] | None) -> tuple[int, int]:
    """(accepted, proposed) summed over record_step's entries (None and other padding skipped);
    (0, 0) when there are none (speculation off, or not SEER's worker)."""
    accepted = proposed = 0
    for v in values or ():
        if isinstance(v, list | tuple) and len(v) == 2:
            proposed += int(v[0])
            accepted += int(v[1])
    return accepted, proposed


class DraftSink(Protocol):
    """The part of services.worker.draft_client.DraftClient the bridge uses."""

    def register_attempt(self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], group_size: int,
                         ttl_seconds: int = 3600, *, request_id: str = "", epoch: int = 0,
                         submit_seq: int = 0, policy_version: int | None = None) -> None: ...

    def resume(self, group_id: str, request_id: str, output_token_ids: Sequence[int], epoch: int = 0, *,
               submit_seq: int = 0) -> None: ...

    def append(self, group_id: str, request_id: str, offset: int, token_ids: Sequence[int],
               finished: bool = False, truncate: bool = False, *, epoch: int = 0, submit_seq: int = 0) -> None: ...

    def end(self, group_id: str, request_id: str, *, epoch: int = 0, submit_seq: int = 0) -> None: ...

    def propose(self, group_id: str, request_id: str, context: Sequence[int], max_len: int,
                width: int = 1) -> Any: ...


@dataclass
class _Attempt:
    meta: RequestMeta
    request_id: str
    appended: int = 0  # of this attempt's output_ids, already appended


class DraftBridge:
    """SGLang's requests (one rid per attempt; output counted from the attempt's own input) onto
    the draft client's responses (one per Seer request, at response positions). Not thread-safe:
    SGLang's scheduler calls it from its one loop."""

    def __init__(self, client: DraftSink, ttl_seconds: int = 3600) -> None:
        self.client = client
        self.ttl_seconds = ttl_seconds
        self._attempts: dict[str, _Attempt] = {}

    def _attempt(self, rid: str, meta: RequestMeta, origin_input_ids: Sequence[int]) -> _Attempt:
        a = self._attempts.get(rid)
        if a is None:
            # First sight of this attempt: its input is the prompt + the committed output.
            split = max(0, len(origin_input_ids) - meta.output_offset)
            a = self._attempts[rid] = _Attempt(meta, meta.request_id or rid)
            # With the attempt's submission and dispatch epoch, as the worker registers it: without
            # both (0) the draft server cannot tell this run's attempt from an old run under a reused
            # group id; with the epoch alone, not after the scheduler's clock went back. And with its
            # policy version, as the worker registers it: this follower's RegisterGroup may reach
            # the draft server first, and the group's first version is its history iteration there.
            self.client.register_attempt(meta.group_id, meta.prompt_key, origin_input_ids[:split], meta.group_size,
                                         self.ttl_seconds, request_id=a.request_id, epoch=meta.epoch,
                                         submit_seq=meta.submit_seq, policy_version=meta.policy_version)
            # Every call for an attempt names it (its dispatch epoch and submission): SGLang holds two
            # rids of one request at once (the re-dispatched chunk's and the aborted one, still in
            # the batch) and drops them in any order, so the client must know which attempt ends,
            # and which one a late token is of (an abandoned attempt's is dropped, not sent as the
            # newer one's).
            self.client.resume(meta.group_id, a.request_id, origin_input_ids[split:], epoch=meta.epoch,
                               submit_seq=meta.submit_seq)
        return a

    def propose(self, rid: str, meta: RequestMeta, origin_input_ids: Sequence[int], output_ids: Sequence[int],
                max_len: int, width: int) -> Any:
        """A draft for the request's next tokens (None: none), from its whole context."""
        a = self._attempt(rid, meta, origin_input_ids)
        return self.client.propose(meta.group_id, a.request_id, [*origin_input_ids, *output_ids], max_len, width)

    def verified(self, rid: str, meta: RequestMeta, origin_input_ids: Sequence[int], output_ids: Sequence[int],
                 finished: bool) -> int:
        """Appends the attempt's tokens not appended yet; returns how many there were."""
        a = self._attempt(rid, meta, origin_input_ids)
        new = list(output_ids[a.appended :])
        if new:
            offset = meta.output_offset + a.appended
            self.client.append(meta.group_id, a.request_id, offset, new, finished, epoch=a.meta.epoch,
                               submit_seq=a.meta.submit_seq)
            a.appended += len(new)
        if finished:
            self._end(rid)
        return len(new)

    def forget(self, rid: str) -> None:
        """The attempt left SGLang's batch (finished, retracted or aborted): the mirror's request
        ends here (Sync deltas apply to it again). Unknown rids are ignored."""
        if rid in self._attempts:
            self._end(rid)

    def _end(self, rid: str) -> None:
        a = self._attempts.pop(rid)
        self.client.end(a.meta.group_id, a.request_id, epoch=a.meta.epoch, submit_seq=a.meta.submit_seq)

    def __len__(self) -> int:
        return len(self._attempts)


def tree_attention_backend(draft_width: int, page_size: int, attention_backend: str | None) -> str | None:
    """The attention backend SGLang must run for SEER's trees: SGLang verifies a tree (width > 1)
    on paged KV (page_size > 1) only with flashinfer (speculative_hook.py:1356-1366 for NGRAM; it
    produces wrong results elsewhere). None = no constraint; an unset backend becomes flashinfer;
    another one is refused, naming the field to change."""
    if draft_width <= 1 or page_size <= 1:
        return attention_backend
    if attention_backend in (None, "", "flashinfer"):
        return "flashinfer"
    raise ValueError(f"draft_width: {draft_width} > 1 (a draft tree) with page_size {page_size} > 1 needs "
                     f"SGLang's flashinfer attention backend, not {attention_backend!r}; set draft_width=1 "
                     "or page_size=1, or use flashinfer")


def ngram_server_args(gamma_max: int, draft_width: int) -> dict[str, Any]:
    """The server args SGLang's _handle_ngram sets for "NGRAM" (speculative_hook.py:1285-1330), which
    a registered algorithm does not get, plus what supports_overlap=False requires: synchronous
    scheduling (spec_registry.py:134-141). The worker passes them; the spec class applies them too
    (for SGLang launched by hand with --speculative-algorithm SEER)."""
    n = gamma_max + 1
    width = max(1, draft_width)
    return {
        "speculative_num_draft_tokens": n,
        "speculative_eagle_topk": width,
        "speculative_num_steps": max(1, n // width),
        "speculative_ngram_max_bfs_breadth": width,
        "disable_overlap_schedule": True,
        "enable_mixed_chunk": False,
    }


def register() -> Any:
    """The entry point (SGLang calls it in every process it starts): registers SEER once per
    process when the worker configured speculation; returns the registered algorithm (None when
    speculation is off)."""
    global _registered
    if _registered is not None:
        return _registered
    if os.environ.get(ENV_SPECULATION) != "1":
        return None
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # type: ignore[import-not-found]

    try:  # registered already in this process (register_algorithm refuses a second one)
        _registered = SpeculativeAlgorithm.from_string(ALGORITHM)
        return _registered
    except ValueError:
        pass
    SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=False, validate_server_args=_validate_server_args,
                                  spec_class=_spec_class())(_worker_factory)
    _registered = SpeculativeAlgorithm.from_string(ALGORITHM)
    return _registered


def _validate_server_args(server_args: Any) -> None:
    """SGLang's validate_server_args hook (speculative_hook.py:245-250). It runs before
    handle_server_args, so the tree guard is repeated there on the width that sets.

    Tensor parallelism is refused: every TP rank runs its own SeerDraftWorker with its own draft
    mirror, synced on its own schedule, so ranks could propose different drafts for the same step
    and verify diverging token blocks."""
    tp = int(getattr(server_args, "tp_size", None) or 1)
    if tp > 1:
        raise ValueError(f"tp_size: {tp} > 1 is not supported with speculative_algorithm {ALGORITHM} (each "
                         "tensor-parallel rank would draft from its own mirror and ranks could disagree); run "
                         "tp_size=1 or turn speculation off")
    tree_attention_backend(int(getattr(server_args, "speculative_eagle_topk", None) or 1),
                           int(getattr(server_args, "page_size", None) or 1),
                           getattr(server_args, "attention_backend", None) or "")


def _worker_factory(server_args: Any) -> type:
    """SGLang's worker factory (CustomSpecAlgo.create_worker calls it with the server args)."""
    return _worker_class()


def _spec_class() -> type:
    # spec_info re-exports CustomSpecAlgo (spec_info.py:10-16); spec_registry is SGLang-internal.
    from sglang.srt.speculative.spec_info import CustomSpecAlgo  # type: ignore[import-not-found]

    class SeerSpecAlgo(CustomSpecAlgo):  # type: ignore[misc,valid-type]
        """SEER is NGRAM to SGLang's verify paths; only its drafts come from elsewhere."""

        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False  # as NGRAM: the tree lives only in the verify mask (spec_info.py:174-178)

        def handle_server_args(self, server_args: Any) -> None:
            # SGLang hands a recorder whose field writes it declares (arg_groups/overrides.py:157).
            n = int(getattr(server_args, "speculative_num_draft_tokens", None) or 0)
            width = int(os.environ.get(ENV_DRAFT_WIDTH, "1") or 1)
            for name, value in ngram_server_args(max(n - 1, 0), width).items():
                if name != "speculative_num_draft_tokens" or not n:
                    setattr(server_args, name, value)
            # SGLang runs validate_server_args before this hook (speculative_hook.py:245-250 vs
            # 271-284), when a hand-launched SEER may not have its tree width yet: the tree guard
            # again, on the width just set (an unset backend becomes flashinfer, another refused).
            backend = tree_attention_backend(width, int(getattr(server_args, "page_size", None) or 1),
                                             getattr(server_args, "attention_backend", None) or None)
            if backend and backend != getattr(server_args, "attention_backend", None):
                server_args.attention_backend = backend

        # Three methods only the built-in SpeculativeAlgorithm has (not CustomSpecAlgo,
        # spec_registry.py:26-175), which the scheduler calls on every start whatever the algorithm:
        # init_disaggregation (managers/scheduler.py:1540), init_overlap (scheduler.py:1681) and
        # FutureMap (managers/overlap_utils.py:381). Without them the scheduler died at startup
        # with AttributeError. Each answers what SpeculativeAlgorithm.NGRAM answers (spec_info.py).

        def carries_draft_hidden_states(self) -> bool:
            return False  # EAGLE family only (spec_info.py:180-183): no draft model here

        def need_topk(self) -> bool:
            return False  # EAGLE / STANDALONE only (spec_info.py:232-233)

        def create_future_map(self, device: Any, req_to_token_pool: Any, needs_cpu_seq_lens: bool = True,
                              needs_confidence_relay: bool = False) -> Any:
            # As SpeculativeAlgorithm.create_future_map (spec_info.py:185-200).
            from sglang.srt.managers.overlap_utils import FutureMap  # type: ignore[import-not-found]

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    return SeerSpecAlgo


def _worker_class() -> type:
    import numpy as np
    from sglang.srt.speculative.ngram_worker import NGRAMWorker  # type: ignore[import-not-found]

    from services.worker.adaptive import AdaptiveSpeculation
    from services.worker.draft_client import DraftClient
    from services.worker.engines.sglang.drafts import Block, accepted_drafts, block_depth, pack_blocks, to_block

    class SeerDraftWorker(NGRAMWorker):  # type: ignore[misc,valid-type]
        """NGRAMWorker with drafts from the Seer draft client instead of the n-gram cache.

        When the draft mirror learns a request's tokens follows SGLang's synchronous order
        (disable_overlap_schedule, which supports_overlap=False requires), one decode step being:
          1. forward_batch_generation -> _prepare_draft_tokens: drafts from req.output_ids, which
             holds every token verified so far (ngram_worker.py:237-243);
          2. verify (eagle_sample, ngram_worker.py:479); NGRAM's corpus update (:527) runs here,
             before this step's tokens reach the request;
          3. result processing: on_verify_complete_cpu with this step's per-request accepted-draft
             counts (batch_result_processor.py:803), then req.output_ids.extend and the finish
             state (:1046-1047).
        So the tokens of step k are appended at step k+1's prepare (the first place they are in
        output_ids), a request's last tokens at note_request_finished (or, as a fallback, when it
        is seen to have left the batch finished: its finish is known by then), and the planner
        learns step k's acceptance at step k's on_verify_complete_cpu, paired with step k's
        proposals."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # A follower: the worker's own client writes these requests' tokens to the server.
            self.seer_drafts = DraftBridge(DraftClient(os.environ.get(ENV_DRAFT_ADDRESS) or None, follower=True),
                                           int(float(os.environ.get(ENV_GROUP_TTL, "3600"))))
            self.seer_planner = AdaptiveSpeculation(None, gamma_max=max(self.draft_token_num - 1, 0))
            self.seer_width = int(os.environ.get(ENV_DRAFT_WIDTH, "1"))
            self.seer_vocab_size = int(os.environ.get(ENV_VOCAB_SIZE, "0")) or None
            self.seer_proposed: dict[str, int] = {}  # rid -> draft depth proposed this step
            self.seer_step_reqs: list[Any] = []  # this step's decode batch's Req objects, in batch order
            # rid -> this step's verify block for it (Block.real: the draft tokens it holds before
            # padding, what the worker reports as proposed, not SGLang's block capacity; the
            # tokens and parents tell an accepted draft node from an accepted padding node).
            self.seer_blocks: dict[str, Block] = {}
            # The last forward's GenerationBatchResult: its next_token_ids hold each request's
            # accepted tokens (predict[accept_index], ngram_worker.py:494-500), on the CPU by
            # on_verify_complete_cpu (copy_to_cpu, managers/utils.py:201; asserted in
            # _resolve_spec_v2_tokens, batch_result_processor.py:776).
            self.seer_result: Any = None
            # rid -> Req of the grouped requests of the last decode batch: the ones the mirror
            # follows, until they are seen to have left (finished, retracted or aborted).
            self.seer_running: dict[str, Any] = {}

        def forward_batch_generation(self, batch: Any, on_publish: Any = None, pp_proxy_tensors: Any = None) -> Any:
            self._seer_departures(batch)
            if not batch.forward_mode.is_decode():
                for req in batch.reqs:  # prefill (extend): before its token is streamed
                    # Grouped requests only: an ungrouped one is never drafted for, so a list of
                    # Nones and (0, 0)s only added a key to each of its outputs (no drafts either way).
                    if _grouped(req):
                        open_step_info(req)
            self.seer_result = None
            result = super().forward_batch_generation(batch, on_publish=on_publish, pp_proxy_tensors=pp_proxy_tensors)
            self.seer_result = result
            return result

        def _seer_departures(self, batch: Any) -> None:
            """Requests of the last decode batch that are not in this one. Finished: their last
            tokens are appended and the mirror's request ends (through the stop token: SGLang may
            have verified past it, schedule_batch.py:1509). Not finished, and this is a decode batch:
            retracted (or aborted), forgotten; a retracted one seen again resumes from its
            committed output. An extend batch does not hold the running requests, so only finished
            ones leave at one; the others are settled at the next decode batch."""
            present = {r.rid for r in batch.reqs}
            decode = bool(batch.forward_mode.is_decode())
            for rid, req in list(self.seer_running.items()):
                if rid in present:
                    continue
                if req.finished():
                    self._seer_settle(rid, req)
                elif decode:
                    self.seer_drafts.forget(rid)
                    del self.seer_running[rid]

        def _seer_settle(self, rid: str, req: Any) -> None:
            """A finished request's last tokens to the mirror, and its mirror request ends (through
            the stop token: SGLang may have verified past it, schedule_batch.py:1509)."""
            meta = request_meta(getattr(req.sampling_params, "custom_params", None))
            # An abort is no end of the response (the request goes on elsewhere).
            aborted = type(req.finished_reason).__name__ == "FINISH_ABORT"
            self.seer_drafts.verified(rid, meta, req.origin_input_ids, req.output_ids_through_stop, not aborted)
            self.seer_drafts.forget(rid)
            self.seer_running.pop(rid, None)

        def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
            """SGLang's hook at a request's finish (batch_result_processor.py:1441-1444, after its
            output_ids took the step's tokens): settled here, at once, instead of at the next
            forward (an idle scheduler has none for a while); _seer_departures stays the fallback
            for a release without the hook."""
            req = self.seer_running.get(rid)
            if req is not None and req.finished():
                self._seer_settle(rid, req)
            parent = getattr(super(), "note_request_finished", None)
            if callable(parent):
                parent(rid=rid, natural_stop=natural_stop)

        def _prepare_draft_tokens(self, batch: Any) -> tuple[np.ndarray, np.ndarray]:
            metas = [request_meta(getattr(r.sampling_params, "custom_params", None)) for r in batch.reqs]
            # The last step's tokens: in output_ids since its result processing (see the class doc).
            self.seer_running = {}
            for req, meta in zip(batch.reqs, metas, strict=True):
                if meta.group_id:
                    self.seer_drafts.verified(req.rid, meta, req.origin_input_ids, req.output_ids, False)
                    self.seer_running[req.rid] = req
            self.seer_step_reqs = list(batch.reqs)
            plan = self.seer_planner.plan([(r.rid, m.is_probe) for r, m in zip(batch.reqs, metas, strict=True)])
            blocks: list[Block] = []
            self.seer_proposed = {}
            self.seer_blocks = {}
            for req, meta in zip(batch.reqs, metas, strict=True):
                last = int(req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1])
                n = min(int(plan.get(req.rid, 0)), self.draft_token_num - 1)
                d = None
                if meta.group_id and n > 0:
                    d = self.seer_drafts.propose(req.rid, meta, req.origin_input_ids, req.output_ids, n,
                                                 self.seer_width)
                block = to_block(d, last, self.draft_token_num, self.seer_vocab_size)
                blocks.append(block)
                self.seer_blocks[req.rid] = block
                # The depth of the block actually verified, not of the raw draft: to_block drops
                # out-of-vocabulary nodes (with their subtrees) and cuts at draft_token_num - 1.
                if block.real:
                    self.seer_proposed[req.rid] = block_depth(block)
            return pack_blocks(blocks, self.draft_token_num)

        def _update_ngram_corpus(self, batch: Any) -> None:
            """NGRAM's corpus update, inside forward before this step's tokens are in output_ids
            (ngram_worker.py:527): nothing to do here (SEER has no n-gram corpus; the mirror is fed
            in _prepare_draft_tokens and _seer_departures)."""

        def _seer_accepted_tokens(self, batch_size: int) -> list[int] | None:
            """This step's committed tokens, flattened [batch_size x stride] (request i's accepted
            drafts first, then its bonus token; stride as _get_speculative_output_stride,
            batch_result_processor.py:86-93); None when the last forward's result has none, or when
            their count is not a whole number of strides for batch_size (a layout this code does
            not know: the caller then counts without the tokens)."""
            result = self.seer_result
            ids = getattr(result, "next_token_ids", None)
            if ids is None or batch_size <= 0:
                return None
            flat = [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
            if len(flat) % batch_size:
                return None
            return flat

        def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
            """This step's accepted drafts per request, in batch order (batch_result_processor.py:
            804, from accept_lens - 1): to the planner with this step's proposed depths, and filed
            on each request (record_step). SGLang's count includes a padding node matched because
            the model sampled its token (0, a real token in most vocabularies); only the accepted
            path through draft nodes is counted (accepted_drafts over the committed tokens)."""
            counts = [int(n) for n in num_correct_drafts_per_req]
            if len(counts) == len(self.seer_step_reqs):
                rids = [r.rid for r in self.seer_step_reqs]
                flat = self._seer_accepted_tokens(len(counts))
                stride = len(flat) // len(counts) if flat else 0
                real_accepted: list[int] = []
                for i, (rid, n) in enumerate(zip(rids, counts, strict=True)):
                    block = self.seer_blocks.get(rid)
                    if block is None or block.real == 0 or n <= 0:
                        real_accepted.append(0)  # no draft: a padding match only
                    elif flat is not None and n <= stride:
                        real_accepted.append(accepted_drafts(block, flat[i * stride : i * stride + n]))
                    else:
                        # No committed tokens to walk (not seen with 0.5.23): a path of 2 or more
                        # is real (padding nodes are leaves under the root), a single match is
                        # not counted, as it may be padding's.
                        real_accepted.append(n if n >= 2 else 0)
                positions = max(self.draft_token_num - 1, 1)
                proposed = [0] * positions
                accepted = [0] * positions
                for rid, k in zip(rids, real_accepted, strict=True):
                    depth = self.seer_proposed.get(rid, 0)
                    for j in range(min(depth, positions)):
                        proposed[j] += 1
                    for j in range(min(k, depth, positions)):
                        accepted[j] += 1
                self.seer_planner.observe(proposed, accepted)
                for req, n, k in zip(self.seer_step_reqs, counts, real_accepted, strict=True):
                    # As SGLang counts spec_verify_ct: not for a retracted or finished request
                    # (batch_result_processor.py:819-835); the step appends n + 1 tokens (accept_lens).
                    # Not for an ungrouped request either (never drafted for: see open_step_info's
                    # caller); a list first filed here would also miss its earlier outputs.
                    if getattr(req, "is_retracted", False) or req.finished() or not _grouped(req):
                        continue
                    block = self.seer_blocks.get(req.rid)
                    real = block.real if block is not None else 0
                    record_step(req, real, min(k, real), n + 1)
            super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size=batch_size)

    return SeerDraftWorker

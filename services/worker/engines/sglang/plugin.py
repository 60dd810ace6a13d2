"""The SEER speculative algorithm for SGLang: grouped drafts from the Seer draft server, verified by
SGLang's own NGRAM tree verification (lossless for any draft content).

SGLang loads general plugins from the `sglang.srt.plugins` entry point group in every process:

    [project.entry-points."sglang.srt.plugins"]
    seer = "services.worker.engines.sglang.plugin:register"

`register()` adds the algorithm "SEER" (flag NGRAM, so SGLang's scheduler, attention backends and
verify path treat it exactly like NGRAM) whose draft worker subclasses NGRAMWorker and replaces only
where drafts come from: instead of the local n-gram cache, an embedded DraftClient (the local mirror
of the groups' suffix indexes, synced from the draft server; Seer section 4) proposes a tree per
request, AdaptiveSpeculation (Seer Algorithm 1) sizes it, and services.worker.engines.sglang.drafts
packs it into NGRAM's block format (root = last verified token, BFS order, padding, ancestor mask).
After verification the newly accepted tokens are appended to the draft client.

Per-request metadata comes in SamplingParams.custom_params (set by SGLangEngine.add_request):
seer_group_id, seer_prompt_key, seer_group_size, seer_is_probe, seer_request_id (SGLang's rid is
one attempt of it) and seer_output_offset (how much of the response this attempt's input already
holds). Process-wide settings come from the environment the worker sets before starting SGLang:
SEER_SGLANG_DRAFT_ADDRESS, SEER_SGLANG_DRAFT_WIDTH.

The draft client's side is DraftBridge (pure; tested without SGLang): it keys the mirror by the
Seer request id at response positions, so a request's chunks and attempts extend one response,
and it resumes the mirror's copy from the committed output when it first sees an attempt (what an
abandoned attempt streamed is dropped, what earlier chunks elsewhere produced is filled in).

Run SGLang with --speculative-algorithm SEER --speculative-num-draft-tokens <gamma_max + 1>.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

ALGORITHM = "SEER"
ENV_DRAFT_ADDRESS = "SEER_SGLANG_DRAFT_ADDRESS"
ENV_DRAFT_WIDTH = "SEER_SGLANG_DRAFT_WIDTH"
ENV_GROUP_TTL = "SEER_SGLANG_GROUP_TTL"
# The served model's vocabulary size: draft tokens outside it are dropped before they reach the GPU.
ENV_VOCAB_SIZE = "SEER_SGLANG_VOCAB_SIZE"

_registered: Any = None


class RequestMeta(NamedTuple):
    """What the plugin knows of one SGLang request; an empty group_id means no drafting."""

    group_id: str = ""
    prompt_key: str = ""
    group_size: int = 1
    is_probe: bool = False
    request_id: str = ""  # the Seer request ("" = SGLang's rid)
    output_offset: int = 0  # response tokens already in the attempt's input (a resumed chunk)


def request_meta(custom_params: dict[str, Any] | None) -> RequestMeta:
    p = custom_params or {}
    return RequestMeta(str(p.get("seer_group_id", "")), str(p.get("seer_prompt_key", "")),
                       int(p.get("seer_group_size", 1) or 1), bool(p.get("seer_is_probe", False)),
                       str(p.get("seer_request_id", "")), max(0, int(p.get("seer_output_offset", 0) or 0)))


def custom_params(group_id: str, prompt_key: str, group_size: int, is_probe: bool, *, request_id: str = "",
                  output_offset: int = 0) -> dict[str, Any]:
    return {"seer_group_id": group_id, "seer_prompt_key": prompt_key, "seer_group_size": group_size,
            "seer_is_probe": is_probe, "seer_request_id": request_id, "seer_output_offset": output_offset}


class DraftSink(Protocol):
    """The part of services.worker.draft_client.DraftClient the bridge uses."""

    def register_group(self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], group_size: int,
                       ttl_seconds: int = 3600) -> None: ...

    def resume(self, group_id: str, request_id: str, output_token_ids: Sequence[int], epoch: int = 0) -> None: ...

    def append(self, group_id: str, request_id: str, offset: int, token_ids: Sequence[int],
               finished: bool = False, truncate: bool = False) -> None: ...

    def end(self, group_id: str, request_id: str) -> None: ...

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
            self.client.register_group(meta.group_id, meta.prompt_key, origin_input_ids[:split], meta.group_size,
                                       self.ttl_seconds)
            self.client.resume(meta.group_id, a.request_id, origin_input_ids[split:])
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
            self.client.append(meta.group_id, a.request_id, meta.output_offset + a.appended, new, finished)
            a.appended += len(new)
        if finished:
            self._end(rid)
        return len(new)

    def prune(self, live_rids: Sequence[str]) -> None:
        """Forgets attempts that are not running (aborted, or retracted by SGLang: one seen again is
        resumed from its committed output and appended from there, idempotently)."""
        keep = set(live_rids)
        for rid in [r for r in self._attempts if r not in keep]:
            self._end(rid)

    def _end(self, rid: str) -> None:
        a = self._attempts.pop(rid)
        self.client.end(a.meta.group_id, a.request_id)

    def __len__(self) -> int:
        return len(self._attempts)


def register() -> Any:
    """The entry point: registers SEER once per process; returns the SpeculativeAlgorithm."""
    global _registered
    if _registered is not None:
        return _registered
    from sglang.srt.speculative.spec_info import register_speculative_algorithm  # type: ignore[import-not-found]

    _registered = register_speculative_algorithm(ALGORITHM, _worker_class(), flags=("NGRAM",))
    return _registered


def _worker_class() -> type:
    import numpy as np
    from sglang.srt.speculative.ngram_worker import NGRAMWorker  # type: ignore[import-not-found]

    from services.worker.adaptive import AdaptiveSpeculation
    from services.worker.draft_client import DraftClient
    from services.worker.engines.sglang.drafts import pack_batch

    class SeerDraftWorker(NGRAMWorker):  # type: ignore[misc,valid-type]
        """NGRAMWorker with drafts from the Seer draft client instead of the n-gram cache."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # A follower: the worker's own client writes these requests' tokens to the server.
            self.seer_drafts = DraftBridge(DraftClient(os.environ.get(ENV_DRAFT_ADDRESS) or None, follower=True),
                                           int(float(os.environ.get(ENV_GROUP_TTL, "3600"))))
            self.seer_planner = AdaptiveSpeculation(None, gamma_max=max(self.draft_token_num - 1, 0))
            self.seer_width = int(os.environ.get(ENV_DRAFT_WIDTH, "1"))
            self.seer_vocab_size = int(os.environ.get(ENV_VOCAB_SIZE, "0")) or None
            self.seer_proposed: dict[str, int] = {}  # rid -> draft depth proposed this step

        def _prepare_draft_tokens(self, batch: Any) -> tuple[np.ndarray, np.ndarray]:
            metas = [request_meta(getattr(r.sampling_params, "custom_params", None)) for r in batch.reqs]
            plan = self.seer_planner.plan([(r.rid, m.is_probe) for r, m in zip(batch.reqs, metas, strict=True)])
            drafts: list[Any] = []
            last_tokens: list[int] = []
            self.seer_proposed = {}
            for req, meta in zip(batch.reqs, metas, strict=True):
                last_tokens.append(int(req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]))
                n = min(int(plan.get(req.rid, 0)), self.draft_token_num - 1)
                if not meta.group_id or n <= 0:
                    drafts.append(None)
                    continue
                d = self.seer_drafts.propose(req.rid, meta, req.origin_input_ids, req.output_ids, n, self.seer_width)
                drafts.append(d)
                if d is not None:
                    depth = [0] * len(d.tokens)
                    for i, p in enumerate(d.parents):
                        depth[i] = 0 if p < 0 else depth[p] + 1
                    self.seer_proposed[req.rid] = max(depth) + 1
            return pack_batch(drafts, last_tokens, self.draft_token_num, self.seer_vocab_size)

        def _update_ngram_cache(self, batch: Any) -> None:
            proposed = [0] * max(self.draft_token_num - 1, 1)
            accepted = [0] * len(proposed)
            for req in batch.reqs:
                meta = request_meta(getattr(req.sampling_params, "custom_params", None))
                depth = self.seer_proposed.get(req.rid, 0)
                if not meta.group_id:
                    continue
                n_new = self.seer_drafts.verified(req.rid, meta, req.origin_input_ids, req.output_ids,
                                                  bool(req.finished()))
                for i in range(min(depth, len(proposed))):
                    proposed[i] += 1
                for i in range(min(max(n_new - 1, 0), depth, len(accepted))):
                    accepted[i] += 1  # all new tokens but the bonus token were accepted drafts
            if len(self.seer_drafts) > 2 * len(batch.reqs) + 64:
                self.seer_drafts.prune([r.rid for r in batch.reqs])  # aborted attempts
            self.seer_planner.observe(proposed, accepted)

    return SeerDraftWorker

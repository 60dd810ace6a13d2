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
seer_group_id, seer_prompt_key, seer_group_size, seer_is_probe. Process-wide settings come from the
environment the worker sets before starting SGLang: SEER_SGLANG_DRAFT_ADDRESS, SEER_SGLANG_DRAFT_WIDTH.

Run SGLang with --speculative-algorithm SEER --speculative-num-draft-tokens <gamma_max + 1>.
"""

from __future__ import annotations

import os
from typing import Any

ALGORITHM = "SEER"
ENV_DRAFT_ADDRESS = "SEER_SGLANG_DRAFT_ADDRESS"
ENV_DRAFT_WIDTH = "SEER_SGLANG_DRAFT_WIDTH"
ENV_GROUP_TTL = "SEER_SGLANG_GROUP_TTL"

_registered: Any = None


def request_meta(custom_params: dict[str, Any] | None) -> tuple[str, str, int, bool]:
    """(group_id, prompt_key, group_size, is_probe) of one request; empty group = no drafting."""
    p = custom_params or {}
    return (str(p.get("seer_group_id", "")), str(p.get("seer_prompt_key", "")),
            int(p.get("seer_group_size", 1) or 1), bool(p.get("seer_is_probe", False)))


def custom_params(group_id: str, prompt_key: str, group_size: int, is_probe: bool) -> dict[str, Any]:
    return {"seer_group_id": group_id, "seer_prompt_key": prompt_key, "seer_group_size": group_size,
            "seer_is_probe": is_probe}


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
            self.seer_drafts = DraftClient(os.environ.get(ENV_DRAFT_ADDRESS) or None)
            self.seer_planner = AdaptiveSpeculation(None, gamma_max=max(self.draft_token_num - 1, 0))
            self.seer_width = int(os.environ.get(ENV_DRAFT_WIDTH, "1"))
            self.seer_ttl = int(float(os.environ.get(ENV_GROUP_TTL, "3600")))
            self.seer_groups: set[str] = set()
            self.seer_appended: dict[str, int] = {}  # rid -> output tokens already appended
            self.seer_proposed: dict[str, int] = {}  # rid -> draft depth proposed this step

        def _prepare_draft_tokens(self, batch: Any) -> tuple[np.ndarray, np.ndarray]:
            metas = [request_meta(getattr(r.sampling_params, "custom_params", None)) for r in batch.reqs]
            plan = self.seer_planner.plan([(r.rid, m[3]) for r, m in zip(batch.reqs, metas, strict=True)])
            drafts: list[Any] = []
            last_tokens: list[int] = []
            self.seer_proposed = {}
            for req, (group, key, size, _probe) in zip(batch.reqs, metas, strict=True):
                context = list(req.origin_input_ids) + list(req.output_ids)
                last_tokens.append(int(context[-1]))
                n = min(int(plan.get(req.rid, 0)), self.draft_token_num - 1)
                if not group or n <= 0:
                    drafts.append(None)
                    continue
                if group not in self.seer_groups:
                    self.seer_drafts.register_group(group, key, req.origin_input_ids, size, self.seer_ttl)
                    self.seer_groups.add(group)
                d = self.seer_drafts.propose(group, req.rid, context, n, self.seer_width)
                drafts.append(d)
                if d is not None:
                    depth = [0] * len(d.tokens)
                    for i, p in enumerate(d.parents):
                        depth[i] = 0 if p < 0 else depth[p] + 1
                    self.seer_proposed[req.rid] = max(depth) + 1
            return pack_batch(drafts, last_tokens, self.draft_token_num)

        def _update_ngram_cache(self, batch: Any) -> None:
            proposed = [0] * max(self.draft_token_num - 1, 1)
            accepted = [0] * len(proposed)
            for req in batch.reqs:
                group = request_meta(getattr(req.sampling_params, "custom_params", None))[0]
                done = self.seer_appended.get(req.rid, 0)
                new = list(req.output_ids[done:])
                depth = self.seer_proposed.get(req.rid, 0)
                for i in range(min(depth, len(proposed))):
                    proposed[i] += 1
                for i in range(min(max(len(new) - 1, 0), depth, len(accepted))):
                    accepted[i] += 1  # all new tokens but the bonus token were accepted drafts
                if group and new:
                    self.seer_drafts.append(group, req.rid, done, new, bool(req.finished()))
                    self.seer_appended[req.rid] = done + len(new)
                if req.finished():
                    self.seer_appended.pop(req.rid, None)
            self.seer_planner.observe(proposed, accepted)

    return SeerDraftWorker

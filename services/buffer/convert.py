"""Protobuf <-> core conversions for the buffer (no grpc; shared by the server and tests)."""

from __future__ import annotations

from collections.abc import Sequence

from seer.v1 import buffer_pb2, common_pb2, rollout_pb2

from services.buffer.core import BatchStatus, Commit, WorkItem
from services.buffer.records import ChunkStats, FinishReason, GroupSpec, RolloutResult, Sampling


def sampling_from_pb(s: common_pb2.SamplingParams) -> Sampling:
    return Sampling(
        temperature=float(s.temperature), top_p=float(s.top_p), top_k=int(s.top_k),
        seed=int(s.seed) if s.HasField("seed") else None,
        stop_token_ids=tuple(int(t) for t in s.stop_token_ids), ignore_eos=bool(s.ignore_eos),
    )


def sampling_to_pb(s: Sampling) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)
    if s.seed is not None:
        msg.seed = s.seed
    return msg


def group_from_pb(g: rollout_pb2.PromptGroup) -> GroupSpec:
    return GroupSpec(
        prompt_key=g.prompt_key, prompt_token_ids=tuple(int(t) for t in g.prompt_token_ids),
        prompt_text=g.prompt_text, group_size=int(g.group_size), max_tokens=int(g.max_tokens),
        sampling=sampling_from_pb(g.sampling), labels=tuple(sorted(g.labels.items())),
    )


def stats_from_pb(s: common_pb2.ChunkStats) -> ChunkStats:
    return ChunkStats(s.prefill_tokens, s.cached_tokens, s.kv_loaded_tokens, s.draft_tokens, s.accepted_tokens,
                      s.steps, s.wall_seconds, s.kv_recomputed_pages)


def stats_to_pb(s: ChunkStats) -> common_pb2.ChunkStats:
    return common_pb2.ChunkStats(**s.to_meta())


def _finish_reason(value: int) -> FinishReason:
    try:
        return FinishReason(value)
    except ValueError:  # an enum value newer than this build: let validation name the field
        return FinishReason.UNSPECIFIED


def commit_from_pb(r: buffer_pb2.CommitChunkRequest) -> Commit:
    return Commit(
        request_id=r.request_id, seq=int(r.seq), token_ids=list(r.token_ids), logprobs=list(r.logprobs),
        finish_reason=_finish_reason(int(r.finish_reason)),
        policy_version=int(r.policy_version), worker_id=r.worker_id, stats=stats_from_pb(r.stats),
        submit_seq=int(r.submit_seq),
    )


def work_item_to_pb(w: WorkItem) -> buffer_pb2.WorkItem:
    return WorkItemEncoder().encode(w)


class WorkItemEncoder:
    """Converts WorkItems, reusing each group's converted prompt and sampling (the G requests of a
    group share them; copying a protobuf template is ~10x cheaper than rebuilding the token list)."""

    def __init__(self, max_groups: int = 4096) -> None:
        # group_id -> (the group's prompt array, its template). A group's requests share one prompt
        # array object (the core's group record), so identity says "the same group", not just the
        # same id: a batch id resubmitted after retention deleted it has new groups under the old
        # ids, which must not get the old prompt, sampling and version. The reference keeps the
        # array alive, so its identity cannot be reused while cached.
        self._templates: dict[str, tuple[object, buffer_pb2.WorkItem]] = {}
        self._max_groups = max_groups

    def _template(self, w: WorkItem) -> buffer_pb2.WorkItem:
        hit = self._templates.get(w.group_id)
        if hit is not None and hit[0] is w.prompt_token_ids:
            return hit[1]
        if len(self._templates) >= self._max_groups:
            self._templates.clear()
        t = buffer_pb2.WorkItem(
            batch_id=w.batch_id, group_id=w.group_id, group_index=w.group_index, group_size=w.group_size,
            prompt_key=w.prompt_key, prompt_token_ids=w.prompt_token_ids.tolist(), max_tokens=w.max_tokens,
            sampling=sampling_to_pb(w.sampling), policy_version=w.policy_version,
            trace_context=w.trace_context, submit_seq=w.submit_seq,
        )
        self._templates[w.group_id] = (w.prompt_token_ids, t)
        return t

    def encode(self, w: WorkItem) -> buffer_pb2.WorkItem:
        msg = buffer_pb2.WorkItem()
        self._fill(msg, w)
        return msg

    def added(self, items: Sequence[WorkItem]) -> buffer_pb2.WatchWorkResponse:
        """The WatchWork event for items, in order (built in place: constructing the event from
        messages would copy each of them once more)."""
        resp = buffer_pb2.WatchWorkResponse()
        batch = resp.added
        batch.SetInParent()
        for w in items:
            self._fill(batch.items.add(), w)
        return resp

    def _fill(self, msg: buffer_pb2.WorkItem, w: WorkItem) -> None:
        msg.CopyFrom(self._template(w))
        msg.request_id = w.request_id
        msg.sample_index = w.sample_index
        if w.sampling.seed is not None:
            msg.sampling.seed = w.sampling.seed
        if len(w.output_token_ids):
            msg.output_token_ids.extend(w.output_token_ids.tolist())
        msg.next_seq = w.next_seq


def result_to_pb(r: RolloutResult) -> rollout_pb2.RolloutResult:
    return rollout_pb2.RolloutResult(
        request_id=r.request_id, batch_id=r.batch_id, group_index=r.group_index, sample_index=r.sample_index,
        prompt_key=r.prompt_key, token_ids=r.token_ids.tolist(), logprobs=r.logprobs.tolist(),
        finish_reason=int(r.finish_reason), policy_version=r.policy_version, stats=stats_to_pb(r.stats),
        num_chunks=r.num_chunks, latency_seconds=r.latency_seconds, labels=r.labels, text=r.text,
    )


def batch_to_pb(b: BatchStatus) -> rollout_pb2.GetBatchResponse:
    return rollout_pb2.GetBatchResponse(
        batch_id=b.batch_id, state=int(b.state), num_requests=b.num_requests, num_finished=b.num_finished,
        num_cancelled=b.num_cancelled, generated_tokens=b.generated_tokens, policy_version=b.policy_version,
        submission_id=b.submission_id, requests=[
            rollout_pb2.RequestStatus(request_id=r.request_id, state=int(r.state), generated_tokens=r.generated_tokens,
                                      num_chunks=r.num_chunks, finish_reason=int(r.finish_reason))
            for r in b.requests
        ],
    )

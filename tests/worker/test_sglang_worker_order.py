"""SeerDraftWorker (the SEER plugin's NGRAMWorker subclass) driven in SGLang 0.5.23's real order.

SGLang needs CUDA, so NGRAMWorker is a stand-in that calls the plugin's hooks where the real one
does (tests/worker/test_sglang_api.py checks that order against the pinned wheel):
forward_batch_generation -> _prepare_draft_tokens (decode batches only, ngram_worker.py:307-333) ->
verify -> _update_ngram_corpus (ngram_worker.py:527); then the scheduler's result processing:
on_verify_complete_cpu(num_correct_drafts_per_req, batch_size=...) (batch_result_processor.py:803)
and only after it req.output_ids.extend + the finish state (:1046-1047).

Found by review: the plugin appended in _update_ngram_corpus, before the step's tokens were in
output_ids, so the mirror lagged a step, a request's last tokens were never appended (the mirror's
request stayed active), and the planner paired step k-1's acceptance with step k's drafts."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from services.worker.engine import Draft
from services.worker.engines.sglang import plugin
from services.worker.engines.sglang.engine import attempt_rid

N = 4  # speculative_num_draft_tokens: root + 3 draft slots
DEPTH = N - 1
PROMPT = [1, 2, 3]
# SGLang ids of the first attempts of Seer requests a, b, c, as the adapter makes them.
A, B, C = attempt_rid(1, "a"), attempt_rid(1, "b"), attempt_rid(1, "c")


def truth(rid: str) -> list[int]:
    """What the target model produces for a request (distinct per request)."""
    base = 10 if rid == A else 40
    return list(range(base, base + 30))


class _Mode:
    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode


@dataclass
class _FinishLength:  # SGLang's FINISH_LENGTH (schedule_batch.py:320)
    length: int


@dataclass
class _Req:
    """The fields of SGLang's Req the plugin reads (schedule_batch.py)."""

    rid: str
    max_new_tokens: int
    origin_input_ids: list[int] = field(default_factory=lambda: list(PROMPT))
    output_ids: list[int] = field(default_factory=list)
    finished_reason: Any = None
    finished_len: int | None = None
    sampling_params: Any = None
    customized_info: Any = None  # schedule_batch.py:1340

    def __post_init__(self) -> None:
        # The Seer request id: after the first '#' of attempt_rid's "<attempt>#<request id>".
        self.sampling_params = types.SimpleNamespace(
            custom_params=plugin.custom_params("g", "k", 2, False, request_id=self.rid.partition("#")[2]))

    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def output_ids_through_stop(self) -> list[int]:
        return self.output_ids[: self.finished_len] if self.finished_len is not None else self.output_ids

    def update_finish_state(self) -> None:
        if len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = _FinishLength(self.max_new_tokens)
            self.finished_len = self.max_new_tokens


class _NGRAMWorker:
    """NGRAMWorker's skeleton: the hooks in the order the real forward calls them."""

    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any) -> None:
        self.draft_token_num = N
        self.verified_on: list[str] = []
        self.finished_noted: list[str] = []

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        self.verified_on.append("base")

    def _prepare_draft_tokens(self, batch: Any) -> Any:
        raise NotImplementedError  # the n-gram corpus's drafts: SeerDraftWorker replaces it

    def _update_ngram_corpus(self, batch: Any) -> None:
        pass

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.finished_noted.append(rid)  # BaseSpecWorker's hook (a no-op there)

    def forward_batch_generation(self, batch: Any, on_publish: Any = None, pp_proxy_tensors: Any = None) -> Any:
        if batch.forward_mode.is_decode():
            batch.packed = self._prepare_draft_tokens(batch)
            self._update_ngram_corpus(batch)  # after verify, inside forward (ngram_worker.py:527)
        # GenerationBatchResult: next_token_ids [bs x N], each request's committed tokens first
        # (the scheduler's verify stand-in fills them, as eagle_sample does on the GPU).
        batch.next_token_ids = None
        return batch


class _Sink:
    """The draft client the bridge writes to: records appends and ends; proposes a chain of the
    true next tokens of which the first `correct[rid]` are right."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.ended: list[str] = []
        self.correct: dict[str, int] = {}

    def register_attempt(self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], group_size: int,
                         ttl_seconds: int = 3600, *, request_id: str = "", epoch: int = 0,
                         submit_seq: int = 0, policy_version: int | None = None) -> None:
        pass

    def resume(self, group_id: str, request_id: str, output_token_ids: Sequence[int], epoch: int = 0, *,
               submit_seq: int = 0) -> None:
        self.tokens[request_id] = list(output_token_ids)

    def append(self, group_id: str, request_id: str, offset: int, token_ids: Sequence[int],
               finished: bool = False, truncate: bool = False, *, epoch: int = 0, submit_seq: int = 0) -> None:
        assert offset == len(self.tokens[request_id]), (request_id, offset, self.tokens[request_id])
        self.tokens[request_id] += list(token_ids)

    def end(self, group_id: str, request_id: str, *, epoch: int = 0, submit_seq: int = 0) -> None:
        self.ended.append(request_id)

    def propose(self, group_id: str, request_id: str, context: Sequence[int], max_len: int, width: int = 1) -> Any:
        n = len(context) - len(PROMPT)
        want = truth(attempt_rid(1, request_id))[n : n + max_len]  # the first attempt's truth
        k = self.correct.get(attempt_rid(1, request_id), 0)  # keyed by SGLang rid
        toks = tuple(want[:k]) + (0,) * (max_len - k)
        return Draft(toks, tuple(range(-1, max_len - 1)))


class _Planner:
    def __init__(self) -> None:
        self.observed: list[tuple[list[int], list[int]]] = []

    def plan(self, reqs: Sequence[tuple[str, bool]]) -> dict[str, int]:
        return {rid: DEPTH for rid, _ in reqs}

    def observe(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        self.observed.append((list(proposed), list(accepted)))


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    mod = types.ModuleType("sglang.srt.speculative.ngram_worker")
    mod.NGRAMWorker = _NGRAMWorker  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.speculative"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.speculative.ngram_worker", mod)
    monkeypatch.delenv(plugin.ENV_DRAFT_ADDRESS, raising=False)  # a local mirror: no server
    w = plugin._worker_class()(None, 0, 0, None)
    w.seer_drafts = plugin.DraftBridge(_Sink())
    w.seer_planner = _Planner()
    yield w


class _Scheduler:
    """SGLang's synchronous loop (disable_overlap_schedule) over the worker."""

    def __init__(self, worker: Any, finish_hook: bool = True) -> None:
        self.w = worker
        # False: a release without BaseSpecWorker.note_request_finished (the departure fallback).
        self.finish_hook = finish_hook
        self.sink: _Sink = worker.seer_drafts.client
        self.running: list[_Req] = []
        self.accepts: list[list[int]] = []  # per decode step, per request: accepted drafts

    def prefill(self, req: _Req) -> None:
        batch = types.SimpleNamespace(reqs=[req], forward_mode=_Mode(False))
        self.w.forward_batch_generation(batch)
        req.output_ids.append(truth(req.rid)[0])  # process_batch_result_prefill
        req.update_finish_state()
        if not req.finished():
            self.running.append(req)

    def decode(self, correct: dict[str, int], sampled: dict[str, list[int]] | None = None) -> None:
        """One verify step; sampled[rid] overrides the tokens the model commits (else its truth)."""
        batch = types.SimpleNamespace(reqs=list(self.running), forward_mode=_Mode(True))
        self.sink.correct = correct
        result = self.w.forward_batch_generation(batch)
        # Verify: the first `correct` drafts match, plus the bonus token.
        counts = [correct.get(r.rid, 0) for r in batch.reqs]
        self.accepts.append(counts)
        result.next_token_ids = []
        for r, c in zip(batch.reqs, counts, strict=True):
            n = len(r.output_ids)
            row = (sampled or {}).get(r.rid) or truth(r.rid)[n : n + c + 1]
            result.next_token_ids += row + [0] * (N - len(row))  # predict[accept_index]: junk past the run
        self.w.on_verify_complete_cpu(counts, batch_size=len(batch.reqs))
        for r, c in zip(batch.reqs, counts, strict=True):
            n = len(r.output_ids)
            row = (sampled or {}).get(r.rid) or truth(r.rid)[n : n + c + 1]
            r.output_ids.extend(row)  # batch_result_processor.py:1046
            r.update_finish_state()
            if r.finished() and self.finish_hook:  # batch_result_processor.py:1441-1444
                self.w.note_request_finished(rid=r.rid, natural_stop=False)
        self.running = [r for r in self.running if not r.finished()]


def test_the_mirror_holds_each_step_and_a_finished_requests_last_tokens(worker: Any) -> None:
    s = _Scheduler(worker, finish_hook=False)
    a, b = _Req(A, max_new_tokens=6), _Req(B, max_new_tokens=40)
    s.prefill(a)
    s.prefill(b)
    s.decode({A: 2, B: 1})  # a: 1 + 3 = 4 tokens; b: 1 + 2 = 3
    # At the next step's prepare the mirror has everything verified so far.
    s.decode({A: 3, B: 0})  # a overshoots its 6 (4 + 4 = 8): finished through 6
    assert a.finished() and a not in s.running
    assert s.sink.tokens["a"] == truth(A)[:4]  # before a's departure is seen
    s.prefill(_Req(C, max_new_tokens=40))  # an extend batch: a's departure is settled here
    assert s.sink.tokens["a"] == truth(A)[:6]  # through its stop, not the overshoot
    assert s.sink.ended == ["a"]
    assert A not in worker.seer_running
    s.decode({B: 1})
    assert s.sink.tokens["b"] == b.output_ids[: len(s.sink.tokens["b"])] and len(s.sink.tokens["b"]) == 4
    assert len(s.sink.tokens["b"]) == len(b.output_ids) - 2  # only the step in flight is not in yet


def test_a_request_that_leaves_unfinished_is_forgotten_at_the_next_decode_batch(worker: Any) -> None:
    s = _Scheduler(worker)
    a, b = _Req(A, max_new_tokens=40), _Req(B, max_new_tokens=40)
    s.prefill(a)
    s.prefill(b)
    s.decode({})
    s.running.remove(a)  # retracted (KV pressure) or aborted before its finish flag
    s.prefill(_Req(C, max_new_tokens=40))  # an extend batch does not hold the running requests
    assert s.sink.ended == []
    s.decode({})
    assert s.sink.ended == ["a"]


def test_the_planner_pairs_each_steps_drafts_with_that_steps_acceptance(worker: Any) -> None:
    s = _Scheduler(worker)
    s.prefill(_Req(A, max_new_tokens=40))
    pattern = [3, 0, 2, 1, 3]
    for k in pattern:
        s.decode({A: k})
    planner: _Planner = worker.seer_planner
    assert len(planner.observed) == len(pattern)
    for (proposed, accepted), k in zip(planner.observed, pattern, strict=True):
        assert proposed == [1] * DEPTH
        assert accepted == [1] * k + [0] * (DEPTH - k)
    assert worker.verified_on == ["base"] * len(pattern)  # NGRAMWorker's own hook still runs


def test_a_finished_request_is_settled_at_sglangs_finish_hook(worker: Any) -> None:
    """Nit (review 4): a finished request's last tokens reached the mirror only at the next
    forward (none for a while on an idle scheduler). SGLang 0.5.23 calls
    draft_worker.note_request_finished(rid=, natural_stop=) at the finish
    (batch_result_processor.py:1441-1444): settled there, the base hook still called."""
    s = _Scheduler(worker)
    a, b = _Req(A, max_new_tokens=6), _Req(B, max_new_tokens=40)
    s.prefill(a)
    s.prefill(b)
    s.decode({A: 2, B: 1})
    s.decode({A: 3, B: 0})  # a finishes through 6
    assert s.sink.tokens["a"] == truth(A)[:6] and s.sink.ended == ["a"]  # no further forward
    assert A not in worker.seer_running and worker.finished_noted == [A]
    s.prefill(_Req(C, max_new_tokens=40))  # the departure path finds nothing left to settle
    assert s.sink.ended == ["a"] and s.sink.tokens["a"] == truth(A)[:6]


def test_each_verify_step_files_its_real_draft_count_for_the_worker(worker: Any) -> None:
    """SGLang reports spec_num_proposed_drafts = verify steps x (N - 1), padding included; the
    plugin files the real draft length of each step (and the accepted drafts within it) in
    customized_info at the step's first new token and None at its other tokens (the list lines up
    with output_ids, as SGLang's streamer slices it by token position)."""
    s = _Scheduler(worker)
    a = _Req(A, max_new_tokens=40)
    s.prefill(a)
    sink = s.sink
    real_propose = sink.propose

    def short(group_id: str, request_id: str, context: Sequence[int], max_len: int, width: int = 1) -> Any:
        d = real_propose(group_id, request_id, context, max_len, width)
        return Draft(d.tokens[:1], d.parents[:1])  # one real draft token, the block's other slots pad

    s.decode({A: 2})  # 3 drafts proposed, 2 right: 3 tokens
    sink.propose = short  # type: ignore[method-assign]
    s.decode({A: 1})  # 1 draft proposed, right: 2 tokens
    s.decode({A: 2})  # 2 correct by fiat (no padding path is 2 deep): the real node's 1 counted
    values = a.customized_info[plugin.DRAFT_INFO_KEY]
    assert values == [None, (3, 2), None, None, (1, 1), None, (1, 1), None, None]
    assert len(values) == len(a.output_ids)
    assert plugin.draft_totals(values) == (4, 5)  # SGLang's capacity: 3 steps x 3 = 9
    assert plugin.draft_totals(None) == (0, 0)  # no list: not SEER's worker


def test_a_padding_match_is_no_accepted_draft(worker: Any) -> None:
    """Review (b1346aa): padding nodes carry token 0 under the root (drafts.to_sglang), and SGLang
    counts a padding node the model's sample matched as a correct draft. The real draft (one
    wrong token) had nothing accepted: neither the planner nor the reported counts may say 1.
    The accepted path is walked over the tokens SGLang commits (next_token_ids)."""
    s = _Scheduler(worker)
    a = _Req(A, max_new_tokens=40)
    s.prefill(a)
    sink = s.sink
    sink.propose = lambda group_id, request_id, context, max_len, width=1: Draft((999,), (-1,))  # type: ignore[method-assign]
    s.decode({A: 1}, sampled={A: [0, 7]})  # the model samples token 0 (the padding's), then 7
    assert a.output_ids[1:] == [0, 7]
    planner: _Planner = worker.seer_planner
    assert planner.observed[-1] == ([1, 0, 0], [0, 0, 0])
    assert a.customized_info[plugin.DRAFT_INFO_KEY] == [None, (1, 0), None]
    # A real node with token 0 that matches is the draft's own acceptance.
    sink.propose = lambda group_id, request_id, context, max_len, width=1: Draft((0, 5), (-1, 0))  # type: ignore[method-assign]
    s.decode({A: 2}, sampled={A: [0, 5, 8]})
    assert planner.observed[-1] == ([1, 1, 0], [1, 1, 0])
    assert a.customized_info[plugin.DRAFT_INFO_KEY] == [None, (1, 0), None, (2, 2), None, None]


def test_the_planner_is_told_the_depth_of_the_block_verified_not_of_the_raw_draft(worker: Any) -> None:
    """Final read: the proposed depth came from the Seer draft as proposed, though to_block drops an
    out-of-vocabulary node with its subtree: a chain 3 deep whose second token is outside the
    vocabulary verifies 1 draft node, and the planner was told 3 were proposed (two never
    verified, counted as rejected)."""
    s = _Scheduler(worker)
    worker.seer_vocab_size = 100
    s.prefill(_Req(A, max_new_tokens=40))
    want = truth(A)[1:4]
    s.sink.propose = (  # type: ignore[method-assign]
        lambda group_id, request_id, context, max_len, width=1: Draft((want[0], 500, want[2]), (-1, 0, 1)))
    s.decode({A: 1})
    planner: _Planner = worker.seer_planner
    assert planner.observed[-1] == ([1, 0, 0], [1, 0, 0])
    assert worker.seer_blocks[A].real == 1


def test_an_ungrouped_request_files_no_draft_list(worker: Any) -> None:
    """Found by review: the prefill filed its None entry (open_step_info) for every request, so an
    ungrouped one (no group: never drafted for) carried SEER's key in each of its outputs, and each
    verify step filed (0, 0) for it. Only grouped requests get the list; a grouped one beside it
    keeps its own."""
    s = _Scheduler(worker)
    a, u = _Req(A, max_new_tokens=40), _Req(C, max_new_tokens=40)
    u.sampling_params = types.SimpleNamespace(custom_params=plugin.custom_params("", "", 0, False))
    s.prefill(a)
    s.prefill(u)
    assert u.customized_info is None
    s.decode({A: 1})
    s.decode({A: 2})
    assert u.customized_info is None and len(u.output_ids) == 3
    assert a.customized_info[plugin.DRAFT_INFO_KEY] == [None, (3, 1), None, (3, 2), None, None]

"""Worker and reference engine fault paths found by a review (session 13): a LoadWeights of a bad
checkpoint leaves the running weights whole, a temperature too small for float32 is refused naming
the field, and a chunk's cached_tokens is what the engine can actually reuse."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from services.worker.core import ChunkFinish, ChunkJob, DoneEvent, Worker
from services.worker.engine import SamplingParams
from services.worker.engines.reference import ReferenceEngine
from services.worker.model.loader import load_state_dict


def test_a_checkpoint_missing_a_tensor_changes_nothing(ref_engine: ReferenceEngine, model_dir: Path) -> None:
    model = ref_engine.model
    before = (model.layers[0].qkv, model.embed, model.norm, model.lm_head)
    state = load_state_dict(model_dir)
    state = {k: v + 1.0 for k, v in state.items() if k != "model.norm.weight"}  # other weights, one missing
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        model.load(state)
    after = (model.layers[0].qkv, model.embed, model.norm, model.lm_head)
    assert all(a is b for a, b in zip(after, before, strict=True))  # the same tensors, untouched


@pytest.mark.parametrize("t", [1e-40, 1e-300, 5e-6])
def test_a_temperature_too_small_for_float32_is_refused(t: float) -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=t).validate()
    SamplingParams(temperature=1e-5).validate()
    SamplingParams(temperature=0.0).validate()


def test_the_smallest_temperature_survives_the_float32_proto_field() -> None:
    """1e-5, the documented minimum, sent over gRPC arrives as 9.99999974738e-06 (float32): the
    workers and the buffer took it for less than their bound and refused it (audit, session 27)."""
    from seer.v1 import common_pb2

    from services.buffer.convert import sampling_from_pb
    from services.buffer.validation import _validate_sampling
    from services.worker.server import sampling_from_proto

    msg = common_pb2.SamplingParams.FromString(common_pb2.SamplingParams(temperature=1e-5).SerializeToString())
    assert msg.temperature != 1e-5  # the float32 rounding this is about
    sampling_from_proto(msg).validate()
    _validate_sampling(sampling_from_pb(msg), 49152, "groups[0].sampling")


def test_cached_tokens_counts_what_the_engine_reuses(ref_engine: ReferenceEngine) -> None:
    page = ref_engine.kv_layout.page_size
    prompt = tuple(range(1000, 1000 + 2 * page))  # whole pages: the last one is recomputed anyway
    w = Worker(ref_engine, speculation=False).start()
    try:
        job = ChunkJob(request_id="a", prompt_token_ids=prompt, max_new_tokens=1, max_tokens=1,
                       sampling=SamplingParams(temperature=0.0), policy_version=0)
        w.run(job)
        _toks, _reason, done = w.run(ChunkJob(**{**job.__dict__, "request_id": "b"}))
        assert done.stats.cached_tokens == page and done.stats.prefill_tokens == page
    finally:
        w.close()


class _HeldFetchPool:
    """A KV pool whose prefix fetch waits until released (the window between RunChunk and admission,
    as when the pool is slow); it has nothing to give."""

    def __init__(self) -> None:
        self.fetching = threading.Event()
        self.go = threading.Event()

    def fetch_prefix(self, token_ids: object, model_version: str, layout: object, *, min_tokens: int = 0,
                     cancelled: object = None) -> None:
        self.fetching.set()
        self.go.wait(30)

    def release(self, model_version: str, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("abort_epoch", "aborted"), [(0, True), (5, True), (4, False)])
def test_an_abort_during_admission_ends_the_chunk_before_it_runs(
    ref_engine: ReferenceEngine, prompts: list[tuple[int, ...]], abort_epoch: int, aborted: bool,
) -> None:
    pool = _HeldFetchPool()
    w = Worker(ref_engine, kv_pool=pool, kv_offload=False, speculation=False).start()  # type: ignore[arg-type]
    # Tokens no other test caches: the worker fetches only what its engine lacks.
    prompt = prompts[0] + tuple(range(2000 + 100 * abort_epoch, 2040 + 100 * abort_epoch))
    job = ChunkJob(request_id="r", prompt_token_ids=prompt, max_new_tokens=4, max_tokens=64,
                   sampling=SamplingParams(temperature=0.0, ignore_eos=True), policy_version=0, fetch_kv=True,
                   dispatch_epoch=5)
    out: dict[str, tuple[list[int], list[float], DoneEvent]] = {}
    t = threading.Thread(target=lambda: out.setdefault("run", w.run(job)))
    try:
        t.start()
        assert pool.fetching.wait(30)
        # The scheduler dropped the request (any attempt: epoch 0), or aborts this attempt (5), or an
        # earlier one (4: ignored, the chunk runs).
        assert w.abort("r", dispatch_epoch=abort_epoch) is aborted
        pool.go.set()
        t.join(60)
        tokens, _logprobs, done = out["run"]
        assert done.finish == (ChunkFinish.ABORTED if aborted else ChunkFinish.CHUNK)
        assert len(tokens) == (0 if aborted else 4)
    finally:
        pool.go.set()
        w.close()

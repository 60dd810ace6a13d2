"""A chunk re-dispatched from a shorter committed output than an earlier attempt of it ran to (the
scheduler never got that attempt's CHUNK) generates a different chain: the worker's offload
watermark must drop back to the resumed prefix's whole pages, else the next offload skips the new
chain's pages up to the old mark and the next worker recomputes them. Glue over the fake engine
and pool (pages of 4 tokens)."""

from __future__ import annotations

from typing import Any

from worker_fake_engine import FakeEngine, FakePool

from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.engine import SamplingParams

PROMPT = tuple(range(1, 11))  # 10 tokens: 2 whole pages


class _ShiftEngine(FakeEngine):
    """Continuation depends on `shift`: a re-sampled attempt produces other tokens."""

    shift = 0

    def _next(self, last: int) -> int:
        return (last + 1 + self.shift) % self._vocab


def _job(epoch: int, output: tuple[int, ...] = (), seq: int = 0) -> ChunkJob:
    kw: dict[str, Any] = dict(request_id="r", prompt_token_ids=PROMPT, output_token_ids=output,
                              max_new_tokens=8, max_tokens=40, sampling=SamplingParams(temperature=0.0),
                              policy_version=0, group_id="g0", seq=seq, fetch_kv=True, dispatch_epoch=epoch)
    return ChunkJob(**kw)


def test_redispatch_from_shorter_output_offloads_the_new_chain() -> None:
    pool = FakePool()
    ea, eb = _ShiftEngine(), FakeEngine()
    wa = Worker(ea, kv_pool=pool, speculation=False).start()
    wb = Worker(eb, kv_pool=pool, speculation=False).start()
    try:
        t1, _, d1 = wa.run(_job(1))
        assert d1.finish == ChunkFinish.CHUNK
        wa.wait_offloads()
        assert wa.offloaded_pages("r") == 4  # 17 computed tokens
        ea.shift = 1  # the re-dispatched attempt samples another continuation
        t2, _, d2 = wa.run(_job(2))
        assert d2.finish == ChunkFinish.CHUNK and t2 != t1
        wa.wait_offloads()
        # Pages 2 and 3 of the new chain are new: sent from the prompt's last whole page on.
        assert pool.sent[-1] == ("r", 2, 4)
        # The next chunk, elsewhere, fetches the whole committed prefix instead of recomputing.
        _, _, d3 = wb.run(_job(3, tuple(t2), seq=1))
        assert d3.stats.kv_recomputed_pages == 0
        assert d3.stats.kv_loaded_tokens == 16
    finally:
        wa.close()
        wb.close()

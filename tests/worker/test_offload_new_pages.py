"""A request run in several chunks, moving between workers, sends each KV page to the real KV store
exactly once (issue 6: only the pages earlier chunks did not offload), and a resume on another engine
still loads the whole stored prefix instead of re-prefilling it."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from services.kvstore.config import KvStoreConfig
from services.kvstore.server import serve
from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.kv_client import KVClient

CHUNK = 16  # one page of new tokens per chunk
PAGE = 16


def test_each_page_is_offloaded_once(ref_engine: ReferenceEngine, model_dir: Path, tmp_path: Path,
                                     tokenizer: Tokenizer) -> None:
    running, _store = serve(KvStoreConfig(port=0, data_dir=str(tmp_path / "kv"), dram_bytes=64 << 20,
                                          ssd_bytes=256 << 20, grace_seconds=1.0))
    other = ReferenceEngine.from_dir(model_dir, num_pages=64, max_batch_size=4, num_threads=1)
    kv_a, kv_b = KVClient([running.address]), KVClient([running.address])
    wa = Worker(ref_engine, worker_id="a", kv_pool=kv_a, speculation=False).start()
    wb = Worker(other, worker_id="b", kv_pool=kv_b, speculation=False).start()
    text = "Offload test: describe, step by step, how bread dough rises in a warm kitchen."
    prompt = tuple(tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids)
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    total = 3 * CHUNK + 2

    def run(w: Worker, output: list[int], seq: int, n: int = CHUNK) -> tuple[list[int], ChunkFinish, int, int]:
        toks, _, done = w.run(ChunkJob(request_id="r", prompt_token_ids=prompt, output_token_ids=tuple(output),
                                       max_new_tokens=n, max_tokens=total, sampling=sampling, policy_version=0,
                                       group_id="g", seq=seq, fetch_kv=True))
        w.wait_offloads()
        return toks, done.finish, done.stats.cached_tokens, done.stats.prefill_tokens

    def full_pages(output: list[int]) -> int:
        return (len(prompt) + len(output) - 1) // PAGE  # the last token's KV is not computed

    try:
        out: list[int] = []
        # Chunk 1 on a, chunks 2 and 3 on b (chunk 2 loads a's pages), chunk 4 back on a.
        for seq, w in enumerate((wa, wb, wb)):
            toks, finish, _, _ = run(w, out, seq)
            assert finish == ChunkFinish.CHUNK
            out += toks
        stored = full_pages(out)
        assert stored >= full_pages([]) + 3  # every chunk added a page
        a, b = kv_a.stats(), kv_b.stats()
        # Each page went into a Put stream with its bytes exactly once, none was re-sent. The only
        # claims are b's of the prefix it fetched (so a sibling's Release cannot take it away).
        assert a.put_bytes + b.put_bytes == stored * ref_engine.kv_layout.page_bytes
        assert a.claimed_pages == 0 and b.claimed_pages == b.fetched_pages > 0
        assert a.put_pages + b.put_pages == stored + b.claimed_pages
        assert a.put_failures == b.put_failures == 0
        assert a.stored_pages + b.stored_pages == stored
        store_stats = kv_a.store_stats()[running.address]
        assert store_stats is not None and store_stats["pages"] == stored
        assert wb.offloaded_pages("r") == stored

        # Back on a: the prefix a lacks comes from the store; only the last partial page is computed.
        prefill_before = ref_engine.stats().prefill_tokens
        toks, finish, cached, prefill = run(wa, out, 3, total - len(out))
        assert finish == ChunkFinish.LENGTH
        prefix = len(prompt) + len(out)
        assert cached == stored * PAGE and prefill == prefix - stored * PAGE < PAGE
        assert ref_engine.stats().prefill_tokens - prefill_before == prefill
        out += toks
        # The last chunk neither offloads nor claims what it fetched.
        assert kv_a.stats().put_pages + kv_b.stats().put_pages == stored + b.claimed_pages

    finally:
        wa.close()
        wb.close()
        running.stop(1.0)
    # The chunked run, moved twice over stored KV, generated what one uninterrupted greedy run does.
    # Checked cheaply: offered as drafts, greedy verification accepts exactly the tokens the model
    # would generate itself (the worker's loop has stopped: the engine is ours again).
    ref_engine.add_request(GenerateRequest("whole", prompt, total, sampling))
    whole: list[int] = []
    while ref_engine.has_unfinished():
        for o in ref_engine.step({"whole": Draft.chain(out[len(whole) : len(whole) + 8])}):
            whole += o.token_ids
    assert whole == out

"""The buffer with the real embedded model directory (SmolLM2 tokenizer and config), and metrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
from buffer_helpers import STOP, BufferHandle, commit, expect_error, group, snapshot, submit
from prometheus_client import REGISTRY
from seer.v1 import rollout_pb2
from tokenizers import Tokenizer


def test_real_tokenizer_and_limits(make_buffer: Callable[..., BufferHandle], model_dir: Path) -> None:
    h = make_buffer(model_dir=str(model_dir))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # Chat markup in the text is matched as the model's special tokens; no BOS is added.
    text = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    submit(h.rollout, "real", [group(prompt_text=text, group_size=1, max_tokens=16)])
    ids = list(snapshot(h.internal)[0].prompt_token_ids)
    assert ids == tok.encode(text, add_special_tokens=False).ids and ids[0] == tok.token_to_id("<|im_start|>")
    # Limits come from the model's config.json (vocab 49152, context 8192).
    expect_error(lambda: submit(h.rollout, "long", [group(prompt_token_ids=[5] * 100, max_tokens=8093)]),
                 grpc.StatusCode.INVALID_ARGUMENT, "groups[0].max_tokens")
    assert submit(h.rollout, "fits", [group(prompt_token_ids=[49151] * 100, max_tokens=8092)]).num_requests == 2
    # Results carry the detokenized text.
    answer = tok.encode("The answer is 5.", add_special_tokens=False).ids
    commit(h.internal, "real/0/0", 0, answer, reason=STOP)
    r = next(iter(h.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="real"), timeout=10))).result
    assert r.text == "The answer is 5."


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_metrics_count_commits_duplicates_and_queue_depth(buf: BufferHandle) -> None:
    commits, dups, results = (_metric("seer_buffer_commits_total"), _metric("seer_buffer_duplicate_commits_total"),
                              _metric("seer_buffer_results_total"))
    submit(buf.rollout, "m", [group(group_size=3)])
    assert _metric("seer_buffer_pending_requests") == 3
    commit(buf.internal, "m/0/0", 0, [5])
    commit(buf.internal, "m/0/0", 0, [5])
    commit(buf.internal, "m/0/1", 0, [5], reason=STOP)
    assert _metric("seer_buffer_commits_total") - commits == 2
    assert _metric("seer_buffer_duplicate_commits_total") - dups == 1
    assert _metric("seer_buffer_results_total") - results == 1
    assert _metric("seer_buffer_pending_requests") == 2

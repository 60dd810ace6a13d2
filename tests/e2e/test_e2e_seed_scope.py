"""SubmitBatchRequest.seed_scope end to end: seeds derived in the buffer, chunks scheduled over two
real workers, sampled by the reference engine on the embedded model.

Its own suite because speculation must be off: a verified draft samples with fresh randomness
(lossless, not reproducible), and the module suite of test_e2e_suite.py speculates.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from seer_client import PromptGroup, Sampling, SeerClient

from services.cli.up import Suite


@pytest.fixture(scope="module")
def suite(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    s = Suite(workers=2, data_dir=tmp_path_factory.mktemp("suite"), model_dir=model_dir, policy="divided",
              chunk_size=6, speculation=False, heartbeat_interval=0.5)
    s.start(timeout=300)
    try:
        yield s
    finally:
        s.stop()


def test_seed_scope_reproduces_a_batch_under_another_id(suite: Suite) -> None:
    """Two batches with one scope sample the same responses, though their chunks ran in other
    batches and places; without the scope (the negative control) the batch id keys the seeds and
    the samples differ. top_p and top_k cut the nearly flat tail of the distribution, where float rounding
    of a differently composed batch could move a sample to a neighbouring token."""
    tag = uuid.uuid4().hex[:8]

    def batch() -> list[PromptGroup]:
        return [PromptGroup(prompt=f"Question: What is {7 + i} plus {5 * i + 3}?\nAnswer:", group_size=3,
                            max_tokens=16, prompt_key=f"scope-{i}",
                            sampling=Sampling(temperature=0.8, top_p=0.9, top_k=20, seed=11 + i))
                for i in range(3)]

    runs = {}
    with SeerClient(suite.address, retry_seconds=90) as client:
        for name, scope in (("a", tag), ("b", tag), ("c", "")):
            out = client.run_batch(f"scope-{name}-{tag}", batch(), seed_scope=scope)
            runs[name] = {(r.group_index, r.sample_index): r.token_ids for r in out}
    assert len(runs["a"]) == 9
    assert any(len(t) > 6 for t in runs["a"].values()), "no response crossed a chunk boundary"
    assert runs["a"] == runs["b"]
    assert runs["c"] != runs["a"]

"""A LoadWeights refusal (INVALID_ARGUMENT / FAILED_PRECONDITION) must mean "nothing changed": the
scheduler keeps every refusing worker serving the old version. The reference engine checks a
checkpoint whole before swapping anything in (test_worker_faults, test_worker_engine). SGLang's
update_weights_from_disk, failing after it started writing weights, answers "Rolling back to
original weights" but reloads the NEW path (it set model_config.model_path first): the adapter
answered that as a bad source (ValueError -> INVALID_ARGUMENT) while the weights were changed. It is
now a broken engine (RuntimeError, INTERNAL at the server), over the SGLang stand-in of
test_sglang_attempts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_sglang_attempts import (  # noqa: F401  (fixtures)
    GREEDY,
    UpdateWeightFromDiskReqInput,
    _sglang,
    engine,
    model_dir,
    run,
)

from services.worker.engine import FinishReason, GenerateRequest
from services.worker.engines.sglang import engine as sg


def test_a_load_sglang_failed_mid_way_is_no_refusal(
        engine: sg.SGLangEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    tm = engine._sgl.tokenizer_manager

    async def mid_load(obj: UpdateWeightFromDiskReqInput, request: Any = None) -> tuple[bool, str, int]:
        tm.calls.append(obj)
        return False, "Failed to update weights: shard 2 truncated.\nRolling back to original weights.", 0

    monkeypatch.setattr(tm, "update_weights_from_disk", mid_load)
    with pytest.raises(RuntimeError, match="weights unknown"):
        engine.load_weights(str(tmp_path), "m@v1")
    assert engine._broken is not None and engine.model_version == "m@v0"
    outs = run(engine, GenerateRequest(request_id="r", prompt_token_ids=(1, 2), max_new_tokens=3, sampling=GREEDY))
    assert [o.finish_reason for o in outs] == [FinishReason.ABORTED]  # serves nothing under the old name


def test_a_load_sglang_refused_before_writing_stays_a_refusal(
        engine: sg.SGLangEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    tm = engine._sgl.tokenizer_manager

    async def refused(obj: UpdateWeightFromDiskReqInput, request: Any = None) -> tuple[bool, str, int]:
        tm.calls.append(obj)
        return False, "Failed to get weights iterator: no safetensors found.", 0

    monkeypatch.setattr(tm, "update_weights_from_disk", refused)
    with pytest.raises(ValueError, match="refused the weights"):
        engine.load_weights(str(tmp_path), "m@v1")
    assert engine._broken is None and engine.model_version == "m@v0"

"""`seer rollout --timeout`: enforced while no result arrives; the batch is cancelled and the CLI
exits non-zero with a message that says so."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from client_helpers import Buffer
from seer_client import PromptGroup, SeerClient

from services.cli import rollout


def test_run_cancels_the_batch_when_no_result_comes(buffer: Buffer) -> None:
    groups = [PromptGroup(prompt=[1, 2, 3], group_size=2, max_tokens=4)]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="cancelled it"):
        rollout.run(buffer.address, groups, "cli-t", progress=False, timeout=0.5)  # before: blocked forever
    assert time.monotonic() - t0 < 5
    with SeerClient(buffer.address) as client:
        assert client.get_batch("cli-t").state == "cancelled"


def test_main_exits_non_zero_on_timeout(buffer: Buffer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2], "prompt_key": "k"}) + "\n")
    code = rollout.main(["--prompts", str(prompts), "--group-size", "1", "--max-tokens", "2", "--address",
                         buffer.address, "--timeout", "0.3", "--no-progress", "--batch-id", "cli-m"])
    assert code == 1
    assert "not done after 0.3s" in capsys.readouterr().err

"""`seer up` and `seer rollout` as a user runs them: up prints the endpoints, rollout prints its
summary (--json), Ctrl-C (SIGINT) stops every service cleanly."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a second whole suite (~45 s on 2 cores); Suite itself is covered by the other e2e tests
def test_up_rollout_and_ctrl_c(model_dir: Path, tmp_path: Path) -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--base-port", "0", "--workers", "1", "--model-dir",
         str(model_dir), "--data-dir", str(tmp_path / "state"), "--policy", "seer", "--chunk-size", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )
    lines: list[str] = []
    try:
        address = None
        deadline = time.monotonic() + 300
        assert up.stdout is not None
        while address is None and time.monotonic() < deadline:
            line = up.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"trainer API \(RolloutService\): (\S+)", line)
            if m:
                address = m.group(1)
        assert address, "".join(lines)
        out = "".join(lines)
        for name in ("buffer", "scheduler", "draft", "kvstore", "worker-0"):
            assert re.search(rf"^\s+{name}\s+127\.0\.0\.1:\d+", out, re.M), out

        roll = subprocess.run(
            [sys.executable, "-m", "services.cli", "rollout", "--prompts", str(ROOT / "examples" / "prompts.jsonl"),
             "--limit", "2", "--group-size", "2", "--max-tokens", "10", "--address", address, "--json",
             "--temperature", "0.7", "--seed", "3"],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
        )
        assert roll.returncode == 0, roll.stdout + roll.stderr
        summary = json.loads(roll.stdout.strip().splitlines()[-1])
        assert summary["responses"] == 4
        assert 4 <= summary["tokens"] <= 40
        assert summary["tokens_per_second"] > 0
        assert summary["latency_p50_seconds"] <= summary["latency_p99_seconds"] <= summary["wall_seconds"] + 0.5
        assert 0 <= summary["tail_seconds"] <= summary["latency_p99_seconds"]
        assert summary["mean_accepted_length"] >= 1.0
        assert summary["policy_versions"] == [0]
        assert 0.0 <= summary["accuracy"] <= 1.0

        def rollout_with(*flags: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "services.cli", "rollout", "--prompts", str(ROOT / "examples" / "prompts.jsonl"),
                 "--limit", "1", "--max-tokens", "4", "--address", address, "--json", *flags],
                capture_output=True, text=True, timeout=120, cwd=ROOT,
            )

        # Refused by the command line, by its flag, before anything is submitted (usage error: 2).
        bad = rollout_with("--group-size", "0")
        assert bad.returncode == 2 and "--group-size" in bad.stderr, bad.stderr
        # Refused by the buffer, naming the field (the suite keeps serving): exit status 1.
        bad = rollout_with("--group-size", "1", "--top-p", "1.5")
        assert bad.returncode == 1 and "top_p" in bad.stderr, bad.stderr
    finally:
        up.send_signal(signal.SIGINT)
        try:
            rest, _ = up.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            rest, _ = up.communicate()
    assert up.returncode == 0, rest
    assert "stopped cleanly" in rest, rest

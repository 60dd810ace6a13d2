"""Plausibility of the engine statistics a worker reports with a chunk (ChunkDone.stats).

Like impossible telemetry (workers.telemetry_problem), impossible chunk statistics mean the worker
cannot be trusted: its chunk is not committed and the worker is quarantined. The bounds are those
no healthy worker can break (services/worker/core.py fills the stats per chunk):
- every count is a non-negative number and wall_seconds is finite;
- accepted_tokens <= draft_tokens (an accepted draft token was proposed; the SGLang engine reports
  accepted as proposed, which is equal);
- steps <= tokens + 1 when the chunk has tokens: a step counts one engine output for the request,
  which carries at least one token (the reference engine always emits the bonus token; a step of a
  prefill in parts delivers no output at all), except that SGLang's stream may end with a finish
  message that carries no new token.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.scheduler.core.workers import counts_problem


def chunk_stats_problem(stats: Mapping[str, float], tokens: int) -> str:
    """Why a chunk's stats cannot be true ("" when they are plausible). `tokens`: the tokens the
    chunk streamed."""
    problem = counts_problem(stats)
    if problem:
        return problem
    draft, accepted = stats.get("draft_tokens", 0), stats.get("accepted_tokens", 0)
    if accepted > draft:
        return f"accepted_tokens {accepted} exceeds draft_tokens {draft}"
    steps = stats.get("steps", 0)
    if tokens > 0 and steps > tokens + 1:
        return f"steps {steps} exceeds the chunk's {tokens} tokens + 1"
    return ""

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
  message that carries no new token;
- steps >= 1 when the chunk has tokens: every engine output that delivers tokens is a step
  (services/worker/core.py counts one per output), so tokens from no step were never computed;
- the prefix counts are within the chunk's context (prompt + output before the chunk, the prefix
  the worker starts from): prefill_tokens + cached_tokens is exactly that prefix's length (what was
  computed plus what was reused), and kv_loaded_tokens and kv_recomputed_pages (a page holds at
  least a token) are parts of it. Without this bound a worker could commit any figure, and the
  buffer sums them into the response's stats.
Not checked: wall_seconds of 0 (a clock's resolution, and test fakes, give it) and the chunk's
timing otherwise; none of it is a decision's input.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.scheduler.core.workers import counts_problem


def chunk_stats_problem(stats: Mapping[str, float], tokens: int, context: int) -> str:
    """Why a chunk's stats cannot be true ("" when they are plausible). `tokens`: the tokens the
    chunk streamed; `context`: the prompt and output tokens it started from."""
    problem = counts_problem(stats)
    if problem:
        return problem
    draft, accepted = stats.get("draft_tokens", 0), stats.get("accepted_tokens", 0)
    if accepted > draft:
        return f"accepted_tokens {accepted} exceeds draft_tokens {draft}"
    steps = stats.get("steps", 0)
    if tokens > 0 and steps > tokens + 1:
        return f"steps {steps} exceeds the chunk's {tokens} tokens + 1"
    if tokens > 0 and steps < 1:
        return f"steps {steps} for the chunk's {tokens} tokens (at least 1)"
    prefix = stats.get("prefill_tokens", 0) + stats.get("cached_tokens", 0)
    if prefix > context:
        return f"prefill_tokens + cached_tokens {prefix} exceeds the chunk's context of {context} tokens"
    for name in ("kv_loaded_tokens", "kv_recomputed_pages"):
        if stats.get(name, 0) > context:
            return f"{name} {stats[name]} exceeds the chunk's context of {context} tokens"
    return ""

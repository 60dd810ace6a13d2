"""Prometheus metrics of the worker (served on --metrics-port by services.common.server)."""

from __future__ import annotations

from services.common.telemetry import Counter, Gauge

IN_FLIGHT = Gauge("seer_worker_in_flight_chunks", "chunks running in this worker's engine")
TOKENS = Counter("seer_worker_generated_tokens", "tokens generated (rate() of it = tokens/s)")
TOKENS_PER_SECOND = Gauge("seer_worker_tokens_per_second", "generated tokens/s over the last 10 s")
CHUNKS = Counter("seer_worker_chunks", "chunks finished, by finish reason", ["finish"])
PROPOSED = Counter("seer_worker_draft_proposed", "draft tokens proposed, by draft position", ["position"])
ACCEPTED = Counter("seer_worker_draft_accepted", "draft tokens accepted, by draft position", ["position"])
FREE_PAGES = Gauge("seer_worker_free_kv_pages", "free KV cache pages of the engine")
POLICY_VERSION = Gauge("seer_worker_policy_version", "policy version the engine serves")
STREAMS = Gauge("seer_worker_open_streams", "open RunChunk streams")
INVALID_DRAFTS = Counter("seer_worker_invalid_drafts_total",
                         "drafts dropped before the engine saw them (invalid; the request stepped without one)")
STREAMS_REFUSED = Counter("seer_worker_refused_streams_total", "RunChunk streams refused at max_streams")
ENGINE_HEALTHY = Gauge("seer_worker_engine_healthy",
                       "0 while the engine is broken (every chunk and a canary failed) until a step succeeds")
ENGINE_HEALTHY.set(1)

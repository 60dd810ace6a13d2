"""Prometheus metrics of the buffer (process-wide)."""

from __future__ import annotations

from services.common.telemetry import Counter, Gauge

PENDING = Gauge("seer_buffer_pending_requests", "Unfinished, uncancelled requests (queue depth)")
BATCHES = Counter("seer_buffer_batches_total", "Batches accepted (new submissions)")
REQUESTS = Counter("seer_buffer_requests_total", "Requests created")
RESULTS = Counter("seer_buffer_results_total", "Finished responses appended to results logs")
COMMITS = Counter("seer_buffer_commits_total", "Chunks committed")
COMMITTED_TOKENS = Counter("seer_buffer_committed_tokens_total", "Tokens committed")
DUPLICATES = Counter("seer_buffer_duplicate_commits_total", "Retried commits acknowledged as duplicates")
REJECTED = Counter("seer_buffer_rejected_commits_total", "Commits refused", ["reason"])
CANCELLED = Counter("seer_buffer_cancelled_requests_total", "Requests cancelled")
WATCHERS = Gauge("seer_buffer_watchers", "Open WatchWork streams")
WATCHERS_DROPPED = Counter("seer_buffer_watchers_dropped_total",
                           "WatchWork streams ended RESOURCE_EXHAUSTED: the watcher fell watch_queue_events behind")
# Set at scrape time (events.py registers the callback): no cost on the publishing path. Compared
# with watch_queue_events (seer_buffer_watch_queue_limit), it shows a watcher falling behind
# before it is dropped.
WATCH_QUEUE_EVENTS = Gauge("seer_buffer_watch_queue_events",
                           "Events queued for the WatchWork watcher furthest behind (0 = none queued or no watchers)")
WATCH_QUEUE_LIMIT = Gauge("seer_buffer_watch_queue_limit",
                          "watch_queue_events: a watcher with this many events queued is dropped at the next publish")
# Each read that met one counts (a result two readers met counts twice): any rise means a stored
# result some reader did not get; the error log names its key and field. read: "results" (a
# StreamResults page) or "history" (a completing batch's prompt history).
UNREADABLE_RESULTS = Counter("seer_buffer_unreadable_results_total",
                             "Stored results that could not be decoded, left out of a read (each read)", ["read"])
# GetBatch with include_requests: a stored request record that could not be decoded, listed as
# unknown (state UNSPECIFIED) and named in GetBatchResponse.unreadable_requests; each read that met one counts.
UNREADABLE_REQUESTS = Counter(
    "seer_buffer_unreadable_requests_total",
    "Stored request records that could not be decoded, listed as unknown by GetBatch (each read)")
# A completing batch's responses to a prompt key older than every version the key's history keeps
# (records.add_iteration returns None). UpdateWeights waits for the batches of the version it
# replaces, so a buffer does not produce this; a rise means a store written otherwise (another
# buffer's history, an edited store). Logged with the key and the versions.
HISTORY_DROPPED = Counter("seer_buffer_history_dropped_total",
                          "Prompt-key iterations of a completed batch older than every kept version, not recorded")
STREAMS = Gauge("seer_buffer_open_streams", "Open long-lived streams (StreamResults + WatchWork)")
STREAMS_REFUSED = Counter("seer_buffer_refused_streams_total", "Streams refused at max_streams", ["method"])

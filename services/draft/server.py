"""DraftService servicer: converts messages, calls DraftStore, lets @rpc map typed errors."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from seer.v1 import draft_pb2, draft_pb2_grpc

from services.common.grpcutil import rpc
from services.common.log import log_context
from services.common.telemetry import Counter
from services.draft.backfill import HistoryBackfill
from services.draft.store import DraftStore, GroupDelta

APPENDED = Counter("seer_draft_appended_tokens_total", "Tokens newly appended to group indexes")
DUPLICATES = Counter("seer_draft_duplicate_tokens_total", "Appended tokens already present (retries)")
SYNCED = Counter("seer_draft_synced_tokens_total", "Tokens sent to workers in Sync deltas")


class _StoreCollector(Collector):
    """The store's state on /metrics, read from DraftStore.stats() at scrape time. The gauges were
    set only inside GetDraftStats, which nothing in a deployment calls: /metrics showed 0 groups
    and 0 bytes for the server's whole life, and the evicted/expired totals were not exported at
    all. One store per process (the newest servicer's; weakly held, so a test's stopped server is
    not kept alive by it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store: weakref.ref[DraftStore] | None = None

    def follow(self, store: DraftStore) -> None:
        with self._lock:
            self._store = weakref.ref(store)

    def describe(self) -> Iterable[Metric]:
        return []  # unchecked collector: its metrics exist only while a store does

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            store = self._store() if self._store is not None else None
        if store is None:
            return []
        s = store.stats()
        gauges = [
            ("seer_draft_memory_bytes", "Estimated index + history memory", s.memory_bytes),
            ("seer_draft_memory_budget_bytes", "Memory budget of index + history", s.memory_budget_bytes),
            ("seer_draft_groups", "Live groups", s.groups),
            ("seer_draft_history_keys", "Prompt keys with history", s.history_keys),
            ("seer_draft_indexed_tokens", "Tokens indexed over the live groups", s.indexed_tokens),
            ("seer_draft_remembered_ids_bytes", "Tombstones and remembered incarnations (outside the budget)",
             s.remembered_ids_bytes),
        ]
        counters = [
            ("seer_draft_evicted_history_responses", "History responses evicted for memory", s.evicted_history),
            ("seer_draft_expired_groups", "Groups expired by TTL", s.expired_groups),
            ("seer_draft_evicted_groups", "Completed groups evicted for memory", s.evicted_groups),
            # Counted in the store since 17cbf47 (the warnings are limited to one per key a minute)
            # but not exported: a flood of rejections showed only in evicted_history.
            ("seer_draft_rejected_history_adds",
             "History adds rejected as older than every kept iteration of their key (retries too)",
             s.rejected_history_adds),
        ]
        out: list[Metric] = [GaugeMetricFamily(n, h, value=float(v)) for n, h, v in gauges]
        out += [CounterMetricFamily(n, h, value=float(v)) for n, h, v in counters]
        return out


_STATS = _StoreCollector()
REGISTRY.register(_STATS)


def delta_to_pb(d: GroupDelta) -> draft_pb2.GroupDelta:
    return draft_pb2.GroupDelta(
        group_id=d.group_id,
        watermark=d.watermark,
        appends=[
            draft_pb2.SequenceDelta(request_id=a.request_id, offset=a.offset, token_ids=a.token_ids,
                                    finished=a.finished, truncate=a.truncate)
            for a in d.appends
        ],
        prompt_token_ids=d.prompt_token_ids,
        history=[draft_pb2.TokenSequence(token_ids=h) for h in d.history],
        gone=d.gone,
        incarnation=d.incarnation,
        reset=d.reset,
        reused=d.reused,
        reused_epoch=d.reused_epoch,
        reused_submit_seq=d.reused_submit_seq,
        submit_seq=d.submit_seq,
        expired=d.expired,
    )


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, store: DraftStore, backfill: HistoryBackfill | None = None) -> None:
        self.store = store
        self.backfill = backfill
        _STATS.follow(store)

    @rpc
    def Append(self, request_iterator: Iterator[draft_pb2.AppendRequest], context: grpc.ServicerContext
               ) -> draft_pb2.AppendResponse:
        appended = duplicate = 0
        # Each message is applied as it arrives; on a bad message the stream fails with a status
        # naming it (messages[i].field) and the messages before it stay applied (appends are
        # idempotent, so the client may resend the whole batch). Counted in `finally`: the tokens
        # of the messages applied before a refused one are in the index (they were not counted).
        try:
            for i, m in enumerate(request_iterator):
                with log_context(group_id=m.group_id, request_id=m.request_id):
                    a, d = self.store.append(m.group_id, m.request_id, m.offset, m.token_ids, m.finished,
                                             where=f"messages[{i}].", truncate=m.truncate, epoch=m.epoch,
                                             incarnation=m.incarnation)
                appended += a
                duplicate += d
        finally:
            APPENDED.inc(appended)
            DUPLICATES.inc(duplicate)
        return draft_pb2.AppendResponse(appended_tokens=appended, duplicate_tokens=duplicate)

    @rpc
    def Sync(self, request: draft_pb2.SyncRequest, context: grpc.ServicerContext) -> draft_pb2.SyncResponse:
        deltas = self.store.sync([(g.group_id, g.watermark) for g in request.groups],
                                 [g.incarnation for g in request.groups])
        SYNCED.inc(sum(len(a.token_ids) for d in deltas for a in d.appends))
        return draft_pb2.SyncResponse(groups=[delta_to_pb(d) for d in deltas])

    @rpc
    def SeedHistory(self, request: draft_pb2.SeedHistoryRequest, context: grpc.ServicerContext
                    ) -> draft_pb2.SeedHistoryResponse:
        responses: Sequence[Sequence[int]] = [r.token_ids for r in request.responses]
        n = self.store.seed_history(request.prompt_key, request.iteration, responses)
        return draft_pb2.SeedHistoryResponse(num_responses=n)

    @rpc
    def RegisterGroup(self, request: draft_pb2.RegisterGroupRequest, context: grpc.ServicerContext
                      ) -> draft_pb2.RegisterGroupResponse:
        # Unset (an old client) is unknown, not version 0 (the first policy version).
        version = request.policy_version if request.HasField("policy_version") else None
        with log_context(group_id=request.group_id):
            r = self.store.register(
                request.group_id, request.prompt_key, request.prompt_token_ids, request.ttl_seconds,
                request.group_size, request.epoch, request.submit_seq, version)
        if r.created and self.backfill is not None:
            self.backfill.on_register(request.prompt_key, r.history_responses, version)
        return draft_pb2.RegisterGroupResponse(created=r.created, history_responses=r.history_responses,
                                               incarnation=r.incarnation, submit_seq=r.submit_seq)

    @rpc
    def GetDraftStats(self, request: draft_pb2.GetDraftStatsRequest, context: grpc.ServicerContext
                      ) -> draft_pb2.GetDraftStatsResponse:
        s = self.store.stats()
        return draft_pb2.GetDraftStatsResponse(
            groups=s.groups, history_keys=s.history_keys, indexed_tokens=s.indexed_tokens,
            memory_bytes=s.memory_bytes, memory_budget_bytes=s.memory_budget_bytes,
            bytes_per_token=s.bytes_per_token, evicted_history=s.evicted_history, expired_groups=s.expired_groups,
            evicted_groups=s.evicted_groups, remembered_ids_bytes=s.remembered_ids_bytes)


def add_servicers(store: DraftStore, backfill: HistoryBackfill | None = None) -> Callable[[grpc.Server], list[str]]:
    def _add(server: grpc.Server) -> list[str]:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(DraftServicer(store, backfill), server)
        return [draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name]

    return _add

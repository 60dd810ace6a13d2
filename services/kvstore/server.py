"""gRPC glue of the kvstore service: converts messages, calls services.kvstore.store, lets @rpc map
typed errors to status codes. No logic here beyond message shape (per-message size limit, fields
inherited within one Put stream).

Put and Get carry pages: their messages are (de)serialized by services.kvstore.wire (same wire
format, fewer page copies) instead of the generated classes; the other RPCs use the generated ones.

Page streams and handler threads: a sync gRPC server runs each call on a thread of its pool, and a
Put or Get stream keeps its thread for as long as it lasts. Unbounded, enough open streams (idle
clients, or clients that stopped reading) take every thread, and Exists / Release / GetKvStats queue
behind them until the streams end, which an idle client without a deadline never does. So at most
`max_page_streams` Put+Get streams run at once (more are refused at once with RESOURCE_EXHAUSTED: a
miss for the client), keeping threads for the unary calls, a Put stream that sends nothing for
`put_idle_timeout_seconds` is cancelled, and so is a Get stream whose client takes no message for
`get_stall_timeout_seconds` (gRPC's send of a page waits on the client's flow-control window, so a
client that stopped reading holds the thread until its own deadline, or for ever without one). Both
count only time spent waiting on the client, never the server's own store work."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import grpc
from prometheus_client.registry import CollectorRegistry
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

from services.common.errors import InvalidArgument, ResourceExhausted, SeerError
from services.common.grpcutil import rpc
from services.common.kvlayout import KVLayout
from services.common.log import get_logger, kv, log_context
from services.common.server import RunningServer, start_server
from services.common.streams import StreamSlots
from services.kvstore import metrics
from services.kvstore.config import KvStoreConfig
from services.kvstore.store import KvStore
from services.kvstore.wire import BadFrame, PutMessage, decode_put_frame, encode_get

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KvStoreService"].full_name

log = get_logger(__name__)


class _Stream:
    """One open Put or Get stream as the watchdog sees it."""

    __slots__ = ("context", "kind", "last", "timeout")

    def __init__(self, context: grpc.ServicerContext, kind: str, timeout: float, now: float) -> None:
        self.context = context
        self.kind = kind  # "Put" or "Get"
        self.timeout = timeout
        # Since when it waits on its client (inf while the server works): a float store, no lock
        # needed to update.
        self.last = now


class PageStreams:
    """Admission of page streams (Put, Get) and the watchdog of idle Put and stalled Get streams;
    see the module docstring. The watchdog is one thread, started with the first watched stream:
    per message a stream only stores a timestamp."""

    def __init__(self, limit: int, put_idle_timeout_s: float, get_stall_timeout_s: float = 30.0) -> None:
        self.slots = StreamSlots(limit, "max_page_streams")
        self.put_idle_timeout_s = put_idle_timeout_s
        self.get_stall_timeout_s = get_stall_timeout_s
        self._lock = threading.Lock()
        self._watched: set[_Stream] = set()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.idle_cancelled = 0  # Put streams
        self.stalled_cancelled = 0  # Get streams

    @property
    def limit(self) -> int:
        return self.slots.limit

    @property
    def refused(self) -> int:
        return self.slots.refused

    def hold(self, method: str) -> AbstractContextManager[None]:
        """Admission of one Put or Get stream (services.common.streams)."""
        return self.slots.hold(method)

    def _add(self, context: grpc.ServicerContext, kind: str, timeout: float, now: float) -> _Stream:
        stream = _Stream(context, kind, timeout, now)
        with self._lock:
            self._watched.add(stream)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="kvstore-stream-watchdog", daemon=True)
                self._watchdog.start()
        return stream

    def _discard(self, stream: _Stream) -> None:
        with self._lock:
            self._watched.discard(stream)

    def watch_put(self, context: grpc.ServicerContext, requests: Iterator[Any]) -> Iterator[Any]:
        """requests, with the stream cancelled when no message arrives for put_idle_timeout_s."""
        if self.put_idle_timeout_s <= 0:
            yield from requests
            return
        stream = self._add(context, "Put", self.put_idle_timeout_s, time.monotonic())
        it = iter(requests)
        try:
            while True:
                stream.last = time.monotonic()  # from here the stream waits on its client
                try:
                    msg = next(it)
                except StopIteration:
                    return
                # The server stores the message now (the store lock, a RocksDB write stall): not the
                # client's idle time, so the watchdog leaves the stream alone until the next read.
                stream.last = math.inf
                yield msg
        finally:
            self._discard(stream)

    def watch_get(self, context: grpc.ServicerContext, messages: Iterator[bytes]) -> Iterator[bytes]:
        """messages, with the stream cancelled when gRPC cannot hand one to the client for
        get_stall_timeout_s (it stopped reading: its flow-control window stays full)."""
        if self.get_stall_timeout_s <= 0:
            yield from messages
            return
        stream = self._add(context, "Get", self.get_stall_timeout_s, math.inf)
        try:
            for msg in messages:  # reading the store: the server's time, not watched
                # gRPC sends it before it asks for the next one: from here the stream waits on
                # the client taking it.
                stream.last = time.monotonic()
                yield msg
                stream.last = math.inf
        finally:
            self._discard(stream)

    def _watch(self) -> None:
        timeouts = [t for t in (self.put_idle_timeout_s, self.get_stall_timeout_s) if t > 0]
        period = min(1.0, min(timeouts) / 4)
        while not self._stop.wait(period):
            now = time.monotonic()
            with self._lock:
                late = [s for s in self._watched if now - s.last > s.timeout]
                for s in late:
                    self._watched.discard(s)
                self.idle_cancelled += sum(s.kind == "Put" for s in late)
                self.stalled_cancelled += sum(s.kind == "Get" for s in late)
            for s in late:
                # A Put handler's thread is blocked reading the next message, a Get's in gRPC's
                # send of the last one: cancelling the call ends either wait (the Put's read with an
                # RpcError, the Get's send as failed) and so frees the thread and the slot.
                log.warning(
                    "Put stream idle; cancelled" if s.kind == "Put" else "Get stream stalled (the client takes no "
                    "messages); cancelled",
                    extra=kv(waited_s=round(now - s.last, 1), timeout_s=s.timeout, peer=s.context.peer()),
                )
                s.context.cancel()

    def close(self) -> None:
        self._stop.set()


def layout_from_pb(msg: kvstore_pb2.PageLayout) -> KVLayout:
    return KVLayout(
        dtype=msg.dtype,
        page_size=msg.page_size,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        layout=msg.layout,
    )


def _prefixed(exc: SeerError, prefix: str) -> SeerError:
    """The same error with its field qualified by the message's position in the stream."""
    message = str(exc)
    if exc.field and message.startswith(f"{exc.field}: "):
        message = message[len(exc.field) + 2 :]
    field = f"{prefix}.{exc.field}" if exc.field else prefix
    return type(exc)(message, field=field)


class KvStoreServicer(kvstore_pb2_grpc.KvStoreServiceServicer):
    def __init__(
        self,
        store: KvStore,
        max_page_message_bytes: int,
        *,
        max_page_streams: int = 56,
        put_idle_timeout_s: float = 30.0,
        get_stall_timeout_s: float = 30.0,
    ) -> None:
        self.store = store
        self.max_page_message_bytes = max_page_message_bytes
        self.streams = PageStreams(max_page_streams, put_idle_timeout_s, get_stall_timeout_s)

    @rpc
    def Put(
        self, request_iterator: Iterator[PutMessage | BadFrame], context: grpc.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        with self.streams.hold("Put"):
            return self._put(self.streams.watch_put(context, request_iterator))

    def _put(self, request_iterator: Iterator[PutMessage | BadFrame]) -> kvstore_pb2.PutResponse:
        # namespace, layout and request_id may be sent once, on the first message of the stream.
        namespace, request_id = "", ""
        layout: KVLayout | None = None
        stored = stored_bytes = claimed = 0
        first_unclaimed = -1
        chain: list[bytes] = []  # the stream's pages, head first (store.touch_tail_first)
        for i, msg in enumerate(request_iterator):
            prefix = f"requests[{i}]"
            if isinstance(msg, BadFrame):
                raise InvalidArgument(f"malformed PutRequest: {msg.reason}", field=prefix)
            data = msg.data
            if len(data) > self.max_page_message_bytes:
                raise ResourceExhausted(
                    f"{len(data)} bytes exceed the {self.max_page_message_bytes}-byte page limit",
                    field=f"{prefix}.data",
                )
            namespace = msg.namespace or namespace
            request_id = msg.request_id or request_id
            if msg.layout is not None:
                layout = layout_from_pb(msg.layout)
            if layout is None:
                raise InvalidArgument("required on the first message of the stream", field=f"{prefix}.layout")
            with log_context(request_id=request_id):
                try:
                    if not data:
                        # A claim: the client saw the page stored (Exists) and only adds its owner.
                        # A claim can find nothing (released or evicted since the Exists): say
                        # so, or the client would count the page as stored and never resend it.
                        self.store.check_layout(namespace, layout)
                        if self.store.claim(namespace, msg.page_hash, request_id):
                            claimed += 1
                        elif first_unclaimed < 0:
                            first_unclaimed = i
                    elif self.store.put(namespace, layout, msg.page_hash, data, msg.checksum, request_id):
                        stored += 1
                        stored_bytes += len(data)
                except SeerError as exc:
                    raise _prefixed(exc, prefix) from exc
            chain.append(msg.page_hash)
        if namespace:
            self.store.touch_tail_first(namespace, chain)
        return kvstore_pb2.PutResponse(
            stored_pages=stored,
            stored_bytes=stored_bytes,
            claimed_pages=claimed,
            first_unclaimed=max(first_unclaimed, 0),
        )

    @rpc
    def Get(self, request: kvstore_pb2.GetRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Serialized GetResponses (services.kvstore.wire.encode_get)."""
        layout = layout_from_pb(request.layout) if request.HasField("layout") else None
        with self.streams.hold("Get"):
            pages = self.store.get(request.namespace, list(request.page_hashes), layout)
            yield from self.streams.watch_get(
                context, (encode_get(page_hash, data, checksum) for page_hash, data, checksum in pages)
            )

    @rpc
    def Exists(self, request: kvstore_pb2.ExistsRequest, context: grpc.ServicerContext) -> kvstore_pb2.ExistsResponse:
        return kvstore_pb2.ExistsResponse(prefix_pages=self.store.exists(request.namespace, list(request.page_hashes)))

    @rpc
    def Release(
        self, request: kvstore_pb2.ReleaseRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.ReleaseResponse:
        with log_context(request_id=request.request_id):
            n = self.store.release(request.namespace, request.request_id, list(request.page_hashes))
        return kvstore_pb2.ReleaseResponse(released_pages=n)

    @rpc
    def GetKvStats(
        self, request: kvstore_pb2.GetKvStatsRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.GetKvStatsResponse:
        s = self.store.stats()
        return kvstore_pb2.GetKvStatsResponse(
            dram_bytes=s.dram_bytes,
            dram_capacity_bytes=s.dram_capacity_bytes,
            ssd_bytes=s.ssd_bytes,
            ssd_capacity_bytes=s.ssd_capacity_bytes,
            hits=s.hits,
            misses=s.misses,
            evictions=s.evictions,
            namespaces=s.namespaces,
            pages=s.pages,
            dram_pages=s.dram_pages,
            ssd_pages=s.ssd_pages,
            demotions=s.demotions,
            promotions=s.promotions,
            checksum_failures=s.checksum_failures,
            released_pages=s.released_pages,
            dropped_namespaces=s.dropped_namespaces,
            late_puts=s.late_puts,
            meta_write_failures=s.meta_write_failures,
            refused_streams=self.streams.refused,
            idle_put_streams_cancelled=self.streams.idle_cancelled,
            stalled_get_streams_cancelled=self.streams.stalled_cancelled,
            column_families=s.column_families,
            memtable_bytes=s.memtable_bytes,
            flush_failures=s.flush_failures,
            write_stalls=s.write_stalls,
            write_stall_failures=s.write_stall_failures,
            write_stall_seconds=s.write_stall_seconds,
            pending_ssd_records=s.pending_ssd_records,
            chain_links=s.chain_links,
            pending_ssd_bytes=s.pending_ssd_bytes,
            orphan_owner_records=s.orphan_owner_records,
        )


def method_handlers(servicer: KvStoreServicer) -> grpc.GenericRpcHandler:
    """The generated registration, except that Put decodes and Get encodes with wire."""
    pb = kvstore_pb2

    def unary(fn: Any, request: Any, response: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=request.FromString, response_serializer=response.SerializeToString
        )

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Put": grpc.stream_unary_rpc_method_handler(
                servicer.Put,
                request_deserializer=decode_put_frame,
                response_serializer=pb.PutResponse.SerializeToString,
            ),
            # The servicer yields bytes already serialized: no response serializer.
            "Get": grpc.unary_stream_rpc_method_handler(servicer.Get, request_deserializer=pb.GetRequest.FromString),
            "Exists": unary(servicer.Exists, pb.ExistsRequest, pb.ExistsResponse),
            "Release": unary(servicer.Release, pb.ReleaseRequest, pb.ReleaseResponse),
            "GetKvStats": unary(servicer.GetKvStats, pb.GetKvStatsRequest, pb.GetKvStatsResponse),
        },
    )


def open_store(cfg: KvStoreConfig) -> KvStore:
    if cfg.ssd_page_bytes() < cfg.max_page_message_bytes:
        # Valid only beside a DRAM tier holding the largest page (KvStoreConfig.check_largest_page_fits):
        # the SSD tier is then off for every page above the budget. Said once here, as a deliberate
        # setting (a store run on DRAM) and a mistake (a --ssd-bytes too small for the model) look alike.
        log.warning(
            "the SSD tier holds no page larger than its page budget (--ssd-bytes less the WAL cap): such pages "
            "live in DRAM only, evicted instead of demoted when they leave it; raise --ssd-bytes to keep them",
            extra=kv(ssd_bytes=cfg.ssd_bytes, ssd_page_bytes=cfg.ssd_page_bytes(),
                     max_page_message_bytes=cfg.max_page_message_bytes, dram_bytes=cfg.dram_bytes),
        )
    return KvStore(
        cfg.data_dir,
        dram_bytes=cfg.dram_bytes,
        ssd_bytes=cfg.ssd_page_bytes(),  # the WAL's cap reserved out of --ssd-bytes
        keep_versions=cfg.keep_versions,
        verify_checksums=cfg.verify_checksums,
        verify_put_checksums=cfg.verify_put_checksums,
        min_blob_bytes=cfg.min_blob_bytes,
        ssd_wal=cfg.ssd_wal,
        ssd_write_buffer_bytes=cfg.ssd_write_buffer_bytes,
        release_tombstone_s=cfg.release_tombstone_seconds,
    )


def serve(
    cfg: KvStoreConfig, store: KvStore | None = None, *, registry: CollectorRegistry | None = None
) -> tuple[RunningServer, KvStore]:
    """Starts the service (tests and __main__); stopping the server closes the store. With a
    registry, the store's figures and the page-stream counters are registered as metrics there."""
    store = store if store is not None else open_store(cfg)
    servicer = KvStoreServicer(
        store,
        cfg.max_page_message_bytes,
        max_page_streams=cfg.page_stream_limit(),
        put_idle_timeout_s=cfg.put_idle_timeout_seconds,
        get_stall_timeout_s=cfg.get_stall_timeout_seconds,
    )
    if registry is not None:
        metrics.register(store, registry, servicer.streams)

    def add(server: grpc.Server) -> Sequence[str]:
        server.add_generic_rpc_handlers((method_handlers(servicer),))
        return [SERVICE_NAME]

    def stop() -> None:
        servicer.streams.close()
        store.close()

    return start_server("kvstore", cfg, add, on_stop=stop), store

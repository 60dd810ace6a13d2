"""gRPC glue of the kvstore service: converts messages, calls services.kvstore.store, lets @rpc map
typed errors to status codes. No logic here beyond message shape (per-message size limit, fields
inherited within one Put stream).

Put and Get carry pages: their messages are (de)serialized by services.kvstore.wire (same wire
format, fewer page copies) instead of the generated classes; the other RPCs use the generated ones."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

from services.common.errors import InvalidArgument, ResourceExhausted, SeerError
from services.common.grpcutil import rpc
from services.common.kvlayout import KVLayout
from services.common.log import log_context
from services.common.server import RunningServer, start_server
from services.kvstore.config import KvStoreConfig
from services.kvstore.store import KvStore
from services.kvstore.wire import BadFrame, PutMessage, decode_put_frame, encode_get

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KvStoreService"].full_name


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
    def __init__(self, store: KvStore, max_page_message_bytes: int) -> None:
        self.store = store
        self.max_page_message_bytes = max_page_message_bytes

    @rpc
    def Put(
        self, request_iterator: Iterator[PutMessage | BadFrame], context: grpc.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        # namespace, layout and request_id may be sent once, on the first message of the stream.
        namespace, request_id = "", ""
        layout: KVLayout | None = None
        stored = stored_bytes = claimed = 0
        first_unclaimed = -1
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
        for page_hash, data, checksum in self.store.get(request.namespace, list(request.page_hashes), layout):
            yield encode_get(page_hash, data, checksum)

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
    return KvStore(
        cfg.data_dir,
        dram_bytes=cfg.dram_bytes,
        ssd_bytes=cfg.ssd_bytes,
        keep_versions=cfg.keep_versions,
        verify_checksums=cfg.verify_checksums,
        verify_put_checksums=cfg.verify_put_checksums,
        min_blob_bytes=cfg.min_blob_bytes,
        ssd_wal=cfg.ssd_wal,
    )


def serve(cfg: KvStoreConfig, store: KvStore | None = None) -> tuple[RunningServer, KvStore]:
    """Starts the service (tests and __main__); stopping the server closes the store."""
    store = store if store is not None else open_store(cfg)
    servicer = KvStoreServicer(store, cfg.max_page_message_bytes)

    def add(server: grpc.Server) -> Sequence[str]:
        server.add_generic_rpc_handlers((method_handlers(servicer),))
        return [SERVICE_NAME]

    return start_server("kvstore", cfg, add, on_stop=store.close), store

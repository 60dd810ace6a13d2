"""Copy-lean codec of the two page-carrying messages, PutRequest and GetResponse.

Same bytes on the wire as protos/seer/v1/kvstore.proto (any protobuf peer can talk to it; the tests
check both directions against the generated classes); it only avoids the generated classes' copies
of the page bytes, which decide throughput at ~1 GB/s:

- encode: the generated path copies the page into the message (assignment) and again into the
  serialized string; here the small fields are serialized by protobuf and the page is appended as
  field `data` with one join (protobuf parsers accept fields in any order).
- decode: the generated path copies the received string into an arena and again on every `.data`
  access; here `data` is a memoryview into the received bytes (no copy). The view keeps the
  received message alive, which is the page plus a few dozen bytes.

- echo: GetResponse is numbered to be wire-compatible with PutRequest (kvstore.proto), so a page
  that arrived by Put is answered with the very bytes of its PutRequest (`echo_frame`): the server
  then sends every page with no copy of its own (gRPC still copies it into its send buffer).

Pure (no gRPC): the server and the client install these as (de)serializers of Put and Get.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from seer.v1 import kvstore_pb2

# Field numbers and wire types (kvstore.proto; protobuf encoding spec).
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# PutRequest.data = 4 = GetResponse.data (the two messages share their page fields' numbers).
_DATA_TAG = bytes([(4 << 3) | _LEN])
_PAGE_HASH, _DATA, _CHECKSUM = 3, 4, 7  # in both messages


class DecodeError(ValueError):
    """Malformed protobuf bytes."""


@dataclass(frozen=True, slots=True)
class PutMessage:
    """A decoded PutRequest; `data` views the received bytes. Unset fields are empty / None."""

    namespace: str
    layout: kvstore_pb2.PageLayout | None
    page_hash: bytes
    data: memoryview
    checksum: int
    request_id: str


@dataclass(frozen=True, slots=True)
class GetMessage:
    """A decoded GetResponse; `data` views the received bytes."""

    page_hash: bytes
    data: memoryview
    checksum: int
    found: bool


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise DecodeError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise DecodeError("varint longer than 10 bytes")


def _fields(raw: bytes | memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) per field in order: varint/fixed as int, LEN as a view."""
    buf = memoryview(raw)
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        value: int | memoryview
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type == _LEN:
            size, pos = _read_varint(buf, pos)
            if pos + size > end:
                raise DecodeError(f"field {number}: {size} bytes announced, {end - pos} left")
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type in (_I64, _I32):
            width = 8 if wire_type == _I64 else 4
            if pos + width > end:
                raise DecodeError(f"field {number}: truncated fixed{width * 8}")
            value, pos = int.from_bytes(buf[pos : pos + width], "little"), pos + width
        else:  # 3/4: groups (proto2 only), 6/7: invalid
            raise DecodeError(f"field {number}: unsupported wire type {wire_type}")
        yield number, wire_type, value


def _as_view(value: int | memoryview, number: int) -> memoryview:
    if not isinstance(value, memoryview):
        raise DecodeError(f"field {number}: expected length-delimited, got a number")
    return value


def _as_int(value: int | memoryview, number: int) -> int:
    if isinstance(value, memoryview):
        raise DecodeError(f"field {number}: expected a number, got length-delimited")
    return value


def _text(view: memoryview, number: int) -> str:
    try:
        return str(view, "utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"field {number}: invalid UTF-8") from exc


_EMPTY = memoryview(b"")


# ---------------------------------------------------------------------------- PutRequest
def encode_put(
    page_hash: bytes,
    data: bytes | memoryview,
    checksum: int,
    *,
    namespace: str = "",
    layout: kvstore_pb2.PageLayout | None = None,
    request_id: str = "",
) -> bytes:
    """A serialized PutRequest (one page copy: the join)."""
    head = kvstore_pb2.PutRequest(
        namespace=namespace, layout=layout, page_hash=page_hash, checksum=checksum, request_id=request_id
    ).SerializeToString()
    if not len(data):
        return head
    return b"".join((head, _DATA_TAG, _varint(len(data)), data))


def decode_put(raw: bytes) -> PutMessage:
    """A PutRequest from its bytes; unknown fields are skipped, a repeated scalar field keeps the
    last value and a repeated `layout` is merged, as protobuf parsers do."""
    namespace = request_id = ""
    page_hash = b""
    data = _EMPTY
    checksum = 0
    layout: kvstore_pb2.PageLayout | None = None
    for number, _wire_type, value in _fields(raw):
        if number == 1:
            namespace = _text(_as_view(value, number), number)
        elif number == 2:
            layout = layout if layout is not None else kvstore_pb2.PageLayout()
            layout.MergeFromString(bytes(_as_view(value, number)))
        elif number == _PAGE_HASH:
            page_hash = bytes(_as_view(value, number))
        elif number == _DATA:
            data = _as_view(value, number)
        elif number == _CHECKSUM:
            checksum = _as_int(value, number) & 0xFFFFFFFFFFFFFFFF
        elif number == 6:
            request_id = _text(_as_view(value, number), number)
    return PutMessage(namespace, layout, page_hash, data, checksum, request_id)


# ---------------------------------------------------------------------------- GetResponse
def echo_frame(data: bytes | memoryview, page_hash: bytes, checksum: int) -> bytes | None:
    """The received PutRequest that stored this page, when `data` is a view into it (decode_put's
    views are: the store keeps them as they came): a valid GetResponse for the page as it is. None
    when data is not such a view, or the frame it views is not a Put of this very page."""
    frame = data.obj if isinstance(data, memoryview) else None
    if not isinstance(frame, bytes):
        return None
    try:
        msg = decode_put(frame)
    except DecodeError:
        return None
    # The store took `data` from this frame's last data field, which decode_put also returns; the
    # hash, checksum and length confirm the frame is the Put of this page.
    if msg.page_hash != page_hash or msg.checksum != checksum or len(msg.data) != len(data):
        return None
    return frame


def encode_get(page_hash: bytes, data: bytes | memoryview | None, checksum: int = 0) -> bytes:
    """A serialized GetResponse: found with its data (the stored Put frame itself when there is
    one, see echo_frame), or (data None) missing."""
    if data is None:
        return kvstore_pb2.GetResponse(page_hash=page_hash, missing=True).SerializeToString()
    frame = echo_frame(data, page_hash, checksum)
    if frame is not None:
        return frame
    head = kvstore_pb2.GetResponse(page_hash=page_hash, checksum=checksum).SerializeToString()
    if not len(data):
        return head
    return b"".join((head, _DATA_TAG, _varint(len(data)), data))


def decode_get(raw: bytes) -> GetMessage:
    """A GetResponse from its bytes; PutRequest's fields in an echoed frame are skipped as unknown."""
    page_hash = b""
    data = _EMPTY
    checksum = 0
    missing = False
    for number, _wire_type, value in _fields(raw):
        if number == _PAGE_HASH:
            page_hash = bytes(_as_view(value, number))
        elif number == _DATA:
            data = _as_view(value, number)
        elif number == _CHECKSUM:
            checksum = _as_int(value, number) & 0xFFFFFFFFFFFFFFFF
        elif number == 8:
            missing = _as_int(value, number) != 0
    return GetMessage(page_hash, data, checksum, not missing)

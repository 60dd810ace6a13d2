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

from google.protobuf import message as protobuf_message
from seer.v1 import kvstore_pb2

# Field numbers and wire types (kvstore.proto; protobuf encoding spec).
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# The two messages share their page fields' numbers.
_PAGE_HASH, _DATA, _CHECKSUM = 3, 4, 7  # in both messages
_DATA_TAG = bytes([(_DATA << 3) | _LEN])
_NAMESPACE, _LAYOUT, _REQUEST_ID = 1, 2, 6  # PutRequest only
_MISSING = 8  # GetResponse only
# Wire type per field number (kvstore.proto). A field of another number, or of a known number but
# another wire type, is an unknown field and skipped, as protobuf parsers do.
_PUT_SCHEMA = {_NAMESPACE: _LEN, _LAYOUT: _LEN, _PAGE_HASH: _LEN, _DATA: _LEN, _REQUEST_ID: _LEN, _CHECKSUM: _I64}
_GET_SCHEMA = {_PAGE_HASH: _LEN, _DATA: _LEN, _CHECKSUM: _I64, _MISSING: _VARINT}


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


def _view(value: int | memoryview) -> memoryview:
    assert isinstance(value, memoryview)  # the schema checked the wire type
    return value


def _int(value: int | memoryview) -> int:
    assert not isinstance(value, memoryview)
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
    for number, wire_type, value in _fields(raw):
        if _PUT_SCHEMA.get(number) != wire_type:
            continue
        if number == _NAMESPACE:
            namespace = _text(_view(value), number)
        elif number == _LAYOUT:
            layout = layout if layout is not None else kvstore_pb2.PageLayout()
            layout.MergeFromString(bytes(_view(value)))
        elif number == _PAGE_HASH:
            page_hash = bytes(_view(value))
        elif number == _DATA:
            data = _view(value)
        elif number == _CHECKSUM:
            checksum = _int(value)
        elif number == _REQUEST_ID:
            request_id = _text(_view(value), number)
    return PutMessage(namespace, layout, page_hash, data, checksum, request_id)


@dataclass(frozen=True)
class BadFrame:
    """A Put message that did not decode (decode_put_frame): the servicer answers it with
    INVALID_ARGUMENT naming its position, instead of gRPC's INTERNAL for a deserializer error."""

    reason: str


def decode_put_frame(raw: bytes) -> PutMessage | BadFrame:
    """decode_put for the gRPC handler: a malformed message becomes a BadFrame, not an exception."""
    try:
        return decode_put(raw)
    except (DecodeError, protobuf_message.DecodeError) as exc:
        return BadFrame(str(exc) or type(exc).__name__)


# ---------------------------------------------------------------------------- GetResponse
def echo_frame(data: bytes | memoryview, page_hash: bytes, checksum: int) -> bytes | None:
    """The received PutRequest that stored this page, when `data` is a view into it (decode_put's
    views are: the store keeps them as they came): a valid GetResponse for the page as it is. None
    when data is not such a view, or the frame it views is not a Put of this very page, or it holds
    any field beyond PutRequest's own (one could mean something else in a GetResponse)."""
    frame = data.obj if isinstance(data, memoryview) else None
    if not isinstance(frame, bytes):
        return None
    got_hash, got_checksum, got_len = b"", 0, 0
    try:
        for number, wire_type, value in _fields(frame):
            if _PUT_SCHEMA.get(number) != wire_type:
                return None
            if number == _PAGE_HASH:
                got_hash = bytes(_view(value))
            elif number == _CHECKSUM:
                got_checksum = _int(value)
            elif number == _DATA:
                got_len = len(_view(value))
    except DecodeError:
        return None
    # The store took `data` from this frame's last data field (decode_put keeps the last); the
    # hash, checksum and length confirm the frame is the Put of this page.
    if got_hash != page_hash or got_checksum != checksum or got_len != len(data):
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
    for number, wire_type, value in _fields(raw):
        if _GET_SCHEMA.get(number) != wire_type:
            continue
        if number == _PAGE_HASH:
            page_hash = bytes(_view(value))
        elif number == _DATA:
            data = _view(value)
        elif number == _CHECKSUM:
            checksum = _int(value)
        elif number == _MISSING:
            missing = _int(value) != 0
    return GetMessage(page_hash, data, checksum, not missing)

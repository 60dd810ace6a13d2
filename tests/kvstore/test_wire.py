"""services.kvstore.wire against the generated protobuf classes, in both directions."""

from __future__ import annotations

import os

import pytest
import xxhash
from seer.v1 import kvstore_pb2

from services.kvstore.checksum import page_checksum
from services.kvstore.wire import DecodeError, decode_get, decode_put, echo_frame, encode_get, encode_put

LAYOUT_PB = kvstore_pb2.PageLayout(
    dtype="float32", page_size=16, num_layers=30, num_kv_heads=3, head_dim=64, layout="layer,kv,token,head,dim"
)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_383, 16_384, 737_280])
def test_encode_put_parses_as_the_generated_message(size: int) -> None:
    data = os.urandom(size)
    h = os.urandom(32)
    raw = encode_put(h, data, 0xFFFF_FFFF_FFFF_FFFF, namespace="m@v1", layout=LAYOUT_PB, request_id="req-1")
    msg = kvstore_pb2.PutRequest.FromString(raw)
    assert msg.page_hash == h and msg.data == data and msg.checksum == 0xFFFF_FFFF_FFFF_FFFF
    assert msg.namespace == "m@v1" and msg.request_id == "req-1" and msg.layout == LAYOUT_PB
    # A later message of the stream: only hash, data, checksum.
    later = kvstore_pb2.PutRequest.FromString(encode_put(h, data, 7))
    assert not later.HasField("layout") and later.namespace == "" and later.data == data and later.checksum == 7


def test_decode_put_reads_what_the_generated_class_writes() -> None:
    data = os.urandom(4096)
    h = os.urandom(32)
    raw = kvstore_pb2.PutRequest(
        namespace="m@v1", layout=LAYOUT_PB, page_hash=h, data=data, checksum=123456789, request_id="r"
    ).SerializeToString()
    msg = decode_put(raw)
    assert msg.namespace == "m@v1" and msg.request_id == "r" and msg.layout == LAYOUT_PB
    assert msg.page_hash == h and bytes(msg.data) == data and msg.checksum == 123456789
    # The page is a view into the received bytes, not a copy.
    assert isinstance(msg.data, memoryview) and msg.data.obj is raw
    bare = decode_put(kvstore_pb2.PutRequest(page_hash=h).SerializeToString())
    assert bare.layout is None and len(bare.data) == 0 and bare.namespace == "" and bare.checksum == 0


def test_decode_skips_unknown_fields_and_keeps_the_last_scalar() -> None:
    h = os.urandom(32)
    base = kvstore_pb2.PutRequest(page_hash=h, data=b"abc", checksum=1).SerializeToString()
    unknown = (
        bytes([(15 << 3) | 0])
        + b"\x96\x01"  # varint field 15
        + bytes([(16 << 3) | 1, 1])
        + b"\x00" * 8  # fixed64 field 16 (two-byte tag)
        + bytes([(17 << 3) | 5, 1])
        + b"\x00" * 4  # fixed32 field 17
        + bytes([(18 << 3) | 2, 1])
        + b"\x03xyz"  # bytes field 18
    )
    later_checksum = bytes([(7 << 3) | 1]) + (9).to_bytes(8, "little")  # fixed64 field 7, again
    raw = base + unknown + later_checksum
    # The generated parser agrees on what this means.
    ref = kvstore_pb2.PutRequest.FromString(raw)
    msg = decode_put(raw)
    assert (msg.page_hash, bytes(msg.data), msg.checksum) == (ref.page_hash, ref.data, ref.checksum) == (h, b"abc", 9)


@pytest.mark.parametrize(
    "raw",
    [
        bytes([(4 << 3) | 2, 10]) + b"short",  # length beyond the end
        bytes([(6 << 3) | 2, 0x80]),  # truncated varint (a length)
        bytes([(7 << 3) | 1, 1, 2, 3]),  # truncated fixed64
        bytes([(1 << 3) | 2, 2]) + b"\xff\xfe",  # namespace not UTF-8
        bytes([(3 << 3) | 3]),  # group wire type
        bytes([0 << 3 | 0, 0]),  # field number 0
    ],
)
def test_malformed_put_is_a_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_put(raw)


def test_a_known_field_with_another_wire_type_is_skipped_as_protobuf_does() -> None:
    """protobuf parses a known field number sent with another wire type as an unknown field; the
    codec must agree, or a checksum sent as a varint would verify here and read 0 elsewhere."""
    h = os.urandom(32)
    raw = (
        kvstore_pb2.PutRequest(page_hash=h, data=b"abc", checksum=11).SerializeToString()
        + bytes([(4 << 3) | 0, 5])  # data as a varint
        + bytes([(7 << 3) | 0, 9])  # checksum as a varint
    )
    ref = kvstore_pb2.PutRequest.FromString(raw)
    msg = decode_put(raw)
    assert (msg.page_hash, bytes(msg.data), msg.checksum) == (ref.page_hash, ref.data, ref.checksum) == (h, b"abc", 11)
    get_raw = kvstore_pb2.GetResponse(page_hash=h).SerializeToString() + bytes([(8 << 3) | 2, 1, 1])  # missing as LEN
    assert not kvstore_pb2.GetResponse.FromString(get_raw).missing
    assert decode_get(get_raw).found


@pytest.mark.parametrize("size", [0, 200, 737_280])
def test_get_response_both_directions(size: int) -> None:
    data = os.urandom(size)
    h = os.urandom(32)
    ref = kvstore_pb2.GetResponse.FromString(encode_get(h, data, 42))
    assert (ref.page_hash, ref.data, ref.checksum, ref.missing) == (h, data, 42, False)
    missing = kvstore_pb2.GetResponse.FromString(encode_get(h, None))
    assert missing.page_hash == h and missing.missing and missing.data == b""
    raw = kvstore_pb2.GetResponse(page_hash=h, data=data, checksum=42).SerializeToString()
    msg = decode_get(raw)
    assert (msg.page_hash, bytes(msg.data), msg.checksum, msg.found) == (h, data, 42, True)
    assert not decode_get(kvstore_pb2.GetResponse(page_hash=h, missing=True).SerializeToString()).found


@pytest.mark.parametrize("first_of_stream", [True, False])
def test_a_stored_put_frame_is_echoed_as_a_valid_get_response(first_of_stream: bool) -> None:
    """The server answers with the bytes of the PutRequest that stored the page (no copy): they are
    the very object received, and both the generated class and decode_get read them as the page."""
    data = os.urandom(737_280)
    h = os.urandom(32)
    extra = {"namespace": "m@v1", "layout": LAYOUT_PB, "request_id": "req-7"} if first_of_stream else {}
    frame = encode_put(h, data, page_checksum(data), **extra)  # type: ignore[arg-type]
    stored = decode_put(frame).data  # what the store keeps
    out = encode_get(h, stored, page_checksum(data))
    assert out is frame
    ref = kvstore_pb2.GetResponse.FromString(out)
    assert (ref.page_hash, ref.data, ref.checksum, ref.missing) == (h, data, page_checksum(data), False)
    msg = decode_get(out)
    assert (msg.page_hash, bytes(msg.data), msg.checksum, msg.found) == (h, data, page_checksum(data), True)


def test_echo_only_for_the_put_of_that_very_page() -> None:
    data = os.urandom(4096)
    h = os.urandom(32)
    stored = decode_put(encode_put(h, data, page_checksum(data))).data
    assert echo_frame(stored, h, page_checksum(data)) is not None
    assert echo_frame(stored, os.urandom(32), page_checksum(data)) is None  # another page's hash
    assert echo_frame(stored, h, page_checksum(data) ^ 1) is None  # another checksum
    assert echo_frame(stored[:-1], h, page_checksum(data)) is None  # a part of the page
    assert echo_frame(data, h, page_checksum(data)) is None  # plain bytes (an SSD read)
    assert echo_frame(memoryview(b"\xff" * 16), h, 0) is None  # a view into bytes that are no frame
    # Re-encoded when not echoable: the same GetResponse content.
    got = kvstore_pb2.GetResponse.FromString(encode_get(h, data, page_checksum(data)))
    assert (got.page_hash, got.data, got.checksum) == (h, data, page_checksum(data))


def test_a_frame_with_fields_beyond_put_request_is_not_echoed() -> None:
    """A field PutRequest does not define (8 is GetResponse.missing) or a known one with another
    wire type could read differently as a GetResponse: such a frame is re-encoded, not echoed."""
    data = os.urandom(4096)
    h = os.urandom(32)
    for extra in (bytes([(8 << 3) | 0, 1]), bytes([(8 << 3) | 2, 1, 1]), bytes([(6 << 3) | 0, 1])):
        stored = decode_put(encode_put(h, data, page_checksum(data)) + extra).data
        assert echo_frame(stored, h, page_checksum(data)) is None
        got = kvstore_pb2.GetResponse.FromString(encode_get(h, stored, page_checksum(data)))
        assert (got.page_hash, got.data, got.missing) == (h, data, False)


def test_checksum_is_xxh3_64_for_every_buffer_type() -> None:
    data = os.urandom(737_280 + 3)
    want = xxhash.xxh3_64_intdigest(data)
    assert page_checksum(data) == want
    assert page_checksum(memoryview(data)) == want
    assert page_checksum(bytearray(data)) == want
    assert page_checksum(memoryview(data)[5:1000]) == xxhash.xxh3_64_intdigest(data[5:1000])
    assert page_checksum(b"") == 0x2D06800538D394C2  # XXH3-64 of the empty input (xxHash's test vector)
    flipped = bytearray(data)
    flipped[12345] ^= 1
    assert page_checksum(flipped) != want

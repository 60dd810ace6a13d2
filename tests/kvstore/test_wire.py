"""services.kvstore.wire against the generated protobuf classes, in both directions."""

from __future__ import annotations

import os
import zlib

import pytest
from seer.v1 import kvstore_pb2

from services.kvstore.checksum import IMPLEMENTATION, crc32
from services.kvstore.wire import DecodeError, decode_get, decode_put, encode_get, encode_put

LAYOUT_PB = kvstore_pb2.PageLayout(
    dtype="float32", page_size=16, num_layers=30, num_kv_heads=3, head_dim=64, layout="layer,kv,token,head,dim"
)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16_383, 16_384, 737_280])
def test_encode_put_parses_as_the_generated_message(size: int) -> None:
    data = os.urandom(size)
    h = os.urandom(32)
    raw = encode_put(h, data, 0xFFFF_FFFF, namespace="m@v1", layout=LAYOUT_PB, request_id="req-1")
    msg = kvstore_pb2.PutRequest.FromString(raw)
    assert msg.page_hash == h and msg.data == data and msg.checksum == 0xFFFF_FFFF
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
    later_checksum = bytes([(5 << 3) | 0, 9])
    raw = base + unknown + later_checksum
    # The generated parser agrees on what this means.
    ref = kvstore_pb2.PutRequest.FromString(raw)
    msg = decode_put(raw)
    assert (msg.page_hash, bytes(msg.data), msg.checksum) == (ref.page_hash, ref.data, ref.checksum) == (h, b"abc", 9)


@pytest.mark.parametrize(
    "raw",
    [
        bytes([(4 << 3) | 2, 10]) + b"short",  # length beyond the end
        bytes([(5 << 3) | 0, 0x80]),  # truncated varint
        bytes([(4 << 3) | 0, 5]),  # data as a number
        bytes([(1 << 3) | 2, 2]) + b"\xff\xfe",  # namespace not UTF-8
        bytes([(3 << 3) | 3]),  # group wire type
        bytes([0 << 3 | 0, 0]),  # field number 0
    ],
)
def test_malformed_put_is_a_decode_error(raw: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_put(raw)


@pytest.mark.parametrize("size", [0, 200, 737_280])
def test_get_response_both_directions(size: int) -> None:
    data = os.urandom(size)
    h = os.urandom(32)
    ref = kvstore_pb2.GetResponse.FromString(encode_get(h, data, 42))
    assert (ref.page_hash, ref.data, ref.checksum, ref.found) == (h, data, 42, True)
    missing = kvstore_pb2.GetResponse.FromString(encode_get(h, None))
    assert missing.page_hash == h and not missing.found and missing.data == b""
    raw = kvstore_pb2.GetResponse(page_hash=h, data=data, checksum=42, found=True).SerializeToString()
    msg = decode_get(raw)
    assert (msg.page_hash, bytes(msg.data), msg.checksum, msg.found) == (h, data, 42, True)
    assert not decode_get(kvstore_pb2.GetResponse(page_hash=h).SerializeToString()).found


def test_crc32_matches_zlib_for_every_buffer_type() -> None:
    data = os.urandom(737_280 + 3)
    want = zlib.crc32(data)
    assert crc32(data) == want
    assert crc32(memoryview(data)) == want
    assert crc32(bytearray(data)) == want
    assert crc32(memoryview(data)[5:1000]) == zlib.crc32(data[5:1000])
    assert crc32(b"") == 0
    assert IMPLEMENTATION in ("isal", "zlib-ng", "zlib")

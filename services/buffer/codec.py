"""Compact value encoding for RocksDB records: a JSON header plus raw little-endian arrays.

Token ids and logprobs dominate the stored bytes; JSON would triple them and lose float32 identity
(duplicate-commit detection compares logprobs bit for bit), so they travel as int32 / float32 arrays.

Layout: b"SB1" | u32 header length | JSON {"m": meta, "a": [[name, typecode, count], ...]} | arrays.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from typing import Any

MAGIC = b"SB1"
_HEADER = struct.Struct("<I")
_TYPECODES = {"i": 4, "f": 4}  # int32, float32

if array("i").itemsize != 4 or array("f").itemsize != 4:  # pragma: no cover - exotic platforms
    raise ImportError("codec: needs 4-byte array('i') and array('f')")


def i32(values: Any = ()) -> array[int]:
    return array("i", values)


def f32(values: Any = ()) -> array[float]:
    return array("f", values)


def encode(meta: dict[str, Any], arrays: dict[str, array[Any]] | None = None) -> bytes:
    arrays = arrays or {}
    spec = [[name, a.typecode, len(a)] for name, a in arrays.items()]
    header = json.dumps({"m": meta, "a": spec}, separators=(",", ":"), sort_keys=True).encode()
    parts = [MAGIC, _HEADER.pack(len(header)), header]
    for a in arrays.values():
        if a.typecode not in _TYPECODES:
            raise ValueError(f"codec: unsupported array type {a.typecode!r}")
        if sys.byteorder != "little":  # pragma: no cover
            a = array(a.typecode, a)
            a.byteswap()
        parts.append(a.tobytes())
    return b"".join(parts)


def decode(data: bytes) -> tuple[dict[str, Any], dict[str, array[Any]]]:
    if data[:3] != MAGIC:
        raise ValueError("codec: not a buffer record (bad magic)")
    (hlen,) = _HEADER.unpack_from(data, 3)
    start = 3 + _HEADER.size
    header = json.loads(data[start : start + hlen])
    pos = start + hlen
    arrays: dict[str, array[Any]] = {}
    for name, code, count in header["a"]:
        nbytes = _TYPECODES[code] * count
        a: array[Any] = array(code)
        a.frombytes(data[pos : pos + nbytes])
        if sys.byteorder != "little":  # pragma: no cover
            a.byteswap()
        arrays[name] = a
        pos += nbytes
    if pos != len(data):
        raise ValueError("codec: trailing or missing bytes")
    return header["m"], arrays

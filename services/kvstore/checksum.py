"""CRC-32 of page bytes: the checksum field of the kvstore protocol (zlib's CRC-32, IEEE polynomial).

zlib's crc32 runs at ~1.2-1.5 GB/s on this CPU (Zen3, zlib 1.2.13 has no PCLMUL path), and a page
is checksummed up to three times per round trip (client Put, server Put, client Get): at 1 GB/s
of transfer that alone would eat most of the time. ISA-L (the `isal` wheel) computes the same
CRC-32 with carry-less multiplication at ~4-5 GB/s; zlib-ng likewise. The fastest one importable
is used; values are identical, so writers and readers may use different implementations. All of
them release the GIL for large buffers, so a check overlaps the transfer of the next page.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

Buffer = bytes | bytearray | memoryview


def _pick() -> tuple[str, Callable[[Buffer], int]]:
    try:
        from isal import isal_zlib

        return "isal", isal_zlib.crc32
    except ImportError:
        pass
    try:
        from zlib_ng import zlib_ng

        return "zlib-ng", zlib_ng.crc32
    except ImportError:
        pass
    return "zlib", zlib.crc32


IMPLEMENTATION, _crc32 = _pick()


def crc32(data: Buffer) -> int:
    """CRC-32 (zlib's) of data, as an unsigned 32-bit int."""
    return _crc32(data) & 0xFFFFFFFF

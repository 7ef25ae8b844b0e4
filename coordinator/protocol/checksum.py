"""``cui_checksum64``, the carrier checksum of protocol.h, in Python. Part of
:mod:`cuinterpose.coordinator.protocol`."""

from __future__ import annotations

import struct

__all__ = [
    "cui_checksum64",
]

# --- checksum -------------------------------------------------------------------------------
_M64 = 0xFFFFFFFFFFFFFFFF
_K_GOLDEN = 0x9E3779B97F4A7C15
_K_WORD = 0xC2B2AE3D27D4EB4F
_K_FIN = 0xFF51AFD7ED558CCD


def cui_checksum64(data: bytes | bytearray | memoryview) -> int:
    """``cui_checksum64`` per protocol.h: the carrier checksum of ``data`` (any length).

    Words are little-endian uint64; a trailing partial word is zero-padded. Pure Python, a
    few MB/s: fine for a digest table (32 bytes per chunk), not for carried bytes. Returns an
    int in [0, 2**64).
    """
    b = bytes(data)
    n = len(b)
    full = n - (n % 8)
    words = struct.unpack_from(f"<{full // 8}Q", b) if full else ()
    if n != full:
        words += (int.from_bytes(b[full:], "little"),)
    h = _K_GOLDEN ^ n
    for w in words:
        h ^= (w * _K_WORD) & _M64
        h = (((h << 31) | (h >> 33)) & _M64) * _K_GOLDEN & _M64
    h ^= h >> 33
    h = (h * _K_FIN) & _M64
    h ^= h >> 33
    return h

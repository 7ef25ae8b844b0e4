"""``cui_checksum64``, the carrier checksum of protocol.h, in Python. Part of
:mod:`cuinterpose.coordinator.protocol`."""

from __future__ import annotations

import array
import sys

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

    Words are little-endian uint64; a trailing partial word is zero-padded. Pure Python,
    about 20 MB/s: a test/verification helper, not a hot path. Returns an int in [0, 2**64).
    """
    mv = memoryview(data).cast("B")
    n = len(mv)
    full = n - (n % 8)
    words = array.array("Q")
    words.frombytes(mv[:full])
    if n != full:
        words.frombytes(bytes(mv[full:]).ljust(8, b"\0"))
    if sys.byteorder != "little":
        words.byteswap()
    h = _K_GOLDEN ^ n
    for w in words:
        h ^= (w * _K_WORD) & _M64
        h = (((h << 31) | (h >> 33)) & _M64) * _K_GOLDEN & _M64
    h ^= h >> 33
    h = (h * _K_FIN) & _M64
    h ^= h >> 33
    return h

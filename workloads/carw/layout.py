"""carw's memory layout and values: pure functions, no CUDA (unit-tested in tests/carw).

Every rank allocates three ranges with ``cuMemAlloc`` (the driver call behind ``cudaMalloc``):

- **data**: two slots (step parity ``s % 2``), each a 16-byte header (``seq`` u64, ``check``
  u64) then ``elems`` little-endian u64 contributions. Two slots suffice: a rank writes step
  ``s + 2`` into slot ``s % 2`` only after every peer signalled ``s + 1``, which a peer does
  only after it finished reading step ``s``.
- **signal**: one u64, the last step whose contribution this rank has written (0 before the
  first), then at :data:`PROBE_OFFSET` the probe word (:func:`probe_value`, written after each
  resume), padded to :data:`SIGNAL_BYTES`.
- **table** (private, not exported): the rank-data table, ``world`` rows of two u64 (the data
  VA and the signal VA of rank r, this rank's own at its own row), as vLLM's custom
  all-reduce keeps its peers' pointers on the device. Every step reads it to find the peers.

Values: element ``i`` of rank ``r``'s contribution at step ``s`` is :func:`contribution`, a
32-bit mix of (r, s, i), so sums over at most 2**32 ranks never wrap a u64 and a buffer read
from the wrong rank, the wrong step or the wrong VA gives a different sum.
"""

from __future__ import annotations

import struct
from array import array

HEADER_BYTES = 16
SIGNAL_BYTES = 64
PROBE_OFFSET = 8  # in the signal range: the probe word written after each resume
ROW_BYTES = 16  # table row: data VA u64, signal VA u64
MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1
IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE (cuda.h)
SHARES = ("ipc", "pidfd", "host")  # --share: see share.py


def slot_bytes(elems: int) -> int:
    """Bytes of one data slot: header plus ``elems`` u64."""
    return HEADER_BYTES + 8 * elems


def data_bytes(elems: int) -> int:
    """Bytes of the data range: two slots."""
    return 2 * slot_bytes(elems)


def slot_offset(step: int, elems: int) -> int:
    """Byte offset of the slot that holds ``step`` (step parity)."""
    return (step % 2) * slot_bytes(elems)


def contribution(rank: int, step: int, elems: int) -> array:
    """Rank ``rank``'s ``elems`` u64 values at ``step`` (each < 2**32)."""
    a = (rank + 1) * 0x9E3779B1
    b = step * 0x85EBCA77
    return array("Q", (((i * 0xC2B2AE3D) ^ a) + b & MASK32 for i in range(elems)))


def checksum(values: array, step: int, rank: int) -> int:
    """The header's ``check`` word: a u64 over the values, the step and the rank."""
    h = (0xCBF29CE484222325 ^ (step << 20) ^ rank) & MASK64
    for v in values[:: max(1, len(values) // 64)]:
        h = ((h ^ v) * 0x100000001B3) & MASK64
    return (h + sum(values)) & MASK64


def expected_sum(world: int, step: int, elems: int) -> array:
    """The exact all-reduce result at ``step``: the element-wise sum of every rank's values."""
    out = array("Q", bytes(8 * elems))
    for r in range(world):
        c = contribution(r, step, elems)
        for i in range(elems):
            out[i] += c[i]
    return out


def encode_slot(rank: int, step: int, elems: int) -> bytes:
    """The bytes rank ``rank`` writes into its slot for ``step``: header then values."""
    vals = contribution(rank, step, elems)
    return struct.pack("<QQ", step, checksum(vals, step, rank)) + vals.tobytes()


def decode_slot(buf: bytes, elems: int) -> tuple[int, int, array]:
    """(seq, check, values) of a slot's bytes; ValueError when ``buf`` is not one slot."""
    if len(buf) != slot_bytes(elems):
        raise ValueError(f"slot is {len(buf)} bytes, expected {slot_bytes(elems)}")
    seq, check = struct.unpack_from("<QQ", buf)
    vals = array("Q")
    vals.frombytes(buf[HEADER_BYTES:])
    return seq, check, vals


def encode_table(rows: list[tuple[int, int]]) -> bytes:
    """The table's bytes from ``[(data_va, signal_va)]`` in rank order."""
    return b"".join(struct.pack("<QQ", d, s) for d, s in rows)


def decode_table(buf: bytes) -> list[tuple[int, int]]:
    """``[(data_va, signal_va)]`` from the table's bytes (a multiple of :data:`ROW_BYTES`)."""
    if len(buf) % ROW_BYTES:
        raise ValueError(f"table is {len(buf)} bytes, not a multiple of {ROW_BYTES}")
    return [struct.unpack_from("<QQ", buf, o) for o in range(0, len(buf), ROW_BYTES)]


def probe_value(resumes: int, rank: int) -> int:
    """The probe word rank ``rank`` writes after its ``resumes``-th resume (never 0)."""
    return (resumes << 16) | (rank + 1)


def encode_u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def decode_u64(buf: bytes) -> int:
    return struct.unpack_from("<Q", buf)[0]


def encode_signal(step: int) -> bytes:
    return struct.pack("<Q", step) + bytes(SIGNAL_BYTES - 8)


def decode_signal(buf: bytes) -> int:
    return struct.unpack_from("<Q", buf)[0]

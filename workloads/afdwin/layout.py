"""Window layout and header codec of the afdwin symmetric window (docs/afdwin.md "Window layout").

Window (one per rank, ``total_bytes`` long, mapped at the base of the rank's reservation)::

    [ flags: int32[num_regions * ring_depth], padded to 256 B ][ slot(0,0) ] ... [ slot(R-1,D-1) ]

Slots are ordered region-major, ring-minor. Inside a slot every field offset is rounded up to
256 B: header int32[7 + experts_per_rank], expand_idx int32[partial_cap], weights
float32[partial_cap], routed_x payload[token_cap x hidden], shared_x payload[shared_cap x hidden].

All sizes and offsets are in bytes. Everything here is pure Python: no CUDA.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Sequence

ALIGN = 256
MAGIC = 0x41464447  # "AFDG"
VERSION = 4
FLAG_SHUTDOWN_BIT = 2  # header word 4, bit 1
FLAG_EMPTY = 0  # flag-word value of an untouched slot
FLAG_REPLY_READY = 1  # constant reply marker, reset to FLAG_EMPTY by the reader
HEADER_HOST_WORDS = 5  # magic, version, layer, num_tokens, flags
HEADER_FIXED_WORDS = 7  # + routed_tokens, segment_start

# Order of the geometry tuple every rank sends before allocating (docs/afdwin.md "Setup", 2).
GEOMETRY_FIELDS = (
    "num_regions",
    "ring_depth",
    "header_words",
    "partial_cap",
    "token_cap",
    "shared_cap",
    "hidden_size",
    "payload_itemsize",
    "slot_bytes",
    "total_bytes",
)


class HeaderError(ValueError):
    """A slot header failed validation (magic, version, routing tail)."""


def align_up(n: int, a: int = ALIGN) -> int:
    """Round ``n`` (bytes, >= 0) up to a multiple of ``a``."""
    return -(-n // a) * a


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Field offsets of one slot, in bytes from the slot start.

    Raises ``ValueError`` for non-positive capacities or an itemsize not in (1, 2, 4, 8).
    """

    experts_per_rank: int
    partial_cap: int
    token_cap: int
    shared_cap: int
    hidden_size: int
    payload_itemsize: int

    def __post_init__(self):
        for name in ("experts_per_rank", "partial_cap", "token_cap", "hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.shared_cap < 0:
            raise ValueError(f"shared_cap must be >= 0, got {self.shared_cap}")
        if self.payload_itemsize not in (1, 2, 4, 8):
            raise ValueError(f"payload_itemsize must be 1, 2, 4 or 8, got {self.payload_itemsize}")

    @property
    def header_words(self) -> int:
        return HEADER_FIXED_WORDS + self.experts_per_rank

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row of routed_x/shared_x."""
        return self.hidden_size * self.payload_itemsize

    @property
    def header_off(self) -> int:
        return 0

    @property
    def expand_idx_off(self) -> int:
        return align_up(self.header_words * 4)

    @property
    def weights_off(self) -> int:
        return align_up(self.expand_idx_off + 4 * self.partial_cap)

    @property
    def routed_x_off(self) -> int:
        return align_up(self.weights_off + 4 * self.partial_cap)

    @property
    def routed_x_bytes(self) -> int:
        return self.token_cap * self.row_bytes

    @property
    def shared_x_off(self) -> int:
        return align_up(self.routed_x_off + self.routed_x_bytes)

    @property
    def shared_x_bytes(self) -> int:
        return self.shared_cap * self.row_bytes

    @property
    def slot_bytes(self) -> int:
        return align_up(self.shared_x_off + self.shared_x_bytes)

    def fields(self) -> dict[str, tuple[int, int]]:
        """``{name: (offset, nbytes)}`` for header, expand_idx, weights, routed_x, shared_x."""
        return {
            "header": (self.header_off, 4 * self.header_words),
            "expand_idx": (self.expand_idx_off, 4 * self.partial_cap),
            "weights": (self.weights_off, 4 * self.partial_cap),
            "routed_x": (self.routed_x_off, self.routed_x_bytes),
            "shared_x": (self.shared_x_off, self.shared_x_bytes),
        }


@dataclasses.dataclass(frozen=True)
class WindowLayout:
    """One rank's window: flag array then ``num_regions * ring_depth`` slots."""

    slot: SlotLayout
    num_regions: int
    ring_depth: int

    def __post_init__(self):
        if self.num_regions <= 0:
            raise ValueError(f"num_regions must be > 0, got {self.num_regions}")
        if self.ring_depth <= 0:
            raise ValueError(f"ring_depth must be > 0, got {self.ring_depth}")

    @property
    def num_flags(self) -> int:
        return self.num_regions * self.ring_depth

    @property
    def flag_bytes(self) -> int:
        return align_up(self.num_flags * 4)

    @property
    def slot_bytes(self) -> int:
        return self.slot.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.flag_bytes + self.num_flags * self.slot_bytes

    def flag_idx(self, region: int, ring: int) -> int:
        """Index into the int32 flag array; raises ``IndexError`` when out of range."""
        self._check(region, ring)
        return region * self.ring_depth + ring

    def flag_off(self, region: int, ring: int) -> int:
        """Byte offset of flag (region, ring) from the window base."""
        return 4 * self.flag_idx(region, ring)

    def slot_off(self, region: int, ring: int) -> int:
        """Byte offset of slot (region, ring) from the window base."""
        return self.flag_bytes + self.flag_idx(region, ring) * self.slot_bytes

    def _check(self, region: int, ring: int) -> None:
        if not (0 <= region < self.num_regions):
            raise IndexError(f"region {region} outside [0, {self.num_regions})")
        if not (0 <= ring < self.ring_depth):
            raise IndexError(f"ring {ring} outside [0, {self.ring_depth})")

    def geometry(self) -> tuple[int, ...]:
        """The geometry tuple, in ``GEOMETRY_FIELDS`` order."""
        s = self.slot
        return (
            self.num_regions,
            self.ring_depth,
            s.header_words,
            s.partial_cap,
            s.token_cap,
            s.shared_cap,
            s.hidden_size,
            s.payload_itemsize,
            s.slot_bytes,
            self.total_bytes,
        )


def check_geometry(tuples: Sequence[Sequence[int]]) -> None:
    """Compare every rank's geometry tuple column by column (rank order = list order).

    Raises ``GeometryMismatch`` for the first column holding more than one distinct value,
    and ``ValueError`` when a tuple has the wrong length.
    """
    for r, t in enumerate(tuples):
        if len(t) != len(GEOMETRY_FIELDS):
            raise ValueError(
                f"rank {r} sent {len(t)} geometry values, expected {len(GEOMETRY_FIELDS)}"
            )
    for col, name in enumerate(GEOMETRY_FIELDS):
        values = [int(t[col]) for t in tuples]
        if len(set(values)) > 1:
            raise GeometryMismatch(name, values)


class GeometryMismatch(ValueError):
    """Ranks disagree on one geometry field. ``field``: its name; ``values``: one per rank."""

    def __init__(self, field: str, values: list[int]):
        self.field = field
        self.values = values
        super().__init__(self.message_for(None))

    def message_for(self, rank: int | None) -> str:
        """The error text, naming this rank's value when ``rank`` is given."""
        mine = "" if rank is None else f"rank {rank} has {self.field}={self.values[rank]}; "
        return (
            f"afdwin geometry mismatch: {self.field} differs across ranks: {mine}"
            f"all ranks' values (by world rank): {self.values}; attention and FFN ranks "
            f"must launch with the same geometry"
        )


@dataclasses.dataclass(frozen=True)
class Header:
    """A decoded v4 slot header. No seq, source or stage: those come from region and ring."""

    layer: int
    num_tokens: int
    routed_tokens: int
    segment_start: int
    expert_counts: tuple[int, ...]
    shutdown: bool = False


def encode_header(h: Header, experts_per_rank: int) -> bytes:
    """Header -> ``4 * (7 + experts_per_rank)`` little-endian bytes.

    Raises ``ValueError`` naming ``expert_counts`` when its length is not ``experts_per_rank``,
    or when the counts do not sum to ``routed_tokens``.
    """
    counts = tuple(h.expert_counts)
    if len(counts) != experts_per_rank:
        raise ValueError(
            f"expert_counts has {len(counts)} entries, expected experts_per_rank={experts_per_rank}"
        )
    if sum(counts) != h.routed_tokens:
        raise ValueError(f"expert_counts sum {sum(counts)} != routed_tokens {h.routed_tokens}")
    flags = FLAG_SHUTDOWN_BIT if h.shutdown else 0
    words = (
        MAGIC,
        VERSION,
        h.layer,
        h.num_tokens,
        flags,
        h.routed_tokens,
        h.segment_start,
    ) + counts
    return struct.pack(f"<{len(words)}i", *words)


def decode_header(buf: bytes, experts_per_rank: int) -> Header:
    """``4 * (7 + experts_per_rank)`` (or more) bytes -> Header.

    Raises ``HeaderError`` on "magic mismatch", "version mismatch", or an expert_counts sum
    that differs from routed_tokens; ``ValueError`` when ``buf`` is too short.
    """
    n = HEADER_FIXED_WORDS + experts_per_rank
    if len(buf) < 4 * n:
        raise ValueError(f"header needs {4 * n} bytes, got {len(buf)}")
    w = struct.unpack_from(f"<{n}i", buf)
    if w[0] != MAGIC:
        raise HeaderError(f"magic mismatch: got {w[0] & 0xFFFFFFFF:#010x}, expected {MAGIC:#010x}")
    if w[1] != VERSION:
        raise HeaderError(f"version mismatch: got {w[1]}, expected {VERSION}")
    counts = tuple(w[HEADER_FIXED_WORDS:])
    if sum(counts) != w[5]:
        raise HeaderError(f"expert_counts sum {sum(counts)} != routed_tokens {w[5]}")
    return Header(
        layer=w[2],
        num_tokens=w[3],
        routed_tokens=w[5],
        segment_start=w[6],
        expert_counts=counts,
        shutdown=bool(w[4] & FLAG_SHUTDOWN_BIT),
    )

"""protocol.h "Carriers": the chunk files of SAVE_ALLOCATIONS / LOAD_ALLOCATIONS on the wire.

A request carries ``chunk_bytes``, ``staging_bytes``, ``writers`` and the stream count in
``cui_request.reserved`` (:func:`carrier_reserved`), then the entries (:class:`StreamEntry`,
32 bytes each) in groups of at most :data:`CUI_STREAM_FDS_PER_MSG`, each group on one
``sendmsg`` whose SCM_RIGHTS carry one descriptor per entry (:func:`entry_groups`). A
SAVE_ALLOCATIONS reply with status OK is followed, after its message, by the chunk table of
``reply.reserved[0]`` bytes (:func:`parse_chunk_table`): per stream one ``cui_stream_head``
then ``chunk_count`` digests of 32 bytes (BLAKE2b-256, or SHA-256 with
:attr:`CarryFlag.SHA256`; 32 zero bytes: an all-zero chunk, not written). Sizes are bytes.
Part of :mod:`cuinterpose.coordinator.protocol`.

With :attr:`CarryFlag.STREAMED` (SAVE_ALLOCATIONS; decisions D70) the entries go first without
descriptors, then the chunk store's table, then the descriptors in groups as the sender opens
the files (:func:`open_groups`, each group one ``cui_fd_group``: :func:`fd_group`), so that
creating the files overlaps the shim's copies and writes.

Chunk store (protocol.h "Chunk store"; decisions D34): the request's :class:`CarryFlag` bits
add one table after the entries. SAVE with ``KNOWN``: :func:`known_table` (a
``cui_table_head`` and the ascending digests of chunks the store holds; those chunks are not
written). LOAD with ``SOURCES``: :func:`source_table` (the head, then the source entries in
groups with one descriptor each, as the streams, then the :class:`ChunkRef` rows).
"""

from __future__ import annotations

import enum
import hashlib
import struct
import time
from dataclasses import dataclass, field

from .checksum import cui_checksum64
from .codes import ProtocolError
from .structs import FORMATS, SIZES, alloc_id_bytes, alloc_id_hex

__all__ = [
    "CUI_STREAM_FDS_PER_MSG",
    "CUI_CHUNK_MIN",
    "CUI_CHUNK_MAX",
    "CUI_STAGING_MAX",
    "CUI_WRITERS_MAX",
    "CUI_DIGEST_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_STAGING_BYTES",
    "DEFAULT_WRITERS",
    "DEFAULT_CARRIER_TIMEOUT_S",
    "CUI_KNOWN_MAX",
    "CUI_REFS_MAX",
    "CarryFlag",
    "CHUNK_CHECKSUMS",
    "DEFAULT_CHUNK_CHECKSUM",
    "chunk_checksum_flag",
    "chunk_digest",
    "ChunkRef",
    "known_table",
    "source_table",
    "STREAM_ENTRY_SIZE",
    "STREAM_HEAD_SIZE",
    "StreamEntry",
    "StreamTable",
    "carrier_reserved",
    "entry_groups",
    "fd_group",
    "open_groups",
    "FD_GROUP_FLUSH_S",
    "parse_chunk_table",
    "check_carrier_params",
    "chunk_bytes_ok",
    "ChunkSettings",
]

CUI_STREAM_FDS_PER_MSG = 64
CUI_CHUNK_MIN = 64 << 10
CUI_CHUNK_MAX = 1 << 30
CUI_STAGING_MAX = 64 << 30
CUI_WRITERS_MAX = 64
CUI_DIGEST_BYTES = 32
CUI_KNOWN_MAX = 1 << 22
CUI_REFS_MAX = 1 << 22


class CarryFlag(enum.IntFlag):
    """``CUI_CARRY_*``: bits 16-31 of ``cui_request.reserved[2]`` (protocol.h "Chunk store")."""

    KNOWN = 0x1  # SAVE_ALLOCATIONS: a known-digest table follows the entries
    SOURCES = 0x2  # LOAD_ALLOCATIONS: source files and chunk refs follow the entries
    SHA256 = 0x4  # SAVE and LOAD: the chunk checksum is SHA-256, not BLAKE2b-256
    STREAMED = 0x8  # SAVE: the descriptors follow the table in groups, as the files are opened


#: the chunk checksums (the manifest's ``chunks.checksum``; protocol.h "Carriers", decisions
#: D36) -> the request flag that selects it in the shim
CHUNK_CHECKSUMS = {"blake2b-256": CarryFlag(0), "sha256": CarryFlag.SHA256}
#: what a request without the flag means (every snapshot before D36)
DEFAULT_CHUNK_CHECKSUM = "blake2b-256"


def chunk_checksum_flag(name: str) -> CarryFlag:
    """The :class:`CarryFlag` bit of chunk checksum ``name``; ValueError naming the known ones."""
    try:
        return CHUNK_CHECKSUMS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"chunk checksum {name!r} is not one of {sorted(CHUNK_CHECKSUMS)}"
        ) from None


def chunk_digest(name: str, data) -> bytes:
    """The 32-byte digest of ``data`` under chunk checksum ``name`` (hashlib: BLAKE2b with
    digest_size 32, or SHA-256); ValueError for another name."""
    chunk_checksum_flag(name)
    if name == "sha256":
        return hashlib.sha256(data).digest()
    return hashlib.blake2b(data, digest_size=32).digest()


#: the defaults of :class:`ChunkSettings` (docs/snapshot-format.md "chunks"; issue 12 chunk
#: format), pinned to protocol.h's CUI_DEFAULT_* by tests/coordinator/test_protocol.py
DEFAULT_CHUNK_BYTES = 8 << 20
DEFAULT_STAGING_BYTES = 64 << 20  # 8 slots of 8 MiB: 2 per writer (bench/datapath.py)
DEFAULT_WRITERS = 4
#: the deadline of SAVE/LOAD_ALLOCATIONS, seconds: they move every shared byte (the agent's
#: ``carrier_timeout_s``, agent/options.py)
DEFAULT_CARRIER_TIMEOUT_S = 3600.0

STREAM_ENTRY_SIZE = SIZES["cui_stream_entry"]  # 32
STREAM_HEAD_SIZE = SIZES["cui_stream_head"]  # 32
_ENTRY = struct.Struct(FORMATS["cui_stream_entry"])
_HEAD = struct.Struct(FORMATS["cui_stream_head"])
_ZERO = bytes(CUI_DIGEST_BYTES)
_TABLE_HEAD = struct.Struct(FORMATS["cui_table_head"])
_FD_GROUP = struct.Struct(FORMATS["cui_fd_group"])
_SOURCE = struct.Struct(FORMATS["cui_source_entry"])
_REF = struct.Struct(FORMATS["cui_chunk_ref"])


def chunk_bytes_ok(cb) -> bool:
    """``cb`` is a chunk size protocol.h allows: an int, a power of two in [64 KiB, 1 GiB]."""
    return type(cb) is int and CUI_CHUNK_MIN <= cb <= CUI_CHUNK_MAX and not cb & (cb - 1)


def check_carrier_params(
    chunk_bytes: int, staging_bytes: int, writers: int, names: dict | None = None
) -> None:
    """Raise ValueError naming the bad value unless protocol.h's limits hold: chunk_bytes a
    power of two in [64 KiB, 1 GiB], chunk_bytes <= staging_bytes <= 64 GiB (the ring holds
    whole chunks), 1..64 writers. ``names``: how the caller's user spells each of the three
    keys (e.g. ``{"staging_bytes": "--staging-bytes (the default)"}``); default the keys."""
    n = {k: k for k in ("chunk_bytes", "staging_bytes", "writers")} | (names or {})
    cb, sb = int(chunk_bytes), int(staging_bytes)
    if not chunk_bytes_ok(cb):
        raise ValueError(
            f"{n['chunk_bytes']} {cb} must be a power of two from {CUI_CHUNK_MIN} to "
            f"{CUI_CHUNK_MAX} bytes (64 KiB to 1 GiB)"
        )
    if not cb <= sb <= CUI_STAGING_MAX:
        raise ValueError(
            f"{n['staging_bytes']} {sb} must be at least {n['chunk_bytes']} ({cb}: the staging "
            f"ring holds whole chunks) and at most {CUI_STAGING_MAX} bytes (64 GiB)"
        )
    if not 1 <= int(writers) <= CUI_WRITERS_MAX:
        raise ValueError(f"{n['writers']} {writers} must be 1..{CUI_WRITERS_MAX}")


@dataclass(frozen=True)
class ChunkSettings:
    """How chunk streams are written and read: one value for both writers of the chunk
    format, the shim's (SAVE/LOAD_ALLOCATIONS carry ``chunk_bytes``, ``staging_bytes``,
    ``writers`` and the checksum flag: :func:`carrier_reserved`, coordinator/carrierfiles.py)
    and the agent's GPU custom storage (agent/mech/gpustore.py ``Options``).

    ``chunk_bytes``: bytes per chunk, a power of two from 64 KiB to 1 GiB; ``staging_bytes``:
    the staging memory per process (the shim's ring) or per stream (the GPU writer's slots),
    bytes, from ``chunk_bytes`` to 64 GiB; ``writers``: threads that hash and write (read and
    verify) chunks, 1..64; ``checksum``: the chunk checksum, a key of :data:`CHUNK_CHECKSUMS`.
    The defaults are protocol.h's ``CUI_DEFAULT_*``. An instance is valid: construction raises
    ``ValueError`` naming the value (:func:`check_carrier_params`, the one validation;
    :meth:`of` names each value as the caller's user wrote it)."""

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    staging_bytes: int = DEFAULT_STAGING_BYTES
    writers: int = DEFAULT_WRITERS
    checksum: str = DEFAULT_CHUNK_CHECKSUM

    def __post_init__(self):
        for k in ("chunk_bytes", "staging_bytes", "writers"):
            if type(getattr(self, k)) is not int:
                raise ValueError(f"{k} {getattr(self, k)!r} is not an integer")
        check_carrier_params(self.chunk_bytes, self.staging_bytes, self.writers)
        chunk_checksum_flag(self.checksum)

    @classmethod
    def of(cls, names: dict | None = None, **values) -> "ChunkSettings":
        """The settings ``values`` (the fields; a missing one takes its default), refused
        (ValueError) with each field named as ``names`` spells it (:func:`check_carrier_params`)."""
        d = cls()
        v = {k: values.get(k, getattr(d, k)) for k in ("chunk_bytes", "staging_bytes", "writers")}
        check_carrier_params(v["chunk_bytes"], v["staging_bytes"], v["writers"], names)
        return cls(**v, checksum=values.get("checksum", d.checksum))

    def as_dict(self) -> dict:
        """{"chunk_bytes", "staging_bytes", "writers", "checksum"} (the ``.lock`` record,
        ``CarrierFiles`` keyword arguments)."""
        return {
            "chunk_bytes": self.chunk_bytes,
            "staging_bytes": self.staging_bytes,
            "writers": self.writers,
            "checksum": self.checksum,
        }


@dataclass(frozen=True)
class StreamEntry:
    """``struct cui_stream_entry``: one carried allocation (16-byte id) and its size, bytes."""

    alloc_id: bytes
    bytes: int

    def pack(self) -> bytes:
        try:
            return _ENTRY.pack(alloc_id_bytes(self.alloc_id), int(self.bytes), 0)
        except struct.error as exc:
            raise ProtocolError(f"cannot pack struct cui_stream_entry: {exc}") from None


def carrier_reserved(
    chunk_bytes: int, staging_bytes: int, writers: int, count: int, flags: int = 0
) -> tuple:
    """``cui_request.reserved`` of SAVE/LOAD_ALLOCATIONS: (chunk_bytes, staging_bytes,
    writers | flags << 16 | count << 32); ``flags``: :class:`CarryFlag` bits."""
    low = (int(writers) & 0xFFFF) | (int(flags) & 0xFFFF) << 16
    return (int(chunk_bytes), int(staging_bytes), low | int(count) << 32)


def known_table(digests) -> bytes:
    """The CUI_CARRY_KNOWN table: a ``cui_table_head`` and the distinct non-zero 32-byte
    ``digests``, sorted. Raises ProtocolError on a digest that is not 32 bytes or more than
    CUI_KNOWN_MAX."""
    ds = sorted({bytes(d) for d in digests} - {_ZERO})
    if any(len(d) != CUI_DIGEST_BYTES for d in ds) or len(ds) > CUI_KNOWN_MAX:
        raise ProtocolError(
            f"known-digest table: {len(ds)} digests (32 bytes each, at most {CUI_KNOWN_MAX})"
        )
    return _TABLE_HEAD.pack(len(ds), 0, 0) + b"".join(ds)


@dataclass(frozen=True, order=True)
class ChunkRef:
    """``struct cui_chunk_ref``: chunk ``chunk`` of stream ``stream`` is read from source
    ``source`` at byte ``offset``."""

    stream: int
    chunk: int
    source: int
    offset: int

    def pack(self) -> bytes:
        return _REF.pack(self.stream, self.chunk, self.source, 0, self.offset)


def source_table(source_sizes: list[int], refs: list[ChunkRef]) -> tuple[bytes, list, bytes]:
    """The CUI_CARRY_SOURCES table as (head bytes, source groups as :func:`entry_groups`
    gives them (bytes, first, count), ref bytes); ``source_sizes``: each source file's size,
    bytes; ``refs`` sorted by (stream, chunk). Raises ProtocolError on unsorted or too many
    refs."""
    keys = [(r.stream, r.chunk) for r in refs]
    if keys != sorted(set(keys)) or len(refs) > CUI_REFS_MAX:
        raise ProtocolError(f"chunk refs: {len(refs)} refs, not strictly ascending or too many")
    groups = []
    for i in range(0, len(source_sizes), CUI_STREAM_FDS_PER_MSG):
        part = source_sizes[i : i + CUI_STREAM_FDS_PER_MSG]
        groups.append((b"".join(_SOURCE.pack(int(b), 0) for b in part), i, len(part)))
    head = _TABLE_HEAD.pack(len(refs), len(source_sizes), 0)
    return head, groups, b"".join(r.pack() for r in refs)


def entry_groups(entries: list[StreamEntry]) -> list[tuple[bytes, int, int]]:
    """The entries as (bytes, first index, count) groups of at most CUI_STREAM_FDS_PER_MSG,
    one ``sendmsg`` each with that many descriptors."""
    out = []
    for i in range(0, len(entries), CUI_STREAM_FDS_PER_MSG):
        part = entries[i : i + CUI_STREAM_FDS_PER_MSG]
        out.append((b"".join(e.pack() for e in part), i, len(part)))
    return out


#: CUI_CARRY_STREAMED: a group is sent once opening its files took this long (seconds), full or
#: not; the shim waits at most 10 s for each (protocol.h "Carriers")
FD_GROUP_FLUSH_S = 0.25


def fd_group(count: int, error: int = 0) -> bytes:
    """``struct cui_fd_group``: ``count`` descriptors follow as SCM_RIGHTS, or (count 0) the
    sender could not open the next entry's file, ``error`` its errno."""
    return _FD_GROUP.pack(int(count), int(error))


def open_groups(streams: list, opener, flush_s: float = FD_GROUP_FLUSH_S):
    """CUI_CARRY_STREAMED: yield the descriptors of ``streams`` (a list of (StreamEntry, fd)
    pairs, fd -1 until opened) in entry order, as (first index, [fds], None) groups of 1, 2, 4,
    ... up to CUI_STREAM_FDS_PER_MSG, a group cut short once opening its files took ``flush_s``
    seconds: the shim starts on the first stream as soon as its file is open and is never kept
    waiting long. ``opener(i)`` opens entry i's file and returns its descriptor, which is stored
    in ``streams[i]`` (the caller closes it; an entry opened before is not opened again). An
    OSError from ``opener`` ends the groups with (i, [], that OSError)."""
    i, size, n = 0, 1, len(streams)
    while i < n:
        t0, fds = time.monotonic(), []
        while len(fds) < size and i + len(fds) < n and (time.monotonic() - t0 < flush_s or not fds):
            k = i + len(fds)
            entry, fd = streams[k]
            if fd < 0:
                try:
                    fd = opener(k)
                except OSError as exc:
                    if fds:
                        yield i, fds, None
                    yield k, [], exc
                    return
                streams[k] = (entry, fd)
            fds.append(fd)
        yield i, fds, None
        i += len(fds)
        size = min(2 * size, CUI_STREAM_FDS_PER_MSG)


@dataclass
class StreamTable:
    """One stream of a chunk table: allocation id (hex), size (bytes) and its digests (32-byte
    bytes, ``None`` for a zero chunk)."""

    alloc_id: str
    bytes: int
    checksums: list = field(default_factory=list)

    @property
    def zero(self) -> list[int]:
        """Indices of the all-zero chunks (not written)."""
        return [i for i, c in enumerate(self.checksums) if c is None]

    @property
    def carrier_checksum(self) -> int:
        """cui_checksum64 of the digest table (zero chunks as 32 zero bytes): the allocation
        record's ``carrier_checksum`` after SAVE_ALLOCATIONS."""
        return cui_checksum64(b"".join(c if c is not None else _ZERO for c in self.checksums))


def parse_chunk_table(data: bytes, chunk_bytes: int) -> list[StreamTable]:
    """Parse a SAVE_ALLOCATIONS chunk table. Raises ProtocolError on a truncated table, a
    chunk count that is not ceil(bytes / chunk_bytes), or a zero count that disagrees."""
    out: list[StreamTable] = []
    off, n = 0, len(data)
    while off < n:
        if n - off < STREAM_HEAD_SIZE:
            raise ProtocolError(f"chunk table truncated at byte {off} of {n} (stream header)")
        aid, size, count, zeros = _HEAD.unpack_from(data, off)
        off += STREAM_HEAD_SIZE
        want = -(-size // chunk_bytes) if chunk_bytes else 0
        if count != want:
            raise ProtocolError(
                f"chunk table: allocation {alloc_id_hex(aid)} of {size} bytes has {count} "
                f"chunks, not ceil({size} / {chunk_bytes}) = {want}"
            )
        if n - off < count * CUI_DIGEST_BYTES:
            raise ProtocolError(f"chunk table truncated in allocation {alloc_id_hex(aid)}")
        sums = []
        for i in range(count):
            d = bytes(data[off + i * CUI_DIGEST_BYTES : off + (i + 1) * CUI_DIGEST_BYTES])
            sums.append(None if d == _ZERO else d)
        off += count * CUI_DIGEST_BYTES
        t = StreamTable(alloc_id=alloc_id_hex(aid), bytes=size, checksums=sums)
        if len(t.zero) != zeros:
            raise ProtocolError(
                f"chunk table: allocation {t.alloc_id} announces {zeros} zero chunks, has "
                f"{len(t.zero)}"
            )
        out.append(t)
    return out

"""protocol.h's structs: their little-endian ``struct`` layouts (:data:`SIZES`, :data:`OFFSETS`,
:data:`FORMATS`) and the dataclasses that pack and unpack them (``Request``, ``Reply``,
``Access``, ``Record``; ``Ticket`` is in :mod:`.ticket`). Part of
:mod:`cuinterpose.coordinator.protocol`."""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

from .codes import (
    CUI_MAX_ACCESS,
    CUI_PROTO_MAGIC,
    CUI_PROTO_VERSION,
    DeviceUse,
    Op,
    Phase,
    ProtocolError,
    RecordKind,
    Role,
    Status,
)

__all__ = [
    "Request",
    "Reply",
    "Access",
    "Record",
    "SIZES",
    "OFFSETS",
    "FORMATS",
    "REQUEST_SIZE",
    "REPLY_SIZE",
    "ACCESS_SIZE",
    "RECORD_SIZE",
    "TICKET_SIZE",
    "alloc_id_hex",
    "alloc_id_bytes",
]

# --- struct layouts -------------------------------------------------------------------------
# (field name, struct code); arrays are expanded by the packers below.
_REQUEST_FIELDS = [
    ("magic", "I"),
    ("version", "H"),
    ("op", "H"),
    ("txn_id", "Q"),
    ("expected_phase", "I"),
    ("sender_pid", "I"),
    ("alloc_id", "16s"),
    ("reserved", "3Q"),
]
_REPLY_FIELDS = [
    ("magic", "I"),
    ("version", "H"),
    ("op", "H"),
    ("txn_id", "Q"),
    ("status", "i"),
    ("phase", "I"),
    ("pid", "I"),
    ("record_count", "I"),
    ("record_size", "I"),
    ("message_len", "I"),
    ("bytes", "Q"),
    ("elapsed_ns", "Q"),
    ("copy_ns", "Q"),
    ("cuda_result", "i"),
    ("records_changed", "I"),
    ("shim_flags", "Q"),
    ("reserved", "6Q"),
]
_ACCESS_FIELDS = [("location_type", "I"), ("location_id", "i"), ("flags", "I"), ("reserved", "I")]
_RECORD_FIELDS = [
    ("kind", "H"),
    ("role", "H"),
    ("flags", "I"),
    ("alloc_id", "16s"),
    ("creator_pid", "I"),
    ("handle_refs", "I"),
    ("size", "Q"),
    ("va", "Q"),
    ("offset", "Q"),
    ("prop_type", "I"),
    ("prop_location_type", "I"),
    ("prop_location_id", "i"),
    ("prop_handle_types", "I"),
    ("carrier_checksum", "Q"),
    ("carrier_bytes", "Q"),
    ("access_count", "I"),
    ("reserved0", "I"),
    ("reserved", "4Q"),
    ("access", "%ds" % (16 * CUI_MAX_ACCESS)),
]
_TICKET_FIELDS = [
    ("magic", "8s"),
    ("version", "I"),
    ("kind", "I"),
    ("creator_pid", "I"),
    ("reserved0", "I"),
    ("alloc_id", "16s"),
    ("size", "Q"),
    ("reserved", "2Q"),
]


def _layout(fields):
    fmt = "<" + "".join(code for _, code in fields)
    offsets, off = {}, 0
    for name, code in fields:
        offsets[name] = off
        off += struct.calcsize("<" + code)
    assert off == struct.calcsize(fmt), "implicit padding in a protocol struct"
    return fmt, offsets


_STREAM_ENTRY_FIELDS = [("alloc_id", "16s"), ("bytes", "Q"), ("reserved", "Q")]
_STREAM_HEAD_FIELDS = [
    ("alloc_id", "16s"),
    ("bytes", "Q"),
    ("chunk_count", "I"),
    ("zero_count", "I"),
]

_FD_GROUP_FIELDS = [("count", "I"), ("error", "i")]
_TABLE_HEAD_FIELDS = [("count", "I"), ("sources", "I"), ("reserved", "Q")]
_SOURCE_ENTRY_FIELDS = [("bytes", "Q"), ("reserved", "Q")]
_CHUNK_REF_FIELDS = [
    ("stream", "I"),
    ("chunk", "I"),
    ("source", "I"),
    ("reserved", "I"),
    ("offset", "Q"),
]

_LAYOUTS = {
    "cui_request": _REQUEST_FIELDS,
    "cui_reply": _REPLY_FIELDS,
    "cui_access": _ACCESS_FIELDS,
    "cui_record": _RECORD_FIELDS,
    "cui_ticket": _TICKET_FIELDS,
    "cui_stream_entry": _STREAM_ENTRY_FIELDS,  # carriers.py packs these two
    "cui_stream_head": _STREAM_HEAD_FIELDS,
    "cui_fd_group": _FD_GROUP_FIELDS,  # carriers.py: CUI_CARRY_STREAMED's descriptor groups
    "cui_table_head": _TABLE_HEAD_FIELDS,  # carriers.py: the chunk store's tables
    "cui_source_entry": _SOURCE_ENTRY_FIELDS,
    "cui_chunk_ref": _CHUNK_REF_FIELDS,
}
#: struct name -> little-endian struct format
FORMATS: dict[str, str] = {}
#: struct name -> {field name: byte offset}
OFFSETS: dict[str, dict[str, int]] = {}
for _name, _fields in _LAYOUTS.items():
    FORMATS[_name], OFFSETS[_name] = _layout(_fields)
#: struct name -> sizeof, bytes
SIZES: dict[str, int] = {name: struct.calcsize(fmt) for name, fmt in FORMATS.items()}
REQUEST_SIZE = SIZES["cui_request"]  # 64
REPLY_SIZE = SIZES["cui_reply"]  # 128
ACCESS_SIZE = SIZES["cui_access"]  # 16
RECORD_SIZE = SIZES["cui_record"]  # 640
TICKET_SIZE = SIZES["cui_ticket"]  # 64
_STRUCTS = {name: struct.Struct(fmt) for name, fmt in FORMATS.items()}


def _pack(name: str, *values) -> bytes:
    try:
        return _STRUCTS[name].pack(*values)
    except struct.error as exc:
        raise ProtocolError(f"cannot pack struct {name}: {exc}") from None


def _unpack(name: str, data) -> tuple:
    size = SIZES[name]
    if len(data) != size:
        raise ProtocolError(f"struct {name} is {size} bytes, got {len(data)}")
    return _STRUCTS[name].unpack(bytes(data))


def _enum(cls, value):
    try:
        return cls(value)
    except ValueError:
        return value  # unknown codes are kept as plain ints (reported, not crashed on)


def alloc_id_bytes(value: bytes | str | None) -> bytes:
    """A 16-byte allocation id from bytes (right-padded with zeros) or a hex string."""
    if value is None:
        return bytes(16)
    if isinstance(value, str):
        value = bytes.fromhex(value)
    value = bytes(value)
    if len(value) > 16:
        raise ProtocolError(f"alloc_id is at most 16 bytes, got {len(value)}")
    return value.ljust(16, b"\0")


def alloc_id_hex(value: bytes) -> str:
    """Lowercase 32-digit hex of a 16-byte allocation id (the manifest/JSON form)."""
    return bytes(value).hex()


# --- dataclasses ----------------------------------------------------------------------------
@dataclass
class Request:
    """``struct cui_request`` (64 bytes). ``alloc_id``: 16 bytes, by op (a union in protocol.h):
    FETCH_FD's allocation id, or a mutating op's claim token (:attr:`claim`, protocol.h "Claims")."""

    op: int
    txn_id: int = 0
    expected_phase: int = Phase.ACTIVE
    sender_pid: int = 0
    alloc_id: bytes = bytes(16)
    magic: int = CUI_PROTO_MAGIC
    version: int = CUI_PROTO_VERSION
    reserved: tuple = (0, 0, 0)

    SIZE: ClassVar[int] = REQUEST_SIZE

    def __post_init__(self):
        self.alloc_id = alloc_id_bytes(self.alloc_id)

    @property
    def claim(self) -> bytes:
        """``cui_request.claim``: the same 16 bytes as :attr:`alloc_id` (protocol.h's union)."""
        return self.alloc_id

    @claim.setter
    def claim(self, token: bytes) -> None:
        self.alloc_id = alloc_id_bytes(token)

    def pack(self) -> bytes:
        return _pack(
            "cui_request",
            self.magic,
            self.version,
            int(self.op),
            self.txn_id,
            int(self.expected_phase),
            self.sender_pid,
            alloc_id_bytes(self.alloc_id),
            *self.reserved,
        )

    @classmethod
    def unpack(cls, data: bytes) -> "Request":
        v = _unpack("cui_request", data)
        return cls(
            magic=v[0],
            version=v[1],
            op=_enum(Op, v[2]),
            txn_id=v[3],
            expected_phase=_enum(Phase, v[4]),
            sender_pid=v[5],
            alloc_id=v[6],
            reserved=tuple(v[7:10]),
        )


@dataclass
class Reply:
    """``struct cui_reply`` (128 bytes). ``bytes``: carrier bytes; ``*_ns``: nanoseconds."""

    op: int
    txn_id: int = 0
    status: int = Status.OK
    phase: int = Phase.ACTIVE
    pid: int = 0
    record_count: int = 0
    record_size: int = RECORD_SIZE
    message_len: int = 0
    bytes: int = 0
    elapsed_ns: int = 0
    copy_ns: int = 0
    cuda_result: int = 0
    records_changed: int = 0
    magic: int = CUI_PROTO_MAGIC
    version: int = CUI_PROTO_VERSION
    shim_flags: int = 0  # ShimFlag bits
    reserved: tuple = (0,) * 6

    SIZE: ClassVar[int] = REPLY_SIZE

    def pack(self) -> bytes:
        return _pack(
            "cui_reply",
            self.magic,
            self.version,
            int(self.op),
            self.txn_id,
            int(self.status),
            int(self.phase),
            self.pid,
            self.record_count,
            self.record_size,
            self.message_len,
            self.bytes,
            self.elapsed_ns,
            self.copy_ns,
            self.cuda_result,
            self.records_changed,
            self.shim_flags,
            *self.reserved,
        )

    @classmethod
    def unpack(cls, data: bytes) -> "Reply":
        v = _unpack("cui_reply", data)
        return cls(
            magic=v[0],
            version=v[1],
            op=_enum(Op, v[2]),
            txn_id=v[3],
            status=_enum(Status, v[4]),
            phase=_enum(Phase, v[5]),
            pid=v[6],
            record_count=v[7],
            record_size=v[8],
            message_len=v[9],
            bytes=v[10],
            elapsed_ns=v[11],
            copy_ns=v[12],
            cuda_result=v[13],
            records_changed=v[14],
            shim_flags=v[15],
            reserved=tuple(v[16:22]),
        )


@dataclass(frozen=True)
class Access:
    """``struct cui_access`` (16 bytes): one merged CUmemAccessDesc."""

    location_type: int
    location_id: int
    flags: int
    reserved: int = 0

    SIZE: ClassVar[int] = ACCESS_SIZE

    def pack(self) -> bytes:
        return _pack("cui_access", self.location_type, self.location_id, self.flags, self.reserved)

    @classmethod
    def unpack(cls, data: bytes) -> "Access":
        return cls(*_unpack("cui_access", data))

    def to_dict(self) -> dict:
        return {
            "location_type": self.location_type,
            "location_id": self.location_id,
            "flags": self.flags,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Access":
        return cls(
            int(d["location_type"]),
            int(d["location_id"]),
            int(d["flags"]),
            int(d.get("reserved", 0)),
        )


_ACCESS_STRUCT, _ACCESS_SEEN = _STRUCTS["cui_access"], {}
_KINDS, _ROLES = {int(m): m for m in RecordKind}, {int(m): m for m in Role}


def _access_of(v: tuple) -> Access:
    """The (frozen, shared) Access of an unpacked ``cui_access`` tuple."""
    a = _ACCESS_SEEN.get(v)
    if a is None:
        if len(_ACCESS_SEEN) >= 4096:
            _ACCESS_SEEN.clear()
        a = _ACCESS_SEEN[v] = Access(*v)
    return a


@dataclass
class Record:
    """``struct cui_record`` (640 bytes).

    ``access`` holds only the used entries (``access_count`` of them, at most
    :data:`CUI_MAX_ACCESS`); ``access_count`` on the wire is ``len(access)``. Unused wire
    entries are written as zeros and ignored on unpack.
    """

    kind: int
    role: int = Role.PRIVATE
    flags: int = 0
    alloc_id: bytes = bytes(16)
    creator_pid: int = 0
    handle_refs: int = 0
    size: int = 0
    va: int = 0
    offset: int = 0
    prop_type: int = 0
    prop_location_type: int = 0
    prop_location_id: int = 0
    prop_handle_types: int = 0
    carrier_checksum: int = 0
    carrier_bytes: int = 0
    access: tuple = ()
    reserved0: int = 0
    reserved: tuple = (0, 0, 0, 0)

    SIZE: ClassVar[int] = RECORD_SIZE

    def __post_init__(self):
        if self.alloc_id.__class__ is not bytes or len(self.alloc_id) != 16:
            self.alloc_id = alloc_id_bytes(self.alloc_id)
        if self.access.__class__ is not tuple:
            self.access = tuple(self.access)

    @property
    def access_count(self) -> int:
        return len(self.access)

    @property
    def alloc_id_hex(self) -> str:
        return self.alloc_id.hex()  # 16 bytes (__post_init__)

    def pack(self) -> bytes:
        if len(self.access) > CUI_MAX_ACCESS:
            raise ProtocolError(
                f"record has {len(self.access)} access entries, CUI_MAX_ACCESS is {CUI_MAX_ACCESS}"
            )
        acc = b"".join(a.pack() for a in self.access).ljust(ACCESS_SIZE * CUI_MAX_ACCESS, b"\0")
        head = (int(self.kind), int(self.role), int(self.flags), alloc_id_bytes(self.alloc_id))
        mid = (self.creator_pid, self.handle_refs, self.size, self.va, self.offset, self.prop_type)
        props = (self.prop_location_type, self.prop_location_id, self.prop_handle_types)
        tail = (self.carrier_checksum, self.carrier_bytes, len(self.access), self.reserved0)
        return _pack("cui_record", *head, *mid, *props, *tail, *self.reserved, acc)

    @classmethod
    def unpack(cls, data: bytes) -> "Record":
        return cls._of(_unpack("cui_record", data))

    @classmethod
    def _of(cls, v: tuple) -> "Record":
        """The record of one unpacked ``cui_record`` tuple (enum codes through dict lookups and
        equal access entries shared: INSPECT replies carry ~2 records per allocation)."""
        count = v[15]
        if count > CUI_MAX_ACCESS:
            raise ProtocolError(f"record access_count {count} > CUI_MAX_ACCESS {CUI_MAX_ACCESS}")
        access = tuple(map(_access_of, _ACCESS_STRUCT.iter_unpack(v[21][: count * ACCESS_SIZE])))
        k, r = v[0], v[1]
        return cls(_KINDS.get(k, k), _ROLES.get(r, r), *v[2:15], access, v[16], v[17:21])

    @classmethod
    def unpack_many(cls, data: bytes, count: int) -> list["Record"]:
        """``count`` consecutive records; raises ProtocolError if the length is not exact."""
        if len(data) != count * RECORD_SIZE:
            raise ProtocolError(
                f"{count} records need {count * RECORD_SIZE} bytes, got {len(data)}"
            )
        return [cls._of(v) for v in _STRUCTS["cui_record"].iter_unpack(data)]

    def describe(self) -> str:
        """Human name of the object for error messages, e.g. 'mapping of allocation 9f3c… at
        va 0x7f0000200000'."""
        kind = _enum(RecordKind, self.kind)
        aid = alloc_id_hex(self.alloc_id)
        if kind == RecordKind.ALLOCATION:
            return f"allocation {aid}"
        if kind == RecordKind.MAPPING:
            return f"mapping of allocation {aid} at va {self.va:#x}"
        if kind == RecordKind.RESERVATION:
            return f"reservation at va {self.va:#x} size {self.size:#x}"
        if kind == RecordKind.MULTICAST:
            return f"multicast object {aid}"
        if kind == RecordKind.MULTICAST_DEVICE:
            return f"device {self.prop_location_id} of multicast object {aid}"
        if kind == RecordKind.MULTICAST_BINDING:
            return (
                f"binding of multicast object {aid} device {self.prop_location_id} at "
                f"offset {self.offset:#x} size {self.size:#x}"
            )
        if kind == RecordKind.MULTICAST_MAPPING:
            return f"mapping of multicast object {aid} at va {self.va:#x}"
        if kind == RecordKind.DEVICE:
            return f"device ordinal {self.prop_location_id} ({self.device_uuid})"
        return f"record kind {int(kind)} (allocation {aid})"

    # DEVICE records (protocol.h CUI_RECORD_DEVICE)
    @property
    def device_uuid(self) -> str:
        """The GPU of a DEVICE record as ``nvidia-smi -L`` writes it:
        ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (the 16 bytes of ``CUuuid``)."""
        h = bytes(self.alloc_id).hex()
        return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    @property
    def device_uses(self) -> "DeviceUse":
        """A DEVICE record's ``CUI_DEV_USE_*`` bits (``reserved0``)."""
        return DeviceUse(self.reserved0 & 0xF)

    @property
    def device_name_hash(self) -> int:
        """A DEVICE record's cui_checksum64 of ``cuDeviceGetName`` (``reserved[0]``)."""
        return self.reserved[0]

    # MULTICAST_BINDING records: the bound member (protocol.h "Multicast records")
    @property
    def member_alloc_id(self) -> bytes:
        return struct.pack("<QQ", self.reserved[0], self.reserved[1])

    @property
    def member_alloc_id_hex(self) -> str:
        return alloc_id_hex(self.member_alloc_id)

    @property
    def member_creator_pid(self) -> int:
        return self.reserved0

    @property
    def member_offset(self) -> int:
        return self.reserved[2]

    def to_dict(self) -> dict:
        """JSON-able dict: enums by name (unknown codes as ints), alloc_id as hex.

        Reserved fields are written only when non-zero.
        """
        d: dict[str, Any] = {
            "kind": _name(RecordKind, self.kind),
            "role": _name(Role, self.role),
            "flags": int(self.flags),
            "alloc_id": alloc_id_hex(self.alloc_id),
            "creator_pid": self.creator_pid,
            "handle_refs": self.handle_refs,
            "size": self.size,
            "va": self.va,
            "offset": self.offset,
            "prop_type": self.prop_type,
            "prop_location_type": self.prop_location_type,
            "prop_location_id": self.prop_location_id,
            "prop_handle_types": self.prop_handle_types,
            "carrier_checksum": self.carrier_checksum,
            "carrier_bytes": self.carrier_bytes,
            "access": [a.to_dict() for a in self.access],
        }
        if self.reserved0:
            d["reserved0"] = self.reserved0
        if any(self.reserved):
            d["reserved"] = list(self.reserved)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        """Inverse of :meth:`to_dict`; accepts enum names or ints. Raises KeyError/ValueError."""
        return cls(
            kind=_from_name(RecordKind, d["kind"]),
            role=_from_name(Role, d["role"]),
            flags=int(d["flags"]),
            alloc_id=alloc_id_bytes(d["alloc_id"]),
            creator_pid=int(d["creator_pid"]),
            handle_refs=int(d["handle_refs"]),
            size=int(d["size"]),
            va=int(d["va"]),
            offset=int(d["offset"]),
            prop_type=int(d["prop_type"]),
            prop_location_type=int(d["prop_location_type"]),
            prop_location_id=int(d["prop_location_id"]),
            prop_handle_types=int(d["prop_handle_types"]),
            carrier_checksum=int(d["carrier_checksum"]),
            carrier_bytes=int(d["carrier_bytes"]),
            access=tuple(Access.from_dict(a) for a in d.get("access", ())),
            reserved0=int(d.get("reserved0", 0)),
            reserved=tuple(int(x) for x in d.get("reserved", (0, 0, 0, 0))),
        )

    def replace(self, **changes) -> "Record":
        """A copy with ``changes`` (field names; TypeError for another name)."""
        if not changes.keys() <= _RECORD_NAMES:
            return dataclasses.replace(self, **changes)
        new = object.__new__(Record)
        new.__dict__ = {**self.__dict__, **changes}
        new.__post_init__()
        return new


_RECORD_NAMES = frozenset(f.name for f in dataclasses.fields(Record))


def _name(cls, value) -> str | int:
    try:
        return cls(value).name
    except ValueError:
        return int(value)


def _from_name(cls, value):
    if isinstance(value, str):
        try:
            return cls[value]
        except KeyError:
            raise ValueError(f"unknown {cls.__name__} {value!r}") from None
    return _enum(cls, int(value))

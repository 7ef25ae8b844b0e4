"""protocol.h's virtual IPC handle (``struct cui_ipc_handle``, what the shim's
``cuIpcGetMemHandle`` returns for an IPC adapter allocation) and where the FETCH_FD secret
sits in ``cui_request`` and ``cui_ticket`` (protocol.h "Secrets"). Part of
:mod:`cuinterpose.coordinator.protocol`.

The secret is 64 bits from getrandom(2), never 0: ``Request.reserved[0]`` of a FETCH_FD,
``Ticket.reserved[1]`` of an allocation ticket, :attr:`IpcHandle.secret`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar

from .codes import CUI_IPC_EVENT_MAGIC, CUI_IPC_MAGIC, CUI_PROTO_VERSION, ProtocolError

__all__ = [
    "IpcEventHandle",
    "IPC_EVENT_HANDLE_FORMAT",
    "IpcHandle",
    "IPC_HANDLE_FORMAT",
    "IPC_HANDLE_SIZE",
    "REQUEST_SECRET_INDEX",
    "TICKET_SECRET_INDEX",
]

#: magic 8s, version, creator_pid, alloc_id 16s, size, offset, secret, mapped (64 bytes)
IPC_HANDLE_FORMAT = "<8sII16sQQQQ"
IPC_HANDLE_SIZE = struct.calcsize(IPC_HANDLE_FORMAT)  # 64 (CU_IPC_HANDLE_SIZE)
#: ``Request.reserved[REQUEST_SECRET_INDEX]`` carries the secret of a FETCH_FD
REQUEST_SECRET_INDEX = 0
#: ``Ticket.reserved[TICKET_SECRET_INDEX]`` carries an allocation ticket's secret
TICKET_SECRET_INDEX = 1


@dataclass
class IpcHandle:
    """``struct cui_ipc_handle`` (64 bytes). ``size``: bytes requested from cuMemAlloc_v2;
    ``mapped``: bytes created and mapped (rounded up to the granularity); ``offset``: bytes."""

    creator_pid: int
    alloc_id: bytes
    size: int
    offset: int
    secret: int
    mapped: int
    magic: bytes = CUI_IPC_MAGIC
    version: int = CUI_PROTO_VERSION

    SIZE: ClassVar[int] = IPC_HANDLE_SIZE

    def pack(self) -> bytes:
        return struct.pack(
            IPC_HANDLE_FORMAT,
            bytes(self.magic),
            self.version,
            self.creator_pid,
            bytes(self.alloc_id),
            self.size,
            self.offset,
            self.secret,
            self.mapped,
        )

    @classmethod
    def unpack(cls, data: bytes) -> IpcHandle:
        """Decode 64 bytes; raise ProtocolError on a wrong length, magic or version."""
        if len(data) != IPC_HANDLE_SIZE:
            raise ProtocolError(f"IPC handle is {len(data)} bytes, want {IPC_HANDLE_SIZE}")
        magic, version, pid, aid, size, offset, secret, mapped = struct.unpack(
            IPC_HANDLE_FORMAT, data
        )
        if magic != CUI_IPC_MAGIC:
            raise ProtocolError(f"IPC handle magic {magic!r} != {CUI_IPC_MAGIC!r}")
        if version != CUI_PROTO_VERSION:
            raise ProtocolError(f"IPC handle version {version} != {CUI_PROTO_VERSION}")
        return cls(pid, aid, size, offset, secret, mapped, magic, version)


#: magic 8s, version, creator_pid, event_id 16s, secret, flags, reserved0, reserved 2Q (64 bytes)
IPC_EVENT_HANDLE_FORMAT = "<8sII16sQII2Q"


@dataclass
class IpcEventHandle:
    """``struct cui_ipc_event_handle`` (64 bytes): what the shim's ``cuIpcGetEventHandle`` returns
    for an event created with CU_EVENT_INTERPROCESS. ``flags``: its CU_EVENT_* flags."""

    creator_pid: int
    event_id: bytes
    secret: int
    flags: int
    magic: bytes = CUI_IPC_EVENT_MAGIC
    version: int = CUI_PROTO_VERSION

    SIZE: ClassVar[int] = IPC_HANDLE_SIZE

    def pack(self) -> bytes:
        return struct.pack(
            IPC_EVENT_HANDLE_FORMAT,
            bytes(self.magic),
            self.version,
            self.creator_pid,
            bytes(self.event_id),
            self.secret,
            self.flags,
            0,
            0,
            0,
        )

    @classmethod
    def unpack(cls, data: bytes) -> IpcEventHandle:
        """Decode 64 bytes; raise ProtocolError on a wrong length, magic or version."""
        if len(data) != IPC_HANDLE_SIZE:
            raise ProtocolError(f"IPC event handle is {len(data)} bytes, want {IPC_HANDLE_SIZE}")
        magic, version, pid, eid, secret, flags, _r0, _r1, _r2 = struct.unpack(
            IPC_EVENT_HANDLE_FORMAT, data
        )
        if magic != CUI_IPC_EVENT_MAGIC:
            raise ProtocolError(f"IPC event handle magic {magic!r} != {CUI_IPC_EVENT_MAGIC!r}")
        if version != CUI_PROTO_VERSION:
            raise ProtocolError(f"IPC event handle version {version} != {CUI_PROTO_VERSION}")
        return cls(pid, eid, secret, flags, magic, version)

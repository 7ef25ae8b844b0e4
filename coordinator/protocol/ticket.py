"""protocol.h's ``struct cui_ticket`` (64 bytes, layout in :mod:`.structs`): the ticket a
creator writes in front of a sealed-memfd export. Part of
:mod:`cuinterpose.coordinator.protocol`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .codes import CUI_PROTO_VERSION, CUI_TICKET_MAGIC, ProtocolError, TicketKind
from .structs import TICKET_SIZE, _enum, _pack, _unpack, alloc_id_bytes

__all__ = ["Ticket"]


@dataclass
class Ticket:
    """``struct cui_ticket`` (64 bytes): the sealed-memfd export ticket."""

    creator_pid: int
    alloc_id: bytes
    size: int
    kind: int = TicketKind.ALLOCATION
    magic: bytes = CUI_TICKET_MAGIC
    version: int = CUI_PROTO_VERSION
    reserved0: int = 0
    reserved: tuple = (0, 0)

    SIZE: ClassVar[int] = TICKET_SIZE

    def __post_init__(self):
        self.alloc_id = alloc_id_bytes(self.alloc_id)

    def pack(self) -> bytes:
        return _pack(
            "cui_ticket",
            bytes(self.magic),
            self.version,
            int(self.kind),
            self.creator_pid,
            self.reserved0,
            alloc_id_bytes(self.alloc_id),
            self.size,
            *self.reserved,
        )

    @classmethod
    def unpack(cls, data: bytes, *, check: bool = True) -> "Ticket":
        """Decode 64 bytes; with ``check`` raise ProtocolError on bad magic or version."""
        v = _unpack("cui_ticket", data)
        t = cls(
            magic=v[0],
            version=v[1],
            kind=_enum(TicketKind, v[2]),
            creator_pid=v[3],
            reserved0=v[4],
            alloc_id=v[5],
            size=v[6],
            reserved=tuple(v[7:9]),
        )
        if check and t.magic != CUI_TICKET_MAGIC:
            raise ProtocolError(f"ticket magic {t.magic!r} != {CUI_TICKET_MAGIC!r}")
        if check and t.version != CUI_PROTO_VERSION:
            raise ProtocolError(f"ticket version {t.version} != {CUI_PROTO_VERSION}")
        return t

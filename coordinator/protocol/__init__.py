"""Python mirror of ``interposer/include/cuinterpose/protocol.h``: the shim control wire format.

protocol.h is the single definition; this package mirrors it field for field (and the
``CUI_OPS`` table row for row: :data:`OPS`, from which :data:`MUTATING_OPS`,
:data:`CARRIER_OPS` and :data:`MULTICAST_RESTORE_OPS` are derived) and
``tests/coordinator/test_protocol.py`` pins every offset, size and constant against the C
header (compiled), and round-trips bytes in both directions. Change both together.

The definitions live in four modules (``codes``: #defines, enums, the ops table;
``structs``: the struct layouts and the dataclasses that pack them; ``checksum``;
``sockets``: socket names and the default control dir); every name is importable from here.

All structs are packed with explicit little-endian ``struct`` formats (``<``); the C structs
are naturally aligned with no implicit padding, so the formats need no pad bytes.

Units: sizes, offsets and byte counts are bytes; durations are nanoseconds (``*_ns``).
Errors: ``unpack`` raises :class:`ProtocolError` on a wrong length, bad magic/version or an
``access_count`` above :data:`CUI_MAX_ACCESS`; ``pack`` raises :class:`ProtocolError` on a
field that does not fit (``struct.error`` is converted).
"""

from __future__ import annotations

from .checksum import (
    cui_checksum64,
)
from .codes import (
    CARRIER_OPS,
    CONTROL_DIR_ENV,
    CUI_DEFAULT_CONTROL_DIR,
    CUI_MAX_ACCESS,
    CUI_PROTO_MAGIC,
    CUI_PROTO_VERSION,
    CUI_SOCKET_PREFIX,
    CUI_SOCKET_SUFFIX,
    CUI_TICKET_MAGIC,
    CUI_TXN_ROOM,
    MULTICAST_KINDS,
    MULTICAST_RESTORE_OPS,
    MUTATING_OPS,
    OP_RULES,
    OPS,
    Op,
    OpRule,
    Phase,
    PhaseRule,
    ProtocolError,
    RecordFlag,
    RecordKind,
    Role,
    ShimFlag,
    Status,
    TicketKind,
)
from .sockets import (
    cuda_result_name,
    default_control_dir,
    pid_from_socket_path,
    socket_path,
)
from .structs import (
    _LAYOUTS,  # noqa: F401 (test_protocol.py compares it with the C layout)
    ACCESS_SIZE,
    FORMATS,
    OFFSETS,
    RECORD_SIZE,
    REPLY_SIZE,
    REQUEST_SIZE,
    SIZES,
    TICKET_SIZE,
    Access,
    Record,
    Reply,
    Request,
    Ticket,
    alloc_id_bytes,
    alloc_id_hex,
)

__all__ = [
    "cui_checksum64",
    "CUI_PROTO_MAGIC",
    "CUI_PROTO_VERSION",
    "CUI_DEFAULT_CONTROL_DIR",
    "CUI_SOCKET_PREFIX",
    "CUI_SOCKET_SUFFIX",
    "CUI_MAX_ACCESS",
    "CUI_TXN_ROOM",
    "CUI_TICKET_MAGIC",
    "CONTROL_DIR_ENV",
    "Op",
    "Phase",
    "PhaseRule",
    "OpRule",
    "OPS",
    "OP_RULES",
    "ShimFlag",
    "Status",
    "RecordKind",
    "Role",
    "RecordFlag",
    "TicketKind",
    "MUTATING_OPS",
    "CARRIER_OPS",
    "MULTICAST_KINDS",
    "MULTICAST_RESTORE_OPS",
    "ProtocolError",
    "socket_path",
    "default_control_dir",
    "pid_from_socket_path",
    "cuda_result_name",
    "Request",
    "Reply",
    "Access",
    "Record",
    "Ticket",
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

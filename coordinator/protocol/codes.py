"""protocol.h's #defines and enums, and the ``CUI_OPS`` table row for row (:data:`OPS`), from
which the op sets the coordinator uses are derived. Part of :mod:`cuinterpose.coordinator.protocol`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "CUI_PROTO_MAGIC",
    "CUI_PROTO_VERSION",
    "CUI_DEFAULT_CONTROL_DIR",
    "CUI_SOCKET_PREFIX",
    "CUI_SOCKET_SUFFIX",
    "CUI_CLAIM_SUFFIX",
    "CLAIM_TOKEN_BYTES",
    "CUI_MAX_ACCESS",
    "CUI_TXN_ROOM",
    "CUI_TICKET_MAGIC",
    "CUI_IPC_MAGIC",
    "CUI_IPC_EVENT_MAGIC",
    "CONTROL_DIR_ENV",
    "Op",
    "Phase",
    "PhaseRule",
    "OpRule",
    "OPS",
    "OP_RULES",
    "Status",
    "RecordKind",
    "Role",
    "RecordFlag",
    "DeviceUse",
    "CUI_INSPECT_DEVICES",
    "TicketKind",
    "ShimFlag",
    "CUI_TXN_ROOM",
    "MUTATING_OPS",
    "CARRIER_OPS",
    "MULTICAST_KINDS",
    "MULTICAST_RESTORE_OPS",
    "ProtocolError",
]

# --- #defines -------------------------------------------------------------------------------
CUI_PROTO_MAGIC = 0x50495543  # "CUIP" as little-endian bytes
CUI_PROTO_VERSION = 2  # 2: SAVE/LOAD_ALLOCATIONS carry chunk files (protocol.h "Carriers")
CUI_DEFAULT_CONTROL_DIR = "/tmp/cuinterpose"
CUI_SOCKET_PREFIX = "cuinterpose-"  # + decimal pid + ".sock"
CUI_SOCKET_SUFFIX = ".sock"
#: CUI_SOCKET_PREFIX + pid + this: the claim file of a process (protocol.h "Claims")
CUI_CLAIM_SUFFIX = ".claim"
#: bytes of a claim token (``cui_request.claim``)
CLAIM_TOKEN_BYTES = 16
CUI_MAX_ACCESS = 32
#: txn ids kept free after a capture op for the ops that undo or restore it (protocol.h).
CUI_TXN_ROOM = 16
CUI_TICKET_MAGIC = b"CUITKT01"  # 8 bytes, no NUL
CUI_IPC_MAGIC = b"CUIIPC01"  # 8 bytes, no NUL: a virtual IPC handle (struct cui_ipc_handle)
#: 8 bytes, no NUL: a virtual IPC event handle (struct cui_ipc_event_handle)
CUI_IPC_EVENT_MAGIC = b"CUIIPCEV"
CONTROL_DIR_ENV = "CUINTERPOSE_CONTROL_DIR"


class ProtocolError(ValueError):
    """Bytes that do not match protocol.h (length, magic, version, limits)."""


# --- enums ----------------------------------------------------------------------------------
class Op(enum.IntEnum):
    """``enum cui_op``."""

    INSPECT = 1
    PREPARE_MULTICAST = 2
    SAVE_ALLOCATIONS = 3
    PREPARE_UNICAST = 4
    LOAD_ALLOCATIONS = 5
    RESTORE_UNICAST = 6
    RESTORE_MULTICAST_CREATORS = 7
    RESTORE_MULTICAST_IMPORTERS = 8
    RESTORE_MULTICAST_DEVICES = 9
    RESTORE_MULTICAST_BINDINGS = 10
    CANCEL_CAPTURE = 11
    FETCH_FD = 32


class Phase(enum.IntEnum):
    """``enum cui_phase``."""

    ACTIVE = 0
    MULTICAST_RELEASED = 1
    SAVED = 2
    PREPARED = 3
    LOADED = 4
    MULTICAST_CREATED = 5
    MULTICAST_IMPORTED = 6
    MULTICAST_DEVICES = 7
    FAILED = 255


class PhaseRule(enum.IntEnum):
    """``enum cui_phase_rule``: pseudo phases of the ops table (never a shim's phase)."""

    ANY = 256  # needs: every phase but FAILED
    SAME = 257  # leaves: the phase does not change
    MULTICAST_RELEASED_OR_ACTIVE = 258  # MULTICAST_RELEASED if the capture ran PREPARE_MULTICAST
    UNCHECKED = 259  # needs: no expected_phase check (FETCH_FD: refuses SAVED/PREPARED/FAILED)


@dataclass(frozen=True)
class OpRule:
    """One row of ``CUI_OPS``: the phase an op needs and the phase a success leaves (a
    :class:`Phase` or a :class:`PhaseRule`), whether it mutates (newer txn_id, never retried)
    and whether it copies carrier bytes (the long carrier timeout)."""

    op: Op
    needs: Phase | PhaseRule
    leaves: Phase | PhaseRule
    mutating: bool
    copies_bytes: bool


_R = PhaseRule
#: ``CUI_OPS`` of protocol.h, row for row and in its order (pinned by the protocol probe).
OPS: tuple[OpRule, ...] = tuple(
    OpRule(*row)
    for row in (
        (Op.INSPECT, _R.ANY, _R.SAME, False, False),
        (Op.PREPARE_MULTICAST, Phase.ACTIVE, Phase.MULTICAST_RELEASED, True, False),
        (Op.SAVE_ALLOCATIONS, _R.MULTICAST_RELEASED_OR_ACTIVE, Phase.SAVED, True, True),
        (Op.PREPARE_UNICAST, Phase.SAVED, Phase.PREPARED, True, False),
        (Op.LOAD_ALLOCATIONS, Phase.PREPARED, Phase.LOADED, True, True),
        (Op.RESTORE_UNICAST, Phase.LOADED, _R.MULTICAST_RELEASED_OR_ACTIVE, True, False),
        (
            Op.RESTORE_MULTICAST_CREATORS,
            Phase.MULTICAST_RELEASED,
            Phase.MULTICAST_CREATED,
            True,
            False,
        ),
        (
            Op.RESTORE_MULTICAST_IMPORTERS,
            Phase.MULTICAST_CREATED,
            Phase.MULTICAST_IMPORTED,
            True,
            False,
        ),
        (
            Op.RESTORE_MULTICAST_DEVICES,
            Phase.MULTICAST_IMPORTED,
            Phase.MULTICAST_DEVICES,
            True,
            False,
        ),
        (Op.RESTORE_MULTICAST_BINDINGS, Phase.MULTICAST_DEVICES, Phase.ACTIVE, True, False),
        (Op.CANCEL_CAPTURE, Phase.SAVED, _R.MULTICAST_RELEASED_OR_ACTIVE, True, False),
        (Op.FETCH_FD, _R.UNCHECKED, _R.SAME, False, False),
    )
)
#: op -> its row of :data:`OPS`
OP_RULES: dict[Op, OpRule] = {r.op: r for r in OPS}
#: Ops that change shim state: they need a strictly increasing txn_id and are never retried.
MUTATING_OPS = frozenset(r.op for r in OPS if r.mutating)
#: Ops that copy carrier bytes (they get the long carrier timeout).
CARRIER_OPS = frozenset(r.op for r in OPS if r.copies_bytes)
#: The multicast rebuild ops in order, each with the phase it needs.
MULTICAST_RESTORE_OPS = tuple(
    (r.op, r.needs) for r in OPS if r.op.name.startswith("RESTORE_MULTICAST_")
)


class Status(enum.IntEnum):
    """``enum cui_status`` (``cui_reply.status``)."""

    OK = 0
    REFUSED_PHASE = 1
    REFUSED_DUPLICATE = 2
    REFUSED_STATE = 3
    FAILED = 4
    BAD_REQUEST = 5
    NOT_FOUND = 6
    BUSY = 7  # retryable: another mutating request runs; nothing changed, txn not consumed
    REFUSED_PEER = 8  # SO_PEERCRED: mutating op from neither root nor the shim's uid;
    # or FETCH_FD without the allocation's secret

    @property
    def is_refusal(self) -> bool:
        """True for statuses that, per protocol.h, changed nothing in the shim."""
        return self in (
            Status.REFUSED_PHASE,
            Status.REFUSED_DUPLICATE,
            Status.REFUSED_STATE,
            Status.BAD_REQUEST,
            Status.NOT_FOUND,
            Status.BUSY,
            Status.REFUSED_PEER,
        )

    @property
    def is_retryable(self) -> bool:
        """True for BUSY: the same request may be sent again unchanged."""
        return self is Status.BUSY


class ShimFlag(enum.IntFlag):
    """``cui_reply.shim_flags`` (``CUI_SHIM_*``)."""

    FOREIGN_DLSYM = 1  # another dlsym interposer preloaded before the shim: lookups untracked
    CARRY_SHA256 = 2  # the shim takes CarryFlag.SHA256 (a shim from before D36 does not)
    OP_RUNNING = 4  # a mutating op is queued or running: a lost reply is still being worked on
    CARRY_STREAMED = 8  # the shim takes CarryFlag.STREAMED (a shim from before D70 does not)


class RecordKind(enum.IntEnum):
    """``enum cui_record_kind``."""

    ALLOCATION = 1
    MAPPING = 2
    RESERVATION = 3
    MULTICAST = 4
    MULTICAST_DEVICE = 5
    MULTICAST_BINDING = 6
    MULTICAST_MAPPING = 7
    DEVICE = 8  # one per device ordinal used: alloc_id = CUuuid now, size = total memory


#: Record kinds that describe multicast state (protocol.h "Multicast records").
MULTICAST_KINDS = frozenset(
    {
        RecordKind.MULTICAST,
        RecordKind.MULTICAST_DEVICE,
        RecordKind.MULTICAST_BINDING,
        RecordKind.MULTICAST_MAPPING,
    }
)


class Role(enum.IntEnum):
    """``enum cui_role``."""

    PRIVATE = 0
    CREATOR = 1
    IMPORTER = 2


class RecordFlag(enum.IntFlag):
    """``CUI_REC_*`` bits of ``cui_record.flags``."""

    EXPORTED = 0x1
    SHARED = 0x2
    RAW_IMPORT = 0x4
    CARRIED = 0x8
    PASSTHROUGH = 0x10
    MC_BY_ADDR = 0x20
    MC_V2_ABI = 0x40
    ADAPTER = 0x80  # IPC adapter allocation: reserved[0] = bytes requested, size = bytes mapped
    IPC = 0x100  # creator: virtual IPC handle handed out; importer: opened (reserved[1] = opens)


#: ``cui_request.reserved[0]`` of an INSPECT: also send the DEVICE records (protocol.h).
CUI_INSPECT_DEVICES = 0x1


class DeviceUse(enum.IntFlag):
    """``CUI_DEV_USE_*`` bits of a DEVICE record's ``reserved0``: why the process uses the
    ordinal (protocol.h ``CUI_RECORD_DEVICE``)."""

    CONTEXT = 0x1  # its primary context is active (cuDevicePrimaryCtxGetState)
    ALLOCATION = 0x2  # an allocation's location (or the IPC adapter's device)
    ACCESS = 0x4  # named by an access descriptor of a mapping
    MULTICAST = 0x8  # added to a multicast object, or a binding's device


class TicketKind(enum.IntEnum):
    """``enum cui_ticket_kind``."""

    ALLOCATION = 1
    MULTICAST = 2

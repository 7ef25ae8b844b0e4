"""Topology checks on INSPECT records: capture preflight and restore equality.

``validate(records_by_pid)`` runs before anything is torn down, so a refusal here is free:
the workload keeps running. ``compare(captured, restored)`` runs on the INSPECT after
restore and must pass before the workload is told to continue.

Both raise :class:`TopologyError` whose message names the pid and the object, e.g.
``pid 4121 imports allocation 9f3c... from pid 4119, which is not a participant``.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Iterable, Mapping

from .errors import CoordinatorError
from .protocol import Record, RecordFlag, RecordKind, Role, alloc_id_hex

__all__ = ["TopologyError", "validate", "compare", "carriers", "COMPARE_IGNORED",
           "CU_MEM_ALLOCATION_TYPE_PINNED", "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"]

# CUDA driver enum values (cuda.h), used by the checks below.
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1

#: Record fields that legitimately change between capture and the INSPECT after restore:
#: the carrier is released after LOAD_ALLOCATIONS (``CUI_REC_CARRIED`` cleared,
#: ``carrier_checksum``/``carrier_bytes`` reset), and reserved fields carry no meaning.
#: Every other field (kind, role, other flags, alloc_id, creator_pid, handle_refs, size, va,
#: offset, allocation properties, access list) must be equal.
COMPARE_IGNORED = ("carrier_checksum", "carrier_bytes", "flags:CUI_REC_CARRIED", "reserved0",
                   "reserved", "access[].reserved")


class TopologyError(CoordinatorError):
    """A topology that cannot be captured, or a restore that did not rebuild it.

    Attributes: ``pid`` (participant at fault, or None), ``alloc_id`` (hex, or None),
    ``phase`` ("INSPECT"), ``changed`` (False from validate, True from compare: the shims
    were already rebuilt).
    """

    def __init__(self, message: str, *, pid: int | None = None, alloc_id: str | None = None,
                 phase: str = "INSPECT", changed: bool = False):
        super().__init__(message)
        self.pid = pid
        self.alloc_id = alloc_id
        self.phase = phase
        self.changed = changed


def _is(value, enum_member) -> bool:
    return int(value) == int(enum_member)


def validate(records_by_pid: Mapping[int, Iterable[Record]],
             participants: Iterable[int] | None = None) -> None:
    """Check that the records describe a topology the phases can capture and restore.

    ``records_by_pid``: pid -> INSPECT records. ``participants``: the pids in the group
    (default: the keys of ``records_by_pid``). Rules, in order; the first violation raises
    :class:`TopologyError` naming pid and allocation:

    1. no record carries ``CUI_REC_RAW_IMPORT`` (a live import of a non-ticket FD);
    2. allocations: size > 0, type PINNED, handle types 0 or POSIX_FILE_DESCRIPTOR; shared
       ones (creator/importer) exactly POSIX_FILE_DESCRIPTOR;
    3. exactly one creator per shared allocation (by alloc_id);
    4. every importer names a creator pid that is a participant and holds the creator
       record of that allocation, with the same size; importers carry no bytes;
    5. each creator still holds a handle or a mapping (``missing creator anchor``);
    6. mappings: va != 0; a shared mapping refers to an allocation record of the same pid;
       offset + size <= that allocation's size.
    """
    recs = {int(pid): list(rs) for pid, rs in records_by_pid.items()}
    members = set(int(p) for p in participants) if participants is not None else set(recs)

    for pid, rs in sorted(recs.items()):
        for r in rs:
            if r.flags & RecordFlag.RAW_IMPORT:
                raise TopologyError(
                    f"pid {pid} holds a live raw import of allocation {r.alloc_id_hex} "
                    f"(imported from a file descriptor that is not a cuinterpose export ticket); "
                    f"it cannot be restored, so capture is refused", pid=pid,
                    alloc_id=r.alloc_id_hex)

    allocs: dict[int, dict[bytes, Record]] = {}
    creators: dict[bytes, list[int]] = defaultdict(list)
    for pid, rs in sorted(recs.items()):
        by_id = allocs.setdefault(pid, {})
        for r in rs:
            if not _is(r.kind, RecordKind.ALLOCATION):
                continue
            aid = r.alloc_id_hex
            shared = int(r.role) in (Role.CREATOR, Role.IMPORTER)
            if r.size == 0:
                raise TopologyError(f"pid {pid} allocation {aid} has size 0", pid=pid,
                                    alloc_id=aid)
            if r.prop_type != CU_MEM_ALLOCATION_TYPE_PINNED:
                raise TopologyError(f"pid {pid} allocation {aid} has allocation type "
                                    f"{r.prop_type}, only CU_MEM_ALLOCATION_TYPE_PINNED is "
                                    "supported", pid=pid, alloc_id=aid)
            allowed = ((CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,) if shared else
                       (CU_MEM_HANDLE_TYPE_NONE, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
            if r.prop_handle_types not in allowed:
                need = "a shared allocation needs exactly" if shared else "supported are 0 and"
                raise TopologyError(
                    f"pid {pid} allocation {aid} has requested handle types "
                    f"{r.prop_handle_types:#x}; {need} CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
                    pid=pid, alloc_id=aid)
            by_id[bytes(r.alloc_id)] = r
            if _is(r.role, Role.CREATOR):
                creators[bytes(r.alloc_id)].append(pid)

    for aid_b, pids in creators.items():
        if len(pids) > 1:
            aid = alloc_id_hex(aid_b)
            raise TopologyError(f"allocation {aid} has {len(pids)} creators (pids "
                                f"{', '.join(map(str, sorted(pids)))}); exactly one is allowed",
                                pid=sorted(pids)[1], alloc_id=aid)

    for pid, by_id in sorted(allocs.items()):
        for aid_b, r in by_id.items():
            if not _is(r.role, Role.IMPORTER):
                continue
            aid = r.alloc_id_hex
            cpid = r.creator_pid
            if cpid not in members:
                raise TopologyError(f"pid {pid} imports allocation {aid} from pid {cpid}, "
                                    "which is not a participant", pid=pid, alloc_id=aid)
            if creators.get(aid_b) != [cpid]:
                raise TopologyError(f"pid {pid} imports allocation {aid} from pid {cpid}, but "
                                    f"pid {cpid} has no creator record of it (missing creator)",
                                    pid=pid, alloc_id=aid)
            creator = allocs[cpid][aid_b]
            if creator.size != r.size:
                raise TopologyError(f"pid {pid} imports allocation {aid} with size "
                                    f"{r.size:#x}, creator pid {cpid} has size "
                                    f"{creator.size:#x}", pid=pid, alloc_id=aid)
            if r.flags & RecordFlag.CARRIED or r.carrier_bytes:
                raise TopologyError(f"pid {pid} importer of allocation {aid} holds carrier "
                                    "bytes; only the creator may", pid=pid, alloc_id=aid)

    mapped: dict[int, set[bytes]] = defaultdict(set)
    for pid, rs in sorted(recs.items()):
        for r in rs:
            if not _is(r.kind, RecordKind.MAPPING):
                continue
            aid = r.alloc_id_hex
            if r.va == 0:
                raise TopologyError(f"pid {pid} mapping of allocation {aid} has va 0",
                                    pid=pid, alloc_id=aid)
            alloc = allocs.get(pid, {}).get(bytes(r.alloc_id))
            if alloc is None:
                if int(r.role) in (Role.CREATOR, Role.IMPORTER):
                    raise TopologyError(f"pid {pid} mapping at va {r.va:#x} refers to allocation "
                                        f"{aid}, which pid {pid} does not hold", pid=pid,
                                        alloc_id=aid)
                continue
            if r.offset + r.size > alloc.size:
                raise TopologyError(f"pid {pid} mapping of allocation {aid} at va {r.va:#x}: "
                                    f"offset {r.offset:#x} + size {r.size:#x} exceeds the "
                                    f"allocation size {alloc.size:#x}", pid=pid, alloc_id=aid)
            mapped[pid].add(bytes(r.alloc_id))

    for aid_b, pids in creators.items():
        pid = pids[0]
        r = allocs[pid][aid_b]
        if r.handle_refs == 0 and aid_b not in mapped[pid]:
            raise TopologyError(f"pid {pid} allocation {r.alloc_id_hex}: missing creator anchor "
                                "(the creator holds neither a handle nor a mapping of it)",
                                pid=pid, alloc_id=r.alloc_id_hex)


def carriers(records_by_pid: Mapping[int, Iterable[Record]]) -> list[dict]:
    """Carried creator allocations: ``[{"pid", "alloc_id" (hex), "bytes", "checksum" (16 hex)}]``,
    sorted by pid then alloc_id. ``bytes`` is ``carrier_bytes``; checksum is cui_checksum64."""
    out = []
    for pid, rs in sorted(records_by_pid.items()):
        for r in rs:
            if (_is(r.kind, RecordKind.ALLOCATION) and _is(r.role, Role.CREATOR)
                    and r.flags & RecordFlag.CARRIED):
                out.append({"pid": int(pid), "alloc_id": r.alloc_id_hex,
                            "bytes": int(r.carrier_bytes),
                            "checksum": f"{r.carrier_checksum:016x}"})
    out.sort(key=lambda c: (c["pid"], c["alloc_id"]))
    return out


# --- restore equality --------------------------------------------------------------------
def _normal(r: Record) -> Record:
    """The record with every ignored field cleared (see COMPARE_IGNORED)."""
    return dataclasses.replace(
        r, flags=int(r.flags) & ~int(RecordFlag.CARRIED), carrier_checksum=0, carrier_bytes=0,
        reserved0=0, reserved=(0, 0, 0, 0),
        access=tuple(dataclasses.replace(a, reserved=0) for a in r.access),
        kind=int(r.kind), role=int(r.role))


def _key(r: Record):
    kind = int(r.kind)
    if kind == RecordKind.ALLOCATION:
        return (kind, bytes(r.alloc_id))
    if kind == RecordKind.MAPPING:
        return (kind, bytes(r.alloc_id), r.offset, r.size)
    return (kind, bytes(r.alloc_id), r.size, r.offset)


_FIELDS = [f.name for f in dataclasses.fields(Record)]


def _fmt(name, value):
    if name in ("va", "size", "offset"):
        return f"{value:#x}"
    if name == "alloc_id":
        return alloc_id_hex(value)
    if name == "flags":
        return f"{value:#x}"
    if name == "access":
        return "[" + ", ".join(f"({a.location_type},{a.location_id},{a.flags:#x})"
                               for a in value) + "]"
    return str(value)


def compare(captured: Mapping[int, Iterable[Record]], restored: Mapping[int, Iterable[Record]],
            *, phase: str = "INSPECT") -> None:
    """Raise :class:`TopologyError` unless ``restored`` equals ``captured`` per participant,
    modulo :data:`COMPARE_IGNORED`. Record order does not matter. The message names the pid,
    the object and the first differing field, e.g. ``INSPECT after restore: pid 4121 mapping of
    allocation 9f3c... at va 0x7f0000200000: va differs (captured 0x7f0000200000, restored
    0x7f0000400000)``."""
    head = f"{phase} after restore"
    cap = {int(p): list(rs) for p, rs in captured.items()}
    res = {int(p): list(rs) for p, rs in restored.items()}
    for pid in sorted(set(cap) | set(res)):
        if pid not in res:
            raise TopologyError(f"{head}: pid {pid} did not report", pid=pid, phase=phase,
                                changed=True)
        if pid not in cap:
            raise TopologyError(f"{head}: pid {pid} was not captured", pid=pid, phase=phase,
                                changed=True)
        groups_c, groups_r = defaultdict(list), defaultdict(list)
        for r in cap[pid]:
            groups_c[_key(r)].append(r)
        for r in res[pid]:
            groups_r[_key(r)].append(r)
        for key in sorted(set(groups_c) | set(groups_r), key=repr):
            cs = sorted(groups_c.get(key, []), key=lambda r: r.va)
            rs = sorted(groups_r.get(key, []), key=lambda r: r.va)
            for c, r in zip(cs, rs):
                nc, nr = _normal(c), _normal(r)
                if nc == nr:
                    continue
                for name in _FIELDS:
                    if getattr(nc, name) != getattr(nr, name):
                        raise TopologyError(
                            f"{head}: pid {pid} {c.describe()}: {name} differs (captured "
                            f"{_fmt(name, getattr(nc, name))}, restored "
                            f"{_fmt(name, getattr(nr, name))})",
                            pid=pid, alloc_id=c.alloc_id_hex, phase=phase,
                            changed=True)
            for c in cs[len(rs):]:
                raise TopologyError(f"{head}: pid {pid} {c.describe()} is missing",
                                    pid=pid, alloc_id=c.alloc_id_hex, phase=phase,
                                    changed=True)
            for r in rs[len(cs):]:
                raise TopologyError(f"{head}: pid {pid} has an unexpected {r.describe()}",
                                    pid=pid, alloc_id=r.alloc_id_hex, phase=phase,
                                    changed=True)

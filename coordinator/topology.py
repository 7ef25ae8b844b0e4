"""Topology checks on INSPECT records: capture preflight and restore equality.

``validate(records_by_pid)`` runs before anything is torn down, so a refusal here is free:
the workload keeps running. ``compare(captured, restored)`` runs on the INSPECT after
restore and must pass before the workload is told to continue.

Both raise :class:`TopologyError` whose message names the pid and the object, e.g.
``pid 4121 imports allocation 9f3c... from pid 4119, which is not a participant``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter, defaultdict
from typing import Iterable, Mapping

from .errors import CoordinatorError
from .protocol import (
    MULTICAST_KINDS,
    DeviceUse,
    Op,
    Record,
    RecordFlag,
    RecordKind,
    Role,
    alloc_id_hex,
)

__all__ = [
    "TopologyError",
    "validate",
    "validate_multicast",
    "has_multicast",
    "compare",
    "carriers",
    "COMPARE_IGNORED",
    "CU_MEM_ALLOCATION_TYPE_PINNED",
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
]

# CUDA driver enum values (cuda.h), used by the checks below.
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1

#: Record fields that legitimately change between capture and the INSPECT after restore:
#: the carrier is released after LOAD_ALLOCATIONS (``CUI_REC_CARRIED`` cleared,
#: ``carrier_checksum``/``carrier_bytes`` reset), and reserved fields carry no meaning
#: (except in MULTICAST_BINDING records, where they name the bound member and are compared).
#: Every other field (kind, role, other flags, alloc_id, creator_pid, handle_refs, size, va,
#: offset, allocation properties, access list) must be equal.
COMPARE_IGNORED = (
    "carrier_checksum",
    "carrier_bytes",
    "flags:CUI_REC_CARRIED",
    "reserved0",
    "reserved",
    "access[].reserved",
)


class TopologyError(CoordinatorError):
    """A topology that cannot be captured, or a restore that did not rebuild it.

    Attributes: ``pid`` (participant at fault, or None), ``alloc_id`` (hex, or None),
    ``phase`` ("INSPECT"), ``changed`` (False from validate, True from compare: the shims
    were already rebuilt).
    """

    def __init__(
        self,
        message: str,
        *,
        pid: int | None = None,
        alloc_id: str | None = None,
        phase: str = Op.INSPECT.name,
        changed: bool = False,
    ):
        super().__init__(message)
        self.pid = pid
        self.alloc_id = alloc_id
        self.phase = phase
        self.changed = changed


# plain ints: a record's fields compare with them without an enum operator per record
_ALLOCATION, _MAPPING, _DEVICE, _BINDING, _CREATOR, _IMPORTER, _CARRIED, _RAW_IMPORT = map(int, (
    RecordKind.ALLOCATION, RecordKind.MAPPING, RecordKind.DEVICE, RecordKind.MULTICAST_BINDING,
    Role.CREATOR, Role.IMPORTER, RecordFlag.CARRIED, RecordFlag.RAW_IMPORT))  # fmt: skip


def validate(
    records_by_pid: Mapping[int, Iterable[Record]], participants: Iterable[int] | None = None
) -> None:
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
    7. multicast (:func:`validate_multicast`).
    """
    recs = {int(pid): list(rs) for pid, rs in records_by_pid.items()}
    members = set(int(p) for p in participants) if participants is not None else set(recs)

    for pid, rs in sorted(recs.items()):
        for r in rs:
            if r.flags & _RAW_IMPORT:
                raise TopologyError(
                    f"pid {pid} holds a live raw import of allocation {r.alloc_id_hex} "
                    f"(imported from a file descriptor that is not a cuinterpose export ticket); "
                    f"it cannot be restored, so capture is refused",
                    pid=pid,
                    alloc_id=r.alloc_id_hex,
                )

    allocs: dict[int, dict[bytes, Record]] = {}
    creators: dict[bytes, list[int]] = defaultdict(list)
    for pid, rs in sorted(recs.items()):
        by_id = allocs.setdefault(pid, {})
        for r in rs:
            if r.kind != _ALLOCATION:
                continue
            aid = r.alloc_id_hex
            shared = r.role == _CREATOR or r.role == _IMPORTER
            if r.size == 0:
                raise TopologyError(f"pid {pid} allocation {aid} has size 0", pid=pid, alloc_id=aid)
            if r.prop_type != CU_MEM_ALLOCATION_TYPE_PINNED:
                raise TopologyError(
                    f"pid {pid} allocation {aid} has allocation type "
                    f"{r.prop_type}, only CU_MEM_ALLOCATION_TYPE_PINNED is "
                    "supported",
                    pid=pid,
                    alloc_id=aid,
                )
            allowed = (
                (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,)
                if shared
                else (CU_MEM_HANDLE_TYPE_NONE, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
            )
            if r.prop_handle_types not in allowed:
                need = "a shared allocation needs exactly" if shared else "supported are 0 and"
                raise TopologyError(
                    f"pid {pid} allocation {aid} has requested handle types "
                    f"{r.prop_handle_types:#x}; {need} CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
                    pid=pid,
                    alloc_id=aid,
                )
            by_id[bytes(r.alloc_id)] = r
            if r.role == _CREATOR:
                creators[bytes(r.alloc_id)].append(pid)

    for aid_b, pids in creators.items():
        if len(pids) > 1:
            aid = alloc_id_hex(aid_b)
            raise TopologyError(
                f"allocation {aid} has {len(pids)} creators (pids "
                f"{', '.join(map(str, sorted(pids)))}); exactly one is allowed",
                pid=sorted(pids)[1],
                alloc_id=aid,
            )

    for pid, by_id in sorted(allocs.items()):
        for aid_b, r in by_id.items():
            if r.role != _IMPORTER:
                continue
            aid = r.alloc_id_hex
            cpid = r.creator_pid
            if cpid not in members:
                raise TopologyError(
                    f"pid {pid} imports allocation {aid} from pid {cpid}, "
                    "which is not a participant",
                    pid=pid,
                    alloc_id=aid,
                )
            if creators.get(aid_b) != [cpid]:
                raise TopologyError(
                    f"pid {pid} imports allocation {aid} from pid {cpid}, but "
                    f"pid {cpid} has no creator record of it (missing creator)",
                    pid=pid,
                    alloc_id=aid,
                )
            creator = allocs[cpid][aid_b]
            if creator.size != r.size:
                raise TopologyError(
                    f"pid {pid} imports allocation {aid} with size "
                    f"{r.size:#x}, creator pid {cpid} has size "
                    f"{creator.size:#x}",
                    pid=pid,
                    alloc_id=aid,
                )
            if r.flags & _CARRIED or r.carrier_bytes:
                raise TopologyError(
                    f"pid {pid} importer of allocation {aid} holds carrier "
                    "bytes; only the creator may",
                    pid=pid,
                    alloc_id=aid,
                )

    mapped: dict[int, set[bytes]] = defaultdict(set)
    for pid, rs in sorted(recs.items()):
        for r in rs:
            if r.kind != _MAPPING:
                continue
            aid = r.alloc_id_hex
            if r.va == 0:
                raise TopologyError(
                    f"pid {pid} mapping of allocation {aid} has va 0", pid=pid, alloc_id=aid
                )
            alloc = allocs.get(pid, {}).get(bytes(r.alloc_id))
            if alloc is None:
                if int(r.role) in (Role.CREATOR, Role.IMPORTER):
                    raise TopologyError(
                        f"pid {pid} mapping at va {r.va:#x} refers to allocation "
                        f"{aid}, which pid {pid} does not hold",
                        pid=pid,
                        alloc_id=aid,
                    )
                continue
            if r.offset + r.size > alloc.size:
                raise TopologyError(
                    f"pid {pid} mapping of allocation {aid} at va {r.va:#x}: "
                    f"offset {r.offset:#x} + size {r.size:#x} exceeds the "
                    f"allocation size {alloc.size:#x}",
                    pid=pid,
                    alloc_id=aid,
                )
            mapped[pid].add(bytes(r.alloc_id))

    bound: dict[int, set[bytes]] = defaultdict(set)
    for pid, rs in recs.items():
        for r in rs:
            if r.kind == _BINDING and any(r.member_alloc_id):
                bound[pid].add(bytes(r.member_alloc_id))
    for aid_b, pids in creators.items():
        pid = pids[0]
        r = allocs[pid][aid_b]
        if r.handle_refs == 0 and aid_b not in mapped[pid] and aid_b not in bound[pid]:
            raise TopologyError(
                f"pid {pid} allocation {r.alloc_id_hex}: missing creator anchor "
                "(the creator holds neither a handle nor a mapping of it)",
                pid=pid,
                alloc_id=r.alloc_id_hex,
            )

    validate_multicast(recs, members, allocs)


def validate_multicast(
    recs: Mapping[int, list[Record]],
    members: set[int],
    allocs: Mapping[int, Mapping[bytes, Record]] | None = None,
) -> None:
    """Multicast rules (docs/coordinator.md "Validation rules", 7), first violation raises
    TopologyError naming the pid and the object:

    1. no object is a pass-through (``CUI_REC_PASSTHROUGH``: handle types not exactly POSIX);
    2. exactly one creator per object; importers name a participant that holds it;
    3. every participant reports the same requested size, numDevices and handle types;
    4. the attached (participant, device) pairs number exactly numDevices;
    5. every attached pair has a binding, and every binding's device is attached in the same
       participant;
    6. every binding and mapping range lies within the largest extent any participant
       reported; a bound member is an allocation of the same pid and the range fits it.
    """
    objs: dict[bytes, dict[int, Record]] = defaultdict(dict)
    devices: dict[bytes, set[tuple[int, int]]] = defaultdict(set)
    binds: dict[bytes, list[tuple[int, Record]]] = defaultdict(list)
    maps: dict[bytes, list[tuple[int, Record]]] = defaultdict(list)
    for pid, rs in sorted(recs.items()):
        for r in rs:
            k = int(r.kind)
            key = bytes(r.alloc_id)
            if k == RecordKind.MULTICAST:
                objs[key][pid] = r
            elif k == RecordKind.MULTICAST_DEVICE:
                devices[key].add((pid, int(r.prop_location_id)))
            elif k == RecordKind.MULTICAST_BINDING:
                binds[key].append((pid, r))
            elif k == RecordKind.MULTICAST_MAPPING:
                maps[key].append((pid, r))
    for key in sorted(set(devices) | set(binds) | set(maps)):
        holders = sorted(
            {p for p, _ in devices[key]} | {p for p, _ in binds[key]} | {p for p, _ in maps[key]}
        )
        for pid in holders:
            if pid not in objs.get(key, {}):
                aid = alloc_id_hex(key)
                raise TopologyError(
                    f"pid {pid} has devices, bindings or mappings of multicast "
                    f"object {aid} but no record of the object",
                    pid=pid,
                    alloc_id=aid,
                )
    for key, by_pid in sorted(objs.items()):
        aid = alloc_id_hex(key)
        for pid, r in sorted(by_pid.items()):
            if r.flags & RecordFlag.PASSTHROUGH:
                raise TopologyError(
                    f"pid {pid} multicast object {aid} has handle types "
                    f"{r.prop_handle_types:#x}; only exactly CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
                    "can be rebuilt after a restore, so capture is refused",
                    pid=pid,
                    alloc_id=aid,
                )
        creators = sorted(p for p, r in by_pid.items() if r.role == _CREATOR)
        if len(creators) != 1:
            pid = creators[1] if creators else sorted(by_pid)[0]
            raise TopologyError(
                f"multicast object {aid} has {len(creators)} creators"
                + (f" (pids {', '.join(map(str, creators))})" if creators else "")
                + "; exactly one is required",
                pid=pid,
                alloc_id=aid,
            )
        cpid = creators[0]
        c = by_pid[cpid]
        for pid, r in sorted(by_pid.items()):
            if r.role == _IMPORTER and r.creator_pid not in members:
                raise TopologyError(
                    f"pid {pid} imports multicast object {aid} from pid "
                    f"{r.creator_pid}, which is not a participant",
                    pid=pid,
                    alloc_id=aid,
                )
            if r.creator_pid != cpid:
                raise TopologyError(
                    f"pid {pid} names pid {r.creator_pid} as the creator of "
                    f"multicast object {aid}, but pid {cpid} created it",
                    pid=pid,
                    alloc_id=aid,
                )
            for name, what in (
                ("size", "requested size"),
                ("prop_location_id", "numDevices"),
                ("prop_handle_types", "handle types"),
            ):
                if getattr(r, name) != getattr(c, name):
                    raise TopologyError(
                        f"pid {pid} multicast object {aid}: {what} {getattr(r, name):#x} differs "
                        f"from the creator pid {cpid}'s {getattr(c, name):#x}",
                        pid=pid,
                        alloc_id=aid,
                    )
        attached = devices.get(key, set())
        want = int(c.prop_location_id)
        if len(attached) != want:
            raise TopologyError(
                f"multicast object {aid}: {len(attached)} (participant, device) "
                f"pairs attached, numDevices is {want} (incomplete multicast "
                "team)",
                pid=cpid,
                alloc_id=aid,
            )
        bound_pairs = {(pid, int(r.prop_location_id)) for pid, r in binds.get(key, [])}
        for pid, dev in sorted(attached):
            if (pid, dev) not in bound_pairs:
                raise TopologyError(
                    f"pid {pid} attached device {dev} to multicast object {aid} "
                    "but bound no memory for it",
                    pid=pid,
                    alloc_id=aid,
                )
        for pid, dev in sorted(bound_pairs):
            if (pid, dev) not in attached:
                raise TopologyError(
                    f"pid {pid} binding of multicast object {aid} is for device "
                    f"{dev}, which pid {pid} did not attach",
                    pid=pid,
                    alloc_id=aid,
                )
        extent = max(int(r.offset) for r in by_pid.values())
        for pid, r in binds.get(key, []) + maps.get(key, []):
            if r.offset + r.size > extent:
                raise TopologyError(
                    f"pid {pid} {r.describe()}: offset {r.offset:#x} + size "
                    f"{r.size:#x} exceeds the largest extent {extent:#x} any "
                    "participant reported",
                    pid=pid,
                    alloc_id=aid,
                )
        for pid, r in binds.get(key, []):
            if allocs is None or not any(r.member_alloc_id):
                continue
            member = allocs.get(pid, {}).get(bytes(r.member_alloc_id))
            if member is None:
                raise TopologyError(
                    f"pid {pid} {r.describe()} binds allocation "
                    f"{r.member_alloc_id_hex}, which pid {pid} does not hold",
                    pid=pid,
                    alloc_id=aid,
                )
            if r.member_offset + r.size > member.size:
                raise TopologyError(
                    f"pid {pid} {r.describe()}: member offset "
                    f"{r.member_offset:#x} + size {r.size:#x} exceeds allocation "
                    f"{r.member_alloc_id_hex} size {member.size:#x}",
                    pid=pid,
                    alloc_id=aid,
                )


def has_multicast(records_by_pid: Mapping[int, Iterable[Record]]) -> bool:
    """True when any participant reports a multicast record: the capture then runs
    PREPARE_MULTICAST (every participant) and the restore the four rebuild ops."""
    return any(int(r.kind) in MULTICAST_KINDS for rs in records_by_pid.values() for r in rs)


def carriers(records_by_pid: Mapping[int, Iterable[Record]]) -> list[dict]:
    """Carried creator allocations: ``[{"pid", "alloc_id" (hex), "bytes", "checksum" (16 hex)}]``,
    sorted by pid then alloc_id. ``bytes`` is ``carrier_bytes``; checksum is cui_checksum64."""
    out = []
    for pid, rs in sorted(records_by_pid.items()):
        for r in rs:
            if r.kind == _ALLOCATION and r.role == _CREATOR and r.flags & _CARRIED:
                out.append(
                    {
                        "pid": int(pid),
                        "alloc_id": r.alloc_id_hex,
                        "bytes": int(r.carrier_bytes),
                        "checksum": f"{r.carrier_checksum:016x}",
                    }
                )
    out.sort(key=lambda c: (c["pid"], c["alloc_id"]))
    return out


# --- restore equality --------------------------------------------------------------------
def _normal(r: Record) -> Record:
    """The record with every ignored field cleared (see COMPARE_IGNORED)."""
    same = dict(
        kind=int(r.kind),
        role=int(r.role),
        access=tuple(dataclasses.replace(a, reserved=0) for a in r.access),
    )
    if r.kind == _BINDING:  # reserved fields name the member
        return r.replace(**same)
    zero = dict(carrier_checksum=0, carrier_bytes=0, reserved0=0, reserved=(0, 0, 0, 0))
    return r.replace(flags=int(r.flags) & ~_CARRIED, **zero, **same)


_FIELDS_OF = operator.attrgetter(
    "alloc_id", "creator_pid", "handle_refs", "size", "va", "offset", "prop_type",
    "prop_location_type", "prop_location_id", "prop_handle_types",
)  # fmt: skip
_BINDING_TAIL = operator.attrgetter("carrier_checksum", "carrier_bytes", "reserved0", "reserved")


def _compared(r: Record) -> tuple:
    """The fields of ``r`` that :func:`compare` compares, as a tuple (what :func:`_normal`
    keeps, without building a record)."""
    acc = tuple([(a.location_type, a.location_id, a.flags) for a in r.access])
    if r.kind == _BINDING:  # the reserved fields name the member
        return (r.kind, r.role, r.flags, _FIELDS_OF(r), acc, _BINDING_TAIL(r))
    return (r.kind, r.role, r.flags & ~_CARRIED, _FIELDS_OF(r), acc)


def _equal_but_devices(cap: list[Record], res: list[Record]) -> bool:
    """Whether the records other than DEVICE ones are equal as multisets under
    :data:`COMPARE_IGNORED` (O(n): one tuple and one hash per record)."""
    c = Counter(_compared(r) for r in cap if r.kind != _DEVICE)
    return c == Counter(_compared(r) for r in res if r.kind != _DEVICE)


def _key(r: Record):
    kind = int(r.kind)
    if kind == RecordKind.DEVICE:
        return (kind, int(r.prop_location_id))
    if kind == RecordKind.ALLOCATION:
        return (kind, bytes(r.alloc_id))
    if kind == RecordKind.MAPPING:
        return (kind, bytes(r.alloc_id), r.offset, r.size)
    if kind == RecordKind.MULTICAST:
        return (kind, bytes(r.alloc_id))
    if kind == RecordKind.MULTICAST_DEVICE:
        return (kind, bytes(r.alloc_id), int(r.prop_location_id))
    if kind == RecordKind.MULTICAST_BINDING:
        return (kind, bytes(r.alloc_id), int(r.prop_location_id), r.offset, r.size)
    if kind == RecordKind.MULTICAST_MAPPING:
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
        return (
            "["
            + ", ".join(f"({a.location_type},{a.location_id},{a.flags:#x})" for a in value)
            + "]"
        )
    return str(value)


def _has_devices(rs) -> bool:
    return any(r.kind == _DEVICE for r in rs)


def _kept(r: Record, devices: bool) -> bool:
    return r.kind != _DEVICE or (devices and bool(int(r.device_uses) & ~int(DeviceUse.CONTEXT)))


def _uses(bits: int) -> str:
    return "|".join(u.name for u in DeviceUse if bits & u) or "none"


def _compare_device(
    head: str, pid: int, c: Record, r: Record, device_map: Mapping[str, str], phase: str
) -> None:
    """One DEVICE record pair (same ordinal) under the device map: the restored UUID is the
    captured one mapped (unmapped: the same), the name hash equal, the total memory equal (at
    least the captured one when the ordinal moved: the map's targets may be larger), the uses
    equal but for CONTEXT (the shim's restore ops retain primary contexts itself)."""
    old, new = c.device_uuid, r.device_uuid
    want = device_map.get(old, old)
    moved = want != old
    what = f"pid {pid} device ordinal {c.prop_location_id}"
    problem = None
    if new != want:
        mapped = f", which the device map moves to {want}" if moved else ""
        problem = f"uuid differs (captured {old}{mapped}; restored {new})"
    elif c.device_name_hash != r.device_name_hash:
        problem = (
            f"name differs on {new} (name hash captured {c.device_name_hash:#018x}, restored "
            f"{r.device_name_hash:#018x}): not the same GPU model"
        )
    elif (r.size < c.size) if moved else (r.size != c.size):
        problem = (
            f"total memory differs (captured {c.size} bytes on {old}, restored {r.size} on {new})"
        )
    else:
        uses_c = int(c.device_uses) & ~int(DeviceUse.CONTEXT)
        uses_r = int(r.device_uses) & ~int(DeviceUse.CONTEXT)
        if uses_c != uses_r:
            problem = f"uses differ (captured {_uses(uses_c)}, restored {_uses(uses_r)})"
    if problem:
        raise TopologyError(f"{head}: {what}: {problem}", pid=pid, phase=phase, changed=True)


def compare(
    captured: Mapping[int, Iterable[Record]],
    restored: Mapping[int, Iterable[Record]],
    *,
    phase: str = Op.INSPECT.name,
    device_map: Mapping[str, str] | None = None,
) -> None:
    """Raise :class:`TopologyError` unless ``restored`` equals ``captured`` per participant,
    modulo :data:`COMPARE_IGNORED`. Record order does not matter. The message names the pid,
    the object and the first differing field, e.g. ``INSPECT after restore: pid 4121 mapping of
    allocation 9f3c... at va 0x7f0000200000: va differs (captured 0x7f0000200000, restored
    0x7f0000400000)``.

    DEVICE records (one per ordinal) are compared under ``device_map`` ({old UUID: new UUID},
    ``GPU-xxxxxxxx-...`` strings as agent/mech/devicemap.py writes them; None or empty: the
    same GPUs): ``INSPECT after restore: pid 4121 device ordinal 0: uuid differs (captured
    GPU-a..., which the device map moves to GPU-c...; restored GPU-d...)``. They are compared
    for a pid when both sides carry some (an INSPECT without ``CUI_INSPECT_DEVICES``, or a shim
    before CUI_RECORD_DEVICE, sends none), and only those with a use besides ``CONTEXT`` (the
    shim's restore ops retain primary contexts themselves)."""
    head = f"{phase} after restore"
    dmap = dict(device_map or {})
    cap = {int(p): list(rs) for p, rs in captured.items()}
    res = {int(p): list(rs) for p, rs in restored.items()}
    for pid in set(cap) & set(res):
        # compared when both INSPECTs carry them (CUI_INSPECT_DEVICES; a shim before them),
        # and only ordinals used by more than a context: the shim's restore ops retain the
        # primary context of the device they rebuild on (ordinal 0 for host memory) themselves
        both = _has_devices(cap[pid]) and _has_devices(res[pid])
        cap[pid] = [r for r in cap[pid] if _kept(r, both)]
        res[pid] = [r for r in res[pid] if _kept(r, both)]
    for pid in sorted(set(cap) | set(res)):
        if pid in cap and pid in res and _equal_but_devices(cap[pid], res[pid]):
            # the common case in O(n): only DEVICE records (under the device map) take the
            # pairwise walk below, which also names any difference
            cap[pid], res[pid] = ([r for r in x[pid] if r.kind == _DEVICE] for x in (cap, res))
        if pid not in res:
            raise TopologyError(
                f"{head}: pid {pid} did not report", pid=pid, phase=phase, changed=True
            )
        if pid not in cap:
            raise TopologyError(
                f"{head}: pid {pid} was not captured", pid=pid, phase=phase, changed=True
            )
        groups_c, groups_r = defaultdict(list), defaultdict(list)
        for r in cap[pid]:
            groups_c[_key(r)].append(r)
        for r in res[pid]:
            groups_r[_key(r)].append(r)
        for key in sorted(set(groups_c) | set(groups_r), key=repr):
            cs = sorted(groups_c.get(key, []), key=lambda r: r.va)
            rs = sorted(groups_r.get(key, []), key=lambda r: r.va)
            for c, r in zip(cs, rs):
                if int(c.kind) == RecordKind.DEVICE:
                    _compare_device(head, pid, c, r, dmap, phase)
                    continue
                nc, nr = _normal(c), _normal(r)
                if nc == nr:
                    continue
                for name in _FIELDS:
                    if getattr(nc, name) != getattr(nr, name):
                        raise TopologyError(
                            f"{head}: pid {pid} {c.describe()}: {name} differs (captured "
                            f"{_fmt(name, getattr(nc, name))}, restored "
                            f"{_fmt(name, getattr(nr, name))})",
                            pid=pid,
                            alloc_id=c.alloc_id_hex,
                            phase=phase,
                            changed=True,
                        )
            for c in cs[len(rs) :]:
                raise TopologyError(
                    f"{head}: pid {pid} {c.describe()} is missing",
                    pid=pid,
                    alloc_id=c.alloc_id_hex,
                    phase=phase,
                    changed=True,
                )
            for r in rs[len(cs) :]:
                raise TopologyError(
                    f"{head}: pid {pid} has an unexpected {r.describe()}",
                    pid=pid,
                    alloc_id=r.alloc_id_hex,
                    phase=phase,
                    changed=True,
                )

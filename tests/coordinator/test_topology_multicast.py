"""topology.validate's multicast rules (one test per rule, exact messages) and compare over
multicast records. A valid two-participant team: pid 10 creates object M and imports nothing,
pid 11 imports M; each adds its device 0, binds its own shared allocation (1 MiB) at offset 0
and maps M."""

from __future__ import annotations

import struct

import pytest

from cuinterpose.coordinator import topology
from cuinterpose.coordinator.protocol import Access, RecordFlag, RecordKind, Role
from cuinterpose.coordinator.topology import TopologyError

MiB = 1 << 20
M = bytes(range(0x40, 0x50))
MH = M.hex()
MEM = {10: bytes([0xA0] * 16), 11: bytes([0xB0] * 16)}


def member_fields(pid, off=0):
    lo, hi = struct.unpack("<QQ", MEM[pid])
    return {"reserved0": pid, "reserved": (lo, hi, off, 0)}


def team(extent=MiB, size=MiB, ndev=2):
    recs = {}
    for pid, role in ((10, Role.CREATOR), (11, Role.IMPORTER)):
        recs[pid] = [
            dict(
                kind=RecordKind.ALLOCATION,
                role=Role.CREATOR,
                flags=RecordFlag.SHARED,
                alloc_id=MEM[pid],
                creator_pid=pid,
                handle_refs=1,
                size=MiB,
                prop_type=1,
                prop_location_type=1,
                prop_handle_types=1,
            ),
            dict(
                kind=RecordKind.MULTICAST,
                role=role,
                flags=RecordFlag.SHARED,
                alloc_id=M,
                creator_pid=10,
                handle_refs=1,
                size=size,
                offset=extent,
                prop_location_id=ndev,
                prop_handle_types=1,
            ),
            dict(
                kind=RecordKind.MULTICAST_DEVICE,
                role=role,
                alloc_id=M,
                creator_pid=10,
                prop_location_type=1,
                prop_location_id=0,
            ),
            dict(
                kind=RecordKind.MULTICAST_BINDING,
                role=role,
                alloc_id=M,
                creator_pid=10,
                prop_location_type=1,
                prop_location_id=0,
                offset=0,
                size=MiB,
                **member_fields(pid),
            ),
            dict(
                kind=RecordKind.MULTICAST_MAPPING,
                role=role,
                alloc_id=M,
                creator_pid=10,
                va=0x7F0000000000 + pid * MiB,
                size=MiB,
                access=(Access(1, 0, 3),),
            ),
        ]
    from cuinterpose.coordinator.protocol import Record

    return {pid: [Record(**d) for d in rs] for pid, rs in recs.items()}


def _raises(recs, message, pid):
    with pytest.raises(TopologyError) as ei:
        topology.validate(recs)
    assert str(ei.value) == message
    assert (ei.value.pid, ei.value.alloc_id, ei.value.changed) == (pid, MH, False)


def _set(recs, pid, kind, **changes):
    recs[pid] = [r.replace(**changes) if r.kind == kind else r for r in recs[pid]]
    return recs


def test_valid_team():
    topology.validate(team())
    assert topology.has_multicast(team())
    assert not topology.has_multicast(
        {10: [r for r in team()[10] if r.kind == RecordKind.ALLOCATION]}
    )


def test_passthrough_object_refused():
    recs = _set(team(), 11, RecordKind.MULTICAST, flags=RecordFlag.PASSTHROUGH, prop_handle_types=0)
    _raises(
        recs,
        f"pid 11 multicast object {MH} has handle types 0x0; only exactly "
        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR can be rebuilt after a restore, so capture "
        "is refused",
        11,
    )


def test_two_creators():
    recs = _set(team(), 11, RecordKind.MULTICAST, role=Role.CREATOR)
    _raises(
        recs, f"multicast object {MH} has 2 creators (pids 10, 11); exactly one is required", 11
    )


def test_no_creator():
    recs = team()
    del recs[10]
    _raises(recs, f"multicast object {MH} has 0 creators; exactly one is required", 11)


def test_inconsistent_properties():
    _raises(
        _set(team(), 11, RecordKind.MULTICAST, size=2 * MiB),
        f"pid 11 multicast object {MH}: requested size 0x200000 differs from the creator pid "
        "10's 0x100000",
        11,
    )
    _raises(
        _set(team(), 11, RecordKind.MULTICAST, prop_location_id=3),
        f"pid 11 multicast object {MH}: numDevices 0x3 differs from the creator pid 10's 0x2",
        11,
    )


def test_attached_pairs_must_equal_num_devices():
    recs = team(ndev=3)
    recs = _set(recs, 11, RecordKind.MULTICAST, prop_location_id=3)
    _raises(
        recs,
        f"multicast object {MH}: 2 (participant, device) pairs attached, numDevices is 3 "
        "(incomplete multicast team)",
        10,
    )


def test_attached_pair_without_binding():
    recs = team()
    recs[11] = [r for r in recs[11] if r.kind != RecordKind.MULTICAST_BINDING]
    recs[11] = [r for r in recs[11] if r.kind != RecordKind.ALLOCATION]
    _raises(
        recs, f"pid 11 attached device 0 to multicast object {MH} but bound no memory for it", 11
    )


def test_binding_for_a_device_not_attached_in_the_same_participant():
    recs = team(ndev=3)
    recs = _set(recs, 11, RecordKind.MULTICAST, prop_location_id=3)
    recs[11].append(recs[11][2].replace(prop_location_id=1))  # device 1 of pid 11
    recs[11].append(recs[11][3].replace(prop_location_id=2))  # binding for device 2
    recs[11].append(recs[11][3].replace(prop_location_id=1))  # binding for device 1
    _raises(
        recs,
        f"pid 11 binding of multicast object {MH} is for device 2, which pid 11 did not attach",
        11,
    )


def test_member_range_beyond_every_reported_extent():
    recs = _set(team(), 11, RecordKind.MULTICAST_BINDING, offset=MiB)
    _raises(
        recs,
        f"pid 11 binding of multicast object {MH} device 0 at offset 0x100000 size "
        "0x100000: offset 0x100000 + size 0x100000 exceeds the largest extent 0x100000 any "
        "participant reported",
        11,
    )


def test_extent_larger_than_requested_passes():
    """Test 4's validation: ranks bound into the slack the driver gave beyond the requested
    size; the largest extent any participant reported covers it."""
    recs = team(extent=3 * MiB)
    recs = _set(recs, 10, RecordKind.MULTICAST_BINDING, offset=2 * MiB)
    recs = _set(recs, 11, RecordKind.MULTICAST, offset=MiB)  # pid 11 reports less: fine
    topology.validate(recs)


def test_bound_member_not_held():
    recs = team()
    recs[11] = [r for r in recs[11] if r.kind != RecordKind.ALLOCATION]
    _raises(
        recs,
        f"pid 11 binding of multicast object {MH} device 0 at offset 0x0 size 0x100000 "
        f"binds allocation {MEM[11].hex()}, which pid 11 does not hold",
        11,
    )


def test_records_without_object():
    recs = team()
    recs[11] = [r for r in recs[11] if r.kind != RecordKind.MULTICAST]
    with pytest.raises(TopologyError) as ei:
        topology.validate(recs)
    assert str(ei.value) == (
        f"pid 11 has devices, bindings or mappings of multicast object {MH} "
        "but no record of the object"
    )


def test_compare_covers_multicast_records():
    cap = team()
    topology.compare(cap, team())
    # a binding whose member differs (reserved fields name it) is a difference
    other = _set(team(), 11, RecordKind.MULTICAST_BINDING, **member_fields(10))
    with pytest.raises(TopologyError) as ei:
        topology.compare(cap, other)
    assert str(ei.value) == (
        f"INSPECT after restore: pid 11 binding of multicast object {MH} "
        "device 0 at offset 0x0 size 0x100000: reserved0 differs (captured 11, "
        "restored 10)"
    )
    # a missing mapping, a changed extent
    gone = team()
    gone[10] = [r for r in gone[10] if r.kind != RecordKind.MULTICAST_MAPPING]
    with pytest.raises(TopologyError) as ei:
        topology.compare(cap, gone)
    assert str(ei.value) == (
        f"INSPECT after restore: pid 10 mapping of multicast object {MH} at va "
        "0x7f0000a00000 is missing"
    )
    with pytest.raises(TopologyError) as ei:
        topology.compare(cap, _set(team(), 10, RecordKind.MULTICAST, offset=2 * MiB))
    assert str(ei.value) == (
        f"INSPECT after restore: pid 10 multicast object {MH}: offset differs "
        "(captured 0x100000, restored 0x200000)"
    )

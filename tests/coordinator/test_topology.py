"""topology.validate (one test per rule) and topology.compare."""

from __future__ import annotations

import pytest

from cuinterpose.coordinator import topology
from cuinterpose.coordinator.protocol import Access, RecordFlag, RecordKind, Role
from cuinterpose.coordinator.topology import TopologyError

from .helpers import BASE, A, B, MiB, P, alloc, group_records, mapping

AH, BH = A.hex(), B.hex()


def _raises(recs, message, pid, alloc_id, participants=None):
    with pytest.raises(TopologyError) as ei:
        topology.validate(recs, participants=participants)
    assert str(ei.value) == message
    assert ei.value.pid == pid and ei.value.alloc_id == alloc_id


def test_valid_group():
    topology.validate(group_records())


def test_raw_import_refused():
    recs = group_records()
    recs[4123][0] = recs[4123][0].replace(flags=RecordFlag.SHARED | RecordFlag.RAW_IMPORT)
    _raises(
        recs,
        f"pid 4123 holds a live raw import of allocation {AH} (imported from a file "
        "descriptor that is not a cuinterpose export ticket); it cannot be restored, so "
        "capture is refused",
        4123,
        AH,
    )


def test_two_creators():
    recs = group_records()
    recs[4123][0] = recs[4123][0].replace(role=Role.CREATOR, creator_pid=4123, handle_refs=1)
    _raises(
        recs, f"allocation {AH} has 2 creators (pids 4119, 4123); exactly one is allowed", 4123, AH
    )


def test_importer_of_non_participant():
    recs = group_records()
    del recs[4119]
    _raises(
        recs,
        f"pid 4121 imports allocation {AH} from pid 4119, which is not a participant",
        4121,
        AH,
    )


def test_importer_without_creator_record():
    recs = group_records()
    recs[4119] = [r for r in recs[4119] if r.alloc_id != A]
    _raises(
        recs,
        f"pid 4121 imports allocation {AH} from pid 4119, but pid 4119 has no creator "
        "record of it (missing creator)",
        4121,
        AH,
    )


def test_importer_names_wrong_creator():
    recs = group_records()
    recs[4123][0] = recs[4123][0].replace(creator_pid=4121)
    _raises(
        recs,
        f"pid 4123 imports allocation {AH} from pid 4121, but pid 4121 has no creator "
        "record of it (missing creator)",
        4123,
        AH,
    )


def test_importer_size_differs():
    recs = group_records()
    recs[4123][0] = recs[4123][0].replace(size=4 * MiB)
    _raises(
        recs,
        f"pid 4123 imports allocation {AH} with size 0x400000, creator pid 4119 has size 0x200000",
        4123,
        AH,
    )


def test_importer_with_carrier():
    recs = group_records()
    recs[4123][0] = recs[4123][0].replace(flags=RecordFlag.SHARED | RecordFlag.CARRIED)
    _raises(
        recs,
        f"pid 4123 importer of allocation {AH} holds carrier bytes; only the creator may",
        4123,
        AH,
    )


def test_missing_creator_anchor():
    recs = group_records()
    recs[4119] = [
        r.replace(handle_refs=0) if r.kind == RecordKind.ALLOCATION else r
        for r in recs[4119]
        if not (r.kind == RecordKind.MAPPING and r.alloc_id == A)
    ]
    _raises(
        recs,
        f"pid 4119 allocation {AH}: missing creator anchor (the creator holds neither "
        "a handle nor a mapping of it)",
        4119,
        AH,
    )


def test_creator_anchor_by_mapping_alone_is_enough():
    recs = group_records()
    recs[4119] = [
        r.replace(handle_refs=0) if r.kind == RecordKind.ALLOCATION else r for r in recs[4119]
    ]
    topology.validate(recs)


def test_mapping_out_of_bounds():
    recs = group_records()
    recs[4123][1] = recs[4123][1].replace(offset=MiB, size=MiB + 4096)
    _raises(
        recs,
        f"pid 4123 mapping of allocation {AH} at va {BASE + 6 * MiB:#x}: offset "
        "0x100000 + size 0x101000 exceeds the allocation size 0x200000",
        4123,
        AH,
    )


def test_mapping_va_zero():
    recs = group_records()
    recs[4121][2] = recs[4121][2].replace(va=0)
    _raises(recs, f"pid 4121 mapping of allocation {BH} has va 0", 4121, BH)


def test_shared_mapping_of_unknown_allocation():
    recs = group_records()
    recs[4123] = [r for r in recs[4123] if r.kind != RecordKind.ALLOCATION or r.alloc_id != A]
    _raises(
        recs,
        f"pid 4123 mapping at va {BASE + 6 * MiB:#x} refers to allocation {AH}, which "
        "pid 4123 does not hold",
        4123,
        AH,
    )


def test_allocation_type_not_pinned():
    recs = group_records()
    recs[4123][2] = recs[4123][2].replace(prop_type=2)
    _raises(
        recs,
        f"pid 4123 allocation {P.hex()} has allocation type 2, only "
        "CU_MEM_ALLOCATION_TYPE_PINNED is supported",
        4123,
        P.hex(),
    )


def test_handle_types():
    recs = group_records()
    recs[4123][2] = recs[4123][2].replace(prop_handle_types=8)  # FABRIC
    _raises(
        recs,
        f"pid 4123 allocation {P.hex()} has requested handle types 0x8; supported are "
        "0 and CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
        4123,
        P.hex(),
    )
    recs = group_records()
    recs[4121][1] = recs[4121][1].replace(prop_handle_types=0)
    _raises(
        recs,
        f"pid 4121 allocation {BH} has requested handle types 0x0; a shared "
        "allocation needs exactly CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
        4121,
        BH,
    )


def test_zero_size():
    recs = group_records()
    recs[4123][2] = recs[4123][2].replace(size=0)
    _raises(recs, f"pid 4123 allocation {P.hex()} has size 0", 4123, P.hex())


def test_explicit_participants():
    # 4119 reported records but is not in the group
    _raises(
        group_records(),
        f"pid 4121 imports allocation {AH} from pid 4119, which is not a participant",
        4121,
        AH,
        participants=[4121, 4123],
    )


# --- compare ------------------------------------------------------------------------------
def test_compare_ignores_carrier_fields_and_order():
    cap = group_records()
    res = group_records()
    res[4119] = list(reversed(res[4119]))
    cap[4119][1] = cap[4119][1].replace(
        flags=cap[4119][1].flags | RecordFlag.CARRIED,
        carrier_bytes=2 * MiB,
        carrier_checksum=0x1234,
    )
    res[4121][2] = res[4121][2].replace(reserved=(1, 0, 0, 0))
    topology.compare(cap, res)


@pytest.mark.parametrize(
    "field,value,text",
    [
        ("handle_refs", 2, "handle_refs differs (captured 1, restored 2)"),
        ("flags", RecordFlag.SHARED, "flags differs (captured 0x3, restored 0x2)"),
        ("prop_location_id", 1, "prop_location_id differs (captured 0, restored 1)"),
    ],
)
def test_compare_names_field(field, value, text):
    res = group_records()
    res[4119][1] = res[4119][1].replace(**{field: value})
    with pytest.raises(TopologyError) as ei:
        topology.compare(group_records(), res)
    assert str(ei.value) == f"INSPECT after restore: pid 4119 allocation {AH}: {text}"
    assert ei.value.pid == 4119 and ei.value.alloc_id == AH


def test_compare_access_differs():
    res = group_records()
    res[4121][4] = res[4121][4].replace(access=(Access(1, 0, 3),))
    with pytest.raises(
        TopologyError,
        match=r"access differs \(captured \[\(1,0,0x3\), "
        r"\(1,1,0x3\)\], restored \[\(1,0,0x3\)\]\)",
    ):
        topology.compare(group_records(), res)


def test_compare_missing_and_extra():
    res = group_records()
    del res[4123][3]
    with pytest.raises(TopologyError) as ei:
        topology.compare(group_records(), res)
    assert str(ei.value) == (
        f"INSPECT after restore: pid 4123 mapping of allocation {P.hex()} "
        f"at va {BASE + 8 * MiB:#x} is missing"
    )
    res = group_records()
    res[4123].append(mapping(P, Role.PRIVATE, 4123, BASE + 10 * MiB))
    with pytest.raises(TopologyError) as ei:
        topology.compare(group_records(), res)
    assert str(ei.value) == (
        f"INSPECT after restore: pid 4123 has an unexpected mapping of "
        f"allocation {P.hex()} at va {BASE + 10 * MiB:#x}"
    )
    res = group_records()
    del res[4123]
    with pytest.raises(TopologyError, match="^INSPECT after restore: pid 4123 did not report$"):
        topology.compare(group_records(), res)


def test_carriers_list():
    recs = group_records()
    recs[4119][1] = recs[4119][1].replace(
        flags=recs[4119][1].flags | RecordFlag.CARRIED,
        carrier_bytes=2 * MiB,
        carrier_checksum=0xABC,
    )
    assert topology.carriers(recs) == [
        {"pid": 4119, "alloc_id": AH, "bytes": 2 * MiB, "checksum": "0000000000000abc"}
    ]
    assert alloc(A, Role.CREATOR, 4119).flags == RecordFlag.SHARED | RecordFlag.EXPORTED


def test_changed_flag_and_base_class():
    from cuinterpose.coordinator.errors import CoordinatorError

    recs = group_records()
    recs[4121][2] = recs[4121][2].replace(va=0)
    with pytest.raises(CoordinatorError) as ei:
        topology.validate(recs)
    assert ei.value.changed is False and ei.value.phase == "INSPECT"
    with pytest.raises(CoordinatorError) as ei:
        topology.compare(group_records(), recs)
    assert ei.value.changed is True

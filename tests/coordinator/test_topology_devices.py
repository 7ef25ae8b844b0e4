"""DEVICE records (protocol.h CUI_RECORD_DEVICE) in the restore compare: equal on the same GPUs,
moved by exactly the device map onto other GPUs, anything else refused naming pid, ordinal and
both GPUs (coordinator/topology.py compare)."""

from __future__ import annotations

import pytest

from cuinterpose.coordinator.protocol import DeviceUse, Record, RecordKind
from cuinterpose.coordinator.topology import TopologyError, compare

from .helpers import BASE, A, MiB, Role, alloc, mapping

GiB = 1 << 30
U0, U1, U2, U3 = (bytes([0xA0 + i]) + bytes(range(1, 16)) for i in range(4))
NAME = 0x1234_5678_9ABC_DEF0


def dev(ordinal, uuid, *, mem=16 * GiB, uses=DeviceUse.CONTEXT | DeviceUse.ALLOCATION, name=NAME):
    return Record(
        kind=RecordKind.DEVICE,
        alloc_id=uuid,
        size=mem,
        prop_location_type=1,
        prop_location_id=ordinal,
        reserved0=int(uses),
        reserved=(name, 0, 0, 0),
    )


def s(b: bytes) -> str:
    return Record(kind=RecordKind.DEVICE, alloc_id=b).device_uuid


def recs(*devices):
    return {
        4119: [
            alloc(A, Role.PRIVATE, 4119, refs=1),
            mapping(A, Role.PRIVATE, 4119, BASE, size=2 * MiB),
            *devices,
        ]
    }


def test_device_uuid_is_written_as_nvidia_smi_does():
    r = dev(0, bytes.fromhex("0123456789abcdef0011223344556677"))
    assert r.device_uuid == "GPU-01234567-89ab-cdef-0011-223344556677"
    assert r.describe() == "device ordinal 0 (GPU-01234567-89ab-cdef-0011-223344556677)"
    assert r.device_uses == DeviceUse.CONTEXT | DeviceUse.ALLOCATION
    assert r.device_name_hash == NAME


def test_same_gpus_compare_equal():
    compare(recs(dev(0, U0), dev(1, U1)), recs(dev(0, U0), dev(1, U1)))


def test_moved_by_exactly_the_map():
    compare(
        recs(dev(0, U0), dev(1, U1)),
        recs(dev(0, U2, mem=32 * GiB), dev(1, U3)),
        device_map={s(U0): s(U2), s(U1): s(U3)},
    )


def test_moved_without_the_map_is_refused_naming_both_gpus():
    with pytest.raises(TopologyError) as e:
        compare(recs(dev(0, U0)), recs(dev(0, U2)))
    assert str(e.value) == (
        f"INSPECT after restore: pid 4119 device ordinal 0: uuid differs (captured {s(U0)}; "
        f"restored {s(U2)})"
    )
    assert (e.value.pid, e.value.changed) == (4119, True)


def test_moved_elsewhere_than_the_map_says_is_refused():
    with pytest.raises(TopologyError) as e:
        compare(
            recs(dev(0, U0), dev(1, U1)),
            recs(dev(0, U3), dev(1, U2)),
            device_map={s(U0): s(U2), s(U1): s(U3)},
        )
    assert str(e.value) == (
        f"INSPECT after restore: pid 4119 device ordinal 0: uuid differs (captured {s(U0)}, "
        f"which the device map moves to {s(U2)}; restored {s(U3)})"
    )


def test_other_model_less_memory_and_other_uses_are_refused():
    dmap = {s(U0): s(U2)}
    with pytest.raises(TopologyError, match=r"device ordinal 0: name differs on GPU-a2"):
        compare(recs(dev(0, U0)), recs(dev(0, U2, name=NAME + 1)), device_map=dmap)
    with pytest.raises(TopologyError) as e:
        compare(recs(dev(0, U0)), recs(dev(0, U2, mem=8 * GiB)), device_map=dmap)
    assert str(e.value).endswith(
        f"device ordinal 0: total memory differs (captured {16 * GiB} bytes on {s(U0)}, "
        f"restored {8 * GiB} on {s(U2)})"
    )
    # in place, the memory must be equal
    with pytest.raises(TopologyError, match="total memory differs"):
        compare(recs(dev(0, U0)), recs(dev(0, U0, mem=32 * GiB)))
    with pytest.raises(TopologyError) as e:
        compare(recs(dev(0, U0)), recs(dev(0, U0, uses=DeviceUse.ACCESS)))
    assert "uses differ (captured ALLOCATION, restored ACCESS)" in str(e.value)


def test_context_use_alone_may_change():
    """The shim's restore ops retain primary contexts themselves (ordinal 0 for host memory):
    CONTEXT is not compared, and an ordinal used by a context only is left out."""
    compare(
        recs(dev(0, U0, uses=DeviceUse.ALLOCATION)),
        recs(dev(0, U0, uses=DeviceUse.ALLOCATION | DeviceUse.CONTEXT)),
    )
    compare(
        recs(dev(1, U1, uses=DeviceUse.ALLOCATION)),
        recs(dev(0, U2, uses=DeviceUse.CONTEXT), dev(1, U1, uses=DeviceUse.ALLOCATION)),
    )


def test_missing_and_unexpected_device_records_are_refused():
    with pytest.raises(TopologyError) as e:
        compare(recs(dev(0, U0), dev(1, U1)), recs(dev(0, U0)))
    assert str(e.value) == f"INSPECT after restore: pid 4119 device ordinal 1 ({s(U1)}) is missing"
    with pytest.raises(TopologyError) as e:
        compare(recs(dev(0, U0)), recs(dev(0, U0), dev(1, U1)))
    assert str(e.value) == (
        f"INSPECT after restore: pid 4119 has an unexpected device ordinal 1 ({s(U1)})"
    )


def test_device_records_on_one_side_only_are_skipped():
    """A snapshot taken by a shim before CUI_RECORD_DEVICE restores under a newer one, and an
    INSPECT that did not ask (no CUI_INSPECT_DEVICES) compares without them."""
    compare(recs(), recs(dev(0, U2), dev(1, U3)))
    compare(recs(dev(0, U0), dev(1, U1)), recs())

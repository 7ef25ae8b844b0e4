"""INSPECT's DEVICE records (protocol.h CUI_RECORD_DEVICE, CUI_INSPECT_DEVICES): sent only when
the request asks, one per ordinal used (allocation location, access grant, active primary
context), ordinal order after every other record, each naming the GPU the driver gives for the
ordinal (UUID bytes, total memory, name hash) as FAKECUDA_DEVICES configures it."""

from __future__ import annotations

from cuinterpose.coordinator.client import ShimClient
from cuinterpose.coordinator.protocol import (
    DeviceUse,
    Op,
    Phase,
    RecordKind,
    Status,
    cui_checksum64,
    socket_path,
)

from .conftest import GRAN, POSIX, RW

NODE = "H100 80GB:80G:7,L4:24G:9,H100 80GB:80G:11"


def uuid(i: int) -> str:
    h = (b"fakecudaGPU-uu" + bytes([i >> 8, i & 0xFF])).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def inspect(env, app, devices: bool):
    c = ShimClient(
        socket_path(env["CUINTERPOSE_CONTROL_DIR"], app.pid), timeout_s=30, inspect_devices=devices
    )
    resp = c.request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    assert resp.reply.status == Status.OK, resp.message
    return resp.records


def test_device_records_only_when_asked_naming_the_gpus(apps, shim_env):
    env = {**shim_env, "FAKECUDA_DEVICES": NODE, "CUDA_VISIBLE_DEVICES": "2,1,0"}
    a = apps(env=env)
    a.ok("init 0")  # primary context on ordinal 0 (node GPU 2, id 11)
    h = a.val(f"create {GRAN} {POSIX} 2")  # allocation on ordinal 2 (node GPU 0, id 7)
    va = a.val(f"reserve {GRAN}")
    a.ok(f"map {va} {GRAN} 0 {h}")
    a.ok(f"access {va} {GRAN} 2 {RW}")  # granted to ordinal 2 too: ordinal 1 stays unused

    plain = inspect(env, a, devices=False)
    assert [r.kind for r in plain] == [
        RecordKind.ALLOCATION,
        RecordKind.MAPPING,
        RecordKind.RESERVATION,
    ]
    recs = inspect(env, a, devices=True)
    assert recs[: len(plain)] == plain  # the same records first
    devs = recs[len(plain) :]
    assert [(r.kind, r.prop_location_type, r.prop_location_id) for r in devs] == [
        (RecordKind.DEVICE, 1, 0),
        (RecordKind.DEVICE, 1, 2),
    ]
    assert [r.device_uuid for r in devs] == [uuid(11), uuid(7)]
    assert [r.size for r in devs] == [80 << 30, 80 << 30]
    assert [r.device_name_hash for r in devs] == [cui_checksum64(b"H100 80GB")] * 2
    assert [r.device_uses for r in devs] == [
        DeviceUse.CONTEXT,
        DeviceUse.ALLOCATION | DeviceUse.ACCESS,
    ]
    assert [(r.flags, bytes(r.alloc_id)) for r in devs] == [
        (0, b"fakecudaGPU-uu\x00\x0b"),
        (0, b"fakecudaGPU-uu\x00\x07"),
    ]

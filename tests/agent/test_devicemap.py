"""agent/mech/devicemap.py: GPU records, --device-map parsing, the automatic mapping and its
refusals (docs/agent.md "Restore onto other GPUs"); the manifest's GPU fields."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from cuinterpose.agent.mech import devicemap
from cuinterpose.agent.mech.devicemap import DeviceMapError
from cuinterpose.agent.snapshot import manifest, pb

G80 = 80 << 30


def uuid(i: int) -> str:
    return devicemap.uuid_str(b"fakecudaGPU-uu" + bytes([i >> 8, i & 0xFF]))


def gpu(i: int, name: str = "H100", mem: int = G80, ordinal: int | None = None) -> dict:
    return {
        "ordinal": i if ordinal is None else ordinal,
        "uuid": uuid(i),
        "name": name,
        "total_memory": mem,
        "compute_capability": "9.0",
    }


def node(*gpus: dict) -> list[dict]:
    return [dict(g, ordinal=i) for i, g in enumerate(gpus)]


def snap(*procs: list[dict]) -> dict:
    """A manifest with one participant per list of GPU records (pids 101, 102, ...)."""
    return {
        "participants": [
            {"pid": 101 + i, "socket_path": f"/s{i}", "gpus": gs} for i, gs in enumerate(procs)
        ]
    }


# two ranks that each saw physical {0,1} as ordinals 0, 1
M01 = snap([gpu(0), gpu(1)], [gpu(0), gpu(1)])
NODE4 = node(gpu(0), gpu(1), gpu(2), gpu(3))
NODE23 = node(gpu(2), gpu(3))


def test_uuid_text_round_trip():
    assert uuid(2) == "GPU-66616b65-6375-6461-4750-552d75750002"


@pytest.mark.parametrize(
    "cvd, want",
    [
        (None, [0, 1, 2, 3]),
        ("2,3", [2, 3]),
        ("3,0", [3, 0]),
        (f"{uuid(1)}, 2", [1, 2]),
        ("1,9,2", [1]),
        ("1,1", [1]),
        ("", []),
    ],
)
def test_visible_follows_the_driver(cvd, want):
    got = devicemap.visible(cvd, NODE4)
    assert [g["uuid"] for g in got] == [uuid(i) for i in want]
    assert [g["ordinal"] for g in got] == list(range(len(want)))


def test_snapshot_gpus_once_in_order():
    m = snap([gpu(1, ordinal=0)], [gpu(0, ordinal=0), gpu(1, ordinal=1)])
    assert [g["uuid"] for g in devicemap.snapshot_gpus(m)] == [uuid(1), uuid(0)]
    assert devicemap.snapshot_gpus({"participants": [{"pid": 1}]}) is None


@pytest.mark.parametrize(
    "text",
    [
        f"{uuid(0)}={uuid(2)},{uuid(1)}={uuid(3)}",
        "0=0,1=1",  # ordinals: the processes' for OLD, the agent's for NEW
        f"0={uuid(2)}, {uuid(1)}=1",
    ],
)
def test_parse_explicit_map(text):
    assert devicemap.parse(text, M01, NODE23) == {uuid(0): uuid(2), uuid(1): uuid(3)}


@pytest.mark.parametrize(
    "text, msg",
    [
        (
            "0=0",
            "device map: every checkpointed GPU must be listed; missing: "
            f"{uuid(1)} (H100, {G80} bytes)",
        ),
        ("0=0,1=0", f"device map: new GPU {uuid(2)} (H100, {G80} bytes) is the target of both"),
        ("0=0,0=1", f"device map: old GPU {uuid(0)} (H100, {G80} bytes) is listed twice"),
        ("0=0,1", "device map: entry '1' is not OLD=NEW"),
        ("0=0,7=1", "device map: old GPU '7' is no GPU of the snapshot"),
        (
            "0=0,1=5",
            f"device map: new GPU '5' is not visible to the agent (it sees 0: {uuid(2)} "
            f"(H100, {G80} bytes), 1: {uuid(3)} (H100, {G80} bytes))",
        ),
    ],
)
def test_parse_refusals(text, msg):
    with pytest.raises(DeviceMapError) as e:
        devicemap.parse(text, M01, NODE23)
    assert str(e.value).startswith(msg)
    assert e.value.phase == "device map"


def test_parse_refuses_another_model_or_less_memory_naming_both():
    n = node(gpu(2, name="L4", mem=24 << 30), gpu(3, mem=40 << 30))
    with pytest.raises(DeviceMapError) as e:
        devicemap.parse("0=0,1=1", M01, n)
    assert str(e.value) == (
        f"device map: GPU {uuid(0)} (H100, {G80} bytes) cannot be restored onto "
        f"{uuid(2)} (L4, {24 << 30} bytes): another model"
    )
    with pytest.raises(DeviceMapError) as e:
        devicemap.parse("0=1,1=0", M01, n)
    assert str(e.value) == (
        f"device map: GPU {uuid(0)} (H100, {G80} bytes) cannot be restored onto "
        f"{uuid(3)} (H100, {40 << 30} bytes): less memory"
    )


def test_parse_refuses_an_ambiguous_old_ordinal():
    m = snap([gpu(0, ordinal=0)], [gpu(1, ordinal=0)])
    with pytest.raises(DeviceMapError) as e:
        devicemap.parse("0=0,1=1", m, NODE23)
    assert str(e.value) == (
        f"device map: old GPU 0 is ambiguous: the processes saw ordinal 0 as {uuid(0)}, "
        f"{uuid(1)}; name it by UUID"
    )
    assert devicemap.parse(f"{uuid(0)}=0,{uuid(1)}=1", m, NODE23) == {
        uuid(0): uuid(2),
        uuid(1): uuid(3),
    }


def test_parse_without_gpu_records_is_refused():
    with pytest.raises(DeviceMapError) as e:
        devicemap.parse("0=0", {"participants": [{"pid": 5, "gpus": []}]}, NODE23)
    assert "records no GPUs" in str(e.value)


def test_automatic_mapping():
    # the snapshot's GPUs are visible: no mapping
    assert devicemap.automatic(M01, NODE4) == {}
    assert devicemap.resolve(M01, NODE4, None) == {}
    # absent: in snapshot order onto the visible GPUs in agent ordinal order
    assert devicemap.automatic(M01, NODE23) == {uuid(0): uuid(2), uuid(1): uuid(3)}
    # one present stays, the absent one takes a free GPU of its model with enough memory
    n = node(gpu(5, name="L4"), gpu(1), gpu(6, mem=1 << 30), gpu(7))
    assert devicemap.automatic(M01, n) == {uuid(0): uuid(7), uuid(1): uuid(1)}
    # a permutation even without the node: GPU 7, taken, gives its place to GPU 0
    assert devicemap.pairs_for(M01["participants"][0], devicemap.resolve(M01, n, None)) == [
        (uuid(0), uuid(7)),
        (uuid(1), uuid(1)),
        (uuid(7), uuid(0)),
    ]
    # with the node: a permutation of every GPU known (the driver wants the whole node), each
    # GPU left over onto a free one of its model first
    assert devicemap.pairs_for(M01["participants"][0], devicemap.resolve(M01, n, None), n) == [
        (uuid(0), uuid(7)),
        (uuid(1), uuid(1)),
        (uuid(7), uuid(6)),
        (uuid(5), uuid(5)),
        (uuid(6), uuid(0)),
    ]
    # an identity map given explicitly is no remap
    assert devicemap.resolve(M01, NODE4, "0=0,1=1") == {}


def test_automatic_refusals_name_the_gpus():
    with pytest.raises(DeviceMapError) as e:
        devicemap.automatic(M01, node(gpu(2)))
    assert str(e.value) == (
        f"device map: the snapshot used 2 GPUs ({uuid(0)} (H100, {G80} bytes), {uuid(1)} "
        f"(H100, {G80} bytes)), the agent sees 1: pass --device-map or restore where enough "
        "are visible"
    )
    with pytest.raises(DeviceMapError) as e:
        devicemap.automatic(M01, node(gpu(2), gpu(3, name="L4"), gpu(4, mem=1 << 30)))
    assert str(e.value) == (
        f"device map: GPU {uuid(1)} (H100, {G80} bytes) is absent and no visible GPU can take "
        f"it ({uuid(3)} (L4, {G80} bytes): another model; {uuid(4)} (H100, {1 << 30} bytes): "
        "less memory)"
    )


def test_mapped_gpus_keep_the_ordinals():
    mp = {uuid(0): uuid(2), uuid(1): uuid(3)}
    got = devicemap.mapped_gpus(M01["participants"][1], mp, NODE23)
    assert [(g["ordinal"], g["uuid"]) for g in got] == [(0, uuid(2)), (1, uuid(3))]


def test_manifest_gpu_fields_and_proto_round_trip():
    p = types.SimpleNamespace(gpus=[gpu(2, ordinal=0)], cuda_visible_devices="2")
    f = manifest.gpu_fields(p)
    assert f == {"gpus": [gpu(2, ordinal=0)], "cuda_visible_devices": "2"}
    assert manifest.gpu_fields(types.SimpleNamespace(gpus=None)) == {"gpus": []}
    part = {"pid": 7, "comm": "r", "socket_path": "/s", "cuda_state": "RUNNING", **f}
    part["roles"] = {"private": 0, "creator": 0, "importer": 0}
    msg = pb.manifest_to_proto({"participants": [part]})
    assert pb.manifest_from_proto(msg)["participants"] == [part]
    assert not manifest.gpus_problem(part)
    for bad in ({"gpus": [{"ordinal": 0}]}, {"gpus": "x"}, {"cuda_visible_devices": 3}):
        assert manifest.gpus_problem({**part, **bad}), bad


NODE_SCRIPT = """
import json
from cuinterpose.agent.mech import devicemap, native
native.load("fake")
print(json.dumps(devicemap.node_gpus()))
"""


def test_node_gpus_on_fakecuda(fake_env):
    env = dict(fake_env, FAKECUDA_DEVICES="H100 80GB:80G,L4:24G:9", CUDA_VISIBLE_DEVICES="1,0")
    env.pop("LD_LIBRARY_PATH")  # native.load("fake") loads it
    out = subprocess.run(
        [sys.executable, "-c", NODE_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [
        {
            "ordinal": 0,
            "uuid": uuid(9),
            "name": "L4",
            "total_memory": 24 << 30,
            "compute_capability": "9.0",
        },
        {
            "ordinal": 1,
            "uuid": uuid(0),
            "name": "H100 80GB",
            "total_memory": 80 << 30,
            "compute_capability": "9.0",
        },
    ]


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, [0, 1, 2, 3]),
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, [0, 1, 2, 3]),
        ({"NVIDIA_VISIBLE_DEVICES": "none"}, []),
        ({"NVIDIA_VISIBLE_DEVICES": "void"}, []),
        ({"NVIDIA_VISIBLE_DEVICES": f"{uuid(3)},{uuid(2)}"}, [3, 2]),
        ({"NVIDIA_VISIBLE_DEVICES": "2,3", "CUDA_VISIBLE_DEVICES": "1"}, [3]),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, [2, 3]),
    ],
)
def test_placement_gpus_are_what_the_placeholder_sees(env, want):
    """A placeholder's GPUs from its /proc/PID/environ: the container runtime's
    NVIDIA_VISIBLE_DEVICES, then CUDA_VISIBLE_DEVICES; renumbered as it sees them."""
    base = {k: v for k, v in __import__("os").environ.items() if "VISIBLE_DEVICES" not in k}
    p = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**base, **env},
    )
    try:
        assert p.stdout.readline() == b"up\n"  # past exec: its environ is the new one
        got = devicemap.placement_gpus(p.pid, NODE4)
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    assert [(g["ordinal"], g["uuid"]) for g in got] == [(i, uuid(w)) for i, w in enumerate(want)]
    # a snapshot on {0,1} restored into it maps onto what it sees
    if len(want) >= 2 and 0 not in want[:2]:
        assert devicemap.automatic(M01, got) == {uuid(0): uuid(want[0]), uuid(1): uuid(want[1])}

"""INSPECT shows the devices (issue 13): the shim's DEVICE records name, per ordinal the process
uses, the GPU the driver gives for it at that INSPECT. afdwin checkpointed on fake GPUs {0,1}
of a four-GPU node and restored onto {2,3}: the capture's records name GPUs 0 and 1, the
restored processes' INSPECT (``cuinterpose-agent inspect``, JSON and table) GPUs 2 and 3 for
the same ordinals, and the coordinator's compare accepted exactly that move."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cuinterpose.coordinator.protocol import Record, RecordKind
from cuinterpose.workloads.afdwin import demo

STEPS = 120
HOLD = 12
NODE = "H100 80GB:80G,H100 80GB:80G,H100 80GB:80G,H100 80GB:80G"
MEM = 80 << 30


def uuid(i: int) -> str:
    """fakecuda's UUID of physical GPU ``i`` (docs/fakecuda.md "Devices")."""
    h = (b"fakecudaGPU-uu" + bytes([i >> 8, i & 0xFF])).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def captured_devices(m: dict) -> dict[int, dict[int, str]]:
    """pid -> {ordinal: uuid} of the DEVICE records the capture kept in the manifest."""
    out = {}
    for p in m["capture"]["participants"]:
        recs = [Record.from_dict(r) for r in p["records"]]
        out[p["pid"]] = {
            r.prop_location_id: r.device_uuid for r in recs if r.kind == RecordKind.DEVICE
        }
    return out


def inspect_table(pid: int, ctl) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    res = subprocess.run(
        [sys.executable, "-m", "cuinterpose.agent.cli", "inspect", "--pid", str(pid)]
        + ["--control-dir", str(ctl)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_inspect_names_the_new_gpus_after_a_restore_onto_others(afdwin, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKECUDA_DEVICES", NODE)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    # the restored tree holds again at 2 * HOLD: INSPECT it there
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD, 2 * HOLD))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    a.wait_hold()
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    a.wait_dumped()
    m = json.loads((snap / "manifest.json").read_text())
    cuda = sorted(m["cuda_pids"])
    cap = captured_devices(m)
    assert sorted(cap) == cuda
    used = {pid: sorted(devs) for pid, devs in cap.items()}
    assert all(used[pid] and set(used[pid]) <= {0, 1} for pid in cuda), used
    assert set().union(*map(set, used.values())) == {0, 1}
    assert cap == {pid: {o: uuid(o) for o in used[pid]} for pid in cuda}

    rc, rs = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--device-map", "0=2,1=3"
    )
    assert rc == 0 and rs["ok"], rs
    a.wait_hold(2)
    for pid in cuda:
        rc, ins = demo.run_agent("inspect", "--pid", str(pid), "--control-dir", str(a.ctl))
        assert rc == 0 and ins["ok"], ins
        assert [(d["ordinal"], d["uuid"], d["total_memory"]) for d in ins["devices"]] == [
            (o, uuid(o + 2), MEM) for o in used[pid]
        ]
        # the same, as the raw records carry it
        recs = [Record.from_dict(r) for r in ins["records"]]
        assert {r.prop_location_id: r.device_uuid for r in recs if r.kind == RecordKind.DEVICE} == {
            o: uuid(o + 2) for o in used[pid]
        }
        table = inspect_table(pid, a.ctl)
        assert f"pid {pid}  devices" in table
        for o in used[pid]:
            row = next(ln for ln in table.splitlines() if uuid(o + 2) in ln)
            cells = [c.strip() for c in row.strip(" │|").split("│")]
            assert cells[:2] == [str(o), uuid(o + 2)], row
        assert uuid(0) not in table and uuid(1) not in table
    a.release_hold()
    assert a.wait_restored_exit(300) in (0, None)
    s = [e for e in a.events() if demo.kind(e) == "summary"][-1]
    assert (s["ok"], s["lost"], s["duplicated"], s["restores_seen"]) == (True, 0, 0, 1), s

"""Restore onto other GPUs (issue 13): afdwin checkpointed on fake GPUs {0,1} of a four-GPU node
restores onto {2,3}, with ``--device-map`` and automatically (the agent then sees only {2,3});
the same with ``--multicast``; a refused mapping leaves the snapshot untouched and the next
restore works. fakecuda: FAKECUDA_DEVICES, CUDA_VISIBLE_DEVICES (docs/fakecuda.md "Devices")."""

from __future__ import annotations

import json
import signal

import pytest

from cuinterpose.workloads.afdwin import demo

STEPS = 120
HOLD = 12
NODE = "H100 80GB:80G,H100 80GB:80G,H100 80GB:80G,H100 80GB:80G"


uuid = demo.fake_gpu_uuid
digest = demo.snapshot_digest


def checkpointed(afdwin, tmp_path, monkeypatch, extra=()):
    """afdwin (2 ranks) on GPUs {0,1}, checkpointed by an agent that sees all four."""
    log = tmp_path / "fakecuda.log"
    monkeypatch.setenv("FAKECUDA_DEVICES", NODE)
    monkeypatch.setenv("FAKECUDA_LOG", str(log))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,), extra_args=extra)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    a.wait_hold()
    before = a.events()
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    m = json.loads((snap / "manifest.json").read_text())
    return a, before, snap, m, log


def windows(evs, after):
    return {
        e["rank"]: e
        for e in evs
        if demo.kind(e) == "window" and bool(e.get("after_restore")) == after
    }


def va_fields(w):
    return {k: v for k, v in w.items() if k.endswith("va") or k == "device"}


def check_restored(a, before, rs, m, log, offset):
    """Exactly-once stream, same VAs, every CUDA process moved 0->2, 1->3 (fakecuda's log and
    the restore's per-process GPU records)."""
    assert a.wait_restored_exit(300) in (0, None)
    evs = a.events()
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (
        s["ok"],
        s["lost"],
        s["duplicated"],
        s["torn"],
        s["restores_seen"],
        s["window_checks_failed"],
    ) == (True, 0, 0, 0, 1, 0), s
    pairs = {(p["src"], p["dst"]): p for e in evs if demo.kind(e) == "done" for p in e["pairs"]}
    for p in pairs.values():
        assert (p["count"], p["distinct"], p["gaps"], p["duplicates"], p["torn"]) == (
            STEPS,
            STEPS,
            0,
            0,
            0,
        ), p
    w0, w1 = windows(before, False), windows(evs, True)
    assert sorted(w1) == sorted(w0) == [0, 1]
    assert {r: va_fields(w) for r, w in w1.items()} == {r: va_fields(w) for r, w in w0.items()}
    cuda = sorted(m["cuda_pids"])
    moved = sorted(
        (int(ln.split()[0]), ln.split(" ", 2)[2].split(" (")[0])
        for ln in log.read_text()[offset:].splitlines()
        if "fakecuda: restore moved ordinal" in ln
    )
    assert moved == sorted(
        (pid, f"fakecuda: restore moved ordinal {o} from {uuid(o)} to {uuid(o + 2)}")
        for pid in cuda
        for o in (0, 1)
    )
    assert {int(p): [(g["ordinal"], g["uuid"]) for g in gs] for p, gs in rs["gpus"].items()} == {
        pid: [(0, uuid(2)), (1, uuid(3))] for pid in cuda
    }


def test_manifest_records_the_gpus(afdwin, tmp_path, monkeypatch):
    a, _, snap, m, _ = checkpointed(afdwin, tmp_path, monkeypatch)
    parts = m["participants"]
    assert parts and sorted(p["pid"] for p in parts) == sorted(m["cuda_pids"])
    for p in parts:
        assert p["cuda_visible_devices"] == "0,1"
        assert p["gpus"] == [
            {
                "ordinal": o,
                "uuid": uuid(o),
                "name": "H100 80GB",
                "total_memory": 80 << 30,
                "compute_capability": "9.0",
            }
            for o in (0, 1)
        ]


@pytest.mark.parametrize("backend", ["driver-api", "cuda-checkpoint"])
@pytest.mark.parametrize("how", ["explicit", "automatic"])
@pytest.mark.parametrize("extra", [(), ("--multicast",)], ids=["unicast", "multicast"])
def test_restore_onto_other_gpus(afdwin, tmp_path, monkeypatch, how, extra, backend):
    """gpuPairs through the driver API, or --device-map through fakecuda's cuda-checkpoint."""
    a, before, snap, m, log = checkpointed(afdwin, tmp_path, monkeypatch, extra)
    d0 = digest(snap)
    offset = log.stat().st_size
    args = ["restore", "--images-dir", str(snap), "--driver", "fake", "--native-backend", backend]
    if how == "explicit":
        args += ["--device-map", f"0=2,{uuid(1)}={uuid(3)}"]
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the agent sees only {2,3}
    rc, rs = demo.run_agent(*args)
    assert rc == 0 and rs["ok"], rs
    drv = [p for p in rs["phases"] if p["name"] == "driver"][0]
    assert drv["detail"].endswith(f"; GPUs {uuid(0)}={uuid(2)}, {uuid(1)}={uuid(3)}"), drv
    check_restored(a, before, rs, m, log, offset)
    assert digest(snap) == d0


def test_refused_mapping_leaves_the_snapshot_untouched(afdwin, tmp_path, monkeypatch):
    a, before, snap, m, log = checkpointed(afdwin, tmp_path, monkeypatch)
    d0 = digest(snap)
    rc, rs = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--device-map", "0=2"
    )
    assert rc != 0 and not rs["ok"], rs
    assert rs["error"]["phase"] == "device map"
    assert rs["error"]["message"] == (
        "device map: every checkpointed GPU must be listed; missing: "
        f"{uuid(1)} (H100 80GB, {80 << 30} bytes)"
    )
    assert not demo.pid_alive(a.pid)  # nothing restored
    assert digest(snap) == d0
    offset = log.stat().st_size
    rc, rs = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--device-map", "0=2,1=3"
    )
    assert rc == 0 and rs["ok"], rs
    check_restored(a, before, rs, m, log, offset)

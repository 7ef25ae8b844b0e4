"""``cuinterpose.io/restore-from`` onto a placeholder pod that sees other GPUs (issue 13): afdwin
checkpointed through annotations on fake GPUs {0,1} of a four-GPU node is restored into a
placeholder whose container sees {2,3} (``NVIDIA_VISIBLE_DEVICES``, as the NVIDIA container
runtime sets it); the devices are mapped from what the placeholder sees
(docs/agent.md "Restore onto other GPUs"). Same harness as test_kube_e2e.py.
Uses the installed shim: run under ``flock -s /tmp/cuinterpose-build.lock``."""

from __future__ import annotations

import json
import os
import signal

from fakeapi import make_pod
from proclayout import lay_proc
from test_kube_e2e import CID, PCID, RMSG, RST, ST, watcher_proc  # noqa: F401 (fixture)

from cuinterpose.agent.mech.census import walk_tree
from cuinterpose.workloads.afdwin import demo

NODE4 = "H100 80GB:80G,H100 80GB:80G,H100 80GB:80G,H100 80GB:80G"


def uuid(i: int) -> str:
    h = (b"fakecudaGPU-uu" + bytes([i >> 8, i & 0xFF])).hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def test_restore_from_onto_a_placeholder_with_other_gpus(
    api,
    tmp_path,
    watcher_proc,  # noqa: F811 (the fixture imported above)
    criu_ok,
    subreaper,
    placeholder,
    cgroup_dir,
    monkeypatch,
):
    log = tmp_path / "fakecuda.log"
    monkeypatch.setenv("FAKECUDA_DEVICES", NODE4)
    monkeypatch.setenv("FAKECUDA_LOG", str(log))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    steps, hold = 200, 20
    a = demo.Afdwin(tmp_path / "run", steps=steps, step_delay_ms=5, hold_at=(hold,)).start()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # the watcher sees the whole node
    try:
        a.wait_hold()
        lay_proc(tmp_path / "proc", CID, [p for p, _, _ in walk_tree([a.pid])])
        watcher_proc(a.ctl)
        api.add_pod(
            make_pod(
                "job",
                annotations={"cuinterpose.io/checkpoint": "snap1"},
                containers=[("main", f"containerd://{CID}")],
            )
        )
        assert api.wait_for(
            lambda x: x.annotations("default", "job").get(ST) in ("Succeeded", "Failed"), 300
        )
        snap = tmp_path / "snap" / "default" / "snap1"
        assert api.annotations("default", "job")[ST] == "Succeeded"
        assert a.wait_dumped() == -signal.SIGKILL
        m = json.loads((snap / "manifest.json").read_text())
        assert {g["uuid"] for p in m["participants"] for g in p["gpus"]} == {uuid(0), uuid(1)}

        monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", f"{uuid(2)},{uuid(3)}")
        ph = placeholder("job-restored", cgroup=cgroup_dir(), mount=True, stdout=False)
        monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES")
        lay_proc(tmp_path / "proc", PCID, [ph.pid])
        offset = log.stat().st_size
        api.add_pod(
            make_pod(
                "job-restored",
                annotations={"cuinterpose.io/restore-from": "snap1"},
                containers=[("main", f"containerd://{PCID}")],
            )
        )
        assert api.wait_for(
            lambda x: x.annotations("default", "job-restored").get(RST) in ("Succeeded", "Failed"),
            300,
        )
        r = api.annotations("default", "job-restored")
        assert r[RST] == "Succeeded", r[RMSG]
        assert a.wait_restored_exit(300) in (0, None)
        s = [e for e in a.events() if demo.kind(e) == "summary"][-1]
        assert (s["ok"], s["lost"], s["duplicated"], s["torn"], s["restores_seen"]) == (
            True,
            0,
            0,
            0,
            1,
        )
        moved = sorted(
            (int(ln.split()[0]), ln.split(" ", 2)[2].split(" (")[0])
            for ln in log.read_text()[offset:].splitlines()
            if "fakecuda: restore moved ordinal" in ln
        )
        assert moved == sorted(
            (pid, f"fakecuda: restore moved ordinal {o} from {uuid(o)} to {uuid(o + 2)}")
            for pid in m["cuda_pids"]
            for o in (0, 1)
        )
    finally:
        if demo.pid_alive(a.pid):
            for pid in [p for p, _, _ in walk_tree([a.pid])]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        a.kill()

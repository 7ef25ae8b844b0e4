"""``restore --agent ... --device-map`` (issue 13): the RestoreRequest carries the map to the
daemon, which restores onto the mapped GPUs (bytes exactly once, VAs, the shim's INSPECT
devices, the report's native backend); a bad map is refused by the daemon naming both GPUs,
the snapshot untouched and restorable. Also: a group restore takes a map per member only."""

from __future__ import annotations

import json
import signal

import pytest

from cuinterpose.workloads.afdwin import demo

STEPS = 120
HOLD = 12
# four H100s and an A100: GPU 4 is another model
NODE = "H100 80GB:80G,H100 80GB:80G,H100 80GB:80G,H100 80GB:80G,A100 40GB:40G"


uuid = demo.fake_gpu_uuid
digest = demo.snapshot_digest


def windows(evs, after):
    return {
        e["rank"]: {k: v for k, v in e.items() if k.endswith("va")}
        for e in evs
        if demo.kind(e) == "window" and bool(e.get("after_restore")) == after
    }


def test_daemon_restore_with_a_device_map(afdwin, daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKECUDA_DEVICES", NODE)
    d = daemon("n1", "--driver", "fake")  # sees all five GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD, 2 * HOLD))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    a.wait_hold()
    before = a.events()
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    m = json.loads((snap / "manifest.json").read_text())
    cuda = sorted(m["cuda_pids"])
    d0 = digest(snap)

    # another model: refused by the daemon before anything is restored, naming both GPUs
    rc, bad = demo.run_agent(
        "restore", "--agent", d["listen"], "--images-dir", str(snap), "--device-map", "0=2,1=4"
    )
    assert rc != 0 and not bad["ok"], bad
    assert (bad["error"]["phase"], bad["error"]["outcome"]) == ("device map", "refused")
    assert bad["error"]["reason"] == (
        f"GPU {uuid(1)} (H100 80GB, {80 << 30} bytes) cannot be restored onto {uuid(4)} "
        f"(A100 40GB, {40 << 30} bytes): another model"
    )
    assert not demo.pid_alive(a.pid)
    assert digest(snap) == d0

    rc, rs = demo.run_agent(
        "restore", "--agent", d["listen"], "--images-dir", str(snap), "--device-map", "0=2,1=3"
    )
    assert rc == 0 and rs["ok"], rs
    assert {int(p): [(g["ordinal"], g["uuid"]) for g in gs] for p, gs in rs["gpus"].items()} == {
        pid: [(0, uuid(2)), (1, uuid(3))] for pid in cuda
    }
    assert (rs["native"]["backend"], rs["native"]["snapshot"]["backend"]) == (
        "driver-api",
        "driver-api",
    )
    a.wait_hold(2)
    for pid in cuda:
        rc, ins = demo.run_agent(
            "inspect", "--agent", d["listen"], "--pid", str(pid), "--control-dir", str(a.ctl)
        )
        assert rc == 0 and ins["ok"], ins
        got = {g["ordinal"]: g["uuid"] for g in ins["devices"]}
        assert got and got == {o: uuid(o + 2) for o in got}, got
    a.release_hold()
    assert a.wait_restored_exit(300) in (0, None)
    evs = a.events()
    assert demo.check_run(evs, STEPS) == []
    assert windows(evs, True) == windows(before, False)
    assert digest(snap) == d0


@pytest.mark.parametrize(
    "spec,message",
    [
        (
            {"device_map": "0=2,1=3", "members": [{"node": "n1", "address": "unix:/x"}]},
            "device_map maps one node's GPUs; in a group restore each member names its own "
            "device_map (the GPUs of its node)",
        ),
    ],
)
def test_group_restore_takes_a_map_per_member_only(spec, message):
    from cuinterpose.agent.errors import AgentError
    from cuinterpose.agent.rpc.group import lead
    from cuinterpose.agent.run.report import Reporter
    from cuinterpose.agent.snapshot import pb

    apb, _, _ = pb.modules()
    req = apb.RestoreRequest(
        device_map=spec["device_map"],
        members=[apb.Member(node=m["node"], address=m["address"]) for m in spec["members"]],
    )
    with pytest.raises(AgentError) as e:
        lead("restore", req, Reporter(), lambda row: None, call=lambda *a: None)
    assert (e.value.phase, e.value.reason, e.value.outcome) == ("group", message, "usage")


def test_group_file_member_device_map_reaches_the_member_request(tmp_path):
    """load_members puts each member's "device_map" on its Member; the leader copies it into
    that member's RestoreRequest (the first phase's RunPhaseRequest)."""
    from cuinterpose.agent.cli.common import load_members
    from cuinterpose.agent.rpc.group import lead
    from cuinterpose.agent.run.report import Reporter
    from cuinterpose.agent.snapshot import pb

    f = tmp_path / "group.json"
    f.write_text(
        json.dumps(
            {
                "members": [
                    {"node": "a", "address": "unix:/a", "images_dir": "/s/a", "device_map": "0=2"},
                    {"node": "b", "address": "unix:/b", "images_dir": "/s/b"},
                ]
            }
        )
    )
    members = load_members(str(f), "restore")
    assert [(m.node, m.device_map) for m in members] == [("a", "0=2"), ("b", "")]
    from types import SimpleNamespace

    from cuinterpose.agent.errors import AgentError
    from cuinterpose.agent.run.restore import Restore

    apb, _, _ = pb.modules()
    sent = {}
    refused = SimpleNamespace(
        ok=False,
        error=SimpleNamespace(
            phase="manifest", reason="stop here", has_pid=False, pid=0, outcome="refused", node=""
        ),
    )

    def call(address, method, req, on_progress):
        if method == "RunPhase" and req.phase == Restore.GROUP_PHASES[0]:
            sent[req.node] = req.restore.device_map
        return refused

    with pytest.raises(AgentError):
        lead("restore", apb.RestoreRequest(members=members), Reporter(), lambda r: None, call=call)
    assert sent == {"a": "0=2", "b": ""}


def test_cli_device_map_with_group_is_a_usage_error(tmp_path):
    from click.testing import CliRunner

    from cuinterpose.agent.cli import main

    f = tmp_path / "group.json"
    f.write_text(json.dumps({"members": [{"node": "a", "address": "unix:/a", "images_dir": "/s"}]}))
    res = CliRunner().invoke(main, ["restore", "--group", str(f), "--device-map", "0=1"])
    assert res.exit_code == 2, res.output
    assert (
        "--device-map maps one node's GPUs; in a group restore each member of the --group file "
        'names its own "device_map"'
    ) in " ".join(res.output.split())

"""A group restore into placements: two agents, each owning one afdwin job on fakecuda with real
CRIU, checkpointed as one group, then restored as one group with each member naming its own
placeholder (``Member.into_pid``): every restored rank is in its node's placeholder's
namespaces (net, uts, ipc, mount) and cgroups, and both jobs finish with nothing lost."""

from __future__ import annotations

import json
import signal

from group_kit import STEPS, agents, finished_intact, reap_tree, start_jobs, wait_running
from placement_kit import not_placed

from cuinterpose.agent.rpc import client
from cuinterpose.agent.snapshot import pb


def test_group_restore_puts_each_member_into_its_own_placeholder(
    afdwin, daemon, tmp_path, placeholder, cgroup_dir
):
    apb, _, _ = pb.modules()
    steps = 2 * STEPS
    ja, jb = start_jobs(afdwin, steps=steps)
    A, B = agents(daemon, (ja, jb))
    wait_running((ja, jb))
    snaps = {"node-a": tmp_path / "snap-a", "node-b": tmp_path / "snap-b"}

    def members(**into):
        return [
            apb.Member(
                node=n,
                address=x["listen"],
                roots=[j.pid],
                images_dir=str(snaps[n]),
                into_pid=into.get(n.replace("-", "_"), 0),
            )
            for n, x, j in (("node-a", A, ja), ("node-b", B, jb))
        ]

    res = client.call(A["listen"], "Checkpoint", apb.CheckpointRequest(members=members()))
    assert res.ok, res.error
    assert [j.proc.wait(timeout=300) for j in (ja, jb)] == [-signal.SIGKILL] * 2
    for n in snaps:
        reap_tree(json.loads((snaps[n] / "manifest.json").read_text()))

    pa = placeholder("node-a-ph", cgroup=cgroup_dir(), mount=True, stdout=False)
    pb_ = placeholder("node-b-ph", cgroup=cgroup_dir(), mount=True, stdout=False)
    # the request's own into_pid is for a single-node restore: refused, nothing restored
    res = client.call(
        A["listen"],
        "Restore",
        apb.RestoreRequest(members=members(node_a=pa.pid, node_b=pb_.pid), into_pid=pa.pid),
    )
    assert (res.ok, res.error.phase, res.error.outcome) == (False, "group", "usage")
    assert res.error.reason == (
        "into_pid places a single-node restore; in a group restore "
        "each member names its own into_pid (a pid on its node)"
    )

    rows = []
    res = client.call(
        A["listen"],
        "Restore",
        apb.RestoreRequest(members=members(node_a=pa.pid, node_b=pb_.pid)),
        on_progress=rows.append,
    )
    assert res.ok, res.error
    placed = [r for r in rows if r.get("event") == "end" and r.get("phase") == "placement"]
    assert sorted((r["node"], r["status"]) for r in placed) == [("node-a", "ok"), ("node-b", "ok")]
    assert not_placed(ja.pid, pa.pid) == []
    assert not_placed(jb.pid, pb_.pid) == []
    finished_intact((ja, jb), steps, restored=True)


def test_a_group_file_member_into_pid_must_be_a_pid(tmp_path):
    from click.testing import CliRunner

    from cuinterpose.agent.cli import main

    f = tmp_path / "group.json"
    f.write_text(
        json.dumps(
            {"members": [{"node": "a", "address": "unix:/x", "images_dir": "/s", "into_pid": -1}]}
        )
    )
    r = CliRunner().invoke(main, ["restore", "--group", str(f), "--json"])
    assert r.exit_code == 2
    assert "member 'a': into_pid -1 is not a pid" in r.output

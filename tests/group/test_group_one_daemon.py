"""Issue 23: a group whose two members are the same daemon (two roots, two images dirs) is two
jobs on that daemon, not one whose second ``prepare`` is refused and whose undo then reports a
false ``rollback_failed`` (exit 5) although nothing changed: the cut succeeds, each member's
manifest names its own root, and both jobs, left running, finish exactly."""

from __future__ import annotations

import json

from group_kit import STEPS, release

from cuinterpose.workloads.afdwin import demo


def test_two_members_on_one_daemon_are_two_jobs(afdwin, daemon, tmp_path):
    ja = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(20,))
    # the second job shares the first one's control dir: one daemon serves both
    jb = demo.Afdwin(tmp_path / "runb", steps=STEPS, step_delay_ms=5, hold_at=(20,))
    jb.ctl = ja.ctl
    jb.start()
    try:
        info = daemon("node-a", "--driver", "fake", "--control-dir", str(ja.ctl))
        for j in (ja, jb):
            j.wait_hold()
        spec = tmp_path / "group.json"
        spec.write_text(
            json.dumps(
                {
                    "members": [
                        {
                            "node": node,
                            "address": info["listen"],
                            "roots": [j.pid],
                            "images_dir": str(tmp_path / f"snap-{node}"),
                        }
                        for node, j in (("node-a", ja), ("node-b", jb))
                    ]
                }
            )
        )
        rc, out = demo.run_agent(
            "checkpoint", "--agent", info["listen"], "--group", str(spec), "--leave-running"
        )
        assert (rc, out["ok"]) == (0, True), out
        for node, j in (("node-a", ja), ("node-b", jb)):
            m = json.loads((tmp_path / f"snap-{node}" / "manifest.json").read_text())
            assert (m["roots"], m["group"]["node"]) == ([j.pid], node)
        release((ja, jb))
        for j in (ja, jb):
            j.wait_ok(300)
            evs = j.events()
            assert demo.check_run(evs, STEPS, expect_restore=False) == []
            assert [(e["restored"], e["cancelled"]) for e in evs if demo.kind(e) == "resumed"] == [
                (False, False)
            ]
    finally:
        jb.kill()

"""A read-only ``inspect`` loop (a monitoring probe) racing checkpoints of the same job never
makes a checkpoint roll back (newuser trial: 4 of 6 ``--leave-running`` checkpoints failed at
``criu dump``, "External socket is used", the probe's connection to a control socket being in
the tree). An INSPECT holds the control dir's lock (``quiesce.serial``) while connected, which a
checkpoint's quiesce request takes too, and is refused while a checkpoint or restore of its
job runs (``quiesce.job_busy``). Asserted: every checkpoint exits 0 (or is refused cleanly,
exit 3, never rolled back); every inspect exits 0 or is refused naming the running checkpoint;
the job takes every answer and finishes with every message exactly once."""

from __future__ import annotations

import shutil
import threading

from cuinterpose.workloads.afdwin import demo

ROUNDS = 6
#: one hold per step up to here: each quiesce lets the job issue exactly one more step
HOLDS = ROUNDS + 1
STEPS = HOLDS + 9
#: inspect loops running at once
LOOPS = 2


def test_an_inspect_loop_racing_checkpoints_never_makes_one_roll_back(afdwin, tmp_path):
    a = afdwin(steps=STEPS, step_delay_ms=1, hold_at=tuple(range(1, HOLDS + 1)))
    a.wait_hold()
    a.wait_for(
        lambda evs: len([e for e in evs if demo.kind(e) == "window"]) == 2, 60, "both windows"
    )
    ranks = sorted(e["pid"] for e in a.events() if demo.kind(e) == "window")
    stop = threading.Event()
    inspects: list[tuple[int, dict]] = []

    def probe(rank: int) -> None:
        while not stop.is_set():
            inspects.append(
                demo.run_agent(
                    "inspect", "--pid", str(rank), "--control-dir", str(a.ctl), "--driver", "fake"
                )
            )

    loops = [threading.Thread(target=probe, args=(ranks[i % 2],)) for i in range(LOOPS)]
    for t in loops:
        t.start()
    ids, refused = [], []
    try:
        for i in range(ROUNDS):
            snap = tmp_path / f"s{i}"
            rc, out = a.checkpoint(snap, "--leave-running")
            assert rc in (0, 3), (i, out)  # never 4: rolled back
            if rc == 0:
                ids.append(out["snapshot_id"])
                shutil.rmtree(snap)
            else:
                assert out["error"]["outcome"] == "refused", out
                assert out["error"]["phase"] not in ("criu dump", "capture"), out
                refused.append(out["error"])
                a.release_hold()  # the job never saw this one
    finally:
        stop.set()
        for t in loops:
            t.join(timeout=demo.HANG_S)
    for rc, out in inspects:
        assert rc in (0, 3), out
        if rc == 0:
            assert out["pid"] in ranks and out["phase"] == "ACTIVE", out
        else:
            e = out["error"]
            assert (e["phase"], e["outcome"]) == ("INSPECT", "refused"), out
            assert f"a checkpoint of root {a.pid} is in progress in agent pid " in e["reason"], e
            assert e["reason"].endswith("INSPECT refused while it runs (its connection would "
                                        "be in the tree when CRIU dumps or restores it): retry "
                                        "once it has ended"), e  # fmt: skip
    print(
        f"inspect race: {len(ids)} checkpoints ok, {len(refused)} refused; "
        f"{sum(rc == 0 for rc, _ in inspects)} inspects ok, "
        f"{sum(rc == 3 for rc, _ in inspects)} refused during a checkpoint"
    )
    assert ids, refused
    # after the race: the job is idle, an inspect answers
    rc, out = demo.run_agent(
        "inspect", "--pid", str(ranks[0]), "--control-dir", str(a.ctl), "--driver", "fake"
    )
    assert rc == 0 and out["phase"] == "ACTIVE", out
    resumed = [e["id"] for e in a.events() if demo.kind(e) == "resumed"]
    assert resumed == ids
    a.release_hold()
    a.wait_ok(300)
    s = [e for e in a.events() if demo.kind(e) == "summary"]
    assert [(x["ok"], x["lost"], x["duplicated"], x["torn"]) for x in s] == [(True, 0, 0, 0)]

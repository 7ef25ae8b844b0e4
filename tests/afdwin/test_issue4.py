"""Issue 4 knobs on fakecuda (no shim): fence race, stages, per-rank ring depth, a pending flag
carried across a quiesce, the --no-drain cut, and a 4A4F run."""

import pytest
from test_run_fake import check_done

from cuinterpose.workloads.afdwin.config import Config


def test_no_fence_with_delayed_zero_loses_first_message(afdwin):
    """Without the fence, FFN rank 1 zeroes its window 1 s late and erases the dispatches
    that already landed (steps 1 and 2, one per ring): seq 1 is never received, the attention
    rank's ring never frees and the stall detector reports the loss."""
    steps = 10
    run = afdwin(
        "--steps", steps, "--no-fence", "--delay-zero-ms", "1:1000", "--stall-timeout-s", 2
    )  # > the delay (setup counts)
    assert run.finish() == 1
    assert run.of("start")[0]["no_fence"] is True
    (err,) = run.of("error")
    assert err["stage"] == "stall"
    done = {d["rank"]: d for d in run.of("done")}
    (p,) = done[1]["pairs"]
    assert (p["count"], p["first"], p["lost"]) == (0, None, steps)
    # the late zero saw (and erased) the first dispatch of each ring
    assert done[1]["fence"] == {
        "fenced": False,
        "delay_zero_ms": 1000.0,
        "erased": [{"region": 0, "ring": 0, "value": 1}, {"region": 0, "ring": 1, "value": 2}],
    }
    assert done[1]["errors"][0].startswith("unfenced zero erased flags written by peers")
    s = run.of("summary")[0]
    assert (s["ok"], s["messages"], s["lost"]) == (False, 0, 2 * steps)


def test_fenced_run_with_delayed_zero_loses_nothing(afdwin):
    steps = 10
    run = afdwin("--steps", steps, "--delay-zero-ms", "1:1000")
    assert run.finish() == 0, run.stderr()
    done, s = check_done(run, 2, 1, steps)
    assert done[1]["fence"] == {"fenced": True, "delay_zero_ms": 1000.0, "erased": []}
    assert done[0]["fence"]["delay_zero_ms"] == 0


def test_ring_depth_list_mismatch_fails_at_setup(afdwin):
    run = afdwin("--ranks", 4, "--attention", 2, "--steps", 5, "--ring-depth", "2,2,3,2")
    assert run.finish() == 1
    (err,) = run.of("error")
    assert (err["stage"], err["field"], err["values"]) == ("geometry", "ring_depth", [2, 2, 3, 2])
    assert run.of("window") == []
    assert "rank 2 has ring_depth=3" in run.stderr()


@pytest.mark.parametrize(
    "args,msg",
    [
        (("--ring-depth", 2, "--stages", 3), "ring_depth 2 < stages 3"),
        (("--ring-depth", 3, "--stages", 2), "not a multiple of stages"),
        (("--ring-depth", "2,2,2"), "1 or 2 (one per rank) values"),
        (("--no-drain", "--pending-at-cut"), "exclusive"),
    ],
)
def test_bad_arguments(afdwin, args, msg):
    run = afdwin("--steps", 5, *args)
    assert run.finish() == 2
    assert msg in run.stderr()


def test_stages_own_disjoint_rings(afdwin):
    """2 stages over 4 rings: stage k issues steps s = k + 1 mod 2 into rings r = k mod 2."""
    steps = 24
    run = afdwin("--steps", steps, "--ring-depth", 4, "--stages", 2)
    assert run.finish() == 0, run.stderr()
    assert run.of("start")[0]["stages"] == 2
    assert {w["stages"] for w in run.of("window")} == {2}
    check_done(run, 2, 1, steps)


def quiesce(run, qid):
    req = run.write_control("request", {"id": qid, "timeout_ms": 600000})
    ready = run.wait_file(req.with_suffix(".ready"), ".ready")
    q = run.wait_for(lambda e: e["event"] == "quiesced" and e["id"] == qid, "quiesced")
    return ready, q


def test_pending_reply_flag_crosses_the_cut_exactly_once(afdwin):
    """--pending-at-cut, 2A2F: at each quiesce every attention rank dispatches its next step and
    stops before the combine; the FFN ranks drain it, so each (attention, FFN) pair has a reply
    flag at 1 that nobody has read at the cut. After the resume the combine finds it set,
    reads it, resets it: every seq exactly once, no flag left set."""
    steps = 300
    run = afdwin(
        "--ranks", 4, "--attention", 2, "--steps", steps, "--step-delay-ms", 3, "--pending-at-cut"
    )
    run.wait_for(
        lambda e: e["event"] == "progress" and e["role"] == "attention" and e["sent"] >= 10,
        "10 dispatches",
    )
    ready, q = quiesce(run, "c1")
    unread = [p for r in ready["ranks"] for p in r["pending"]]
    assert q["drained"] is True and q["pending"] == {"reply_unread": 4}
    assert sorted((p["src"], p["dst"]) for p in unread) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    issued = {r["rank"]: r["last_seq"] for r in ready["ranks"] if r["role"] == "attention"}
    for p in unread:
        assert p["kind"] == "reply_unread" and p["seq"] == issued[p["dst"]][str(p["src"])]
        assert p["ring"] == (p["seq"] - 1) % 2
    run.write_control("resume", {"id": "c1", "restored": True, "cancelled": False})
    res = run.wait_for(lambda e: e["event"] == "resumed", "resumed")
    assert all(v["failed"] == 0 for v in res["window_checks"].values()), res
    assert run.finish() == 0, run.stderr()
    done, s = check_done(run, 4, 2, steps)
    for a in (0, 1):
        held = done[a]["cut_pending"]
        assert [
            (h["quiesce"], h["ffn"], h["flag_at_cut"], h["flag_at_resume"], h["consumed"])
            for h in held
        ] == [(1, 2, 1, 1, 1), (1, 3, 1, 1, 1)]
        assert {h["seq"] for h in held} == {issued[a]["2"]}
        assert done[a]["final_flags"] == [0] * 4


def test_no_drain_leaves_replies_owed_then_continues(afdwin):
    """--no-drain: FFN ranks park without draining, then every attention rank parks with a reply
    owed (its stream still waits). Cancelled (as the agent does after a refused or rolled-back
    checkpoint), the run continues and every seq arrives exactly once."""
    steps = 300
    run = afdwin("--steps", steps, "--step-delay-ms", 3, "--no-drain")
    run.wait_for(
        lambda e: e["event"] == "progress" and e["role"] == "attention" and e["sent"] >= 10,
        "10 dispatches",
    )
    ready, q = quiesce(run, "n1")
    assert q["drained"] is False
    pending = [p for r in ready["ranks"] for p in r["pending"]]
    owed = [p for p in pending if p["kind"] == "reply_owed"]
    # a reply is owed for one or both of the attention rank's last D = 2 steps (the one it
    # issued after the FFN parked, or an earlier one the FFN had not consumed before parking)
    issued = next(r for r in ready["ranks"] if r["role"] == "attention")["last_seq"]["1"]
    assert {(p["src"], p["dst"]) for p in owed} == {(1, 0)} and q["pending"]["reply_owed"] >= 1
    assert {p["seq"] for p in owed} <= {issued - 1, issued}
    unconsumed = {p["seq"] for p in pending if p["kind"] == "dispatch_unconsumed"}
    assert unconsumed <= {p["seq"] for p in owed} and len(pending) == len(owed) + len(unconsumed)
    run.write_control("resume", {"id": "n1", "restored": False, "cancelled": True})
    res = run.wait_for(lambda e: e["event"] == "resumed", "resumed")
    run.finish()
    assert all(v["failed"] == 0 for v in res["window_checks"].values()), (
        res,
        [d["window_checks"] for d in run.of("done")],
    )
    check_done(run, 2, 1, steps)


def test_4a4f_eight_ranks(afdwin):
    steps = 12
    run = afdwin("--ranks", 8, "--attention", 4, "--steps", steps)
    assert run.finish() == 0, run.stderr()
    done, s = check_done(run, 8, 4, steps)
    assert s["messages"] == 4 * 4 * steps
    wins = {w["rank"]: w for w in run.of("window")}
    for r, w in wins.items():
        assert w["peer_va"] == [w["base_va"] + w["stride"] * ((p - r) % 8) for p in range(8)]


def test_gpu_profile_by_flag(afdwin):
    """--profile gpu: token_cap 512, hidden 2048, 2-byte (bf16-sized) items, ~4 MiB slots."""
    steps = 3
    run = afdwin("--profile", "gpu", "--steps", steps)
    assert run.finish() == 0, run.stderr()
    assert {(w["slot_bytes"], w["regions"], w["rings"]) for w in run.of("window")} == {
        (4_219_392, 1, 2)
    }
    done, s = check_done(run, 2, 1, steps)
    tot = done[0]["rates"]["total"]
    reply_bytes = 4_219_392 - Config(profile="gpu").window_layout().slot.routed_x_off
    assert tot["payload_bytes"] == steps * (4_219_392 + reply_bytes)
    assert tot["gb_per_s"] > 0 and tot["rtt_us_p99"] >= tot["rtt_us_p50"] > 0

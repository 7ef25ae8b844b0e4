"""afdwin --multicast on fakecuda (no shim): the multicast region is built, written by rank 0
through the multicast VA and read back by every rank from its own member; a quiesce/resume
repeats the check with the next epoch's value; the default path has no multicast at all."""

GRAN = 2 << 20  # fakecuda's default granularity

MC = 0x4D430000


def mc(run):
    return sorted(
        (e["rank"], e["epoch"], e["value"], e["ok"], e["writer"]) for e in run.of("multicast")
    )


def test_multicast_region_written_by_rank0_read_by_all(afdwin):
    run = afdwin("--ranks", 3, "--attention", 1, "--steps", 30, "--multicast")
    assert run.finish() == 0, run.stderr()
    assert mc(run) == [(r, 0, MC, True, 0) for r in range(3)]
    wins = {w["rank"]: w for w in run.of("window")}
    for r, w in wins.items():
        assert w["mc_size"] == GRAN
        # the multicast VA and the member VA are separate reservations, outside the window
        assert len({w["mc_va"], w["mc_member_va"], w["base_va"]}) == 3
        assert not (w["base_va"] <= w["mc_va"] < w["base_va"] + 3 * w["stride"])
        ev = [e for e in run.of("multicast") if e["rank"] == r][0]
        assert (ev["mc_va"], ev["member_va"]) == (w["mc_va"], w["mc_member_va"])
    s = run.of("summary")[0]
    assert (s["ok"], s["messages"], s["lost"], s["torn"], s["window_checks_failed"]) == (
        True,
        60,
        0,
        0,
        0,
    )


def test_multicast_check_repeats_after_resume(afdwin):
    run = afdwin(
        "--ranks", 2, "--attention", 1, "--steps", 150, "--step-delay-ms", 4, "--multicast"
    )
    run.wait_for(
        lambda e: e["event"] == "progress" and e["role"] == "attention" and e["sent"] >= 10,
        "10 dispatches",
    )
    req = run.write_control("request", {"id": "ckpt-1", "timeout_ms": 600000})
    run.wait_file(req.with_suffix(".ready"), ".ready")
    run.write_control("resume", {"id": "ckpt-1", "restored": True, "cancelled": False})
    run.wait_for(lambda e: e["event"] == "resumed", "resumed event")
    assert run.finish() == 0, run.stderr()
    assert mc(run) == [
        (0, 0, MC, True, 0),
        (0, 1, MC | 1, True, 0),
        (1, 0, MC, True, 0),
        (1, 1, MC | 1, True, 0),
    ]
    s = run.of("summary")[0]
    assert (s["ok"], s["window_checks_failed"]) == (True, 0)


def test_default_path_has_no_multicast(afdwin):
    run = afdwin("--ranks", 2, "--attention", 1, "--steps", 10)
    assert run.finish() == 0, run.stderr()
    assert run.of("multicast") == []
    assert all("mc_va" not in w for w in run.of("window"))

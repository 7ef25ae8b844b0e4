"""End-to-end afdwin runs on fakecuda (no shim): protocol evidence, geometry check, quiesce."""

import os

import pytest

GRAN = 2 << 20  # fakecuda's default granularity


def pair_ok(p, steps):
    return (
        p["count"],
        p["distinct"],
        p["first"],
        p["last"],
        p["gaps"],
        p["duplicates"],
        p["torn"],
        p["out_of_order"],
        p["lost"],
    ) == (steps, steps, 1, steps, 0, 0, 0, 0, 0)


def check_windows(run, ranks, attention):
    wins = {w["rank"]: w for w in run.of("window") if not w["after_restore"]}
    assert sorted(wins) == list(range(ranks))
    for r, w in wins.items():
        assert w["role"] == ("attention" if r < attention else "ffn")
        regions = max(attention, ranks - attention)
        assert (w["stride"], w["slot_bytes"], w["total_bytes"], w["regions"]) == (
            GRAN,
            4864,
            256 + regions * 2 * 4864,
            regions,
        )
        assert w["rings"] == 2 and w["handle_type"] == "POSIX_FILE_DESCRIPTOR"
        assert w["device"] == r % 2
        # own window at the base; peer k at base + stride * ((peer - rank) mod N)
        assert w["peer_va"] == [w["base_va"] + GRAN * ((p - r) % ranks) for p in range(ranks)]
    return wins


def check_done(run, ranks, attention, steps):
    done = {d["rank"]: d for d in run.of("done")}
    assert sorted(done) == list(range(ranks))
    ffn = ranks - attention
    for r, d in done.items():
        assert d["ok"] is True and d["errors"] == []
        srcs = range(attention, ranks) if r < attention else range(attention)
        assert [(p["src"], p["dst"]) for p in d["pairs"]] == [(s, r) for s in srcs]
        assert all(pair_ok(p, steps) for p in d["pairs"]), d["pairs"]
        n_peers = ffn if r < attention else attention
        assert (d["sent"], d["received"], d["replied"]) == (steps * n_peers,) * 3
        if r >= attention:
            assert d["shutdown_from"] == list(range(attention))
        assert d["rates"]["total"]["msgs"] == steps * n_peers
    s = run.of("summary")
    assert len(s) == 1
    s = s[0]
    assert (
        s["ok"],
        s["messages"],
        s["replies"],
        s["expected_messages"],
        s["lost"],
        s["duplicated"],
        s["torn"],
        s["out_of_order"],
        s["ranks"],
    ) == (
        True,
        attention * ffn * steps,
        attention * ffn * steps,
        attention * ffn * steps,
        0,
        0,
        0,
        0,
        ranks,
    )
    assert s["exit_codes"] == [0] * ranks
    return done, s


@pytest.mark.parametrize("ranks,attention", [(2, 1), (3, 2)])
def test_run_completes_exactly(afdwin, ranks, attention):
    steps = 60
    run = afdwin(
        "--ranks", ranks, "--attention", attention, "--steps", steps, "--ring-depth", 2, "--seed", 3
    )
    assert run.finish() == 0, run.stderr()
    assert run.bad_lines == []
    start = run.of("start")[0]
    assert start["pid"] == run.proc.pid
    check_windows(run, ranks, attention)
    done, s = check_done(run, ranks, attention, steps)
    assert (s["restores_seen"], s["quiesces"]) == (0, 0)
    # attention ranks measured a round trip for every step
    for r in range(attention):
        assert done[r]["rates"]["pre_checkpoint"]["rtt_us_p50"] is not None


def test_geometry_mismatch_names_ring_depth(afdwin):
    run = afdwin("--steps", 5, "--test-override", "1:ring_depth=3")
    assert run.finish() == 1
    err = run.of("error")
    assert len(err) == 1
    assert (err[0]["stage"], err[0]["field"], err[0]["values"]) == (
        "geometry",
        "ring_depth",
        [2, 3],
    )
    assert "ring_depth" in err[0]["message"]
    stderr = run.stderr()
    assert "rank 1 has ring_depth=3" in stderr and "rank 0 has ring_depth=2" in stderr
    assert run.of("window") == []  # failed before any allocation was shared
    s = run.of("summary")[0]
    assert s["ok"] is False and s["exit_codes"] == [1, 1]


def socket_fds(pid):
    fds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    return fds


@pytest.mark.parametrize("ranks,attention,restored", [(2, 1, False), (3, 2, True)])
def test_quiesce_handshake(afdwin, ranks, attention, restored):
    steps = 150
    run = afdwin(
        "--ranks",
        ranks,
        "--attention",
        attention,
        "--steps",
        steps,
        "--ring-depth",
        2,
        "--step-delay-ms",
        4,
        "--hold-at",
        10,  # the cut lands at step 10, however slow the machine is
    )
    for a in range(attention):
        run.wait_for(lambda e, a=a: e["event"] == "hold" and e["rank"] == a, f"rank {a} hold")
    req = run.write_control("request", {"id": "ckpt-1", "timeout_ms": 600000})
    ready = run.wait_file(req.with_suffix(".ready"), ".ready")
    q = run.wait_for(lambda e: e["event"] == "quiesced", "quiesced event")
    wins = {w["rank"]: w for w in run.of("window")}
    assert ready["id"] == "ckpt-1"
    assert [(r["rank"], r["pid"], r["role"]) for r in ready["ranks"]] == [
        (i, wins[i]["pid"], wins[i]["role"]) for i in range(ranks)
    ]
    assert q["ranks"] == ready["ranks"]
    # every attention rank's last issued seq was received by every FFN rank
    issued = {}
    for r in ready["ranks"]:
        if r["role"] == "attention":
            (issued[r["rank"]],) = set(r["last_seq"].values())  # same seq to every FFN rank
            assert issued[r["rank"]] == 10
    for r in ready["ranks"]:
        if r["role"] == "ffn":
            assert {int(k): v for k, v in r["last_seq"].items()} == issued
    n_quiesced = len(run.events)

    # parked: two progress snapshots per rank, counters frozen at the cut
    def parked_snaps(i):
        return [
            e
            for e in run.events[n_quiesced:]
            if e["event"] == "progress" and e["rank"] == i and e["parked"]
        ]

    for i in range(ranks):
        run.wait_for(lambda e, i=i: len(parked_snaps(i)) >= 2, f"2 parked snapshots rank {i}")
        a, b = parked_snaps(i)[:2]
        assert (a["sent"], a["received"], a["replied"]) == (b["sent"], b["received"], b["replied"])
        assert a["last_seq"] == b["last_seq"]
        assert a["last_seq"] == {str(k): v for k, v in ready["ranks"][i]["last_seq"].items()}
        assert a["sent"] < steps * (ranks - attention if i < attention else attention)
    # the launcher holds only stdio and one socket per rank
    fds = socket_fds(run.proc.pid)
    assert sorted(fds) == [0, 1, 2] + sorted(k for k in fds if k > 2)
    assert [v.startswith("socket:") for k, v in sorted(fds.items()) if k > 2] == [True] * ranks

    run.write_control("resume", {"id": "ckpt-1", "restored": restored, "cancelled": False})
    res = run.wait_for(lambda e: e["event"] == "resumed", "resumed event")
    assert (res["id"], res["restored"], res["cancelled"]) == ("ckpt-1", restored, False)
    # own flags + per (peer, ring): 3 slot/flag checks + one sharing probe per peer
    F = ranks - attention
    want = {
        str(i): {
            "checked": 1 + 3 * 2 * (F if i < attention else attention) + (ranks - 1),
            "failed": 0,
        }
        for i in range(ranks)
    }
    assert res["window_checks"] == want
    assert run.finish() == 0, run.stderr()
    assert sorted(p.name for p in run.ctl.iterdir()) == []
    done, s = check_done(run, ranks, attention, steps)
    assert (s["quiesces"], s["restores_seen"], s["window_checks_failed"]) == (
        1,
        1 if restored else 0,
        0,
    )
    assert s["va_tables_identical"] is True
    after = [w for w in run.of("window") if w["after_restore"]]
    if restored:
        assert sorted(w["rank"] for w in after) == list(range(ranks))
        for w in after:
            before = wins[w["rank"]]
            assert {k: v for k, v in w.items() if k not in ("after_restore", "t")} == {
                k: v for k, v in before.items() if k not in ("after_restore", "t")
            }
    else:
        assert after == []
    for d in done.values():
        assert d["quiesces"] == 1 and d["restores_seen"] == (1 if restored else 0)
        segs = d["rates"]["segments"]
        assert [x["restored"] for x in segs] == [False, restored]
        assert sum(x["msgs"] for x in segs) == d["rates"]["total"]["msgs"]
        assert segs[0]["msgs"] > 0 and segs[1]["msgs"] > 0
        assert (d["rates"]["post_restore"] is not None) == restored


def test_two_quiesces_cancelled_then_restored(afdwin):
    steps = 300
    run = afdwin("--steps", steps, "--step-delay-ms", 3)
    run.wait_for(
        lambda e: e["event"] == "progress" and e["role"] == "attention" and e["sent"] >= 5,
        "5 dispatches",
    )
    req = run.write_control("request", {"id": "q1", "timeout_ms": 600000})
    assert run.wait_file(req.with_suffix(".ready"), ".ready q1")["id"] == "q1"
    run.write_control("resume", {"id": "q1", "restored": False, "cancelled": True})
    r1 = run.wait_for(lambda e: e["event"] == "resumed", "resumed q1")
    assert (r1["id"], r1["restored"], r1["cancelled"]) == ("q1", False, True)
    # a stale answer to another request must not release the next quiesce
    run.write_control("resume", {"id": "stale", "restored": False, "cancelled": True})
    req = run.write_control("request", {"id": "q2", "timeout_ms": 600000})
    ready = run.wait_file(req.with_suffix(".ready"), ".ready q2")
    assert ready["id"] == "q2"
    run.write_control("resume", {"id": "q2", "restored": True, "cancelled": False})
    r2 = run.wait_for(lambda e: e["event"] == "resumed" and e["id"] == "q2", "resumed q2")
    assert (r2["restored"], r2["cancelled"]) == (True, False)
    assert run.finish() == 0, run.stderr()
    done, s = check_done(run, 2, 1, steps)
    assert (s["quiesces"], s["restores_seen"]) == (2, 1)
    assert [q["id"] for q in run.of("quiesced")] == ["q1", "q2"]
    assert sorted(w["rank"] for w in run.of("window") if w["after_restore"]) == [0, 1]
    for d in done.values():
        assert [x["restored"] for x in d["rates"]["segments"]] == [False, False, True]
        assert d["window_checks"] == {"checked": 16, "failed": 0, "failures": []}
    assert list(run.ctl.iterdir()) == []


def test_corrupted_magic_is_rejected_end_to_end(afdwin):
    run = afdwin("--steps", 20, "--test-override", "0:corrupt_step=7")
    assert run.finish() == 1
    done = {d["rank"]: d for d in run.of("done")}
    (f_pair,) = done[1]["pairs"]
    (a_pair,) = done[0]["pairs"]
    for p, kind in ((f_pair, "magic"), (a_pair, "payload")):
        assert (
            p["count"],
            p["distinct"],
            p["first"],
            p["last"],
            p["gaps"],
            p["lost"],
            p["torn"],
            p["torn_kinds"],
        ) == (19, 19, 1, 20, 1, 1, 1, {kind: 1})
    assert "magic mismatch" in done[1]["errors"][0]
    assert done[0]["errors"] == ["reply from rank 1 step 7: reply for seq 7 differs from R(P)"]
    assert done[0]["ok"] is False and done[1]["ok"] is False
    s = run.of("summary")[0]
    assert (s["ok"], s["messages"], s["replies"], s["lost"], s["torn"], s["exit_codes"]) == (
        False,
        19,
        19,
        2,
        2,
        [1, 1],
    )

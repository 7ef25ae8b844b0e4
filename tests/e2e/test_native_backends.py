"""afdwin checkpointed mid-stream and restored with each native backend (issue 13 "Native
backends"): ``--native-backend driver-api`` (cuCheckpointProcess* in the agent) and
``--native-backend cuda-checkpoint`` (fakecuda's cuda-checkpoint utility run per pid). The
utility is reached through a wrapper at ``$CUINTERPOSE_CUDA_CHECKPOINT`` that records each argv
before it execs the real one: the driver-API run must never run it; the CLI run runs exactly
lock, unlock (the quiescence check), lock, checkpoint (each rank, in the manifest's order), then
restore, unlock. Both runs finish with every message exactly once and the same VAs."""

from __future__ import annotations

import json
import signal
import sys

import pytest

from cuinterpose.agent.mech import native_cli
from cuinterpose.workloads.afdwin import demo

STEPS = 120
HOLD = 20


@pytest.fixture
def cli_log(tmp_path, monkeypatch):
    log = tmp_path / "cli-argv.jsonl"
    wrapper = tmp_path / "cuda-checkpoint"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"os.execv({native_cli.fake_cli()!r}, [{native_cli.fake_cli()!r}] + sys.argv[1:])\n"
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv(native_cli.CLI_ENV, str(wrapper))

    def read():
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]

    return read


@pytest.mark.parametrize(
    "backend,restore_with",
    [
        ("driver-api", "driver-api"),
        ("cuda-checkpoint", "cuda-checkpoint"),
        ("driver-api", "cuda-checkpoint"),
    ],
    ids=["api", "cli", "api-then-cli"],
)
def test_afdwin_checkpoint_restore_with_each_backend(
    afdwin, tmp_path, cli_log, backend, restore_with
):
    a = afdwin(steps=STEPS, step_delay_ms=5, hold_at=(HOLD,))
    a.wait_hold()
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap, "--native-backend", backend)
    assert rc == 0 and cp["ok"], cp
    assert a.wait_dumped() == -signal.SIGKILL
    evs = a.events()
    assert demo.cut_seqs(evs) == {(0, 1): HOLD}
    before = {e["rank"]: e for e in evs if demo.kind(e) == "window" and not e.get("after_restore")}
    pids = [before[r]["pid"] for r in sorted(before)]
    m = json.loads((snap / "manifest.json").read_text())
    assert sorted(m["cuda_pids"]) == sorted(pids)
    order = m["cuda_pids"]
    dumped = cli_log()

    rc, rs = demo.run_agent(
        "restore", "--images-dir", str(snap), "--driver", "fake", "--native-backend", restore_with
    )
    assert rc == 0 and rs["ok"], rs
    assert a.wait_restored_exit(300) in (0, None)
    evs = a.events()
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (s["ok"], s["lost"], s["duplicated"], s["torn"], s["restores_seen"]) == (
        True,
        0,
        0,
        0,
        1,
    ), s
    assert s["va_tables_identical"] is True
    after = {e["rank"]: e for e in evs if demo.kind(e) == "window" and e.get("after_restore")}
    keys = ("pid", "base_va", "peer_va", "stride", "total_bytes")
    assert {r: tuple(str(w[k]) for k in keys) for r, w in after.items()} == {
        r: tuple(str(w[k]) for k in keys) for r, w in before.items()
    }
    assert demo.check_run(evs, STEPS, attention=1, ffn=1) == []

    runs = cli_log()
    order_s = [str(p) for p in order]
    if restore_with == "driver-api":
        assert runs == []
        return
    if backend == "driver-api":  # a snapshot of the API backend restores through the CLI
        assert dumped == []
        assert [r for r in runs if r[0] == "--action"] == [
            *(["--action", "restore", "--pid", p] for p in order_s),
            *(["--action", "unlock", "--pid", p] for p in order_s),
        ]
        return
    actions = [r for r in runs if r[0] == "--action"]
    lock = [["--action", "lock", "--pid", str(p), "--timeout", "10000"] for p in order]
    # the quiescence check locks and unlocks every rank, then the checkpoint proper
    assert [r for r in dumped if r[0] == "--action"] == [
        *lock,
        *(["--action", "unlock", "--pid", str(p)] for p in order),
        *lock,
        *(["--action", "checkpoint", "--pid", str(p)] for p in order),
    ]
    assert actions[4 * len(order) :] == [
        *(["--action", "restore", "--pid", str(p)] for p in order),
        *(["--action", "unlock", "--pid", str(p)] for p in order),
    ]
    states = {r[2] for r in runs if r[0] == "--get-state"}
    assert states >= {str(p) for p in order}
    # nothing else was run: only --get-state and --action lines
    assert [r for r in runs if r[0] not in ("--action", "--get-state")] == []


def test_a_cli_lock_timeout_refuses_the_checkpoint_and_the_workload_finishes(
    afdwin, tmp_path, cli_log
):
    """--no-drain: a stream still waits on an owed reply, so the quiescence check's lock times
    out in the utility; the refusal names the command and the driver's answer with its hint,
    nothing was torn down and the workload finishes with every message exactly once."""
    a = afdwin(steps=150, step_delay_ms=4, extra_args=("--no-drain",), hold_at=(20,))
    a.wait_hold()
    snap = tmp_path / "snap"
    rc, cp = a.checkpoint(snap, "--native-backend", "cuda-checkpoint", "--lock-timeout-ms", "300")
    assert rc == 3 and not cp["ok"], cp
    err = cp["error"]
    assert [p["name"] for p in cp["phases"]] == ["driver", "census", "quiesce", "quiescence check"]
    assert (err["phase"], err["outcome"]) == ("quiescence check", "refused")
    assert err["reason"] == (
        "cuda-checkpoint --action lock: CUDA_ERROR_NOT_READY (work was still in flight when the "
        "lock timed out: the workload is not quiescent)"
    )
    assert ["--action", "lock", "--pid", str(err["pid"]), "--timeout", "300"] in cli_log()
    assert not (snap / "manifest.json").exists()
    a.wait_ok(300)
    evs = a.events()
    s = [e for e in evs if demo.kind(e) == "summary"][-1]
    assert (s["ok"], s["lost"], s["duplicated"], s["torn"], s["restores_seen"]) == (
        True,
        0,
        0,
        0,
        0,
    ), s
    resumed = [e for e in evs if demo.kind(e) == "resumed"]
    assert [(e["restored"], e["cancelled"]) for e in resumed] == [(False, True)]

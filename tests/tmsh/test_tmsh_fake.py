"""tmsh on fakecuda without a checkpoint (docs/tmsh.md): the run's evidence, the variants, the
event limit, and, without the shim, fakecuda's native checkpoint refusing what
torch.multiprocessing leaves live (IPC imports, the exporter's buffers open elsewhere, IPC
events), with the processes back to running and the run finishing exact."""

from __future__ import annotations

import subprocess

import pytest
from tmsh_kit import check_finished

from cuinterpose.agent import paths
from cuinterpose.coordinator import contract
from cuinterpose.workloads.afdwin import demo


def test_runs_exact_past_the_event_limit(tmsh):
    """Four processes, 60 storages through 32: storages reused once their counter reads 0; past
    4 live events the producer synchronizes its stream instead of sending one (PyTorch's
    CUDA_IPC_MAXIMUM_EVENTS_TO_USE fallback)."""
    run = tmsh(procs=4, steps=60, max_events=4)
    assert run.wait_exit() == 0, run.stderr_tail()
    s = check_finished(run, restores=0)
    p = s["producer"]
    assert (p["storages"], p["reuses"], p["max_live_events"]) == (32, 28, 4)
    assert p["synced_instead_of_event"] > 0
    assert (
        sum(c["events_opened"] for c in s["consumers"].values())
        == 60 - p["synced_instead_of_event"]
    )


def _quiesce_by_hand(run) -> dict:
    req = contract.quiesce_path(run.ctl, run.pid, "request")
    contract.write_atomic(req, {"id": "q1", "timeout_ms": 60000})
    run.wait_for(lambda ev: any(e.get("event") == "quiesced" for e in ev), "quiesced")
    return run.of("quiesced")[0]


def _cli(action: str, pid: int) -> subprocess.CompletedProcess:
    cli = paths.fakecuda_dir() / "bin" / "cuda-checkpoint"
    return subprocess.run(
        [str(cli), "--action", action, "--pid", str(pid)], capture_output=True, text=True
    )


@pytest.mark.parametrize("variant", ["ipc", "event"])
def test_native_checkpoint_without_the_shim_is_refused(tmsh, tmp_path, variant):
    log = tmp_path / "fake.log"
    run = tmsh(
        procs=2,
        variant=variant,
        steps=24,
        hold_at=8,
        consumer_hold_at=3,
        shim=False,
        env={"FAKECUDA_LOG": str(log)},
    )
    run.wait_hold()
    q = _quiesce_by_hand(run)
    roles = run.roles()
    assert (q["sent"], q["received"]) == (8, 3)
    refusals = {}
    for role, pid in roles.items():
        assert _cli("lock", pid).returncode == 0
        r = _cli("checkpoint", pid)
        # NVIDIA's line, and the CUresult as the exit status (801 & 0xff; docs/fakecuda.md)
        assert (r.returncode, r.stderr.strip()) == (
            801 & 0xFF,
            f'Could not checkpoint on process ID {pid}: "operation not supported"',
        )
        assert _cli("unlock", pid).returncode == 0
        (line,) = [
            x
            for x in log.read_text().splitlines()
            if x.startswith(f"{pid} ") and "checkpoint refused" in x
        ]
        refusals[role] = line.split("checkpoint refused: ", 1)[1]
    prod, cons = roles["producer"], roles["consumer0"]
    # the consumer holds the producer's first segment open (storages 2 and 3 are in it);
    # the producer's segments are open in the consumer
    assert refusals["consumer0"].startswith(f"pid {cons} holds 1 live CUDA IPC import(s) (0x")
    assert f"buffer of pid {prod}, 1 reference(s))" in refusals["consumer0"]
    assert refusals["producer"].startswith(
        f"1 cuMemAlloc buffer(s) of pid {prod} are open in other processes"
    )
    contract.write_atomic(
        contract.quiesce_path(run.ctl, run.pid, "resume"),
        {"id": "q1", "restored": False, "cancelled": True},
    )
    assert run.wait_exit() == 0, run.stderr_tail()
    s = check_finished(run, restores=0)
    assert [(r["restored"], r["cancelled"]) for r in run.of("resumed")] == [(False, True)]
    assert [(x["restored"], x["cancelled"], x["vas_identical"]) for x in s["quiesces"]] == [
        (False, True, True)
    ]


def test_a_hang_report_carries_the_stack_of_the_launcher_and_every_rank(tmsh):
    """SIGUSR2 (what the harness sends before it calls a run hung) makes the launcher and each
    multiprocessing rank write their stacks, each to its own file; the resource tracker is not
    signalled, and every process lives on."""
    run = tmsh(procs=3, steps=20, hold_at=6, consumer_hold_at=2)
    run.wait_hold()
    got = run.dump_stacks()
    roles = run.roles()
    assert sorted(got) == sorted([run.pid, *roles.values()])
    wait = {
        run.pid: "workloads/mpcontract.py",
        **{p: f"workloads/tmsh/{r.rstrip('0123456789')}.py" for r, p in roles.items()},
    }
    for pid, where in wait.items():
        text = run.stacks_of(pid, f'{where}", line')
        assert text.count("Current thread 0x") == 1, text
    assert all(demo.pid_alive(p) for p in got)


def test_a_rank_killed_stops_the_others_and_the_summary_names_it(tmsh):
    """A rank that dies (SIGKILL) while the others hold: the launcher stops the rest at once
    (they would wait for it until their peer timeout, or hold forever) and the summary names it;
    the run ends 1."""
    import os
    import signal

    run = tmsh(procs=3, steps=20, hold_at=6, consumer_hold_at=2)
    run.wait_hold()
    roles = run.roles()
    os.kill(roles["consumer1"], signal.SIGKILL)
    assert run.finish() == 1
    (s,) = run.of("summary")
    pid = roles["consumer1"]
    assert (
        f"consumer1 pid {pid} exited {-signal.SIGKILL}: the other ranks are stopped"
        in s["problems"]
    ), s
    assert s["rank_exit"]["consumer1"] == -signal.SIGKILL
    assert all(not demo.pid_alive(p) for p in roles.values())

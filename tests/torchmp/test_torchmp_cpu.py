"""The torchmp jobs on a CPU build of PyTorch (the rehearsal of tests/gpu/test_gpu_torch.py,
docs/torchmp.md): the same flows, with ``--device cpu``, under the shim on fakecuda, with the
agent and real CRIU. torch.multiprocessing shares CPU tensors through shared memory instead of
CUDA IPC, so this proves the harness, the contract of the ranks, the checks of the summary and
the report rows, not the CUDA paths. Skipped, with the reason printed, where torch and
transformers cannot be imported (``CUI_TORCH_SITE``)."""

from __future__ import annotations

from torchmp_kit import (
    TorchMp,
    collective_cut,
    decode_cut,
    native_alone,
    report,
    stream_cut,
    torch_env,
)


def test_stream_cut_mid_way_on_cpu(tmp_path, criu_ok, subreaper):
    row = stream_cut(tmp_path, device="cpu", driver="fake", shim=True, env=torch_env("cpu"))
    assert row["quiesces"] == 1
    report("cpu-stream", row)


def test_decode_cut_at_token_100_equals_a_straight_run_on_cpu(tmp_path, criu_ok, subreaper):
    row = decode_cut(tmp_path, device="cpu", driver="fake", shim=True, env=torch_env("cpu"))
    assert row["distinct_tokens"] > 100 and row["snapshot_bytes"] > 0
    report("cpu-decode", row)


def test_native_checkpoint_alone_of_each_rank_is_tried_and_the_run_finishes_on_cpu(
    tmp_path, subreaper
):
    """The experiment of tests/gpu/test_gpu_torch.py rehearsed: no shim, each rank locked,
    checkpointed, restored and unlocked in place by fakecuda's native checkpoint (CPU tensors:
    nothing is refused), then resumed: every step ok and the run exact."""
    got = native_alone(tmp_path, device="cpu", driver="fake", env=torch_env("cpu"))
    steps = ("lock", "checkpoint", "restore", "unlock")
    assert got["steps"] == {r: dict.fromkeys(steps, "ok") for r in ("producer", "consumer0")}, got
    assert got["finished_exact"] and got["problems"] == [], got
    report("cpu-native-alone", got)


def test_one_rank_of_torch_distributed_all_reduces_exact_on_cpu(tmp_path):
    """The collective job straight, with gloo: 40 all-reduces, every result exact. (Its cut is
    an experiment on the GPU only: torch.distributed keeps TCP sockets, gloo's listener or
    NCCL's bootstrap, which the agent's CRIU dump does not take, docs/criu.md; on this VM's
    kernel CRIU cannot dump even a listening TCP socket: SO_PASSCRED is not supported on it.)"""
    run = TorchMp(tmp_path / "coll", job="collective", device="cpu", shim=False, driver="fake",
                  env=torch_env("cpu"), steps=40, elems=1 << 14)  # fmt: skip
    try:
        run.start()
        assert run.finish() == 0, run.stderr_tail()
        s = run.summary()
        assert (s["steps"], s["wrong"], s["rank_exit"]) == (40, 0, {"rank0": 0})
    finally:
        run.kill()


def test_one_rank_of_torch_distributed_cut_with_its_group_made_anew_on_cpu(
    tmp_path, criu_ok, subreaper
):
    """The workload contract's way for a process group: destroyed before the park (its TCP
    sockets closed), made anew after the resume. Cut after 12 of 40 all-reduces with gloo,
    killed, restored: all exact, two groups, one restore."""
    row = collective_cut(
        tmp_path, device="cpu", driver="fake", shim=True, env=torch_env("cpu"), reinit=True
    )
    assert row == {
        "ok": True, "stage": "done", "error": "", "steps": 40, "wrong": 0, "groups": 2, "restores_seen": 1,
    }  # fmt: skip
    report("cpu-collective-reinit", row)

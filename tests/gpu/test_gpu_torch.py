"""Real PyTorch under the shim on a real GPU (issue 29; docs/torchmp.md): the torchmp jobs with
``--device cuda`` on the machine's own torch (the lent machine's image: PyTorch with CUDA), each
cut by the agent with native checkpoint and CRIU, killed, restored and finished exact:

- ``stream``: tensors through a torch.multiprocessing queue (IPC memory and IPC events), with
  the default caching allocator and with ``expandable_segments:True`` (cuMem + pidfd_getfd);
- ``decode``: a seeded Llama decoding 300 tokens, cut after token 100: the tokens equal a
  straight run's; the cold-start-versus-restore row is reported;
- experiments (recorded, not asserted): native checkpoint alone (no shim) of each rank of a
  parked stream; one rank of torch.distributed on NCCL cut by the agent, its process group
  kept (its bootstrap's TCP connections: the census refuses them) or destroyed before the park
  and made anew after (does NCCL come back under the shim?).

Rows go to ``$CUI_TORCHMP_REPORT_DIR`` (scripts/gpu_check.py's ``real-stacks`` reads them).
Without a usable GPU, torch with CUDA, CRIU or the checkpoint API, each test is skipped and the
reason printed. The same flows run on the CPU in tests/torchmp. Not yet run on hardware."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "torchmp"))  # torchmp_kit
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: gpu
from torchmp_kit import (  # noqa: E402
    collective_cut,
    decode_cut,
    native_alone,
    report,
    stream_cut,
    torch_env,
)

from gpu.conftest import _probe  # noqa: E402

EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.fixture(scope="module")
def gpu_torch():
    ok, why, info = _probe()
    if not ok:
        print(f"tests/gpu torch tests skipped: {why}")
        pytest.skip(why)
    return info, torch_env("cuda")


def _needs_checkpoint(info: dict) -> None:
    if info.get("checkpoint_api") != 0:
        why = f"the driver ({info.get('driver_version')}) has no usable cuCheckpointProcess*"
        print(f"tests/gpu torch tests skipped: {why}")
        pytest.skip(why)


# the decode first: its row (cold start against restore) is the one the report is judged by
def test_real_gpu_torch_decode_cut_equals_a_straight_run(gpu_torch, criu_ok, subreaper, tmp_path):
    info, env = gpu_torch
    _needs_checkpoint(info)
    row = decode_cut(tmp_path, device="cuda", driver="real", shim=True, env=env)
    assert row["distinct_tokens"] > 100 and row["snapshot_bytes"] > 0
    report("gpu-decode", row)


@pytest.mark.parametrize("alloc", ["caching", "expandable"])
def test_real_gpu_torch_stream_cut(gpu_torch, criu_ok, subreaper, tmp_path, alloc):
    info, env = gpu_torch
    _needs_checkpoint(info)
    env = {**env, **(EXPANDABLE if alloc == "expandable" else {})}
    row = stream_cut(tmp_path, device="cuda", driver="real", shim=True, env=env)
    report(f"gpu-stream-{alloc}", row)


def test_real_gpu_native_checkpoint_alone_experiment(gpu_torch, subreaper, tmp_path):
    info, env = gpu_torch
    _needs_checkpoint(info)
    got = native_alone(tmp_path, device="cuda", driver="real", env=env)
    assert set(got["steps"]) == {"producer", "consumer0"} and all(
        "lock" in s for s in got["steps"].values()
    ), got
    report("gpu-native-alone", got)


@pytest.mark.parametrize("group", ["kept", "reinit"])
def test_real_gpu_nccl_one_rank_cut_experiment(gpu_torch, criu_ok, subreaper, tmp_path, group):
    info, env = gpu_torch
    _needs_checkpoint(info)
    row = collective_cut(
        tmp_path, device="cuda", driver="real", shim=True, env=env, reinit=group == "reinit"
    )
    assert row["stage"] in ("start", "checkpoint", "restore", "finish", "done"), row
    report(f"gpu-nccl-one-rank-{group}", row)

"""Restore onto other GPUs (``CUcheckpointRestoreArgs.gpuPairs``, cuda.h 13.0): the driver API,
cuCheckpointProcessRestore: "GPU UUID pairs can be specified in args to remap the process old GPUs
onto new GPUs. The GPU to restore onto needs to have enough memory and be of the same chip type
as the old GPU. If an array of GPU UUID pairs is specified, it must contain every checkpointed
GPU"; cuda.core ``checkpoint.Process.restore``: "For migration workflows, provide mappings for
every GPU visible to the kernel-mode driver. User-space masking such as CUDA_VISIBLE_DEVICES does
not reduce this mapping requirement"; cuda-python's ``test_checkpoint.py`` rotation and swap
scenarios (after NVIDIA/cuda-checkpoint ``r580-migration-api.c``). They need two GPUs of one
chip type (one name) and skip otherwise, as cuda-python's do."""

from __future__ import annotations

import pytest

CHECKPOINTED = "CUDA_SUCCESS/2"


@pytest.fixture
def gpus(ctl):
    """[(UUID, name)] of the node, unmasked; skips without two GPUs of one name."""
    init, devs = ctl("init", "devices")
    assert init == "CUDA_SUCCESS"
    names = [name for _, name in devs]
    if len(devs) < 2 or len(set(names)) == len(names):
        pytest.skip(f"migration needs two GPUs of the same chip type; the node has {devs}")
    return [tuple(d) for d in devs]


def checkpointed(target, ctl, dev=0, **env):
    t = target(dev, **env)
    assert ctl(f"lock:{t.pid}:10000", f"checkpoint:{t.pid}") == ["CUDA_SUCCESS", "CUDA_SUCCESS"]
    return t


def pairs(mapping: dict) -> str:
    return ",".join(f"{o}={n}" for o, n in mapping.items())


def test_rotation_moves_the_context_and_keeps_the_memory(gpus, target, ctl):
    """cuda.core ``rotation_migrates_context``: every GPU onto the next, as many times as there
    are GPUs; the target's context follows (``Device().uuid``) and comes home; the memory is
    intact after each step."""
    same = [g for g in gpus if g[1] == gpus[0][1]]
    if len(same) != len(gpus):
        pytest.skip("a rotation needs every GPU of the node of one chip type")
    uuids = [u for u, _ in gpus]
    rotation = {uuids[i]: uuids[(i + 1) % len(uuids)] for i in range(len(uuids))}
    t = target(0)
    home = t.cmd("uuid")[0]
    assert home == uuids[0]
    for step in range(len(uuids)):
        p = t.pid
        got = ctl(
            f"lock:{p}:10000",
            f"checkpoint:{p}",
            "init",
            f"restore:{p}:{pairs(rotation)}",
            f"unlock:{p}",
        )
        assert got == ["CUDA_SUCCESS"] * 5
        assert t.cmd("uuid") == [uuids[(step + 1) % len(uuids)]]
        assert t.cmd("check") == ["1"]
    assert t.cmd("uuid") == [home]


def test_swap_with_the_controller_masked(gpus, target, ctl):
    """cuda.core ``swap_identical_gpus``: two GPUs of one chip swap, the others map onto
    themselves. The controller runs with CUDA_VISIBLE_DEVICES naming only the first GPU: masking
    "does not reduce this mapping requirement", and does not refuse the full map either."""
    u0, u1 = gpus[0][0], next(u for u, n in gpus[1:] if n == gpus[0][1])
    mapping = {u: u for u, _ in gpus} | {u0: u1, u1: u0}
    t = checkpointed(target, ctl)
    masked = {"CUDA_VISIBLE_DEVICES": "0"}
    assert (
        ctl("init", f"restore:{t.pid}:{pairs(mapping)}", f"unlock:{t.pid}", env=masked)
        == ["CUDA_SUCCESS"] * 3
    )
    assert t.cmd("uuid") == [u1]
    assert t.cmd("check") == ["1"]


def test_a_map_missing_a_gpu_is_refused(gpus, target, ctl):
    """ "it must contain every checkpointed GPU" / "provide mappings for every GPU visible to the
    kernel-mode driver": a map of the target's own GPU only (the rest of the node left out) is
    refused with CUDA_ERROR_INVALID_VALUE and the process stays CHECKPOINTED (cuda-python's
    _checkpoint_restore reads INVALID_VALUE as a refused migration); a full map then works."""
    u0, u1 = gpus[0][0], next(u for u, n in gpus[1:] if n == gpus[0][1])
    t = checkpointed(target, ctl)
    assert ctl("init", f"restore:{t.pid}:{u0}={u1}", f"state:{t.pid}") == [
        "CUDA_SUCCESS",
        "CUDA_ERROR_INVALID_VALUE",
        CHECKPOINTED,
    ]
    identity = {u: u for u, _ in gpus}
    assert (
        ctl("init", f"restore:{t.pid}:{pairs(identity)}", f"unlock:{t.pid}") == ["CUDA_SUCCESS"] * 3
    )
    assert t.cmd("uuid") == [u0]
    assert t.cmd("check") == ["1"]


def test_a_target_masked_to_one_gpu_still_maps_the_node(gpus, target, ctl):
    """The target itself sees one GPU (CUDA_VISIBLE_DEVICES=1): the map still names every GPU of
    the node, and the target's only ordinal moves with it."""
    u0, u1 = gpus[0][0], next(u for u, n in gpus[1:] if n == gpus[0][1])
    k = [u for u, _ in gpus].index(u1)
    t = target(0, CUDA_VISIBLE_DEVICES=str(k))
    assert t.cmd("uuid") == [u1]
    assert ctl(f"lock:{t.pid}:10000", f"checkpoint:{t.pid}") == ["CUDA_SUCCESS", "CUDA_SUCCESS"]
    assert ctl("init", f"restore:{t.pid}:{u1}={u0}", f"state:{t.pid}") == [
        "CUDA_SUCCESS",
        "CUDA_ERROR_INVALID_VALUE",
        CHECKPOINTED,
    ]
    mapping = {u: u for u, _ in gpus} | {u0: u1, u1: u0}
    assert (
        ctl("init", f"restore:{t.pid}:{pairs(mapping)}", f"unlock:{t.pid}") == ["CUDA_SUCCESS"] * 3
    )
    assert t.cmd("uuid") == [u0]
    assert t.cmd("check") == ["1"]

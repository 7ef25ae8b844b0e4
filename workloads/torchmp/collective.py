"""The ``collective`` job: one rank (world size 1) initializes ``torch.distributed`` (NCCL on a
GPU, gloo on the CPU; rendezvous through a ``FileStore`` in the working directory, no port)
and all-reduces one tensor per step, checking each result exactly. Step ``s`` reduces the
stream job's payload of ``s``; with one rank the sum is the payload itself.

The process group holds TCP connections (NCCL's bootstrap, gloo's listener and pairs), which
the agent does not dump (docs/criu.md). ``--reinit`` follows the workload contract's way out:
the rank destroys its process group before it parks and makes a new one (a new store file)
after it resumes; without it the group is kept across the park (what does a cut do then?)."""

from __future__ import annotations

import os

from .rank import Rank
from .stream import payload


def run(cfg: dict, store_path: str, conn) -> None:
    Rank(cfg, "rank0", conn).main(lambda rank: _run(rank, cfg, store_path))


def _run(rank: Rank, cfg: dict, store_path: str) -> dict:
    import torch.distributed as dist

    torch = rank.torch
    cuda = rank.dev.type == "cuda"
    groups = []

    def init() -> None:
        path = f"{store_path}-{len(groups)}"  # a FileStore file serves one group
        groups.append(path)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=dist.FileStore(path, 1),
            rank=0,
            world_size=1,
            **({"device_id": rank.dev} if cuda else {}),
        )

    def down() -> None:
        dist.destroy_process_group()
        for path in groups:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    init()
    if cfg["reinit"]:
        rank.before_park, rank.after_resume = down, init
    wrong, step = [], 0
    while step < cfg["steps"]:
        if not rank.ready(step, cfg["hold_at"]):
            continue
        step += 1
        t = payload(torch, step, cfg["elems"], rank.dev)
        dist.all_reduce(t)
        if not torch.equal(t, payload(torch, step, cfg["elems"], rank.dev)):
            wrong.append(step)
        rank.sent = step
        rank.progressed()
    rank.synchronize()
    down()
    return {"steps": step, "wrong_steps": wrong[:8], "wrong": len(wrong), "groups": len(groups)}

"""A torchmp rank: the rank side of the workload contract (workloads/mpcontract.py) on PyTorch.
``start`` selects ``cfg["device"]`` ("cuda": GPU 0 and its current stream; "cpu": no device
work; with ``cfg["cuinit"]`` the rank calls ``cuInit`` of ``libcuda.so.1`` all the same, so
that the shim binds its control socket and the agent can checkpoint a CPU rehearsal);
``synchronize`` is ``torch.cuda.synchronize()`` before a rank parks, so no kernel or copy
of this process runs while the agent checkpoints it."""

from __future__ import annotations

from ..mpcontract import Rank as ContractRank


class Rank(ContractRank):
    def start(self) -> None:
        import torch

        self.torch = torch
        self.dev = torch.device("cuda", 0) if self.cfg["device"] == "cuda" else torch.device("cpu")
        if self.dev.type == "cuda":
            torch.cuda.set_device(self.dev)
            # the context and the allocator's first segment now, before anything is received:
            # PyTorch picks the expandable segments' handle type at a process's first
            # allocation (pytorch/pytorch#179220: a consumer that rebuilds first fails)
            torch.zeros(1, device=self.dev)
        elif self.cfg["cuinit"]:  # a CPU rehearsal under the shim: a participant all the same
            import ctypes

            rc = ctypes.CDLL("libcuda.so.1").cuInit(0)
            if rc:
                raise RuntimeError(f"cuInit returned CUresult {rc}")
        torch.use_deterministic_algorithms(True, warn_only=True)

    def synchronize(self) -> None:
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize(self.dev)

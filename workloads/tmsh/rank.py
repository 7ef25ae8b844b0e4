"""A tmsh rank: the rank side of the workload contract (workloads/mpcontract.py: ``serve()``
between two storages, ``hold()`` at a fixed point, JSON events on stdout) on cuda-python's
driver API: the primary context of ``cfg["device"]`` and one stream, and ``cuCtxSynchronize``
before it parks (no work left on any stream). See docs/tmsh.md "The cut".
"""

from __future__ import annotations

from cuda.bindings import driver as cu

from ..afdwin.cudrv import call
from ..mpcontract import Rank as ContractRank


class Rank(ContractRank):
    def start(self) -> None:
        call(cu.cuInit, 0)
        self.device = self.cfg["device"]
        ctx = call(cu.cuDevicePrimaryCtxRetain, call(cu.cuDeviceGet, self.device))
        call(cu.cuCtxSetCurrent, ctx)
        self.stream = call(cu.cuStreamCreate, 0)

    def synchronize(self) -> None:
        call(cu.cuCtxSynchronize)

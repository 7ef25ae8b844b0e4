"""cuMemMap at a non-zero offset: refused as R580 refuses it (NOT_SUPPORTED, aligned or not,
docs/gpu-validation.md), accepted when aligned with FAKECUDA_MAP_OFFSETS=1 (a later driver)."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = r"""
import json
from cuda.bindings import driver as d
d.cuInit(0)
ctx = d.cuDevicePrimaryCtxRetain(d.cuDeviceGet(0)[1])[1]
d.cuCtxSetCurrent(ctx)
p = d.CUmemAllocationProp()
p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
p.location.id = 0
g = d.cuMemGetAllocationGranularity(p, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)[1]
h = d.cuMemCreate(2 * g, p, 0)[1]
va = int(d.cuMemAddressReserve(2 * g, 0, 0, 0)[1])
out = [d.cuMemMap(va, g, 4096, h, 0)[0].name, d.cuMemMap(va, g, g, h, 0)[0].name,
       d.cuMemMap(va + g, g, 0, h, 0)[0].name]
print(json.dumps(out))
"""


def run(fake_env, **extra) -> list:
    res = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env=dict(fake_env, **extra),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_offsets_are_refused_as_on_r580(fake_env):
    fake_env.pop("FAKECUDA_MAP_OFFSETS", None)
    assert run(fake_env) == ["CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_NOT_SUPPORTED", "CUDA_SUCCESS"]


def test_aligned_offsets_map_when_allowed(fake_env):
    assert run(fake_env, FAKECUDA_MAP_OFFSETS="1") == [
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_SUCCESS",
        "CUDA_SUCCESS",
    ]

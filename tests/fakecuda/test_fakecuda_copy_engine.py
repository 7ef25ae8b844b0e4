"""fakecuda's copy engine writes a VMM allocation through its memfd (decisions D71; copy.c
copy_by_memfd), as a DMA engine writes device memory, not through the process's page tables:
- a host-to-device copy into a fresh allocation lands its bytes without mapping a page into
  the process (its RssShmem does not grow); a device-to-host read brings them back and maps
  them (it grows by the allocation);
- a copy at an offset inside a mapping, into a mapping of an allocation at a non-zero offset
  (FAKECUDA_MAP_OFFSETS=1) and across two mappings land where the VA says: read back through
  another mapping of the same allocation."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = r"""
import json
from cuda.bindings import driver as d

def ok(res):
    err = res[0] if isinstance(res, tuple) else res
    assert err == d.CUresult.CUDA_SUCCESS, err
    return res[1] if isinstance(res, tuple) and len(res) > 1 else None

def shmem():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssShmem:"))

ok(d.cuInit(0))
ctx = ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0))))
ok(d.cuCtxSetCurrent(ctx))
p = d.CUmemAllocationProp()
p.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
p.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
p.location.id = 0
g = ok(d.cuMemGetAllocationGranularity(p, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
acc = d.CUmemAccessDesc()
acc.location = p.location
acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

def mapped(h, size, offset=0):
    va = int(ok(d.cuMemAddressReserve(size, 0, 0, 0)))
    ok(d.cuMemMap(va, size, offset, h, 0))
    ok(d.cuMemSetAccess(va, size, [acc], 1))
    return va

def pattern(n, seed):
    return bytes((i * 131 + seed) & 0xFF for i in range(256)) * (n // 256)

def read(va, n):
    buf = bytearray(n)
    ok(d.cuMemcpyDtoH(buf, va, n))
    return bytes(buf)

out = {"g": g}
h = ok(d.cuMemCreate(2 * g, p, 0))
va = mapped(h, 2 * g)
before = shmem()
data = pattern(2 * g, 1)
ok(d.cuMemcpyHtoD(va, data, 2 * g))
out["grown_by_write"] = shmem() - before
out["read_back"] = read(va, 2 * g) == data
out["grown_by_read"] = shmem() - before
# a copy at an offset inside the mapping
part = pattern(g // 2, 2)
ok(d.cuMemcpyHtoD(va + g // 4, part, g // 2))
out["offset_copy"] = read(va, 2 * g) == data[: g // 4] + part + data[g // 4 + g // 2 :]
# into a mapping of the second half of an allocation (offset g), read through a whole mapping
h2 = ok(d.cuMemCreate(2 * g, p, 0))
whole = mapped(h2, 2 * g)
ok(d.cuMemcpyHtoD(whole, bytes(2 * g), 2 * g))
half = mapped(h2, g, g)
ok(d.cuMemcpyHtoD(half, pattern(g, 3), g))
out["mapping_offset"] = read(whole, 2 * g) == bytes(g) + pattern(g, 3)
# across two mappings of two allocations, side by side
pair = int(ok(d.cuMemAddressReserve(2 * g, 0, 0, 0)))
hs = [ok(d.cuMemCreate(g, p, 0)) for _ in range(2)]
for k, hk in enumerate(hs):
    ok(d.cuMemMap(pair + k * g, g, 0, hk, 0))
ok(d.cuMemSetAccess(pair, 2 * g, [acc], 1))
ok(d.cuMemcpyHtoD(pair, pattern(2 * g, 4), 2 * g))
out["across"] = read(pair, 2 * g) == pattern(2 * g, 4)
print(json.dumps(out))
"""


def run(fake_env, **extra) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env=dict(fake_env, **extra),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_host_to_device_copy_writes_the_memfd_not_the_process_pages(fake_env):
    out = run(fake_env, FAKECUDA_MAP_OFFSETS="1")
    g = out["g"]
    # the write maps nothing into the process (a page or two of other shmem at most)
    assert out["grown_by_write"] < g // 8, out
    # the read maps the two granules it reads
    assert out["grown_by_read"] >= 2 * g - g // 8, out
    assert (out["read_back"], out["offset_copy"], out["mapping_offset"], out["across"]) == (
        True,
        True,
        True,
        True,
    )

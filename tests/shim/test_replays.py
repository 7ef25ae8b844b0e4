"""Lookup replays (issue 10; docs/shim.md "Lookup replays"): one small C program per stack
(tests/shim/replays/) makes that stack's exact sequence of driver lookups under the shim on
fakecuda and calls through what it got. Each resolved pointer must be the shim's export of the
ELF name of the ABI the driver answered (dladdr names libcuinterpose.so and the symbol, and the
pointer equals dlsym(RTLD_DEFAULT, that name)); fakecuda's lookup log shows which resolver the
shim forwarded to and with which version, and its call log that the calls arrived with the
right ABI (a v1 bind called through a _v2 wrapper would land on another device and offset)."""

from __future__ import annotations

import hashlib
import subprocess

import pytest

from cuinterpose.coordinator.protocol.ipc import IpcHandle

from .conftest import C_DIR, GRAN, HERE, TAG, link_fakecuda

SHIM = "libcuinterpose.so"
REPLAYS = HERE / "replays"
MIB2 = str(2 << 20)


@pytest.fixture(scope="module")
def replay(build_c, fakecuda_dir):
    cudart = build_c(
        [C_DIR / "fake_cudart.c"],
        "libcudart.so.13",
        extra=("-shared", "-fPIC", "-Wl,-soname,libcudart.so.13"),
    )
    # the shared headers are not hashed by build_c: fold them into a flag
    hdrs = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(REPLAYS.glob("*.h"))))
    extra = (f"-DREPLAY_HEADERS={hdrs.hexdigest()[:16]}",)
    rt = (f"-L{cudart.parent}", "-l:libcudart.so.13", f"-Wl,-rpath,{cudart.parent}")
    libs = {
        "nvshmem": ("-ldl",),
        "nccl": (*rt, *link_fakecuda(fakecuda_dir)),
        "pytorch": link_fakecuda(fakecuda_dir),
        "cudart_ipc": link_fakecuda(fakecuda_dir),
    }
    bins = {
        name: build_c([REPLAYS / f"{name}.c"], f"replay_{name}", extra=extra, libs=lib)
        for name, lib in libs.items()
    }

    def run(name, env):
        env = dict(env)
        env["LD_LIBRARY_PATH"] = f"{env['LD_LIBRARY_PATH']}:{cudart.parent}"
        res = subprocess.run(
            [str(bins[name])], env=env, capture_output=True, text=True, timeout=120
        )
        fns, calls, handles = {}, [], {}
        for ln in res.stdout.splitlines():
            t = ln.split()
            if t[0] in ("pid", "ptr", "range", "ipc"):
                handles[t[0]] = t[1:]
            elif t[0] == "fn":
                fns[t[1]] = (t[2], t[3], int(t[4]))
            elif t[0] == "call":
                calls.append((t[1], int(t[2])))
            elif t[0] == "handle":
                handles[t[1]] = int(t[2], 16)
        return res, fns, calls, handles

    return run


def wrapped(fns, names, elf=None):
    """Names whose pointer is not the shim's export of its ELF name."""
    elf = elf or {}
    return {n: fns.get(n) for n in names if fns.get(n) != (SHIM, elf.get(n, n), 1)}


NVSHMEM = [
    "cuInit",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemRetainAllocationHandle",
    "cuMemGetAllocationPropertiesFromHandle",
    "cuMulticastCreate",
    "cuMulticastAddDevice",
    "cuMulticastBindMem",
    "cuMulticastUnbind",
]
MC = [
    "cuInit",
    "cuMemCreate",
    "cuMemRelease",
    "cuMulticastCreate",
    "cuMulticastAddDevice",
    "cuMulticastBindMem",
    "cuMulticastUnbind",
]
MC_CALLS = [
    ("cuInit", 0),
    ("cuMulticastCreate", 0),
    ("cuMulticastAddDevice", 0),
    ("cuMemCreate", 0),
    ("cuMulticastBindMem", 0),
    ("cuMulticastUnbind", 0),
    ("cuMemRelease", 0),
    ("cuMemRelease", 0),
]


def test_nvshmem_dlsym_resolver_old_abi(replay, shim_env, fake_log):
    res, fns, calls, handles = replay("nvshmem", shim_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert fns["cuGetProcAddress"] == (SHIM, "cuGetProcAddress", 1)
    assert wrapped(fns, NVSHMEM) == {}
    # the shim answered with the driver's 4-argument resolver, at the version asked for
    looks = {(r, s, v) for r, s, v, _f, _e in fake_log.lookups()}
    assert {("cuGetProcAddress", n, 12040) for n in NVSHMEM} <= looks
    assert not [x for x in fake_log.lookups() if x[0] == "cuGetProcAddress_v2"]
    assert calls == [
        ("cuInit", 0),
        ("cuMemCreate", 0),
        ("cuMulticastCreate", 0),
        ("cuMemRelease", 0),
        ("cuMemRelease", 0),
    ]
    assert handles["cuMemCreate"] >> 48 == TAG and handles["cuMulticastCreate"] >> 48 == TAG
    assert [(a["size"], a["types"], r) for _f, a, r in fake_log.calls(fn="cuMemCreate")] == [
        (MIB2, "1", "CUDA_SUCCESS")
    ]
    assert [(a["numDevices"], r) for _f, a, r in fake_log.calls(fn="cuMulticastCreate")] == [
        ("1", "CUDA_SUCCESS")
    ]


def test_nvshmem_without_shim_gets_the_driver(replay, fake_env):
    res, fns, _calls, handles = replay("nvshmem", fake_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert fns["cuMemCreate"][:2] == ("libcuda.so.1", "cuMemCreate")
    assert handles["cuMemCreate"] >> 48 != TAG


def check_v1_bind(fake_log, version, resolver_versions):
    looks = {(r, s, v) for r, s, v, _f, _e in fake_log.lookups()}
    assert resolver_versions <= looks, sorted(looks)
    binds = fake_log.calls(fn="cuMulticastBindMem")
    assert [(f, a["dev"], a["mcOffset"], a["memOffset"], a["size"], r) for f, a, r in binds] == [
        ("cuMulticastBindMem", "-1", "0", "0", MIB2, "CUDA_SUCCESS")
    ]
    assert fake_log.calls(fn="cuMulticastBindMem_v2") == []
    unbinds = fake_log.calls(fn="cuMulticastUnbind")
    assert [(a["dev"], a["size"], r) for _f, a, r in unbinds] == [("0", MIB2, "CUDA_SUCCESS")]


def test_nccl_runtime_entry_points_at_12010(replay, shim_env, fake_log):
    res, fns, calls, handles = replay("nccl", shim_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert fns["cudaGetDriverEntryPointByVersion"] == (SHIM, "cudaGetDriverEntryPointByVersion", 1)
    assert wrapped(fns, MC) == {}
    # the runtime's own resolver, asked for by name, is the shim's 5-argument one ...
    assert fns["cuGetProcAddress"] == (SHIM, "cuGetProcAddress_v2", 1)
    # ... and hands out the v1 bind at 12010
    assert fns["cuMulticastBindMem@gpa"] == (SHIM, "cuMulticastBindMem", 1)
    want = {("cuGetProcAddress_v2", n, 12010) for n in MC[3:]}
    want |= {("cuGetProcAddress_v2", "cuMemCreate", 11030)}
    check_v1_bind(fake_log, 12010, want)
    assert calls == MC_CALLS
    assert handles["cuMulticastCreate"] >> 48 == TAG and handles["cuMemCreate"] >> 48 == TAG


def test_pytorch_rtld_default_entry_point_at_12030(replay, shim_env, fake_log):
    res, fns, calls, handles = replay("pytorch", shim_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert fns["cudaGetDriverEntryPointByVersion"] == (SHIM, "cudaGetDriverEntryPointByVersion", 1)
    assert wrapped(fns, MC) == {}
    check_v1_bind(fake_log, 12030, {("cuGetProcAddress_v2", n, 12030) for n in MC})
    assert calls == MC_CALLS
    assert handles["cuMulticastCreate"] >> 48 == TAG and handles["cuMemCreate"] >> 48 == TAG


IPC = {
    "cuInit": "cuInit",
    "cuMemAlloc": "cuMemAlloc_v2",
    "cuMemFree": "cuMemFree_v2",
    "cuMemGetAddressRange": "cuMemGetAddressRange_v2",
    "cuIpcGetMemHandle": "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle": "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle": "cuIpcCloseMemHandle",
}


def test_cudart_ipc_through_cuGetProcAddress_v2(replay, shim_env, fake_log):
    """libcudart's way to cudaMalloc/cudaFree/cudaIpc*: the driver answers each base name with
    its newest ABI at 13010, and the shim hands out its wrapper of exactly that ELF name; the
    IPC adapter backs the allocation (the driver sees cuMemCreate with a POSIX handle type, no
    cuMemAlloc_v2) and cuIpcGetMemHandle returns the shim's virtual handle for it."""
    res, fns, calls, out = replay("cudart_ipc", shim_env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert fns["cuGetProcAddress_v2"] == (SHIM, "cuGetProcAddress_v2", 1)
    assert wrapped(fns, list(IPC), IPC) == {}
    looks = {(r, s, v) for r, s, v, _f, _e in fake_log.lookups()}
    assert {("cuGetProcAddress_v2", n, 13010) for n in IPC} <= looks
    assert calls == [
        ("cuInit", 0),
        ("cuMemAlloc", 0),
        ("cuMemGetAddressRange", 0),
        ("cuIpcGetMemHandle", 0),
        ("cuMemFree", 0),
    ]
    pid, ptr = int(out["pid"][0]), int(out["ptr"][0], 16)
    assert [int(x, 16) for x in out["range"]] == [ptr, 1 << 20]
    h = IpcHandle.unpack(bytes.fromhex(out["ipc"][0]))
    assert (h.creator_pid, h.size, h.mapped, h.offset) == (pid, 1 << 20, GRAN, 0)
    assert fake_log.calls(fn="cuMemAlloc_v2") == []
    creates = fake_log.calls(fn="cuMemCreate")
    assert [(a["size"], a["types"], r) for _f, a, r in creates] == [
        (str(GRAN), "1", "CUDA_SUCCESS")
    ]
    assert [a["ptr"] for _f, a, _r in fake_log.calls(fn="cuMemUnmap")] == [hex(ptr)]

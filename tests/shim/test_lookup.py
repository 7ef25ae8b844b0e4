"""Every lookup path hands out the shim's wrapper (docs/shim.md section 1): the returned
pointers lie in libcuinterpose.so, cuMemCreate returns a virtual handle (tag 0xC01E) and the
driver saw the real call (fake log). Untracked functions resolve straight into libcuda."""

from __future__ import annotations

import subprocess

import pytest

from .conftest import C_DIR, TAG, link_fakecuda

SHIM = "libcuinterpose.so"
PATHS = [
    "elf",
    "dlsym",
    "dlsym_default",
    "rtld_next",
    "gpa",
    "gpa2",
    "cudart",
    "cudart_ver",
    "cudart_default",
]


@pytest.fixture(scope="module")
def lookup_bins(build_c, fakecuda_dir):
    linked = build_c(
        [C_DIR / "lookup.c"],
        "shim_lookup_linked",
        extra=("-DLINKED",),
        libs=link_fakecuda(fakecuda_dir),
    )
    plain = build_c([C_DIR / "lookup.c"], "shim_lookup")
    cudart = build_c(
        [C_DIR / "fake_cudart.c"],
        "libcudart.so.13",
        extra=("-shared", "-fPIC", "-Wl,-soname,libcudart.so.13"),
    )
    return linked, plain, cudart.parent


def run_lookup(bins, env, path):
    linked, plain, cudart_dir = bins
    env = dict(env)
    env["LD_LIBRARY_PATH"] = f"{env['LD_LIBRARY_PATH']}:{cudart_dir}"
    exe = linked if path == "elf" else plain
    res = subprocess.run([str(exe), path], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    fns = {}
    handle = None
    release = None
    for ln in res.stdout.splitlines():
        t = ln.split()
        if t[0] in ("fn", "mcfn"):
            fns[t[1]] = (t[2], t[3])
        elif t[0] == "handle":
            handle = int(t[1], 16)
        elif t[0] == "release":
            release = int(t[1])
    return fns, handle, release


@pytest.mark.parametrize("path", PATHS)
def test_lookup_path_returns_wrapper(lookup_bins, shim_env, fake_log, path):
    fns, handle, release = run_lookup(lookup_bins, shim_env, path)
    assert fns["cuInit"] == (SHIM, "cuInit")
    assert fns["cuMemCreate"] == (SHIM, "cuMemCreate")
    assert fns["cuMemRelease"] == (SHIM, "cuMemRelease")
    # not tracked: the driver's own function, nothing in between
    assert fns["cuMemGetAllocationGranularity"] == ("libcuda.so.1", "cuMemGetAllocationGranularity")
    assert handle >> 48 == TAG and handle & 0xFFFFFFFFFFFF == 1
    assert release == 0
    creates = fake_log.calls(fn="cuMemCreate")
    assert [(a["size"], a["handle"], r) for _, a, r in creates] == [
        ("2097152", "0", "CUDA_SUCCESS")
    ]
    # the multicast hooks, the 13.1 device-explicit binds by their full names included
    for name in (
        "cuMulticastCreate",
        "cuMulticastAddDevice",
        "cuMulticastBindMem",
        "cuMulticastBindAddr",
        "cuMulticastBindMem_v2",
        "cuMulticastBindAddr_v2",
        "cuMulticastUnbind",
    ):
        assert fns[name] == (SHIM, name), (path, name)
    assert [(a["handle"], r) for _, a, r in fake_log.calls(fn="cuMemRelease")] == [
        ("0", "CUDA_SUCCESS")
    ]


def test_cuGetProcAddress_self_lookup_matches_arity(lookup_bins, shim_env, fake_log):
    """Both resolvers return the shim's resolver of the ABI the driver returned for the
    requested version: 11030 -> 4-argument cuGetProcAddress, 12000 -> cuGetProcAddress_v2."""
    for path, entry in (("gpa", "cuGetProcAddress"), ("gpa2", "cuGetProcAddress_v2")):
        fns, _, _ = run_lookup(lookup_bins, shim_env, path)
        assert fns[entry] == (SHIM, entry)
        assert fns["cuGetProcAddress@11030"] == (SHIM, "cuGetProcAddress")
        assert fns["cuGetProcAddress@12000"] == (SHIM, "cuGetProcAddress_v2")
    # the real resolvers answered first, with the versions asked for
    looks = [(res, sym, ver, elf) for res, sym, ver, _, elf in fake_log.lookups()]
    assert ("cuGetProcAddress", "cuGetProcAddress", 11030, "cuGetProcAddress") in looks
    assert ("cuGetProcAddress", "cuMemCreate", 10020, "cuMemCreate") in looks
    assert ("cuGetProcAddress_v2", "cuGetProcAddress", 12000, "cuGetProcAddress_v2") in looks
    assert ("cuGetProcAddress_v2", "cuMemCreate", 12000, "cuMemCreate") in looks


def test_runtime_path_goes_through_driver_resolver(lookup_bins, shim_env, fake_log):
    fns, _, _ = run_lookup(lookup_bins, shim_env, "cudart_ver")
    assert fns["cudaGetDriverEntryPointByVersion"] == (SHIM, "cudaGetDriverEntryPointByVersion")
    looks = [(res, sym, ver) for res, sym, ver, _, _ in fake_log.lookups()]
    assert ("cuGetProcAddress_v2", "cuMemCreate", 12000) in looks


def test_without_shim_nothing_is_wrapped(lookup_bins, fake_env):
    fns, handle, release = run_lookup(lookup_bins, fake_env, "dlsym")
    assert fns["cuMemCreate"] == ("libcuda.so.1", "cuMemCreate")
    assert fns["cuMulticastBindMem_v2"] == ("libcuda.so.1", "cuMulticastBindMem_v2")
    assert handle == 0 and release == 0

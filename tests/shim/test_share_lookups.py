"""Every lookup path reaches the shim's wrappers of the functions it hooks for what real stacks
share besides memory (docs/shim.md section 1 and sections 10-12): events with their per-thread
twins, peer access, pool IPC, cuMemHostRegister in both ABIs. ``c/share_lookup.c`` asks each
name by ELF name (dlsym on the libcuda handle and RTLD_DEFAULT), by base name and version
through both resolvers and the runtime's cudaGetDriverEntryPointByVersion (the fixture
libcudart.so.13), with the per-thread-default-stream flag for the _ptsz rows; without the shim
the same program gets libcuda's own functions."""

from __future__ import annotations

import subprocess

import pytest

from .conftest import C_DIR

WANT = {
    "cuEventCreate@2000": "cuEventCreate",
    "cuEventRecord@2000": "cuEventRecord",
    "cuEventRecord@2000+pt": "cuEventRecord_ptsz",
    "cuEventRecordWithFlags@11010": "cuEventRecordWithFlags",
    "cuEventRecordWithFlags@11010+pt": "cuEventRecordWithFlags_ptsz",
    "cuEventQuery@2000": "cuEventQuery",
    "cuEventSynchronize@2000": "cuEventSynchronize",
    "cuEventDestroy@2000": "cuEventDestroy",
    "cuEventDestroy@4000": "cuEventDestroy_v2",
    "cuStreamWaitEvent@3020": "cuStreamWaitEvent",
    "cuStreamWaitEvent@3020+pt": "cuStreamWaitEvent_ptsz",
    "cuIpcGetEventHandle@4010": "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle@4010": "cuIpcOpenEventHandle",
    "cuCtxEnablePeerAccess@4000": "cuCtxEnablePeerAccess",
    "cuCtxDisablePeerAccess@4000": "cuCtxDisablePeerAccess",
    "cuMemPoolExportToShareableHandle@11020": "cuMemPoolExportToShareableHandle",
    "cuMemPoolImportFromShareableHandle@11020": "cuMemPoolImportFromShareableHandle",
    "cuMemPoolExportPointer@11020": "cuMemPoolExportPointer",
    "cuMemPoolImportPointer@11020": "cuMemPoolImportPointer",
    "cuMemHostRegister@4000": "cuMemHostRegister",
    "cuMemHostRegister@6050": "cuMemHostRegister_v2",
    "cuMemHostUnregister@4000": "cuMemHostUnregister",
}


@pytest.fixture(scope="module")
def lookup_bins(build_c):
    exe = build_c([C_DIR / "share_lookup.c"], "shim_share_lookup")
    cudart = build_c(
        [C_DIR / "fake_cudart.c"],
        "libcudart.so.13",
        extra=("-shared", "-fPIC", "-Wl,-soname,libcudart.so.13"),
    )
    return exe, cudart.parent


def lookup(bins, env, path) -> dict:
    exe, cudart_dir = bins
    env = dict(env, LD_LIBRARY_PATH=f"{env['LD_LIBRARY_PATH']}:{cudart_dir}")
    res = subprocess.run([str(exe), path], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return {t[1]: (t[2], t[3]) for t in (ln.split() for ln in res.stdout.splitlines())}


@pytest.mark.parametrize("path", ["dlsym", "dlsym_default", "gpa", "gpa2", "cudart_ver"])
def test_lookups_reach_the_wrappers(lookup_bins, shim_env, path):
    assert lookup(lookup_bins, shim_env, path) == {
        k: ("libcuinterpose.so", v) for k, v in WANT.items()
    }


def test_lookups_without_the_shim_are_the_drivers(lookup_bins, fake_env):
    assert lookup(lookup_bins, fake_env, "gpa2") == {
        k: ("libcuda.so.1", v) for k, v in WANT.items()
    }

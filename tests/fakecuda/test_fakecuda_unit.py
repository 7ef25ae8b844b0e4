"""Single-process strictness checks (tests/fakecuda/c/fc_unit.c), against the installed
libcuda.so.1 and again compiled together with fakecuda's sources under ASan/UBSan."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
from fakecuda_helpers import read_log

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
FAKECUDA_SRC = sorted((REPO / "fakecuda" / "src").glob("*.c"))


def run_unit(exe, env, gran, ndev, mode=None):
    env = dict(env, FAKECUDA_GRANULARITY=str(gran), FAKECUDA_DEVICE_COUNT=str(ndev))
    args = [str(exe), str(gran), str(ndev)]
    if mode == "mcknobs":  # a short multicast watchdog, capacity rounded up to 8 granules
        env.update(
            FAKECUDA_MULTICAST_WATCHDOG_MS="100", FAKECUDA_MULTICAST_CAPACITY_ROUNDING=str(8 * gran)
        )
        args.append(mode)
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    tail = res.stdout.strip().splitlines()[-1:] or [""]
    assert res.returncode == 0 and "0 failures" in tail[0], res.stdout + res.stderr
    return res


@pytest.fixture(scope="module")
def unit_exe(build_c, fakecuda_dir):
    return build_c(
        [HERE / "c" / "fc_unit.c"],
        "fc_unit",
        libs=(f"-L{fakecuda_dir}", "-l:libcuda.so.1", "-ldl", "-lpthread"),
    )


@pytest.mark.parametrize("gran,ndev", [(2 << 20, 2), (64 << 10, 3)])
def test_unit(unit_exe, fake_env, gran, ndev):
    res = run_unit(unit_exe, fake_env, gran, ndev)
    log = read_log(fake_env)
    # the stale/double release is loud, on stderr and in the call log
    assert "cuMemRelease(0): stale (already released) handle" in res.stderr
    assert any(l.endswith("cuMemRelease(handle=0) = CUDA_ERROR_INVALID_VALUE") for l in log)
    assert "cuMemRelease(424242): unknown handle" in res.stderr
    # the checkpoint refusal names the fd and the allocation
    assert any("checkpoint refused: exported fd" in l for l in log)
    # pre-init calls are logged with NOT_INITIALIZED
    assert any(l.split(" ", 2)[2] == "cuDeviceGetCount() = CUDA_ERROR_NOT_INITIALIZED" for l in log)
    # multicast refusals are loud and say why
    assert "checkpoint refused: the process holds 2 multicast object(s)" in res.stderr
    assert (
        "through multicast VA" in res.stderr
        and "refused -> CUDA_ERROR_ILLEGAL_ADDRESS" in res.stderr
    )
    assert "no binding of this process matches exactly -> CUDA_ERROR_INVALID_VALUE" in res.stderr
    # the bind really blocked until another thread added the last device
    assert sum("cuMulticastBindMem blocks until every device was added" in l for l in log) == 1


@pytest.mark.parametrize("gran", [2 << 20, 64 << 10])
def test_unit_multicast_knobs(unit_exe, fake_env, gran):
    """FAKECUDA_MULTICAST_WATCHDOG_MS fails a bind/map of an incomplete team with
    CUDA_ERROR_TIMEOUT and a diagnostic; FAKECUDA_MULTICAST_CAPACITY_ROUNDING enlarges the
    bindable and mappable capacity."""
    res = run_unit(unit_exe, fake_env, gran, 2, mode="mcknobs")
    for what in ("cuMulticastBindMem", "cuMemMap"):
        assert (
            f"multicast watchdog: {what} waited 100 ms, but only 1 of 2 devices were added"
            in res.stderr
        ), res.stderr
    log = read_log(fake_env)
    assert any(f"capacity {8 * gran} for a requested {gran}" in l for l in log)


def test_unit_sanitized(build_c, fake_env):
    exe = build_c([*FAKECUDA_SRC, HERE / "c" / "fc_unit.c"], "fc_unit-static", sanitize=True)
    env = dict(
        fake_env,
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    env.pop("LD_LIBRARY_PATH")  # fakecuda is compiled in
    run_unit(exe, env, 2 << 20, 2)
    run_unit(exe, env, 64 << 10, 3, mode="mcknobs")


def test_call_log_format(unit_exe, fake_env):
    run_unit(unit_exe, fake_env, 2 << 20, 2)
    log = read_log(fake_env)
    assert all(l.split()[0].isdigit() and l.split()[1].isdigit() for l in log)
    pids = {l.split()[0] for l in log}
    assert len(pids) == 2  # fc_unit and its forked child
    lines = [l.split(" ", 2)[2] for l in log]
    assert "cuInit(flags=0) = CUDA_SUCCESS" in lines
    assert "lookup cuGetProcAddress_v2 cuMemGetAddressRange 3000 0 -> cuMemGetAddressRange" in lines
    assert (
        "lookup cuGetProcAddress_v2 cuMemGetAddressRange 3020 0 -> cuMemGetAddressRange_v2" in lines
    )
    assert (
        "lookup cuGetProcAddress_v2 cuStreamWaitValue32 12000 2 -> cuStreamWaitValue32_v2_ptsz"
        in lines
    )
    assert "lookup cuGetProcAddress_v2 cuNoSuchFunction 12000 0 -> NULL" in lines
    assert 'lookup cuGetProcAddress_v2 "" 0 0 -> NULL' in lines
    assert "lookup cuGetProcAddress cuMemMap 11030 0 -> cuMemMap" in lines
    assert any(
        l.startswith("cuMemMap(ptr=0x") and l.endswith("handle=0 flags=0) = CUDA_SUCCESS")
        for l in lines
    )
    assert any(
        l.startswith("cuMemcpyHtoD_v2(") and l.endswith("= CUDA_ERROR_ILLEGAL_ADDRESS")
        for l in lines
    )

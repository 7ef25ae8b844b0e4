"""LOAD_ALLOCATIONS's pipeline under the ASan/UBSan and the TSan builds of the shim and fakecuda
(tests/shim/sanitize_build.py, the same builds as test_sanitize.py): a refused LOAD (a bad chunk
in the last allocation, a chunk-store ref into another allocation's file), then the LOAD that
works (test_load_pipeline._pipeline_scenario), in vmm_app; /proc/PID/maps shows the instrumented
libraries are the ones running, and the process exits 0 with no report."""

from __future__ import annotations

import os
import shutil

import pytest

from .conftest import App
from .sanitize_build import SAN, TSAN, build_libs, runtime
from .test_load_pipeline import _pipeline_scenario


def _run_sanitized(vmm_app, env, ctl, chunk_files, prefix=()):
    c = App(vmm_app, env, prefix)
    try:
        try:
            _pipeline_scenario(c, ctl, chunk_files)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{c.stderr()[-6000:]}") from None
        with open(f"/proc/{c.pid}/maps") as f:  # the instrumented builds are the ones running
            maps = f.read()
        for lib in env["LD_PRELOAD"].split() + [
            os.path.join(env["LD_LIBRARY_PATH"], "libcuda.so.1")
        ]:
            assert os.path.realpath(lib) in maps, lib
        c.ok("quit")
        rc = c.proc.wait(timeout=120)
        return rc, c.stderr()
    finally:
        c.close()


def test_pipeline_under_asan_ubsan(vmm_app, fake_env, cuda_include, ctl, chunk_files):
    shim, fake_dir = build_libs(SAN, "shim-asan", cuda_include)
    env = dict(
        fake_env,
        LD_LIBRARY_PATH=str(fake_dir),
        LD_PRELOAD=f"{runtime('libasan.so')} {shim}",
        FAKECUDA_MAP_OFFSETS="1",
        ASAN_OPTIONS="abort_on_error=0:halt_on_error=1:detect_leaks=1:exitcode=23",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    rc, err = _run_sanitized(vmm_app, env, ctl, chunk_files)
    assert "AddressSanitizer" not in err and "runtime error" not in err, err[-6000:]
    assert rc == 0, err[-6000:]


def test_pipeline_under_tsan(vmm_app, fake_env, cuda_include, ctl, chunk_files):
    libtsan = runtime("libtsan.so")
    if not shutil.which("setarch"):
        pytest.skip("no setarch")
    shim, fake_dir = build_libs(TSAN, "shim-tsan", cuda_include)
    env = dict(
        fake_env,
        LD_LIBRARY_PATH=str(fake_dir),
        LD_PRELOAD=f"{libtsan} {shim}",
        FAKECUDA_MAP_OFFSETS="1",
        TSAN_OPTIONS="halt_on_error=1:exitcode=23",
    )
    rc, err = _run_sanitized(vmm_app, env, ctl, chunk_files, prefix=("setarch", "-R"))
    if "ThreadSanitizer" in err and "unexpected memory mapping" in err:
        pytest.skip("TSan cannot start with this kernel's memory layout")
    assert "WARNING: ThreadSanitizer" not in err, err[-6000:]
    assert rc == 0, err[-6000:]

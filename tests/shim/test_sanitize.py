"""The C drivers under ASan/UBSan, shim, fakecuda and the driver programs all instrumented; the
sanitized processes never exec anything (a sanitizer runtime does not survive an exec of
an uninstrumented helper):
- c/cycle_driver.c: the two-process cycle, plus the edge paths of the object model (spanning
  and partial ranges, retain inside a mapping, release while mapped, double release);
- c/stress.c: application threads creating/mapping/exporting while FETCH_FD and INSPECT are
  served (also run unsanitized, and under TSan where the kernel lets TSan start: it needs
  `setarch -R`, and is skipped when TSan refuses the memory layout)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from .conftest import C_DIR, link_fakecuda
from .sanitize_build import SAN, TSAN, build_libs, runtime


def libasan() -> str:
    return runtime("libasan.so")


@pytest.fixture(scope="module")
def asan_build(build_c, cuda_include):
    shim, fake_dir = build_libs(SAN, "shim-asan", cuda_include)
    drv = build_c(
        [C_DIR / "cycle_driver.c"],
        "shim_cycle_driver",
        sanitize=True,
        libs=link_fakecuda(fake_dir),
    )
    stress = build_c(
        [C_DIR / "stress.c"], "shim_stress", sanitize=True, libs=link_fakecuda(fake_dir)
    )
    return shim, fake_dir, drv, stress


def test_cycle_plain(build_c, shim_env, fakecuda_dir):
    drv = build_c([C_DIR / "cycle_driver.c"], "shim_cycle_driver", libs=link_fakecuda(fakecuda_dir))
    res = subprocess.run([str(drv)], env=shim_env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == "cycle ok\n"


def sanitized_env(asan_build, fake_env):
    shim, fake_dir = asan_build[0], asan_build[1]
    env = dict(fake_env)
    env["LD_LIBRARY_PATH"] = str(fake_dir)
    env["LD_PRELOAD"] = f"{libasan()} {shim}"
    env["ASAN_OPTIONS"] = "abort_on_error=0:halt_on_error=1:detect_leaks=1:exitcode=23"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    return env


def test_cycle_asan_ubsan(asan_build, fake_env):
    res = subprocess.run(
        [str(asan_build[2])],
        env=sanitized_env(asan_build, fake_env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert res.stdout == "cycle ok\n"
    assert "runtime error" not in res.stderr and "AddressSanitizer" not in res.stderr, res.stderr[
        -6000:
    ]


def test_stress_plain(build_c, shim_env, fakecuda_dir):
    drv = build_c([C_DIR / "stress.c"], "shim_stress", libs=link_fakecuda(fakecuda_dir))
    res = subprocess.run([str(drv)], env=shim_env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == "stress ok 48\n"
    assert res.stderr == ""


def test_stress_asan_ubsan(asan_build, fake_env):
    res = subprocess.run(
        [str(asan_build[3])],
        env=sanitized_env(asan_build, fake_env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert res.stdout == "stress ok 48\n"
    assert "runtime error" not in res.stderr and "AddressSanitizer" not in res.stderr, res.stderr[
        -6000:
    ]


def test_stress_tsan(build_c, cuda_include, fake_env):
    """Data races in the shim's locking (state lock, export cache, job slot, lock-free bounds)."""
    libtsan = runtime("libtsan.so")
    if not shutil.which("setarch"):
        pytest.skip("no setarch")
    shim, fake_dir = build_libs(TSAN, "shim-tsan", cuda_include)
    drv = build_c(
        [C_DIR / "stress.c"],
        "shim_stress_tsan",
        extra=("-fsanitize=thread",),
        libs=link_fakecuda(fake_dir),
    )
    env = dict(
        fake_env,
        LD_LIBRARY_PATH=str(fake_dir),
        LD_PRELOAD=f"{libtsan} {shim}",
        TSAN_OPTIONS="halt_on_error=1:exitcode=23",
    )
    res = subprocess.run(
        ["setarch", "-R", str(drv)], env=env, capture_output=True, text=True, timeout=300
    )
    if "ThreadSanitizer" in res.stderr and "unexpected memory mapping" in res.stderr:
        pytest.skip("TSan cannot start with this kernel's memory layout")
    assert "WARNING: ThreadSanitizer" not in res.stderr, res.stderr[-6000:]
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert res.stdout == "stress ok 48\n"

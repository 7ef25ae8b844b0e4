"""The two-process cycle (c/cycle_driver.c) under ASan/UBSan: shim, fakecuda and the driver
program all instrumented; the sanitized processes never exec anything (prior-art.md §6)."""
from __future__ import annotations

import os
import subprocess

import pytest

from .conftest import C_DIR, FAKECUDA_SRC, SHIM_SRC, build_shared, link_fakecuda

SAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-O1", "-g"]


def libasan() -> str:
    path = subprocess.run(["cc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path):
        pytest.skip("the compiler has no libasan.so")
    return path


@pytest.fixture(scope="module")
def asan_build(build_c, cuda_include):
    from .conftest import C_BUILD_DIR
    d = C_BUILD_DIR / "shim-asan"
    shim = build_shared(sorted((SHIM_SRC / "src").glob("*.c")), d / "libcuinterpose.so",
                        [*SAN, "-std=gnu11", "-fvisibility=hidden", f"-I{SHIM_SRC / 'include'}",
                         f"-I{cuda_include}", f"-Wl,--version-script={SHIM_SRC / 'libcuinterpose.map'}",
                         "-Wl,-Bsymbolic-functions"])
    fake = build_shared([FAKECUDA_SRC / "src" / "fakecuda.c"], d / "fakecuda" / "libcuda.so.1",
                        [*SAN, "-std=gnu11", "-fvisibility=hidden", f"-I{cuda_include}",
                         "-Wl,-Bsymbolic", "-Wl,-soname,libcuda.so.1"])
    drv = build_c([C_DIR / "cycle_driver.c"], "shim_cycle_driver", sanitize=True,
                  libs=link_fakecuda(fake.parent))
    return shim, fake.parent, drv


def test_cycle_plain(build_c, shim_env, fakecuda_dir):
    drv = build_c([C_DIR / "cycle_driver.c"], "shim_cycle_driver", libs=link_fakecuda(fakecuda_dir))
    res = subprocess.run([str(drv)], env=shim_env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == "cycle ok\n"


def test_cycle_asan_ubsan(asan_build, fake_env):
    shim, fake_dir, drv = asan_build
    env = dict(fake_env)
    env["LD_LIBRARY_PATH"] = str(fake_dir)
    env["LD_PRELOAD"] = f"{libasan()} {shim}"
    env["ASAN_OPTIONS"] = "abort_on_error=0:halt_on_error=1:detect_leaks=1:exitcode=23"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    res = subprocess.run([str(drv)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert res.stdout == "cycle ok\n"
    assert "runtime error" not in res.stderr and "AddressSanitizer" not in res.stderr, res.stderr[-6000:]

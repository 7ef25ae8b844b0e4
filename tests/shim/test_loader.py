"""Loader-level robustness: a driver whose handles collide with the shim's virtual tag, an
application that dlopens and dlcloses libcuda while the shim holds real pointers, and
dlsym(RTLD_NEXT, ...) from an application library (docs/shim.md section 1)."""

from __future__ import annotations

import subprocess

from .conftest import C_BUILD_DIR, C_DIR

SHARED = ("-shared", "-fPIC")


def test_driver_handle_with_the_virtual_tag_is_released_and_refused(build_c, shim_env, tmp_path):
    (C_BUILD_DIR / "tagcuda").mkdir(parents=True, exist_ok=True)
    lib = build_c(
        [C_DIR / "tagcuda.c"], "tagcuda/libcuda.so.1", extra=(*SHARED, "-Wl,-soname,libcuda.so.1")
    )
    app = build_c(
        [C_DIR / "tag_app.c"], "shim_tag_app", libs=(f"-L{lib.parent}", "-l:libcuda.so.1")
    )
    env = dict(shim_env, LD_LIBRARY_PATH=str(lib.parent), TAGCUDA_LOG=str(tmp_path / "tag.log"))
    res = subprocess.run([str(app)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # CUDA_ERROR_INVALID_HANDLE (400), the output untouched, for every way a handle comes back
    assert res.stdout.splitlines() == [
        "cuInit 0",
        "cuMemCreate 400 0x99",
        "cuMemRetainAllocationHandle 400 0x99",
        "cuMemImportFromShareableHandle 400 0x99",
    ]
    # ... and each colliding driver reference was released exactly once
    assert (tmp_path / "tag.log").read_text().splitlines() == [
        "cuMemCreate 0xc01e000000000001",
        "cuMemRelease 0xc01e000000000001",
        "cuMemRetainAllocationHandle 0xc01e000000000002",
        "cuMemRelease 0xc01e000000000002",
        "cuMemImportFromShareableHandle 0xc01e000000000003",
        "cuMemRelease 0xc01e000000000003",
    ]
    for api in ("cuMemCreate", "cuMemRetainAllocationHandle", "cuMemImportFromShareableHandle"):
        assert f"{api}: pid " in res.stderr and "carries the shim's tag 0xc01e" in res.stderr


def test_app_dlclose_of_libcuda_keeps_shim_pointers_valid(build_c, shim_env, fake_log):
    exe = build_c([C_DIR / "dl_cycle.c"], "shim_dl_cycle")
    res = subprocess.run([str(exe)], env=shim_env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    rounds = [ln.split() for ln in res.stdout.splitlines()]
    # every round: a virtual handle (a new one each time), a clean release, libcuda still loaded
    assert [(r[2], r[4], r[5]) for r in rounds] == [("0", "0", "1")] * 3
    handles = [int(r[3], 16) for r in rounds]
    assert [h >> 48 for h in handles] == [0xC01E] * 3 and len(set(handles)) == 3
    assert len([1 for _, _, r in fake_log.calls(fn="cuMemRelease") if r == "CUDA_SUCCESS"]) == 3


def test_rtld_next_from_an_app_library_resolves_relative_to_it(build_c, shim_env):
    d = C_BUILD_DIR / "next"
    d.mkdir(parents=True, exist_ok=True)
    b = build_c(
        [C_DIR / "next_b.c"], "next/libnext_b.so", extra=(*SHARED, "-Wl,-soname,libnext_b.so")
    )
    a = build_c(
        [C_DIR / "next_a.c"], "next/libnext_a.so", extra=(*SHARED, "-Wl,-soname,libnext_a.so")
    )
    exe = build_c(
        [C_DIR / "next_main.c"],
        "next/next_main",
        libs=(
            f"-L{d}",
            "-Wl,--no-as-needed",
            "-l:libnext_a.so",
            "-l:libnext_b.so",
            f"-Wl,-rpath,{d}",
            "-ldl",
        ),
    )
    assert a.parent == b.parent == d
    plain = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
    shimmed = subprocess.run([str(exe)], env=shim_env, capture_output=True, text=True, timeout=30)
    assert plain.stdout == "2\n"
    assert shimmed.stdout == "2\n", shimmed.stderr

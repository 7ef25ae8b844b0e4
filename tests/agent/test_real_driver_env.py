"""paths.real_driver_env: a child on the real driver keeps the image's LD_LIBRARY_PATH (a GPU
image may reach libcuda.so.1 only through it, docs/gpu-validation.md) minus fakecuda's
directory, and loses the preload and CUINTERPOSE_DRIVER."""

from __future__ import annotations

from cuinterpose.agent import paths


def test_keeps_the_image_library_path_without_fakecuda(fakecuda_dir):
    base = {
        "LD_PRELOAD": "/x/libcuinterpose.so",
        "CUINTERPOSE_DRIVER": "fake",
        "LD_LIBRARY_PATH": f"/usr/local/nvidia/lib64::{fakecuda_dir}:/opt/lib",
        "HOME": "/root",
    }
    assert paths.real_driver_env(base) == {
        "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64:/opt/lib",
        "HOME": "/root",
    }
    assert paths.real_driver_env({"LD_LIBRARY_PATH": f"{fakecuda_dir}/"}) == {}
    assert base["LD_PRELOAD"] == "/x/libcuinterpose.so"  # the base is not changed

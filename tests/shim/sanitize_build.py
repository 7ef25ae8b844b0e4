"""Sanitized builds of the shim and fakecuda for tests/shim (test_sanitize.py,
test_load_pipeline_sanitize.py).

- ``SAN``, ``TSAN``: the compiler flags of the ASan/UBSan and the TSan builds;
- ``runtime(name)``: the compiler's path of a sanitizer runtime (``libasan.so``,
  ``libtsan.so``), to LD_PRELOAD before the shim; skips the test when the compiler has none;
- ``build_libs(flags, name, cuda_include)``: (shim .so, fakecuda's directory) built with
  ``flags`` under build/tests/<name>/, rebuilt only when a source, header or flag changed
  (conftest.build_shared).
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from .conftest import C_BUILD_DIR, FAKECUDA_SRC, SHIM_SRC, build_shared

SAN = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-O1",
    "-g",
]
TSAN = ["-fsanitize=thread", "-O1", "-g"]


def runtime(name: str) -> str:
    path = subprocess.run(
        ["cc", f"-print-file-name={name}"], capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(path):
        pytest.skip(f"the compiler has no {name}")
    return path


def build_libs(flags, name: str, cuda_include) -> tuple[pathlib.Path, pathlib.Path]:
    d = C_BUILD_DIR / name
    shim = build_shared(
        sorted((SHIM_SRC / "src").glob("*.c")),
        d / "libcuinterpose.so",
        [
            *flags,
            "-std=gnu11",
            "-fvisibility=hidden",
            f"-I{SHIM_SRC / 'include'}",
            f"-I{cuda_include}",
            f"-Wl,--version-script={SHIM_SRC / 'libcuinterpose.map'}",
            "-Wl,-Bsymbolic-functions",
        ],
    )
    fake = build_shared(
        sorted((FAKECUDA_SRC / "src").glob("*.c")),
        d / "fakecuda" / "libcuda.so.1",
        [
            *flags,
            "-std=gnu11",
            "-fvisibility=hidden",
            f"-I{cuda_include}",
            "-Wl,-Bsymbolic",
            "-Wl,-soname,libcuda.so.1",
        ],
    )
    return shim, fake.parent

"""The glibc ceiling (issue 11, item 7: old containers): the installed shim and fakecuda need
no glibc symbol version above GLIBC_2.17, so they load in images with glibc 2.17 or newer
(Ubuntu 20.04, RHEL 8, older). Read from ``objdump -T`` (binutils); the sanitizer builds of
tests/shim build from the sources with their own flags and are not checked."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from cuinterpose.agent import paths

CEILING = (2, 17)
_VERSIONED = re.compile(r"\(?GLIBC_(\d+(?:\.\d+)+)\)?\s+(\S+)$")


def glibc_needs(lib) -> dict[str, tuple[int, ...]]:
    """Undefined dynamic symbols of ``lib`` bound to a GLIBC_x.y version: name -> version."""
    out = subprocess.run(["objdump", "-T", str(lib)], capture_output=True, text=True, check=True)
    needs: dict[str, tuple[int, ...]] = {}
    for line in out.stdout.splitlines():
        m = _VERSIONED.search(line)
        if m and "*UND*" in line:
            needs[m.group(2)] = tuple(int(x) for x in m.group(1).split("."))
    return needs


@pytest.mark.parametrize("which", ["shim", "fakecuda"])
def test_no_glibc_symbol_above_2_17(which):
    if shutil.which("objdump") is None:
        pytest.fail("objdump not found: install binutils (scripts/bootstrap-debian.sh)")
    lib = paths.shim_path() if which == "shim" else paths.fakecuda_dir() / paths.FAKECUDA_NAME
    needs = glibc_needs(lib)
    assert needs, f"{lib}: objdump -T lists no GLIBC_ symbol"
    over = sorted(f"{n}@GLIBC_{'.'.join(map(str, v))}" for n, v in needs.items() if v > CEILING)
    assert not over, (
        f"{lib} needs glibc symbols newer than GLIBC_2.17: {', '.join(over)}; bind them in "
        "interposer/compat/glibc_moved.def or replace them in glibc_compat.h (docs/shim.md)"
    )


def test_old_pthread_and_dl_libraries_are_needed():
    """On glibc < 2.34 the old pthread_* and dl* versions live in libpthread.so.0 and libdl.so.2."""
    for lib in (paths.shim_path(), paths.fakecuda_dir() / paths.FAKECUDA_NAME):
        out = subprocess.run(
            ["objdump", "-p", str(lib)], capture_output=True, text=True, check=True
        )
        needed = set(re.findall(r"NEEDED\s+(\S+)", out.stdout))
        assert {"libdl.so.2", "libpthread.so.0", "libc.so.6"} <= needed, (lib, needed)

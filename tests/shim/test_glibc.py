"""The glibc ceiling (issue 11, item 7: old containers): the installed shim, fakecuda and
fakecuda's ``cuda-checkpoint`` tool need no glibc symbol version above GLIBC_2.17, so they load in
images with glibc 2.17 or newer (Ubuntu 20.04, RHEL 8, older) and the wheel is
manylinux_2_17 (issue 28). Read from ``objdump -T`` (binutils); the sanitizer builds of
tests/shim build from the sources with their own flags and are not checked."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from cuinterpose.agent import paths

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]

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


def _built(which):
    return {
        "shim": lambda: paths.shim_path(),
        "fakecuda": lambda: paths.fakecuda_dir() / paths.FAKECUDA_NAME,
        "cuda-checkpoint": lambda: paths.fakecuda_dir() / "bin" / "cuda-checkpoint",
    }[which]()


@pytest.mark.parametrize("which", ["shim", "fakecuda", "cuda-checkpoint"])
def test_no_glibc_symbol_above_2_17(which):
    if shutil.which("objdump") is None:
        pytest.fail("objdump not found: install binutils (scripts/bootstrap-debian.sh)")
    lib = _built(which)
    needs = glibc_needs(lib)
    assert needs, f"{lib}: objdump -T lists no GLIBC_ symbol"
    over = sorted(f"{n}@GLIBC_{'.'.join(map(str, v))}" for n, v in needs.items() if v > CEILING)
    assert not over, (
        f"{lib} needs glibc symbols newer than GLIBC_2.17: {', '.join(over)}; bind them in "
        "compat/glibc_moved.def or replace them in glibc_compat.h (docs/shim.md)"
    )


def test_old_pthread_and_dl_libraries_are_needed():
    """On glibc < 2.34 the old pthread_* and dl* versions live in libpthread.so.0 and libdl.so.2."""
    for lib in (paths.shim_path(), paths.fakecuda_dir() / paths.FAKECUDA_NAME):
        out = subprocess.run(
            ["objdump", "-p", str(lib)], capture_output=True, text=True, check=True
        )
        needed = set(re.findall(r"NEEDED\s+(\S+)", out.stdout))
        assert {"libdl.so.2", "libpthread.so.0", "libc.so.6"} <= needed, (lib, needed)


def test_old_start_main_runs_constructors_and_destructors_once(tmp_path):
    """compat/glibc_start.c: a program linked with it and --wrap=__libc_start_main binds the
    old __libc_start_main, runs its preinit_array (ld.so does), init_array (glibc_start.c, with
    argc and argv) and fini_array exactly once each, in that order, and returns main's status."""
    prog = tmp_path / "prog.c"
    prog.write_text(
        """#include <stdio.h>
static int argc_seen = -1;
static void pre(int argc, char **argv, char **envp) { printf("preinit %d %s\\n", argc, argv[1]); }
__attribute__((section(".preinit_array"), used)) static void (*pre_p)(int, char **, char **) = pre;
__attribute__((constructor)) static void ctor(int argc, char **argv) {
  argc_seen = argc; printf("ctor %d %s\\n", argc, argv[1]); }
__attribute__((destructor)) static void dtor(void) { printf("dtor\\n"); }
int main(int argc, char **argv) { printf("main %d\\n", argc_seen); return 7; }
"""
    )
    exe = tmp_path / "prog"
    subprocess.run(
        [
            "cc",
            "-O1",
            "-o",
            str(exe),
            str(prog),
            str(ROOT / "compat" / "glibc_start.c"),
            "-Wl,--wrap=__libc_start_main",
        ],
        check=True,
    )
    needs = glibc_needs(exe)
    assert needs["__libc_start_main"] <= CEILING, needs
    res = subprocess.run([str(exe), "x"], capture_output=True, text=True)
    assert (res.returncode, res.stdout) == (7, "preinit 2 x\nctor 2 x\nmain 2\ndtor\n")

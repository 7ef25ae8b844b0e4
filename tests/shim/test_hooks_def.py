"""hooks.def is the one list of hooked names: libcuinterpose.map exports exactly its hooked rows
(and dlsym), and the built library exports exactly the map."""

from __future__ import annotations

import subprocess

from .shim_build import hooked_names, hooks_def_rows, map_globals


def test_hooks_def_rows_are_unique():
    elfs = [elf for _, elf in hooks_def_rows()]
    assert elfs and len(elfs) == len(set(elfs)), "an ELF name is listed twice in hooks.def"


def test_map_exports_exactly_the_hooked_rows():
    exported = map_globals()
    assert len(exported) == len(set(exported)), "a name is listed twice in libcuinterpose.map"
    assert sorted(exported) == sorted(hooked_names() + ["dlsym"])


def test_library_exports_exactly_the_map(shim_path):
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(shim_path)], capture_output=True, text=True, check=True
    ).stdout
    defined = sorted(line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip())
    assert defined == sorted(map_globals())

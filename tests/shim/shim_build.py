"""Helpers for the shim's source-level tests (test_hooks_def.py, test_layers.py).

- ``SRC``: interposer/src; ``hooks_def_rows()``: the rows of hooks.def as (kind, elf name).
- ``object_files()``: the shim's object files in the CMake build dir (build/*/interposer/),
  one per source file of interposer/src, by source stem.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
INTERPOSER = ROOT / "interposer"
SRC = INTERPOSER / "src"
MAP = INTERPOSER / "libcuinterpose.map"

_ROW = re.compile(r"^(CUI_HOOK|CUI_HOOK_AS|CUI_REAL)\((\w+),", re.M)


def hooks_def_rows() -> list[tuple[str, str]]:
    """(macro, elf name) of every row of hooks.def, in file order."""
    return _ROW.findall((SRC / "hooks.def").read_text())


def hooked_names() -> list[str]:
    """ELF names of the hooked rows (CUI_HOOK, CUI_HOOK_AS): the shim's exports besides dlsym."""
    return [elf for kind, elf in hooks_def_rows() if kind != "CUI_REAL"]


def map_globals() -> list[str]:
    """The names under ``global:`` of libcuinterpose.map."""
    text = re.sub(r"/\*.*?\*/", "", MAP.read_text(), flags=re.S)
    body = text.split("global:", 1)[1].split("local:", 1)[0]
    return [n.strip() for n in body.split(";") if n.strip()]


def object_files() -> dict[str, pathlib.Path]:
    """Source stem -> object file of the newest CMake build of the shim (stale objects of
    removed sources are left out)."""
    found: dict[str, pathlib.Path] = {}
    for obj in sorted(
        ROOT.glob("build/*/interposer/**/src/*.c.o"), key=lambda p: p.stat().st_mtime
    ):
        stem = obj.name[: -len(".c.o")]
        if (SRC / f"{stem}.c").exists():
            found[stem] = obj
    return found

"""fakecuda's shape: the built libcuda.so.1 exports exactly the functions proc_address.def
lists (so cuGetProcAddress resolves every exported name and nothing else leaks), and the
source files call each other one way only (fc.h lists the layers)."""

from __future__ import annotations

import pathlib
import re
import subprocess

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE.parent.parent / "fakecuda" / "src"
ROW = re.compile(r"^FC_PROC(_PT)?\((\w+), (\d+), (\w+)(?:, (\w+))?\)", re.M)


def def_rows():
    return ROW.findall((SRC / "proc_address.def").read_text())


def test_def_rows_are_well_formed():
    rows = def_rows()
    # 13.5: cuStreamGetDevice, cuCheckpointOperationComplete; events, peer access, pools (issue 24)
    assert len(rows) == 120
    for pt, _base, _version, _fn, pt_fn in rows:
        assert bool(pt) == bool(pt_fn)
    keys = [(base, int(version)) for _pt, base, version, _fn, _ptfn in rows]
    assert len(keys) == len(set(keys)), "a (name, version) row is listed twice"


def test_exports_equal_the_def(fakecuda_dir):
    lib = fakecuda_dir / "libcuda.so.1"
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    syms = [line.split() for line in out.splitlines() if line.strip()]
    assert all(kind == "T" for _addr, kind, _name in syms), [s for s in syms if s[1] != "T"]
    exported = {name for _addr, _kind, name in syms}
    listed = {fn for _pt, _base, _v, fn, _ptfn in def_rows()} | {p for *_, p in def_rows() if p}
    assert exported == listed, (sorted(exported - listed), sorted(listed - exported))
    assert len(exported) == 146


def test_sources_are_small_and_say_what_they_hold():
    for f in sorted(SRC.iterdir()):
        if f.suffix not in (".c", ".h", ".def", ".inc"):
            continue
        text = f.read_text()
        assert len(text.splitlines()) <= 650, f.name
        assert text.startswith("/*"), f"{f.name} does not start with a comment saying what it holds"


def test_calls_go_one_way(cuda_include, tmp_path):
    """Compile each file alone; a file's undefined symbols defined by another file are its
    arrows. They all point down the layer order fc.h lists (so there is no cycle)."""
    defs, uses = {}, {}
    for c in sorted(SRC.glob("*.c")):
        obj = tmp_path / (c.stem + ".o")
        subprocess.run(
            [
                "cc",
                "-c",
                "-fPIC",
                "-std=gnu11",
                "-O0",
                "-fvisibility=hidden",
                f"-I{cuda_include}",
                "-o",
                str(obj),
                str(c),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        for line in subprocess.run(
            ["nm", str(obj)], capture_output=True, text=True, check=True
        ).stdout.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "TDBRC":
                defs[parts[2]] = c.stem
            elif len(parts) == 2 and parts[0] == "U":
                uses.setdefault(c.stem, set()).add(parts[1])
    graph = {f: {defs[s] for s in u if s in defs and defs[s] != f} for f, u in uses.items()}
    # fc.h lists the files bottom to top; each may call only files listed before it
    order = re.findall(r"^ \*   (\w+)\.c ", (SRC / "fc.h").read_text(), re.M)
    assert sorted(order) == sorted(c.stem for c in SRC.glob("*.c")), order
    upward = [
        (f, g) for f, callees in graph.items() for g in callees if order.index(g) > order.index(f)
    ]
    assert not upward, f"calls against the layer order of fc.h: {upward}"
    assert graph["core"] == set()
    assert graph["device"] == {"core"}

"""The shim's files by layer, arrows one way only (docs/shim.md "Files and layers").

Two graphs over interposer/src: calls (from the object files of the CMake build: an arrow
A -> B when A.o uses a global symbol that B.o defines) and includes (``#include "..."``).
Both must be acyclic, and every arrow must go down the layer order:

    util (util, checksum, blake2b, sha256, chunkio) -> resolve -> state -> vmm_api | multicast_api | peer | proc_address
      | alloc_api | ipc_api | event_api | peer_access | share_api
      -> ops_unicast | ops_copies | ops_carriers | ops_load | ops_multicast | ops_share -> ops
      -> control | carry_in

read "may be used by". Inside a layer only the calls in SAME_LAYER are allowed (a file may
include its own layer's header). The hook
table in resolve.c takes the address of every exported wrapper (the hooked names of hooks.def);
those references are the table's purpose, not calls, and are the one exemption.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from .shim_build import SRC, hooked_names, object_files

LAYERS = [
    {"util", "checksum", "blake2b", "sha256", "chunkio", "util.h"},
    {"resolve", "resolve.h", "hooks.def"},
    {"state", "state.h"},
    {
        "vmm_api",
        "multicast_api",
        "peer",
        "proc_address",
        "alloc_api",
        "ipc_api",
        "event_api",
        "peer_access",
        "share_api",
        "api.h",
    },
    {
        "ops_unicast",
        "ops_copies",
        "ops_carriers",
        "ops_load",
        "ops_multicast",
        "ops_share",
        "phase_ops.h",
    },
    {"ops", "ops.h"},
    {"control", "carry_in"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
#: (user, used) pairs allowed inside one layer: the VMM wrappers' multicast branches live in
#: multicast_api; the import wrappers and the multicast import use the FETCH_FD client.
#: The IPC adapter builds on the tracked VMM wrappers (docs/shim.md "IPC adapter").
SAME_LAYER = {
    ("ops_carriers", "ops_unicast"),  # the staging mapping and remap helpers
    ("ops_carriers", "ops_copies"),  # the copy pipeline
    ("ops_load", "ops_unicast"),
    ("ops_load", "ops_copies"),
    ("ops_load", "ops_carriers"),  # the helpers SAVE and LOAD share
    ("control", "carry_in"),  # the worker receives the carriers' tables
    ("vmm_api", "multicast_api"),
    ("vmm_api", "peer"),
    ("multicast_api", "peer"),
    ("alloc_api", "vmm_api"),
    ("ipc_api", "alloc_api"),
    ("ipc_api", "vmm_api"),
    # issue 24: IPC events fetch their creator's handle; peer access grants through the tracked
    # cuMemSetAccess, for adapter memory made later too; FABRIC refusals say one line
    ("event_api", "peer"),
    ("peer_access", "vmm_api"),
    ("alloc_api", "peer_access"),
    ("ipc_api", "peer_access"),
    ("vmm_api", "share_api"),
    ("share_api", "event_api"),
    ("ops_share", "ops_unicast"),  # the unicast ops with the events and registrations around them
    ("ops_share", "ops_load"),
}


def _node(path) -> str:
    return path.stem if path.suffix == ".c" else path.name


def _check(graph: dict[str, set[str]], what: str, same_layer: set[tuple[str, str]] | None) -> None:
    """No arrow up the layers, inside a layer only `same_layer` (None: any), and no cycle."""
    bad = []
    for a, users in sorted(graph.items()):
        for b in sorted(users):
            if RANK[a] < RANK[b]:
                bad.append(f"{a} -> {b}: a lower layer uses a higher one")
            elif RANK[a] == RANK[b] and same_layer is not None and (a, b) not in same_layer:
                bad.append(f"{a} -> {b}: an arrow inside a layer that SAME_LAYER does not allow")
    assert not bad, f"{what} arrows against the layer order:\n  " + "\n  ".join(bad)
    # acyclic (Kahn)
    indeg = {n: 0 for n in graph}
    for a in graph:
        for b in graph[a]:
            indeg[b] = indeg.get(b, 0) + 1
    ready = [n for n, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for b in graph.get(n, ()):
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    cyc = sorted(n for n, d in indeg.items() if d > 0)
    assert seen == len(indeg), f"{what} graph has a cycle through: {', '.join(cyc)}"


def test_every_file_has_a_layer():
    files = {_node(p) for p in SRC.iterdir() if p.suffix in (".c", ".h", ".def")}
    assert files == set(RANK), "interposer/src and LAYERS differ (add the new file to its layer)"


def _symbols(obj, *flags) -> set[str]:
    out = subprocess.run(
        ["nm", *flags, str(obj)], capture_output=True, text=True, check=True
    ).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_call_graph_follows_the_layers():
    objs = object_files()
    if set(objs) != {p.stem for p in SRC.glob("*.c")}:
        pytest.fail(
            f"object files of the shim not found under build/*/interposer/ (got {sorted(objs)}); "
            "run `make build`"
        )
    defined = {n: _symbols(o, "-g", "--defined-only") for n, o in objs.items()}
    used = {n: _symbols(o, "-u") for n, o in objs.items()}
    table_refs = set(hooked_names())
    graph: dict[str, set[str]] = {n: set() for n in objs}
    for a in objs:
        for b in objs:
            if a == b:
                continue
            common = used[a] & defined[b]
            if a == "resolve":
                common -= table_refs
            if common:
                graph[a].add(b)
    _check(graph, "call", SAME_LAYER)


def test_include_graph_follows_the_layers():
    graph: dict[str, set[str]] = {}
    for p in SRC.iterdir():
        if p.suffix not in (".c", ".h", ".def"):
            continue
        incs = re.findall(r'^\s*#\s*include\s+"([^"]+)"', p.read_text(), re.M)
        graph[_node(p)] = {i for i in incs if (SRC / i).exists()}
    _check(graph, "include", None)

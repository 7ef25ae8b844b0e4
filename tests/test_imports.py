"""The import graph of every ``cuinterpose.*`` module: no cycle, and the agent's layers in order.

The graph is read from the sources (``ast``, nothing is imported): every ``import`` and
``from ... import`` in a module, at module level and inside functions and classes (a lazy
import is still an arrow), relative ones resolved; those under ``if TYPE_CHECKING:`` are left
out. The modules are the ``.py`` files of the folders that pyproject.toml's
``[tool.scikit-build.wheel.packages]`` maps to ``cuinterpose/...`` packages. An arrow goes to the
module named (``from P import m`` names the module ``P.m`` when there is one, else ``P``) and
to the packages above it that do not also hold the importer (their ``__init__`` runs first; a
package above the importer is being imported already).
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def source_modules() -> dict[str, pathlib.Path]:
    """Module name -> source file, for every package folder pyproject.toml maps."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = conf["tool"]["scikit-build"]["wheel"]["packages"]
    mods = {}
    for pkg, folder in packages.items():
        base = ROOT / folder
        for f in sorted(base.rglob("*.py")):
            rel = f.relative_to(base).with_suffix("")
            parts = pkg.split("/") + list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = (
                t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else ""
            )
            if name == "TYPE_CHECKING":
                for sub in node.body:
                    skip.update(id(n) for n in ast.walk(sub))
    return skip


def _known(name: str, mods) -> str | None:
    """``name`` or the longest dotted prefix of it that is one of ``mods``."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in mods:
            return cand
        parts.pop()
    return None


def import_graph(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports (only modules of ``mods``; no self-arrows)."""
    graph = {}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_pkg = path.name == "__init__.py"
        skip = _type_checking_only(tree)
        named = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                named.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module
                for a in node.names:  # a submodule of src, else a name defined in src
                    sub = f"{src}.{a.name}"
                    named.add(sub if a.name != "*" and sub in mods else src)
        targets = set()
        for name in named:
            t = _known(name, mods)
            if t is None:
                continue
            targets.add(t)
            # the packages above the target run first, unless they hold the importer too
            parts = t.split(".")[:-1]
            while parts:
                pkg = ".".join(parts)
                if pkg in mods and not (mod == pkg or mod.startswith(pkg + ".")):
                    targets.add(pkg)
                parts.pop()
        targets.discard(mod)
        graph[mod] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component that has one."""
    index, low, on, stack, sccs = {}, {}, set(), [], []
    counter = [0]

    def strong(v):  # Tarjan, iterative over the successors
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        sccs.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    cycles = []
    for comp in sccs:
        start = min(comp)
        path = _path(graph, start, start, within=comp)
        cycles.append(path)
    return cycles


def _path(graph, src: str, dst: str, within=None) -> list[str] | None:
    """A shortest import path ``[src, ..., dst]`` (one step at least), through ``within``
    only when given; None when there is none."""
    prev = {}
    frontier = [src]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if within is not None and w not in within:
                    continue
                if w == dst:
                    path = [w, v]
                    while path[-1] != src:
                        path.append(prev[path[-1]])
                    return path[::-1]
                if w not in prev and w != src:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return None


@pytest.fixture(scope="module")
def graph():
    return import_graph(source_modules())


def test_the_graph_sees_module_function_and_relative_imports(graph):
    """The reader finds what it must: a module-level import, an import inside a function and
    a relative import (so that the checks below are not vacuous)."""
    mods = source_modules()
    assert "cuinterpose.agent.rpc.service" in mods and "cuinterpose.coordinator.phases" in mods
    assert "cuinterpose.agent.rpc.client" in graph["cuinterpose.agent.rpc.service"]
    assert "cuinterpose.agent.rpc.metrics" in graph["cuinterpose.agent.rpc.service"]  # in Server()
    assert "cuinterpose.coordinator.topology" in graph["cuinterpose.coordinator.phases"]  # "from ."


def test_no_import_cycle(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


LAYERS = [
    # (importers, what they must never reach, directly or through other modules[, exempt])
    (
        "cuinterpose.agent.mech",
        [
            "cuinterpose.agent.run",
            "cuinterpose.agent.rpc",
            "cuinterpose.agent.cli",
            "cuinterpose.agent.kube",
        ],
    ),
    (
        "cuinterpose.agent.snapshot",
        [
            "cuinterpose.agent.run",
            "cuinterpose.agent.rpc",
            "cuinterpose.agent.cli",
            "cuinterpose.agent.kube",
        ],
    ),
    (
        "cuinterpose.agent.run",
        ["cuinterpose.agent.rpc", "cuinterpose.agent.cli", "cuinterpose.agent.kube"],
    ),
    ("cuinterpose.coordinator", ["cuinterpose.agent", "cuinterpose.workloads"]),
    # the workload runs without the agent; its demo harness (demo.py) drives the agent
    ("cuinterpose.workloads", ["cuinterpose.agent"], ["cuinterpose.workloads.afdwin.demo"]),
]


def _inside(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


@pytest.mark.parametrize(
    "lower,upper,exempt",
    [(lo, up, *rest) if rest else (lo, up, []) for lo, up, *rest in LAYERS],
    ids=[layer[0].rsplit(".", 1)[-1] for layer in LAYERS],
)
def test_layer_order(graph, lower, upper, exempt):
    """A lower layer never imports a higher one, not even through a module of another layer
    (``exempt``: modules of the lower package that are harnesses of the higher one)."""
    bad = []
    for mod in sorted(m for m in graph if _inside(m, lower) and m not in exempt):
        for target in sorted(t for t in graph if any(_inside(t, u) for u in upper)):
            path = _path(graph, mod, target)
            if path is not None:
                bad.append(" -> ".join(path))
                break
    assert not bad, f"{lower} must not import {', '.join(upper)}:\n" + "\n".join(bad)

"""Import direction of the coordinator and the workload: neither reaches into the agent.

The agent drives the coordinator (and demo.py, a harness, drives the agent); the coordinator's
modules and afdwin's launcher and ranks import nothing from ``cuinterpose.agent``, and the
coordinator imports nothing from the workload.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _imports(path: pathlib.Path) -> list[str]:
    """Every module ``path`` imports, as an absolute cuinterpose.* name where relative."""
    pkg = ["cuinterpose", *path.parent.relative_to(REPO).parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [mod] + [f"{mod}.{a.name}" for a in node.names]
    return out


def _sources(*dirs: str, skip: tuple[str, ...] = ()) -> list[pathlib.Path]:
    return [p for d in dirs for p in sorted((REPO / d).glob("*.py")) if p.name not in skip]


@pytest.mark.parametrize("path", _sources("coordinator", "workloads/afdwin", skip=("demo.py",)),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_agent_import(path):
    bad = [m for m in _imports(path) if m == "cuinterpose.agent"
           or m.startswith("cuinterpose.agent.")]
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"


@pytest.mark.parametrize("path", _sources("coordinator"), ids=lambda p: p.name)
def test_coordinator_does_not_import_the_workload(path):
    bad = [m for m in _imports(path) if m.startswith("cuinterpose.workloads")]
    assert not bad, f"{path.relative_to(REPO)} imports {bad}"

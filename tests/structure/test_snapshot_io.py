"""Only agent/snapshot touches a snapshot's files (issue 27; decisions D64).

agent/snapshot/snapdir.py's ``SnapshotDir`` owns every path name in a snapshot directory and
is the one place its files are created, opened, synced, listed or removed. This test reads
(``ast``, nothing is imported) every module of the ``cuinterpose`` packages outside
``cuinterpose.agent.snapshot`` and fails on either of:

1. **a layout name as a literal** (docstrings are prose and not read): a string (or the static
   text of an f-string) that holds ``manifest.json``, ``.cuinterpose-claim`` or
   ``.cuinterpose-store``, or starts with ``chunks/`` or ``criu/`` (a path inside a snapshot),
   or the bare ``"chunks"``/``"criu"`` bound to a name (``CHUNKS_DIR = "chunks"``) or joined
   to a snapshot path (below: an operand of ``/`` or an argument of ``os.path.join`` beside
   one). ``m["chunks"]``, the manifest's field, and ``REPO / "criu"``, CRIU's own folder, are
   no snapshot paths and pass.
2. **a file operation on a snapshot path**: ``open``; ``os.open/unlink/remove/rename/replace/
   makedirs/mkdir/rmdir/listdir/scandir/walk/link/symlink/chmod/truncate/stat/lstat``;
   ``os.path.exists/lexists/isfile/isdir/getsize``; any ``shutil`` call; or a ``Path`` method
   (``open``, ``read_*``, ``write_*``, ``unlink``, ``mkdir``, ``rmdir``, ``iterdir``, ``glob``,
   ``rglob``, ``touch``, ``rename``, ``replace``, ``exists``, ``is_file``, ``is_dir``, ``stat``,
   ``lstat``, ``chmod``) whose receiver or argument is derived from a snapshot path. Snapshot
   paths are: a name or attribute called ``images_dir`` / ``snapshot_dir`` / ``snap_dir`` /
   ``local_dir`` (an ``s3://`` run's local copy), a subscript ``[...]["images_dir"]``, the
   attributes ``path``/``chunks_dir``/``packs_dir``/``manifest_path`` and the calls
   ``.criu_dir()``/``.make_criu_dir()``/``.file()`` of a SnapshotDir object; a variable
   assigned from an expression that holds one (within the same function, to a fixpoint) is
   one too. A SnapshotDir object (``SnapshotDir(...)``, ``SnapshotDir.canonical(...)``,
   ``snapdir.prepare(...)``, a name or attribute ``snap``, a variable assigned one) is the
   channel itself: its other methods pass.

:data:`ALLOWED` lists the modules exempt from rule 2, each with its reason; a test checks
that every one of them still needs it. A negative test feeds the checker offending samples
(the lines this refactor removed) and a clean one.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from test_imports import source_modules  # noqa: E402

SNAPSHOT_PACKAGE = "cuinterpose.agent.snapshot"

#: module -> why it may apply file operations to a path under a snapshot (rule 2 only)
ALLOWED = {
    "cuinterpose.agent.mech.criu": (
        "drives CRIU on the tree's images directory criu/<root>/ that SnapshotDir.criu_dir "
        "hands it: CRIU, an external program, writes and reads every file there (this module "
        "checks the directory holds no earlier images and keeps the restore's work dir apart)"
    ),
    "cuinterpose.agent.mech.criu_images": (
        "reads CRIU's own image format (pstree.img) in the tree's images directory "
        "criu/<root>/ after CRIU wrote it: part of driving CRIU, like mech/criu.py"
    ),
    "cuinterpose.agent.mech.criu_remap": (
        "CRIU's linked-remap files of a dump, kept in CRIU's images directory criu/<root>/ "
        "beside the images CRIU wrote there, and put back before CRIU's restore reads them"
    ),
}

SEED_NAMES = {"images_dir", "snapshot_dir", "snap_dir", "local_dir"}
SEED_ATTRS = {"path", "chunks_dir", "packs_dir", "manifest_path"}
SEED_CALLS = {"criu_dir", "make_criu_dir", "file"}
OS_OPS = {
    "open",
    "unlink",
    "remove",
    "rename",
    "replace",
    "makedirs",
    "mkdir",
    "rmdir",
    "listdir",
    "scandir",
    "walk",
    "link",
    "symlink",
    "chmod",
    "truncate",
    "stat",
    "lstat",
}
OS_PATH_OPS = {"exists", "lexists", "isfile", "isdir", "getsize"}
PATH_METHODS = {
    "open",
    "read_text",
    "read_bytes",
    "write_text",
    "write_bytes",
    "unlink",
    "mkdir",
    "rmdir",
    "iterdir",
    "glob",
    "rglob",
    "touch",
    "rename",
    "replace",
    "exists",
    "is_file",
    "is_dir",
    "stat",
    "lstat",
    "chmod",
}
NAMES_ANYWHERE = ("manifest.json", ".cuinterpose-claim", ".cuinterpose-store")
PATH_PREFIXES = ("chunks/", "criu/")
COMPONENTS = {"chunks", "criu"}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of the module, its classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _static_text(node: ast.AST) -> str | None:
    """A string constant's text, or an f-string's with each placeholder as ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _literal_findings(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    docs = _docstrings(tree)
    inner = set()  # the Constant parts of f-strings: judged as the whole f-string
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            inner.update(id(v) for v in node.values)
    for node in ast.walk(tree):
        if id(node) in docs or id(node) in inner:
            continue
        text = _static_text(node)
        if text is None:
            continue
        hit = next((n for n in NAMES_ANYWHERE if n in text), None)
        if hit is None and text.startswith(PATH_PREFIXES):
            hit = text.split("/", 1)[0] + "/"
        if hit is not None:
            out.append((node.lineno, f"snapshot name {hit!r} in the literal {text!r}"))
    for node in ast.walk(tree):  # "chunks"/"criu" bound to a name: a second definition
        if (
            isinstance(node, (ast.Assign, ast.AnnAssign))
            and isinstance(node.value, ast.Constant)
            and node.value.value in COMPONENTS
        ):
            out.append((node.lineno, f"snapshot directory {node.value.value!r} given a name"))
    return out


#: what makes a SnapshotDir object (the channel itself: its methods are fine, its path
#: attributes are snapshot paths)
OBJ_MAKERS = ("SnapshotDir", "SnapshotDir.canonical", "snapdir.prepare")
OBJ_NAMES = {"snap"}
STR_ATTRS = {"name", "stem", "suffix"}


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope`` without those of the functions and classes nested in it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(n))


class _Taint:
    """Which names of one scope hold snapshot paths, and which hold SnapshotDir objects (see
    the module docstring)."""

    def __init__(self, scope: ast.AST):
        self.names: set[str] = set()
        self.objs: set[str] = set(OBJ_NAMES)
        args = getattr(scope, "args", None)
        if args is not None:
            for a in args.args + args.kwonlyargs + args.posonlyargs:
                if a.arg in SEED_NAMES:
                    self.names.add(a.arg)
        assigns = []
        for node in _own_nodes(scope):
            if isinstance(node, ast.Assign):
                assigns.append((node.targets, node.value))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                assigns.append(([node.target], node.value))
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                assigns.append(([node.target], node.iter))
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                assigns.append(([node.optional_vars], node.context_expr))
            elif isinstance(node, ast.NamedExpr):
                assigns.append(([node.target], node.value))
        changed = True
        while changed:
            changed = False
            for targets, value in assigns:
                into = (
                    self.objs if self.is_obj(value) else self.names if self.holds(value) else None
                )
                if into is None:
                    continue
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name) and n.id not in into:
                            into.add(n.id)
                            changed = True

    def is_obj(self, e: ast.AST) -> bool:
        """``e`` is a SnapshotDir object."""
        if isinstance(e, ast.Name):
            return e.id in self.objs
        if isinstance(e, ast.Attribute):
            return e.attr == "snap"
        if isinstance(e, ast.Call):
            f = _dotted(e.func)
            return any(f == m or f.endswith("." + m) for m in OBJ_MAKERS)
        return False

    def holds(self, e: ast.AST) -> bool:
        """``e`` is, or is built from, a snapshot path."""
        if self.is_obj(e):
            return False
        if isinstance(e, ast.Name):
            return e.id in SEED_NAMES or e.id in self.names
        if isinstance(e, ast.Attribute):
            if e.attr in STR_ATTRS:  # a part of a path's name is a string, not a path
                return False
            if e.attr in SEED_NAMES or (e.attr in SEED_ATTRS and self.is_obj(e.value)):
                return True
            return self.holds(e.value) if not self.is_obj(e.value) else False
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
            if e.func.attr in SEED_CALLS and self.is_obj(e.func.value):
                return True
            if self.is_obj(e.func.value):  # another method of the object: not a path
                return any(self.holds(a) for a in e.args)
        if (
            isinstance(e, ast.Subscript)
            and isinstance(e.slice, ast.Constant)
            and e.slice.value in SEED_NAMES
        ):
            return True
        return any(self.holds(c) for c in ast.iter_child_nodes(e))


def _file_op(call: ast.Call) -> tuple[str, list[ast.AST]] | None:
    """(what, the expressions it applies to) when ``call`` is a file operation."""
    f = call.func
    name = _dotted(f)
    if name == "open":
        return name, call.args[:1]
    if name.startswith("os.path.") and name.rsplit(".", 1)[1] in OS_PATH_OPS:
        return name, list(call.args)
    if name.startswith("os.") and name.count(".") == 1 and name[3:] in OS_OPS:
        return name, list(call.args)
    if name.startswith("shutil."):
        return name, list(call.args)
    if isinstance(f, ast.Attribute) and f.attr in PATH_METHODS and not name.startswith("os."):
        return f".{f.attr}()", [f.value]
    return None


def _io_findings(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    scopes = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    for scope in scopes:
        taint = _Taint(scope)
        for node in _own_nodes(scope):
            if isinstance(node, ast.Call):
                op = _file_op(node)
                if op is not None and any(taint.holds(a) for a in op[1]):
                    out.append((node.lineno, f"{op[0]} on a snapshot path: {ast.unparse(node)}"))
            parts = []
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                parts = [node.left, node.right]
            elif isinstance(node, ast.Call) and _dotted(node.func) == "os.path.join":
                parts = list(node.args)
            if any(taint.holds(p) for p in parts):
                for p in parts:
                    if isinstance(p, ast.Constant) and p.value in COMPONENTS:
                        out.append(
                            (p.lineno, f"snapshot directory {p.value!r} joined to a snapshot path")
                        )
    return out


def findings(source: str, *, io: bool = True) -> list[tuple[int, str]]:
    """Every breach of the two rules in ``source`` (rule 2 only with ``io``), by line."""
    tree = ast.parse(source)
    return sorted(_literal_findings(tree) + (_io_findings(tree) if io else []))


def outside_modules() -> dict[str, pathlib.Path]:
    return {
        m: p
        for m, p in source_modules().items()
        if not (m == SNAPSHOT_PACKAGE or m.startswith(SNAPSHOT_PACKAGE + "."))
    }


def test_the_walk_covers_the_modules_that_used_to_open_snapshot_files():
    mods = outside_modules()
    for m in (
        "cuinterpose.agent.run.carriers",
        "cuinterpose.agent.run.durable",
        "cuinterpose.agent.run.rollback",
        "cuinterpose.agent.run.report",
        "cuinterpose.agent.mech.gpustore",
        "cuinterpose.agent.mech.native_storage",
        "cuinterpose.agent.kube.watcher",
        "cuinterpose.coordinator.carrierfiles",
    ):
        assert m in mods
    assert not any(m.startswith(SNAPSHOT_PACKAGE) for m in mods)


def test_no_module_outside_agent_snapshot_names_or_opens_snapshot_files():
    bad = []
    for mod, path in sorted(outside_modules().items()):
        for line, what in findings(path.read_text(), io=mod not in ALLOWED):
            bad.append(f"{path.relative_to(path.parents[2])}:{line}: {what}")
    assert not bad, "go through agent/snapshot/snapdir.py SnapshotDir:\n" + "\n".join(bad)


@pytest.mark.parametrize("mod", sorted(ALLOWED))
def test_every_allowed_module_still_needs_it(mod):
    """An exemption whose module no longer touches snapshot paths is stale: remove it."""
    path = outside_modules()[mod]
    assert _io_findings(ast.parse(path.read_text())), f"{mod} is allowed for nothing"
    assert len(ALLOWED[mod]) > 40  # the reason is said


OFFENDING = """
import os, pathlib, shutil

def remove_manifest(self):
    (pathlib.Path(self.images_dir) / "manifest.json").unlink(missing_ok=True)

def cleanup(images_dir):
    d = pathlib.Path(images_dir) / CRIU
    shutil.rmtree(d, ignore_errors=True)

def rows(s):
    return json.loads((pathlib.Path(s["images_dir"]) / MANIFEST).read_text())

def stream(snap, pid):
    path = snap.path / f"chunks/gpu-{pid}-0.bin"
    return os.open(path, os.O_RDONLY)

def dump_bytes(self, root):
    d = self.snap.criu_dir(root)
    return sum(f.stat().st_size for f in d.rglob("*"))

def listing(cp):
    base = cp.images_dir
    for name in os.listdir(base):
        pass

CHUNKS_DIR = "chunks"
where = os.path.join(images_dir, "criu", "1")
"""

CLEAN = """
import os, pathlib

HELP = "streamed by the agent to chunks/gpu-<pid>-<ordinal>.bin, outside CRIU's images"

def fields(m):
    return m.get("chunks") or m["criu"]["files"]

def uses_the_object(snap, root):
    d = snap.make_criu_dir(root)
    criu.dump(root, d)
    return snap.tree_bytes(root), snap.read_manifest()

CRIU_CACHE = REPO / ".cache" / "criu"  # the CRIU program's own folder, not a snapshot's

def elsewhere(control_dir):
    for name in os.listdir(control_dir):
        pathlib.Path(control_dir, name).unlink()
    with open("/proc/self/maps") as f:
        return f.read()
"""


def test_the_checker_finds_each_offence_of_a_sample_module():
    got = findings(OFFENDING)
    lines = {line for line, _ in got}
    text = "\n".join(w for _, w in got)
    assert lines == {5, 9, 12, 15, 16, 20, 24, 27, 28}, got
    assert "snapshot name 'manifest.json'" in text
    assert "shutil.rmtree on a snapshot path" in text
    assert ".read_text() on a snapshot path" in text
    assert "snapshot name 'chunks/' in the literal 'chunks/gpu-{}-0.bin'" in text
    assert "os.open on a snapshot path" in text
    assert ".rglob() on a snapshot path" in text
    assert "os.listdir on a snapshot path" in text
    assert "snapshot directory 'criu' joined to a snapshot path" in text
    assert "snapshot directory 'chunks' given a name" in text


def test_the_checker_passes_fields_help_texts_the_object_and_other_paths():
    assert findings(CLEAN) == []

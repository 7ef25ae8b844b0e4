"""The agent's side of the workload contract (docs/workload-contract.md).

Files in the control directory, per root pid ``ROOT``, each written atomically
(``NAME.tmp`` then ``rename``):

- ``quiesce-ROOT.request`` (agent): ``{"id": str, "timeout_ms": int}``
- ``quiesce-ROOT.ready`` (workload): ``{"id": str, "ranks": [{"pid": int, ...}], ...}``
- ``quiesce-ROOT.resume`` (agent): ``{"id": str, "restored": bool, "cancelled": bool}``
"""
from __future__ import annotations

import json
import os
import pathlib
import time
import uuid
from typing import Iterable, Optional

from .errors import QuiesceRefused

POLL_S = 0.02


def file_path(control_dir: os.PathLike | str, root: int, kind: str) -> pathlib.Path:
    """``<control_dir>/quiesce-<root>.<kind>`` (kind: request, ready, resume)."""
    return pathlib.Path(control_dir) / f"quiesce-{root}.{kind}"


def write_atomic(path: pathlib.Path, obj: dict) -> None:
    """Write ``obj`` as JSON to ``path`` via ``path.tmp`` + rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def new_id() -> str:
    return uuid.uuid4().hex


def request(control_dir, roots: Iterable[int], qid: str, timeout_ms: int) -> None:
    """Write ``.request`` for every root (a stale ``.ready``/``.resume`` of the root is removed
    first so an old answer cannot be mistaken for this one)."""
    for r in roots:
        for kind in ("ready", "resume"):
            file_path(control_dir, r, kind).unlink(missing_ok=True)
        write_atomic(file_path(control_dir, r, "request"), {"id": qid, "timeout_ms": int(timeout_ms)})


def read_ready(control_dir, root: int, qid: str) -> Optional[dict]:
    """The ``.ready`` payload of ``root`` if it answers ``qid``, else None."""
    try:
        data = json.loads(file_path(control_dir, root, "ready").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("id") == qid else None


def wait_ready(control_dir, roots: Iterable[int], qid: str, timeout_ms: int) -> dict[int, dict]:
    """Wait until every root answered ``qid``; returns {root: ready payload}. On timeout
    (``timeout_ms``) cancels every root (see :func:`cancel`) and raises ``QuiesceRefused``
    naming the roots that did not answer."""
    roots = list(roots)
    deadline = time.monotonic() + timeout_ms / 1000.0
    ready: dict[int, dict] = {}
    while True:
        for r in roots:
            if r not in ready:
                got = read_ready(control_dir, r, qid)
                if got is not None:
                    ready[r] = got
        if len(ready) == len(roots):
            return ready
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    missing = [r for r in roots if r not in ready]
    cancel(control_dir, roots, qid)
    alive = [r for r in missing if os.path.exists(f"/proc/{r}")]
    why = ("did not write " + ", ".join(str(file_path(control_dir, r, "ready")) for r in missing)
           + f" within {timeout_ms} ms")
    if len(alive) < len(missing):
        why += f" (exited: {', '.join(str(r) for r in missing if r not in alive)})"
    raise QuiesceRefused("quiesce", f"workload {why}; checkpoint refused, nothing was torn down, "
                         "the workload keeps running", pid=missing[0])


def resume(control_dir, roots: Iterable[int], qid: str, *, restored: bool, cancelled: bool = False) -> None:
    """Write ``.resume`` for every root: the workload may continue."""
    for r in roots:
        write_atomic(file_path(control_dir, r, "resume"),
                     {"id": qid, "restored": bool(restored), "cancelled": bool(cancelled)})


def cancel(control_dir, roots: Iterable[int], qid: str) -> None:
    """Refuse a checkpoint before teardown: ``.resume`` with ``cancelled=true`` and remove ``.request``."""
    roots = list(roots)
    resume(control_dir, roots, qid, restored=False, cancelled=True)
    for r in roots:
        file_path(control_dir, r, "request").unlink(missing_ok=True)

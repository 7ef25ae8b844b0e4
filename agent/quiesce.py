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
from typing import Callable, Iterable, Optional

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


def pending_request(control_dir, root: int) -> Optional[str]:
    """The id of a ``.request`` of ``root`` that is still pending (no ``.resume`` answers it
    yet), else None. An unreadable request counts as pending (id "?")."""
    try:
        req = json.loads(file_path(control_dir, root, "request").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "?"
    rid = str(req.get("id")) if isinstance(req, dict) else "?"
    try:
        res = json.loads(file_path(control_dir, root, "resume").read_text())
    except (OSError, ValueError):
        res = None
    if isinstance(res, dict) and str(res.get("id")) == rid:
        return None     # answered: the workload just has not removed its files yet
    return rid


def request(control_dir, roots: Iterable[int], qid: str, timeout_ms: int) -> None:
    """Write ``.request`` for every root (a stale ``.ready``/``.resume`` of the root is removed
    first so an old answer cannot be mistaken for this one).

    One checkpoint at a time: a ``.request`` that no ``.resume`` answers yet (another agent's,
    or one left by an agent that died) is never overwritten: ``QuiesceRefused`` naming it, and
    nothing is written. The request is created with ``link`` (fails if it exists), so two
    agents cannot both win."""
    roots = list(roots)
    for r in roots:
        rid = pending_request(control_dir, r)
        if rid is not None:
            raise _busy(control_dir, r, rid)
    written = []
    try:
        for r in roots:
            for kind in ("ready", "resume", "request"):   # a request here was answered
                file_path(control_dir, r, kind).unlink(missing_ok=True)
            path = file_path(control_dir, r, "request")
            tmp = path.with_name(f"{path.name}.{qid}.tmp")
            write_atomic(tmp, {"id": qid, "timeout_ms": int(timeout_ms)})
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise _busy(control_dir, r, pending_request(control_dir, r) or "?") from None
            finally:
                tmp.unlink(missing_ok=True)
            written.append(r)
    except BaseException:
        for r in written:
            file_path(control_dir, r, "request").unlink(missing_ok=True)
        raise


def _busy(control_dir, root: int, rid: str) -> QuiesceRefused:
    return QuiesceRefused(
        "quiesce", f"{file_path(control_dir, root, 'request')} already exists (id {rid}): another "
        "checkpoint of this tree is in progress, or an agent died during one (the workload may "
        f"then be parked until {file_path(control_dir, root, 'resume')} carries that id); "
        "checkpoint refused, nothing was changed", pid=root)


def clear(control_dir, roots: Iterable[int]) -> None:
    """Remove ``.request`` and ``.ready`` of trees that are gone (killed after their dump): a
    later process reusing the root pid must not take them for a request."""
    for r in roots:
        for kind in ("request", "ready"):
            file_path(control_dir, r, kind).unlink(missing_ok=True)


def read_ready(control_dir, root: int, qid: str) -> Optional[dict]:
    """The ``.ready`` payload of ``root`` if it answers ``qid``, else None."""
    try:
        data = json.loads(file_path(control_dir, root, "ready").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("id") == qid else None


def wait_ready(control_dir, roots: Iterable[int], qid: str, timeout_ms: int,
               stop: Optional[Callable[[], Optional[str]]] = None) -> dict[int, dict]:
    """Wait until every root answered ``qid``; returns {root: ready payload}. On timeout
    (``timeout_ms``) cancels every root (see :func:`cancel`) and raises ``QuiesceRefused``
    naming the roots that did not answer. ``stop()`` is polled too: when it returns a signal
    name the wait is abandoned the same way (cancel, ``QuiesceRefused``)."""
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
        sig = stop() if stop is not None else None
        if sig:
            cancel(control_dir, roots, qid)
            raise QuiesceRefused("quiesce", f"interrupted by {sig}; checkpoint cancelled, nothing "
                                 "was torn down, the workload keeps running")
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

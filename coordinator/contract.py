"""The workload contract's files (docs/workload-contract.md), for both of its sides.

The agent writes requests and resumes, the workload writes its ready answer; both build the
same names and write them the same way through this module, so the two sides cannot drift.

Files in the control directory (``protocol.default_control_dir()`` unless given), per job root
pid ``ROOT``, each a JSON object:

- ``quiesce-ROOT.request`` (agent): ``{"id": str, "timeout_ms": int}``
- ``quiesce-ROOT.ready`` (workload): ``{"id": str, "ranks": [{"pid": int, ...}], ...}``
- ``quiesce-ROOT.resume`` (agent): ``{"id": str, "restored": bool, "cancelled": bool}``
- ``quiesce-ROOT.lock`` (agent): which agent process owns the pending request

Each side removes only files that carry the id of the request it is handling
(:func:`remove_if_id`); the workload, once it read ``.resume``, removes ``.ready`` and
``.resume`` and then ``.request`` last: the agent's next request waits for that (case 017).
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets

from .protocol import default_control_dir

__all__ = [
    "KINDS",
    "quiesce_path",
    "write_atomic",
    "read_json",
    "remove_if_id",
    "default_control_dir",
]

KINDS = ("request", "ready", "resume", "lock")


def quiesce_path(control_dir: str | os.PathLike | None, root: int, kind: str) -> pathlib.Path:
    """``<control_dir>/quiesce-<root>.<kind>``; ``kind`` is one of :data:`KINDS` (ValueError
    otherwise); ``control_dir`` None means :func:`default_control_dir`."""
    if kind not in KINDS:
        raise ValueError(f"quiesce file kind {kind!r} is not one of {', '.join(KINDS)}")
    base = os.fspath(control_dir) if control_dir is not None else default_control_dir()
    return pathlib.Path(base) / f"quiesce-{int(root)}.{kind}"


def write_atomic(path: str | os.PathLike, obj: dict) -> None:
    """Write ``obj`` as JSON to ``path`` so that a reader sees the old file or the whole new
    one: a temp file ``.<name>.<random>.tmp`` beside it, created ``O_CREAT|O_EXCL|O_NOFOLLOW``
    mode 0600 (a file or symlink planted at any name is never opened, so it never redirects the
    write), rename over ``path`` (which replaces a symlink there, never follows it); no fsync.
    OSError propagates; the temp file is removed then.

    The control directory's files describe live processes: a reader sees a renamed file at
    once through the page cache, an agent that dies leaves it for ``release``, and after a
    power loss there is no process left to coordinate. So they are not fsynced (decisions
    D33): an fsync there waits for the journal commit, which on ext4 (data=ordered) first
    writes back the dirty data of the snapshot being written (seconds at GiB sizes)."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    data = json.dumps(obj).encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        tmp = os.path.join(head, f".{name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o600)
            break
        except FileExistsError:
            continue  # someone planted this very name: draw another
    else:
        raise FileExistsError(17, "no free temporary name after 16 tries", path)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_json(path: str | os.PathLike) -> dict | None:
    """The JSON object in ``path``; None when absent, unreadable or not (yet) a JSON object."""
    try:
        with open(path) as f:
            obj = json.load(f)
        return obj if isinstance(obj, dict) else None
    except (OSError, ValueError):
        return None


def remove_if_id(path: str | os.PathLike, qid: str) -> bool:
    """Remove ``path`` when it holds a JSON object whose ``"id"`` is ``qid``; True when it was
    removed. A file of another request, an unreadable one or none is left as it is: neither
    side ever removes a file that belongs to another request (case 017)."""
    got = read_json(path)
    if got is None or str(got.get("id")) != str(qid):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True

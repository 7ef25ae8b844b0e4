"""The agent's side of the workload contract (docs/workload-contract.md).

Files in the control directory, per root pid ``ROOT``, each written atomically
(``NAME.tmp`` then ``rename``; names and the write are :mod:`cuinterpose.coordinator.contract`'s,
shared with the workload side):

- ``quiesce-ROOT.request`` (agent): ``{"id": str, "timeout_ms": int}``
- ``quiesce-ROOT.ready`` (workload): ``{"id": str, "ranks": [{"pid": int, ...}], ...}``
- ``quiesce-ROOT.resume`` (agent): ``{"id": str, "restored": bool, "cancelled": bool}``
- ``quiesce-ROOT.lock`` (agent): ``{"id": str, "pid": int, "starttime": int, "torn_down": bool,
  ...}``: the agent process that owns the pending request (so ``release`` can refuse while that
  agent is alive), and what that agent had done: the record agent/run/recover.py reads to undo
  the checkpoint of an agent that died (its fields: :func:`write_lock`)
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Callable, Iterable, Optional

from cuinterpose.agent.errors import QuiesceRefused
from cuinterpose.agent.mech import procfs, signal_at
from cuinterpose.coordinator.contract import quiesce_path, read_json, write_atomic

POLL_S = 0.02


def new_id() -> str:
    return uuid.uuid4().hex


def pending_request(control_dir, root: int) -> Optional[str]:
    """The id of a ``.request`` of ``root`` that is still pending (no ``.resume`` answers it
    yet), else None. An unreadable request counts as pending (id "?")."""
    try:
        req = json.loads(quiesce_path(control_dir, root, "request").read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "?"
    rid = str(req.get("id")) if isinstance(req, dict) else "?"
    res = read_json(quiesce_path(control_dir, root, "resume"))
    if res is not None and str(res.get("id")) == rid:
        return None  # answered: the workload just has not removed its files yet
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
            for kind in ("ready", "resume", "request"):  # a request here was answered
                quiesce_path(control_dir, r, kind).unlink(missing_ok=True)
            path = quiesce_path(control_dir, r, "request")
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
            quiesce_path(control_dir, r, "request").unlink(missing_ok=True)
        raise


def _busy(control_dir, root: int, rid: str) -> QuiesceRefused:
    owner = lock_owner(control_dir, root)
    lk = read_json(quiesce_path(control_dir, root, "lock"))
    dead = lk if not owner and isinstance(lk, dict) and lk.get("id") == rid else None
    if owner:
        who = f"a checkpoint of this tree is in progress in agent pid {owner['pid']}"
    elif dead is not None and dead.get("torn_down"):
        # case 009: `release` rolls that checkpoint back (agent/run/recover.py)
        who = (
            f"the agent (pid {dead.get('pid')}) that sent it died after it had started tearing "
            "the shared memory down (steps: " + ", ".join(map(str, dead.get("steps") or [])) + ")"
        )
    else:
        who = "another checkpoint of this tree is in progress, or an agent died during one"
    e = QuiesceRefused(
        "quiesce",
        f"{quiesce_path(control_dir, root, 'request')} already exists (id {rid}): {who}; "
        f"the workload may be parked until {quiesce_path(control_dir, root, 'resume')} carries that "
        "id; checkpoint refused, nothing was changed by this request"
        + (
            ""
            if owner
            else f". If no agent is checkpointing this tree, release it with "
            f"`cuinterpose-agent release --pid {root} --control-dir {control_dir}`"
            + (" (it rolls that checkpoint back first)" if dead and dead.get("torn_down") else "")
        ),
        pid=root,
    )
    e.hint = "this request changed nothing; the workload may be parked by the earlier request" + (
        "" if owner else f" (`cuinterpose-agent release --pid {root}` resumes it)"
    )
    return e


# -- the agent's lock: which agent process owns the pending request of a root ------------------


def write_lock(
    control_dir,
    roots: Iterable[int],
    qid: str,
    *,
    torn_down: bool = False,
    record: Optional[dict] = None,
) -> None:
    """``quiesce-ROOT.lock``: {"id", "pid" (this agent), "starttime", "torn_down"} while this
    agent owns the request of ``root`` (removed by :func:`unlock`; a SIGKILLed agent leaves it
    with a dead pid, which :func:`lock_owner` ignores). ``torn_down`` is set once the capture
    started tearing shared memory down. ``record`` (merged into the lock of the same ``qid``,
    whose other fields, e.g. ``steps``, stay): what a dead agent's checkpoint is undone from,
    (agent/run/recover.py ``lock_record``): "roots", "cuda_pids", "participants" [[pid, socket
    path]], "driver", "images_dir", "created_dirs", "phase_timeout_s", "carrier_timeout_s";
    :func:`mark_step` adds "steps", "records" {"proto", "by_pid": {pid: hex of the packed
    ``struct cui_record``s of the capture's first INSPECT}}, "last_txn_id", "tree_pids"."""
    me = os.getpid()
    for r in roots:
        path = quiesce_path(control_dir, r, "lock")
        old = read_json(path)
        keep = old if isinstance(old, dict) and old.get("id") == qid else {}
        write_atomic(
            path,
            {
                **keep,
                "id": qid,
                "pid": me,
                "starttime": procfs.starttime(me),
                "torn_down": bool(torn_down),
                **(record or {}),
            },
        )


def mark_step(control_dir, roots: Iterable[int], qid: str, step: str, **extra) -> None:
    """Append ``step`` ("capture", "capture done", "native lock", ..., "criu dump TREE") to
    the ``steps`` of this agent's ``.lock`` of every root (and merge ``extra``), so whoever
    finds the lock of a dead agent knows what it had done (case 009). A root whose lock is
    not this request's is left alone."""
    for r in roots:
        path = quiesce_path(control_dir, r, "lock")
        lk = read_json(path)
        if lk is None or lk.get("id") != qid:
            continue
        lk["steps"] = [*lk.get("steps", []), step]
        lk.update(extra)
        write_atomic(path, lk)


def abandon_lock(
    control_dir,
    roots: Iterable[int],
    qid: str,
    *,
    by: str = "checkpoint",
    why: str = "",
    last_txn_id: int = 0,
    torn_down: bool = True,
) -> None:
    """After a failed rollback the agent gives up the request but the workload stays parked on
    torn-down memory: the ``.lock`` names no owner any more (``release`` no longer waits for
    this agent, e.g. a daemon), keeps ``torn_down`` and everything a release continues the
    rollback from (the record, ``records``, ``steps``), raises ``last_txn_id`` to ``last_txn_id``
    (the failed rollback's highest txn id, so the next rollback's ids stay above it), says
    ``rollback_failed`` and adds ``abandoned`` {"pid": this process, "by": ``by``
    ("checkpoint", "release"), "why": ``why`` (the rollback's error)}. ``release`` of a lock
    with ``records`` runs the rollback again (agent/run/recover.py); without them it wants
    ``--force``. ``torn_down=False``: nothing was torn down but processes were left natively
    LOCKED (``LeftLocked``); ``release`` unlocks the lock's ``cuda_pids`` and resumes."""
    for r in roots:
        path = quiesce_path(control_dir, r, "lock")
        old = read_json(path)
        keep = old if isinstance(old, dict) and old.get("id") == qid else {}
        write_atomic(
            path,
            {
                **keep,
                "id": qid,
                "pid": None,
                "starttime": None,
                "torn_down": bool(torn_down) or bool(keep.get("torn_down")),
                "rollback_failed": True,
                "last_txn_id": max(int(keep.get("last_txn_id") or 0), int(last_txn_id or 0)),
                "abandoned": {"pid": os.getpid(), "by": str(by), "why": str(why)},
            },
        )


def unlock(control_dir, roots: Iterable[int], qid: Optional[str] = None) -> None:
    """Remove this agent's ``.lock`` of every root (only one carrying ``qid`` when given)."""
    for r in roots:
        path = quiesce_path(control_dir, r, "lock")
        if qid is not None:
            lk = read_json(path)
            if lk is None or lk.get("id") != qid:
                continue
        path.unlink(missing_ok=True)


def lock_owner(control_dir, root: int) -> Optional[dict]:
    """The ``.lock`` payload of ``root`` when the agent process it names is still alive (same
    pid and start time), else None."""
    lk = read_json(quiesce_path(control_dir, root, "lock"))
    try:
        pid = int(lk["pid"])
    except (ValueError, KeyError, TypeError):  # no lock (None), or no pid in it
        return None
    st = procfs.starttime(pid)
    if st is None or (lk.get("starttime") is not None and lk["starttime"] != st):
        return None
    return lk


def release_check(control_dir, root: int) -> tuple[str, Optional[dict]]:
    """What ``release`` of ``root`` finds: (the pending request's id, the ``.lock`` payload of
    that request or None). Refused (``QuiesceRefused``, phase "release", naming the pid) when
    there is no pending request, its id cannot be read, or a live agent owns it."""
    req = quiesce_path(control_dir, root, "request")
    rid = pending_request(control_dir, root)
    if rid is None:
        why = (
            "it was already answered by " + str(quiesce_path(control_dir, root, "resume"))
            if req.exists()
            else "there is none"
        )
        raise QuiesceRefused(
            "release", f"no pending quiesce request {req} ({why}); nothing to release", pid=root
        )
    if rid == "?":
        raise QuiesceRefused(
            "release",
            f"{req} cannot be read (no id to answer); remove it by hand if no agent is running",
            pid=root,
        )
    owner = lock_owner(control_dir, root)
    if owner is not None and int(owner["pid"]) != os.getpid():
        raise QuiesceRefused(
            "release",
            f"a checkpoint of this tree (request id {rid}) is in "
            f"progress in agent pid {owner['pid']} "
            f"({quiesce_path(control_dir, root, 'lock')}); release refused: it would "
            "resume the workload under a running checkpoint",
            pid=root,
        )
    lk = read_json(quiesce_path(control_dir, root, "lock"))
    return rid, (lk if isinstance(lk, dict) and lk.get("id") == rid else None)


def release(control_dir, root: int, *, force: bool = False) -> dict:
    """Answer the pending ``.request`` of ``root`` with ``.resume`` {"id": its id, "restored":
    false, "cancelled": true} (atomically) and remove the request and the lock, so a workload
    parked by a request no live agent will answer continues; nothing is rebuilt (the rollback
    of a dead agent's checkpoint is agent/run/recover.py's, which ``cuinterpose-agent
    release`` runs first). Returns {"pid", "request_id", "resume", "removed_lock"}. Refused
    (``QuiesceRefused`` naming the pid) as :func:`release_check`, or (without ``force``) when
    its agent died after tearing shared memory down."""
    req = quiesce_path(control_dir, root, "request")
    rid, lk = release_check(control_dir, root)
    if not force:
        if lk is not None and lk.get("torn_down"):
            who = (
                f"the agent (pid {lk['pid']}) that sent request {rid} had started tearing the "
                "shared memory down and never rebuilt it"
                if lk.get("pid") is not None
                else f"the checkpoint that sent request {rid} failed and so did its rollback: the "
                "shared memory is torn down"
            )
            steps = lk.get("steps") or []
            if steps:
                who += f" (steps it had started: {', '.join(map(str, steps))})"
            raise QuiesceRefused(
                "release",
                f"{who}: resuming the workload may run it on "
                "torn-down memory; pass --force to release it anyway",
                pid=root,
            )
    resume_path = quiesce_path(control_dir, root, "resume")
    write_atomic(resume_path, {"id": rid, "restored": False, "cancelled": True})
    req.unlink(missing_ok=True)
    lock = quiesce_path(control_dir, root, "lock")
    had_lock = lock.exists()
    lock.unlink(missing_ok=True)
    return {"pid": root, "request_id": rid, "resume": str(resume_path), "removed_lock": had_lock}


def clear(control_dir, roots: Iterable[int]) -> None:
    """Remove ``.request`` and ``.ready`` of trees that are gone (killed after their dump): a
    later process reusing the root pid must not take them for a request."""
    for r in roots:
        for kind in ("request", "ready", "lock"):
            quiesce_path(control_dir, r, kind).unlink(missing_ok=True)


def read_ready(control_dir, root: int, qid: str) -> Optional[dict]:
    """The ``.ready`` payload of ``root`` if it answers ``qid``, else None."""
    try:
        data = json.loads(quiesce_path(control_dir, root, "ready").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("id") == qid else None


def wait_ready(
    control_dir,
    roots: Iterable[int],
    qid: str,
    timeout_ms: int,
    stop: Optional[Callable[[], Optional[str]]] = None,
) -> dict[int, dict]:
    """Wait until every root answered ``qid``; returns {root: ready payload}. On timeout
    (``timeout_ms``) cancels every root (see :func:`cancel`) and raises ``QuiesceRefused``
    naming the roots that did not answer. ``stop()`` is polled too: when it returns a signal
    name the wait is abandoned the same way (cancel, ``QuiesceRefused``)."""
    roots = list(roots)
    deadline = time.monotonic() + timeout_ms / 1000.0
    ready: dict[int, dict] = {}
    signal_at.signal_point("during")  # test only: the request is out, the wait begins
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
            raise QuiesceRefused(
                "quiesce",
                f"interrupted by {sig}; checkpoint cancelled, nothing "
                "was torn down, the workload keeps running",
            )
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    missing = [r for r in roots if r not in ready]
    cancel(control_dir, roots, qid)
    alive = [r for r in missing if os.path.exists(f"/proc/{r}")]
    why = (
        "did not write "
        + ", ".join(str(quiesce_path(control_dir, r, "ready")) for r in missing)
        + f" within {timeout_ms} ms"
    )
    if len(alive) < len(missing):
        why += f" (exited: {', '.join(str(r) for r in missing if r not in alive)})"
    raise QuiesceRefused(
        "quiesce",
        f"workload {why}; checkpoint refused, nothing was torn down, the workload keeps running",
        pid=missing[0],
    )


def resume(
    control_dir, roots: Iterable[int], qid: str, *, restored: bool, cancelled: bool = False
) -> None:
    """Write ``.resume`` for every root: the workload may continue."""
    roots = list(roots)
    for r in roots:
        write_atomic(
            quiesce_path(control_dir, r, "resume"),
            {"id": qid, "restored": bool(restored), "cancelled": bool(cancelled)},
        )
    unlock(control_dir, roots, qid)


def cancel(control_dir, roots: Iterable[int], qid: str) -> None:
    """Refuse a checkpoint before teardown: ``.resume`` with ``cancelled=true`` and remove ``.request``."""
    roots = list(roots)
    resume(control_dir, roots, qid, restored=False, cancelled=True)
    for r in roots:
        quiesce_path(control_dir, r, "request").unlink(missing_ok=True)

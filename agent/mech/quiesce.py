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

One request per root at a time, and no file of one request is ever removed or overwritten on
behalf of another (case 017, decisions D55): every read-then-change of these files by an agent
runs under :func:`serial` (the control directory's ``flock``); a new request waits until the
workload took the answer to the previous one (it removes ``.request`` last, once it read
``.resume``); the agent removes a ``.request`` only while it carries its own id (a refused
request withdrawn, a dead tree's files cleared) and never removes a ``.ready`` or ``.resume``
of another id; each id is answered by one ``.resume`` write.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import pathlib
import threading
import time
import uuid
from typing import Callable, Iterable, Optional

from cuinterpose.agent.errors import QuiesceRefused
from cuinterpose.agent.mech import procfs, signal_at
from cuinterpose.coordinator.contract import quiesce_path, read_json, remove_if_id, write_atomic

POLL_S = 0.02
#: seconds an agent waits for the control directory's lock (:func:`serial`); its holders keep it
#: for a few file operations, so only a holder stopped by a signal makes anyone wait this long
SERIAL_TIMEOUT_S = 10.0
_held = threading.local()
#: (control dir, root, request id) this process has answered (:func:`_answer`): never a second
#: ``.resume`` for one id
_ANSWERED: set = set()


@contextlib.contextmanager
def serial(control_dir, timeout_s: float = SERIAL_TIMEOUT_S):
    """Hold ``flock(LOCK_EX)`` on a descriptor of ``control_dir`` (flock(2): it dies with the
    holder) while this agent reads and changes quiesce files there, so what it checked is still
    true when it writes. Re-entrant within a thread. Raises ``TimeoutError`` naming the
    directory when it stays taken for ``timeout_s`` seconds (polled every :data:`POLL_S`)."""
    key = os.fspath(control_dir)
    depth = getattr(_held, "depth", None)
    if depth is None:
        depth = _held.depth = {}
    if depth.get(key):
        depth[key] += 1
        try:
            yield
        finally:
            depth[key] -= 1
        return
    fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"the lock of control directory {key} (flock) stayed taken for "
                        f"{timeout_s:g} s: another agent holding it is stopped or hung"
                    ) from None
                time.sleep(POLL_S)
        depth[key] = 1
        try:
            yield
        finally:
            depth[key] = 0
    finally:
        os.close(fd)  # releases the flock


def _serialized(fn):
    """Run ``fn(control_dir, ...)`` under :func:`serial` of its ``control_dir``."""

    @functools.wraps(fn)
    def run(control_dir, *a, **kw):
        with serial(control_dir):
            return fn(control_dir, *a, **kw)

    return run


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
    """Write ``.request`` {"id": ``qid``, "timeout_ms"} and this agent's ``.lock``
    (:func:`write_lock`) for every root, each under :func:`serial`.

    One request per root at a time, and nothing of another request is removed:

    - a ``.request`` no ``.resume`` answers yet (pending: another agent's, or one left by an
      agent that died) refuses at once: ``QuiesceRefused`` naming it and its owner;
    - a ``.request`` its ``.resume`` answers is the previous checkpoint's, whose answer the
      workload has not taken yet (it removes the request last, once it read ``.resume``):
      waited for, up to ``timeout_ms``, then ``QuiesceRefused`` saying so;
    - a ``.ready`` or ``.resume`` without a ``.request`` is left alone: it carries an older id
      (which the workload and :func:`wait_ready` ignore), and a workload may still read it (a
      cancelled request it had seen, a restored tree's answer).

    The request is created with ``link`` (fails if it exists). On a refusal the requests
    already written for earlier roots are withdrawn; nothing else was changed."""
    roots = list(roots)
    deadline = time.monotonic() + timeout_ms / 1000.0
    written = []
    try:
        for r in roots:
            while not _try_request(control_dir, r, qid, timeout_ms):
                if time.monotonic() >= deadline:
                    raise _untaken(control_dir, r, timeout_ms)
                time.sleep(POLL_S)
            written.append(r)
    except TimeoutError as e:
        _withdraw(control_dir, written, qid)
        raise QuiesceRefused("quiesce", f"{e}; checkpoint refused, nothing was changed") from None
    except BaseException:
        _withdraw(control_dir, written, qid)
        raise


def _try_request(control_dir, root: int, qid: str, timeout_ms: int) -> bool:
    """Under :func:`serial`: create ``root``'s request and lock (True), or False while the
    previous request is answered but not yet taken; ``QuiesceRefused`` while one is pending."""
    with serial(control_dir):
        path = quiesce_path(control_dir, root, "request")
        if os.path.lexists(path):
            rid = pending_request(control_dir, root)
            if rid is None:
                return False  # answered: the workload has not removed it yet
            raise _busy(control_dir, root, rid)
        owner = lock_owner(control_dir, root)
        if owner is not None and owner.get("id") != qid:  # e.g. a restore of this tree
            lock = quiesce_path(control_dir, root, "lock")
            raise QuiesceRefused(
                "quiesce",
                f"{lock} names agent pid {owner['pid']} (id {owner.get('id')}), which is alive: a "
                "restore or checkpoint of this tree is in progress there; checkpoint refused, "
                "nothing was changed by this request",
                pid=root,
            )
        tmp = path.with_name(f"{path.name}.{qid}.tmp")
        write_atomic(tmp, {"id": qid, "timeout_ms": int(timeout_ms)})
        try:
            os.link(tmp, path)
        except FileExistsError:  # a writer that does not take the lock (not an agent)
            raise _busy(control_dir, root, pending_request(control_dir, root) or "?") from None
        finally:
            tmp.unlink(missing_ok=True)
        write_lock(control_dir, [root], qid)
        return True


def _withdraw(control_dir, roots: Iterable[int], qid: str) -> None:
    """Remove the ``.request`` and ``.lock`` of ``roots`` that carry ``qid`` (a request refused
    before any workload answered it)."""
    with serial(control_dir):
        for r in roots:
            remove_if_id(quiesce_path(control_dir, r, "request"), qid)
        unlock(control_dir, roots, qid)


def _untaken(control_dir, root: int, timeout_ms: int) -> QuiesceRefused:
    req = quiesce_path(control_dir, root, "request")
    got = read_json(req) or {}
    return QuiesceRefused(
        "quiesce",
        f"{req} (id {got.get('id', '?')}) was answered by "
        f"{quiesce_path(control_dir, root, 'resume')}, but the workload has not taken that answer "
        f"within {timeout_ms} ms (a workload removes the request once it read its .resume): it is "
        "busy resuming, hung, or does not follow docs/workload-contract.md; checkpoint refused, "
        "nothing was changed by this request",
        pid=root,
    )


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


@_serialized
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


@_serialized
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


@_serialized
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


@_serialized
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
    return _live(read_json(quiesce_path(control_dir, root, "lock")))


def _live(lk) -> Optional[dict]:
    """``lk`` (a ``.lock`` payload, or None) when the agent it names is alive, else None."""
    try:
        pid = int(lk["pid"])
    except (ValueError, KeyError, TypeError):  # no lock (None), or no pid in it
        return None
    st = procfs.starttime(pid)
    if st is None or (lk.get("starttime") is not None and lk["starttime"] != st):
        return None
    return lk


def job_busy(control_dir, pids: Iterable[int]) -> Optional[str]:
    """What holds the job of a process now, in words, else None. ``pids``: the process and its
    ancestors (the job's root is one of them); the first with a ``.lock`` or a pending
    ``.request`` in ``control_dir`` is the root. Its live agent (another process than this one)
    checkpointing or restoring it: ``a checkpoint of root R is in progress in agent pid A
    (request id I)``; its agent dead with the request pending or a restore recorded: ``the agent
    (pid A) that ran a checkpoint of root R died (request id I): run `cuinterpose-agent release
    --pid R --control-dir D``` (docs/agent.md "What each failure leaves behind").

    Decided under :func:`serial` from one read of each file: an agent that answers its request
    and removes its ``.lock`` (:func:`resume`) between two reads would otherwise look dead."""
    if not pathlib.Path(control_dir).is_dir():
        return None  # no control directory: no agent ever held a job there
    with serial(control_dir):
        return _job_busy(control_dir, pids)


def _job_busy(control_dir, pids: Iterable[int]) -> Optional[str]:
    for root in pids:
        lk = read_json(quiesce_path(control_dir, root, "lock"))
        lk = lk if isinstance(lk, dict) else None
        pending = pending_request(control_dir, root)
        if lk is None and pending is None:
            continue
        kind = "restore" if lk is not None and isinstance(lk.get("restore"), dict) else "checkpoint"
        owner = _live(lk)
        rid = (lk or {}).get("id") or pending
        if owner is not None:
            if int(owner["pid"]) == os.getpid():
                return None
            return f"a {kind} of root {root} is in progress in agent pid {owner['pid']} (request id {rid})"
        if pending is None and kind != "restore":
            return None  # a stale lock of an answered request: nothing holds the job
        who = f"the agent (pid {lk['pid']})" if lk is not None and lk.get("pid") else "the agent"
        return (
            f"{who} that ran a {kind} of root {root} died (request id {rid}), leaving it parked: "
            f"run `cuinterpose-agent release --pid {root} --control-dir {control_dir}`"
        )
    return None


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


@_serialized
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
    _answer(control_dir, root, rid, restored=False, cancelled=True)
    remove_if_id(req, rid)  # withdrawn: its workload may never have read it
    lock = quiesce_path(control_dir, root, "lock")
    had_lock = lock.exists()
    lock.unlink(missing_ok=True)
    return {"pid": root, "request_id": rid, "resume": str(resume_path), "removed_lock": had_lock}


@_serialized
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
    gone = [r for r in missing if r not in alive]
    if gone:
        why += f" (exited: {', '.join(map(str, gone))})"
    e = QuiesceRefused(
        "quiesce",
        f"workload {why}; checkpoint refused, nothing was torn down, "
        + (
            "the workload keeps running"
            if not gone
            else f"the job of root {', '.join(map(str, gone))} has exited"
        ),
        pid=missing[0],
    )
    if gone:
        e.hint = f"nothing was torn down; the job of root {', '.join(map(str, gone))} has exited"
    raise e


@_serialized
def resume(
    control_dir, roots: Iterable[int], qid: str, *, restored: bool, cancelled: bool = False
) -> None:
    """Write ``.resume`` for every root (:func:`_answer`: once per id): the workload may
    continue. The ``.request`` stays: the workload removes it once it took the answer, and
    the next :func:`request` waits for that."""
    roots = list(roots)
    for r in roots:
        _answer(control_dir, r, qid, restored=restored, cancelled=cancelled)
    unlock(control_dir, roots, qid)


@_serialized
def cancel(control_dir, roots: Iterable[int], qid: str) -> None:
    """Refuse a checkpoint before teardown: withdraw ``.request`` (while it still carries
    ``qid``: its workload may never have read it), then answer it with ``.resume``
    ``cancelled=true`` (a workload that had read it and parks takes that answer)."""
    roots = list(roots)
    for r in roots:
        remove_if_id(quiesce_path(control_dir, r, "request"), qid)
    resume(control_dir, roots, qid, restored=False, cancelled=True)


def _answer(control_dir, root: int, qid: str, *, restored: bool, cancelled: bool) -> None:
    """``.resume`` {"id": ``qid``, "restored", "cancelled"} of ``root``. A checkpoint's answer
    (``restored`` false: done, cancelled, rolled back, released) is written once per id: not
    again when this process wrote it already or a ``.resume`` carries that id. A restore's
    (``restored`` true) is always written: the restored tree is a new incarnation parked on the
    snapshot's id, which its checkpoint may have answered long ago. Call under :func:`serial`."""
    key = (os.fspath(control_dir), int(root), qid)
    path = quiesce_path(control_dir, root, "resume")
    if not restored:
        old = read_json(path)
        if key in _ANSWERED or (old is not None and old.get("id") == qid):
            return
    write_atomic(path, {"id": qid, "restored": bool(restored), "cancelled": bool(cancelled)})
    _ANSWERED.add(key)

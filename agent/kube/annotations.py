"""Pod annotations the agent reads and writes, and the decision what to do with a pod.

Requests (written by a user or a controller):

- ``cuinterpose.io/checkpoint: NAME`` — checkpoint the pod's process trees into
  ``<snapshotDir>/<namespace>/NAME``.
- ``cuinterpose.io/checkpoint-leave-running: "true"|"false"`` — optional; keep the workload
  running after the snapshot (default: the config's ``kubernetes.leaveRunning``).
- ``cuinterpose.io/restore-from: NAME`` — on a placeholder pod: restore the snapshot
  ``<snapshotDir>/<namespace>/NAME`` (same namespace only).

Results (written by the agent; ``KIND`` is ``checkpoint`` or ``restore``):

- ``cuinterpose.io/KIND-status``: ``Pending`` → ``Running`` → ``Succeeded`` | ``Failed``.
- ``cuinterpose.io/KIND-message``: one line; for Failed the agent's error
  (``"<phase>: pid N <reason>"`` and the outcome).
- ``cuinterpose.io/KIND-handled``: ``NAME@POD_UID`` of the request this pod's status is about.
- ``cuinterpose.io/snapshot``: the snapshot directory on the node (checkpoint: once Succeeded;
  restore: the directory restored from, from Running on).
- ``cuinterpose.io/snapshot-node``: the node that holds it.

Idempotency: a request is identified by ``NAME@POD_UID``. The agent writes ``-handled`` together
with ``Pending`` in one conditional patch (``metadata.resourceVersion``: a concurrent change
makes it fail with 409 and nothing runs) *before* it starts, so a repeated event, a re-list, a
second watcher or a restarted agent sees the request as handled and does not run it again.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

PREFIX = "cuinterpose.io/"
CHECKPOINT = PREFIX + "checkpoint"
LEAVE_RUNNING = PREFIX + "checkpoint-leave-running"
RESTORE_FROM = PREFIX + "restore-from"
SNAPSHOT = PREFIX + "snapshot"
SNAPSHOT_NODE = PREFIX + "snapshot-node"

PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"

#: snapshot names: one path component, DNS-subdomain-like (no "/", no "..")
NAME_RE = re.compile(r"[a-z0-9]([a-z0-9._-]{0,251}[a-z0-9])?")


def status_key(kind: str) -> str:
    return f"{PREFIX}{kind}-status"


def message_key(kind: str) -> str:
    return f"{PREFIX}{kind}-message"


def handled_key(kind: str) -> str:
    return f"{PREFIX}{kind}-handled"


REQUEST_KEY = {"checkpoint": CHECKPOINT, "restore": RESTORE_FROM}


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with one request on one pod. ``action``: ``"run"`` (claim and run it),
    ``"skip"`` (nothing to write), ``"fail"`` (write Failed with ``message`` and the handled
    marker, run nothing). ``token`` is ``NAME@UID``."""

    kind: str
    action: str
    name: str
    token: str
    message: str = ""


def annotations_of(pod: dict) -> dict:
    return (pod.get("metadata") or {}).get("annotations") or {}


def decide(pod: dict, kind: str, in_flight: frozenset = frozenset()) -> Optional[Decision]:
    """Decide for the ``kind`` ("checkpoint" or "restore") request of ``pod`` (the API's JSON
    object). Returns None when the pod carries no such request. ``in_flight`` holds the tokens
    this watcher process is running right now.

    - handled == NAME@UID and status Succeeded/Failed: a repeat → skip.
    - handled == NAME@UID, status Pending/Running, token not in flight here: the agent that
      claimed it is gone (restarted mid-run) → Failed, not retried.
    - handled == NAME@OTHER_UID: the annotations were carried over from another pod (a copied
      manifest) → stale → Failed "stale request", not run.
    - a name that is not a valid snapshot name → Failed.
    - the pod is being deleted or still Pending → skip (a later event brings it Running);
      Succeeded/Failed/Unknown → Failed, not run.
    - the pod does not set ``spec.hostPID: true`` → Failed, not run: the agent, CRIU and the
      shim's control files work with host pids, and CRIU restores a tree into the pid
      namespace it runs in (the host's), so a pod with its own pid namespace can neither be
      dumped by pid nor receive a restored tree (docs/kubernetes.md, "Opting a pod in").
    - otherwise → run.
    """
    meta = pod.get("metadata") or {}
    ann = annotations_of(pod)
    name = ann.get(REQUEST_KEY[kind])
    if name is None:
        return None
    uid = meta.get("uid", "")
    token = f"{name}@{uid}"
    handled = ann.get(handled_key(kind))
    status = ann.get(status_key(kind))
    if handled == token:
        if token in in_flight or status in (SUCCEEDED, FAILED):
            return Decision(kind, "skip", name, token)
        return Decision(
            kind,
            "fail",
            name,
            token,
            f"interrupted: the agent restarted while this {kind} was {status or 'claimed'}; "
            f"it is not retried (request a new snapshot name; the workload may be parked "
            f"or stopped, see docs/agent.md)",
        )
    if handled and handled.rsplit("@", 1)[0] == name:
        other = handled.rsplit("@", 1)[1] if "@" in handled else "?"
        return Decision(
            kind,
            "fail",
            name,
            token,
            f"stale request: {REQUEST_KEY[kind]}={name} was handled for pod uid {other}, "
            f"not this pod ({uid}); the annotations were copied from another pod. "
            f"Not run: set a new snapshot name to request a {kind}",
        )
    if meta.get("deletionTimestamp"):
        return Decision(kind, "skip", name, token)
    if not NAME_RE.fullmatch(name):
        return Decision(
            kind,
            "fail",
            name,
            token,
            f"request: {name!r} is not a snapshot name (lower-case letters, digits, "
            f"'.', '_', '-'; one path component)",
        )
    phase = (pod.get("status") or {}).get("phase")
    if phase in (None, "Pending"):
        return Decision(kind, "skip", name, token)  # wait: a later event brings it Running
    if phase != "Running":
        return Decision(
            kind,
            "fail",
            name,
            token,
            f"request: pod is {phase or 'without a phase'}, not Running; nothing was done",
        )
    if (pod.get("spec") or {}).get("hostPID") is not True:
        what = "checkpointed" if kind == "checkpoint" else "restored into"
        return Decision(
            kind,
            "fail",
            name,
            token,
            f"request: pod {meta.get('namespace')}/{meta.get('name')} does not set "
            f"spec.hostPID: true; a pod with its own PID namespace cannot be {what} "
            "(the agent, CRIU and the shim's control files use host pids; see "
            "docs/kubernetes.md); nothing was done",
        )
    return Decision(kind, "run", name, token)

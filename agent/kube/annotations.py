"""Pod annotations the agent reads and writes, and the decision what to do with a pod.

Requests (written by a user or a controller):

- ``cuinterpose.io/checkpoint: NAME`` — checkpoint the pod's process trees into
  ``<snapshotDir>/<namespace>/NAME``.
- ``cuinterpose.io/restore-from: NAME`` — on a placeholder pod: restore the snapshot
  ``<snapshotDir>/<namespace>/NAME`` (same namespace only).

Options (:func:`option_values`): ``cuinterpose.io/KIND-OPTION: VALUE`` sets the option
``OPTION`` (its command-line flag without the dashes: ``leave-running``, ``gpu-storage``,
``carrier-timeout-s``, ...; agent/options.py) of the pod's ``KIND`` request, as the same flag
of ``cuinterpose-agent KIND`` does (a flag option: ``"true"``/``"false"``).
``cuinterpose.io/checkpoint-leave-running`` defaults to the config's
``kubernetes.leaveRunning``. Options of the node (``driver``, ``native-backend``,
``control-dir``) are the agent's config's, not a pod's. An unknown option or a bad value fails
the request, naming the annotation and the pod, before anything is done.

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
#: the ``cuinterpose.io/KIND-*`` keys that are no option: the request and its result
NOT_OPTIONS = ("from", "status", "message", "handled")


def option_key(kind: str, name: str) -> str:
    """The annotation of option ``name`` of a ``kind`` request:
    ``cuinterpose.io/checkpoint-carrier-timeout-s``."""
    return f"{PREFIX}{kind}-{name.replace('_', '-')}"


LEAVE_RUNNING = option_key("checkpoint", "leave_running")


def option_values(pod: dict, kind: str) -> dict:
    """The options the annotations of ``pod`` set for its ``kind`` request: {option name:
    typed value} (each checked on its own; agent/options.py). Raises ``OptionError`` (phase
    "request", refused) naming the pod, the annotation and its value: an option that is not
    one of ``kind`` or not one a pod may set (a node's), or a bad value."""
    from cuinterpose.agent.options import BY_KIND, OptionError, annotated_fields

    cls = BY_KIND[kind]
    allowed = annotated_fields(cls)
    meta = pod.get("metadata") or {}
    where = f"pod {meta.get('namespace')}/{meta.get('name')}: annotation"
    head = f"{PREFIX}{kind}-"
    out = {}
    for key, text in sorted(annotations_of(pod).items()):
        if not key.startswith(head) or key[len(head) :] in NOT_OPTIONS:
            continue
        name = key[len(head) :].replace("-", "_")
        if name not in allowed:
            known = ", ".join(option_key(kind, n) for n in allowed)
            why = (
                "is set by the agent's config, not by a pod"
                if name in cls.names()
                else f"is not an option of a {kind} (known: {known})"
            )
            raise OptionError(name, text, why, f"{where} {key}")
        out[name] = cls.parse_text(name, str(text), f"{where} {key}")
    return out


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
    - a name that is not a valid snapshot name, or an option annotation of the request that
      is unknown or bad (:func:`option_values`) → Failed.
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
    from cuinterpose.agent.options import OptionError

    try:
        option_values(pod, kind)
    except OptionError as e:
        return Decision(kind, "fail", name, token, f"{e}; nothing was done")
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

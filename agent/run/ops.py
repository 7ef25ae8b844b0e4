"""The bodies of the agent's commands, shared by the one-shot CLI (in-process), the gRPC
service (``serve``) and the pod watcher (agent/kube): each calls these with the options object
it built once (agent/options.py), so ``--agent ADDR`` and a pod's annotations run exactly the
code a local command runs.

Each function takes a :class:`~cuinterpose.agent.run.report.Reporter` (progress rows go to its
sinks) and returns the JSON object the CLI prints with ``--json`` on success, or raises
``AgentError`` whose ``to_dict()`` is the ``error`` object of a failure (``outcome`` says what
was left behind; docs/agent.md). A bug (any other exception) is turned into an ``AgentError``
naming the phase that was running, with outcome ``rollback_failed`` (checkpoint) or
``restore_failed`` (restore): the workload's state is then unknown.
"""

from __future__ import annotations

import json
from typing import Optional

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.options import CheckpointOptions, InspectOptions, RestoreOptions
from cuinterpose.agent.run.report import Reporter
from cuinterpose.agent.run.steps import unexpected
from cuinterpose.agent.snapshot import snapdir
from cuinterpose.agent.snapshot.snapdir import SnapshotDir


def _failed_total(rep: Reporter) -> None:
    """A run that stopped still ends its table with a total that is the sum of its rows
    (docs/agent.md: every second belongs to a row; without it the live table showed its own
    wall time, start-up included)."""
    if rep.phases:
        rep.total(rep.covered_ns(), "stopped: see the error")


def checkpoint(
    rep: Reporter,
    roots,
    images_dir,
    options: Optional[CheckpointOptions] = None,
    remote=None,
    cancel=None,
    **changes,
) -> tuple[dict, dict]:
    """Checkpoint ``roots`` into ``images_dir`` with ``options`` (``changes``: option names
    set on them, as ``Checkpoint`` takes them; ``remote``: agent/run/remote.py ``Remote`` of an
    ``s3://`` images dir, whose local copy is then where the checkpoint writes before its
    upload; ``cancel``: agent/run/interrupt.py ``Cancel`` that stops it like a signal).
    Returns (the CLI's JSON object, the manifest dict); with ``remote`` the object's
    ``images_dir`` is the location and it has ``local_dir``, ``local_kept`` and ``upload``
    (agent/run/upload.py ``result``)."""
    from cuinterpose.agent.run import upload
    from cuinterpose.agent.run.checkpoint import Checkpoint

    local = remote.local_dir if remote is not None else images_dir
    cp = Checkpoint(roots, local, options, reporter=rep, remote=remote, cancel=cancel, **changes)
    try:
        m = cp.run()
    except AgentError:
        _failed_total(rep)
        raise
    except Exception as e:
        raise unexpected(
            rep,
            e,
            "checkpoint",
            prefix="unexpected ",
            outcome="rollback_failed",
            tail="; workload state unknown",
        ) from e
    return (
        {
            "ok": True,
            "images_dir": str(cp.images_dir),
            "snapshot_id": m["snapshot_id"],
            "roots": m["roots"],
            "cuda_pids": m["cuda_pids"],
            "phases": rep.to_list(),
            "totals": m["totals"],
            "shim_sha256": m["shim"]["sha256"],
            "warnings": m.get("warnings", []),
            **upload.result(cp),
        },
        m,
    )


def restore(
    rep: Reporter, images_dir, options: Optional[RestoreOptions] = None, remote=None, **kw
) -> dict:
    """Restore the snapshot in ``images_dir`` with ``options`` (``kw``: ``Restore``'s
    ``placement``, ``device_map`` and ``cancel``, or option names set on ``options``; ``remote``:
    agent/run/remote.py ``Remote`` of an ``s3://`` images dir, downloaded into its local copy
    first, which goes again afterwards unless kept). With ``remote`` the object has
    ``images_dir`` (the location), ``local_dir``, ``local_kept`` and ``download``
    (agent/run/download.py ``result``)."""
    from cuinterpose.agent.run import download
    from cuinterpose.agent.run.restore import Restore

    local = remote.local_dir if remote is not None else images_dir
    rs = Restore(local, options, reporter=rep, remote=remote, **kw)
    try:
        res = rs.run()
    except AgentError:
        _failed_total(rep)
        raise
    except Exception as e:
        raise unexpected(rep, e, "restore", prefix="unexpected ", outcome="restore_failed") from e
    finally:
        rs.release_store()
    return {"ok": True, **res, **download.result(rs)}


def inspect(pid: int, options: Optional[InspectOptions] = None) -> dict:
    """INSPECT one process (read-only) and ask the driver for its checkpoint state: {"ok":
    true, "pid", "socket_path", "phase", "records", ..., "native"} (agent/inspect.py)."""
    from cuinterpose.agent.inspect import inspect_pid, native_state

    o = options or InspectOptions()
    res = inspect_pid(pid, control_dir=o.control_dir, timeout_s=o.phase_timeout_s)
    return {"ok": True, **res, "native": native_state(pid, o)}


def list_snapshots(directory, storage=None) -> dict:
    """Snapshots directly under ``directory`` (sub-directories holding ``manifest.json``,
    sorted by name; ``directory`` itself when it holds one): {"ok": true, "dir",
    "snapshots": [{"images_dir", "snapshot_id", "created_at", "roots", "image_bytes",
    "carrier_bytes", "driver", "native", "error"}]}; ``native``: the native backend that took
    it ("driver-api", "cuda-checkpoint"; "" for a manifest from before the record). A manifest
    that cannot be read is listed with ``error`` set. Raises ``AgentError`` (phase "snapshots")
    when ``directory`` cannot be read. ``s3://BUCKET/PREFIX``: the snapshots of the bucket under
    that prefix (:func:`_list_remote`; ``storage``: the ``StorageOptions`` reaching it)."""
    from cuinterpose.agent.snapshot import backends

    if backends.is_remote(str(directory)):
        return _list_remote(str(directory), storage)
    top = SnapshotDir.canonical(directory)
    d = top.path
    try:
        # the path is itself a snapshot: list that one
        subs = [top] if top.has_manifest() else snapdir.children(d)
    except OSError as e:
        raise AgentError("snapshots", f"{d} cannot be read: {e.strerror or e}") from None
    out = []
    for snap in subs:
        if not snap.has_manifest():
            continue
        row = {
            "images_dir": str(snap.path),
            "snapshot_id": "",
            "created_at": "",
            "roots": [],
            "image_bytes": 0,
            "carrier_bytes": 0,
            "driver": "",
            "native": "",
            "error": "",
        }
        try:
            m = json.loads(snap.read_manifest())
            row.update(
                snapshot_id=str(m["snapshot_id"]),
                created_at=str(m["created_at"]),
                roots=[int(r) for r in m["roots"]],
                image_bytes=int(m.get("totals", {}).get("image_bytes", 0)),
                carrier_bytes=int(m.get("totals", {}).get("carrier_bytes", 0)),
                driver=str(m["driver"]["kind"]),
                native=str((m.get("native") or {}).get("backend", "")),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            row["error"] = f"{type(e).__name__}: {e}"
        out.append(row)
    return {"ok": True, "dir": str(d), "snapshots": out}


def _list_remote(root: str, storage) -> dict:
    """:func:`list_snapshots` of ``s3://BUCKET[/PREFIX]``: the prefix itself when it is a
    snapshot, else the snapshots directly under it (agent/snapshot/backends ``list_snapshots``);
    a manifest that is not JSON refuses the listing (``StorageError`` phase "list")."""
    from cuinterpose.agent.snapshot import backends
    from cuinterpose.agent.snapshot.backends.api import StorageError, parse_location

    loc = parse_location(root, root=True)
    found = []
    if loc.key:
        try:
            found = [backends.stat(str(loc), storage)]
        except StorageError as e:
            if "no manifest" not in e.reason:
                raise
    if not found:
        found = backends.list_snapshots(str(loc), storage)
    rows = [
        {
            "images_dir": i.location,
            "snapshot_id": i.snapshot_id,
            "created_at": i.created_at,
            "roots": [int(r) for r in i.roots],
            "image_bytes": i.image_bytes,
            "carrier_bytes": i.carrier_bytes,
            "driver": i.driver,
            "native": i.native,
            "error": "",
        }
        for i in found
    ]
    return {"ok": True, "dir": str(loc), "snapshots": rows}


def delete_snapshot(images_dir, storage=None) -> dict:
    """Delete one snapshot and free the chunks nothing else refers to. A local directory:
    agent/snapshot/store.py ``delete`` ({"ok", "deleted", "packs_removed", "packs_kept",
    "pack_bytes_freed", "pinned"}); ``s3://BUCKET/PREFIX``: its manifest first, then its other
    objects, then the bucket's chunks no manifest or pin names ({"ok", "deleted",
    "objects_removed", "chunks_removed", "chunks_kept", "chunk_bytes_freed", "pins"};
    agent/snapshot/backends/s3gc.py). Raises ``AgentError`` (nothing removed) when it is no
    snapshot or the chunks' references cannot all be read."""
    from cuinterpose.agent.snapshot import backends, store

    if not backends.is_remote(str(images_dir)):
        return {"ok": True, **store.delete(images_dir)}
    r = backends.delete(str(images_dir), storage)
    return {
        "ok": True,
        "deleted": r.location,
        "objects_removed": r.objects_removed,
        "chunks_removed": r.chunks_removed,
        "chunks_kept": r.chunks_kept,
        "chunk_bytes_freed": r.chunk_bytes_freed,
        "pins": list(r.pins),
    }


def error_from_dict(d: dict, default_outcome: Optional[str] = None) -> AgentError:
    """Rebuild an ``AgentError`` from its ``to_dict()`` (as carried by the service), keeping
    phase, pid, reason and outcome so that the CLI prints and exits exactly as in-process."""
    e = AgentError(
        d.get("phase") or "agent",
        d.get("reason") or "",
        pid=d.get("pid"),
        outcome=d.get("outcome") or default_outcome,
    )
    if d.get("node"):
        e.node = d["node"]
    msg = d.get("message")
    if msg:
        e.args = (msg,)
    return e

"""What a checkpoint's manifest says: :func:`build_manifest` (written last by the ``manifest``
step) and the dump's check (:func:`check_dumped`). The snapshot directory itself (its
creation and claim, every file in it, the removal of a rolled-back dump) is
agent/snapshot/snapdir.py's; the format is in docs/snapshot-format.md.
"""

from __future__ import annotations

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.snapshot import manifest as manifest_mod
from cuinterpose.agent.snapshot.snapdir import criu_rel


def shim_version() -> dict:
    """{"package": cuinterpose version, "protocol": CUI_PROTO_VERSION}."""
    try:
        from importlib.metadata import version

        pkg = version("cuinterpose")
    except Exception:
        pkg = "unknown"
    try:
        from cuinterpose.coordinator.protocol import CUI_PROTO_VERSION

        proto = CUI_PROTO_VERSION
    except Exception:
        proto = None
    return {"package": pkg, "protocol": proto}


def build_manifest(cp) -> dict:
    """The manifest of :class:`~cuinterpose.agent.run.checkpoint.Checkpoint` ``cp`` once every
    tree is dumped and the ``sync`` phase ran: ``criu.files`` are the digests that phase
    computed (``cp.image_files``: each image hashed once; one serial pass here only when the
    phase did not run), ``phases`` the rows that ended."""
    files = getattr(cp, "image_files", None)
    if files is None:
        files = manifest_mod.image_files(cp.images_dir)
    cap = cp.capture.to_dict() if hasattr(cp.capture, "to_dict") else cp.capture
    records = _records_by_pid_from_capture(cp.capture)
    criu_version = None
    try:
        from cuinterpose.agent.mech import criu

        criu_version = criu.version()
    except Exception as e:  # the dump worked, so this is cosmetic
        criu_version = f"unknown ({e})"
    return {
        "format": manifest_mod.FORMAT,
        "format_version": manifest_mod.FORMAT_VERSION,
        "snapshot_id": cp.qid,
        "created_at": manifest_mod.utc_now(),
        "checkpoint_started_at": cp.started_at,
        "shim": {
            "path": cp.census.shim.path,
            "sha256": cp.census.shim.sha256,
            "size": cp.census.shim.size,
            "version": shim_version(),
        },
        "driver": cp.driver.to_dict(),
        "criu": {
            "version": criu_version,
            "leave_running": cp.options.leave_running,
            "trees": {str(r): criu_rel(r) for r in cp.roots},
            "files": files,
        },
        "roots": cp.roots,
        "control_dir": cp.control_dir,
        "cuda_pids": cp.census.cuda_pids,
        "participants": [
            {
                "pid": p.pid,
                "comm": p.comm,
                "socket_path": p.socket_path,
                "cuda_state": p.cuda_state,
                "roles": manifest_mod.role_counts(records.get(p.pid, [])),
                **manifest_mod.gpu_fields(p),
            }
            for p in cp.census.participants
        ],
        "processes": [{"pid": p.pid, "ppid": p.ppid, "comm": p.comm} for p in cp.census.processes],
        "quiesce": {
            "id": cp.qid,
            "timeout_ms": cp.options.quiesce_timeout_ms,
            "ready": {str(k): v for k, v in cp.ready.items()},
        },
        "capture": cap,
        "carriers": list(
            getattr(cp.capture, "carriers", None) or manifest_mod.carriers_from_capture(cap)
        ),
        "phases": [p for p in cp.r.to_list() if p["status"] != "running"],
        "totals": {
            "carrier_bytes": _capture_bytes(cp.capture),
            "image_bytes": sum(f["bytes"] for f in files.values()),
            **cp.totals_times(),
        },
        "warnings": list(cp.warnings)
        + [w for r in cp.roots for w in cp.external_warnings.get(r, [])],
        "external_pipes": list(cp.external_pipes),
        "external_files": list(cp.external_files),
        "namespaces": [
            {
                "root": r,
                **{k: int(cp.tree_ns[r][k]) for k in ("net", "uts", "ipc")},
                "external_net": cp.tree_ns[r].get("external_net", ""),
                **(
                    {
                        "mnt": int(cp.tree_ns[r]["mnt"]),
                        "foreign_mnt": bool(cp.tree_ns[r].get("foreign_mnt")),
                    }
                    if "mnt" in cp.tree_ns[r]
                    else {}
                ),
            }
            for r in cp.roots
            if r in cp.tree_ns
        ],
        **({"group": cp.group} if cp.group else {}),
    }


def _records_by_pid_from_capture(capture) -> dict[int, list]:
    if capture is None:
        return {}
    d = capture.to_dict() if hasattr(capture, "to_dict") else capture
    return (
        {pid: recs for pid, recs in manifest_mod._records_by_pid(d)} if isinstance(d, dict) else {}
    )


def _capture_bytes(capture) -> int:
    """Carrier bytes held by a capture (sum over creator carriers), 0 if unknown."""
    if capture is None:
        return 0
    for attr in ("carrier_bytes", "bytes"):
        v = getattr(capture, attr, None)
        if isinstance(v, int):
            return v
    d = capture.to_dict() if hasattr(capture, "to_dict") else capture
    return sum(c["bytes"] for c in manifest_mod.carriers_from_capture(d))


def check_dumped(census, tree_pids: dict, root: int, d, alive) -> None:
    """Case 010: every census process of tree ``root`` must be in the dump's process tree
    image (``pstree.img``) and still alive (not gone, not a zombie) once the dump ended;
    a rank that died as CRIU started is otherwise missing from a snapshot whose manifest
    lists it. ``tree_pids``: {root: pids read before its dump}; ``alive(pid)``: not gone, not a
    zombie. Raises ``AgentError`` (phase "criu dump", the pid named): rolled back."""
    from cuinterpose.agent.mech import criu_images

    try:
        dumped = set(criu_images.image_pids(d))
    except Exception as e:
        raise AgentError("criu dump", f"tree {root}: {e}", pid=root) from e
    tree = set(tree_pids.get(root, [])) | {root}
    for p in census.processes:
        if p.pid not in tree:
            continue
        why = None
        if p.pid not in dumped:
            why = f"is not in the dump's process tree image {d / 'pstree.img'}"
        elif not alive(p.pid):
            why = "exited during the dump"
        if why:
            raise AgentError(
                "criu dump",
                f"({p.comm}) of tree {root} {why}: the snapshot would miss it; "
                "checkpoint failed, rolling back what is left of the workload",
                pid=p.pid,
            )


def preflight() -> None:
    """What a checkpoint reads later that is no option of it, checked before anything changes
    (issue 23): the node key (``trust.node_key``: a key file that cannot be read) and the
    coordinator's test hook ``$CUINTERPOSE_TEST_DROP_REPLY``. Raises ``AgentError`` (phase
    "request", refused) naming it. The options were checked when they were built
    (agent/options.py)."""
    from cuinterpose.agent.snapshot import trust
    from cuinterpose.coordinator import client

    for check in (trust.node_key, client.drop_reply_spec):
        try:
            check()
        except (AgentError, ValueError) as e:
            reason = getattr(e, "reason", None) or str(e)
            raise AgentError(
                "request", f"{reason}; checkpoint refused before anything was changed"
            ) from e

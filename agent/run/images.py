"""What a checkpoint writes into its images directory: the directory's acceptance and claim
(:func:`prepare_dir`), the manifest's contents (:func:`build_manifest`, written last by the
``manifest`` step) and the removal of a rolled-back dump (:func:`cleanup`). The format is in
docs/snapshot-format.md.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat

from cuinterpose.agent import paths
from cuinterpose.agent.errors import AgentError, SnapshotError
from cuinterpose.agent.snapshot import dirclaim
from cuinterpose.agent.snapshot import manifest as manifest_mod


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


#: directories of a snapshot: private to the agent's user (case 016)
DIR_MODE = 0o700


def prepare_dir(
    images_dir: os.PathLike | str, *, run_id: str = "", group: str = ""
) -> tuple[pathlib.Path, list[pathlib.Path], dirclaim.DirClaim, list[str]]:
    """Create and claim the snapshot directory; returns (its canonical path
    (``paths.canonical``), the directories this call created, outermost first, so that a
    refused checkpoint can remove them again, this run's
    :class:`~cuinterpose.agent.snapshot.dirclaim.DirClaim` (``run_id``, ``group``: the run it
    names), notes for the operator).

    Missing directories are created 0700. Only a new or empty directory is accepted, and it is
    claimed before it is judged empty (agent/snapshot/dirclaim.py), so two runs racing for one
    directory cannot both pass. An existing directory open to group or other is made 0700
    (a note says so). Refused (``SnapshotError``, phase "images dir", before anything is asked
    of the workload, what this call created removed again): a directory that already holds a
    snapshot (``manifest.json``) or anything else (a checkpoint never writes among other
    files, and a rollback removes ``criu/``), one another live run has claimed (naming it), a
    path that is not a directory, one that cannot be created or written."""
    d = pathlib.Path(paths.canonical(images_dir))
    if os.path.lexists(d) and not d.is_dir():
        raise SnapshotError("images dir", f"{d} is not a directory")
    if (d / manifest_mod.MANIFEST_NAME).exists():
        raise SnapshotError(
            "images dir",
            f"{d} already holds a snapshot "
            f"({manifest_mod.MANIFEST_NAME}); choose a new --images-dir",
        )
    created = _make_dirs(d)
    notes = []
    try:
        claim = dirclaim.DirClaim(d, run_id=run_id, group=group)
        try:
            names = dirclaim.foreign(os.listdir(d))
            if names:
                shown = ", ".join(names[:5]) + (
                    f", … ({len(names)} entries)" if len(names) > 5 else ""
                )
                raise SnapshotError(
                    "images dir",
                    f"{d} is not empty ({shown}); a checkpoint writes "
                    "only into a new or empty directory: choose a new --images-dir",
                )
            st = os.stat(d)
            if st.st_mode & 0o077:
                os.chmod(d, DIR_MODE)
                notes.append(
                    f"images dir {d} had mode {stat.S_IMODE(st.st_mode):04o}: made "
                    f"{DIR_MODE:04o} (a snapshot holds the memory of the processes: it is "
                    "private to the agent's user)"
                )
        except BaseException:
            claim.release()
            raise
    except OSError as e:
        remove_empty(created)
        raise SnapshotError("images dir", f"{d} cannot be read: {e.strerror or e}") from None
    except BaseException:
        remove_empty(created)
        raise
    return d, created, claim, notes


def _make_dirs(d: pathlib.Path) -> list[pathlib.Path]:
    """Create ``d`` and its missing parents, each ``DIR_MODE`` (``mkdir`` one at a time, so
    only those this call made are returned, outermost first); ``SnapshotError`` when one
    cannot be created (those made are removed again)."""
    todo = []
    p = d
    while not os.path.lexists(p) and p != p.parent:
        todo.insert(0, p)
        p = p.parent
    created = []
    for p in todo:
        try:
            os.mkdir(p, DIR_MODE)
            created.append(p)
        except FileExistsError:
            continue  # another run made it meanwhile: not ours to remove
        except OSError as e:
            remove_empty(created)
            raise SnapshotError("images dir", f"{d} cannot be created: {e.strerror or e}") from None
    return created


def remove_empty(dirs: list[pathlib.Path]) -> None:
    """rmdir ``dirs`` innermost first, stopping at the first that is not empty."""
    for p in reversed(dirs):
        try:
            p.rmdir()
        except OSError:
            return


def cleanup(images_dir) -> None:
    """Remove what a rolled-back dump left in ``images_dir``: the CRIU images and a manifest
    temporary file."""
    d = pathlib.Path(images_dir) / manifest_mod.CRIU_DIR
    shutil.rmtree(d, ignore_errors=True)
    tmp = pathlib.Path(images_dir) / (manifest_mod.MANIFEST_NAME + ".tmp")
    try:
        if tmp.is_file():
            tmp.unlink()
    except OSError:
        pass


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
            "trees": {str(r): str(manifest_mod.criu_dir("", r)) for r in cp.roots},
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

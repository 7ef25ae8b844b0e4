"""What a checkpoint writes into its images directory: the directory's acceptance
(:func:`prepare_dir`), the manifest's contents (:func:`build_manifest`, written last by the
``manifest`` step) and the removal of a rolled-back dump (:func:`cleanup`). The format is in
docs/snapshot-format.md.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

from cuinterpose.agent.errors import SnapshotError
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


def prepare_dir(images_dir: os.PathLike | str) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """Create the snapshot directory; returns (its absolute path, the directories this call
    created, outermost first, so that a refused checkpoint can remove them again).

    Only a missing or an empty, writable directory is accepted. Refused (``SnapshotError``,
    phase "images dir", before anything is asked of the workload): a directory that already
    holds a snapshot (``manifest.json``) or anything else (a checkpoint never writes among
    other files, and a rollback removes ``criu/``), a path that is not a directory, one that
    cannot be created or written."""
    d = pathlib.Path(os.path.abspath(images_dir))
    if d.exists() or d.is_symlink():
        if not d.is_dir():
            raise SnapshotError("images dir", f"{d} is not a directory")
        if (d / manifest_mod.MANIFEST_NAME).exists():
            raise SnapshotError(
                "images dir",
                f"{d} already holds a snapshot "
                f"({manifest_mod.MANIFEST_NAME}); choose a new --images-dir",
            )
        try:
            names = sorted(p.name for p in d.iterdir())
        except OSError as e:
            raise SnapshotError("images dir", f"{d} cannot be read: {e.strerror}") from None
        if names:
            shown = ", ".join(names[:5]) + (f", … ({len(names)} entries)" if len(names) > 5 else "")
            raise SnapshotError(
                "images dir",
                f"{d} is not empty ({shown}); a checkpoint writes "
                "only into a new or empty directory: choose a new --images-dir",
            )
        created = []
    else:
        created = []
        p = d
        while not (p.exists() or p.is_symlink()) and p != p.parent:
            created.insert(0, p)
            p = p.parent
        try:
            d.mkdir(parents=True)
        except OSError as e:
            remove_empty(created)
            raise SnapshotError("images dir", f"{d} cannot be created: {e.strerror or e}") from None
    try:
        tempfile.TemporaryFile(dir=d).close()
    except OSError as e:
        remove_empty(created)
        raise SnapshotError("images dir", f"{d} is not writable: {e.strerror or e}") from None
    return d, created


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
            "leave_running": cp.leave_running,
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
            "timeout_ms": cp.quiesce_timeout_ms,
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

"""The checkpoint's ``upload`` step: a snapshot taken with ``--images-dir s3://BUCKET/PREFIX``
goes into the object store before its trees are killed or resumed (decisions D67;
docs/agent.md "Checkpoint into an object store").

The checkpoint writes its local copy as always (agent/run/remote.py says where), then:

1. ``images dir`` (:func:`prepare`, before anything changes): the store is asked whether a
   snapshot is at the location already (a HEAD of its manifest). A snapshot there, a 403, an
   unreachable endpoint or a local copy left by an earlier checkpoint refuse the checkpoint
   (outcome ``refused``, phase ``upload``, naming the bucket and key), nothing torn down.
2. ``sync`` (:func:`sync_step`): the push's first half starts in the background
   (agent/snapshot/backends/s3push.py ``Push.begin``): the chunk streams of the capture and of
   native GPU storage, complete since the capture and the native checkpoint, are pinned and
   the chunks the bucket lacks are sent while the sync fsyncs and hashes the images.
3. ``upload`` (:func:`upload_step`, after ``manifest``, before ``finish``): the push's second
   half: the chunks left, the CRIU images, the manifest last (the commit point); a row with
   progress (bytes, rate). The trees are still stopped here.

A failed upload (endpoint down, 403, 5xx after the retries, a truncated answer, a signal) is a
failed checkpoint: the workload is rebuilt and resumed as after a failed sync (outcome
``rolled_back``, ``.resume`` with ``restored=false``), whether it was to be killed or left
running, and the local snapshot, complete, stays where it is; the bucket holds no manifest
(the push removed its images and pins; the chunks it sent wait for a collection). In a group
the leader's ``rollback`` undoes every member as after any group failure, and a member whose
upload had committed deletes its snapshot from the bucket again (:func:`withdraw`). Once the
run is over (:func:`end`), a committed snapshot's local copy is removed unless ``--keep-local``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional

from cuinterpose.agent.errors import AgentError, CheckpointFailed
from cuinterpose.agent.run import durable
from cuinterpose.agent.run.report import fmt_bytes
from cuinterpose.agent.snapshot import backends, chunks, snapdir, store
from cuinterpose.agent.snapshot.backends.api import Progress, PushResult, StorageError

UPLOAD_PHASE = "upload"
#: how often the upload looks at the signal guard while it runs (seconds)
GUARD_POLL_S = 0.05


class Upload:
    """The upload of one checkpoint: ``remote`` (agent/run/remote.py ``Remote``), its push
    session, the ``upload`` row once it runs, what the first half had done when the row began,
    and ``committed`` (the ``PushResult``, None until the manifest is in the store)."""

    def __init__(self, cp, remote):
        self.cp, self.remote = cp, remote
        self.push = backends.begin_push(
            remote.location, dataclasses.replace(remote.storage, progress=self._progress)
        )
        self.row = None
        self.last: Optional[Progress] = None
        self.base = 0
        self.started = False
        self.committed: Optional[PushResult] = None
        self.dropped = False
        #: the signal that cancelled the upload (None: none)
        self.interrupted: Optional[str] = None
        self.lock = threading.Lock()

    def _progress(self, p: Progress) -> None:
        with self.lock:
            self.last, row, base = p, self.row, self.base
        if row is not None:
            self.cp.r.progress(row, p.done_bytes - base, p.total_bytes - base, final=p.final)


def prepare(cp) -> None:
    """Step ``images dir`` of a checkpoint into an object store (nothing for a local one):
    refuse a local directory that holds a snapshot already, then ask the store (module
    docstring). Raises ``AgentError``/``StorageError`` (outcome refused), nothing changed."""
    remote = getattr(cp, "remote", None)
    if remote is None:
        return
    if snapdir.SnapshotDir(remote.local_dir).exists(snapdir.MANIFEST):
        raise AgentError(
            UPLOAD_PHASE,
            f"the local copy {remote.local_dir} of a checkpoint to {remote.location} holds a "
            "snapshot already (one whose upload failed, or kept with --keep-local): "
            f"`cuinterpose-agent delete {remote.local_dir}` or pass another --local-dir; "
            "checkpoint refused before anything was changed",
        )
    up = Upload(cp, remote)
    try:
        up.push.check_free()
    except StorageError as e:
        raise e.again(UPLOAD_PHASE, "; checkpoint refused before anything was changed") from None
    cp.upload = up


def _streams(cp) -> dict:
    """The ``chunks`` and ``gpu_storage`` records as the manifest will hold them."""
    cap = cp.capture.to_dict() if hasattr(cp.capture, "to_dict") else cp.capture
    out = {}
    ch = chunks.from_capture(cap) if isinstance(cap, dict) else {}
    if ch.get("streams"):
        out["chunks"] = ch
    if getattr(cp, "gpu_storage", None):
        out["gpu_storage"] = cp.gpu_storage
    return out


def sync_step(cp) -> None:
    """The checkpoint's ``sync`` step (agent/run/durable.py ``sync_step``), the push's first
    half running meanwhile for a checkpoint into an object store."""
    up = getattr(cp, "upload", None)
    if up is not None and not up.started:
        up.started = True
        up.push.begin(cp.images_dir, _streams(cp))
    durable.sync_step(cp)


def _interrupted(cp, up: Upload) -> bool:
    """A signal the checkpoint's guard holds cancels the push (the step fails, rolled back)."""
    sig = cp.guard.pending()
    if sig and up.interrupted is None:
        up.interrupted = sig
        cp.r.note(f"upload: {sig} received: the upload is cancelled and rolled back")
        up.push.cancel()
    return bool(sig)


def _watch_guard(cp, up: Upload, done: threading.Event) -> None:
    while not done.wait(GUARD_POLL_S):
        if _interrupted(cp, up):
            return


def upload_step(cp) -> None:
    """Step ``upload`` (module docstring): nothing for a local checkpoint. Raises
    ``CheckpointFailed`` (outcome ``rolled_back`` or ``rollback_failed``) after a failure,
    or, for a group member, the ``StorageError`` itself (the leader undoes the group)."""
    up = getattr(cp, "upload", None)
    if up is None:
        return
    done = threading.Event()
    try:
        with cp.r.phase(UPLOAD_PHASE) as ph:
            with up.lock:
                up.row, up.base = ph, (up.last.done_bytes if up.last else 0)
            if not _interrupted(cp, up):  # (a signal before the step: at once)
                threading.Thread(target=_watch_guard, args=(cp, up, done), daemon=True).start()
            try:
                if not up.started:
                    up.started = True
                    up.push.begin(cp.images_dir, _streams(cp))
                res = up.push.commit(cp.images_dir)
            finally:
                done.set()
            up.committed = res
            ph.detail = (
                f"{res.location}: {res.chunks_uploaded} chunks ({fmt_bytes(res.chunk_bytes_uploaded)}) "
                f"uploaded, {res.chunks_present} ({fmt_bytes(res.chunk_bytes_present)}) already "
                f"there, {res.images} images ({fmt_bytes(res.image_bytes)}); "
                f"{fmt_bytes(up.base)} of the chunks sent or found while the sync ran; "
                "manifest last"
            )
            for n in res.notes:
                cp.r.note(f"upload: {n}")
    except StorageError as e:
        if up.interrupted:
            e = e.again(UPLOAD_PHASE, f" (interrupted by {up.interrupted})")
        if cp.group is not None:
            raise e from None
        raise _roll_back(cp, e) from e


def _roll_back(cp, cause: AgentError) -> CheckpointFailed:
    """The upload failed on a single node: rebuild the workload and resume it (the local
    snapshot stays as it is); the error to raise."""
    try:
        cp.rebuild(restored=False)
    except BaseException as rb:
        lost = cp.lost_text(rb)
        if lost:
            return CheckpointFailed(cause, "rolled_back", lost=lost)
        cp.r.note(f"rollback failed: {rb}")
        return CheckpointFailed(
            cause,
            "rollback_failed",
            rollback_error=f"{rb}; the workload stays parked: once the cause is fixed, "
            f"`cuinterpose-agent release --pid {cp.roots[0]}` continues the rollback",
        )
    return CheckpointFailed(cause, "rolled_back", lost=cp.lost_text())


def withdraw(cp) -> None:
    """Group rollback: the snapshot this member committed to the store is deleted again (a
    cut is whole or absent); a note when that fails (collections then see a snapshot of a
    rolled-back cut, which a group restore refuses: its other members have none)."""
    up = getattr(cp, "upload", None)
    if up is None or up.committed is None:
        return
    try:
        backends.delete(up.remote.location, up.remote.storage)
        cp.r.note(f"rollback: {up.remote.location} deleted from the store again")
    except AgentError as e:
        cp.r.note(f"rollback: {up.remote.location} could not be deleted from the store: {e}")
    up.committed = None


def end(cp, keep_pin: bool = False) -> None:
    """The run is over (``Checkpoint.release_store``): a push that did not commit is aborted
    (its images and pins removed); after a committed one the local copy goes, unless
    ``--keep-local`` or ``keep_pin`` (a failed rollback still needs it). Idempotent."""
    up = getattr(cp, "upload", None)
    if up is None or up.dropped:
        return
    if up.committed is None:
        left = up.push.abort()
        if left:
            cp.r.note(f"upload: left in the store after the failure: {', '.join(left)}")
        return
    if keep_pin or up.remote.keep_local:
        return
    up.dropped = True
    try:
        if snapdir.SnapshotDir(cp.images_dir).exists():
            store.delete(cp.images_dir)
        snapdir.remove_empty(getattr(cp, "created_dirs", []) or [])
    except AgentError as e:
        cp.r.note(f"warning: the local copy {cp.images_dir} could not be removed: {e.reason}")


def result(cp) -> dict:
    """The ``--json`` fields of a checkpoint into an object store ({} for a local one):
    ``images_dir`` (the location), ``local_dir``, ``local_kept`` and ``upload`` (the push's
    counts: chunks, chunks_uploaded, chunk_bytes_uploaded, chunks_present, chunk_bytes_present,
    zero_chunks, images, image_bytes, manifest_rewritten, elapsed_ns, notes)."""
    up = getattr(cp, "upload", None)
    if up is None or up.committed is None:
        return {}
    return {
        "images_dir": up.remote.location,
        "local_dir": up.remote.local_dir,
        "local_kept": not up.dropped,
        "upload": dataclasses.asdict(up.committed)
        | {"notes": list(up.committed.notes), "chunk_bytes_during_sync": up.base},
    }

"""The restore's ``download`` step: ``restore --images-dir s3://BUCKET/PREFIX`` on any node
(decisions D67; docs/agent.md "Restore from an object store").

Before the restore reads anything, :func:`download_step` pulls the snapshot into its local
directory (agent/run/remote.py says where; a missing or empty one): the manifest first (with a
node key its MAC checked), then in a bounded pool every chunk object by a whole-object GET
checked against the digest its key names as it arrives (a chunk used twice fetched once, zero
chunks left as holes) and every CRIU image by parallel ranged GETs checked against its
SHA-256; restore's file checks on the result, the manifest written last
(agent/snapshot/backends/s3.py ``pull``). Its row reports bytes and rate as they arrive. The
restore then runs on that directory exactly as on a local snapshot.

A failed download (endpoint down, 403, 5xx after the retries, a truncated answer, a chunk or
image whose bytes do not match their digest after every retry, a signal) refuses the restore
(outcome ``refused``, phase ``download``, naming the bucket and key): nothing was restored, the
local directory is removed and nothing was written to the bucket. Once the restore is over,
succeeded or not (:func:`end`), the local copy goes unless ``--keep-local``.

Chunks are not streamed to the shims as they arrive: LOAD_ALLOCATIONS runs after CRIU restore
and native restore, which need every image, and its readers take whole chunk files whose chunks
they verify as they copy (protocol.h SAVE/LOAD); a read of a chunk before it arrived would need
a per-chunk ready signal the protocol does not have (decisions D67).
"""

from __future__ import annotations

import dataclasses
import threading

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.run.report import fmt_bytes
from cuinterpose.agent.snapshot import backends, snapdir, store

DOWNLOAD_PHASE = "download"
#: how often the download looks at the signal guard while it runs (seconds)
GUARD_POLL_S = 0.05


def _watch_guard(rs, cancel: threading.Event, done: threading.Event) -> None:
    while not done.wait(GUARD_POLL_S):
        sig = rs.guard.pending()
        if sig:
            rs.r.note(f"download: {sig} received: the download is cancelled")
            cancel.set()
            return


def download_step(rs) -> None:
    """Step ``download`` of :class:`~cuinterpose.agent.run.restore.Restore` (nothing for a
    local images dir). Sets ``rs.pulled`` (the ``PullResult``). Raises ``StorageError``
    (refused: the local directory removed, the bucket untouched)."""
    remote = getattr(rs, "remote", None)
    if remote is None:
        return
    rs.download_dirs = snapdir.make_dirs(rs.images_dir.parent)
    cancel, done = threading.Event(), threading.Event()
    with rs.r.phase(DOWNLOAD_PHASE) as ph:
        opts = dataclasses.replace(
            remote.storage,
            progress=lambda p: rs.r.progress(ph, p.done_bytes, p.total_bytes, final=p.final),
            cancel=cancel,
        )
        threading.Thread(target=_watch_guard, args=(rs, cancel, done), daemon=True).start()
        try:
            res = backends.pull(remote.location, rs.images_dir, opts)
        finally:
            done.set()
        rs.pulled = res
        ph.bytes = res.chunk_bytes + res.image_bytes
        ph.detail = (
            f"{remote.location}: {res.chunks} chunks ({fmt_bytes(res.chunk_bytes)}), "
            f"{res.images} images ({fmt_bytes(res.image_bytes)}), each checked against its "
            f"digest; {res.zero_chunks} zero chunks left as holes"
        )


def end(rs, keep_pin: bool = False) -> None:
    """The restore is over (succeeded or not): its downloaded copy and the directories made
    for it go, unless ``--keep-local``. Idempotent; a failure is a note."""
    remote = getattr(rs, "remote", None)
    if remote is None or remote.keep_local or getattr(rs, "dropped", False):
        return
    rs.dropped = True
    try:
        if getattr(rs, "pulled", None) is not None and snapdir.SnapshotDir(rs.images_dir).exists():
            store.delete(rs.images_dir)  # a plain snapshot: its manifest first, then the rest
        snapdir.remove_empty(getattr(rs, "download_dirs", []))
    except AgentError as e:
        rs.r.note(f"warning: the downloaded copy {rs.images_dir} could not be removed: {e}")


def result(rs) -> dict:
    """The ``--json`` fields of a restore from an object store ({} for a local one):
    ``images_dir`` (the location), ``local_dir``, ``local_kept`` and ``download`` (chunks,
    chunk_bytes, zero_chunks, images, image_bytes, elapsed_ns)."""
    res = getattr(rs, "pulled", None)
    if res is None:
        return {}
    d = dataclasses.asdict(res)
    return {
        "images_dir": rs.remote.location,
        "local_dir": str(rs.images_dir),
        "local_kept": not getattr(rs, "dropped", False),
        "download": {k: d[k] for k in d if k not in ("location", "target")},
    }

"""The native checkpoint/restore steps' GPU storage: custom storage where the driver has it.

``native_checkpoint(ck)`` is :class:`~cuinterpose.agent.run.checkpoint.Checkpoint`'s native
checkpoint step. The mode is the checkpoint's ``gpu_storage`` option (``--gpu-storage``:
auto | custom | host, default auto; agent/options.py): ``auto`` streams each
process's GPU memory to ``chunks/gpu-<pid>-<ordinal>.bin`` when the driver has custom storage
(agent/mech/native_storage.py ``probe``), else stages it in host memory as before (CRIU then
dumps it) and says why; ``custom`` on a driver without it fails the step (rolled back). The
record goes to the manifest (:func:`annotate`): ``"gpu_storage": {"mode", "why",
"chunk_bytes", "checksum" (the chunk checksum), "streams": [...]}`` (agent/mech/gpustore.py has the
stream record). A failed write (ENOSPC, EIO) rolls back: the workload keeps its memory and
every file under ``chunks/`` this checkpoint wrote is removed.

``prepare_restore(m, images_dir, staging_bytes)`` (restore and a release of one, before the
native restore) checks the record
(``trust.check_gpu_storage``) and opens the streams the driver-API restore reads back.
"""

from __future__ import annotations

import os

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import gpustore, native, native_storage
from cuinterpose.agent.run import carriers
from cuinterpose.agent.snapshot import trust
from cuinterpose.agent.snapshot.snapdir import CHUNKS, SnapshotDir


def choose(requested: str) -> tuple[bool, str]:
    """(custom storage used, why) for ``requested`` (auto | custom | host) and the backend and
    driver of this process. Raises ``AgentError`` phase "gpu storage" for ``custom`` where the
    driver has no custom storage."""
    if requested == "host":
        return False, "--gpu-storage host: GPU memory staged in host memory by the driver"
    try:
        b = native.backend()
        if b.name == "driver-api":
            inf = native.info()
            avail, why = native_storage.probe(b.name, inf.library, inf.version)
        else:
            avail, why = native_storage.probe(b.name, "", 0)
    except AgentError as e:
        avail, why = False, f"no driver-API backend to probe ({e.reason})"
    if requested == "custom" and not avail:
        raise AgentError(
            "gpu storage", f"--gpu-storage custom: {why}; use --gpu-storage host (or auto)"
        )
    if avail:
        return True, f"{requested}: {why}"
    return False, f"{requested}: {why}; GPU memory staged in host memory (CRIU dumps it)"


def _pinned_alloc(n: int):
    """A page-locked staging slot (``cuMemAllocHost``) on the real driver."""
    from cuda.bindings import driver as d

    err, p = d.cuMemAllocHost(n)
    if int(err) != 0:
        raise AgentError("gpu storage", f"cuMemAllocHost({n}): {err.name}")
    return int(p), lambda: d.cuMemFreeHost(p)


def options(ck) -> gpustore.Options:
    """The GPU streams' writer options of the checkpoint ``ck``: its :func:`settings` and, on
    the real driver, page-locked staging slots."""
    real = native.info().kind == "real"
    return gpustore.Options(settings(ck), alloc=_pinned_alloc if real else None)


def settings(ck):
    """The checkpoint's ``ChunkSettings``: its shim carriers' (the coordinator's CarrierFiles:
    --chunk-bytes, --staging-bytes, --writers and the chunk checksum reach the GPU streams as
    they reach the shims), else what :func:`carriers.settings` makes of its options
    (agent/options.py ``CheckpointOptions.chunk_settings``)."""
    files = getattr(getattr(ck, "coordinator", None), "carriers", None)
    if files is not None:
        return files.settings
    return carriers.settings(**ck.options.chunk_settings())


def native_checkpoint(ck) -> None:
    """LOCKED -> CHECKPOINTED for every CUDA pid, GPU memory to custom storage or host staging;
    sets ``ck.gpu_storage`` (the manifest record)."""
    pids = ck.census.cuda_pids
    requested = native_storage.mode(ck.options.gpu_storage)
    with ck.r.phase("native checkpoint") as ph:
        use, why = choose(requested)
        opts = options(ck) if use else gpustore.Options()
        snap = SnapshotDir(ck.images_dir)
        if use:
            native_storage.begin_checkpoint(snap, opts)
        streams: list[dict] = []
        try:
            native.checkpoint_all(pids)
        except BaseException:
            streams = native_storage.end_checkpoint() if use else []
            # still readable by the rollback through the held fds
            snap.remove_streams(s["file"] for s in streams)
            raise
        streams = native_storage.end_checkpoint() if use else []
        ph.detail = f"pids {', '.join(map(str, pids))}; GPU storage {why}"
        ph.bytes = sum(snap.allocated(s["file"]) for s in streams)
    ck.gpu_storage = {
        "mode": "custom" if use else "host",
        "why": why,
        "chunk_bytes": opts.chunk_bytes,
        "checksum": opts.checksum,
        "streams": streams,
    }


def discard(ck) -> None:
    """A checkpoint that ends without its manifest: remove its ``chunks/gpu-*.bin`` files (the
    agent still holds them open, so a rollback that has yet to read them back still can)."""
    files = native_storage.held_files()
    if files:
        SnapshotDir(ck.images_dir).remove_streams(files)


def annotate(ck, manifest: dict) -> None:
    """Put the GPU storage record (mode, why, streams) into ``manifest`` before it is written
    (``cuinterpose.v1.Manifest.gpu_storage_json`` carries it over gRPC)."""
    rec = getattr(ck, "gpu_storage", None)
    if rec is not None:
        manifest["gpu_storage"] = rec


def prepare_restore(m: dict, images_dir, staging_bytes=None) -> None:
    """Before the native restore of the snapshot ``images_dir`` (manifest ``m``): a snapshot
    with ``gpu_storage.mode == "custom"`` is checked (``trust.check_gpu_storage``) and its
    streams opened for the driver-API restore, read with the snapshot's chunk size and checksum
    and ``staging_bytes`` (the restore's option; None, as for a release: the default, at least
    one chunk). Raises ``SnapshotError`` (a bad record; nothing changed yet by this step) or
    ``AgentError`` phase "native restore" (a backend without custom storage)."""
    rec = m.get("gpu_storage")
    if not rec or rec.get("mode") != "custom":
        return
    trust.check_gpu_storage(images_dir, m)
    inf = native.info()
    avail, why = native_storage.probe("driver-api", inf.library, inf.version)
    if not avail:
        raise AgentError(
            "native restore",
            f"the snapshot's GPU memory is in custom storage ({len(rec['streams'])} stream(s) "
            f"under {CHUNKS}/), and {why}; restore it on a driver with custom "
            "storage (the driver API restores it, whatever --native-backend)",
        )
    opts = gpustore.Options(
        carriers.settings(
            chunk_bytes=int(rec["chunk_bytes"]),
            staging_bytes=staging_bytes,
            checksum=str(rec.get("checksum", gpustore.CHECKSUM)),
            fit_staging=True,
        ),
        alloc=_pinned_alloc if native.info().kind == "real" else None,
    )
    native_storage.register_sources(SnapshotDir(images_dir), m["cuda_pids"], rec["streams"], opts)


def gpu_bytes(directory: os.PathLike | str, rec: dict) -> int:
    """Bytes the streams of ``rec`` hold (their sizes: the GPU regions)."""
    return sum(int(s["bytes"]) for s in rec.get("streams", []))

"""The shim carriers' chunk files of a snapshot (issue 12 item 1; docs/snapshot-format.md
"chunks"; decisions D31): ``DIR/chunks/shared-<pid>-<alloc_id>.bin``, one per shared creator
allocation, written by the shims at SAVE_ALLOCATIONS and read back at LOAD_ALLOCATIONS (restore
and rollback) through descriptors the agent opens and passes (SCM_RIGHTS), so the shim needs no
access to the agent's mount namespace.

Settings: ``chunk_bytes`` (default 8 MiB, a power of two from 64 KiB to 1 GiB; environment
``CUINTERPOSE_CHUNK_BYTES``), ``staging_bytes`` (the staging ring per process, default 64 MiB;
``CUINTERPOSE_STAGING_BYTES``), ``writers`` (threads per process, default 4;
``CUINTERPOSE_WRITERS``). Errors: :class:`~cuinterpose.agent.errors.AgentError` naming the
value and its source. Durability (fsync of the files and of ``chunks/``) is the sync phase's
job, not this module's. ``--incremental``: the streams are packs of the snapshot root's chunk
store instead (agent/snapshot/store.py; decisions D34), and only chunks it lacks are written.
"""

from __future__ import annotations

import os
import pathlib
import shutil

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.snapshot import store
from cuinterpose.coordinator.carrierfiles import CarrierFiles
from cuinterpose.coordinator.protocol import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STAGING_BYTES,
    DEFAULT_WRITERS,
    check_carrier_params,
)

CHUNKS_DIR = "chunks"
#: "1": every checkpoint of this agent is incremental (a daemon's default; --incremental)
INCREMENTAL_ENV = "CUINTERPOSE_INCREMENTAL"
ENV = {
    "chunk_bytes": "CUINTERPOSE_CHUNK_BYTES",
    "staging_bytes": "CUINTERPOSE_STAGING_BYTES",
    "writers": "CUINTERPOSE_WRITERS",
}
DEFAULTS = {
    "chunk_bytes": DEFAULT_CHUNK_BYTES,
    "staging_bytes": DEFAULT_STAGING_BYTES,
    "writers": DEFAULT_WRITERS,
}


def settings(chunk_bytes=None, staging_bytes=None, writers=None) -> dict:
    """{"chunk_bytes", "staging_bytes", "writers"}: each the argument, else its environment
    variable, else the default. Raises AgentError (phase "images dir") naming a bad value."""
    given = {"chunk_bytes": chunk_bytes, "staging_bytes": staging_bytes, "writers": writers}
    out = {}
    for k, v in given.items():
        where = f"--{k.replace('_', '-')}"
        if v is None and os.environ.get(ENV[k]):
            v, where = os.environ[ENV[k]], ENV[k]
        try:
            out[k] = DEFAULTS[k] if v is None else int(v)
        except ValueError:
            raise AgentError("images dir", f"{where}={v!r} is not an integer") from None
    try:
        check_carrier_params(out["chunk_bytes"], out["staging_bytes"], out["writers"])
    except ValueError as e:
        raise AgentError("images dir", f"carrier chunk files: {e}") from None
    return out


def checkpoint_files(images_dir, incremental: bool = False, **kw) -> CarrierFiles:
    """The chunk files a checkpoint into ``images_dir`` writes (``kw``: :func:`settings`).
    ``incremental`` (or ``$CUINTERPOSE_INCREMENTAL=1``): packs of the chunk store of the
    snapshot root (agent/snapshot/store.py),
    with the chunks it already holds as ``known``; the store's shared lock is taken (AgentError
    when it is not free in time) and kept in ``holder`` until :func:`release`."""
    if not (incremental or os.environ.get(INCREMENTAL_ENV) == "1"):
        return CarrierFiles(pathlib.Path(images_dir) / CHUNKS_DIR, **settings(**kw))
    s = settings(**kw)
    root = store.root_of(images_dir)
    lock = store.Lock(root, exclusive=False)
    try:
        files = CarrierFiles(
            store.packs_dir(root),
            store=store.STORE_REL,
            prefix=store.new_prefix(),
            known=store.known_chunks(root),
            **s,
        )
    except BaseException:
        lock.release()
        raise
    files.holder = lock
    return files


def store_record(files) -> dict | None:
    """What a release needs to load a capture of the chunk store back (``.lock`` field
    ``store``): {"dir", "prefix", "refs": {"PID:ALLOC_ID": [[chunk, pack, offset]]}}; None
    without a store."""
    if files is None or getattr(files, "store", None) is None:
        return None
    refs = {
        f"{pid}:{aid}": [[i, n, o] for i, (n, o) in sorted(r.items())]
        for (pid, aid), r in files.refs.items()
    }
    return {"dir": files.directory, "prefix": files.prefix, "refs": refs}


def release_files(images_dir, lock_fields: dict) -> CarrierFiles:
    """The chunk files a release (a dead agent's checkpoint) loads the shims back from:
    ``lock_fields`` are the ``.lock``'s ``chunks`` and ``store`` (:func:`store_record`)."""
    rec = lock_fields.get("store")
    s = settings(**(lock_fields.get("chunks") or {}))
    if not rec:
        return CarrierFiles(pathlib.Path(images_dir) / CHUNKS_DIR, **s)
    files = CarrierFiles(rec["dir"], store=store.STORE_REL, prefix=rec["prefix"], **s)
    for key, rows in (rec.get("refs") or {}).items():
        pid, aid = key.split(":")
        files.refs[(int(pid), aid)] = {int(i): (str(n), int(o)) for i, n, o in rows}
    return files


def restore_files(images_dir, manifest: dict, **kw) -> CarrierFiles:
    """The chunk files a restore from ``images_dir`` reads, with the manifest's chunk_bytes
    (``kw``: staging_bytes, writers); for a snapshot of the chunk store, each stream's pack
    and refs from ``chunks.streams``."""
    chunks = manifest.get("chunks") or {}
    s = settings(chunk_bytes=chunks.get("chunk_bytes", DEFAULT_CHUNK_BYTES), **kw)
    if chunks.get("store") != store.STORE_REL:
        return CarrierFiles(pathlib.Path(images_dir) / CHUNKS_DIR, **s)
    files = CarrierFiles(store.packs_dir(store.root_of(images_dir)), store=store.STORE_REL, **s)
    for st in chunks.get("streams") or []:
        key = (int(st["pid"]), str(st["alloc_id"]))
        files.names[key] = str(st["pack"])
        files.refs[key] = {int(i): (str(n), int(o)) for i, n, o in st.get("refs") or []}
    return files


def release(files) -> None:
    """Release what ``files`` holds (the chunk store's lock); idempotent."""
    holder = getattr(files, "holder", None)
    if holder is not None:
        files.holder = None
        holder.release()


def remove_chunks(images_dir, files=None) -> None:
    """Remove ``DIR/chunks/`` (a rolled-back checkpoint's partial or complete chunk files;
    the workload's memory is back on the device by then) and, for a checkpoint into the chunk
    store (``files``), the packs it wrote (those of its prefix; older packs stay). A symlink
    there is unlinked, never followed."""
    d = pathlib.Path(images_dir) / CHUNKS_DIR
    if d.is_symlink():
        d.unlink()
    else:
        shutil.rmtree(d, ignore_errors=True)
    if files is not None and getattr(files, "store", None) is not None and files.prefix:
        files.remove()

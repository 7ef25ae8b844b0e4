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
job, not this module's.
"""

from __future__ import annotations

import os
import pathlib
import shutil

from cuinterpose.agent.errors import AgentError
from cuinterpose.coordinator.carrierfiles import CarrierFiles
from cuinterpose.coordinator.protocol import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_STAGING_BYTES,
    DEFAULT_WRITERS,
    check_carrier_params,
)

CHUNKS_DIR = "chunks"
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


def checkpoint_files(images_dir, **kw) -> CarrierFiles:
    """The chunk files a checkpoint into ``images_dir`` writes (``kw``: :func:`settings`)."""
    return CarrierFiles(pathlib.Path(images_dir) / CHUNKS_DIR, **settings(**kw))


def restore_files(images_dir, manifest: dict, **kw) -> CarrierFiles:
    """The chunk files a restore from ``images_dir`` reads, with the manifest's chunk_bytes
    (``kw``: staging_bytes, writers)."""
    chunks = manifest.get("chunks") or {}
    s = settings(chunk_bytes=chunks.get("chunk_bytes", DEFAULT_CHUNK_BYTES), **kw)
    return CarrierFiles(pathlib.Path(images_dir) / CHUNKS_DIR, **s)


def remove_chunks(images_dir) -> None:
    """Remove ``DIR/chunks/`` (a rolled-back checkpoint's partial or complete chunk files;
    the workload's memory is back on the device by then). A symlink there is unlinked, never
    followed."""
    d = pathlib.Path(images_dir) / CHUNKS_DIR
    if d.is_symlink():
        d.unlink()
    else:
        shutil.rmtree(d, ignore_errors=True)

"""A snapshot whose home is an object store: ``--images-dir s3://BUCKET/PREFIX`` (decisions D67;
docs/snapshot-format.md "Object store").

A checkpoint or restore works on a local snapshot directory as always; :class:`Remote` says
where that local copy lives and how it reaches the store: the location, the local directory,
the ``StorageOptions`` (agent/snapshot/backends/api.py: the S3 settings the caller resolved
once, agent/snapshot/backends/awsconf.py ``resolve``; the node key) and whether the local copy
is kept once the snapshot is in the store. The checkpoint's upload is agent/run/upload.py, the
restore's download agent/run/download.py.

Where the local copy goes unless ``--local-dir`` names it (``staging_root``, default
:data:`DEFAULT_STAGING_ROOT`, the daemon's ``--staging-dir``):

- a checkpoint: ``STAGING/checkpoint/BUCKET/PREFIX``, the same directory for the same
  location, so ``--incremental`` finds its chunk store (the directory's parent) again;
- a restore: ``STAGING/restore/BUCKET/PREFIX.<8 hex>``, a new directory per restore.

:func:`make` builds the value (None for a local images dir). Errors: ``StorageError`` (phase
"stat") for a malformed location, ``AgentError`` (phase "request") for a ``--local-dir``
without an ``s3://`` images dir.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Optional

from cuinterpose.agent import paths
from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.snapshot import backends
from cuinterpose.agent.snapshot.backends.api import StorageOptions, parse_location

#: where local copies of object-store snapshots go by default (``--local-dir``, the daemon's
#: ``--staging-dir``); beside the daemon's default snapshot root
DEFAULT_STAGING_ROOT = "/var/lib/cuinterpose/staging"
#: the two sub-trees of a staging root
KINDS = ("checkpoint", "restore")


@dataclasses.dataclass(frozen=True)
class Remote:
    """``location``: ``s3://BUCKET/PREFIX`` (normalized); ``local_dir``: the local snapshot
    directory (absolute, canonical); ``storage``: how the backend reaches the store;
    ``keep_local``: keep the local copy after a checkpoint's committed upload or after a
    restore (a failed upload always keeps it)."""

    location: str
    local_dir: str
    storage: StorageOptions = dataclasses.field(repr=False)
    keep_local: bool = False


def default_local_dir(location: str, kind: str, staging_root: Optional[str] = None) -> str:
    """The local directory of ``location`` for a ``kind`` ("checkpoint" or "restore") run under
    ``staging_root`` (module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    loc = parse_location(location)
    base = os.path.join(
        paths.canonical(staging_root or DEFAULT_STAGING_ROOT), kind, loc.bucket, *loc.key.split("/")
    )
    return base if kind == "checkpoint" else f"{base}.{secrets.token_hex(4)}"


def make(
    images_dir: str,
    storage: Optional[StorageOptions],
    *,
    kind: str,
    local_dir=None,
    staging_root: Optional[str] = None,
    keep_local: bool = False,
) -> Optional[Remote]:
    """The :class:`Remote` of ``images_dir`` for a ``kind`` run, or None when ``images_dir`` is
    a local path (then ``local_dir`` must be None). ``storage``: required for a remote one."""
    if not backends.is_remote(images_dir):
        if local_dir:
            raise AgentError(
                "request",
                f"--local-dir {local_dir} is for an s3:// images dir; {images_dir} is local",
            )
        return None
    if storage is None:
        raise AgentError("request", f"{images_dir}: no storage settings to reach it")
    location = str(parse_location(images_dir))
    local = (
        paths.canonical(local_dir) if local_dir else default_local_dir(location, kind, staging_root)
    )
    return Remote(location, local, storage, keep_local)

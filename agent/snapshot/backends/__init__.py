"""Snapshot storage backends: where a snapshot lives besides the directory a checkpoint wrote
(docs/snapshot-format.md "Object store"; decisions D40).

One table, :data:`BACKENDS`, keyed by a location's scheme; each row
(:class:`~.api.Backend`) is a small set of hooks — ``push``, ``pull``, ``list``, ``delete``,
``stat``, ``collect`` — in the style of CRIU's backend tables. Adding a backend is a module with those
hooks and one line in the table.

- ``file`` (agent/snapshot/backends/local.py): a local directory, the default (a location
  without ``scheme://`` is a path).
- ``s3`` (agent/snapshot/backends/s3.py, s3gc.py, s3io.py): ``s3://BUCKET/PREFIX`` on any
  S3-compatible object store; settings from agent/snapshot/backends/awsconf.py ``resolve``.

The functions below dispatch on the location: :func:`push`, :func:`begin_push`,
:func:`pull`, :func:`list_snapshots`, :func:`delete`, :func:`stat`, :func:`collect`; each
takes one :class:`~.api.StorageOptions` and returns one result value
(agent/snapshot/backends/api.py) or raises :class:`~.api.StorageError` naming phase, bucket
and key. :func:`is_remote` says whether a location is anything but a local path (what a
checkpoint or restore must move through a local directory first: agent/run/remote.py).
"""

from __future__ import annotations

from cuinterpose.agent.snapshot.backends import local, s3
from cuinterpose.agent.snapshot.backends.api import (
    Backend,
    DeleteResult,
    PullResult,
    PushResult,
    SnapshotInfo,
    StorageError,
    StorageOptions,
    parse_location,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "DeleteResult",
    "PullResult",
    "PushResult",
    "SnapshotInfo",
    "StorageError",
    "StorageOptions",
    "backend",
    "begin_push",
    "is_remote",
    "collect",
    "delete",
    "list_snapshots",
    "pull",
    "push",
    "stat",
]

BACKENDS: dict[str, Backend] = {
    local.BACKEND.scheme: local.BACKEND,
    s3.BACKEND.scheme: s3.BACKEND,
}


def backend(location: str, *, root: bool = False) -> Backend:
    """The table row for ``location`` (``StorageError`` phase "stat" for an unknown scheme or
    a malformed location)."""
    return BACKENDS[parse_location(location, root=root).scheme]


def is_remote(location: str) -> bool:
    """Whether ``location`` names anything but a local directory (``s3://...``); raises
    ``StorageError`` (phase "stat") for a malformed location or an unknown scheme."""
    return parse_location(location, root=True).scheme != local.BACKEND.scheme


class _WholePush:
    """The push session of a row without ``begin_push``: nothing before the commit, which
    is the row's ``push``."""

    def __init__(self, row: Backend, location: str, opts: StorageOptions):
        self.row, self.location, self.opts = row, location, opts

    def check_free(self) -> None:
        try:
            self.row.stat(self.location, self.opts)
        except StorageError:
            return
        raise StorageError("upload", f"{self.location} holds a snapshot already; nothing written")

    def begin(self, snapshot_dir, streams: dict) -> None:
        pass

    def commit(self, snapshot_dir) -> PushResult:
        return self.row.push(snapshot_dir, self.location, self.opts)

    def cancel(self) -> None:
        pass

    def abort(self) -> list:
        return []


def begin_push(location: str, opts: StorageOptions):
    """A push session to ``location`` (:class:`~.api.Backend` ``begin_push``): ``check_free()``,
    ``begin(snapshot_dir, streams)``, ``commit(snapshot_dir) -> PushResult``, ``cancel()``,
    ``abort()``."""
    row = backend(location)
    if row.begin_push is not None:
        return row.begin_push(location, opts)
    return _WholePush(row, location, opts)


def push(snapshot_dir, location: str, opts: StorageOptions) -> PushResult:
    """The complete local snapshot ``snapshot_dir`` to ``location`` (no snapshot there yet)."""
    return backend(location).push(snapshot_dir, location, opts)


def pull(location: str, target_dir, opts: StorageOptions) -> PullResult:
    """The snapshot at ``location`` into ``target_dir`` (missing or empty): a plain snapshot
    directory that ``restore --images-dir`` accepts."""
    return backend(location).pull(location, target_dir, opts)


def list_snapshots(root: str, opts: StorageOptions) -> list[SnapshotInfo]:
    """The snapshots directly under ``root``."""
    return backend(root, root=True).list(root, opts)


def delete(location: str, opts: StorageOptions) -> DeleteResult:
    """Remove the snapshot at ``location`` and collect the chunks nothing refers to anymore."""
    return backend(location).delete(location, opts)


def collect(root: str, opts: StorageOptions) -> DeleteResult:
    """Free the chunks under ``root`` (S3: the whole bucket) that nothing refers to."""
    return backend(root, root=True).collect(root, opts)


def stat(location: str, opts: StorageOptions) -> SnapshotInfo:
    """The snapshot at ``location`` (``StorageError`` when there is none)."""
    return backend(location).stat(location, opts)

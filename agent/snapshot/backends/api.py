"""The values the snapshot storage backends take and give (agent/snapshot/backends/__init__.py
holds the table of backends; docs/snapshot-format.md "Object store").

In: :class:`StorageOptions` (one value the caller builds: the S3 settings from
agent/snapshot/backends/awsconf.py, the :class:`TransferOptions`, the node key, a progress
callback). Out: :class:`PushResult`, :class:`PullResult`, :class:`SnapshotInfo`,
:class:`DeleteResult`; :class:`Progress` rows while bytes move. Errors:
:class:`StorageError` (an ``AgentError``) naming the phase (``upload``, ``download``, ``list``,
``delete``, ``stat``), the bucket and the key. :func:`parse_location` splits a location string.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, NamedTuple, Optional

from cuinterpose.agent.errors import AgentError

#: the phases of a storage operation (``StorageError.phase``, ``Progress.phase``)
PHASES = ("upload", "download", "list", "delete", "stat")
#: the object-store prefix no snapshot may use: chunk objects, pins and collection locks
RESERVED = ".cuinterpose"


class StorageError(AgentError):
    """A storage operation failed or was refused: ``phase`` one of :data:`PHASES`, ``bucket``
    and ``key`` (None where no object is to blame, e.g. a local path), ``reason``. What it
    left behind is in the reason (an upload: the local snapshot as it was and no manifest in
    the bucket; a download: the bucket untouched and the local target removed)."""

    def __init__(self, phase: str, reason: str, *, bucket=None, key=None):
        self.bucket, self.key = bucket, key
        #: the reason without the ``s3://BUCKET/KEY: `` in front
        self.detail = reason
        where = f"s3://{bucket}/{key}: " if bucket is not None and key is not None else ""
        where = where or (f"s3://{bucket}: " if bucket is not None else "")
        super().__init__(phase, where + reason)

    def again(self, phase: str, more: str) -> "StorageError":
        """The same failure, reported in ``phase`` with ``more`` said after it."""
        return StorageError(phase, self.detail + more, bucket=self.bucket, key=self.key)


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    """How bytes move. ``threads``: transfers at once (a bounded pool; memory in flight is at
    most about ``threads * part_bytes``); ``part_bytes``: the multipart part size and the size
    of each ranged GET (5 MiB .. 5 GiB, the S3 part limits; an object over 10,000 parts gets
    larger ones); ``attempts``: tries of one idempotent request (GET, HEAD, PUT of a whole
    object or part, LIST, DELETE) on a connection error, a timeout, a truncated body, HTTP 5xx,
    429 or a checksum mismatch (4xx answers are not retried); ``backoff_s``: the first wait
    between tries (doubled each time, at most 5 s); ``connect_timeout_s``/``read_timeout_s``:
    per request (urllib3); ``deadline_s``: the whole operation (None: only the per-request
    bounds); ``lease_s``: how long a collection may delete once it took its lock (seconds),
    ``clock_skew_s``: the clock difference between nodes a pin/lock check tolerates."""

    threads: int = 8
    part_bytes: int = 16 << 20
    attempts: int = 4
    backoff_s: float = 0.2
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    deadline_s: Optional[float] = None
    lease_s: float = 600.0
    clock_skew_s: float = 120.0

    def __post_init__(self):
        if not (isinstance(self.threads, int) and 1 <= self.threads <= 256):
            raise ValueError(f"threads {self.threads!r} is not 1..256")
        if not (isinstance(self.part_bytes, int) and 5 << 20 <= self.part_bytes <= 5 << 30):
            raise ValueError(f"part_bytes {self.part_bytes!r} is not 5 MiB..5 GiB (S3 part limits)")
        if not (isinstance(self.attempts, int) and 1 <= self.attempts <= 20):
            raise ValueError(f"attempts {self.attempts!r} is not 1..20")
        for name in ("backoff_s", "connect_timeout_s", "read_timeout_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} {getattr(self, name)!r} must be > 0")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s {self.deadline_s!r} must be > 0 or None")


@dataclasses.dataclass(frozen=True)
class Progress:
    """One progress row of an upload or a download (what agent/run/report.py's
    ``Reporter.progress(row, done_bytes, total_bytes)`` shows). Bytes; ``rate_bps`` is
    ``transferred_bytes`` per second since the transfer began; ``present_bytes``: chunk bytes
    an upload found in the bucket already (counted in ``done_bytes``, never sent)."""

    phase: str
    location: str
    done_bytes: int
    total_bytes: int
    transferred_bytes: int
    present_bytes: int
    rate_bps: float
    elapsed_ns: int
    final: bool = False


@dataclasses.dataclass(frozen=True)
class StorageOptions:
    """Everything a backend operation takes besides its paths: ``s3`` (agent/snapshot/backends/
    awsconf.py ``S3Settings``; needed by ``s3://`` locations), ``transfer``, ``node_key`` (the
    node key's bytes, agent/snapshot/trust.py ``node_key()``: with one, a push or pull refuses
    a manifest without a valid MAC and a manifest a push rewrites is signed with it),
    ``progress`` (called from worker threads with a :class:`Progress`, at most every 100 ms
    and once at the end), ``cancel`` (a ``threading.Event`` another thread may set to stop the
    operation at its next request: it then fails with "cancelled" and undoes what it wrote)."""

    s3: Optional[object] = None
    transfer: TransferOptions = TransferOptions()
    node_key: Optional[bytes] = dataclasses.field(default=None, repr=False)
    progress: Optional[Callable[[Progress], None]] = None
    cancel: Optional[object] = None


@dataclasses.dataclass(frozen=True)
class PushResult:
    """What a push did: ``location`` (``s3://BUCKET/PREFIX``), ``manifest_key``; chunks:
    ``chunks`` non-zero chunks of the snapshot, ``chunks_uploaded``/``chunk_bytes_uploaded``
    those the bucket lacked, ``chunks_present``/``chunk_bytes_present`` those it had,
    ``zero_chunks`` (never stored); ``images``/``image_bytes`` CRIU images (and other files
    under the prefix) uploaded; ``manifest_rewritten``: the manifest in the bucket is the
    chunk store's converted to file streams; ``elapsed_ns``; ``notes``: what the operator
    should know (a pin that could not be removed after the commit)."""

    location: str
    manifest_key: str
    chunks: int
    chunks_uploaded: int
    chunk_bytes_uploaded: int
    chunks_present: int
    chunk_bytes_present: int
    zero_chunks: int
    images: int
    image_bytes: int
    manifest_rewritten: bool
    elapsed_ns: int
    notes: tuple = ()


@dataclasses.dataclass(frozen=True)
class PullResult:
    """What a pull wrote: ``target`` (a snapshot directory today's restore accepts),
    ``chunks``/``chunk_bytes`` downloaded (each verified), ``zero_chunks`` (holes),
    ``images``/``image_bytes`` (each SHA-256 verified), ``elapsed_ns``."""

    location: str
    target: str
    chunks: int
    chunk_bytes: int
    zero_chunks: int
    images: int
    image_bytes: int
    elapsed_ns: int


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot: ``location``, ``snapshot_id``, ``created_at`` (ISO 8601 UTC), ``roots``,
    ``image_bytes`` (CRIU images), ``chunk_bytes`` (the carried streams' bytes, zero chunks
    included), ``signed_key_id`` (the MAC's key id, None when unsigned), ``manifest_bytes``,
    and what ``cuinterpose-agent snapshots`` shows besides: ``carrier_bytes`` (the manifest's
    ``totals.carrier_bytes``), ``driver`` (its ``driver.kind``), ``native`` (its
    ``native.backend``; "" when absent)."""

    location: str
    snapshot_id: str
    created_at: str
    roots: tuple
    image_bytes: int
    chunk_bytes: int
    signed_key_id: Optional[str]
    manifest_bytes: int
    carrier_bytes: int = 0
    driver: str = ""
    native: str = ""


@dataclasses.dataclass(frozen=True)
class DeleteResult:
    """What a delete removed: ``location``; ``objects_removed`` (the manifest first, then the
    images under the prefix); the collection that followed: ``chunks_removed``,
    ``chunk_bytes_freed``, ``chunks_kept`` (referenced by a manifest or a pin), ``pins``
    (``[{"key", "location", "node", "started_at"}]`` of the pins that held chunks)."""

    location: str
    objects_removed: int
    chunks_removed: int
    chunk_bytes_freed: int
    chunks_kept: int
    pins: tuple


class Backend(NamedTuple):
    """One row of the backend table: the hooks of one storage kind (CRIU's backend-table
    style). Each takes the location string as the user wrote it and a
    :class:`StorageOptions`:

    - ``push(snapshot_dir, location, opts) -> PushResult``: a complete local snapshot
      directory to ``location`` (which must hold no snapshot yet);
    - ``pull(location, target_dir, opts) -> PullResult``: into a missing or empty local
      directory, as a plain snapshot directory (chunk files, no chunk store);
    - ``list(root, opts) -> list[SnapshotInfo]``: the snapshots directly under ``root``;
    - ``delete(location, opts) -> DeleteResult``: one snapshot, then collect its chunks;
    - ``stat(location, opts) -> SnapshotInfo``;
    - ``collect(root, opts) -> DeleteResult``: free the chunks no snapshot (or running
      upload) refers to, deleting no snapshot (after an interrupted upload, or a snapshot
      removed by other means);
    - ``begin_push(location, opts) -> session`` (optional): a push in two halves, the session's
      ``check_free()``, ``begin(snapshot_dir, streams)`` (send the chunk streams before the
      manifest exists), ``commit(snapshot_dir) -> PushResult``, ``cancel()`` and ``abort()``
      (agent/snapshot/backends/s3push.py ``Push``); a row without it is pushed whole at
      commit (agent/snapshot/backends/__init__.py ``begin_push``)."""

    scheme: str
    push: Callable
    pull: Callable
    list: Callable
    delete: Callable
    stat: Callable
    collect: Callable
    begin_push: Optional[Callable] = None


class Location(NamedTuple):
    """A parsed location: ``scheme`` ("file" or "s3"), ``bucket`` (s3; "" for file), ``key``
    (s3: the prefix without leading or trailing "/"; file: the absolute path)."""

    scheme: str
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}" if self.scheme == "s3" else self.key


_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def parse_location(location: str, *, root: bool = False) -> Location:
    """``s3://BUCKET/PREFIX`` (``root``: the prefix may be empty, a listing of the bucket's
    top) or a local path (``file://PATH`` or a plain path, made absolute). A prefix's parts
    are non-empty, not ``.``/``..``, and the first is not :data:`RESERVED`. Raises
    ``StorageError`` (phase "stat") naming the location."""
    if not isinstance(location, str) or not location or "\0" in location:
        raise StorageError("stat", f"location {location!r} is not a path or s3://BUCKET/PREFIX")
    if location.startswith("s3://"):
        rest = location[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        prefix = prefix.strip("/")
        if not _BUCKET.match(bucket):
            raise StorageError(
                "stat", f"location {location}: bucket {bucket!r} is not an S3 bucket name"
            )
        parts = prefix.split("/") if prefix else []
        if any(p in ("", ".", "..") for p in parts) or (parts and parts[0] == RESERVED):
            raise StorageError(
                "stat",
                f"location {location}: prefix {prefix!r} has an empty, '.' or '..' part or "
                f"starts with the reserved {RESERVED}/",
            )
        if not parts and not root:
            raise StorageError(
                "stat", f"location {location} names no snapshot: use s3://{bucket}/PREFIX"
            )
        return Location("s3", bucket, prefix)
    if "://" in location and not location.startswith("file://"):
        scheme = location.split("://", 1)[0]
        raise StorageError("stat", f"location {location}: no storage backend for {scheme}://")
    path = location[len("file://") :] if location.startswith("file://") else location
    return Location("file", "", os.path.abspath(path))

"""The shared chunk objects of a bucket: their keys, the pins that hold them, and their
collection (docs/snapshot-format.md "Object store"; decisions D40).

Keys (under the reserved prefix ``.cuinterpose/`` of the bucket)::

    .cuinterpose/chunks/<checksum>/<2 hex>/<64 hex>   one object per distinct chunk of every
                                                      snapshot of the bucket: its bytes, named
                                                      by its digest (zero chunks: none)
    .cuinterpose/pins/<32 hex>.json                   an upload in progress: the chunks it
                                                      will refer to
    .cuinterpose/collect/<32 hex>.json                a collection in progress, with its lease

What the bucket holds is what its manifests say: no index; :func:`collect` keeps every chunk
that a manifest (any ``*/manifest.json`` outside ``.cuinterpose/``) or a pin names and removes
the others. A manifest that cannot be read, or whose streams are malformed, refuses the
collection before anything is removed.

**Uploads against collections** (no chunk an upload found present may be lost): an upload
writes its pin (every chunk its manifest will name) *before* it checks which chunks the
bucket has, then lists the collection locks and waits while one is live. A collection writes
its lock, *then* lists the pins, *then* lists the manifests, and removes chunks only until its
lease runs out. S3 is strongly consistent (a LIST after a PUT sees it), so either the
collection lists the upload's pin (its chunks are kept), or the pin came after the lock,
the upload saw the lock and waited for the collection to end before checking anything. A pin
removed before the collection listed pins belongs to an upload whose manifest was written
before, so the manifest listing sees it. A lock whose ``started_unix + lease_s`` lies more
than ``clock_skew_s`` in the past is stale (a dead collector) and ignored; a collector stops
deleting before its lease ends (checked before each removal, by its own monotonic clock). A
pin of a dead uploader keeps its chunks until ``collect(drop_pins_older_than_s=...)`` or an
operator removes it: it can leak bytes, never lose them.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional

from cuinterpose.agent.snapshot import snapdir
from cuinterpose.agent.snapshot.backends import layout
from cuinterpose.agent.snapshot.backends.api import (
    RESERVED,
    DeleteResult,
    StorageError,
    StorageOptions,
    parse_location,
)
from cuinterpose.agent.snapshot.backends.s3io import Client, NotFound
from cuinterpose.agent.snapshot.backends.transfer import run_jobs

CHUNKS = f"{RESERVED}/{snapdir.CHUNKS}/"
PINS = f"{RESERVED}/pins/"
LOCKS = f"{RESERVED}/collect/"
MANIFEST_SUFFIX = "/" + snapdir.MANIFEST
#: how often an upload looks again at a live collection lock (seconds)
WAIT_POLL_S = 0.5
#: tests only: called with a point name ("collect locked", "upload pinned", "upload sent")
TEST_HOOK: Optional[Callable[[str], None]] = None


def hook(point: str) -> None:
    if TEST_HOOK is not None:
        TEST_HOOK(point)


def chunk_key(checksum: str, hexdigest: str) -> str:
    return f"{CHUNKS}{checksum}/{hexdigest[:2]}/{hexdigest}"


def parse_chunk_key(key: str) -> Optional[tuple[str, str]]:
    """(checksum, hex digest) of a chunk object's key; None for any other key."""
    parts = key[len(CHUNKS) :].split("/") if key.startswith(CHUNKS) else []
    if len(parts) != 3 or not layout._HEX64.match(parts[2]) or parts[1] != parts[2][:2]:
        return None
    return parts[0], parts[2]


def _record(**extra) -> dict:
    return {
        "node": socket.gethostname(),
        "pid": os.getpid(),
        "started_unix": time.time(),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


def pin(client: Client, bucket: str, location: str, digests, phase: str = "upload") -> str:
    """Write a pin naming ``digests`` ((checksum, hex) pairs) for the upload to ``location``,
    then wait while a live collection lock exists (module docstring); returns the pin's key.
    Raises ``StorageError`` when the wait outlasts the operation's deadline."""
    by: dict = {}
    for alg, hexd in digests:
        by.setdefault(alg, []).append(hexd)
    key = f"{PINS}{uuid.uuid4().hex}.json"
    body = _record(location=location, chunks={a: sorted(v) for a, v in sorted(by.items())})
    client.put(phase, bucket, key, json.dumps(body, sort_keys=True).encode())
    try:
        wait_for_collections(client, bucket, phase)
    except BaseException:
        unpin(client, bucket, key)
        raise
    return key


def unpin(client: Client, bucket: str, key: str) -> Optional[str]:
    """Remove a pin (best effort, also after a cancel); returns why it failed, None if done."""
    with client.cleanup():
        try:
            client.remove("upload", bucket, key)
            return None
        except StorageError as e:
            return e.reason


def _live_locks(client: Client, bucket: str, phase: str) -> list[tuple[str, dict]]:
    t = client.transfer
    out = []
    for name, _, is_dir in client.list(phase, bucket, LOCKS, recursive=True):
        if is_dir:
            continue
        try:
            rec = json.loads(client.get_bytes(phase, bucket, name, 1 << 20))
            end = float(rec["started_unix"]) + float(rec["lease_s"]) + t.clock_skew_s
        except NotFound:
            continue  # ended meanwhile
        except (ValueError, KeyError, TypeError):
            rec, end = {}, float("inf")  # unreadable: treated as live until removed
        if end >= time.time():
            out.append((name, rec))
    return out


def wait_for_collections(client: Client, bucket: str, phase: str) -> None:
    """Return once no live collection lock exists; ``StorageError`` naming the lock when the
    operation's deadline comes first (or on cancel)."""
    seen = None

    def waited(name, rec) -> StorageError:
        return StorageError(
            phase,
            f"a chunk collection is running (lock {name}, node {rec.get('node')}, since "
            f"{rec.get('started_at')}, lease {rec.get('lease_s')} s); the upload waited for "
            "it until its deadline; nothing was uploaded",
            bucket=bucket,
        )

    while True:
        try:
            live = _live_locks(client, bucket, phase)
        except StorageError:
            # the deadline passed during a look at the lock: still the collection's doing
            over = client.deadline is not None and time.monotonic() > client.deadline
            if seen is not None and over:
                raise waited(*seen) from None
            raise
        if not live:
            return
        seen = live[0]
        late = client.deadline is not None and time.monotonic() + WAIT_POLL_S > client.deadline
        if late or client.cancel.wait(WAIT_POLL_S):
            raise waited(*seen)


def manifest_keys(client: Client, bucket: str, phase: str) -> list[str]:
    """Every ``*/manifest.json`` key of the bucket outside ``.cuinterpose/`` (a walk of the
    prefixes, one LIST per prefix)."""
    out, todo = [], [""]
    while todo:
        prefix = todo.pop()
        for name, _, is_dir in client.list(phase, bucket, prefix, recursive=False):
            if is_dir:
                if name != f"{RESERVED}/":
                    todo.append(name)
            elif name.endswith(MANIFEST_SUFFIX):
                out.append(name)
    return sorted(out)


def manifest_chunks(m: dict, where: str, phase: str) -> set:
    """(checksum, hex) of every non-zero chunk ``m`` names; ``StorageError`` for malformed
    streams."""
    out = set()
    for rec_name in ("chunks", "gpu_storage"):
        rec = m.get(rec_name)
        if rec is None:
            continue
        try:
            alg = rec["checksum"]
            for s in rec.get("streams") or []:
                out.update((alg, c) for c in s["checksums"] if c is not None)
        except (KeyError, TypeError, AttributeError) as e:
            raise StorageError(
                phase,
                f"{where}: field {rec_name} is malformed ({type(e).__name__}: {e}); the chunks "
                "it refers to are unknown, so none is collected",
            ) from None
    return out


def _read_manifests(client: Client, bucket: str, skip: Optional[str], phase: str) -> set:
    live: set = set()
    for key in manifest_keys(client, bucket, phase):
        if key == skip:
            continue
        try:
            data = client.get_bytes(phase, bucket, key, layout.MANIFEST_MAX_BYTES)
        except NotFound:
            continue  # deleted meanwhile
        try:
            m = json.loads(data)
        except ValueError:
            raise StorageError(
                phase,
                "is not valid JSON: the chunks it refers to are unknown, so none is "
                "collected; repair or remove that snapshot first",
                bucket=bucket,
                key=key,
            ) from None
        if isinstance(m, dict) and m.get("format") == layout.FORMAT:
            live |= manifest_chunks(m, f"s3://{bucket}/{key}", phase)
    return live


def _read_pins(client: Client, bucket: str, phase: str, drop_older_than_s) -> tuple[set, list]:
    held, pins = set(), []
    for key, _, is_dir in client.list(phase, bucket, PINS, recursive=True):
        if is_dir:
            continue
        try:
            rec = json.loads(client.get_bytes(phase, bucket, key, layout.MANIFEST_MAX_BYTES))
            chunks = {(a, h) for a, hs in rec["chunks"].items() for h in hs}
            started = float(rec["started_unix"])
        except NotFound:
            continue
        except (ValueError, KeyError, TypeError, AttributeError):
            raise StorageError(
                phase,
                "pin cannot be read: what it holds is unknown, so no chunk is collected; "
                "remove it once no upload needs it",
                bucket=bucket,
                key=key,
            ) from None
        if drop_older_than_s is not None and time.time() - started > drop_older_than_s:
            client.remove(phase, bucket, key)
            continue
        held |= chunks
        pins.append({k: rec.get(k) for k in ("location", "node", "started_at")} | {"key": key})
    return held, pins


def collect_bucket(
    client: Client,
    bucket: str,
    *,
    phase: str = "delete",
    skip: Optional[str] = None,
    before_sweep: Callable[[], int] = lambda: 0,
    drop_pins_older_than_s: Optional[float] = None,
) -> dict:
    """Take the collection lock, list pins and then manifests (all but ``skip``), call
    ``before_sweep()`` (a delete removes its snapshot there; returns objects removed), remove
    every chunk object neither names (within the lease), release the lock. Returns
    ``{"objects_removed", "chunks_removed", "chunk_bytes_freed", "chunks_kept", "pins"}``.
    Raises ``StorageError`` (nothing removed) for an unreadable manifest or pin."""
    t = client.transfer
    lock = f"{LOCKS}{uuid.uuid4().hex}.json"
    t0 = time.monotonic()
    client.put(phase, bucket, lock, json.dumps(_record(lease_s=t.lease_s)).encode())
    try:
        hook("collect locked")
        pinned, pins = _read_pins(client, bucket, phase, drop_pins_older_than_s)
        live = _read_manifests(client, bucket, skip, phase)
        removed_objects = before_sweep()
        objs = client.list(phase, bucket, CHUNKS, recursive=True)
        doomed, kept = [], 0
        for name, size, is_dir in objs:
            ident = parse_chunk_key(name) if not is_dir else None
            if ident is None:
                continue  # not a chunk object: never touched
            if ident in live or ident in pinned:
                kept += 1
            else:
                doomed.append((name, size))
        freed = [0, 0]
        lk = threading.Lock()
        margin = max(1.0, t.read_timeout_s)

        def remove(name: str, size: int):
            def job():
                if time.monotonic() - t0 > t.lease_s - margin:
                    raise StorageError(
                        phase,
                        f"the collection's lease ({t.lease_s:g} s) ran out; {len(doomed)} chunk "
                        "objects were due, run the collection again for the rest",
                        bucket=bucket,
                    )
                client.remove(phase, bucket, name)
                with lk:
                    freed[0] += 1
                    freed[1] += size

            return job

        run_jobs((remove(n, s) for n, s in doomed), t.threads, client.cancel)
        return {
            "objects_removed": removed_objects,
            "chunks_removed": freed[0],
            "chunk_bytes_freed": freed[1],
            "chunks_kept": kept,
            "pins": tuple(pins),
        }
    finally:
        with client.cleanup():
            try:
                client.remove(phase, bucket, lock)
            except StorageError:
                pass  # stale after its lease: uploads then ignore it


def remove_prefix(client: Client, bucket: str, prefix: str, phase: str) -> int:
    """Remove ``prefix/manifest.json`` first (the snapshot stops existing), then every other
    object under ``prefix/``; returns how many objects were removed."""
    mkey = f"{prefix}{MANIFEST_SUFFIX}"
    client.remove(phase, bucket, mkey)
    rest = [n for n, _, d in client.list(phase, bucket, prefix + "/", recursive=True) if not d]
    run_jobs(
        (lambda n=n: client.remove(phase, bucket, n) for n in rest if n != mkey),
        client.transfer.threads,
        client.cancel,
    )
    return 1 + len([n for n in rest if n != mkey])


def client_for(opts: StorageOptions, phase: str) -> Client:
    if opts.s3 is None:
        raise StorageError(phase, "no S3 settings (StorageOptions.s3; awsconf.resolve())")
    return Client(opts.s3, opts.transfer, cancel=opts.cancel)


def delete(location: str, opts: StorageOptions) -> DeleteResult:
    """Remove the snapshot at ``s3://BUCKET/PREFIX`` (its manifest first, then its other
    objects) and collect the bucket's chunks (module docstring). Refuses (``StorageError``,
    phase "delete", nothing removed) a location without a manifest and a bucket whose other
    manifests or pins cannot be read."""
    loc = parse_location(location)
    client = client_for(opts, "delete")
    mkey = f"{loc.key}{MANIFEST_SUFFIX}"
    if client.head("delete", loc.bucket, mkey) is None:
        raise StorageError(
            "delete", "no manifest: not a snapshot; nothing removed", bucket=loc.bucket, key=mkey
        )
    out = collect_bucket(
        client,
        loc.bucket,
        skip=mkey,
        before_sweep=lambda: remove_prefix(client, loc.bucket, loc.key, "delete"),
    )
    return DeleteResult(str(loc), **out)


def collect(
    location: str, opts: StorageOptions, *, drop_pins_older_than_s: Optional[float] = None
) -> DeleteResult:
    """Collect the chunks of the bucket of ``location`` (``s3://BUCKET`` or any prefix of it)
    without deleting a snapshot: after an interrupted upload or a removal by other means.
    ``drop_pins_older_than_s``: remove pins older than that first (dead uploaders)."""
    loc = parse_location(location, root=True)
    client = client_for(opts, "delete")
    out = collect_bucket(client, loc.bucket, drop_pins_older_than_s=drop_pins_older_than_s)
    return DeleteResult(str(loc), **out)

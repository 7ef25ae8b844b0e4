"""The S3-compatible object-store backend: ``s3://BUCKET/PREFIX`` (docs/snapshot-format.md
"Object store"; decisions D40).

A snapshot at ``s3://BUCKET/PREFIX`` is::

    PREFIX/criu/<root>/...        its CRIU images, one object per file (multipart above
                                  TransferOptions.part_bytes)
    PREFIX/manifest.json          written LAST: the commit point; a prefix without it is no
                                  snapshot (list skips it, pull refuses it)
    .cuinterpose/chunks/<checksum>/<2 hex>/<64 hex>
                                  its non-zero chunks (shim carriers and native GPU storage),
                                  content-addressed by the digest the manifest records, shared
                                  by every snapshot of the bucket (agent/snapshot/backends/s3gc.py)

:func:`~.s3push.push` (agent/snapshot/backends/s3push.py) uploads a complete local snapshot
(after restore's file checks, and with a node key only one whose MAC is valid): a pin first,
then in a bounded pool every chunk the bucket lacks (a HEAD per distinct chunk; each chunk's
digest is verified before it is sent, so a damaged local chunk never poisons the shared store)
and every image (each image's SHA-256 verified), then the manifest; its :class:`~.s3push.Push`
does it in two halves, the chunks before the manifest exists. A chunk-store (``--incremental``)
snapshot's manifest is stored in the file-stream form (agent/snapshot/backends/layout.py
``plain``), signed again with the node key. A failed push changes nothing local, writes no
manifest, removes the objects it put under the prefix and its pins (best effort; the chunks
it sent are collected later).

:func:`pull` builds a plain snapshot directory in a missing or empty local directory: the
manifest first read (with a node key, its MAC checked) and planned, then chunks by whole-object
GETs (each digest verified as it arrives; zero chunks left as holes; a chunk used twice fetched
once) and images by parallel ranged GETs (SHA-256 verified), restore's file checks, and the
manifest written last. A failed pull removes what it wrote and never writes to the bucket.

Memory in flight is at most about ``threads * part_bytes``. Errors: ``StorageError`` naming the
phase, bucket and key.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

from cuinterpose.agent.snapshot.backends import layout, s3gc, s3push
from cuinterpose.agent.snapshot.backends.api import (
    RESERVED,
    Backend,
    PullResult,
    SnapshotInfo,
    StorageError,
    StorageOptions,
    parse_location,
)
from cuinterpose.agent.snapshot.backends.s3io import Client, NotFound, Retry
from cuinterpose.agent.snapshot.backends.s3push import part_bytes as _part_bytes
from cuinterpose.agent.snapshot.backends.transfer import PIECE, Meter, run_jobs
from cuinterpose.agent.snapshot.snapdir import MANIFEST


def _get_manifest(c: Client, bucket: str, key: str, phase: str) -> bytes:
    try:
        return c.get_bytes(phase, bucket, key, layout.MANIFEST_MAX_BYTES)
    except NotFound:
        raise StorageError(
            phase,
            "no manifest: not a snapshot (an upload that did not finish leaves none)",
            bucket=bucket,
            key=key,
        ) from None


class _Download:
    """One pull: the client, the target, the meter, the counters."""

    def __init__(self, c: Client, bucket: str, prefix: str, target: layout.Target, meter: Meter):
        self.c, self.bucket, self.prefix, self.t, self.meter = c, bucket, prefix, target, meter
        self.part = c.transfer.part_bytes
        self.lock = threading.Lock()
        self.pending: dict[str, int] = {}  # image rel -> parts still to come

    def chunk_job(self, alg: str, hexd: str, where: list):
        def job():
            key = s3gc.chunk_key(alg, hexd)
            s0, _ = where[0]
            n = s0.length(where[0][1])
            h = [None]

            def begin():
                h[0] = layout.hasher(alg)

            def sink(pos, piece):
                h[0].update(piece)
                for s, i in where:
                    self.t.pwrite(s.rel, piece, i * s.chunk_bytes + pos)

            def verify():
                got = h[0].hexdigest()
                if got != hexd:
                    raise Retry(f"chunk object has {alg} {got}, not the {hexd} its key names")

            try:
                self.c.get(
                    "download",
                    self.bucket,
                    key,
                    length=n,
                    whole=True,
                    sink=sink,
                    begin=begin,
                    verify=verify,
                )
            except NotFound:
                raise StorageError(
                    "download",
                    f"chunk object is missing (chunk {where[0][1]} of {s0.rel})",
                    bucket=self.bucket,
                    key=key,
                ) from None
            self.meter.add(transferred=n)

        return job

    def image_jobs(self, img: layout.Image):
        key = f"{self.prefix}/{img.rel}"
        if img.bytes <= self.part:
            h = [None]

            def begin():
                h[0] = hashlib.sha256()

            def sink(pos, piece):
                h[0].update(piece)
                self.t.pwrite(img.rel, piece, pos)

            def verify():
                if h[0].hexdigest() != img.sha256:
                    raise Retry(f"image object has sha256 {h[0].hexdigest()}, not {img.sha256}")

            def job():
                self._get(key, img, 0, img.bytes, True, sink, begin, verify)

            return [job]
        part = _part_bytes(img.bytes, self.part)
        offs = list(range(0, img.bytes, part))
        self.pending[img.rel] = len(offs)

        def ranged(off):
            def job():
                n = min(part, img.bytes - off)
                self._get(
                    key, img, off, n, False, lambda pos, piece: self.t.pwrite(img.rel, piece, pos)
                )
                with self.lock:
                    self.pending[img.rel] -= 1
                    last = self.pending[img.rel] == 0
                if last:
                    self._verify_image(key, img)

            return job

        return [ranged(o) for o in offs]

    def _get(self, key, img, off, n, whole, sink, begin=lambda: None, verify=lambda: None):
        try:
            self.c.get(
                "download",
                self.bucket,
                key,
                offset=off,
                length=n,
                whole=whole,
                sink=sink,
                begin=begin,
                verify=verify,
            )
        except NotFound:
            raise StorageError(
                "download", f"CRIU image {img.rel} is missing", bucket=self.bucket, key=key
            ) from None
        self.meter.add(transferred=n)

    def _verify_image(self, key: str, img: layout.Image) -> None:
        h = hashlib.sha256()
        fd = self.t.fd(img.rel)
        try:
            for pos in range(0, img.bytes, PIECE):
                h.update(os.pread(fd, min(PIECE, img.bytes - pos), pos))
        except OSError as e:
            raise StorageError(
                "download", f"reading {self.t.path / img.rel} back failed: {e.strerror}"
            ) from None
        if h.hexdigest() != img.sha256:
            raise StorageError(
                "download",
                f"CRIU image {img.rel} has sha256 {h.hexdigest()}, the manifest says {img.sha256}",
                bucket=self.bucket,
                key=key,
            )


def pull(location: str, target_dir, opts: StorageOptions) -> PullResult:
    """Download the snapshot at ``location`` into ``target_dir`` (missing, or an empty
    directory) as a plain snapshot directory (module docstring). Refuses (``StorageError``,
    phase "download"; the target removed, the bucket untouched) a prefix without a manifest,
    a manifest without a valid MAC when ``opts.node_key`` is set, a malformed manifest, a
    chunk or image whose bytes do not match its digest after every retry, and a result that
    fails restore's file checks."""
    t0 = time.monotonic_ns()
    loc = parse_location(location)
    c = s3gc.client_for(opts, "download")
    mkey = f"{loc.key}/{MANIFEST}"
    data = _get_manifest(c, loc.bucket, mkey, "download")
    try:
        m = layout.loads(data, "the manifest", "download")
        layout.check_mac(m, opts.node_key, "the manifest", "download")
        p = layout.plan(m, phase="download")
    except StorageError as e:  # name the object
        raise StorageError(
            "download", f"{e.detail}; nothing was written", bucket=loc.bucket, key=mkey
        ) from None
    uses = p.chunk_uses()
    total = p.image_bytes() + p.chunk_bytes()
    t = layout.Target(target_dir, "download")
    try:
        t.open_files(p)
        dl = _Download(c, loc.bucket, loc.key, t, Meter("download", str(loc), total, opts.progress))
        jobs = [dl.chunk_job(alg, h, u) for (alg, h), u in sorted(uses.items())]
        for img in sorted(p.images, key=lambda i: -i.bytes):
            jobs += dl.image_jobs(img)
        run_jobs(jobs, opts.transfer.threads, c.cancel)
        layout.check_local(t.path, m, "download")
        t.commit(data)
    except BaseException as e:
        t.discard()
        if isinstance(e, StorageError):
            raise e.again("download", f"; {t.path} was removed, the bucket is untouched") from None
        raise
    dl.meter.finish()
    return p.pulled(str(loc), t.path, time.monotonic_ns() - t0)


def stat(location: str, opts: StorageOptions) -> SnapshotInfo:
    """The snapshot at ``location``; ``StorageError`` (phase "stat") when it has no manifest."""
    loc = parse_location(location)
    c = s3gc.client_for(opts, "stat")
    mkey = f"{loc.key}/{MANIFEST}"
    data = _get_manifest(c, loc.bucket, mkey, "stat")
    return layout.snapshot_info(
        str(loc), data, layout.loads(data, f"s3://{loc.bucket}/{mkey}", "stat")
    )


def list_snapshots(root: str, opts: StorageOptions) -> list[SnapshotInfo]:
    """The snapshots directly under ``root`` (``s3://BUCKET`` or ``s3://BUCKET/PREFIX``):
    every ``root/NAME/`` holding ``manifest.json``, by name; a prefix without one is skipped.
    A manifest that is not JSON raises ``StorageError`` (phase "list") naming it."""
    loc = parse_location(root, root=True)
    c = s3gc.client_for(opts, "list")
    base = f"{loc.key}/" if loc.key else ""
    out = []
    for name, _, is_dir in c.list("list", loc.bucket, base, recursive=False):
        if not is_dir or name == f"{RESERVED}/":
            continue
        mkey = f"{name}{MANIFEST}"
        try:
            data = c.get_bytes("list", loc.bucket, mkey, layout.MANIFEST_MAX_BYTES)
        except NotFound:
            continue
        m = layout.loads(data, f"s3://{loc.bucket}/{mkey}", "list")
        out.append(layout.snapshot_info(f"s3://{loc.bucket}/{name.rstrip('/')}", data, m))
    return out


BACKEND = Backend(
    scheme="s3",
    push=s3push.push,
    begin_push=s3push.Push,
    pull=pull,
    list=list_snapshots,
    delete=s3gc.delete,
    stat=stat,
    collect=s3gc.collect,
)

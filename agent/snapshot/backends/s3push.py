"""Pushing a local snapshot to ``s3://BUCKET/PREFIX`` (the layout: agent/snapshot/backends/s3.py;
docs/snapshot-format.md "Object store"; decisions D47, D67).

:class:`Push` is one push in two halves, so that a checkpoint can send its chunks while it
still syncs its images (agent/run/upload.py):

- :meth:`Push.begin` (optional): in a background thread, claim the prefix (refused when a
  manifest is there; objects of an earlier push that never committed are removed), pin the
  chunks of the streams given (the ``chunks``/``gpu_storage`` records as the manifest will hold
  them) and send those the bucket lacks;
- :meth:`Push.commit`: wait for that half, read the complete local snapshot (restore's file
  checks, the MAC with a node key), pin and send the chunks the first half did not cover, the
  CRIU images, and the manifest last (the commit point); returns the ``PushResult`` of both
  halves together;
- :meth:`Push.cancel`: stop its requests from another thread (a signal);
- :meth:`Push.abort`: stop a push that will not commit and undo what it wrote (its images
  and pins; the chunks it sent wait for a collection).

:func:`push` is both halves at once (the backend table's ``push``). Every chunk's digest is
checked before it is sent; a failed push changes nothing local, writes no manifest, removes
the objects it put under the prefix and its pins (best effort). Errors: ``StorageError``
(phase "upload") naming the bucket and key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from typing import Optional

from cuinterpose.agent.snapshot.backends import layout, s3gc
from cuinterpose.agent.snapshot.backends.api import (
    PushResult,
    StorageError,
    StorageOptions,
    parse_location,
)
from cuinterpose.agent.snapshot.backends.s3io import Client
from cuinterpose.agent.snapshot.backends.transfer import PIECE, Meter, run_jobs
from cuinterpose.agent.snapshot.snapdir import MANIFEST, SnapshotDir

MAX_PARTS = 10_000  # S3 multipart limit


def part_bytes(size: int, part: int) -> int:
    """The part size for an object of ``size`` bytes: ``part``, larger (whole MiB) when it
    would need more than 10,000 parts."""
    need = -(-size // MAX_PARTS)
    return max(part, -(-need // (1 << 20)) << 20)


def _pread(snap: SnapshotDir, rel: str, off: int, n: int) -> bytes:
    """``n`` bytes of ``rel`` (a file of the local snapshot ``snap``, or a pack) from ``off``;
    ``StorageError`` (phase "upload") naming the file when it cannot be read or is shorter."""
    path = snap.file(rel)
    try:
        fd = snap.open(rel, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            out = bytearray()
            while len(out) < n:
                piece = os.pread(fd, n - len(out), off + len(out))
                if not piece:
                    raise StorageError("upload", f"{path} ends before byte {off + n}")
                out += piece
            return bytes(out)
        finally:
            os.close(fd)
    except OSError as e:
        raise StorageError("upload", f"{path} cannot be read: {e.strerror}") from None


def _digest(h, data, snap: SnapshotDir, rel: str, off: int, n: int) -> str:
    """Hex digest of ``data``, or (``data`` None) of ``n`` bytes of ``rel`` from ``off``."""
    if data is not None:
        h.update(data)
        return h.hexdigest()
    for pos in range(0, n, PIECE):
        h.update(_pread(snap, rel, off + pos, min(PIECE, n - pos)))
    return h.hexdigest()


@dataclasses.dataclass
class _Counts:
    uploaded: int = 0
    uploaded_bytes: int = 0
    present: int = 0
    present_bytes: int = 0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class _Upload:
    """One push: the client, the local snapshot, what was put under the prefix."""

    def __init__(self, client: Client, bucket: str, prefix: str, d: SnapshotDir, meter: Meter):
        self.c, self.bucket, self.prefix, self.d, self.meter = client, bucket, prefix, d, meter
        self.counts = _Counts()
        #: (checksum, hex digest) of the chunks known to be in the bucket (sent or present)
        self.sent: set = set()
        self.put_keys: list[str] = []
        self.uploads: dict[str, str] = {}  # key -> open multipart upload id
        self.lock = threading.Lock()
        self.part = client.transfer.part_bytes

    def _put_object(self, key: str, rel: str, off: int, n: int, check) -> None:
        """``n`` bytes of ``rel`` (in the local snapshot) from ``off`` as object ``key``: one
        PUT up to a part, else a multipart upload whose parts are read one at a time.
        ``check(data)`` verifies the bytes first and raises when they are wrong (``data``
        None: it reads the file itself)."""
        if n <= self.part:
            data = _pread(self.d, rel, off, n)
            check(data)
            self.c.put("upload", self.bucket, key, data)
            return
        check(None)
        part = part_bytes(n, self.part)
        uid = self.c.multipart_begin("upload", self.bucket, key)
        with self.lock:
            self.uploads[key] = uid
        etags = [
            self.c.multipart_part(
                "upload",
                self.bucket,
                key,
                uid,
                k + 1,
                _pread(self.d, rel, off + pos, min(part, n - pos)),
            )
            for k, pos in enumerate(range(0, n, part))
        ]
        self.c.multipart_complete("upload", self.bucket, key, uid, etags)
        with self.lock:
            del self.uploads[key]

    def chunk_job(self, alg: str, hexd: str, s: layout.Stream, i: int):
        def job():
            key = s3gc.chunk_key(alg, hexd)
            n = s.length(i)
            if self.c.head("upload", self.bucket, key) == n:
                with self.counts.lock:
                    self.counts.present += 1
                    self.counts.present_bytes += n
                    self.sent.add((alg, hexd))
                self.meter.add(present=n)
                return
            rel, off = layout.chunk_file(s, i)
            path = self.d.file(rel)

            def check(data):
                got = _digest(layout.hasher(alg), data, self.d, rel, off, n)
                if got != hexd:
                    raise StorageError(
                        "upload",
                        f"chunk {i} of {s.rel} ({path}, {n} bytes at offset {off}) has {alg} "
                        f"{got}, the manifest says {hexd}: the local snapshot is damaged; "
                        "nothing that refers to it was committed",
                    )

            self._put_object(key, rel, off, n, check)
            with self.counts.lock:
                self.counts.uploaded += 1
                self.counts.uploaded_bytes += n
                self.sent.add((alg, hexd))
            self.meter.add(transferred=n)

        return job

    def image_job(self, img: layout.Image):
        def job():
            key = f"{self.prefix}/{img.rel}"
            path = self.d.file(img.rel)

            def check(data):
                got = _digest(hashlib.sha256(), data, self.d, img.rel, 0, img.bytes)
                if got != img.sha256:
                    raise StorageError(
                        "upload",
                        f"CRIU image {path} has sha256 {got}, the manifest says {img.sha256}: "
                        "the local snapshot is damaged; nothing was committed",
                    )

            with self.lock:
                self.put_keys.append(key)
            self._put_object(key, img.rel, 0, img.bytes, check)
            self.meter.add(transferred=img.bytes)

        return job

    def undo(self, pin_keys) -> list[str]:
        """After a failure: abort open multipart uploads, remove what was put under the prefix
        and the pins (best effort); returns what could not be removed."""
        left = []
        with self.c.cleanup():
            for key, uid in list(self.uploads.items()):
                self.c.multipart_abort(self.bucket, key, uid)
            for key in self.put_keys:
                try:
                    self.c.remove("upload", self.bucket, key)
                except StorageError:
                    left.append(key)
        left += [k for k in pin_keys if s3gc.unpin(self.c, self.bucket, k) is not None]
        return left


class Push:
    """One push of a local snapshot to ``location`` (module docstring). ``opts.progress`` gets
    the rows of both halves as one transfer (its total grows when :meth:`commit` adds the
    images and any chunk the first half did not know)."""

    def __init__(self, location: str, opts: StorageOptions):
        self.t0 = time.monotonic_ns()
        self.loc = parse_location(location)
        self.opts = opts
        self.c = s3gc.client_for(opts, "upload")
        self.mkey = f"{self.loc.key}/{MANIFEST}"
        self.meter = Meter("upload", str(self.loc), 0, opts.progress)
        self.pins: list[str] = []
        self.up: Optional[_Upload] = None
        self.claimed = False
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        #: bytes and chunks the first half sent or found present (before the commit began)
        self.early = (0, 0)

    def check_free(self) -> None:
        """Refuse (``StorageError`` phase "upload") when a snapshot is at the location already;
        an unreachable endpoint or refused credentials raise here too. Nothing is written."""
        if self.c.head("upload", self.loc.bucket, self.mkey) is not None:
            raise StorageError(
                "upload",
                "a snapshot is already there; delete it first (nothing was uploaded)",
                bucket=self.loc.bucket,
                key=self.mkey,
            )

    def _claim(self, d: SnapshotDir) -> None:
        if self.claimed:
            return
        self.check_free()
        # objects of an earlier push that never committed: this push claims the prefix
        for name, _, is_dir in self.c.list(
            "upload", self.loc.bucket, self.loc.key + "/", recursive=True
        ):
            if not is_dir:
                self.c.remove("upload", self.loc.bucket, name)
        self.up = _Upload(self.c, self.loc.bucket, self.loc.key, d, self.meter)
        self.claimed = True

    def _send_chunks(self, uses: dict) -> None:
        """Pin the chunks of ``uses`` the bucket is not known to hold, then send those it
        lacks."""
        todo = {k: u for k, u in uses.items() if k not in self.up.sent}
        if not todo:
            return
        with self.meter._lock:
            self.meter.total += sum(u[0][0].length(u[0][1]) for u in todo.values())
        self.pins.append(s3gc.pin(self.c, self.loc.bucket, str(self.loc), todo.keys()))
        s3gc.hook("upload pinned")
        jobs = [self.up.chunk_job(alg, h, *u[0]) for (alg, h), u in sorted(todo.items())]
        run_jobs(jobs, self.opts.transfer.threads, self.c.cancel)

    def begin(self, snapshot_dir, streams: dict) -> None:
        """Start the first half in a background thread: the chunks of ``streams`` (a dict with
        the manifest's ``chunks`` and ``gpu_storage`` records) from the local snapshot
        ``snapshot_dir``. Its failure is raised by :meth:`commit`."""
        d = SnapshotDir(os.path.abspath(snapshot_dir))

        def run():
            try:
                uses = layout.streams(streams, phase="upload", allow_store=True).chunk_uses()
                self._claim(d)
                self._send_chunks(uses)
            except BaseException as e:  # raised again by commit (or dropped by abort)
                self.error = e

        self.thread = threading.Thread(target=run, name="s3-push-early", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Until the first half ended (it has no deadline of its own beyond the requests');
        sets :attr:`early`."""
        if self.thread is not None:
            self.thread.join()
        if self.up is not None and self.early == (0, 0):
            with self.up.counts.lock:
                k = self.up.counts
                self.early = (k.uploaded_bytes + k.present_bytes, k.uploaded + k.present)

    def commit(self, snapshot_dir) -> PushResult:
        """The second half (module docstring). Refuses (``StorageError``, phase "upload")
        a directory that is no snapshot or fails restore's file checks, a manifest without a
        valid MAC when ``opts.node_key`` is set, and a location that already holds a manifest;
        any failure undoes the push (:meth:`abort`)."""
        snap = SnapshotDir(os.path.abspath(snapshot_dir))
        d = snap.path
        self.wait()
        try:
            if self.error is not None:
                raise self.error
            try:
                data, m = layout.local_manifest(snap, "upload")
                layout.check_mac(m, self.opts.node_key, str(snap.manifest_path), "upload")
                p = layout.plan(m, phase="upload", allow_store=True)
                layout.check_local(d, m, "upload")
            except StorageError as e:
                raise e.again("upload", f"; {d} is not pushed, nothing was committed") from None
            out, rewritten = layout.plain(m)
            body = layout.dumps(layout.signed(out, self.opts.node_key)) if rewritten else data
            self._claim(snap)
            if self.up.d.path != d:
                raise StorageError(
                    "upload", f"{d} is not the snapshot the push began with ({self.up.d.path})"
                )
            self._send_chunks(p.chunk_uses())
            with self.meter._lock:
                self.meter.total += p.image_bytes()
            jobs = [self.up.image_job(i) for i in sorted(p.images, key=lambda i: -i.bytes)]
            run_jobs(jobs, self.opts.transfer.threads, self.c.cancel)
            s3gc.hook("upload sent")
            self.c.put("upload", self.loc.bucket, self.mkey, body)  # the commit point
        except BaseException as e:
            left = self._undo()
            if isinstance(e, StorageError):
                note = (
                    f"; left in the bucket: {', '.join(left)}"
                    if left
                    else "; its objects were removed"
                )
                raise e.again(
                    "upload",
                    f". No manifest was written (no snapshot at {self.loc}); the local snapshot "
                    f"{d} is unchanged{note}",
                ) from None
            raise
        whys = [w for w in (s3gc.unpin(self.c, self.loc.bucket, k) for k in self.pins) if w]
        self.meter.finish()
        k = self.up.counts
        counts = (k.uploaded, k.uploaded_bytes, k.present, k.present_bytes)
        res = p.pushed(str(self.loc), self.mkey, counts, rewritten, time.monotonic_ns() - self.t0)
        if not whys:
            return res
        note = (
            f"the snapshot is committed, but its pin(s) under s3://{self.loc.bucket}/"
            f"{s3gc.PINS} could not be removed ({whys[0]}): collections keep its chunks until "
            "they are removed"
        )
        return dataclasses.replace(res, notes=(note,))

    def _undo(self) -> list[str]:
        if self.up is None:
            return [k for k in self.pins if s3gc.unpin(self.c, self.loc.bucket, k) is not None]
        return self.up.undo(self.pins)

    def cancel(self) -> None:
        """Stop the push's requests (from any thread): the running half fails with "cancelled"."""
        self.c.cancel.set()

    def abort(self) -> list[str]:
        """Stop a push that will not commit (cancel its requests, wait for its first half)
        and undo what it wrote; returns the keys that could not be removed. Idempotent."""
        self.c.cancel.set()
        self.wait()
        left, self.pins = self._undo(), []
        if self.up is not None:
            self.up.put_keys.clear()
        return left


def push(snapshot_dir, location: str, opts: StorageOptions) -> PushResult:
    """Upload the complete local snapshot ``snapshot_dir`` to ``location``: :class:`Push`'s
    two halves at once (module docstring; raises as :meth:`Push.commit`)."""
    return Push(location, opts).commit(snapshot_dir)

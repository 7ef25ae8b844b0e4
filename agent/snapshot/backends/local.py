"""The local-directory backend (the default): a location is a directory path, a snapshot
root its parent (docs/snapshot-format.md).

``push``/``pull`` copy a snapshot between two local directories into the plain form (chunk
files laid out sparse, a chunk-store snapshot's packs and refs resolved and its manifest
converted and re-signed, as the S3 backend does; agent/snapshot/backends/layout.py), every
chunk's digest and every image's SHA-256 verified on the way, the manifest written last:
moving a snapshot to a disk that another node mounts. ``list`` is the snapshot directories
of a root, ``delete`` is agent/snapshot/store.py ``delete`` (the chunk store collected),
``stat`` reads one manifest. Nothing here changes the source of a copy; a failed copy removes
what it wrote. Errors: ``StorageError`` (``AgentError`` from store.delete).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import threading
import time

from cuinterpose.agent.snapshot import snapdir, store
from cuinterpose.agent.snapshot.backends import layout
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
from cuinterpose.agent.snapshot.backends.transfer import PIECE, Meter, run_jobs


def _read(snap: snapdir.SnapshotDir, rel: str, off: int, n: int, h, sink, phase: str) -> str:
    """Read ``n`` bytes of ``rel`` (a name in the snapshot ``snap``, or a pack) from ``off`` in
    pieces into ``h`` and ``sink(pos, piece)``; returns the hex digest."""
    path = snap.file(rel)
    try:
        fd = snap.open(rel, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise StorageError(phase, f"{path} cannot be opened: {e.strerror}") from None
    try:
        for pos in range(0, n, PIECE):
            piece = os.pread(fd, min(PIECE, n - pos), off + pos)
            if len(piece) != min(PIECE, n - pos):
                raise StorageError(phase, f"{path} ends before byte {off + n}")
            h.update(piece)
            sink(pos, piece)
    except OSError as e:
        raise StorageError(phase, f"{path} cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    return h.hexdigest()


def _copy(src, dst, opts: StorageOptions, phase: str):
    """Copy snapshot directory ``src`` into ``dst`` (missing or empty) in the plain form;
    returns (plan, manifest rewritten?, meter)."""
    snap = snapdir.SnapshotDir(os.path.abspath(src))
    src = snap.path
    data, m = layout.local_manifest(snap, phase)
    layout.check_mac(m, opts.node_key, str(snap.manifest_path), phase)
    p = layout.plan(m, phase=phase, allow_store=True)
    layout.check_local(src, m, phase)
    out, rewritten = layout.plain(m)
    body = layout.dumps(layout.signed(out, opts.node_key)) if rewritten else data
    uses = p.chunk_uses()
    meter = Meter(phase, str(dst), p.image_bytes() + p.chunk_bytes(), opts.progress)
    t = layout.Target(dst, phase)

    def chunk_job(alg, hexd, where):
        def job():
            s, i = where[0]
            rel, off = layout.chunk_file(s, i)
            path = snap.file(rel)

            def sink(pos, piece):
                for s2, i2 in where:
                    t.pwrite(s2.rel, piece, i2 * s2.chunk_bytes + pos)

            got = _read(snap, rel, off, s.length(i), layout.hasher(alg), sink, phase)
            if got != hexd:
                raise StorageError(
                    phase,
                    f"chunk {i} of {s.rel} ({path} at offset {off}) has {alg} {got}, the "
                    f"manifest says {hexd}: {src} is damaged",
                )
            meter.add(transferred=s.length(i))

        return job

    def image_job(img):
        def job():
            got = _read(
                snap,
                img.rel,
                0,
                img.bytes,
                hashlib.sha256(),
                lambda pos, piece: t.pwrite(img.rel, piece, pos),
                phase,
            )
            if got != img.sha256:
                raise StorageError(
                    phase, f"CRIU image {src / img.rel} has sha256 {got}, not {img.sha256}"
                )
            meter.add(transferred=img.bytes)

        return job

    try:
        t.open_files(p)
        jobs = [chunk_job(a, h, u) for (a, h), u in sorted(uses.items())]
        jobs += [image_job(i) for i in p.images]
        run_jobs(jobs, opts.transfer.threads, threading.Event())
        layout.check_local(t.path, out, phase)
        t.commit(body)
    except BaseException:
        t.discard()
        raise
    meter.finish()
    return p, rewritten, t.path


def push(snapshot_dir, location: str, opts: StorageOptions) -> PushResult:
    """Copy the snapshot ``snapshot_dir`` into the directory ``location`` (module docstring);
    ``StorageError`` phase "upload"."""
    t0 = time.monotonic_ns()
    loc = parse_location(location)
    if os.path.abspath(snapshot_dir) == loc.key:
        raise StorageError("upload", f"{loc.key} is the snapshot itself; nothing to copy")
    p, rewritten, path = _copy(snapshot_dir, loc.key, opts, "upload")
    n = len(p.chunk_uses())
    return p.pushed(
        str(path),
        str(snapdir.SnapshotDir(path).manifest_path),
        (n, p.chunk_bytes(), 0, 0),
        rewritten,
        time.monotonic_ns() - t0,
    )


def pull(location: str, target_dir, opts: StorageOptions) -> PullResult:
    """Copy the snapshot directory ``location`` into ``target_dir``; phase "download"."""
    t0 = time.monotonic_ns()
    loc = parse_location(location)
    p, _, path = _copy(loc.key, target_dir, opts, "download")
    return p.pulled(loc.key, path, time.monotonic_ns() - t0)


def stat(location: str, opts: StorageOptions) -> SnapshotInfo:
    loc = parse_location(location)
    data, m = layout.local_manifest(pathlib.Path(loc.key), "stat")
    return layout.snapshot_info(loc.key, data, m)


def list_snapshots(root: str, opts: StorageOptions) -> list[SnapshotInfo]:
    """The snapshot directories directly under ``root`` (those holding a regular
    ``manifest.json``), by name; the chunk store's directory is skipped."""
    base = pathlib.Path(parse_location(root, root=True).key)
    try:
        subs = snapdir.children(base)
    except OSError as e:
        raise StorageError("list", f"{base} cannot be read: {e.strerror}") from None
    out = []
    for snap in subs:
        if snap.has_manifest(follow=False):
            data, m = layout.local_manifest(snap, "list")
            out.append(layout.snapshot_info(str(snap.path), data, m))
    return out


def delete(location: str, opts: StorageOptions) -> DeleteResult:
    """agent/snapshot/store.py ``delete`` of the directory ``location``: packs are its chunks."""
    loc = parse_location(location)
    r = store.delete(loc.key)
    return DeleteResult(
        location=r["deleted"],
        objects_removed=1,
        chunks_removed=r["packs_removed"],
        chunk_bytes_freed=r["pack_bytes_freed"],
        chunks_kept=r["packs_kept"],
        pins=tuple(r["pinned"]),
    )


def collect(root: str, opts: StorageOptions) -> DeleteResult:
    """agent/snapshot/store.py ``collect`` of the snapshot root ``root`` (nothing to do, and
    nothing created, when it has no chunk store)."""
    base = parse_location(root, root=True).key
    if not os.path.lexists(os.path.join(base, store.STORE_DIR)):
        return DeleteResult(base, 0, 0, 0, 0, ())
    r = store.collect(base)
    return DeleteResult(
        base, 0, r["packs_removed"], r["pack_bytes_freed"], r["packs_kept"], tuple(r["pinned"])
    )


BACKEND = Backend(
    scheme="file",
    push=push,
    pull=pull,
    list=list_snapshots,
    delete=delete,
    stat=stat,
    collect=collect,
)

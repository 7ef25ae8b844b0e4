"""Durability of a snapshot's files: the sync pass before the manifest and the SHA-256 of
CRIU images (decisions D64). Used only through agent/snapshot/snapdir.py's ``SnapshotDir``
(``SnapshotDir.sync`` lists the files, this module syncs them), and by manifest.py to hash.

Facts used: fsync(2) makes a file's data and the metadata to read it back durable, and a
directory entry is durable once its directory is fsynced (Linux man pages); ``st_blocks``
counts 512-byte units (stat(2)).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import stat as stat_mod
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from cuinterpose.agent.errors import AgentError

SYNC_PHASE = "sync"
DIR_MODE, FILE_MODE = 0o700, 0o600

#: every file and directory of a snapshot's sync pass is made durable through this call
#: (tests record it)
_fsync = os.fsync

#: bytes read per ``readv`` while hashing (hashlib releases the GIL on buffers this large, so
#: the threads of :meth:`SnapshotDir.sync` and manifest.verify_images hash in parallel)
HASH_BLOCK = 1 << 20


def sha256_fd(fd: int, on_bytes=None) -> str:
    """SHA-256 (hex) of what is left to read on ``fd``, read in :data:`HASH_BLOCK` pieces;
    ``on_bytes(n)`` after each piece of ``n`` bytes. Raises ``OSError`` from the reads."""
    h = hashlib.sha256()
    buf = bytearray(HASH_BLOCK)
    view = memoryview(buf)
    while True:
        n = os.readv(fd, [buf])
        if not n:
            return h.hexdigest()
        h.update(view[:n])
        if on_bytes is not None:
            on_bytes(n)


def hash_threads() -> int:
    """Threads that hash (and fsync) snapshot files: the CPUs this process may run on, 2..8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 2
    return max(2, min(8, n))


def fsync_dir(d) -> None:
    """fsync(2) of the directory ``d`` (its entries durable)."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass
class Synced:
    """What :meth:`SnapshotDir.sync` did: ``images`` {path under DIR: {"sha256", "bytes"}} of
    the CRIU images (the manifest's ``criu.files``), ``files``/``dirs``: the paths fsynced
    (files in path order, directories bottom-up, parents last), ``bytes``: what the pass moved
    (image bytes read and hashed, plus the allocated bytes of the other files)."""

    images: dict
    files: list
    dirs: list
    bytes: int


def sync_files(
    base: pathlib.Path,
    files: list,
    dirs: list,
    *,
    hashed_under: pathlib.Path,
    parents: tuple = (),
    progress: Optional[Callable[[int, int], None]] = None,
    threads: Optional[int] = None,
) -> Synced:
    """The sync pass of the snapshot ``base`` over ``files`` and ``dirs`` (``SnapshotDir.sync``
    documents it); the files under ``hashed_under`` are hashed (SHA-256) as they are read.
    Raises ``AgentError`` (phase ``sync``) naming the file or directory and the errno."""
    images = hashed_under
    try:
        hashed = {p for p in files if images in p.parents}
        weights = {p: _weight(p, p in hashed) for p in files}
    except OSError as e:  # a file that went away or cannot be read while listing
        raise sync_failed(base, e.filename or base, "listing", e) from e
    total = sum(weights.values())
    lock = threading.Lock()
    done = [0]

    def add(n: int) -> None:
        with lock:  # under the lock: the callback sees the count grow, never go back
            done[0] += n
            if progress is not None:
                progress(done[0], total)

    def one(p: pathlib.Path) -> Optional[str]:
        op = "open"
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                op = "chmod"
                _private(fd, FILE_MODE)
                op = "read (sha256)"
                sha = sha256_fd(fd, add) if p in hashed else None
                op = "fsync"
                _fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _Failed(op, e) from e
        if p not in hashed:
            add(weights[p])
        return sha

    with ThreadPoolExecutor(max_workers=threads or hash_threads()) as pool:
        futs = [(p, pool.submit(one, p)) for p in files]
    out = {}
    for p, f in futs:  # the first failure in path order
        e = f.exception()
        if isinstance(e, _Failed):
            raise sync_failed(base, p, e.op, e.err) from e.err
        if e is not None:
            raise sync_failed(base, p, "fsync", e) from e
        if p in hashed:
            out[str(p.relative_to(base))] = {"sha256": f.result(), "bytes": weights[p]}
    synced_dirs = dirs + [pathlib.Path(d) for d in parents if pathlib.Path(d) not in dirs]
    for d in synced_dirs:
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if d in dirs:  # the snapshot's own directories (not the parents)
                    _private(fd, DIR_MODE)
                _fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise sync_failed(base, d, "fsync of the directory", e) from e
    if progress is not None:
        progress(total, total)
    return Synced(images=out, files=files, dirs=synced_dirs, bytes=total)


def _private(fd: int, mode: int) -> None:
    """``fchmod(fd, mode)`` when its permission bits differ (group or other could read)."""
    if stat_mod.S_IMODE(os.fstat(fd).st_mode) != mode:
        os.fchmod(fd, mode)


def _weight(p: pathlib.Path, hashed: bool) -> int:
    st = os.lstat(p)
    return st.st_size if hashed else min(st.st_size, st.st_blocks * 512)


class _Failed(Exception):
    def __init__(self, op: str, err: OSError):
        super().__init__(op, err)
        self.op, self.err = op, err


def sync_failed(base, p, op: str, e: BaseException) -> AgentError:
    why = (
        f"{e.strerror} (errno {e.errno})"
        if isinstance(e, OSError) and e.errno
        else f"{type(e).__name__}: {e}"
    )
    return AgentError(
        SYNC_PHASE,
        f"{op} of {p} failed: {why}; the snapshot in {base} is not on stable storage, so "
        "the checkpoint fails and rolls back (no tree was killed, the workload keeps running "
        "with its memory intact); check the disk and its free space, then checkpoint again",
    )

"""The chunk store of incremental snapshots (issue 12 item 3; decisions D34;
docs/snapshot-format.md "Chunk store").

Layout, under the snapshot root ROOT (the parent of each snapshot directory)::

    ROOT/.cuinterpose-store/
      lock                              flock(2): shared while a checkpoint runs, exclusive
                                        while snapshots are deleted and packs collected
      packs/<token>-shared-<pid>-<alloc_id>.bin
                                        one pack per carried stream of one checkpoint: the
                                        chunk-file layout (chunk i at i * chunk_bytes, sparse),
                                        holding only the chunks no earlier snapshot held

A snapshot of the store lists, per stream, its ``pack`` and ``refs`` ([chunk, pack, offset]:
chunks whose bytes are in an older pack) in ``chunks.streams``, and ``chunks.store`` is
:data:`STORE_REL`. The store has no index of its own: what it holds is what the manifests
under ROOT say (:func:`live`); a chunk is addressed by its BLAKE2b-256 digest (the shim's chunk
checksum) when a checkpoint looks for it (:func:`known_chunks`), and the shim verifies every
chunk against its own digest table when it loads it, wherever the bytes come from.

:func:`collect` (under the exclusive lock) unlinks every pack no manifest refers to and punches
holes (``fallocate(FALLOC_FL_PUNCH_HOLE)``, Linux fallocate(2)) over the ranges of the others
that no manifest refers to; :func:`delete` removes one snapshot and then collects. Errors:
:class:`~cuinterpose.agent.errors.AgentError` of phase ``chunk store`` naming the file.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import pathlib
import re
import secrets
import shutil
import time
from typing import Iterator

from cuinterpose.agent.errors import AgentError

PHASE = "chunk store"
STORE_DIR = ".cuinterpose-store"
PACKS_DIR = "packs"
LOCK_NAME = "lock"
#: ``chunks.store`` of a manifest whose streams are packs: the packs directory, relative to
#: the snapshot directory
STORE_REL = f"../{STORE_DIR}/{PACKS_DIR}"
PACK_RE = re.compile(r"^[0-9a-f]{16}-shared-[0-9]+-[0-9a-f]{32}\.bin$")
MANIFEST_NAME = "manifest.json"
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02  # linux/falloc.h
LOCK_TIMEOUT_S = 60.0


def root_of(images_dir) -> pathlib.Path:
    """The snapshot root of ``images_dir``: its parent directory (absolute)."""
    return pathlib.Path(os.path.abspath(images_dir)).parent


def packs_dir(root) -> pathlib.Path:
    return pathlib.Path(root) / STORE_DIR / PACKS_DIR


def new_prefix() -> str:
    """The pack-name prefix of one checkpoint: 16 random hex digits and ``-``."""
    return secrets.token_hex(8) + "-"


class Lock:
    """``flock`` of ROOT/.cuinterpose-store/lock, shared or exclusive, waited for at most
    ``timeout_s`` seconds (then AgentError naming the lock). Creates the store's directories
    (0700) when missing. Release with :meth:`release` (idempotent) or as a context manager."""

    def __init__(self, root, *, exclusive: bool, timeout_s: float = LOCK_TIMEOUT_S):
        self.fd = -1
        self.path = pathlib.Path(root) / STORE_DIR / LOCK_NAME
        try:
            packs_dir(root).mkdir(mode=0o700, parents=True, exist_ok=True)
            self.fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
        except OSError as e:
            raise AgentError(
                PHASE, f"cannot open the chunk store lock {self.path}: {e.strerror}"
            ) from None
        how = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(self.fd, how | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = -1
                    kind = "an exclusive" if exclusive else "a shared"
                    raise AgentError(
                        PHASE,
                        f"the chunk store lock {self.path} was not free for {kind} lock within "
                        f"{timeout_s:g} s (a checkpoint or a delete of this snapshot root is "
                        "running); nothing was changed",
                    ) from None
                time.sleep(0.05)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = -1

    def __del__(self) -> None:  # a checkpoint dropped without its release step
        self.release()

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def manifests(root) -> Iterator[tuple[pathlib.Path, dict | None]]:
    """(snapshot directory, its manifest, or None when it cannot be read) for every
    sub-directory of ``root`` holding ``manifest.json``, by name."""
    try:
        subs = sorted(p for p in pathlib.Path(root).iterdir() if p.is_dir() and p.name != STORE_DIR)
    except OSError as e:
        raise AgentError(PHASE, f"{root} cannot be read: {e.strerror or e}") from None
    for d in subs:
        f = d / MANIFEST_NAME
        if not f.is_file():
            continue
        try:
            yield d, json.loads(f.read_text())
        except (OSError, ValueError):
            yield d, None


def uses_store(m: dict | None) -> bool:
    return isinstance(m, dict) and (m.get("chunks") or {}).get("store") == STORE_REL


def chunk_locations(m: dict) -> Iterator[tuple[bytes, str, int, int]]:
    """(digest, pack, offset, length) of every non-zero chunk of a store manifest ``m``:
    where its bytes are (its own pack at chunk * chunk_bytes, or its ref)."""
    ch = m["chunks"]
    cb = int(ch["chunk_bytes"])
    for s in ch["streams"]:
        refs = {int(i): (str(n), int(o)) for i, n, o in s.get("refs") or []}
        size = int(s["bytes"])
        for i, c in enumerate(s["checksums"]):
            if c is None:
                continue
            pack, off = refs.get(i, (str(s["pack"]), i * cb))
            yield bytes.fromhex(c), pack, off, min(cb, size - i * cb)


def live(root) -> dict[str, list[tuple[int, int]]]:
    """pack -> [(offset, length)] that the manifests under ``root`` refer to. Raises
    AgentError when a manifest cannot be read or has a bad ``chunks`` object (it might refer
    to any pack: nothing may be collected)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for d, m in manifests(root):
        if m is None:
            raise AgentError(
                PHASE,
                f"{d / MANIFEST_NAME} cannot be read: the chunks it refers to are unknown, so "
                "no pack is collected; repair or remove that snapshot first",
            )
        if not uses_store(m):
            continue
        try:
            for s in m["chunks"]["streams"]:
                out.setdefault(str(s["pack"]), [])  # its own pack stays, even all holes
            for _, pack, off, n in chunk_locations(m):
                out.setdefault(pack, []).append((off, n))
        except (KeyError, TypeError, ValueError) as e:
            raise AgentError(
                PHASE,
                f"{d / MANIFEST_NAME}: bad chunks object ({type(e).__name__}: {e}); no pack is "
                "collected",
            ) from None
    return out


def known_chunks(root) -> dict[bytes, tuple[str, int]]:
    """digest -> (pack, offset) of the chunks the store holds, for a checkpoint (call it under
    a shared :class:`Lock`): from every readable store manifest under ``root``, only where the
    pack is a regular file that covers the chunk. A manifest that cannot be read is skipped
    (its chunks are simply written again)."""
    out: dict[bytes, tuple[str, int]] = {}
    sizes: dict[str, int] = {}
    pd = packs_dir(root)
    for _, m in manifests(root):
        if not uses_store(m):
            continue
        try:
            locs = list(chunk_locations(m))
        except (KeyError, TypeError, ValueError):
            continue
        for digest, pack, off, n in locs:
            if digest in out or not PACK_RE.match(pack):
                continue
            if pack not in sizes:
                try:
                    st = os.lstat(pd / pack)
                    sizes[pack] = st.st_size if (st.st_mode & 0o170000) == 0o100000 else -1
                except OSError:
                    sizes[pack] = -1
            if off + n <= sizes[pack]:
                out[digest] = (pack, off)
    return out


_libc = None


def _punch(fd: int, off: int, n: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, n) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def collect(root, *, lock: Lock | None = None) -> dict:
    """Free what no manifest under ``root`` refers to (module docstring): {"packs_removed",
    "packs_kept", "pack_bytes_freed"} (bytes: the drop of allocated bytes, st_blocks * 512). Takes
    the exclusive lock unless ``lock`` (held exclusive) is given."""
    own = lock is None
    lk = lock or Lock(root, exclusive=True)
    try:
        keep = live(root)
        pd = packs_dir(root)
        removed = kept = freed = 0
        for e in sorted(os.scandir(pd), key=lambda e: e.name):
            if not e.is_file(follow_symlinks=False):
                continue
            before = e.stat(follow_symlinks=False).st_blocks * 512
            try:
                if e.name not in keep:
                    os.unlink(e.path)
                    removed += 1
                    freed += before
                    continue
                kept += 1
                size = e.stat(follow_symlinks=False).st_size
                fd = os.open(e.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    pos = 0
                    for off, n in sorted(keep[e.name]) + [(size, 0)]:
                        if off > pos:
                            _punch(fd, pos, off - pos)
                        pos = max(pos, off + n)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                freed += before - os.stat(e.path).st_blocks * 512
            except OSError as err:
                raise AgentError(
                    PHASE, f"collecting pack {e.path} failed: {err.strerror} (errno {err.errno})"
                ) from None
        _fsync_dir(pd)
        return {"packs_removed": removed, "packs_kept": kept, "pack_bytes_freed": max(freed, 0)}
    finally:
        if own:
            lk.release()


def delete(images_dir) -> dict:
    """Remove the snapshot ``images_dir`` (a directory holding manifest.json) and collect its
    root's store: {"deleted": path, **collect()}. The manifest goes first (fsynced), so a
    crash part-way leaves a directory that is no longer a snapshot. Raises AgentError
    (nothing removed) when ``images_dir`` is not a snapshot or the lock is not free."""
    d = pathlib.Path(os.path.abspath(images_dir))
    if not (d / MANIFEST_NAME).is_file() or (d / MANIFEST_NAME).is_symlink():
        raise AgentError(PHASE, f"{d} holds no manifest.json: not a snapshot; nothing removed")
    root = d.parent
    if not (root / STORE_DIR).is_dir():  # no chunk store: nothing can refer to its bytes
        _remove(d)
        return {"deleted": str(d), "packs_removed": 0, "packs_kept": 0, "pack_bytes_freed": 0}
    with Lock(root, exclusive=True) as lk:
        _remove(d)
        return {"deleted": str(d), **collect(root, lock=lk)}


def _remove(d: pathlib.Path) -> None:
    try:
        (d / MANIFEST_NAME).unlink()
        _fsync_dir(d)
        shutil.rmtree(d)
        _fsync_dir(d.parent)
    except OSError as e:
        raise AgentError(PHASE, f"removing {d} failed: {e.strerror} (errno {e.errno})") from None


def _fsync_dir(d) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

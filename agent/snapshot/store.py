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
under ROOT say (:func:`live`); a chunk is addressed by its digest (the shim's chunk checksum,
BLAKE2b-256 or SHA-256 as the manifest's ``chunks.checksum`` says; decisions D36) when a
checkpoint looks for it (:func:`known_chunks`), and the shim verifies every
chunk against its own digest table when it loads it, wherever the bytes come from.

A checkpoint also writes a **pin** (``.cuinterpose-store/pins/<prefix>json``, :class:`Hold`):
until it is removed (the checkpoint done, or a release after a dead agent), collect keeps whole
the checkpoint's own packs and every pack it may refer to. The directories must be real
directories owned by the agent's uid (:func:`make_dirs`), and collect touches only regular
files named like a pack.

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
import stat
import time
from typing import Iterator

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.snapshot import dirclaim, snapdir
from cuinterpose.agent.snapshot.snapdir import MANIFEST, SnapshotDir
from cuinterpose.coordinator.protocol import DEFAULT_CHUNK_CHECKSUM

PHASE = "chunk store"
#: the names (agent/snapshot/snapdir.py owns them)
STORE_DIR, PACKS_DIR, LOCK_NAME, PINS_DIR = (
    snapdir.STORE,
    snapdir.PACKS,
    snapdir.STORE_LOCK,
    snapdir.PINS,
)
#: ``chunks.store`` of a manifest whose streams are packs: the packs directory, relative to
#: the snapshot directory
STORE_REL = snapdir.STORE_REL
PACK_RE = re.compile(r"^[0-9a-f]{16}-shared-[0-9]+-[0-9a-f]{32}\.bin$")
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02  # linux/falloc.h
LOCK_TIMEOUT_S = 60.0


def root_of(images_dir) -> pathlib.Path:
    """The snapshot root of ``images_dir``: the parent of its canonical path
    (``paths.canonical``)."""
    return SnapshotDir(images_dir).root


def packs_dir(root) -> pathlib.Path:
    return pathlib.Path(root) / STORE_DIR / PACKS_DIR


def make_dirs(root) -> None:
    """Create ROOT/.cuinterpose-store/{packs,pins} (0700) when missing and check that each is
    a real directory (not a symlink) owned by this process's uid; AgentError naming it
    otherwise (nothing is written through it)."""
    top = pathlib.Path(root) / STORE_DIR
    for d in (top, top / PACKS_DIR, top / PINS_DIR):
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(d)
        except OSError as e:
            raise AgentError(
                PHASE, f"cannot create the chunk store directory {d}: {e.strerror}"
            ) from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise AgentError(
                PHASE,
                f"{d} is not a directory owned by uid {os.geteuid()} (a symlink, or another "
                "user's): the chunk store is not used; nothing was changed",
            )


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
        make_dirs(root)
        try:
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


def manifests(root, skip=None) -> Iterator[tuple[pathlib.Path, dict | None]]:
    """(snapshot directory, its manifest, or None when it cannot be read) for every
    sub-directory of ``root`` holding ``manifest.json`` but ``skip``, by name."""
    try:
        subs = snapdir.children(root)
    except OSError as e:
        raise AgentError(PHASE, f"{root} cannot be read: {e.strerror or e}") from None
    for snap in subs:
        d = snap.path
        if not snap.has_manifest() or (skip is not None and d == skip):
            continue
        try:
            yield d, json.loads(snap.read_manifest())
        except (OSError, ValueError):
            yield d, None


def uses_store(m) -> bool:
    ch = m.get("chunks") if isinstance(m, dict) else None
    return isinstance(ch, dict) and ch.get("store") == STORE_REL


#: what a malformed ``chunks`` object raises while it is walked
BAD_SHAPE = (KeyError, TypeError, ValueError, AttributeError, IndexError)


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


def live(root, skip=None) -> dict[str, list[tuple[int, int]]]:
    """pack -> [(offset, length)] that the manifests under ``root`` (but ``skip``) refer to. Raises
    AgentError when a manifest cannot be read or has a bad ``chunks`` object (it might refer
    to any pack: nothing may be collected)."""
    out: dict[str, list[tuple[int, int]]] = {}
    for d, m in manifests(root, skip):
        if m is None:
            raise AgentError(
                PHASE,
                f"{d / MANIFEST} cannot be read: the chunks it refers to are unknown, so "
                "no pack is collected; repair or remove that snapshot first",
            )
        if not uses_store(m):
            continue
        try:
            for s in m["chunks"]["streams"]:
                out.setdefault(str(s["pack"]), [])  # its own pack stays, even all holes
            for _, pack, off, n in chunk_locations(m):
                out.setdefault(pack, []).append((off, n))
        except BAD_SHAPE as e:
            raise AgentError(
                PHASE,
                f"{d / MANIFEST}: bad chunks object ({type(e).__name__}: {e}); no pack is "
                "collected",
            ) from None
    return out


def known_chunks(
    root, check_mac=lambda d, m: None, checksum: str = DEFAULT_CHUNK_CHECKSUM
) -> dict[bytes, tuple[str, int]]:
    """digest -> (pack, offset) of the chunks the store holds, for a checkpoint (call it under
    a shared :class:`Lock`): from every readable, trusted (:func:`_trusted`) store manifest
    under ``root`` whose ``chunks.checksum`` is ``checksum`` (a digest of another algorithm
    names other bytes), only where the pack is a regular file that covers the chunk. Any other
    manifest is skipped (its chunks are simply written again)."""
    out: dict[bytes, tuple[str, int]] = {}
    sizes: dict[str, int] = {}
    pd = packs_dir(root)
    for d, m in manifests(root):
        if not uses_store(m) or not _trusted(d, m, check_mac):
            continue
        if (m.get("chunks") or {}).get("checksum", DEFAULT_CHUNK_CHECKSUM) != checksum:
            continue
        try:
            locs = list(chunk_locations(m))
        except BAD_SHAPE:
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


def _trusted(d: pathlib.Path, m: dict, check_mac) -> bool:
    """A manifest whose chunks a checkpoint may refer to: it and its directory are owned by
    this uid and writable by nobody else, and ``check_mac(d, m)`` (agent/snapshot/trust.py
    ``check_mac``: with a node key, a valid MAC) does not raise. Another is simply not used
    (its chunks are written again)."""
    snap = SnapshotDir(d)
    for p in (snap.path, snap.manifest_path):
        try:
            st = os.lstat(p)
        except OSError:
            return False
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or stat.S_ISLNK(st.st_mode):
            return False
    try:
        check_mac(d, m)
    except AgentError:  # SnapshotError
        return False
    return True


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
    """Free what no manifest under ``root`` refers to and no pin holds (module docstring):
    {"packs_removed", "packs_kept", "pack_bytes_freed" (the drop of allocated bytes,
    st_blocks * 512), "pinned": [the images dirs of the checkpoints whose pins held packs
    whole]}. Only entries named like a pack (:data:`PACK_RE`) that are regular files are
    touched, through descriptors of the packs directory (no link followed). Takes the
    exclusive lock unless ``lock`` (held exclusive) is given."""
    own = lock is None
    lk = lock or Lock(root, exclusive=True)
    try:
        keep = live(root)
        whole, prefixes, pinned = pinned_packs(root)
        pd = packs_dir(root)
        dfd = os.open(pd, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            removed = kept = freed = 0
            for e in sorted(os.scandir(dfd), key=lambda e: e.name):
                if not PACK_RE.match(e.name) or not e.is_file(follow_symlinks=False):
                    continue  # not a pack: never touched
                if e.name in whole or e.name.startswith(prefixes):
                    kept += 1
                    continue
                try:
                    freed += _collect_one(dfd, e, keep.get(e.name))
                except OSError as err:
                    raise AgentError(
                        PHASE,
                        f"collecting pack {pd / e.name} failed: {err.strerror} (errno {err.errno})",
                    ) from None
                removed += e.name not in keep
                kept += e.name in keep
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return {
            "packs_removed": removed,
            "packs_kept": kept,
            "pack_bytes_freed": max(freed, 0),
            "pinned": pinned,
        }
    finally:
        if own:
            lk.release()


def _collect_one(dfd: int, e: os.DirEntry, ranges) -> int:
    """Unlink the pack ``e`` (``ranges`` None) or punch out what lies outside ``ranges``
    [(offset, length)]; returns the bytes freed."""
    before = e.stat(follow_symlinks=False)
    if ranges is None:
        os.unlink(e.name, dir_fd=dfd)
        return before.st_blocks * 512
    fd = os.open(e.name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
    try:
        pos = 0
        for off, n in sorted(ranges) + [(before.st_size, 0)]:
            if off > pos:
                _punch(fd, pos, off - pos)
            pos = max(pos, off + n)
        os.fsync(fd)
        return (before.st_blocks - os.fstat(fd).st_blocks) * 512
    finally:
        os.close(fd)


class Hold:
    """What a checkpoint into the store holds until it is done: the shared :class:`Lock` and
    its pin (:func:`pin`). :meth:`release` (idempotent) removes the pin, then the lock."""

    def __init__(self, root, prefix: str, known, images_dir):
        """``known()``: the known chunks (:func:`known_chunks`), taken under the lock."""
        self.root, self.prefix = root, prefix
        self.lock = Lock(root, exclusive=False)
        self.pinned = False
        try:
            self.known = known()
            pin(root, prefix, {p for p, _ in self.known.values()}, images_dir)
            self.pinned = True
        except BaseException:
            self.lock.release()
            raise

    def release(self, *, keep_pin: bool = False) -> None:
        """Remove the pin (unless ``keep_pin``: a rollback failed and a release still needs the
        packs) and release the lock."""
        if self.pinned and not keep_pin:
            unpin(self.root, self.prefix)
        self.pinned = False
        self.lock.release()


def pin(root, prefix: str, packs, images_dir) -> pathlib.Path:
    """Write ROOT/.cuinterpose-store/pins/<prefix>json (fsynced): while it exists, collect
    keeps whole the packs of ``prefix`` (a checkpoint's own) and ``packs`` (those its refs
    may point into). It outlives a dead agent: a release removes it (:func:`unpin`)."""
    d = packs_dir(root).parent / PINS_DIR
    path = d / f"{prefix}json"
    body = {
        "prefix": prefix,
        "packs": sorted(packs),
        "images_dir": str(images_dir),
        "pid": os.getpid(),
    }
    tmp = d / f".{prefix}tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(body).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    _fsync_dir(d)
    return path


def unpin(root, prefix: str) -> None:
    """Remove the pin of ``prefix`` (missing is fine)."""
    d = packs_dir(root).parent / PINS_DIR
    try:
        os.unlink(d / f"{prefix}json")
        _fsync_dir(d)
    except FileNotFoundError:
        pass


def pinned_packs(root) -> tuple[set, tuple, list]:
    """(packs held whole, prefixes held, images dirs of the pins). A pin that cannot be read
    raises AgentError (what it holds is unknown: nothing may be collected)."""
    d = packs_dir(root).parent / PINS_DIR
    whole, prefixes, dirs = set(), [], []
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith("json") and not n.startswith("."))
    except FileNotFoundError:
        return whole, (), dirs
    for n in names:
        try:
            rec = json.loads((d / n).read_text())
            whole.update(str(p) for p in rec["packs"])
            prefixes.append(str(rec["prefix"]))
            dirs.append(str(rec.get("images_dir", "")))
        except (OSError, *BAD_SHAPE) as e:
            raise AgentError(
                PHASE,
                f"pin {d / n} cannot be read ({type(e).__name__}); no pack is collected; remove "
                "it once no checkpoint or release needs it",
            ) from None
    return whole, tuple(prefixes), dirs


def delete(images_dir) -> dict:
    """Remove the snapshot ``images_dir`` (a directory holding manifest.json) and collect its
    root's store: {"deleted": path, **collect()}. Checks first that the store can be
    collected (every manifest and pin readable), then removes the manifest (fsynced, so a
    crash part-way leaves a directory that is no longer a snapshot) and the directory. Raises
    AgentError (nothing removed) when ``images_dir`` is empty or not a snapshot, the lock is
    not free or the store cannot be collected."""
    if not str(images_dir or ""):
        raise AgentError("delete", "no snapshot directory given (an empty path); nothing removed")
    snap = SnapshotDir.canonical(images_dir)
    d = snap.path
    if not os.path.lexists(d):
        raise AgentError("delete", f"{d} does not exist; nothing removed")
    busy = snap.claim_holder()
    if busy is not None:
        raise AgentError(
            "delete",
            f"{d} is being written by a checkpoint: {dirclaim.describe(busy)}; nothing removed",
        )
    if not d.is_dir() or d.is_symlink():
        raise AgentError("delete", f"{d} is not a snapshot directory; nothing removed")
    if not snap.has_manifest(follow=False):
        raise AgentError("delete", f"{d} holds no {MANIFEST}: not a snapshot; nothing removed")
    # refused while a restore reads it; held while the directory goes: a restore starting now
    # is refused naming this delete
    claim = snap.lock(phase="delete", kind="delete")
    try:
        return _delete(snap)
    finally:
        claim.release()


def _delete(snap: SnapshotDir) -> dict:
    d = snap.path
    root = d.parent
    if not os.path.lexists(root / STORE_DIR):  # no chunk store: nothing refers to its bytes
        _remove(snap)
        return {
            "deleted": str(d),
            "packs_removed": 0,
            "packs_kept": 0,
            "pack_bytes_freed": 0,
            "pinned": [],
        }
    with Lock(root, exclusive=True) as lk:
        live(root, skip=d)  # refuses before anything is removed
        pinned_packs(root)
        _remove(snap)
        return {"deleted": str(d), **collect(root, lock=lk)}


def _remove(snap: SnapshotDir) -> None:
    try:
        snap.delete()
    except OSError as e:
        raise AgentError(
            PHASE, f"removing {snap.path} failed: {e.strerror} (errno {e.errno})"
        ) from None


_fsync_dir = snapdir.fsync_dir

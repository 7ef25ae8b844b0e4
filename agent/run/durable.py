"""A snapshot's bytes on stable storage, and the progress of the phases that move them.

- :func:`sync_snapshot`: the checkpoint's ``sync`` phase, after every tree is dumped (and
  every chunk file written) and before ``manifest.json``: every regular file under the
  snapshot directory is made 0600 and fsynced (``fsync(2)``: data and the metadata needed to
  read it back; each of its directories 0700: a snapshot is private to the agent's user),
  each CRIU image hashed (SHA-256) in the same pass, while its pages are still in the page
  cache, by a pool of threads (hashlib releases the GIL); then every directory, bottom-up,
  and the parents that hold the snapshot's entry. A failure (EIO, ENOSPC on a delayed
  write-back) is an ``AgentError`` of phase ``sync``: the checkpoint rolls back as after a
  failed dump, and no tree has been killed (docs/agent.md "Checkpoint ordering").
- :func:`verify_snapshot`: restore's ``verify`` phase: every listed CRIU image hashed once,
  in parallel (``manifest.verify_images``), before CRIU reads any of them.
- :class:`ChunkProgress`: while a step that writes or reads the stream files under
  ``DIR/chunks/`` runs (SAVE_ALLOCATIONS inside ``capture``, ``native checkpoint``,
  LOAD_ALLOCATIONS inside ``restore shared``; the chunk format of issue 12), a poller reports
  bytes done of the streams' total as ``progress`` events.

Facts used: fsync(2) and the directory-entry rule (an entry is durable once its directory is
fsynced) from the Linux man pages; ``st_blocks`` counts 512-byte units (stat(2)); ``rchar`` of
``/proc/PID/io`` counts the bytes a process read through read(2)-like calls (proc(5)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import stat as stat_mod
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.run.report import Phase, Reporter
from cuinterpose.agent.snapshot import dirclaim
from cuinterpose.agent.snapshot import manifest as manifest_mod
from cuinterpose.agent.snapshot import store as store_mod

SYNC_PHASE = "sync"
VERIFY_PHASE = "verify"
#: where the stream files of the chunk format live (docs/snapshot-format.md)
CHUNKS_DIR = "chunks"

#: every file and directory of a snapshot is made durable through this call (tests record it)
_fsync = os.fsync
#: what the sync pass leaves on every file and directory under the snapshot: private to the
#: agent's user (case 016; CRIU's images are already created so, under its umask)
FILE_MODE, DIR_MODE = 0o600, 0o700


def _private(fd: int, mode: int) -> None:
    """``fchmod(fd, mode)`` when its permission bits differ (group or other could read)."""
    if stat_mod.S_IMODE(os.fstat(fd).st_mode) != mode:
        os.fchmod(fd, mode)


@dataclasses.dataclass
class Synced:
    """What :func:`sync_snapshot` did: ``images`` {path under DIR: {"sha256", "bytes"}} of the
    CRIU images (the manifest's ``criu.files``), ``files``/``dirs``: the paths fsynced (files
    in path order, directories bottom-up, parents last), ``bytes``: what the phase moved
    (image bytes read and hashed, plus the allocated bytes of the other files)."""

    images: dict
    files: list
    dirs: list
    bytes: int


def snapshot_tree(base: os.PathLike | str) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """(every regular file under ``base`` but the manifest and its temporary file and the
    run's claim (agent/snapshot/dirclaim.py), in path order; every directory under it and
    ``base`` itself, children before parents). Symlinks are neither followed nor listed."""
    base = pathlib.Path(base)
    files, dirs = [], []
    skip = {manifest_mod.MANIFEST_NAME, manifest_mod.MANIFEST_NAME + ".tmp"}
    for top, _, names in os.walk(base, topdown=False, followlinks=False):
        d = pathlib.Path(top)
        dirs.append(d)
        for n in names:
            p = d / n
            if d == base and (n in skip or n not in dirclaim.foreign([n])):
                continue
            if stat_mod.S_ISREG(os.lstat(p).st_mode):
                files.append(p)
    return sorted(files), dirs


def _weight(p: pathlib.Path, hashed: bool) -> int:
    st = os.lstat(p)
    return st.st_size if hashed else min(st.st_size, st.st_blocks * 512)


def sync_snapshot(
    base: os.PathLike | str,
    *,
    parents: tuple = (),
    outside: tuple = (),
    progress: Optional[Callable[[int, int], None]] = None,
    threads: Optional[int] = None,
) -> Synced:
    """Make the snapshot at ``base`` durable (see the module docstring); ``parents``: further
    directories to fsync last (those holding ``base``'s entry and the ones a checkpoint
    created); ``outside``: further files to fsync (the chunk store packs the checkpoint
    wrote). ``progress(done, total)`` (bytes, called from the pool's threads) as bytes are
    hashed and files synced. Raises ``AgentError`` (phase ``sync``) naming the file or
    directory and the errno."""
    base = pathlib.Path(base)
    images = base / manifest_mod.CRIU_DIR
    try:
        files, dirs = snapshot_tree(base)
        files += [pathlib.Path(p) for p in outside]
        hashed = {p for p in files if images in p.parents}
        weights = {p: _weight(p, p in hashed) for p in files}
    except OSError as e:  # a file that went away or cannot be read while listing
        raise _failed(base, e.filename or base, "listing", e) from e
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
                sha = manifest_mod.sha256_fd(fd, add) if p in hashed else None
                op = "fsync"
                _fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise _Failed(op, e) from e
        if p not in hashed:
            add(weights[p])
        return sha

    with ThreadPoolExecutor(max_workers=threads or manifest_mod.hash_threads()) as pool:
        futs = [(p, pool.submit(one, p)) for p in files]
    out = {}
    for p, f in futs:  # the first failure in path order
        e = f.exception()
        if isinstance(e, _Failed):
            raise _failed(base, p, e.op, e.err) from e.err
        if e is not None:
            raise _failed(base, p, "fsync", e) from e
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
            raise _failed(base, d, "fsync of the directory", e) from e
    if progress is not None:
        progress(total, total)
    return Synced(images=out, files=files, dirs=synced_dirs, bytes=total)


class _Failed(Exception):
    def __init__(self, op: str, err: OSError):
        super().__init__(op, err)
        self.op, self.err = op, err


def _failed(base, p, op: str, e: BaseException) -> AgentError:
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


def sync_step(cp) -> None:
    """The checkpoint's ``sync`` step: :func:`sync_snapshot` of ``cp.images_dir`` in its own
    row (bytes, progress), the parents being those of the directories the checkpoint created
    and of the snapshot directory; sets ``cp.image_files`` (the manifest's ``criu.files``)."""
    base = pathlib.Path(cp.images_dir)
    parents = [p.parent for p in reversed(getattr(cp, "created_dirs", []) or [])]
    packs, pack_dirs = store_packs(getattr(getattr(cp, "coordinator", None), "carriers", None))
    parents = list(dict.fromkeys(parents + [base.parent] + pack_dirs))
    with cp.r.phase(SYNC_PHASE) as ph:
        res = sync_snapshot(
            base,
            parents=tuple(parents),
            outside=tuple(packs),
            progress=lambda d, t: cp.r.progress(ph, d, t),
        )
        cp.r.progress(ph, res.bytes, res.bytes, final=True)
        cp.image_files = res.images
        ph.detail = (
            f"{len(res.files)} files, {len(res.dirs)} directories fsynced; "
            f"{len(res.images)} CRIU images hashed (sha256)"
        )


def store_packs(files) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    """(the chunk store packs a checkpoint wrote, the directories holding their entries:
    packs/, the store, its root) for ``files`` (a CarrierFiles with ``store``); ([], [])
    otherwise."""
    if files is None or getattr(files, "store", None) is None:
        return [], []
    d = pathlib.Path(files.directory)
    packs = sorted(p for p in d.glob(f"{files.prefix}*") if p.is_file() and not p.is_symlink())
    return packs, [d, d.parent, d.parent.parent]


def verify_snapshot(rs) -> None:
    """Restore's ``verify`` step: every CRIU image of ``rs.m`` hashed once, in parallel, in
    its own row (bytes, progress). Raises ``SnapshotError`` (phase ``verify``, refused: the
    snapshot untouched)."""
    files = rs.m["criu"].get("files", {})
    total = sum(int(v.get("bytes", 0)) for v in files.values() if isinstance(v, dict))
    with rs.r.phase(VERIFY_PHASE) as ph:
        lock = threading.Lock()
        done = [0]

        def add(n: int) -> None:
            with lock:
                done[0] += n
                rs.r.progress(ph, done[0], total)

        ph.bytes = manifest_mod.verify_images(rs.images_dir, rs.m, on_bytes=add, phase="verify")
        rs.r.progress(ph, ph.bytes, ph.bytes, final=True)
        ph.detail = f"{len(files)} CRIU images, sha256 as in the manifest"


class ChunkProgress:
    """Progress of the stream files under ``DIR/chunks/`` while a phase writes (``mode``
    "write") or reads them ("read", by the processes ``pids``).

    ``total``: the streams' bytes, Σ ``st_size`` (a writer ``ftruncate``s each file to its
    stream's size first). ``done``, write: Σ min(allocated bytes, size) (``st_blocks`` * 512;
    a zero chunk is never written), read: the bytes ``pids`` read since the poller started
    (``rchar``), at most the allocated bytes. Each :meth:`poll` emits a ``progress`` event
    of the running row named ``name`` (the step's own, else a transient row the live display
    replaces by the real one); :meth:`close` the last one, with ``done == total`` when the
    phase succeeded (every chunk written, or skipped as zero)."""

    def __init__(
        self,
        rep: Reporter,
        name: str,
        images_dir,
        *,
        mode: str = "write",
        pids=(),
        packs=None,
        prefix: str = "",
    ):
        self.rep, self.name, self.mode, self.prefix = rep, name, mode, prefix
        self.dir = pathlib.Path(images_dir) / CHUNKS_DIR
        #: a capture of the chunk store: (packs directory, the names of its streams' packs
        #: or the prefix they start with); the streams are those files, not DIR/chunks/
        self.packs = packs
        if packs is not None:
            self.dir = pathlib.Path(packs[0])
        self.pids = list(pids)
        self.row: Optional[Phase] = None
        self.t0 = time.monotonic_ns()
        self.n0 = len(rep.phases)  # rows before this step's: never its own
        self.rchar0 = {p: _rchar(p) for p in self.pids} if mode == "read" else {}

    def measure(self) -> tuple[int, int]:
        """(done, total) bytes now."""
        size = alloc = 0
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return 0, 0
        for e in entries:
            if self.packs is not None and not _is_stream(e.name, self.packs[1]):
                continue  # another snapshot's pack
            if self.packs is None and not e.name.startswith(self.prefix):
                continue  # another step's streams (SAVE's shared-*, GPU storage's gpu-*)
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat_mod.S_ISREG(st.st_mode):
                size += st.st_size
                alloc += min(st.st_size, st.st_blocks * 512)
        if self.mode == "write":
            return alloc, size
        read = sum(max(0, _rchar(p) - r0) for p, r0 in self.rchar0.items() if r0 >= 0)
        # a store snapshot also reads the chunks it refers to in older packs
        return min(read, size if self.packs is not None else alloc), size

    def _target(self) -> Phase:
        """The step's own row of this name once the reporter has one (added since this poller
        started: the coordinator records its phase rows as they end), else a transient
        row; a transient row gives way to the real one as soon as that exists, so the
        table never shows both."""
        if self.row is None or getattr(self.row, "transient", False):
            rows = self.rep.phases
            last = rows[-1] if rows else None
            real = next((p for p in reversed(rows[self.n0 :]) if p.name == self.name), None)
            if real is None and last is not None and last.name == self.name:
                real = last if last.status == "running" else None  # the step's own, open row
            if real is not None:
                self.row = real
            elif self.row is None:
                self.row = Phase(name=self.name, start_ns=self.t0)
                self.row.transient = True
        return self.row

    def poll(self, *, final: bool = False, ok: bool = False) -> Optional[tuple[int, int]]:
        """Measure and emit; returns (done, total), None while there is no stream file."""
        done, total = self.measure()
        if not total:
            return None
        if final and ok:
            done = total
        self.rep.progress(self._target(), done, total, final=final)
        return done, total

    def close(self, ok: bool) -> None:
        if self.row is not None or self.measure()[1]:
            self.poll(final=True, ok=ok)
            if self.row is not None and getattr(self.row, "transient", False):
                self.row.status = "ok" if ok else "failed"
                self.row.elapsed_ns = time.monotonic_ns() - self.t0


def _is_stream(name: str, which) -> bool:
    return name.startswith(which) if isinstance(which, str) else name in which


def _store_packs(run, mode: str):
    """(packs dir, prefix or pack names) of a checkpoint into / restore from the chunk
    store, None otherwise."""
    files = getattr(getattr(run, "coordinator", None), "carriers", None)
    if mode == "write" and getattr(files, "store", None) is not None:
        return files.directory, files.prefix
    ch = (getattr(run, "m", None) or {}).get("chunks") or {}
    if mode == "read" and ch.get("store") == store_mod.STORE_REL:
        root = store_mod.root_of(run.images_dir)
        return store_mod.packs_dir(root), {s.get("pack") for s in ch.get("streams") or []}
    return None


def _rchar(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return -1


#: (sequence KIND, step name) -> (row name, mode, the name prefix of the step's own stream
#: files under chunks/: the shim carriers' "shared-", GPU storage's "gpu-") of the steps that
#: move chunk bytes
POLLED = {
    ("checkpoint", "capture"): ("SAVE_ALLOCATIONS", "write", "shared-"),
    ("checkpoint", "native checkpoint"): ("native checkpoint", "write", "gpu-"),
    ("restore", "restore shared"): ("LOAD_ALLOCATIONS", "read", "shared-"),
    ("restore", "native restore"): ("native restore", "read", "gpu-"),
}
#: seconds between two polls
POLL_EVERY_S = 0.2


@contextlib.contextmanager
def polled(run, step_name: str):
    """Around one step of ``run`` (a Checkpoint or Restore): a :class:`ChunkProgress` thread
    when the step is in :data:`POLLED`, polling every :data:`POLL_EVERY_S` until the step
    returns or raises; nothing otherwise."""
    what = POLLED.get((getattr(run, "KIND", ""), step_name))
    if what is None or getattr(run, "images_dir", None) is None:
        yield
        return
    pids = []
    if what[1] == "read" and getattr(run, "m", None):
        pids = [p["pid"] for p in run.m.get("participants", [])]
    packs = (
        _store_packs(run, what[1]) if what[0] in ("SAVE_ALLOCATIONS", "LOAD_ALLOCATIONS") else None
    )
    poller = ChunkProgress(
        run.r, what[0], run.images_dir, mode=what[1], pids=pids, packs=packs, prefix=what[2]
    )
    stop = threading.Event()

    def loop():
        while not stop.wait(POLL_EVERY_S):
            try:
                poller.poll()
            except Exception:  # progress must never break the phase
                pass

    t = threading.Thread(target=loop, name="cui-chunk-progress", daemon=True)
    t.start()
    ok = False
    try:
        yield poller
        ok = True
    finally:
        stop.set()
        t.join()
        try:
            poller.close(ok)
        except Exception:
            pass

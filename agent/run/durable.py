"""A snapshot's bytes on stable storage, and the progress of the phases that move them.

- :func:`sync_step`: the checkpoint's ``sync`` phase, after every tree is dumped (and
  every chunk file written) and before ``manifest.json``: ``SnapshotDir.sync``
  (agent/snapshot/snapdir.py) makes every file and directory of the snapshot 0600/0700 and
  durable and hashes each CRIU image once, in a pool of threads. A failure (EIO, ENOSPC on a
  delayed write-back) is an ``AgentError`` of phase ``sync``: the checkpoint rolls back as
  after a failed dump, and no tree has been killed (docs/agent.md "Checkpoint ordering").
- :func:`verify_snapshot`: restore's ``verify`` phase: every listed CRIU image hashed once,
  in parallel (``manifest.verify_images``), before CRIU reads any of them.
- :class:`ChunkProgress`: while a step that writes or reads the stream files under
  ``DIR/chunks/`` runs (SAVE_ALLOCATIONS inside ``capture``, ``native checkpoint``,
  LOAD_ALLOCATIONS inside ``restore shared``; the chunk format of issue 12), a poller reports
  bytes done of the streams' total as ``progress`` events.

Facts used: ``st_blocks`` counts 512-byte units (stat(2)); ``rchar`` of ``/proc/PID/io``
counts the bytes a process read through read(2)-like calls (proc(5)).
"""

from __future__ import annotations

import contextlib
import pathlib
import threading
import time
from typing import Optional

from cuinterpose.agent.run.report import Phase, Reporter
from cuinterpose.agent.snapshot import manifest as manifest_mod
from cuinterpose.agent.snapshot import snapdir
from cuinterpose.agent.snapshot import store as store_mod
from cuinterpose.agent.snapshot.snapdir import SnapshotDir

SYNC_PHASE = snapdir.SYNC_PHASE
VERIFY_PHASE = "verify"


def sync_step(cp) -> None:
    """The checkpoint's ``sync`` step: ``SnapshotDir.sync`` of ``cp.images_dir`` in its own
    row (bytes, progress), the parents being those of the directories the checkpoint created
    and of the snapshot directory; sets ``cp.image_files`` (the manifest's ``criu.files``)."""
    snap = SnapshotDir(cp.images_dir)
    parents = [p.parent for p in reversed(getattr(cp, "created_dirs", []) or [])]
    packs, pack_dirs = store_packs(getattr(getattr(cp, "coordinator", None), "carriers", None))
    parents = list(dict.fromkeys(parents + [snap.path.parent] + pack_dirs))
    with cp.r.phase(SYNC_PHASE) as ph:
        res = snap.sync(
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
    return SnapshotDir.packs_in(d, files.prefix), [d, d.parent, d.parent.parent]


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
        self.snap = SnapshotDir(images_dir)
        #: a capture of the chunk store: the names of its streams' packs or the prefix they
        #: start with; the streams are those packs of the snapshot root, not DIR/chunks/
        self.packs = packs
        self.pids = list(pids)
        self.row: Optional[Phase] = None
        self.t0 = time.monotonic_ns()
        self.n0 = len(rep.phases)  # rows before this step's: never its own
        self.rchar0 = {p: _rchar(p) for p in self.pids} if mode == "read" else {}

    def _mine(self, name: str) -> bool:
        if self.packs is not None:  # not another snapshot's pack
            return (
                name.startswith(self.packs) if isinstance(self.packs, str) else name in self.packs
            )
        return name.startswith(self.prefix)  # not another step's streams (shared-*, gpu-*)

    def measure(self) -> tuple[int, int]:
        """(done, total) bytes now."""
        alloc, size = self.snap.stream_usage(self._mine, packs=self.packs is not None)
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


def _store_packs(run, mode: str):
    """The prefix (a checkpoint) or the pack names (a restore) of a run into / from the
    chunk store, None otherwise."""
    files = getattr(getattr(run, "coordinator", None), "carriers", None)
    if mode == "write" and getattr(files, "store", None) is not None:
        return files.prefix
    ch = (getattr(run, "m", None) or {}).get("chunks") or {}
    if mode == "read" and ch.get("store") == store_mod.STORE_REL:
        return {s.get("pack") for s in ch.get("streams") or []}
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


#: seconds between two polls
POLL_EVERY_S = 0.2


@contextlib.contextmanager
def polled(run, what):
    """Around one step of ``run`` (a Checkpoint or Restore): a :class:`ChunkProgress` thread
    when the step's row has ``poll`` (``what``: agent/run/steps.py ``ChunkPoll``, row name,
    mode, stream prefix), polling every :data:`POLL_EVERY_S` until the step returns or raises;
    nothing otherwise."""
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

"""One snapshot directory: every path name in it and every file operation on it
(docs/snapshot-format.md, its opening section; decisions D64).

A snapshot is one directory DIR; its parent is the snapshot root ROOT::

    DIR/manifest.json                     written last, atomically: without it DIR is no snapshot
    DIR/manifest.json.tmp                 the manifest while it is written (never left behind)
    DIR/criu/<root>/...                   CRIU images, one directory per process tree
    DIR/chunks/shared-<pid>-<alloc_id>.bin    a shim carrier's chunk file (SAVE_ALLOCATIONS)
    DIR/chunks/gpu-<pid>-<ordinal>.bin    a GPU's custom-storage stream (native checkpoint)
    DIR/.cuinterpose-claim                the claim of the run writing DIR (dirclaim.py)
    DIR/..cuinterpose-claim.<16 hex>.tmp  a claim while it is built
    ROOT/.cuinterpose-store/packs/<16 hex>-shared-<pid>-<alloc_id>.bin
                                          chunk store packs (store.py), ``../.cuinterpose-store/
                                          packs`` relative to DIR: a manifest's ``chunks.store``

:class:`SnapshotDir` is the only code that creates, opens, syncs, lists or removes these
files; every other module asks it (tests/structure/test_snapshot_io.py checks the modules
outside agent/snapshot). All of its file access goes through two methods: :meth:`SnapshotDir.
file` (a name in DIR to a path: refuses an absolute name or a ``..`` outside the packs) and
:meth:`SnapshotDir.open` (the one opener, ``os.open`` with ``O_CLOEXEC``): a snapshot kept
elsewhere than a local directory is a branch there. CRIU itself (an external program) writes
and reads ``criu/<root>/`` through the path :meth:`SnapshotDir.criu_dir` gives it; the shims
write and read the chunk files through descriptors the agent opens (``CarrierFiles`` of
coordinator/carrierfiles.py, handed :attr:`SnapshotDir.chunks_dir`).

Modes: directories 0700, files 0600 (a snapshot holds the memory of the processes: private to
the agent's user, case 016). Durability: :meth:`SnapshotDir.sync` (every file and directory
fsynced, CRIU images hashed) before :meth:`SnapshotDir.write_manifest` (tmp, fsync, rename,
fsync of DIR): the manifest is the commit point.

Errors: ``OSError`` from the primitives (the caller names its phase), ``SnapshotError`` phase
"images dir" from :func:`prepare`, ``AgentError`` phase "sync" from :meth:`SnapshotDir.sync`.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import stat as stat_mod
from typing import Callable, Iterator, Optional

from cuinterpose.agent import paths
from cuinterpose.agent.errors import SnapshotError
from cuinterpose.agent.snapshot import durability
from cuinterpose.agent.snapshot.durability import Synced, fsync_dir
from cuinterpose.coordinator.carrierfiles import CarrierFiles, stream_file_name

# -- the names --------------------------------------------------------------------------------
MANIFEST = "manifest.json"
MANIFEST_TMP = MANIFEST + ".tmp"
CRIU = "criu"
CHUNKS = "chunks"
CLAIM = ".cuinterpose-claim"
#: the chunk store beside the snapshots of a root (store.py) and its parts
STORE = ".cuinterpose-store"
PACKS = "packs"
PINS = "pins"
STORE_LOCK = "lock"
#: a manifest's ``chunks.store``: the packs directory relative to the snapshot directory
STORE_REL = f"../{STORE}/{PACKS}"
#: name prefixes of the two kinds of stream files under ``chunks/``
SHARED_PREFIX, GPU_PREFIX = "shared-", "gpu-"
DIR_MODE, FILE_MODE = durability.DIR_MODE, durability.FILE_MODE
SYNC_PHASE = durability.SYNC_PHASE


def criu_rel(root: int) -> str:
    """``criu/<root>``: the CRIU images directory of the tree rooted at ``root``."""
    return f"{CRIU}/{int(root)}"


def shared_rel(pid: int, alloc_id: str | bytes) -> str:
    """``chunks/shared-<pid>-<alloc_id as 32 hex>.bin``: a shim carrier's chunk file (the file
    name is coordinator/carrierfiles.py ``stream_file_name``, which the coordinator uses alone)."""
    return f"{CHUNKS}/{stream_file_name(pid, alloc_id)}"


def gpu_rel(pid: int, ordinal: int) -> str:
    """``chunks/gpu-<pid>-<ordinal>.bin``: one GPU's custom-storage stream of one process."""
    return f"{CHUNKS}/{GPU_PREFIX}{int(pid)}-{int(ordinal)}.bin"


def pack_rel(name: str) -> str:
    """A chunk store pack, relative to a snapshot directory (``../.cuinterpose-store/packs/``)."""
    return f"{STORE_REL}/{name}"


def claim_tmp(token: str) -> str:
    """The name a claim is built under before it is linked into place."""
    return f".{CLAIM}.{token}.tmp"


def is_claim(name: str) -> bool:
    """``name`` (an entry of DIR) is the claim or a claim being built."""
    return name.startswith(CLAIM) or name.startswith(f".{CLAIM}.")


class SnapshotDir:
    """The snapshot directory ``path`` (as given: :func:`prepare` and :meth:`canonical` give
    the canonical one). Names in it are ``/``-separated, relative to it."""

    #: the names, as attributes too (dirclaim.py, which imports nothing of this module, gets
    #: them from the object)
    MANIFEST, CRIU, CHUNKS, CLAIM = MANIFEST, CRIU, CHUNKS, CLAIM

    def __init__(self, path: os.PathLike | str):
        self.path = pathlib.Path(path)
        #: set by :func:`prepare`: directories it created (outermost first), the run's claim,
        #: notes for the operator
        self.created: list[pathlib.Path] = []
        self.claim = None
        self.notes: list[str] = []

    @classmethod
    def canonical(cls, path: os.PathLike | str) -> "SnapshotDir":
        return cls(paths.canonical(path))

    def __repr__(self) -> str:
        return f"SnapshotDir({str(self.path)!r})"

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    # -- where things are ------------------------------------------------------------------
    @property
    def root(self) -> pathlib.Path:
        """The snapshot root: the parent of the canonical path."""
        return pathlib.Path(paths.canonical(self.path)).parent

    @property
    def manifest_path(self) -> pathlib.Path:
        return self.path / MANIFEST

    @property
    def chunks_dir(self) -> pathlib.Path:
        return self.path / CHUNKS

    @property
    def packs_dir(self) -> pathlib.Path:
        return self.root / STORE / PACKS

    def criu_dir(self, root: int) -> pathlib.Path:
        """``DIR/criu/<root>``: where CRIU dumps the tree ``root`` and restores it from."""
        return self.path / criu_rel(root)

    def file(self, rel: str) -> pathlib.Path:
        """The path of ``rel`` (a name in DIR, or a pack ``../.cuinterpose-store/packs/NAME``);
        ``ValueError`` for an absolute name or one that leaves DIR otherwise."""
        parts = rel.split("/")
        if rel.startswith(STORE_REL + "/") and len(parts) == 4 and parts[3] not in ("", ".", ".."):
            return self.packs_dir / parts[3]
        if not rel or rel.startswith("/") or "\0" in rel or any(p in ("..", "") for p in parts):
            raise ValueError(f"{rel!r} is not a name inside snapshot {self.path}")
        return self.path / rel

    # -- the one opener and the primitives --------------------------------------------------
    def open(self, rel: str, flags: int, mode: int = FILE_MODE) -> int:
        """``os.open`` of ``rel`` with ``flags | O_CLOEXEC`` (created ``mode``): every
        descriptor of a snapshot file comes from here. Raises ``OSError``."""
        return os.open(self.file(rel), flags | os.O_CLOEXEC, mode)

    def read_bytes(self, rel: str, *, follow: bool = True, limit: Optional[int] = None) -> bytes:
        """The bytes of ``rel`` (at most ``limit`` + 1 when given; ``follow`` False: a symlink
        is refused, ELOOP)."""
        fd = self.open(rel, os.O_RDONLY | (0 if follow else os.O_NOFOLLOW))
        with os.fdopen(fd, "rb") as f:
            return f.read() if limit is None else f.read(limit + 1)

    def lstat(self, rel: str) -> os.stat_result:
        return os.lstat(self.file(rel))

    def exists(self, rel: str = "") -> bool:
        """``rel`` (default: DIR itself) is there (a dangling symlink counts)."""
        return os.path.lexists(self.file(rel) if rel else self.path)

    def is_dir(self) -> bool:
        """DIR is a directory (through a symlink too)."""
        return self.path.is_dir()

    def names(self, rel: str) -> list[str]:
        """The entries of the directory ``rel``, sorted (``OSError`` when it cannot be read)."""
        return sorted(os.listdir(self.file(rel)))

    def walk(self, rel: str) -> Iterator[tuple[str, int]]:
        """(name relative to DIR, ``st_mode`` by lstat) of every entry under ``rel``,
        top-down, no link followed."""
        for d, subdirs, files in os.walk(self.file(rel), followlinks=False):
            for name in subdirs + files:
                p = os.path.join(d, name)
                yield os.path.relpath(p, self.path), os.lstat(p).st_mode

    def unlink(self, rel: str) -> None:
        """Remove the file ``rel`` (missing is fine)."""
        try:
            os.unlink(self.file(rel))
        except FileNotFoundError:
            pass

    def allocated(self, rel: str) -> int:
        """Bytes allocated to ``rel`` (``st_blocks`` * 512), 0 when it is missing."""
        try:
            return self.lstat(rel).st_blocks * 512
        except FileNotFoundError:
            return 0

    def make_dirs(self, rel: str) -> pathlib.Path:
        """``rel`` and the directories above it inside DIR (each 0700, existing kept)."""
        p = self.path
        for part in rel.split("/"):
            p = p / part
            p.mkdir(mode=DIR_MODE, exist_ok=True)
        return p

    def fsync_dir(self, rel: str = "") -> None:
        fsync_dir(self.file(rel) if rel else self.path)

    # -- the manifest: the commit point ----------------------------------------------------
    def has_manifest(self, *, follow: bool = True) -> bool:
        """DIR holds a manifest (a regular file; ``follow`` False: not a symlink to one)."""
        p = self.manifest_path
        return p.is_file() and (follow or not p.is_symlink())

    def read_manifest(self, *, follow: bool = True, limit: Optional[int] = None) -> bytes:
        """The manifest's bytes (``FileNotFoundError`` without one)."""
        return self.read_bytes(MANIFEST, follow=follow, limit=limit)

    def write_manifest(self, data: bytes) -> pathlib.Path:
        """``data`` into ``manifest.json.tmp`` (0600, created ``O_EXCL`` after removing a stale
        one: nothing is written through a planted file), fsync, rename onto ``manifest.json``,
        fsync of DIR; returns the manifest's path. Before the rename a failure removes the tmp
        file; the ``OSError`` is raised either way (the caller decides about a renamed
        manifest whose directory fsync failed)."""
        self.unlink(MANIFEST_TMP)
        fd = self.open(MANIFEST_TMP, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(self.file(MANIFEST_TMP), self.manifest_path)
        except BaseException:
            try:
                self.unlink(MANIFEST_TMP)
            except OSError:
                pass
            raise
        fsync_dir(self.path)
        return self.manifest_path

    def remove_manifest(self) -> None:
        """Remove the manifest: DIR is no snapshot anymore (missing is fine)."""
        self.unlink(MANIFEST)

    # -- CRIU images ------------------------------------------------------------------------
    def make_criu_dir(self, root: int) -> pathlib.Path:
        """Create ``criu/`` and ``criu/<root>/`` (0700) for CRIU's dump; returns the latter."""
        return self.make_dirs(criu_rel(root))

    def tree_bytes(self, root: int) -> int:
        """Bytes of the regular files under ``criu/<root>/`` (a dump's size)."""
        return sum(f.stat().st_size for f in self.criu_dir(root).rglob("*") if f.is_file())

    def image_files(self) -> list[str]:
        """Every regular file (no symlink) under ``criu/``, as names in DIR, sorted."""
        base = self.path / CRIU
        return [
            str(p.relative_to(self.path))
            for p in sorted(base.rglob("*"))
            if p.is_file() and not p.is_symlink()
        ]

    def remove_dump(self) -> None:
        """Remove what a rolled-back dump left: ``criu/`` and a manifest temporary file."""
        shutil.rmtree(self.path / CRIU, ignore_errors=True)
        try:
            if self.file(MANIFEST_TMP).is_file():
                self.unlink(MANIFEST_TMP)
        except OSError:
            pass

    # -- chunk files ------------------------------------------------------------------------
    def create_stream(self, rel: str) -> int:
        """Create the stream file ``rel`` under ``chunks/`` (which is made 0700 when missing)
        for writing: ``O_RDWR | O_CREAT | O_EXCL``, 0600 (a file already there is refused)."""
        self.make_dirs(CHUNKS)
        return self.open(rel, os.O_RDWR | os.O_CREAT | os.O_EXCL)

    def open_stream(self, rel: str) -> int:
        """Open the stream file ``rel`` read-only (a restore never modifies a snapshot)."""
        return self.open(rel, os.O_RDONLY)

    def remove_streams(self, rels) -> None:
        """Remove the stream files ``rels`` and ``chunks/`` when that leaves it empty."""
        for rel in rels:
            self.unlink(rel)
        try:
            os.rmdir(self.chunks_dir)
        except OSError:
            pass

    def remove_chunks(self) -> None:
        """Remove ``chunks/`` and all in it (a rolled-back checkpoint's chunk files); a
        symlink there is unlinked, never followed."""
        if self.chunks_dir.is_symlink():
            self.chunks_dir.unlink()
        else:
            shutil.rmtree(self.chunks_dir, ignore_errors=True)

    def carrier_files(self, settings):
        """The shim carriers' chunk files of this snapshot: a ``CarrierFiles``
        (coordinator/carrierfiles.py: it opens ``chunks/shared-*.bin`` for each SAVE and LOAD
        request, 0600, and names them ``chunks/...`` in the manifest) with ``settings`` (a
        ``ChunkSettings``)."""
        return CarrierFiles(self.chunks_dir, rel_dir=CHUNKS, **settings.as_dict())

    def pack_files(self, settings, **kw):
        """The carriers' streams as packs of the snapshot root's chunk store (``chunks.store``
        is :data:`STORE_REL`); ``kw``: prefix, known."""
        return CarrierFiles(self.packs_dir, store=STORE_REL, **settings.as_dict(), **kw)

    @staticmethod
    def packs_in(packs_dir, prefix: str) -> list[pathlib.Path]:
        """The packs of ``prefix`` (a checkpoint's) in ``packs_dir``: regular files, sorted."""
        d = pathlib.Path(packs_dir)
        return sorted(p for p in d.glob(f"{prefix}*") if p.is_file() and not p.is_symlink())

    def stream_usage(self, accept: Callable[[str], bool], *, packs: bool = False) -> tuple:
        """(allocated bytes, size) summed over the regular files of ``chunks/`` (``packs``:
        of the chunk store's packs) whose name ``accept`` takes; (0, 0) when it cannot be read.
        Allocated: ``min(st_blocks * 512, st_size)`` per file (a zero chunk is a hole)."""
        size = alloc = 0
        try:
            entries = list(os.scandir(self.packs_dir if packs else self.chunks_dir))
        except OSError:
            return 0, 0
        for e in entries:
            if not accept(e.name):
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat_mod.S_ISREG(st.st_mode):
                size += st.st_size
                alloc += min(st.st_size, st.st_blocks * 512)
        return alloc, size

    # -- the run's claim (dirclaim.py) -------------------------------------------------------
    @property
    def claim_path(self) -> pathlib.Path:
        return self.path / CLAIM

    @staticmethod
    def claim_tmp(token: str) -> str:
        return claim_tmp(token)

    def foreign(self) -> list[str]:
        """DIR's entries but the claim and claims being built, sorted."""
        return sorted(n for n in os.listdir(self.path) if not is_claim(n))

    def take_claim(self, run_id: str = "", group: str = "", phase: Optional[str] = None):
        """This run's :class:`~cuinterpose.agent.snapshot.dirclaim.DirClaim` on DIR."""
        from cuinterpose.agent.snapshot import dirclaim

        return dirclaim.DirClaim(self, run_id=run_id, group=group, phase=phase or dirclaim.PHASE)

    def claim_holder(self) -> Optional[dict]:
        """The record of the live run holding DIR's claim, else None (dirclaim.holder)."""
        from cuinterpose.agent.snapshot import dirclaim

        return dirclaim.holder(self)

    def lock(self, *, phase: str, kind: str):
        """A restore's (``kind`` "restore") or a delete's ("delete") lock of DIR: a
        :class:`~cuinterpose.agent.snapshot.dirclaim.SnapshotLock` (flock of the directory,
        nothing written; decisions D72). ``SnapshotError`` (``phase``) naming the holder."""
        from cuinterpose.agent.snapshot import dirclaim

        return dirclaim.SnapshotLock(self.path, phase=phase, kind=kind)

    def remove_stale_claim(self, run_id: str) -> bool:
        """Remove the claim a dead run ``run_id`` left (dirclaim.remove_stale)."""
        from cuinterpose.agent.snapshot import dirclaim

        return dirclaim.remove_stale(self, run_id)

    # -- the whole directory ----------------------------------------------------------------
    def remove_created(self) -> None:
        """rmdir the directories :func:`prepare` created, innermost first, stopping at the
        first that is not empty."""
        remove_empty(self.created)

    def delete(self) -> None:
        """Remove the snapshot: the manifest first (fsynced: a crash part-way leaves a
        directory that is no snapshot), then the directory, then the parent's fsync."""
        self.manifest_path.unlink()
        fsync_dir(self.path)
        shutil.rmtree(self.path)
        fsync_dir(self.path.parent)

    # -- durability ---------------------------------------------------------------------------
    def tree(self) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
        """(every regular file under DIR but the manifest, its temporary file and the run's
        claim, in path order; every directory under it and DIR itself, children before
        parents). Symlinks are neither followed nor listed."""
        files, dirs = [], []
        for top, _, names in os.walk(self.path, topdown=False, followlinks=False):
            d = pathlib.Path(top)
            dirs.append(d)
            for n in names:
                p = d / n
                if d == self.path and (n in (MANIFEST, MANIFEST_TMP) or is_claim(n)):
                    continue
                if stat_mod.S_ISREG(os.lstat(p).st_mode):
                    files.append(p)
        return sorted(files), dirs

    def sync(
        self,
        *,
        parents: tuple = (),
        outside: tuple = (),
        progress: Optional[Callable[[int, int], None]] = None,
        threads: Optional[int] = None,
    ) -> Synced:
        """Make the snapshot durable before its manifest: every regular file (:meth:`tree`)
        made 0600 and fsynced (fsync(2): data and the metadata to read it back), each CRIU
        image hashed (SHA-256) in the same pass while its pages are in the page cache, by a
        pool of ``threads`` (hashlib releases the GIL); then every directory bottom-up (made
        0700), then ``parents`` (the directories holding DIR's entry and those a checkpoint
        created). ``outside``: further files to fsync (the chunk store packs a checkpoint
        wrote). ``progress(done, total)`` (bytes, from the pool's threads). Raises
        ``AgentError`` (phase ``sync``) naming the file or directory and the errno
        (agent/snapshot/durability.py does the pass)."""
        try:
            files, dirs = self.tree()
        except OSError as e:  # a file that went away or cannot be read while listing
            raise durability.sync_failed(self.path, e.filename or self.path, "listing", e) from e
        return durability.sync_files(
            self.path,
            files + [pathlib.Path(p) for p in outside],
            dirs,
            hashed_under=self.path / CRIU,
            parents=parents,
            progress=progress,
            threads=threads,
        )


# -- the snapshot root -----------------------------------------------------------------------------
def children(root: os.PathLike | str) -> list[SnapshotDir]:
    """The sub-directories of the snapshot root ``root`` but the chunk store's, sorted by name
    (snapshots or not: ask :meth:`SnapshotDir.has_manifest`). ``OSError`` when ``root``
    cannot be read."""
    base = pathlib.Path(root)
    return [SnapshotDir(p) for p in sorted(base.iterdir()) if p.is_dir() and p.name != STORE]


# -- a new snapshot directory ------------------------------------------------------------------------
def prepare(images_dir: os.PathLike | str, *, run_id: str = "", group: str = "") -> SnapshotDir:
    """Create and claim a snapshot directory for a checkpoint; returns its
    :class:`SnapshotDir` at the canonical path (``paths.canonical``) with ``created`` (the
    directories this call made, outermost first, removed again by
    :meth:`SnapshotDir.remove_created`), ``claim`` (this run's
    :class:`~cuinterpose.agent.snapshot.dirclaim.DirClaim`: ``run_id``, ``group``) and
    ``notes`` for the operator.

    Missing directories are created 0700. Only a new or empty directory is accepted, and it is
    claimed before it is judged empty (dirclaim.py), so two runs racing for one directory
    cannot both pass. An existing directory open to group or other is made 0700 (a note says
    so). Refused (``SnapshotError``, phase "images dir", before anything is asked of the
    workload, what this call created removed again): a directory that already holds a
    snapshot (``manifest.json``) or anything else, one another live run has claimed (naming
    it), a path that is not a directory, one that cannot be created or written."""
    snap = SnapshotDir.canonical(images_dir)
    d = snap.path
    if os.path.lexists(d) and not d.is_dir():
        raise SnapshotError("images dir", f"{d} is not a directory")
    if snap.manifest_path.exists():
        raise SnapshotError(
            "images dir", f"{d} already holds a snapshot ({MANIFEST}); choose a new --images-dir"
        )
    snap.created = make_dirs(d)
    try:
        claim = snap.take_claim(run_id, group)
        try:
            names = snap.foreign()
            if names:
                shown = ", ".join(names[:5]) + (
                    f", … ({len(names)} entries)" if len(names) > 5 else ""
                )
                raise SnapshotError(
                    "images dir",
                    f"{d} is not empty ({shown}); a checkpoint writes "
                    "only into a new or empty directory: choose a new --images-dir",
                )
            st = os.stat(d)
            if st.st_mode & 0o077:
                os.chmod(d, DIR_MODE)
                snap.notes.append(
                    f"images dir {d} had mode {stat_mod.S_IMODE(st.st_mode):04o}: made "
                    f"{DIR_MODE:04o} (a snapshot holds the memory of the processes: it is "
                    "private to the agent's user)"
                )
        except BaseException:
            claim.release()
            raise
    except OSError as e:
        snap.remove_created()
        raise SnapshotError("images dir", f"{d} cannot be read: {e.strerror or e}") from None
    except BaseException:
        snap.remove_created()
        raise
    snap.claim = claim
    return snap


def make_dirs(d: os.PathLike | str) -> list[pathlib.Path]:
    """Create ``d`` and its missing parents, each 0700 (``mkdir`` one at a time, so only those
    this call made are returned, outermost first: :func:`remove_empty` takes them back);
    ``SnapshotError`` (phase "images dir") when one cannot be created (those made are removed
    again). Used for a snapshot directory and for the parents of a download's target."""
    d = pathlib.Path(d)
    todo = []
    p = d
    while not os.path.lexists(p) and p != p.parent:
        todo.insert(0, p)
        p = p.parent
    created: list[pathlib.Path] = []
    for p in todo:
        try:
            os.mkdir(p, DIR_MODE)
            created.append(p)
        except FileExistsError:
            continue  # another run made it meanwhile: not ours to remove
        except OSError as e:
            remove_empty(created)
            raise SnapshotError("images dir", f"{d} cannot be created: {e.strerror or e}") from None
    return created


def remove_empty(dirs) -> None:
    """rmdir ``dirs`` (as :func:`make_dirs` returns them) innermost first, stopping at the
    first that is not empty."""
    for p in reversed(list(dirs)):
        try:
            pathlib.Path(p).rmdir()
        except OSError:
            return

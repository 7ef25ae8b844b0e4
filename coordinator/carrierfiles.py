"""The chunk files SAVE_ALLOCATIONS writes and LOAD_ALLOCATIONS reads (protocol.h "Carriers";
issue 12 chunk format; docs/coordinator.md "Chunk files").

:class:`CarrierFiles` names, opens and removes the files of one capture in one directory:
``<dir>/shared-<pid>-<alloc_id as 32 hex>.bin``, one per carried allocation (a live creator
allocation that is not a raw import). SAVE opens each ``O_WRONLY | O_CREAT | O_EXCL |
O_NOFOLLOW``, mode 0600 (a file already there is refused, never overwritten), while the request
is sent (``CUI_CARRY_STREAMED``, decisions D70: the shim copies and writes the first streams
while the next files are created, which costs a file system without a journal up to a
millisecond each); LOAD opens them ``O_RDONLY | O_NOFOLLOW`` before. The shim receives
duplicates of the descriptors and closes them before it replies; this class closes its own
right after the request. The chunk tables of the
SAVE replies are kept per (pid, alloc_id) in :attr:`CarrierFiles.tables` for the manifest.

Chunk store (protocol.h "Chunk store"; decisions D34): with ``store`` set, the files are
packs of a content-addressed store shared by several snapshots, named ``<prefix>shared-<pid>-
<alloc_id>.bin``. ``known`` (digest -> (pack name, offset)) goes with every SAVE: a chunk
whose digest is there is not written, and :meth:`saved` records a ref to where its bytes are.
``names`` and ``refs`` (restore: from the manifest) say which pack each stream and each
chunk is read from; LOAD sends the other packs as sources. The caller (agent/snapshot/store.py)
keeps the packs it refers to from being deleted while it runs.

:meth:`CarrierFiles.private` makes a private directory (``mkdtemp``, mode 0700) for a capture
that has no snapshot directory (tests, a coordinator used alone); :meth:`remove` deletes the
files and that directory. Errors: OSError from open, naming the file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Iterable, Mapping

from .client import CarrierRequest
from .protocol import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_CHUNK_CHECKSUM,
    DEFAULT_STAGING_BYTES,
    DEFAULT_WRITERS,
    ChunkRef,
    ChunkSettings,
    Op,
    Record,
    RecordFlag,
    RecordKind,
    Role,
    StreamEntry,
    StreamTable,
    alloc_id_hex,
    check_carrier_params,
    chunk_checksum_flag,
)

__all__ = ["CarrierFiles", "carried_streams", "stream_file_name"]


def stream_file_name(pid: int, alloc_id: str | bytes) -> str:
    """``shared-<pid>-<alloc_id as 32 hex>.bin`` (the chunk format's name of a shim carrier)."""
    aid = alloc_id if isinstance(alloc_id, str) else alloc_id_hex(alloc_id)
    return f"shared-{int(pid)}-{aid}.bin"


def carried_streams(records: Iterable[Record]) -> list[tuple[bytes, int]]:
    """(alloc_id bytes, size) of every allocation the shim carries, in record order: the live
    creator allocations that are not raw imports (ops_carriers.c, cui_is_carried_role)."""
    kind, role, raw = int(RecordKind.ALLOCATION), int(Role.CREATOR), int(RecordFlag.RAW_IMPORT)
    return [
        (bytes(r.alloc_id), int(r.size))
        for r in records
        if r.kind == kind and r.role == role and not r.flags & raw
    ]


class CarrierFiles:
    """The chunk files of one capture in ``directory`` (created 0700 when missing).

    ``chunk_bytes``, ``staging_bytes`` (bytes), ``writers`` and ``checksum`` (a key of
    CHUNK_CHECKSUMS) go to every SAVE/LOAD request (ValueError outside protocol.h's limits).
    ``owned``: :meth:`remove` also deletes the directory. ``rel_dir``: the directory as the
    stream records name it (the agent's snapshot layout, agent/snapshot/snapdir.py, gives
    ``chunks``; default the directory's own name).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        writers: int = DEFAULT_WRITERS,
        owned: bool = False,
        store: str | None = None,
        prefix: str = "",
        known: Mapping[bytes, tuple[str, int]] | None = None,
        checksum: str = DEFAULT_CHUNK_CHECKSUM,
        rel_dir: str | None = None,
    ):
        check_carrier_params(chunk_bytes, staging_bytes, writers)
        chunk_checksum_flag(checksum)
        #: the chunk checksum of every request (the manifest's ``chunks.checksum``)
        self.checksum = checksum
        self.directory = os.fspath(directory)
        self.rel_dir = os.path.basename(self.directory) if rel_dir is None else rel_dir
        self.chunk_bytes = int(chunk_bytes)
        self.staging_bytes = int(staging_bytes)
        self.writers = int(writers)
        self.owned = owned
        #: the manifest's ``chunks.store`` (where the packs are, relative to the snapshot)
        self.store = store
        self.prefix = prefix
        self.known = dict(known) if known is not None else None
        #: what the caller keeps alive as long as these files are in use (the agent: the
        #: chunk store's lock); released by the caller
        self.holder = None
        #: called (no arguments) after :meth:`saved` recorded a SAVE reply's refs (the agent
        #: writes them to its .lock at once: a release after its death needs them)
        self.on_saved = None
        self.tables: dict[tuple[int, str], StreamTable] = {}
        #: (pid, alloc_id hex) -> file name in ``directory`` (restore: the manifest's pack)
        self.names: dict[tuple[int, str], str] = {}
        #: (pid, alloc_id hex) -> {chunk index: (file name in ``directory``, offset in bytes)}
        self.refs: dict[tuple[int, str], dict[int, tuple[str, int]]] = {}
        self._lock = threading.Lock()

    @property
    def settings(self) -> ChunkSettings:
        """The chunk settings every request of these files carries."""
        return ChunkSettings(self.chunk_bytes, self.staging_bytes, self.writers, self.checksum)

    @classmethod
    def private(cls, **kw) -> "CarrierFiles":
        """A fresh private directory (mode 0700) under $TMPDIR, removed by :meth:`remove`."""
        return cls(tempfile.mkdtemp(prefix="cuinterpose-chunks-"), owned=True, **kw)

    def name(self, pid: int, alloc_id: str | bytes) -> str:
        """The file name of ``pid``'s stream of ``alloc_id`` in :attr:`directory`."""
        aid = alloc_id if isinstance(alloc_id, str) else alloc_id_hex(alloc_id)
        return self.names.get((int(pid), aid)) or self.prefix + stream_file_name(pid, aid)

    def path(self, pid: int, alloc_id: str | bytes) -> str:
        return os.path.join(self.directory, self.name(pid, alloc_id))

    def _open_sources(self, req: CarrierRequest, op: Op, pid: int, streams) -> None:
        """LOAD: the chunk refs of ``streams`` and the files they name, opened read-only."""
        opened: dict[str, int] = {}
        for j, (aid, _) in enumerate(streams):
            key = (int(pid), alloc_id_hex(aid))
            for chunk, (name, off) in sorted(self.refs.get(key, {}).items()):
                if name not in opened:
                    path = os.path.join(self.directory, name)
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    except OSError as e:
                        raise OSError(
                            e.errno,
                            f"{op.name}: pid {pid} allocation {key[1]}: cannot open chunk store "
                            f"pack {path} (chunk {chunk}): {e.strerror}",
                        ) from None
                    opened[name] = len(req.sources)
                    req.sources.append((os.fstat(fd).st_size, fd))
                req.refs.append(ChunkRef(j, int(chunk), opened[name], int(off)))

    def _open_dir(self, op: Op, pid: int) -> int:
        """The directory, opened for the request's files (one path walk for all of them, and
        all of them in the same directory); OSError naming it."""
        try:
            return os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise OSError(
                e.errno,
                f"{op.name}: pid {pid}: cannot open the chunk directory {self.directory}: "
                f"{e.strerror}",
            ) from None

    def _open(self, op: Op, pid: int, aid: bytes, flags: int, dir_fd: int) -> int:
        """Open ``pid``'s chunk file of ``aid`` for ``op`` in ``dir_fd``; OSError naming op,
        pid, allocation and file."""
        path = self.path(pid, aid)
        try:
            return os.open(self.name(pid, aid), flags, 0o600, dir_fd=dir_fd)
        except OSError as e:
            raise OSError(
                e.errno,
                f"{op.name}: pid {pid} allocation {alloc_id_hex(aid)}: cannot open "
                f"chunk file {path}: {e.strerror}",
            ) from None

    def request(
        self, op: Op, pid: int, streams: list[tuple[bytes, int]], *, streamed: bool = True
    ) -> CarrierRequest:
        """The carriers of ``pid``'s ``streams`` for ``op``; close them with :meth:`close`.
        SAVE_ALLOCATIONS, ``streamed``: the files are created while the request is sent (its
        ``opener``; the client raises an OSError naming the file after the shim failed the op
        for it). LOAD_ALLOCATIONS, or a SAVE not ``streamed`` (a shim from before D70): opened
        now, OSError naming the file (what was opened is closed)."""
        req = CarrierRequest(
            self.chunk_bytes, self.staging_bytes, self.writers, checksum=self.checksum
        )
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if op == Op.SAVE_ALLOCATIONS:
            if streams:  # a snapshot without carriers gets no chunks/ directory
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
            if self.known is not None:
                req.known = list(self.known)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        req.dir_fd = self._open_dir(op, pid) if streams else -1
        if op == Op.SAVE_ALLOCATIONS and streamed:
            req.streams = [(StreamEntry(aid, size), -1) for aid, size in streams]
            req.opener = lambda i: self._open(op, pid, streams[i][0], flags, req.dir_fd)
            return req
        try:
            if op == Op.LOAD_ALLOCATIONS:
                self._open_sources(req, op, pid, streams)
            for aid, size in streams:
                fd = self._open(op, pid, aid, flags, req.dir_fd)
                req.streams.append((StreamEntry(aid, size), fd))
        except BaseException:
            self.close(req)
            raise
        return req

    @staticmethod
    def close(req: CarrierRequest | None) -> None:
        """Close the descriptors of ``req`` and its directory's (idempotent)."""
        if req is None:
            return
        for fd in [fd for _, fd in req.streams + req.sources] + [req.dir_fd]:
            try:
                if fd >= 0:  # -1: a SAVE file not opened, no directory
                    os.close(fd)
            except OSError:
                pass
        req.streams, req.sources, req.dir_fd = [], [], -1

    def saved(self, pid: int, tables: list[StreamTable]) -> None:
        """Keep the chunk tables of ``pid``'s SAVE_ALLOCATIONS reply."""
        with self._lock:
            for t in tables:
                self.tables[(int(pid), t.alloc_id)] = t
                if self.known is not None:  # the chunks the shim did not write
                    self.refs[(int(pid), t.alloc_id)] = {
                        i: self.known[c] for i, c in enumerate(t.checksums) if c in self.known
                    }
            if self.on_saved is not None:
                self.on_saved()

    def written_bytes(self) -> int:
        """Bytes of the non-zero chunks the shims wrote (not found in ``known``)."""
        total = 0
        for key, t in self.tables.items():
            refs = self.refs.get(key, {})
            for i, c in enumerate(t.checksums):
                if c is not None and i not in refs:
                    total += min(self.chunk_bytes, t.bytes - i * self.chunk_bytes)
        return total

    def streams_json(self) -> list[dict]:
        """The manifest's stream records (issue 12 chunk format), sorted by pid, alloc_id:
        ``{"file": "<rel_dir>/<name>", "kind": "shared", "pid", "alloc_id", "bytes", "zero":
        [indices], "checksums": [64 hex or None]}``; with a chunk store ``"pack": <file name>``
        and ``"refs": [[chunk, pack, offset]]`` instead of ``file``."""
        out = []
        for (pid, aid), t in sorted(self.tables.items()):
            rec = {
                "file": f"{self.rel_dir}/{stream_file_name(pid, aid)}",
                "kind": "shared",
                "pid": pid,
                "alloc_id": aid,
                "bytes": t.bytes,
                "zero": t.zero,
                "checksums": [None if c is None else c.hex() for c in t.checksums],
            }
            if self.store is not None:  # a pack of the chunk store, and where reused chunks are
                del rec["file"]
                rec["pack"] = self.name(pid, aid)
                refs = self.refs.get((pid, aid), {})
                rec["refs"] = [[i, n, o] for i, (n, o) in sorted(refs.items())]
            out.append(rec)
        return out

    def remove(self, pids: Iterable[int] | None = None) -> None:
        """Delete the chunk files (of ``pids``, or all) and, when owned and emptied, the
        directory. Missing files are fine."""
        want = None if pids is None else {int(p) for p in pids}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            if not name.startswith(self.prefix):
                continue  # another snapshot's pack of the chunk store
            base = name[len(self.prefix) :]
            parts = base.split("-")
            if not (base.startswith("shared-") and base.endswith(".bin") and len(parts) == 3):
                continue
            if want is not None and (not parts[1].isdigit() or int(parts[1]) not in want):
                continue
            try:
                os.unlink(os.path.join(self.directory, name))
            except FileNotFoundError:
                pass
        if want is None:
            self.tables.clear()
            if self.owned:
                shutil.rmtree(self.directory, ignore_errors=True)
            else:
                try:
                    os.rmdir(self.directory)
                except OSError:
                    pass


def streams_of(
    records_by_pid: Mapping[int, Iterable[Record]],
) -> dict[int, list[tuple[bytes, int]]]:
    """pid -> :func:`carried_streams` of its records."""
    return {int(p): carried_streams(rs) for p, rs in records_by_pid.items()}

"""What a snapshot is made of, for moving it between storages (docs/snapshot-format.md
"Object store"): its CRIU images, its chunk streams, its manifest.

:func:`plan` reads a manifest (untrusted: it may come from a bucket) into a :class:`Plan`
(:func:`streams`: only its chunk streams, what a push sends before the manifest exists):
the :class:`Image` files (``criu/<root>/...``, with SHA-256 and size) and the
:class:`Stream` files (shim carriers ``chunks/shared-<pid>-<alloc_id>.bin`` of ``chunks``;
native storage ``chunks/gpu-<pid>-<ordinal>.bin`` of ``gpu_storage``), each file name derived
from its numbers, never taken from the manifest. For a local snapshot of the chunk store
(``--incremental``) each chunk's bytes are in a pack (its own, or a ref's): :attr:`Stream.where`.

:func:`plain` converts a chunk-store manifest into the file-stream form (``chunks.store``
dropped; each stream's ``pack``/``refs`` replaced by its derived ``file``), also the copy in
``capture.chunks``. :func:`mac_ok`/:func:`signed` check and set the MAC with a given node key
(agent/snapshot/trust.py's format). The ``Target`` helpers build a plain snapshot
directory: sparse stream files (chunk i at ``i * chunk_bytes``, zero chunks left as holes),
image files, fsyncs, the manifest last and atomically; :func:`check_local` runs restore's
file checks (trust.py, chunks.py) on a directory. Errors: ``StorageError`` of the caller's
phase naming the file or field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import pathlib
import re
import shutil
from typing import Optional

from cuinterpose.agent.errors import SnapshotError
from cuinterpose.agent.snapshot import chunks, store, trust
from cuinterpose.agent.snapshot.backends.api import (
    PullResult,
    PushResult,
    SnapshotInfo,
    StorageError,
)
from cuinterpose.agent.snapshot.snapdir import (
    CRIU,
    DIR_MODE,
    MANIFEST,
    SnapshotDir,
    gpu_rel,
    pack_rel,
    shared_rel,
)
from cuinterpose.coordinator.protocol import CHUNK_CHECKSUMS, chunk_bytes_ok

FORMAT = "cuinterpose-snapshot"
#: a manifest larger than this is refused before it is read (bytes)
MANIFEST_MAX_BYTES = 256 << 20
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclasses.dataclass(frozen=True)
class Image:
    """A file under ``criu/`` (``rel``: its path in the snapshot), ``bytes`` long, SHA-256
    ``sha256`` (hex)."""

    rel: str
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Stream:
    """A chunk file: ``rel`` (derived), ``bytes``, ``chunk_bytes``, ``checksum`` (the
    algorithm), ``checksums`` (64 hex per chunk, None for a zero chunk), ``where`` (a local
    chunk-store stream: per chunk ``(pack name, offset)``; None: the bytes are in ``rel``)."""

    rel: str
    bytes: int
    chunk_bytes: int
    checksum: str
    checksums: tuple
    where: Optional[tuple] = None

    def length(self, i: int) -> int:
        """Bytes of chunk ``i`` (the last one may be short)."""
        return min(self.chunk_bytes, self.bytes - i * self.chunk_bytes)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The files of one snapshot: ``images``, ``streams``, and ``store`` (True: a local
    chunk-store snapshot whose streams read from packs)."""

    images: tuple
    streams: tuple
    store: bool = False

    def chunk_uses(self) -> dict:
        """``(checksum, hex digest) -> [(stream, chunk index)]`` of every non-zero chunk: one
        entry per distinct chunk (a chunk repeated in the snapshot is moved once)."""
        out: dict = {}
        for s in self.streams:
            for i, c in enumerate(s.checksums):
                if c is not None:
                    out.setdefault((s.checksum, c), []).append((s, i))
        return out

    def zero_chunks(self) -> int:
        return sum(c is None for s in self.streams for c in s.checksums)

    def chunk_bytes(self) -> int:
        """Bytes of the distinct non-zero chunks (what moves when none is present yet)."""
        return sum(s.length(i) for s, i in (u[0] for u in self.chunk_uses().values()))

    def image_bytes(self) -> int:
        return sum(i.bytes for i in self.images)

    def pushed(
        self, location: str, manifest_key: str, counts: tuple, rewritten: bool, elapsed_ns: int
    ) -> PushResult:
        """The :class:`~.api.PushResult` of a push of this plan; ``counts``: (chunks
        uploaded, their bytes, chunks present, their bytes)."""
        return PushResult(
            location,
            manifest_key,
            len(self.chunk_uses()),
            *counts,
            self.zero_chunks(),
            len(self.images),
            self.image_bytes(),
            rewritten,
            elapsed_ns,
        )

    def pulled(self, location: str, target, elapsed_ns: int) -> PullResult:
        """The :class:`~.api.PullResult` of a pull of this plan into ``target``."""
        return PullResult(
            location=location,
            target=str(target),
            chunks=len(self.chunk_uses()),
            chunk_bytes=self.chunk_bytes(),
            zero_chunks=self.zero_chunks(),
            images=len(self.images),
            image_bytes=self.image_bytes(),
            elapsed_ns=elapsed_ns,
        )


def hasher(checksum: str):
    """A new hashlib object of chunk checksum ``checksum`` (the digests coordinator/protocol
    ``chunk_digest`` computes: SHA-256, or BLAKE2b with a 32-byte digest)."""
    if checksum not in CHUNK_CHECKSUMS:
        raise ValueError(f"chunk checksum {checksum!r} is not one of {sorted(CHUNK_CHECKSUMS)}")
    return hashlib.sha256() if checksum == "sha256" else hashlib.blake2b(digest_size=32)


def _uint(v) -> bool:
    return type(v) is int and v >= 0


def _safe_image(rel) -> bool:
    if not isinstance(rel, str) or "\\" in rel or "\0" in rel or rel.startswith("/"):
        return False
    parts = rel.split("/")
    return len(parts) >= 3 and parts[0] == CRIU and all(p not in ("", ".", "..") for p in parts)


def _sums(where: str, v, size: int, cb: int, zero, phase: str) -> tuple:
    n = -(-size // cb)
    if not isinstance(v, list) or len(v) != n:
        raise StorageError(phase, f"{where}: {n} checksums expected (ceil(bytes / chunk_bytes))")
    if any(not (c is None or (isinstance(c, str) and _HEX64.match(c))) for c in v):
        raise StorageError(phase, f"{where}: a checksum is not 64 hex digits or null")
    if zero != [i for i, c in enumerate(v) if c is None]:
        raise StorageError(phase, f"{where}: field zero differs from the null checksums")
    return tuple(v)


def _chunk_params(where: str, rec: dict, phase: str) -> tuple[int, str]:
    cb, alg = rec.get("chunk_bytes"), rec.get("checksum")
    if not chunk_bytes_ok(cb):
        raise StorageError(
            phase, f"{where}.chunk_bytes {cb!r} is not a power of two, 64 KiB..1 GiB"
        )
    if alg not in CHUNK_CHECKSUMS:
        raise StorageError(
            phase, f"{where}.checksum {alg!r} is not one of {sorted(CHUNK_CHECKSUMS)}"
        )
    return cb, alg


def plan(m: dict, *, phase: str, allow_store: bool = False) -> Plan:
    """The :class:`Plan` of manifest ``m``, refusing (``StorageError`` of ``phase``, naming
    the field) anything a transfer would act on that is malformed: an image path outside
    ``criu/<root>/``, a bad size or digest, a stream whose numbers, checksums or zero list
    are wrong, and a chunk-store stream unless ``allow_store`` (a local push)."""
    if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("format_version") != 1:
        raise StorageError(phase, f"not a {FORMAT} format_version 1 manifest")
    files = (m.get("criu") or {}).get("files") if isinstance(m.get("criu"), dict) else None
    if not isinstance(files, dict) or not files:
        raise StorageError(phase, "field criu.files must map image paths to {sha256, bytes}")
    images = []
    for rel, meta in sorted(files.items()):
        ok = _safe_image(rel) and isinstance(meta, dict) and _uint(meta.get("bytes"))
        if not ok or not (isinstance(meta.get("sha256"), str) and _HEX64.match(meta["sha256"])):
            raise StorageError(
                phase, f"field criu.files names {rel!r}: not criu/<root>/... with sha256 and bytes"
            )
        images.append(Image(rel, meta["bytes"], meta["sha256"]))
    p = streams(m, phase=phase, allow_store=allow_store)
    return Plan(tuple(images), p.streams, p.store)


def streams(m: dict, *, phase: str, allow_store: bool = False) -> Plan:
    """The chunk streams of ``m`` (its ``chunks`` and ``gpu_storage`` records; nothing else of
    it is read) as a :class:`Plan` without images, with :func:`plan`'s refusals. What a push
    may send before the manifest exists: the streams as the manifest will record them."""
    streams, is_store = [], False
    ch = m.get("chunks")
    if ch is not None:
        if not isinstance(ch, dict) or not isinstance(ch.get("streams"), list):
            raise StorageError(phase, "field chunks must be an object with a streams list")
        cb, alg = _chunk_params("field chunks", ch, phase)
        is_store = "store" in ch
        if is_store and (not allow_store or ch["store"] != store.STORE_REL):
            raise StorageError(
                phase,
                f"field chunks.store {ch['store']!r}: a chunk-store manifest is read only from a "
                "local snapshot root",
            )
        for k, s in enumerate(ch["streams"]):
            if not isinstance(s, dict) or s.get("kind") != "shared":
                raise StorageError(phase, f"chunks.streams[{k}] is not a shared stream record")
            pid, aid, size = s.get("pid"), s.get("alloc_id"), s.get("bytes")
            if not (type(pid) is int and pid > 0 and isinstance(aid, str) and _HEX32.match(aid)):
                raise StorageError(phase, f"chunks.streams[{k}]: bad pid or alloc_id")
            if not _uint(size):
                raise StorageError(phase, f"chunks.streams[{k}]: bad bytes {size!r}")
            rel = shared_rel(pid, aid)
            sums = _sums(rel, s.get("checksums"), size, cb, s.get("zero"), phase)
            where = _store_where(rel, s, cb, sums, phase) if is_store else None
            streams.append(Stream(rel, size, cb, alg, sums, where))
    g = m.get("gpu_storage")
    if isinstance(g, dict) and g.get("streams"):
        cb, alg = _chunk_params("field gpu_storage", g, phase)
        if not isinstance(g["streams"], list):
            raise StorageError(phase, "field gpu_storage.streams must be a list")
        for k, s in enumerate(g["streams"]):
            ok = isinstance(s, dict) and s.get("kind") == "gpu"
            ok = ok and type(s.get("pid")) is int and s["pid"] > 0 and _uint(s.get("ordinal"))
            if not (ok and _uint(s.get("bytes"))):
                raise StorageError(phase, f"gpu_storage.streams[{k}] is not a gpu stream record")
            rel = gpu_rel(s["pid"], s["ordinal"])
            sums = _sums(rel, s.get("checksums"), s["bytes"], cb, s.get("zero"), phase)
            streams.append(Stream(rel, s["bytes"], cb, alg, sums))
    rels = [s.rel for s in streams]
    if len(set(rels)) != len(rels):
        raise StorageError(phase, "two streams have the same pid and alloc_id (or ordinal)")
    return Plan((), tuple(streams), is_store)


def _store_where(rel: str, s: dict, cb: int, sums: tuple, phase: str) -> tuple:
    """Per chunk of a chunk-store stream, ``(pack, offset)`` of its bytes (own pack at
    ``i * chunk_bytes`` unless a ref names another); refuses a bad pack name or ref."""
    pack, refs = s.get("pack"), s.get("refs")
    tail = f"-shared-{s['pid']}-{s['alloc_id']}.bin"
    if not (isinstance(pack, str) and store.PACK_RE.match(pack) and pack.endswith(tail)):
        raise StorageError(phase, f"{rel}: pack {pack!r} is not <16 hex>{tail}")
    at = {}
    for r in refs if isinstance(refs, list) else [None]:
        ok = isinstance(r, list) and len(r) == 3 and _uint(r[0]) and r[0] < len(sums)
        if not (ok and isinstance(r[1], str) and store.PACK_RE.match(r[1]) and _uint(r[2])):
            raise StorageError(phase, f"{rel}: field refs must be [[chunk, pack, offset]]")
        at[r[0]] = (r[1], r[2])
    return tuple(at.get(i, (pack, i * cb)) for i in range(len(sums)))


def _plain_chunks(ch):
    if not isinstance(ch, dict) or "store" not in ch:
        return ch
    out = {k: v for k, v in ch.items() if k != "store"}
    out["streams"] = [
        {
            **{k: v for k, v in s.items() if k not in ("pack", "refs")},
            "file": shared_rel(s["pid"], s["alloc_id"]),
        }
        for s in ch["streams"]
    ]
    return out


def plain(m: dict) -> tuple[dict, bool]:
    """(``m`` in the file-stream form, whether anything changed): a chunk-store manifest's
    ``chunks`` and ``capture.chunks`` without ``store`` and with each stream's derived
    ``file`` instead of ``pack``/``refs``; ``mac`` dropped when changed (re-sign with
    :func:`signed`). ``m`` itself is not modified."""
    if "store" not in (m.get("chunks") or {}):
        return m, False
    out = {k: v for k, v in m.items() if k != "mac"}
    out["chunks"] = _plain_chunks(m["chunks"])
    if isinstance(m.get("capture"), dict) and "chunks" in m["capture"]:
        out["capture"] = {**m["capture"], "chunks": _plain_chunks(m["capture"]["chunks"])}
    return out, True


def _mac(key: bytes, m: dict) -> str:
    return hmac.new(key, trust.canonical_bytes(m), hashlib.sha256).hexdigest()


def mac_ok(m: dict, key: bytes) -> bool:
    """Whether ``m`` carries a valid MAC under ``key`` (agent/snapshot/trust.py format)."""
    mac = m.get("mac")
    return (
        isinstance(mac, dict)
        and mac.get("alg") == trust.MAC_ALG
        and isinstance(mac.get("value"), str)
        and hmac.compare_digest(mac["value"], _mac(key, m))
    )


def signed(m: dict, key: Optional[bytes]) -> dict:
    """``m`` with its ``mac`` under ``key`` (without a key: ``m`` without ``mac``)."""
    out = {k: v for k, v in m.items() if k != "mac"}
    if key is not None:
        out["mac"] = {"alg": trust.MAC_ALG, "key_id": trust.key_id(key), "value": _mac(key, out)}
    return out


def dumps(m: dict) -> bytes:
    """The manifest file's bytes, as agent/snapshot/manifest.py writes them."""
    return json.dumps(m, indent=2, sort_keys=True).encode() + b"\n"


def loads(data: bytes, where: str, phase: str) -> dict:
    """A manifest from ``data``; ``StorageError`` naming ``where`` when it is not JSON."""
    try:
        m = json.loads(data)
    except ValueError as e:
        raise StorageError(phase, f"{where} is not valid JSON: {e}") from None
    if not isinstance(m, dict):
        raise StorageError(phase, f"{where} is not a JSON object")
    return m


def check_mac(m: dict, key: Optional[bytes], where: str, phase: str) -> None:
    """With a node key, refuse a manifest without a valid MAC under it (nothing otherwise)."""
    if key is not None and not mac_ok(m, key):
        raise StorageError(
            phase,
            f"{where} was modified or not signed with this node's key (key id {trust.key_id(key)})",
        )


def check_local(d: pathlib.Path, m: dict, phase: str) -> None:
    """Restore's checks of the files of snapshot directory ``d`` against ``m``: the image set
    (trust.check_image_set), the chunk streams against the capture's carriers (chunks.check)
    and the native storage streams (trust.check_gpu_storage). Raises ``StorageError`` of
    ``phase`` with the check's reason."""
    from cuinterpose.agent.snapshot import manifest

    try:
        trust.check_image_set(d, m)
        chunks.check(d, m, manifest.carriers_from_capture(m.get("capture")))
        trust.check_gpu_storage(d, m)
    except SnapshotError as e:
        raise StorageError(phase, e.reason) from None


def local_manifest(d, phase: str) -> tuple[bytes, dict]:
    """(bytes, dict) of the manifest of the snapshot directory ``d`` (a path or a
    SnapshotDir; never through a symlink); ``StorageError`` when ``d`` is no snapshot."""
    snap = SnapshotDir(d)
    p = snap.manifest_path
    try:
        data = snap.read_manifest(follow=False, limit=MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        raise StorageError(phase, f"{snap.path} is not a snapshot: no {MANIFEST}") from None
    except OSError as e:
        raise StorageError(phase, f"{p} cannot be opened: {e.strerror}") from None
    if len(data) > MANIFEST_MAX_BYTES:
        raise StorageError(phase, f"{p} is over {MANIFEST_MAX_BYTES} bytes")
    return data, loads(data, str(p), phase)


class Target:
    """A plain snapshot directory being built at ``path`` (missing, or an empty directory),
    through its :class:`~cuinterpose.agent.snapshot.snapdir.SnapshotDir`: :meth:`open_files`
    creates every image and stream file at its final size (streams sparse), :meth:`pwrite`
    writes into one, :meth:`commit` fsyncs everything and writes the manifest last
    (atomically), :meth:`discard` removes what was written (the directory too when this
    created it). Files are created ``O_EXCL|O_NOFOLLOW``, 0600, in directories 0700 (the
    target itself too)."""

    def __init__(self, path, phase: str):
        self.snap = SnapshotDir(os.path.abspath(path))
        self.path = self.snap.path
        self.phase = phase
        self.created = False
        self.fds: dict[str, int] = {}
        try:
            if os.path.lexists(self.path):
                if self.path.is_symlink() or not self.path.is_dir() or any(self.path.iterdir()):
                    raise StorageError(
                        phase, f"{self.path} is not an empty directory; nothing was written"
                    )
            else:
                self.path.mkdir(mode=DIR_MODE)
                self.created = True
            os.chmod(self.path, DIR_MODE)
        except OSError as e:
            raise StorageError(phase, f"{self.path} cannot be created: {e.strerror}") from None

    def open_files(self, p: Plan) -> None:
        rel = ""
        try:
            for rel, size in [(i.rel, i.bytes) for i in p.images] + [
                (s.rel, s.bytes) for s in p.streams
            ]:
                if "/" in rel:
                    self.snap.make_dirs(rel.rsplit("/", 1)[0])
                fd = self.snap.open(rel, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
                self.fds[rel] = fd
                os.ftruncate(fd, size)
        except OSError as e:
            raise StorageError(
                self.phase, f"{self.path / rel} cannot be created: {e.strerror}"
            ) from None

    def pwrite(self, rel: str, data, offset: int) -> None:
        """``data`` into file ``rel`` at ``offset``; ``StorageError`` naming the file on a
        write error (ENOSPC, EIO)."""
        view = memoryview(data)
        try:
            while view:
                n = os.pwrite(self.fds[rel], view, offset)
                view, offset = view[n:], offset + n
        except OSError as e:
            raise StorageError(
                self.phase, f"writing {self.path / rel} failed: {e.strerror} (errno {e.errno})"
            ) from None

    def fd(self, rel: str) -> int:
        return self.fds[rel]

    def commit(self, manifest_bytes: bytes) -> None:
        """fsync every file and directory, then write ``manifest.json`` (tmp, fsync, rename,
        fsync of the directory): the snapshot exists only from here on."""
        try:
            for fd in self.fds.values():
                os.fsync(fd)
            dirs = {r.rsplit("/", 1)[0] if "/" in r else "" for r in self.fds}
            ups = {"/".join(d.split("/")[:i]) for d in dirs for i in range(1, d.count("/") + 1)}
            for d in sorted((dirs | ups) - {""}, key=lambda d: -d.count("/")):
                self.snap.fsync_dir(d)
            self.snap.write_manifest(manifest_bytes)
        except OSError as e:
            raise StorageError(self.phase, f"writing {self.path} failed: {e.strerror}") from None
        finally:
            self.close()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def discard(self) -> None:
        """Remove what this target wrote (best effort; the directory too if it created it)."""
        self.close()
        try:
            if self.created:
                shutil.rmtree(self.path)
            else:
                for p in self.path.iterdir():
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:
            pass


def chunk_file(s: Stream, i: int) -> tuple[str, int]:
    """Where chunk ``i`` of local stream ``s`` lies: (name relative to the snapshot directory,
    offset) — its chunk file at ``i * chunk_bytes``, or a chunk store pack
    (``../.cuinterpose-store/packs/NAME``, ``where``); open it with ``SnapshotDir.open``."""
    if s.where is None:
        return s.rel, i * s.chunk_bytes
    pack, off = s.where[i]
    return pack_rel(pack), off


def snapshot_info(location: str, data: bytes, m: dict) -> SnapshotInfo:
    """The :class:`~.api.SnapshotInfo` of manifest ``m`` (``data``: its bytes)."""
    files = (m.get("criu") or {}).get("files") or {}
    streams = list((m.get("chunks") or {}).get("streams") or []) + list(
        (m.get("gpu_storage") or {}).get("streams") or []
    )
    mac = m.get("mac") if isinstance(m.get("mac"), dict) else {}
    return SnapshotInfo(
        location=location,
        snapshot_id=str(m.get("snapshot_id", "")),
        created_at=str(m.get("created_at", "")),
        roots=tuple(m.get("roots") or ()),
        image_bytes=sum(int(v.get("bytes", 0)) for v in files.values() if isinstance(v, dict)),
        chunk_bytes=sum(int(s.get("bytes", 0)) for s in streams if isinstance(s, dict)),
        signed_key_id=mac.get("key_id"),
        manifest_bytes=len(data),
        carrier_bytes=int(_dict(m.get("totals")).get("carrier_bytes", 0)),
        driver=str(_dict(m.get("driver")).get("kind", "")),
        native=str(_dict(m.get("native")).get("backend", "")),
    )


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}

"""The ``chunks`` object of a manifest and what restore trusts of ``DIR/chunks/``
(docs/snapshot-format.md "chunks"; issue 12 chunk format).

``{"chunk_bytes": N, "checksum": "blake2b-256" or "sha256", "streams": [{"file":
"chunks/shared-<pid>-<alloc_id>.bin", "kind": "shared", "pid", "alloc_id" (32 hex), "bytes",
"zero": [indices], "checksums": [64 hex or null per chunk]}]}``: one stream per shim carrier.

:func:`from_capture` derives it from the capture (``Capture.to_dict()["chunks"]``, without the
coordinator's local ``directory``/``private`` keys). :func:`check` refuses a restore
(``SnapshotError``, phase "manifest", naming the file or field) unless: the object has that
shape (``len(checksums) == ceil(bytes / chunk_bytes)``, null exactly at the ``zero`` indices);
each file name is derived from its pid and alloc_id; the streams are exactly the carriers of the
capture's records (pid, alloc_id, bytes, and carrier_checksum == cui_checksum64 of the
digests); and every entry under ``chunks/`` (walked without following links) is a regular file
that is listed, with the listed size. ``gpu-*.bin`` entries belong to the native backend's
streams and are left to its check. A snapshot of the chunk store (``chunks.store`` ==
``store.STORE_REL``; agent/snapshot/store.py) has ``pack`` and ``refs`` instead of ``file``:
each pack name is derived from pid and alloc_id, the refs are ascending and name non-zero
chunks, and each pack is a regular file of the store (its own: the stream's size; the others:
long enough for each ref); ``chunks/`` then holds no shared file. Nothing is modified.
"""

from __future__ import annotations

import re
import stat

from cuinterpose.agent.errors import SnapshotError
from cuinterpose.agent.snapshot import store
from cuinterpose.agent.snapshot.snapdir import CHUNKS, GPU_PREFIX, SnapshotDir, pack_rel, shared_rel
from cuinterpose.coordinator.protocol import CHUNK_CHECKSUMS, chunk_bytes_ok

LOCAL_KEYS = ("directory", "private")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def from_capture(capture) -> dict:
    """The manifest's ``chunks`` object from a capture dict (its local keys dropped)."""
    ch = dict((capture or {}).get("chunks") or {}) if isinstance(capture, dict) else {}
    for k in LOCAL_KEYS:
        ch.pop(k, None)
    return ch


def normalize(manifest: dict) -> None:
    """Before a manifest is written: the top-level ``chunks`` from the capture, and the
    capture's copy without the coordinator's local keys (in place)."""
    cap = manifest.get("capture")
    if isinstance(cap, dict) and isinstance(cap.get("chunks"), dict):
        cap["chunks"] = from_capture(cap)
        manifest.setdefault("chunks", dict(cap["chunks"]))


def _refuse(snapshot, what: str) -> SnapshotError:
    return SnapshotError("manifest", f"{snapshot}: {what}; restore refused, snapshot untouched")


def _digest_sum(checksums) -> int:
    from cuinterpose.coordinator.protocol import cui_checksum64

    return cui_checksum64(b"".join(bytes(32) if c is None else bytes.fromhex(c) for c in checksums))


def _name(s: dict) -> str:
    return str(s.get("file") or s.get("pack"))


def _store_shape(snapshot, s: dict, cb: int) -> None:
    """A stream of the chunk store: its own pack derived from pid and alloc_id, and refs
    [[chunk, pack, offset]] strictly ascending by chunk, each pack name of the store's form."""
    pack, refs = s.get("pack"), s.get("refs")
    tail = f"-shared-{s['pid']}-{s['alloc_id']}.bin"
    if "file" in s or not (
        isinstance(pack, str) and store.PACK_RE.match(pack) and pack.endswith(tail)
    ):
        raise _refuse(
            snapshot,
            f"stream pack {pack!r} is not <16 hex>{tail} (derived from its pid and alloc_id), "
            "or the stream also names a file",
        )
    ok = isinstance(refs, list) and all(
        isinstance(r, list)
        and len(r) == 3
        and type(r[0]) is int
        and r[0] >= 0
        and isinstance(r[1], str)
        and store.PACK_RE.match(r[1])
        and type(r[2]) is int
        and r[2] >= 0
        for r in refs
    )
    if not ok or [r[0] for r in refs] != sorted({r[0] for r in refs}):
        raise _refuse(
            snapshot,
            f"stream {pack}: field refs must be [[chunk, pack, offset]] strictly ascending by "
            "chunk, each pack a name of the chunk store",
        )


def _check_packs(snapshot, ch: dict, streams: list[dict]) -> None:
    """Every pack a store snapshot reads is a regular file in the store: its own packs of
    the stream's size, the others long enough for each ref."""
    snap = SnapshotDir(snapshot)
    cb = ch["chunk_bytes"]
    own = {s["pack"]: s["bytes"] for s in streams}
    ends: dict[str, int] = {}
    for s in streams:
        for i, name, off in s["refs"]:
            ends[name] = max(ends.get(name, 0), off + min(cb, s["bytes"] - i * cb))
    for name in sorted(set(own) | set(ends)):
        p = snap.file(pack_rel(name))
        try:
            st = snap.lstat(pack_rel(name))
        except FileNotFoundError:
            raise _refuse(snapshot, f"chunk store pack {p} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(snapshot, f"chunk store pack {p} is not a regular file (a symlink?)")
        if name in own and st.st_size != own[name]:
            raise _refuse(
                snapshot,
                f"chunk store pack {p} is {st.st_size} bytes, the manifest says {own[name]}",
            )
        if st.st_size < ends.get(name, 0):
            raise _refuse(
                snapshot,
                f"chunk store pack {p} is {st.st_size} bytes, a ref of the manifest ends at byte "
                f"{ends[name]}",
            )


def _shape(snapshot, ch) -> list[dict]:
    if not isinstance(ch, dict) or ch.get("checksum") not in CHUNK_CHECKSUMS:
        raise _refuse(
            snapshot,
            'field chunks must be {"chunk_bytes", "checksum": '
            + " or ".join(f'"{c}"' for c in sorted(CHUNK_CHECKSUMS))
            + ", ...}",
        )
    cb = ch.get("chunk_bytes")
    if not chunk_bytes_ok(cb):
        raise _refuse(
            snapshot, f"field chunks.chunk_bytes {cb!r} is not a power of two from 64 KiB to 1 GiB"
        )
    streams = ch.get("streams")
    store_mode = "store" in ch
    if store_mode and ch["store"] != store.STORE_REL:
        raise _refuse(snapshot, f"field chunks.store {ch['store']!r} is not {store.STORE_REL!r}")
    if not isinstance(streams, list):
        raise _refuse(snapshot, "field chunks.streams must be a list")
    for s in streams:
        if not isinstance(s, dict):
            raise _refuse(snapshot, f"field chunks.streams holds {s!r}, not a stream record")
        pid, aid, size = s.get("pid"), s.get("alloc_id"), s.get("bytes")
        ok = type(pid) is int and pid > 0 and isinstance(aid, str) and _HEX32.match(aid)
        ok = ok and type(size) is int and size >= 0 and s.get("kind") == "shared"
        if not ok:
            raise _refuse(snapshot, f"stream {s.get('file')!r}: bad kind, pid, alloc_id or bytes")
        if store_mode:
            _store_shape(snapshot, s, cb)
        elif s.get("file") != shared_rel(pid, aid):
            raise _refuse(
                snapshot,
                f"stream file {s.get('file')!r} is not {shared_rel(pid, aid)} "
                "(derived from its pid and alloc_id)",
            )
        sums, zero = s.get("checksums"), s.get("zero")
        n = -(-size // cb)
        if not isinstance(sums, list) or len(sums) != n or not isinstance(zero, list):
            raise _refuse(
                snapshot, f"stream {_name(s)}: {n} checksums expected (ceil(bytes / chunk_bytes))"
            )
        if any(not (c is None or (isinstance(c, str) and _HEX64.match(c))) for c in sums):
            raise _refuse(snapshot, f"stream {_name(s)}: a checksum is not 64 hex digits or null")
        if zero != [i for i, c in enumerate(sums) if c is None]:
            raise _refuse(
                snapshot, f"stream {_name(s)}: field zero differs from the null checksums"
            )
        if store_mode and any(sums[r[0]] is None for r in s["refs"] if r[0] < n):
            raise _refuse(snapshot, f"stream {_name(s)}: a ref names an all-zero chunk")
        if store_mode and any(r[0] >= n for r in s["refs"]):
            raise _refuse(snapshot, f"stream {_name(s)}: a ref names a chunk past its {n} chunks")
    return streams


def check(snapshot, m: dict, carriers: list[dict]) -> None:
    """Refuse unless ``m["chunks"]`` and ``DIR/chunks/`` are what the capture's ``carriers``
    (``topology.carriers`` of its records) say (module docstring)."""
    snap = SnapshotDir(snapshot)
    base = snap.path
    ch = m.get("chunks")
    if ch is None and not carriers:
        return
    if ch is None:
        raise _refuse(
            snapshot,
            f"the capture carries {len(carriers)} allocations but the manifest has no field chunks",
        )
    streams = _shape(snapshot, ch)
    have = {(s["pid"], s["alloc_id"]): s for s in streams}
    want = {(c["pid"], c["alloc_id"]): c for c in carriers}
    for key in sorted(set(have) ^ set(want)):
        where = "the capture's records" if key in want else "field chunks.streams"
        raise _refuse(snapshot, f"pid {key[0]} allocation {key[1]} is only in {where}")
    for key, s in have.items():
        c = want[key]
        if s["bytes"] != c["bytes"] or f"{_digest_sum(s['checksums']):016x}" != c["checksum"]:
            raise _refuse(
                snapshot,
                f"stream {_name(s)} ({s['bytes']} bytes) disagrees with the carrier record of "
                f"pid {key[0]} allocation {key[1]} ({c['bytes']} bytes, checksum {c['checksum']})",
            )
    if "store" in ch:
        _check_packs(snapshot, ch, streams)
    listed = {s["file"]: s["bytes"] for s in streams if "file" in s}
    top = base / CHUNKS
    try:
        st = snap.lstat(CHUNKS)
    except FileNotFoundError:
        if listed:
            raise _refuse(snapshot, f"{top} is missing") from None
        return
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(snapshot, f"{top} is not a directory (a symlink?)")
    found = set()
    for name in snap.names(CHUNKS):
        p, rel = top / name, f"{CHUNKS}/{name}"
        mode = snap.lstat(rel)
        if not stat.S_ISREG(mode.st_mode):
            raise _refuse(
                snapshot, f"{p} is not a regular file (a symlink, directory or special file)"
            )
        if rel not in listed:
            if name.startswith(GPU_PREFIX):
                continue  # the native backend's streams (their own check)
            raise _refuse(snapshot, f"{p} is not listed in the manifest's chunks.streams")
        if mode.st_size != listed[rel]:
            raise _refuse(snapshot, f"{p} is {mode.st_size} bytes, the manifest says {listed[rel]}")
        found.add(rel)
    missing = sorted(set(listed) - found)
    if missing:
        raise _refuse(snapshot, f"chunk file {base / missing[0]} listed in the manifest is missing")

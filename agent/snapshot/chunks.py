"""The ``chunks`` object of a manifest and what restore trusts of ``DIR/chunks/``
(docs/snapshot-format.md "chunks"; issue 12 chunk format).

``{"chunk_bytes": N, "checksum": "blake2b-256", "streams": [{"file":
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
streams and are left to its check. Nothing is modified.
"""

from __future__ import annotations

import os
import pathlib
import re
import stat

from cuinterpose.agent.errors import SnapshotError

CHUNKS_DIR = "chunks"
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


def _shape(snapshot, ch) -> list[dict]:
    if not isinstance(ch, dict) or ch.get("checksum") != "blake2b-256":
        raise _refuse(
            snapshot, 'field chunks must be {"chunk_bytes", "checksum": "blake2b-256", ...}'
        )
    cb = ch.get("chunk_bytes")
    if type(cb) is not int or cb < 1 << 16 or cb > 1 << 30 or cb & (cb - 1):
        raise _refuse(
            snapshot, f"field chunks.chunk_bytes {cb!r} is not a power of two from 64 KiB to 1 GiB"
        )
    streams = ch.get("streams")
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
        if s.get("file") != f"{CHUNKS_DIR}/shared-{pid}-{aid}.bin":
            raise _refuse(
                snapshot,
                f"stream file {s.get('file')!r} is not {CHUNKS_DIR}/shared-{pid}-{aid}.bin "
                "(derived from its pid and alloc_id)",
            )
        sums, zero = s.get("checksums"), s.get("zero")
        n = -(-size // cb)
        if not isinstance(sums, list) or len(sums) != n or not isinstance(zero, list):
            raise _refuse(
                snapshot, f"stream {s['file']}: {n} checksums expected (ceil(bytes / chunk_bytes))"
            )
        if any(not (c is None or (isinstance(c, str) and _HEX64.match(c))) for c in sums):
            raise _refuse(snapshot, f"stream {s['file']}: a checksum is not 64 hex digits or null")
        if zero != [i for i, c in enumerate(sums) if c is None]:
            raise _refuse(
                snapshot, f"stream {s['file']}: field zero differs from the null checksums"
            )
    return streams


def check(snapshot, m: dict, carriers: list[dict]) -> None:
    """Refuse unless ``m["chunks"]`` and ``DIR/chunks/`` are what the capture's ``carriers``
    (``topology.carriers`` of its records) say (module docstring)."""
    base = pathlib.Path(snapshot)
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
                f"stream {s['file']} ({s['bytes']} bytes) disagrees with the carrier record of "
                f"pid {key[0]} allocation {key[1]} ({c['bytes']} bytes, checksum {c['checksum']})",
            )
    listed = {s["file"]: s["bytes"] for s in streams}
    top = base / CHUNKS_DIR
    try:
        st = os.lstat(top)
    except FileNotFoundError:
        if listed:
            raise _refuse(snapshot, f"{top} is missing") from None
        return
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(snapshot, f"{top} is not a directory (a symlink?)")
    found = set()
    for name in sorted(os.listdir(top)):
        p, rel = top / name, f"{CHUNKS_DIR}/{name}"
        mode = os.lstat(p)
        if not stat.S_ISREG(mode.st_mode):
            raise _refuse(
                snapshot, f"{p} is not a regular file (a symlink, directory or special file)"
            )
        if rel not in listed:
            if name.startswith("gpu-"):
                continue  # the native backend's streams (their own check)
            raise _refuse(snapshot, f"{p} is not listed in the manifest's chunks.streams")
        if mode.st_size != listed[rel]:
            raise _refuse(snapshot, f"{p} is {mode.st_size} bytes, the manifest says {listed[rel]}")
        found.add(rel)
    missing = sorted(set(listed) - found)
    if missing:
        raise _refuse(snapshot, f"chunk file {base / missing[0]} listed in the manifest is missing")

"""A manifest is untrusted input (docs/snapshot-format.md "What restore trusts").

Everything a restore takes from ``manifest.json`` is checked or derived here before anything
on the node changes:

* paths: ``control_dir`` is absolute and normal; every participant's socket is
  ``<control_dir>/cuinterpose-<pid>.sock`` (:func:`socket_path`, derived: the recorded
  ``socket_path`` must equal it); ``criu.trees`` and ``criu.files`` name only
  ``criu/<root>/...`` (no ``..``, no absolute path);
* the files: the set of entries under ``criu/`` equals ``criu.files`` (an extra, a missing
  or a symlinked entry refuses) (:func:`check_image_set`);
* copies: the top-level ``carriers`` equal the capture's ``carriers`` and the ones its
  records give (:func:`check_carriers`);
* the chunk files: ``chunks`` names one stream per carrier of the capture, each file under
  ``chunks/`` is listed, regular and of the listed size (:func:`check_chunks`);
* the MAC: with a node key, HMAC-SHA256 over :func:`canonical_bytes` in the ``mac`` field
  (:func:`sign`, :func:`check_mac`).

Every refusal is a ``SnapshotError`` (phase "manifest") naming the snapshot and the field.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pathlib
import stat
from typing import Optional

from cuinterpose.agent.errors import SnapshotError
from cuinterpose.agent.snapshot.snapdir import CRIU, SnapshotDir, criu_rel, gpu_rel
from cuinterpose.coordinator.protocol import CHUNK_CHECKSUMS, chunk_bytes_ok

MAC_ALG = "hmac-sha256"
#: the environment variable naming the node key file (set by ``--manifest-key`` and
#: ``manifestKeyFile``; read by every manifest write and load of this process)
KEY_ENV = "CUINTERPOSE_MANIFEST_KEY_FILE"
_KEY_FILE: Optional[str] = None


def set_key_file(path: Optional[str]) -> None:
    """Use the node key in ``path`` (None: the environment's :data:`KEY_ENV`, else no key)."""
    global _KEY_FILE
    _KEY_FILE = os.path.abspath(path) if path else None


def key_file() -> Optional[str]:
    return _KEY_FILE or os.environ.get(KEY_ENV) or None


def node_key() -> Optional[bytes]:
    """The node key's bytes (surrounding whitespace stripped), None without a key. Raises
    ``SnapshotError`` naming the file when it cannot be read or is empty."""
    path = key_file()
    if not path:
        return None
    try:
        key = pathlib.Path(path).read_bytes().strip()
    except OSError as e:
        raise SnapshotError(
            "manifest key", f"node key file {path} cannot be read: {e.strerror or e}"
        ) from None
    if not key:
        raise SnapshotError("manifest key", f"node key file {path} is empty")
    return key


def canonical_bytes(m: dict) -> bytes:
    """The bytes the MAC covers: the manifest without ``mac`` as compact JSON, keys sorted,
    ASCII only."""
    body = {k: v for k, v in m.items() if k != "mac"}
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def _mac(key: bytes, m: dict) -> str:
    return hmac.new(key, canonical_bytes(m), hashlib.sha256).hexdigest()


def key_id(key: bytes) -> str:
    """First 16 hex digits of SHA-256(key): which key signed, without revealing it."""
    return hashlib.sha256(key).hexdigest()[:16]


def sign(m: dict) -> dict:
    """``m`` with ``mac`` set when a node key is configured (``m`` unchanged without one)."""
    key = node_key()
    if key is None:
        return m
    out = {k: v for k, v in m.items() if k != "mac"}
    out["mac"] = {"alg": MAC_ALG, "key_id": key_id(key), "value": _mac(key, out)}
    return out


def check_mac(snapshot, m: dict) -> None:
    """With a node key: refuse a manifest without a valid ``mac``. Without one: nothing."""
    key = node_key()
    if key is None:
        return
    mac = m.get("mac")
    ok = (
        isinstance(mac, dict)
        and mac.get("alg") == MAC_ALG
        and isinstance(mac.get("value"), str)
        and hmac.compare_digest(mac["value"], _mac(key, m))
    )
    if not ok:
        raise SnapshotError(
            "manifest",
            f"manifest of {snapshot} was modified or not signed with this node's key "
            f"({key_file()}, key id {key_id(key)}); restore refused, snapshot untouched",
        )


def socket_path(control_dir: str, pid: int) -> str:
    """``<control_dir>/cuinterpose-<pid>.sock``: the only socket path a restore uses."""
    from cuinterpose.coordinator.protocol import socket_path as sp

    return sp(control_dir, pid)


def _bad_rel(rel) -> bool:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return True
    parts = rel.split("/")
    return any(p in ("", ".", "..") for p in parts) or "\0" in rel


def path_problem(m: dict) -> Optional[str]:
    """What is wrong with a path the manifest names (None if nothing)."""
    cd = m["control_dir"]
    if not os.path.isabs(cd) or os.path.normpath(cd) != cd or "\0" in cd:
        return f"field control_dir {cd!r} must be an absolute, normalized path"
    for p in m["participants"]:
        want = socket_path(cd, p["pid"])
        if p["socket_path"] != want:
            return (
                f"participant {p['pid']}: socket_path {p['socket_path']!r} is not {want!r} "
                "(<control_dir>/cuinterpose-<pid>.sock)"
            )
    roots = {str(r) for r in m["roots"]}
    trees = m["criu"].get("trees", {})
    if not isinstance(trees, dict) or any(
        k not in roots or v != criu_rel(k) for k, v in trees.items()
    ):
        return f"field criu.trees must map each root to {CRIU}/<root>"
    for rel in m["criu"]["files"]:
        parts = rel.split("/") if isinstance(rel, str) else []
        if _bad_rel(rel) or len(parts) < 3 or parts[0] != CRIU or parts[1] not in roots:
            return (
                f"field criu.files names {rel!r}, not a file under {CRIU}/<root>/ "
                "(no '..', no absolute path)"
            )
    return None


def check_image_set(snapshot, m: dict) -> None:
    """The entries under ``criu/`` (walked without following links) must be exactly the
    directories of ``criu.files`` and its regular files; refuses naming the first extra or
    missing entry, a symlink, or a ``criu`` that is not a directory."""
    snap = SnapshotDir(snapshot)
    base = snap.path
    listed = set(m["criu"]["files"])
    dirs = {"/".join(r.split("/")[:i]) for r in listed for i in range(1, r.count("/") + 1)}
    top = base / CRIU
    try:
        st = snap.lstat(CRIU)
    except FileNotFoundError:
        raise SnapshotError("manifest", f"{top} is missing") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SnapshotError("manifest", f"{top} is not a directory (a symlink?); restore refused")
    found_files, found_dirs = set(), {CRIU}
    for rel, mode in snap.walk(CRIU):
        if stat.S_ISDIR(mode):
            found_dirs.add(rel)
        elif stat.S_ISREG(mode):
            found_files.add(rel)
        else:
            raise SnapshotError(
                "manifest",
                f"{base / rel} is not a regular file or directory (a symlink or special file "
                "in the CRIU images); restore refused, snapshot untouched",
            )
    extra = sorted((found_files - listed) | (found_dirs - dirs))
    if extra:
        raise SnapshotError(
            "manifest",
            f"{base / extra[0]} is not listed in the manifest's criu.files "
            f"({len(extra)} unlisted entr{'y' if len(extra) == 1 else 'ies'} under "
            f"{CRIU}/); restore refused, snapshot untouched",
        )
    missing = sorted(listed - found_files)
    if missing:
        raise SnapshotError(
            "manifest",
            f"CRIU image {base / missing[0]} listed in the manifest is missing",
        )


def _carrier_key(c) -> tuple:
    if not isinstance(c, dict):
        return ("?", repr(c))
    return (c.get("pid"), c.get("alloc_id"), c.get("bytes"), c.get("checksum"))


def check_carriers(snapshot, m: dict, from_records: list[dict]) -> None:
    """Every copy of the carrier checksums agrees: the top-level ``carriers``, the capture's
    ``carriers`` and ``from_records`` (what the capture's records give)."""
    top = m["carriers"]
    if not isinstance(top, list):
        raise SnapshotError("manifest", f"{snapshot}: field carriers must be a list")
    want = sorted(map(_carrier_key, top), key=repr)
    copies = {"the records of capture": from_records}
    cap = m["capture"]
    if isinstance(cap, dict) and "carriers" in cap:
        copies["capture.carriers"] = cap["carriers"]
    for where, other in copies.items():
        got = sorted(map(_carrier_key, other if isinstance(other, list) else [other]), key=repr)
        if got != want:
            diff = sorted(set(want) ^ set(got), key=repr)
            raise SnapshotError(
                "manifest",
                f"{snapshot}: the carrier checksums in field carriers and in {where} differ"
                + (f" (first: pid {diff[0][0]} alloc {diff[0][1]})" if diff else "")
                + "; restore refused, snapshot untouched",
            )


def check_control_dir(snapshot, m: dict) -> None:
    """The manifest's ``control_dir`` is the one the restored processes use: the CRIU images
    (their file tables, not memory pages) bind each participant's shim socket at
    ``<control_dir>/cuinterpose-<pid>.sock``, so that path must be in them. Skipped for trees
    checkpointed in a foreign mount namespace (the images hold that namespace's paths)."""
    if not m["participants"] or any(n.get("foreign_mnt") for n in m.get("namespaces", [])):
        return
    snap = SnapshotDir(snapshot)
    blobs = [
        snap.read_bytes(rel)
        for rel in sorted(m["criu"]["files"])
        if not rel.rsplit("/", 1)[-1].startswith("pages-")
    ]
    for p in m["participants"]:
        want = socket_path(m["control_dir"], p["pid"]).encode()
        if not any(want in b for b in blobs):
            raise SnapshotError(
                "manifest",
                f"{snapshot}: field control_dir {m['control_dir']} is not the control dir of "
                f"participant {p['pid']} (its CRIU images bind no socket at "
                f"{want.decode()}); restore refused, snapshot untouched",
                pid=p["pid"],
            )


def check_chunks(snapshot, m: dict, from_records: list[dict]) -> None:
    """The ``chunks`` object and ``DIR/chunks/`` against the capture's carriers
    (agent/snapshot/chunks.py ``check``)."""
    from cuinterpose.agent.snapshot import chunks

    chunks.check(snapshot, m, from_records)


#: ``gpu_storage`` (native custom storage, agent/mech/gpustore.py): its checksum algorithms are
#: the chunk checksums (decisions D36)


def check_gpu_storage(base: os.PathLike | str, m: dict) -> None:
    """The manifest's ``gpu_storage`` record is well formed and its files are there: mode
    "custom" or "host"; ``chunk_bytes`` a power of two from 64 KiB to 1 GiB (the limits of
    every chunk stream, ``ChunkSettings``); ``checksum`` "blake2b-256" or "sha256";
    each stream ``{"file", "kind": "gpu", "pid", "ordinal", "bytes", "zero", "checksums"}`` with
    ``file`` derived (``chunks/gpu-<pid>-<ordinal>.bin``), ``pid`` one of ``cuda_pids``, one
    stream per (pid, ordinal), ``ceil(bytes / chunk_bytes)`` checksums (64 hex digits, null
    exactly at ``zero``), and the file a regular file (no symlink) of ``bytes`` bytes. Raises
    ``SnapshotError`` (phase "manifest") naming the field or the file."""
    rec = m.get("gpu_storage")
    if rec is None:
        return

    def bad(what: str) -> SnapshotError:
        return SnapshotError("manifest", f"{base}: gpu_storage {what}; restore refused")

    if not isinstance(rec, dict) or rec.get("mode") not in ("custom", "host"):
        raise bad("is not a record with mode custom or host")
    cb = rec.get("chunk_bytes")
    if not chunk_bytes_ok(cb):
        raise bad(f"chunk_bytes {cb!r} is not a power of two from 64 KiB to 1 GiB")
    if rec.get("checksum") not in CHUNK_CHECKSUMS:
        raise bad(f"checksum {rec.get('checksum')!r} is not one of {sorted(CHUNK_CHECKSUMS)}")
    streams = rec.get("streams")
    if not isinstance(streams, list) or (rec["mode"] == "host" and streams):
        raise bad("streams is not a list (or a host record lists streams)")
    pids = set(m.get("cuda_pids") or [])
    seen = set()
    for i, s in enumerate(streams):
        if not isinstance(s, dict) or s.get("kind") != "gpu":
            raise bad(f"streams[{i}] is not a gpu stream record")
        pid, ordinal, nbytes = s.get("pid"), s.get("ordinal"), s.get("bytes")
        if not all(isinstance(v, int) and v >= 0 for v in (pid, ordinal, nbytes)):
            raise bad(f"streams[{i}] pid/ordinal/bytes are not integers")
        if pid not in pids:
            raise bad(f"streams[{i}] pid {pid} is not one of cuda_pids")
        if (pid, ordinal) in seen:
            raise bad(f"streams[{i}] repeats pid {pid} ordinal {ordinal}")
        seen.add((pid, ordinal))
        want = gpu_rel(pid, ordinal)
        if s.get("file") != want:
            raise bad(f"streams[{i}] file {s.get('file')!r} is not {want!r}")
        sums, zero = s.get("checksums"), s.get("zero")
        n = -(-nbytes // cb)
        if not isinstance(sums, list) or len(sums) != n or not isinstance(zero, list):
            raise bad(f"streams[{i}] ({want}) has no {n} checksums")
        if [j for j, c in enumerate(sums) if c is None] != zero:
            raise bad(f"streams[{i}] ({want}) zero chunks differ from its null checksums")
        for j, c in enumerate(sums):
            if c is not None and (
                not isinstance(c, str) or len(c) != 64 or c.strip("0123456789abcdef")
            ):
                raise bad(f"streams[{i}] ({want}) checksum {j} is not 64 hex digits")
        snap = SnapshotDir(base)
        p = snap.file(want)
        try:
            st = snap.lstat(want)
        except OSError:
            raise bad(f"stream file {p} is missing") from None
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
            raise bad(f"stream file {p} is not a regular file of {nbytes} bytes")

"""The manifest of a snapshot (docs/snapshot-format.md).

A snapshot is one directory (its layout, and every file operation on it:
agent/snapshot/snapdir.py); ``manifest.json`` is written last: a directory without it is not
a snapshot. The manifest is JSON; its protobuf schema, ``cuinterpose.v1.Manifest`` (proto/,
mapped by agent/snapshot/pb.py), has the same field names. It is written atomically
(``SnapshotDir.write_manifest``: ``manifest.json.tmp``, fsync, rename, fsync of the directory).

:func:`load` refuses (``SnapshotError``) a missing manifest, bad JSON, an unknown format or
version, and missing fields; :func:`check_shim` refuses a shim whose SHA-256 differs;
:func:`verify_images` refuses a CRIU image whose SHA-256 or size differs. None of them writes
anything: a refused snapshot is left exactly as it was.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
from typing import Any

from cuinterpose.agent.errors import AgentError, SnapshotError
from cuinterpose.agent.snapshot import trust
from cuinterpose.agent.snapshot.durability import hash_threads, sha256_fd
from cuinterpose.agent.snapshot.snapdir import MANIFEST, SnapshotDir, criu_rel

FORMAT = "cuinterpose-snapshot"
FORMAT_VERSION = 1

REQUIRED = (
    "format",
    "format_version",
    "snapshot_id",
    "created_at",
    "shim",
    "driver",
    "criu",
    "roots",
    "control_dir",
    "participants",
    "capture",
    "carriers",
    "phases",
    "quiesce",
)


def utc_now() -> str:
    """ISO 8601 UTC timestamp with microseconds, e.g. ``2026-11-30T07:40:00.123456Z``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def sha256_file(path: os.PathLike | str) -> str:
    """SHA-256 (hex) of a file's bytes (the shim's, which a snapshot records; a snapshot's own
    files are hashed through its SnapshotDir)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return sha256_fd(fd)
    finally:
        os.close(fd)


def image_files(snapshot: os.PathLike | str) -> dict[str, dict]:
    """{relative path under DIR: {"sha256": hex, "bytes": size}} for every file under ``criu/``
    (one serial pass; a checkpoint gets these from its ``sync`` phase instead, where each image
    is hashed once, in parallel, as it is fsynced: ``SnapshotDir.sync``)."""
    snap = SnapshotDir(snapshot)
    out = {}
    for rel in snap.image_files():
        fd = snap.open(rel, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            out[rel] = {"sha256": sha256_fd(fd), "bytes": os.fstat(fd).st_size}
        finally:
            os.close(fd)
    return out


def write(snapshot: os.PathLike | str, manifest: dict) -> pathlib.Path:
    """Write ``manifest`` (must contain every :data:`REQUIRED` key) atomically as
    ``DIR/manifest.json``; returns its path. Raises ``SnapshotError`` on a missing key and
    ``OSError`` on I/O failure (ENOSPC, EIO, ...).

    A failed write leaves no ``manifest.json.tmp`` behind and the previous ``manifest.json``
    (if any) as it was: none for a first write (also when only the fsync of the directory after
    the rename failed: the renamed file is removed again), the earlier complete one for a
    rewrite (the
    checkpoint's final rewrite with the totals). A failed *rewrite* also appends a warning
    ``{"path", "message"}`` to ``manifest["warnings"]`` (the caller's dict, which the
    ``--json`` output reports), saying that the snapshot on disk is complete but lacks what
    the rewrite would have added."""
    missing = [k for k in REQUIRED if k not in manifest]
    if missing:
        raise SnapshotError("manifest", f"manifest lacks {', '.join(missing)}")
    if "native" not in manifest:
        rec = native_record()
        if rec is not None:
            manifest["native"] = rec

    from cuinterpose.agent.snapshot import chunks

    chunks.normalize(manifest)  # the top-level "chunks" object from the capture
    snap = SnapshotDir(snapshot)
    final = snap.manifest_path
    rewrite = snap.has_manifest()
    data = json.dumps(trust.sign(manifest), indent=2, sort_keys=True).encode() + b"\n"
    try:
        snap.write_manifest(data)
    except OSError as e:
        if not rewrite:
            # the rename may have happened and only the directory's fsync failed: a first
            # manifest that is not known to be durable is no manifest (the checkpoint fails and
            # rolls back, so no manifest.json may say the snapshot is complete)
            try:
                snap.remove_manifest()
            except OSError:
                pass
        if rewrite:
            manifest.setdefault("warnings", []).append(
                {
                    "path": str(final),
                    "message": (
                        f"could not rewrite {final} ({e.strerror or e}): the snapshot is "
                        "complete and restorable, but its manifest keeps the totals of its "
                        "first write (wall_ms/paused_ms up to the manifest, not the final "
                        "ones); nothing else is missing"
                    ),
                }
            )
        raise
    return final


def native_record() -> dict | None:
    """``{"backend": "driver-api"|"cuda-checkpoint", "driver_version": int (cuDriverGetVersion),
    "detail": the driver (``"fake driver 13010 at LIB"``) or the utility's path}``: the native
    backend this process uses (``agent/mech/native.py`` :func:`backend`, chosen once per
    process) with the loaded driver;
    None while no driver is loaded (nothing native ran, nothing is loaded here either).
    :func:`write` records it in a manifest that lacks ``native``; a restore reports it.
    Raises nothing: a backend that cannot be chosen is reported as ``"backend": "none"`` with
    the reason in ``detail``."""
    from cuinterpose.agent.mech import native

    # the driver native.load() loaded, if any (native.info() would load one)
    inf = native.loaded_info()
    if inf is None:
        return None
    try:
        b = native.backend()
    except AgentError as e:  # the checkpoint would have failed before writing: keep the reason
        return {"backend": "none", "driver_version": int(inf.version), "detail": e.reason}
    return {"backend": b.name, "driver_version": int(inf.version), "detail": b.detail}


def native_problem(m: dict) -> str | None:
    """What is wrong with a manifest's ``native`` record (None when absent or well formed)."""
    n = m.get("native")
    if n is None:
        return None
    if not (
        isinstance(n, dict)
        and isinstance(n.get("backend"), str)
        and isinstance(n.get("detail", ""), str)
        and _is_uint(n.get("driver_version"))
    ):
        return (
            "field native must be an object with backend (string), driver_version (int) and "
            "detail (string)"
        )
    return None


def load(snapshot: os.PathLike | str) -> dict:
    """Read and validate ``DIR/manifest.json``; returns the manifest dict. Raises
    ``SnapshotError`` (phase "manifest") naming the path and what is wrong."""
    snap = SnapshotDir(snapshot)
    base, path = snap.path, snap.manifest_path
    if not base.is_dir():
        raise SnapshotError("manifest", f"{base} is not a directory")
    try:
        raw = snap.read_manifest()
    except FileNotFoundError:
        raise SnapshotError(
            "manifest",
            f"{base} is not a snapshot: no {MANIFEST} "
            "(an interrupted checkpoint leaves the directory without it)",
        ) from None
    try:
        m = json.loads(raw)
    except ValueError as e:
        raise SnapshotError("manifest", f"{path} is not valid JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise SnapshotError(
            "manifest",
            f"{path}: format is {m.get('format') if isinstance(m, dict) else None!r}, "
            f"expected {FORMAT!r}",
        )
    trust.check_mac(base, m)
    fv = m.get("format_version")
    if type(fv) is not int or fv != FORMAT_VERSION:
        raise SnapshotError(
            "manifest",
            f"{path}: format_version {fv!r}"
            + ("" if type(fv) is int else f" ({type(fv).__name__}, not an integer)")
            + " is not "
            f"supported (this agent reads version {FORMAT_VERSION})",
        )
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise SnapshotError("manifest", f"{path}: missing field(s) {', '.join(missing)}")
    problem = _shape_problem(m) or trust.path_problem(m)
    if problem:
        raise SnapshotError("manifest", f"{path}: {problem}; restore refused, snapshot untouched")
    return m


GPU_KEYS = ("ordinal", "uuid", "name", "total_memory", "compute_capability")


def gpu_fields(p) -> dict:
    """A participant's GPU fields for the manifest, from a census ``Process``: ``gpus`` (GPU
    records, agent/mech/devicemap.py: ordinal as the process saw it, uuid, name, total_memory
    in bytes, compute_capability; [] when the census listed no GPUs, as the protobuf form
    reads an absent list) and ``cuda_visible_devices`` (only when it was set)."""
    out: dict = {"gpus": [{k: g[k] for k in GPU_KEYS} for g in getattr(p, "gpus", None) or []]}
    if getattr(p, "cuda_visible_devices", None) is not None:
        out["cuda_visible_devices"] = p.cuda_visible_devices
    return out


def gpus_problem(p: dict) -> bool:
    """Whether a manifest participant's optional GPU fields have the wrong shape."""
    if "cuda_visible_devices" in p and not isinstance(p["cuda_visible_devices"], str):
        return True
    if "gpus" not in p:
        return False
    g = p["gpus"]
    return not (
        isinstance(g, list)
        and all(
            isinstance(x, dict)
            and _is_uint(x.get("ordinal"))
            and _is_uint(x.get("total_memory"))
            and all(isinstance(x.get(k), str) for k in ("uuid", "name", "compute_capability"))
            for x in g
        )
    )


def _is_pid(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _shape_problem(m: dict):
    """What is wrong with the types of the fields restore relies on (None if nothing), so that a
    corrupted manifest is refused by field name instead of failing somewhere later."""

    def obj(v, *keys, kind=str):
        return isinstance(v, dict) and all(isinstance(v.get(k), kind) for k in keys)

    if not obj(m["shim"], "path", "sha256"):
        return "field shim must be an object with path and sha256 (strings)"
    if not obj(m["driver"], "kind"):
        return "field driver must be an object with kind (string)"
    if not (isinstance(m["roots"], list) and m["roots"] and all(map(_is_pid, m["roots"]))):
        return "field roots must be a non-empty list of pids"
    if not isinstance(m["control_dir"], str):
        return "field control_dir must be a string"
    if not (
        isinstance(m["participants"], list)
        and all(
            isinstance(p, dict) and _is_pid(p.get("pid")) and isinstance(p.get("socket_path"), str)
            for p in m["participants"]
        )
    ):
        return (
            "field participants must be a list of objects with pid (int) and socket_path (string)"
        )
    bad_gpus = [p["pid"] for p in m["participants"] if gpus_problem(p)]
    if bad_gpus:
        return (
            f"field participants[pid {bad_gpus[0]}].gpus must be a list of objects with ordinal "
            "(int), uuid, name, compute_capability (strings) and total_memory (int), and "
            "cuda_visible_devices a string"
        )
    if "processes" in m and not (
        isinstance(m["processes"], list)
        and all(isinstance(p, dict) and _is_pid(p.get("pid")) for p in m["processes"])
    ):
        return "field processes must be a list of objects with pid (int)"
    if not (isinstance(m.get("cuda_pids", []), list) and all(map(_is_pid, m.get("cuda_pids", [])))):
        return "field cuda_pids must be a list of pids"
    if native_problem(m):
        return native_problem(m)
    if not obj(m["quiesce"], "id"):
        return "field quiesce must be an object with id (string)"
    if not isinstance(m["capture"], dict):
        return "field capture must be an object"
    files = m["criu"].get("files") if isinstance(m["criu"], dict) else None
    if not (
        isinstance(files, dict)
        and all(
            isinstance(k, str)
            and isinstance(v, dict)
            and isinstance(v.get("sha256"), str)
            and _is_uint(v.get("bytes"))
            for k, v in files.items()
        )
    ):
        return "field criu.files must map each image path to {sha256 (string), bytes (int)}"
    for r in m["roots"]:
        if not any(k.startswith(criu_rel(r) + "/") for k in files):
            return f"field criu.files lists no CRIU image of tree {r}"
    # optional (absent in manifests written before restores into a placement existed)
    if "external_pipes" in m and not (
        isinstance(m["external_pipes"], list)
        and all(
            isinstance(p, dict)
            and all(_is_pid(p.get(k)) for k in ("root", "pid", "inode"))
            and isinstance(p.get("fd"), int)
            and not isinstance(p.get("fd"), bool)
            and p["fd"] >= 0
            and p.get("direction") in ("read", "write")
            for p in m["external_pipes"]
        )
    ):
        return (
            "field external_pipes must be a list of objects with root, pid, fd, inode (int) "
            'and direction ("read" or "write")'
        )
    if "namespaces" in m and not (
        isinstance(m["namespaces"], list)
        and all(
            isinstance(n, dict)
            and all(_is_pid(n.get(k)) for k in ("root", "net", "uts", "ipc"))
            and isinstance(n.get("external_net", ""), str)
            and ("mnt" not in n or _is_pid(n["mnt"]))
            and isinstance(n.get("foreign_mnt", False), bool)
            for n in m["namespaces"]
        )
    ):
        return (
            "field namespaces must be a list of objects with root, net, uts, ipc (int), "
            "external_net (string) and optionally mnt (int) and foreign_mnt (bool)"
        )
    if "external_files" in m and not (
        isinstance(m["external_files"], list)
        and all(
            isinstance(f, dict)
            and all(_is_pid(f.get(k)) for k in ("root", "pid", "inode"))
            and all(_is_uint(f.get(k)) for k in ("fd", "mnt_id", "flags", "st_mode", "rdev"))
            and isinstance(f.get("path"), str)
            and f.get("access") in ("r", "w", "rw")
            for f in m["external_files"]
        )
    ):
        return (
            "field external_files must be a list of objects with root, pid, fd, mnt_id, "
            'inode, flags, st_mode, rdev (int), path (string) and access ("r", "w" '
            'or "rw")'
        )
    return None


def _is_uint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def external_pipes(m: dict, root: int) -> list[dict]:
    """The manifest's ``external_pipes`` of tree ``root`` ([] for an older manifest)."""
    return [p for p in m.get("external_pipes", []) if p["root"] == root]


def external_files(m: dict, root: int) -> list[dict]:
    """The manifest's ``external_files`` of tree ``root`` ([] for an older manifest)."""
    return [f for f in m.get("external_files", []) if f["root"] == root]


def tree_namespaces(m: dict, root: int) -> dict:
    """The manifest's ``namespaces`` entry of tree ``root`` ({} for an older manifest: its
    images hold no external network namespace; ``mnt``/``foreign_mnt`` are absent from
    manifests written before they were recorded)."""
    return next((n for n in m.get("namespaces", []) if n["root"] == root), {})


def check_shim(m: dict, installed_path: str, installed_sha256: str) -> None:
    """Refuse a snapshot taken with another shim build: ``SnapshotError`` naming both hashes and
    the installed path."""
    want = m["shim"].get("sha256")
    if want != installed_sha256:
        raise SnapshotError(
            "manifest",
            f"snapshot was taken with shim sha256 {want} "
            f"({m['shim'].get('path')}), but the installed shim {installed_path} "
            f"has sha256 {installed_sha256}; restore refused, snapshot untouched",
        )


def verify_images(
    snapshot: os.PathLike | str, m: dict, *, on_bytes=None, threads=None, phase: str = "manifest"
) -> int:
    """Check every CRIU image listed in the manifest (SHA-256 and size) and that no listed file is
    missing; returns the total image bytes. The images are hashed in parallel (``threads``,
    default :func:`hash_threads`), each once; ``on_bytes(n)`` (from the hashing threads) after
    every ``n`` bytes read. Raises ``SnapshotError`` (``phase``: restore's ``verify``) naming
    the file (the first in path order that is wrong); reads only."""
    import stat
    from concurrent.futures import ThreadPoolExecutor

    snap = SnapshotDir(snapshot)
    base = snap.path
    try:
        trust.check_image_set(snap, m)
    except SnapshotError as e:
        raise SnapshotError(phase, e.reason, pid=e.pid) from None
    listed = sorted(m["criu"].get("files", {}).items())
    for rel, meta in listed:
        try:
            st = snap.lstat(rel)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise SnapshotError(phase, f"CRIU image {base / rel} listed in the manifest is missing")
        if st.st_size != meta["bytes"]:
            raise _bad_image(base / rel, phase)

    def digest(rel: str) -> str:
        fd = snap.open(rel, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            return sha256_fd(fd, on_bytes)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=threads or hash_threads()) as pool:
        got = list(pool.map(digest, [rel for rel, _ in listed]))
    for (rel, meta), sha in zip(listed, got):
        if sha != meta["sha256"]:
            raise _bad_image(base / rel, phase)
    return sum(meta["bytes"] for _, meta in listed)


def _bad_image(p, phase: str) -> SnapshotError:
    return SnapshotError(
        phase,
        f"CRIU image {p} has a bad checksum (sha256/size differ "
        "from the manifest); restore refused, snapshot untouched",
    )


def carriers_from_capture(capture: Any) -> list[dict]:
    """Per-carrier checksums from a Capture dict: one entry per creator allocation whose bytes
    are held in a host carrier: ``{"pid", "alloc_id" (hex), "bytes", "checksum" (hex, cui_checksum64)}``."""
    out = []
    if not isinstance(capture, dict):
        return out
    for pid, records in _records_by_pid(capture):
        for r in records:
            if not isinstance(r, dict):
                continue
            kind = str(r.get("kind", "")).upper()
            role = str(r.get("role", "")).upper()
            if kind not in ("1", "ALLOCATION", "CUI_RECORD_ALLOCATION") or role not in (
                "1",
                "CREATOR",
                "CUI_ROLE_CREATOR",
            ):
                continue
            nbytes = r.get("carrier_bytes", 0)
            if not nbytes:
                continue
            cs = r.get("carrier_checksum", 0)
            alloc = r.get("alloc_id", "")
            out.append(
                {
                    "pid": pid,
                    "alloc_id": alloc.hex() if isinstance(alloc, (bytes, bytearray)) else alloc,
                    "bytes": int(nbytes),
                    "checksum": cs if isinstance(cs, str) else f"{int(cs):016x}",
                }
            )
    return out


def _records_by_pid(capture: dict):
    """Yield (pid, [record dict]) from a Capture dict, tolerating the shapes
    ``{"participants": [{"pid", "records"}]}``, ``{"records": {pid: [...]}}`` and
    ``{"records": [{"pid", ...}]}``."""
    parts = capture.get("participants")
    if isinstance(parts, list):
        for p in parts:
            if isinstance(p, dict) and isinstance(p.get("records"), list):
                yield int(p.get("pid", 0)), p["records"]
        return
    recs = capture.get("records")
    if isinstance(recs, dict):
        for pid, rs in recs.items():
            yield int(pid), rs if isinstance(rs, list) else []
    elif isinstance(recs, list):
        by = {}
        for r in recs:
            by.setdefault(int(r.get("pid", 0)), []).append(r)
        yield from by.items()


def role_counts(records: list) -> dict:
    """{"private": n, "creator": n, "importer": n} over allocation records (dicts or objects)."""
    counts = {"private": 0, "creator": 0, "importer": 0}
    names = {0: "private", 1: "creator", 2: "importer"}
    for r in records:
        get = r.get if isinstance(r, dict) else (lambda k, d=None, r=r: getattr(r, k, d))
        kind = get("kind")
        if (
            str(kind).upper() not in ("1", "ALLOCATION", "CUI_RECORD_ALLOCATION")
            and getattr(kind, "value", None) != 1
        ):
            continue
        role = get("role")
        role = getattr(role, "value", role)
        key = (
            names.get(role) if isinstance(role, int) else str(role).lower().replace("cui_role_", "")
        )
        if key in counts:
            counts[key] += 1
    return counts

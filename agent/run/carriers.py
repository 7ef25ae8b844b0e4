"""The shim carriers' chunk files of a snapshot (issue 12 item 1; docs/snapshot-format.md
"chunks"; decisions D31): ``DIR/chunks/shared-<pid>-<alloc_id>.bin`` (named and opened by
agent/snapshot/snapdir.py's ``SnapshotDir.carrier_files``), one per shared creator
allocation, written by the shims at SAVE_ALLOCATIONS and read back at LOAD_ALLOCATIONS (restore
and rollback) through descriptors the agent opens and passes (SCM_RIGHTS), so the shim needs no
access to the agent's mount namespace.

Settings (:func:`settings`: one ``ChunkSettings`` of coordinator/protocol/carriers.py, built
from a checkpoint's options, agent/options.py, and the same value the GPU streams of
agent/mech/gpustore.py are written with): ``chunk_bytes`` (default 8 MiB, a power of two from
64 KiB to 1 GiB), ``staging_bytes`` (the staging ring per process, default 64 MiB), ``writers``
(threads per process, default 4), ``checksum`` (the chunk checksum of a checkpoint, decisions
D36: "sha256" where the shim can use the CPU's SHA extensions, x86-64 with ``sha_ni``, else
"blake2b-256"; a restore or release uses the one its snapshot was written with). Errors:
:class:`~cuinterpose.agent.errors.AgentError` naming the value and its source. Durability (fsync
of the files and of ``chunks/``) is the sync phase's job, not this module's. ``--incremental``:
the streams are packs of the snapshot root's chunk store instead (agent/snapshot/store.py;
decisions D34), and only chunks it lacks are written.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.snapshot import store, trust
from cuinterpose.agent.snapshot.snapdir import SnapshotDir
from cuinterpose.agent.units import parse_bytes
from cuinterpose.coordinator.carrierfiles import CarrierFiles
from cuinterpose.coordinator.protocol import DEFAULT_CHUNK_CHECKSUM, ChunkSettings


def node_checksum(cpuinfo: str = "/proc/cpuinfo", machine: str | None = None) -> str:
    """The chunk checksum the shims of this node compute fastest: "sha256" on x86-64
    (``machine``, default ``uname -m``) when ``cpuinfo``'s flags have sha_ni, ssse3 and sse4_1
    (the test interposer/src/sha256.c makes with CPUID), else "blake2b-256" (the shim has no
    other accelerated SHA-256)."""
    if (machine or os.uname().machine) != "x86_64":
        return DEFAULT_CHUNK_CHECKSUM
    try:
        with open(cpuinfo) as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return DEFAULT_CHUNK_CHECKSUM
    return "sha256" if {"sha_ni", "ssse3", "sse4_1"} <= set(flags) else DEFAULT_CHUNK_CHECKSUM


#: the phase of a bad carrier setting (an option, an environment variable, a request field)
SETTINGS_PHASE = "carrier settings"


def settings(
    chunk_bytes=None, staging_bytes=None, writers=None, checksum=None, *, fit_staging=False
) -> ChunkSettings:
    """The run's :class:`~cuinterpose.coordinator.protocol.ChunkSettings` (shared by the shim
    carriers and the GPU streams): each field the argument (an option), else the default
    (``checksum``: :func:`node_checksum`; ``fit_staging``, a restore of ``chunk_bytes``
    chunks: a default staging of at least one chunk). Raises AgentError (phase
    :data:`SETTINGS_PHASE`) naming each bad value (``--staging-bytes``, or the default, a
    snapshot's ``chunks.checksum``); the limits are
    ``ChunkSettings``' (protocol.h's): chunk_bytes a power of two from 64 KiB to 1 GiB,
    chunk_bytes <= staging_bytes <= 64 GiB (the ring holds whole chunks), 1..64 writers."""
    given = {"chunk_bytes": chunk_bytes, "staging_bytes": staging_bytes, "writers": writers}
    out, names = {}, {}
    for k, v in given.items():
        where = f"--{k.replace('_', '-')}"
        names[k] = where if v is not None else f"{where} (the default)"
        try:
            if v is not None:
                out[k] = int(v) if k == "writers" else parse_bytes(v)
        except ValueError as e:  # parse_bytes names the text: "'8MB' is not a byte count: ..."
            why = f"{where}={v!r} is not an integer" if k == "writers" else f"{where}={e}"
            raise AgentError(SETTINGS_PHASE, why) from None
    if fit_staging and "staging_bytes" not in out and "chunk_bytes" in out:
        out["staging_bytes"] = max(ChunkSettings().staging_bytes, out["chunk_bytes"])
    where = "the snapshot's chunks.checksum"
    try:
        s = ChunkSettings.of(names, **out)
    except ValueError as e:
        raise AgentError(SETTINGS_PHASE, str(e)) from None
    try:
        return dataclasses.replace(s, checksum=node_checksum() if checksum is None else checksum)
    except ValueError as e:
        raise AgentError(SETTINGS_PHASE, f"{where}: {e}") from None


def checkpoint_files(images_dir, incremental: bool = False, **kw) -> CarrierFiles:
    """The chunk files a checkpoint into ``images_dir`` writes (``kw``: :func:`settings`).
    ``incremental``: packs of the chunk store of the
    snapshot root (agent/snapshot/store.py), with the chunks it already holds as ``known``;
    the store's shared lock and a pin (``store.Hold``; AgentError when the lock is not free in
    time) are kept in ``holder`` until :func:`release`."""
    snap = SnapshotDir(images_dir)
    if not incremental:
        return snap.carrier_files(settings(**kw))
    s = settings(**kw)
    root = snap.root
    prefix = store.new_prefix()
    # the lock, the chunks of trusted manifests (with a node key: MAC-valid), the pin
    hold = store.Hold(
        root, prefix, lambda: store.known_chunks(root, trust.check_mac, s.checksum), images_dir
    )
    files = snap.pack_files(s, prefix=prefix, known=hold.known)
    files.holder = hold
    return files


def store_record(files) -> dict | None:
    """What a release needs to load a capture of the chunk store back (``.lock`` field
    ``store``): {"dir", "prefix", "refs": {"PID:ALLOC_ID": [[chunk, pack, offset]]}}; None
    without a store."""
    if files is None or getattr(files, "store", None) is None:
        return None
    refs = {
        f"{pid}:{aid}": [[i, n, o] for i, (n, o) in sorted(r.items())]
        for (pid, aid), r in files.refs.items()
    }
    return {"dir": files.directory, "prefix": files.prefix, "refs": refs}


def release_files(images_dir, lock_fields: dict) -> CarrierFiles:
    """The chunk files a release (a dead agent's checkpoint) loads the shims back from:
    ``lock_fields`` are the ``.lock``'s ``chunks`` and ``store`` (:func:`store_record`)."""
    rec = lock_fields.get("store")
    ch = dict(lock_fields.get("chunks") or {})
    ch.setdefault("checksum", DEFAULT_CHUNK_CHECKSUM)  # a .lock from before D36
    s = settings(**ch)
    if not rec:
        return SnapshotDir(images_dir).carrier_files(s)
    files = CarrierFiles(rec["dir"], store=store.STORE_REL, prefix=rec["prefix"], **s.as_dict())
    for key, rows in (rec.get("refs") or {}).items():
        pid, aid = key.split(":")
        files.refs[(int(pid), aid)] = {int(i): (str(n), int(o)) for i, n, o in rows}
    return files


def restore_files(images_dir, manifest: dict, **kw) -> CarrierFiles:
    """The chunk files a restore from ``images_dir`` reads, with the manifest's chunk_bytes
    (``kw``: staging_bytes, writers); for a snapshot of the chunk store, each stream's pack
    and refs from ``chunks.streams``, and the store's shared lock in ``holder`` (:func:`release`
    it once the shims have loaded)."""
    chunks = manifest.get("chunks") or {}
    s = settings(
        chunk_bytes=chunks.get("chunk_bytes", ChunkSettings().chunk_bytes),
        checksum=chunks.get("checksum", DEFAULT_CHUNK_CHECKSUM),
        fit_staging=True,
        **kw,
    )
    snap = SnapshotDir(images_dir)
    if chunks.get("store") != store.STORE_REL:
        return snap.carrier_files(s)
    files = snap.pack_files(s)
    # no delete may collect a pack while the shims read it (released by the caller)
    files.holder = store.Lock(snap.root, exclusive=False)
    for st in chunks.get("streams") or []:
        key = (int(st["pid"]), str(st["alloc_id"]))
        files.names[key] = str(st["pack"])
        files.refs[key] = {int(i): (str(n), int(o)) for i, n, o in st.get("refs") or []}
    return files


_BAD_ALLOC = re.compile(r"allocation ([0-9a-f]{32}): ")
_BAD_CHUNK = re.compile(r"chunk (\d+)")
_BAD_SOURCE = re.compile(r"chunk store source \d+ at offset (\d+)")


def bad_chunk_where(message: str, files, pid=None, manifest: dict | None = None) -> str:
    """Where on disk lies the chunk that a LOAD_ALLOCATIONS refusal of a shim names (the shim's
    messages: "allocation <32 hex>: chunk <k> of its chunk file has checksum ...", "... of chunk
    store source <s> at offset <o> ...", "<where> ends inside chunk <k>", "reading chunk <k> of
    <where> failed"): ``"; the chunk is bytes A..B of FILE"``, FILE the absolute path of the
    stream's chunk file or of the chunk store pack holding that chunk. ``files``: the
    ``CarrierFiles`` the load read from; ``pid``: the process (the error's); the stream's size
    from ``manifest``'s ``chunks.streams`` (restore) or the capture's tables (rollback,
    release), else a whole chunk. "" when the message names no chunk or ``files`` no stream of
    that allocation."""
    a, k = _BAD_ALLOC.search(message or ""), None
    if a and (c := _BAD_CHUNK.search(message, a.end())):
        k = int(c.group(1))
    if files is None or k is None:
        return ""
    aid = a.group(1)
    keys = [key for key in {*files.names, *files.refs, *files.tables} if key[1] == aid]
    keys = [key for key in keys if pid is None or key[0] == int(pid)] or keys
    if not keys and pid is None:
        return ""
    key = keys[0] if keys else (int(pid), aid)
    cb = files.chunk_bytes
    size = None
    for st in ((manifest or {}).get("chunks") or {}).get("streams") or []:
        if (int(st.get("pid", -1)), st.get("alloc_id")) == key:
            size = int(st.get("bytes", 0))
    if size is None and key in files.tables:
        size = files.tables[key].bytes
    n = cb if size is None else max(1, min(cb, size - k * cb))
    ref = files.refs.get(key, {}).get(k)
    src = _BAD_SOURCE.search(message)
    if ref is not None:
        path, off = os.path.join(files.directory, ref[0]), int(src.group(1)) if src else ref[1]
    else:
        path, off = files.path(*key), k * cb
    return f"; the chunk is bytes {off}..{off + n - 1} of {path}"


def name_bad_chunk(err: AgentError, files, manifest: dict | None = None) -> AgentError:
    """``err`` with :func:`bad_chunk_where` appended to its reason when it refuses a damaged
    chunk (every such refusal names the file and the byte range), else ``err`` itself."""
    where = bad_chunk_where(err.reason, files, err.pid, manifest)
    if not where:
        return err
    return AgentError(err.phase, err.reason + where, pid=err.pid, outcome=err.outcome)


def release(files, *, keep_pin: bool = False) -> None:
    """Release what ``files`` holds (the chunk store's pin and lock; ``keep_pin``: a release
    after a failed rollback still needs the packs); idempotent."""
    holder = getattr(files, "holder", None)
    if holder is not None:
        files.holder = None
        holder.release(**({"keep_pin": True} if keep_pin else {}))


def unpin(lock_fields: dict) -> None:
    """A release is done with a dead agent's checkpoint: remove its pin (``.lock`` field
    ``store``), so a delete may collect around its packs again."""
    rec = lock_fields.get("store")
    if rec and rec.get("prefix"):
        store.unpin(pathlib.Path(rec["dir"]).parent.parent, rec["prefix"])


def remove_chunks(images_dir, files=None) -> None:
    """Remove ``DIR/chunks/`` (a rolled-back checkpoint's partial or complete chunk files;
    the workload's memory is back on the device by then: ``SnapshotDir.remove_chunks``) and,
    for a checkpoint into the chunk store (``files``), the packs it wrote (those of its
    prefix; older packs stay)."""
    SnapshotDir(images_dir).remove_chunks()
    if files is not None and getattr(files, "store", None) is not None and files.prefix:
        files.remove()

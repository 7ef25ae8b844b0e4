"""agent/mech/gpustore.py (the chunk writer/reader) over host memory, and
trust.check_gpu_storage on the records it makes: zero chunks skipped (sparse, null checksums),
BLAKE2b-256 per chunk equal to hashlib's, the short last chunk, several writer threads within
the staging bound, verify-before-use at read, exact error messages (ENOSPC on /dev/full, a bad
checksum), and the manifest checks."""

from __future__ import annotations

import dataclasses
import hashlib
import os

import pytest

from cuinterpose.agent.errors import SnapshotError
from cuinterpose.agent.mech import gpustore
from cuinterpose.agent.options import CheckpointOptions
from cuinterpose.agent.run import carriers
from cuinterpose.agent.snapshot import trust
from cuinterpose.coordinator.carrierfiles import CarrierFiles
from cuinterpose.coordinator.protocol import ChunkSettings

CB = 64 << 10


def sample(nchunks_dense: int = 3) -> bytearray:
    """chunks: dense, zero, dense, zero, dense..., then a short dense tail of 1000 bytes."""
    out = bytearray()
    for i in range(2 * nchunks_dense - 1):
        out += bytes((j * 31 + i) & 0xFF for j in range(CB)) if i % 2 == 0 else bytes(CB)
    out += b"\x01" * 1000
    return out


def write(tmp_path, data: bytearray, **kw):
    path = tmp_path / "chunks" / "gpu-7-0.bin"
    path.parent.mkdir(exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    opts = gpustore.Options(
        ChunkSettings(
            chunk_bytes=CB,
            staging_bytes=kw.pop("staging", 2 * CB),
            writers=4,
            checksum=kw.pop("checksum", "blake2b-256"),
        )
    )
    try:
        rec = gpustore.write_stream(
            gpustore.MemoryRegion(data),
            fd,
            pid=7,
            ordinal=0,
            file="chunks/gpu-7-0.bin",
            opts=opts,
            phase="native checkpoint",
        )
    finally:
        os.close(fd)
    return path, rec, opts


def test_write_then_read_back(tmp_path):
    data = sample()
    path, rec, opts = write(tmp_path, data)
    n = len(data)
    assert (rec["file"], rec["kind"], rec["pid"], rec["ordinal"], rec["bytes"]) == (
        "chunks/gpu-7-0.bin",
        "gpu",
        7,
        0,
        n,
    )
    assert rec["zero"] == [1, 3]
    assert len(rec["checksums"]) == 6
    for i, c in enumerate(rec["checksums"]):
        chunk = bytes(data[i * CB : (i + 1) * CB])
        want = None if i in (1, 3) else hashlib.blake2b(chunk, digest_size=32).hexdigest()
        assert c == want, i
    assert path.read_bytes() == bytes(data)
    assert path.stat().st_size == n
    assert path.stat().st_blocks * 512 < n  # the zero chunks were not written
    assert opts.slots() == 2  # 2 chunks of staging in all: two writers at a time
    back = bytearray(b"\xee" * n)  # a fresh region is not zeroed
    fd = os.open(path, os.O_RDONLY)
    try:
        gpustore.read_stream(
            gpustore.MemoryRegion(back), fd, rec, opts=opts, phase="native restore"
        )
    finally:
        os.close(fd)
    assert back == data


def test_a_sha256_stream_round_trips_and_the_other_checksum_refuses(tmp_path):
    """Options.checksum "sha256" (decisions D36): every non-zero chunk's hashlib.sha256; read
    back with it the bytes return, read as BLAKE2b-256 the first dense chunk is refused with
    both digests and the region untouched."""
    data = sample()
    path, rec, opts = write(tmp_path, data, checksum="sha256")
    for i, c in enumerate(rec["checksums"]):
        chunk = bytes(data[i * CB : (i + 1) * CB])
        assert c == (None if i in (1, 3) else hashlib.sha256(chunk).hexdigest()), i
    back = bytearray(b"\xee" * len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        gpustore.read_stream(
            gpustore.MemoryRegion(back), fd, rec, opts=opts, phase="native restore"
        )
        assert back == data
        other = gpustore.Options(ChunkSettings(CB, CB, 1, "blake2b-256"))
        fresh = bytearray(b"\xee" * len(data))
        with pytest.raises(gpustore.GpuStoreError) as ei:
            gpustore.read_stream(
                gpustore.MemoryRegion(fresh), fd, rec, opts=other, phase="native restore"
            )
    finally:
        os.close(fd)
    b2 = hashlib.blake2b(bytes(data[:CB]), digest_size=32).hexdigest()
    assert (
        f"chunk 0 (bytes 0..{CB - 1}) of chunks/gpu-7-0.bin has a bad checksum: manifest "
        f"{rec['checksums'][0]}, file {b2}" in str(ei.value)
    )
    assert fresh == b"\xee" * len(data)  # nothing reached the region


def test_a_bad_chunk_is_refused_before_use(tmp_path):
    data = sample()
    path, rec, opts = write(tmp_path, data)
    raw = bytearray(path.read_bytes())
    raw[2 * CB + 9] ^= 0x40
    path.write_bytes(raw)
    have = hashlib.blake2b(bytes(raw[2 * CB : 3 * CB]), digest_size=32).hexdigest()
    back = bytearray(len(data))
    fd = os.open(path, os.O_RDONLY)
    opts = gpustore.Options(dataclasses.replace(opts.settings, writers=1))
    try:
        with pytest.raises(gpustore.GpuStoreError) as ei:
            gpustore.read_stream(
                gpustore.MemoryRegion(back), fd, rec, opts=opts, phase="native restore"
            )
    finally:
        os.close(fd)
    e = ei.value
    assert (e.phase, e.pid) == ("native restore", 7)
    assert e.reason == (
        f"GPU ordinal 0: chunk 2 (bytes {2 * CB}..{3 * CB - 1}) of chunks/gpu-7-0.bin has a "
        "bad checksum: manifest "
        f"{rec['checksums'][2]}, file {have}; restore refused, snapshot untouched"
    )
    assert back[2 * CB : 3 * CB] == bytes(CB)  # the bad bytes never reached the region


def test_a_failed_write_names_the_stream_and_errno():
    """/dev/full cannot be sized (EINVAL); a chunk write there fails ENOSPC
    (test_gpu_storage_e2e.py has the full disk end to end)."""
    fd = os.open("/dev/full", os.O_WRONLY)
    opts = gpustore.Options(ChunkSettings(CB, CB, 1))
    try:
        with pytest.raises(gpustore.GpuStoreError) as ei:
            gpustore.write_stream(
                gpustore.MemoryRegion(bytearray(b"\x05" * CB)),
                fd,
                pid=7,
                ordinal=1,
                file="chunks/gpu-7-1.bin",
                opts=opts,
                phase="native checkpoint",
            )
    finally:
        os.close(fd)
    assert (ei.value.phase, ei.value.pid) == ("native checkpoint", 7)
    assert ei.value.reason == (
        "GPU ordinal 1: sizing of chunks/gpu-7-1.bin failed: EINVAL (Invalid argument); the "
        "checkpoint rolls back, free space or fix the disk and checkpoint again"
    )


def test_the_gpu_writer_takes_the_one_chunk_settings_value():
    """One ChunkSettings for the shim's carriers and the GPU streams (issue 27): the same
    defaults, the one validation, and --writers sets the GPU writer's threads."""
    assert (
        gpustore.Options().settings == ChunkSettings() == carriers.settings(checksum="blake2b-256")
    )
    assert (ChunkSettings().chunk_bytes, ChunkSettings().staging_bytes) == (8 << 20, 64 << 20)
    assert gpustore.Options().slots() == 4  # 4 writers, 8 slots of staging
    assert gpustore.Options(ChunkSettings(writers=8)).slots() == 8
    assert gpustore.Options(ChunkSettings(chunk_bytes=32 << 20)).slots() == 2  # 64 MiB staging
    assert gpustore.Options(ChunkSettings(staging_bytes=8 << 20, writers=16)).slots() == 1
    with pytest.raises(ValueError) as ei:
        ChunkSettings(chunk_bytes=3 << 20)
    assert str(ei.value) == (
        "chunk_bytes 3145728 must be a power of two from 65536 to 1073741824 bytes "
        "(64 KiB to 1 GiB)"
    )
    with pytest.raises(ValueError) as ei:
        ChunkSettings(chunk_bytes=128 << 20)  # more than the default staging
    assert str(ei.value).startswith("staging_bytes 67108864 must be at least chunk_bytes")


def manifest_with(rec, **over):
    g = {"mode": "custom", "why": "t", "chunk_bytes": CB, "checksum": "blake2b-256"}
    g.update(over)
    g.setdefault("streams", [rec])
    return {"cuda_pids": [7], "gpu_storage": g}


def test_trust_checks_the_record(tmp_path):
    _path, rec, _ = write(tmp_path, sample())
    trust.check_gpu_storage(tmp_path, manifest_with(rec))
    cases = [
        (manifest_with(rec, chunk_bytes=CB + 1), f"chunk_bytes {CB + 1} is not a power of two"),
        (
            manifest_with(rec, checksum="md5"),
            "checksum 'md5' is not one of ['blake2b-256', 'sha256']",
        ),
        (manifest_with(dict(rec, file="chunks/../x.bin")), "is not 'chunks/gpu-7-0.bin'"),
        (manifest_with(dict(rec, pid=8, file="chunks/gpu-8-0.bin")), "pid 8 is not one of"),
        (manifest_with(dict(rec, zero=[1])), "zero chunks differ from its null checksums"),
        (manifest_with(dict(rec, checksums=rec["checksums"][:-1])), "has no 6 checksums"),
        (manifest_with(rec, streams=[rec, rec]), "repeats pid 7 ordinal 0"),
        (manifest_with(dict(rec, bytes=rec["bytes"] - 1)), "is not a regular file of"),
    ]
    for m, want in cases:
        with pytest.raises(SnapshotError) as ei:
            trust.check_gpu_storage(tmp_path, m)
        assert want in ei.value.reason, (want, ei.value.reason)
    (tmp_path / rec["file"]).unlink()
    with pytest.raises(SnapshotError) as ei:
        trust.check_gpu_storage(tmp_path, manifest_with(rec))
    assert ei.value.reason.endswith(
        f"stream file {tmp_path / rec['file']} is missing; restore refused"
    )


@pytest.mark.parametrize("checksum", ["sha256", "blake2b-256"])
def test_gpu_storage_takes_the_checkpoints_chunk_checksum(monkeypatch, checksum):
    """The GPU streams hash with the shim carriers' checksum (the coordinator's CarrierFiles),
    else with the checkpoint's ``chunk_checksum`` option; an incremental checkpoint's
    options work as any other."""
    import types

    from cuinterpose.agent.run import gpustore_step

    monkeypatch.setattr(gpustore_step.native, "info", lambda: types.SimpleNamespace(kind="fake"))
    o = CheckpointOptions(chunk_bytes=1 << 20, writers=6, incremental=True, chunk_checksum=checksum)
    ck = types.SimpleNamespace(options=o)
    opts = gpustore_step.options(ck)
    assert (opts.checksum, opts.chunk_bytes, opts.slots()) == (checksum, 1 << 20, 6)
    assert opts.settings == carriers.settings(**o.chunk_settings())
    other = "blake2b-256" if checksum == "sha256" else "sha256"
    files = CarrierFiles("/nonexistent", chunk_bytes=1 << 20, writers=3, checksum=other)
    ck.coordinator = types.SimpleNamespace(carriers=files)
    # what the shims of this capture used: their checksum, and --writers for the GPU streams
    assert gpustore_step.options(ck).settings == ChunkSettings(1 << 20, 64 << 20, 3, other)

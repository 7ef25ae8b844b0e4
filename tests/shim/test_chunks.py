"""Chunk files of the shim carriers (protocol.h "Carriers"; issue 12 item 1), on fakecuda:
- the cycle brings the bytes back for a dense allocation, a 90 %-zero one (its file mostly
  holes, by st_blocks), one whose last chunk is short and one smaller than a chunk, and the
  files hold exactly the bytes with zero chunks unwritten, every chunk written with O_DIRECT;
- a write error (ENOSPC from /dev/full) fails SAVE_ALLOCATIONS naming pid, allocation, chunk and
  errno; the shim stays ACTIVE with its bytes intact and a new SAVE works;
- SAVE leaves no host copy: the creator's VmRSS grows by less than the ring, not by the bytes,
  and once PREPARED it no longer holds them (what CRIU would dump), yet LOAD brings them back;
- SAVE copies from the app's own mapping where one covers the whole allocation (no staging
  reservation or mapping: no second VA range, no second fault of its pages on fakecuda), and
  through a staging mapping where the app maps it only in parts; the files hold the same bytes
  either way;
- LOAD maps each allocation where the app maps it, zeroes each run of zero chunks with one
  cuMemsetD8 and copies each non-zero chunk to its offset after its allocation was mapped (fake
  log)."""

from __future__ import annotations

import hashlib
import os

from cuinterpose.coordinator.carrierfiles import carried_streams
from cuinterpose.coordinator.protocol import Op, Phase, RecordKind, Status

from .conftest import GRAN, POSIX, RW
from .test_failures import pattern

MiB = 1 << 20


def _alloc(c, size, seed, zero_from=None):
    """A shared (exported) allocation of ``size`` bytes filled with pattern(seed); from byte
    ``zero_from`` on it is zeroed (cuMemsetD32)."""
    h = c.val(f"create {size} {POSIX}")
    va = c.val(f"reserve {size}")
    c.ok(f"map {va} {size} 0 {h}")
    c.ok(f"access {va} {size} 0 {RW}")
    c.ok(f"fill {va} {size} {seed}")
    if zero_from is not None:
        c.ok(f"memset32 {va + zero_from} 0 {(size - zero_from) // 4}")
    c.val(f"export {h}")
    return va


def _records(ctl, c):
    return ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records


def _cycle(ctl, c, start):
    for k, (op, exp) in enumerate(
        (
            (Op.SAVE_ALLOCATIONS, Phase.ACTIVE),
            (Op.PREPARE_UNICAST, Phase.SAVED),
            (Op.LOAD_ALLOCATIONS, Phase.PREPARED),
            (Op.RESTORE_UNICAST, Phase.LOADED),
        )
    ):
        r = ctl(c).request(op, txn_id=start + k, expected_phase=exp)
        assert r.reply.status == Status.OK, r.message
        if op == Op.SAVE_ALLOCATIONS:
            save = r
    return save


def test_cycle_dense_sparse_short_and_small(apps, ctl, chunk_files):
    chunk_files.chunk_bytes, chunk_files.staging_bytes = 4 * MiB, 8 * MiB
    c = apps()
    c.ok("init")
    dense = _alloc(c, 8 * MiB, 3)
    sparse = _alloc(c, 40 * MiB, 4, zero_from=4 * MiB)  # 9 of 10 chunks zero
    short = _alloc(c, 3 * GRAN, 5)  # 6 MiB: a 4 MiB chunk and a 2 MiB one
    small = _alloc(c, GRAN, 6)  # smaller than one chunk
    recs = _records(ctl, c)
    save = _cycle(ctl, c, 1)
    assert save.reply.reserved[1] == 4 * MiB
    assert save.reply.reserved[2] == 8 * MiB + 4 * MiB + 6 * MiB + 2 * MiB  # non-zero bytes
    assert save.reply.reserved[3] == save.reply.reserved[2]  # every one written with O_DIRECT
    for va, size, seed in ((dense, 8, 3), (short, 6, 5), (small, 2, 6)):
        c.ok(f"check {va} {size * MiB} {seed}")
    c.ok(f"check {sparse} {4 * MiB} 4")
    assert (
        c.val(f"read32 {sparse + 4 * MiB}") == 0 and c.val(f"read32 {sparse + 40 * MiB - 4}") == 0
    )
    # the files: exactly the bytes, holes where the chunks are zero
    files = {size: chunk_files.path(c.pid, aid) for aid, size in carried_streams(recs)}
    assert sorted(files) == [2 * MiB, 6 * MiB, 8 * MiB, 40 * MiB]
    sp = files[40 * MiB]
    with open(sp, "rb") as f:
        head = f.read(4 * MiB)
        rest = f.read()
    assert len(head) == 4 * MiB and rest == bytes(36 * MiB)
    assert os.stat(sp).st_blocks * 512 <= 0.15 * 40 * MiB  # ~10 % on disk
    assert os.path.getsize(files[6 * MiB]) == 6 * MiB


def test_save_write_error_keeps_active_and_bytes(apps, ctl):
    c = apps()
    c.ok("init")
    va = _alloc(c, 4 * GRAN, 9)
    recs = _records(ctl, c)
    [(aid, size)] = carried_streams(recs)
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        from cuinterpose.coordinator.client import CarrierRequest
        from cuinterpose.coordinator.protocol import StreamEntry

        req = CarrierRequest(MiB, 2 * MiB, 2, [(StreamEntry(aid, size), fd)])
        r = ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE, carriers=req)
    finally:
        os.close(fd)
    assert (r.reply.status, r.reply.phase, r.reply.bytes) == (Status.FAILED, Phase.ACTIVE, 0)
    head, _, tail = r.message.partition(" of 8 (offset ")
    assert head.startswith(f"SAVE_ALLOCATIONS: pid {c.pid} allocation {aid.hex()}: writing chunk ")
    assert tail.endswith(
        "to its chunk file failed: No space left on device (errno 28); the chunk table was "
        f"dropped and pid {c.pid} stays ACTIVE (nothing was torn down)"
    )
    assert [r for r in _records(ctl, c) if r.kind == RecordKind.ALLOCATION] == [
        r for r in recs if r.kind == RecordKind.ALLOCATION
    ]
    c.ok(f"check {va} {4 * GRAN} 9")
    _cycle(ctl, c, 2)  # a new capture works
    c.ok(f"check {va} {4 * GRAN} 9")


def _rss(pid) -> int:
    with open(f"/proc/{pid}/status") as f:
        for ln in f:
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_save_keeps_no_host_copy(apps, ctl, chunk_files):
    size = 32 * GRAN  # 64 MiB
    c = apps()
    c.ok("init")
    va = _alloc(c, size, 12)
    # fakecuda's copy engine filled the memory through its memfd (decisions D71): a read maps
    # it into the process, so that its RSS holds the 64 MiB as a CRIU dump would find them
    c.ok(f"check {va} {size} 12")
    before = _rss(c.pid)
    r = ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.bytes) == (Status.OK, size), r.message
    grown = _rss(c.pid) - before
    # the ring (256 KiB here) and thread stacks at most; a host carrier would add 64 MiB
    assert grown < 8 * MiB, grown
    [(aid, _)] = carried_streams(_records(ctl, c))
    with open(chunk_files.path(c.pid, aid), "rb") as f:
        data = f.read()
    assert len(data) == size
    assert hashlib.blake2b(data[:65536], digest_size=32).digest() == r.chunk_table[32:64]
    # PREPARED: the creator's memory no longer holds the 64 MiB at all (fakecuda's device
    # memory is host memory of the process): a CRIU dump here finds no carrier bytes, they
    # are only in the chunk file
    r = ctl(c).request(Op.PREPARE_UNICAST, txn_id=2, expected_phase=Phase.SAVED)
    assert r.reply.status == Status.OK, r.message
    assert before - _rss(c.pid) > size - 8 * MiB
    for k, (op, exp) in enumerate(
        ((Op.LOAD_ALLOCATIONS, Phase.PREPARED), (Op.RESTORE_UNICAST, Phase.LOADED)), 3
    ):
        r = ctl(c).request(op, txn_id=k, expected_phase=exp)
        assert r.reply.status == Status.OK, r.message
    c.ok(f"check {va} {size} 12")


def test_save_copies_from_the_apps_whole_mapping(apps, ctl, chunk_files, fake_log):
    chunk_files.chunk_bytes, chunk_files.staging_bytes = 2 * MiB, 4 * MiB
    size = 32 * GRAN  # 64 MiB
    c = apps()
    c.ok("init")
    whole = _alloc(c, size, 21)
    # the second: mapped by the app as two halves, so no one mapping covers it
    h = c.val(f"create {size} {POSIX}")
    parts = c.val(f"reserve {size}")
    for off in (0, size // 2):
        c.ok(f"map {parts + off} {size // 2} {off} {h}")
        c.ok(f"access {parts + off} {size // 2} 0 {RW}")
    c.ok(f"fill {parts} {size} 22")
    c.val(f"export {h}")
    recs = _records(ctl, c)
    mark = fake_log.mark()
    r = ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.bytes) == (Status.OK, 2 * size), r.message
    calls = fake_log.calls(c.pid, since=mark)
    srcs = [int(a["src"], 16) for fn, a, _ in calls if fn == "cuMemcpyDtoHAsync_v2"]
    assert len(srcs) == 2 * size // (2 * MiB)
    # the first allocation's chunks were read at the app's VAs, in order
    assert srcs[: len(srcs) // 2] == [whole + k * 2 * MiB for k in range(len(srcs) // 2)]
    # the second through one staging mapping of the whole allocation, taken and removed
    staged = [fn for fn, _, _ in calls if fn in ("cuMemAddressReserve", "cuMemMap", "cuMemUnmap")]
    assert staged == ["cuMemAddressReserve", "cuMemMap", "cuMemUnmap"]
    (smap,) = [int(a["ptr"], 16) for fn, a, _ in calls if fn == "cuMemMap"]
    assert srcs[len(srcs) // 2 :] == [smap + k * 2 * MiB for k in range(len(srcs) // 2)]
    assert smap not in (whole, parts)
    files = [chunk_files.path(c.pid, aid) for aid, _ in carried_streams(recs)]
    for path, seed in zip(files, (21, 22)):
        with open(path, "rb") as f:
            data = f.read()
        assert len(data) == size and data[: 64 << 10] == pattern(64 << 10, seed)
        assert hashlib.blake2b(data[: 2 * MiB], digest_size=32).digest() != bytes(32)


def test_sha256_chunks_round_trip_and_the_other_checksum_refuses(apps, ctl, chunk_files):
    """CUI_CARRY_SHA256 (decisions D36): SAVE's chunk table is hashlib.sha256 of each chunk; a
    LOAD that names BLAKE2b-256 instead is refused before anything is read (CUI_BAD_REQUEST,
    naming both checksums, the shim PREPARED); a damaged chunk is refused naming its SHA-256;
    the LOAD that names SHA-256 brings the bytes back."""
    chunk_files.chunk_bytes, chunk_files.staging_bytes = MiB, 4 * MiB
    chunk_files.checksum = "sha256"
    c = apps()
    c.ok("init")
    va = _alloc(c, 2 * GRAN, 21)  # 4 MiB: four 1 MiB chunks
    [(aid, size)] = carried_streams(_records(ctl, c))
    r = ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    assert r.reply.status == Status.OK, r.message
    path = chunk_files.path(c.pid, aid)
    with open(path, "rb") as f:
        data = f.read()
    digests = [r.chunk_table[32 + 32 * i : 64 + 32 * i] for i in range(4)]
    assert digests == [hashlib.sha256(data[i * MiB : (i + 1) * MiB]).digest() for i in range(4)]
    r = ctl(c).request(Op.PREPARE_UNICAST, txn_id=2, expected_phase=Phase.SAVED)
    assert r.reply.status == Status.OK, r.message
    chunk_files.checksum = "blake2b-256"
    r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=3, expected_phase=Phase.PREPARED)
    assert (r.reply.status, r.reply.phase) == (Status.BAD_REQUEST, Phase.PREPARED)
    assert r.message == (
        f"LOAD_ALLOCATIONS: pid {c.pid}: checksum blake2b-256 differs from the sha256 the chunk files were "
        "saved with; nothing was changed"
    )
    chunk_files.checksum = "sha256"
    bad = bytearray(data)
    bad[2 * MiB + 7] ^= 0x10
    with open(path, "r+b") as f:
        f.write(bad)
    r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=4, expected_phase=Phase.PREPARED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_STATE, Phase.PREPARED)
    assert r.message.startswith(
        f"LOAD_ALLOCATIONS: pid {c.pid} allocation {aid.hex()}: chunk 2 of its chunk file has checksum sha256 "
        f"{hashlib.sha256(bad[2 * MiB : 3 * MiB]).hexdigest()}, recorded {digests[2].hex()}; nothing was loaded"
    ), r.message
    with open(path, "r+b") as f:
        f.write(data)
    for t, (op, exp) in enumerate(
        ((Op.LOAD_ALLOCATIONS, Phase.PREPARED), (Op.RESTORE_UNICAST, Phase.LOADED)), 5
    ):
        r = ctl(c).request(op, txn_id=t, expected_phase=exp)
        assert r.reply.status == Status.OK, r.message
    c.ok(f"check {va} {size} 21")


def test_load_queues_every_read_first_and_zeroes_each_run_once(apps, ctl, chunk_files, fake_log):
    """LOAD_ALLOCATIONS (protocol.h "Carriers"): each allocation is mapped where the app maps it
    (no staging reservation), each run of consecutive zero chunks is one cuMemsetD8 at the run's
    offset, each non-zero chunk one copy at its offset, after its own allocation was mapped."""
    chunk_files.chunk_bytes, chunk_files.staging_bytes = 4 * MiB, 8 * MiB
    c = apps()
    c.ok("init")
    dense = _alloc(c, 8 * MiB, 31)  # 2 chunks, no zero run
    sparse = _alloc(c, 40 * MiB, 32, zero_from=4 * MiB)  # chunk 0, then one run of 9
    gaps = _alloc(c, 24 * MiB, 33)  # chunks 0 and 3 kept, runs 1-2 and 4-5 zeroed
    for off in (4 * MiB, 16 * MiB):
        c.ok(f"memset32 {gaps + off} 0 {(8 * MiB) // 4}")
    for k, (op, exp) in enumerate(
        ((Op.SAVE_ALLOCATIONS, Phase.ACTIVE), (Op.PREPARE_UNICAST, Phase.SAVED))
    ):
        r = ctl(c).request(op, txn_id=1 + k, expected_phase=exp)
        assert r.reply.status == Status.OK, r.message
    mark = fake_log.mark()
    r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=3, expected_phase=Phase.PREPARED)
    assert (r.reply.status, r.reply.bytes) == (Status.OK, 72 * MiB), r.message
    calls = fake_log.calls(c.pid, since=mark)
    names = [fn for fn, _, _ in calls]
    creates = [i for i, fn in enumerate(names) if fn == "cuMemCreate"]
    copies = [i for i, fn in enumerate(names) if fn == "cuMemcpyHtoDAsync_v2"]
    assert (len(creates), len(copies)) == (3, 2 + 1 + 2)
    # each allocation mapped where the app maps it, in request order (sizes tell them apart)
    maps = [(int(a["size"]), int(a["ptr"], 16)) for fn, a, _ in calls if fn == "cuMemMap"]
    base = {size: ptr for size, ptr in maps[:3]}
    assert base == {8 * MiB: dense, 40 * MiB: sparse, 24 * MiB: gaps}
    assert [fn for fn in names if fn in ("cuMemAddressReserve", "cuMemAddressFree")] == []
    at = {
        ptr: i
        for i, (fn, a, _) in enumerate(calls)
        if fn == "cuMemMap"
        for ptr in [int(a["ptr"], 16)]
    }
    for i in copies:
        dst = int(calls[i][1]["dst"], 16)
        (ptr,) = [b for s_, b in base.items() if b <= dst < b + s_]
        assert at[ptr] < i

    def where(a):
        d = int(a["dst"], 16)
        (size,) = [s for s, b in base.items() if b <= d < b + s]
        return size, d - base[size]

    sets = sorted((where(a), int(a["count"])) for fn, a, _ in calls if fn == "cuMemsetD8_v2")
    assert sets == [
        ((24 * MiB, 4 * MiB), 8 * MiB),
        ((24 * MiB, 16 * MiB), 8 * MiB),
        ((40 * MiB, 4 * MiB), 36 * MiB),
    ]
    got = sorted((where(a), int(a["bytes"])) for fn, a, _ in calls if fn == "cuMemcpyHtoDAsync_v2")
    assert got == [
        ((8 * MiB, 0), 4 * MiB),
        ((8 * MiB, 4 * MiB), 4 * MiB),
        ((24 * MiB, 0), 4 * MiB),
        ((24 * MiB, 12 * MiB), 4 * MiB),
        ((40 * MiB, 0), 4 * MiB),
    ]
    r = ctl(c).request(Op.RESTORE_UNICAST, txn_id=4, expected_phase=Phase.LOADED)
    assert r.reply.status == Status.OK, r.message
    c.ok(f"check {dense} {8 * MiB} 31")
    c.ok(f"check {sparse} {4 * MiB} 32")
    assert c.val(f"read32 {sparse + 40 * MiB - 4}") == 0
    assert (c.val(f"read32 {gaps + 4 * MiB}"), c.val(f"read32 {gaps + 24 * MiB - 4}")) == (0, 0)

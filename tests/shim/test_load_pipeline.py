"""LOAD_ALLOCATIONS's pipeline (ops_load.c queue_reads / zero_chunks / drain_reads, the copies
on ops_copies.c's lanes; docs/shim.md "Chunk files") and the page-locked ring (pin_ring), driven
adversarially on fakecuda (written by a reviewer trying to break them):
- a bad chunk (checksum) or an unreadable chunk file (EBADF) in the LAST allocation, while the
  earlier ones are created: refused naming that allocation and chunk, every allocation the LOAD
  created is unmapped from the app's VAs and released (fake log), the records are unchanged, the
  shim stays PREPARED, and the next LOAD brings the bytes back; with a one-slot ring and one
  reader, and with a wider ring and several readers;
- many allocations through a one-slot ring and one reader, and through a ring whose
  staging_bytes is not a whole number of chunks (reply.reserved[4] says the whole chunks locked,
  on SAVE and on LOAD);
- chunk-store refs that point into OTHER allocations' chunk files (backward and forward), one on
  a zero chunk, while the streams' own files hold garbage at those chunks; a damaged source
  refuses naming the first ref that reads it;
- the zero-run math at the end of allocations whose size is not a multiple of chunk_bytes, an
  allocation smaller than a chunk, all-zero allocations, and a LOAD with no read at all;
- cuMemCreate failing (out of memory) for the middle allocation while the readers run (and a
  bad chunk waits in the last one): the driver failure is reported, the first allocation is
  released, and later LOADs still work;
- a process with shared allocations on two devices, each accessible from its own device only:
  the cycle brings both back (each allocation's copies run in its device's context).
test_load_pipeline_sanitize.py runs _pipeline_scenario under ASan/UBSan and TSan."""

from __future__ import annotations

import hashlib
import os

import pytest

from cuinterpose.coordinator.carrierfiles import CarrierFiles, carried_streams
from cuinterpose.coordinator.client import CarrierRequest
from cuinterpose.coordinator.protocol import Op, Phase, RecordKind, Status, StreamEntry

from .conftest import (
    C_DIR,
    GRAN,
    POSIX,
    RW,
    App,
    link_fakecuda,
)

MiB = 1 << 20
CB = 64 << 10


def b2(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def _alloc(c, size, seed, zero=()):
    """A shared (exported) allocation of ``size`` bytes filled with pattern(seed); each
    (offset, length) of ``zero`` is then zeroed. Returns its VA."""
    h = c.val(f"create {size} {POSIX}")
    va = c.val(f"reserve {size}")
    c.ok(f"map {va} {size} 0 {h}")
    c.ok(f"access {va} {size} 0 {RW}")
    if seed is None:
        c.ok(f"memset32 {va} 0 {size // 4}")
    else:
        c.ok(f"fill {va} {size} {seed}")
    for off, n in zero:
        c.ok(f"memset32 {va + off} 0 {n // 4}")
    c.val(f"export {h}")
    return va


def _allocs(ctl, c, phase=Phase.ACTIVE):
    recs = ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=phase).records
    return [r for r in recs if r.kind == RecordKind.ALLOCATION]


def _step(ctl, c, op, txn, phase, **kw):
    r = ctl(c).request(op, txn_id=txn, expected_phase=phase, **kw)
    assert r.reply.status == Status.OK, r.message
    return r


def _save_prepare(ctl, c, txn=1):
    save = _step(ctl, c, Op.SAVE_ALLOCATIONS, txn, Phase.ACTIVE)
    _step(ctl, c, Op.PREPARE_UNICAST, txn + 1, Phase.SAVED)
    return save


def _load_restore(ctl, c, txn, total):
    r = _step(ctl, c, Op.LOAD_ALLOCATIONS, txn, Phase.PREPARED)
    assert (r.reply.phase, r.reply.bytes) == (Phase.LOADED, total)
    _step(ctl, c, Op.RESTORE_UNICAST, txn + 1, Phase.LOADED)
    return r


def _assert_released(fake_log, pid, mark, vas):
    """Every allocation the refused LOAD created was mapped where the app maps it (``vas``, in
    request order: the app maps each whole with read-write access, so no staging mapping), then
    unmapped and its handle released, each exactly once; nothing exported."""
    calls = fake_log.calls(pid, since=mark)
    made = [a["handle"] for fn, a, res in calls if fn == "cuMemCreate" and res == "CUDA_SUCCESS"]
    assert len(made) == len(vas)
    released = [a["handle"] for fn, a, _ in calls if fn == "cuMemRelease"]
    assert sorted(released) == sorted(made)
    mapped = [
        int(a["ptr"], 16) for fn, a, res in calls if fn == "cuMemMap" and res == "CUDA_SUCCESS"
    ]
    assert mapped == vas
    assert sorted(int(a["ptr"], 16) for fn, a, _ in calls if fn == "cuMemUnmap") == sorted(vas)
    assert [fn for fn, _, _ in calls if fn in ("cuMemAddressReserve", "cuMemAddressFree")] == []
    assert [fn for fn, _, _ in calls if fn == "cuMemExportToShareableHandle"] == []


def _refused_tail(pid):
    return (
        f"; nothing was loaded (the allocations created were released) and pid {pid} stays PREPARED"
    )


# --------------------------------------------------------------------------- the last allocation


@pytest.mark.parametrize(
    "staging,readers", [(CB, 1), (4 * CB, 3)], ids=["1slot-1reader", "4slots-3readers"]
)
def test_bad_chunk_in_the_last_allocation(apps, ctl, chunk_files, fake_log, staging, readers):
    """Five allocations (dense, all-zero, sparse, small, dense); the last one's chunk file has one
    flipped byte in its last chunk. The readers find it only after the earlier allocations were
    created: the LOAD is refused naming the last allocation and that chunk, all five are released,
    the records are unchanged, and with the byte put back the next LOAD brings every byte back."""
    chunk_files.staging_bytes, chunk_files.writers = staging, readers
    c = apps()
    c.ok("init")
    layout = [
        (4 * MiB, 1, ()),
        (4 * MiB, None, ()),
        (8 * MiB, 3, ((CB, 8 * MiB - CB),)),
        (GRAN, 4, ()),
        (4 * MiB, 5, ()),
    ]
    vas = [_alloc(c, size, seed, zero) for size, seed, zero in layout]
    streams = carried_streams(
        ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
    )
    assert [s for _, s in streams] == [size for size, _, _ in layout]
    _save_prepare(ctl, c)
    before = _allocs(ctl, c, Phase.PREPARED)
    aid = streams[-1][0]
    path = chunk_files.path(c.pid, aid)
    with open(path, "rb") as f:
        good = f.read()
    k = 4 * MiB // CB - 1  # the very last chunk of the last allocation
    bad = bytearray(good)
    bad[k * CB + 17] ^= 0x5A
    with open(path, "r+b") as f:
        f.write(bad)
    mark = fake_log.mark()
    r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=3, expected_phase=Phase.PREPARED)
    assert (r.reply.status, r.reply.phase, r.reply.bytes) == (
        Status.REFUSED_STATE,
        Phase.PREPARED,
        0,
    )
    assert r.message == (
        f"LOAD_ALLOCATIONS: pid {c.pid} allocation {aid.hex()}: chunk {k} of its chunk file has "
        f"checksum blake2b-256 {b2(bytes(bad[k * CB :]))}, recorded {b2(good[k * CB :])}"
        + _refused_tail(c.pid)
    )
    _assert_released(fake_log, c.pid, mark, vas)
    assert _allocs(ctl, c, Phase.PREPARED) == before
    assert c.err(f"create {GRAN} 0") == 600  # still PREPARED: NOT_READY
    with open(path, "r+b") as f:
        f.write(good)
    _load_restore(ctl, c, 4, sum(size for size, _, _ in layout))
    c.ok(f"check {vas[0]} {4 * MiB} 1")
    assert (c.val(f"read32 {vas[1]}"), c.val(f"read32 {vas[1] + 4 * MiB - 4}")) == (0, 0)
    c.ok(f"check {vas[2]} {CB} 3")
    assert (c.val(f"read32 {vas[2] + CB}"), c.val(f"read32 {vas[2] + 8 * MiB - 4}")) == (0, 0)
    c.ok(f"check {vas[3]} {GRAN} 4")
    c.ok(f"check {vas[4]} {4 * MiB} 5")


def test_unreadable_chunk_file_of_the_last_allocation(apps, ctl, chunk_files, fake_log):
    """The last allocation's descriptor is the right regular file of the right size, opened
    write-only: its first non-zero chunk's pread fails with EBADF after the other allocations were
    queued and created. Refused naming that allocation, chunk and errno; all released; the next
    LOAD (a readable descriptor) works."""
    c = apps()
    c.ok("init")
    a = _alloc(c, 2 * MiB, 7)
    b = _alloc(c, 4 * MiB, 8, zero=((0, 3 * CB),))  # chunks 0..2 zero: the first read is chunk 3
    streams = carried_streams(
        ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
    )
    _save_prepare(ctl, c)
    req = CarrierRequest(CB, 2 * CB, 1)
    for j, (aid, size) in enumerate(streams):
        flags = os.O_WRONLY if j == len(streams) - 1 else os.O_RDONLY
        req.streams.append((StreamEntry(aid, size), os.open(chunk_files.path(c.pid, aid), flags)))
    mark = fake_log.mark()
    try:
        r = ctl(c).request(
            Op.LOAD_ALLOCATIONS, txn_id=3, expected_phase=Phase.PREPARED, carriers=req
        )
    finally:
        CarrierFiles.close(req)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_STATE, Phase.PREPARED), r.message
    assert r.message == (
        f"LOAD_ALLOCATIONS: pid {c.pid} allocation {streams[1][0].hex()}: reading chunk 3 of its "
        "chunk file failed: Bad file descriptor (errno 9)" + _refused_tail(c.pid)
    )
    _assert_released(fake_log, c.pid, mark, [a, b])
    _load_restore(ctl, c, 4, 6 * MiB)
    c.ok(f"check {a} {2 * MiB} 7")
    assert c.val(f"read32 {b + 3 * CB - 4}") == 0
    # chunk 3 onwards is pattern(8) from byte 3 * CB of the fill
    with open(chunk_files.path(c.pid, streams[1][0]), "rb") as f:
        f.seek(3 * CB)
        want = f.read(4)
    assert c.val(f"read32 {b + 3 * CB}") == int.from_bytes(want, "little")


# --------------------------------------------------------------------------- ring shapes


def test_many_allocations_through_a_one_slot_ring(apps, ctl, chunk_files, fake_log):
    """24 allocations (every third all zero, every third with a zero hole in the middle) through
    a ring of one slot and one reader: the worker takes each verified chunk once its allocation
    exists (between the creates of later ones, or after the last), one chunk at a time. Every
    byte comes back; each non-zero chunk is one copy, after its allocation was mapped, each zero
    run one cuMemsetD8."""
    chunk_files.staging_bytes, chunk_files.writers = CB, 1
    c = apps()
    c.ok("init")
    size = GRAN  # 32 chunks
    kinds = ["dense", "zero", "hole"] * 8
    vas = []
    for i, kind in enumerate(kinds):
        if kind == "zero":
            vas.append(_alloc(c, size, None))
        elif kind == "hole":
            vas.append(_alloc(c, size, 100 + i, zero=((8 * CB, 16 * CB),)))
        else:
            vas.append(_alloc(c, size, 100 + i))
    save = _save_prepare(ctl, c)
    assert save.reply.reserved[4] == CB  # the one slot locked
    mark = fake_log.mark()
    r = _load_restore(ctl, c, 3, 24 * size)
    assert r.reply.reserved[4:6] == (CB, 0)
    calls = fake_log.calls(c.pid, since=mark)
    names = [fn for fn, _, _ in calls]
    creates = [i for i, fn in enumerate(names) if fn == "cuMemCreate"]
    copies = [i for i, fn in enumerate(names) if fn == "cuMemcpyHtoDAsync_v2"]
    assert (len(creates), len(copies)) == (24, 8 * 32 + 8 * 16)
    mapped = {int(a["ptr"], 16): i for i, (fn, a, _) in enumerate(calls) if fn == "cuMemMap"}
    assert sorted(mapped) == sorted(vas)  # where the app maps them
    for i in copies:  # each chunk after its own allocation was mapped
        dst = int(calls[i][1]["dst"], 16)
        (va,) = [v for v in vas if v <= dst < v + size]
        assert mapped[va] < i
    sets = [int(a["count"]) for fn, a, _ in calls if fn == "cuMemsetD8_v2"]
    assert sorted(sets) == [16 * CB] * 8 + [size] * 8
    for i, (kind, va) in enumerate(zip(kinds, vas)):
        if kind == "dense":
            c.ok(f"check {va} {size} {100 + i}")
        elif kind == "hole":
            c.ok(f"check {va} {8 * CB} {100 + i}")
            assert c.val(f"read32 {va + 8 * CB}") == 0 and c.val(f"read32 {va + 24 * CB - 4}") == 0
        else:
            assert c.val(f"read32 {va}") == 0 and c.val(f"read32 {va + size - 4}") == 0


def test_ring_of_a_partial_chunk_locks_whole_chunks(apps, ctl, chunk_files):
    """staging_bytes = 3 chunks + 1 byte and 8 readers: the ring is 3 whole chunks, and both SAVE
    and LOAD report exactly those bytes locked (reserved[4]) and no register error (reserved[5])."""
    chunk_files.staging_bytes, chunk_files.writers = 3 * CB + 1, 8
    c = apps()
    c.ok("init")
    vas = [_alloc(c, 2 * GRAN, 40 + i) for i in range(3)]
    save = _save_prepare(ctl, c)
    assert save.reply.reserved[4:6] == (3 * CB, 0)
    r = _load_restore(ctl, c, 3, 3 * 2 * GRAN)
    assert r.reply.reserved[4:6] == (3 * CB, 0)
    for i, va in enumerate(vas):
        c.ok(f"check {va} {2 * GRAN} {40 + i}")


# --------------------------------------------------------------------------- chunk store refs


def test_refs_into_other_allocations_files(apps, ctl, chunk_files):
    """Stream 0 (A) reads its chunk 10 from C's file, stream 1 (B) its chunk 0 from A's file and
    its chunk 6 from C's, stream 2 (C) its chunk 2 from A's file; B's chunk 5 is zero and has a ref
    too (ignored: zeroed, not read). The streams' own files hold garbage at the ref'd chunks, so
    the LOAD works only when every ref is followed at its offset. Then C's chunk 1 (the source of
    two refs) is damaged: with one reader the first ref to it, A's chunk 10, is named."""
    chunk_files.staging_bytes, chunk_files.writers = 4 * CB, 1
    c = apps()
    c.ok("init")
    A = _alloc(c, 2 * GRAN, 11)
    B = _alloc(c, GRAN, 12, zero=((5 * CB, CB),))
    C = _alloc(c, GRAN, 13)
    c.ok(f"fill {A + 3 * CB} {CB} 7")  # A chunk 3 == B chunk 0
    c.ok(f"fill {B} {CB} 7")
    c.ok(f"fill {C + CB} {CB} 8")  # C chunk 1 == B chunk 6 == A chunk 10
    c.ok(f"fill {B + 6 * CB} {CB} 8")
    c.ok(f"fill {A + 10 * CB} {CB} 8")
    c.ok(f"fill {C + 2 * CB} {CB} 11")  # C chunk 2 == A chunk 0
    streams = carried_streams(
        ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
    )
    (ia, _), (ib, _), (ic, _) = streams
    _save_prepare(ctl, c)
    na, nc = chunk_files.name(c.pid, ia), chunk_files.name(c.pid, ic)
    chunk_files.refs[(c.pid, ia.hex())] = {10: (nc, CB)}
    chunk_files.refs[(c.pid, ib.hex())] = {0: (na, 3 * CB), 5: (na, 0), 6: (nc, CB)}
    chunk_files.refs[(c.pid, ic.hex())] = {2: (na, 0)}
    originals = {}
    for aid, chunks in ((ia, (10,)), (ib, (0, 6)), (ic, (2,))):
        path = chunk_files.path(c.pid, aid)
        with open(path, "r+b") as f:
            originals[aid] = f.read()
            for k in chunks:
                f.seek(k * CB)
                f.write(b"\xee" * CB)
    with open(chunk_files.path(c.pid, ic), "r+b") as f:  # damage C's chunk 1: two refs read it
        good1 = originals[ic][CB : 2 * CB]
        f.seek(CB + 99)
        f.write(bytes([good1[99] ^ 1]))
        bad1 = bytearray(good1)
        bad1[99] ^= 1
    r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=3, expected_phase=Phase.PREPARED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_STATE, Phase.PREPARED), r.message
    # sources in first-use order: C's file (A's ref) is 0, A's file is 1
    assert r.message == (
        f"LOAD_ALLOCATIONS: pid {c.pid} allocation {ia.hex()}: chunk 10 of chunk store source 0 at "
        f"offset {CB} has checksum blake2b-256 {b2(bytes(bad1))}, recorded {b2(good1)}"
        + _refused_tail(c.pid)
    )
    with open(chunk_files.path(c.pid, ic), "r+b") as f:
        f.seek(CB)
        f.write(good1)
    _load_restore(ctl, c, 4, 4 * GRAN)
    # the ref'd chunks hold the pattern they were filled with (not the garbage of their own files)
    for va, k, seed in ((A, 3, 7), (A, 10, 8), (B, 0, 7), (B, 6, 8), (C, 1, 8), (C, 2, 11)):
        c.ok(f"check {va + k * CB} {CB} {seed}")
    c.ok(f"check {A} {3 * CB} 11")  # A's chunks 0..2 and C's chunk 0, from their own files
    c.ok(f"check {C} {CB} 13")

    def dev(va, off, n=64):
        return b"".join(
            c.val(f"read32 {va + off + i}").to_bytes(4, "little") for i in range(0, n, 4)
        )

    # samples of the other chunks against the saved files; B's zero chunk 5 (with its ref) zero
    assert dev(A, 11 * CB) == originals[ia][11 * CB : 11 * CB + 64]
    assert dev(A, 2 * GRAN - 64) == originals[ia][-64:]
    assert dev(B, CB) == originals[ib][CB : CB + 64]
    assert dev(B, 5 * CB) == bytes(64) and dev(B, 6 * CB - 64) == bytes(64)
    assert dev(C, GRAN - 64) == originals[ic][-64:]


# --------------------------------------------------------------------------- zero runs


def test_zero_runs_at_the_end_of_allocations_not_a_multiple_of_a_chunk(
    apps, ctl, chunk_files, fake_log
):
    """4 MiB chunks over allocations of 6, 10, 2, 10 and 6 MiB: a zero short last chunk, a zero
    run that ends in the short chunk, a zero allocation smaller than a chunk, a zero run before a
    non-zero short chunk, an all-zero allocation with a short last chunk. Each run is one
    cuMemsetD8 of exactly the bytes up to the allocation's end, never past it."""
    chunk_files.chunk_bytes, chunk_files.staging_bytes = 4 * MiB, 4 * MiB
    c = apps()
    c.ok("init")
    P = _alloc(c, 6 * MiB, 51, zero=((4 * MiB, 2 * MiB),))
    Q = _alloc(c, 10 * MiB, 52, zero=((4 * MiB, 6 * MiB),))
    R = _alloc(c, 2 * MiB, None)
    S = _alloc(c, 10 * MiB, 54, zero=((0, 4 * MiB),))
    T = _alloc(c, 6 * MiB, None)
    _save_prepare(ctl, c)
    mark = fake_log.mark()
    _load_restore(ctl, c, 3, 34 * MiB)
    calls = fake_log.calls(c.pid, since=mark)
    maps = [(int(a["size"]), int(a["ptr"], 16)) for fn, a, _ in calls if fn == "cuMemMap"][:5]
    order = [6 * MiB, 10 * MiB, 2 * MiB, 10 * MiB, 6 * MiB]
    assert [s for s, _ in maps] == order

    def where(a, key):
        d = int(a[key], 16)
        (j,) = [j for j, (s, b) in enumerate(maps) if b <= d < b + s]
        return j, d - maps[j][1]

    sets = sorted((where(a, "dst"), int(a["count"])) for fn, a, _ in calls if fn == "cuMemsetD8_v2")
    assert sets == [
        ((0, 4 * MiB), 2 * MiB),
        ((1, 4 * MiB), 6 * MiB),
        ((2, 0), 2 * MiB),
        ((3, 0), 4 * MiB),
        ((4, 0), 6 * MiB),
    ]
    copies = sorted(
        (where(a, "dst"), int(a["bytes"])) for fn, a, _ in calls if fn == "cuMemcpyHtoDAsync_v2"
    )
    assert copies == [
        ((0, 0), 4 * MiB),
        ((1, 0), 4 * MiB),
        ((3, 4 * MiB), 4 * MiB),
        ((3, 8 * MiB), 2 * MiB),
    ]
    c.ok(f"check {P} {4 * MiB} 51")
    c.ok(f"check {Q} {4 * MiB} 52")
    for va, size in ((P, 6 * MiB), (Q, 10 * MiB), (R, 2 * MiB), (T, 6 * MiB)):
        assert c.val(f"read32 {va + size - 4}") == 0
    assert c.val(f"read32 {S}") == 0 and c.val(f"read32 {T}") == 0
    with open(chunk_files.path(c.pid, carried_streams(_allocs(ctl, c))[3][0]), "rb") as f:
        tail = f.read()[-4:]
    assert c.val(f"read32 {S + 10 * MiB - 4}") == int.from_bytes(tail, "little")


def test_load_with_only_zero_chunks_reads_nothing(apps, ctl, chunk_files, fake_log):
    """Every chunk of every allocation is zero: nothing is queued (the readers get no task), no
    chunk is copied, and each allocation is one cuMemsetD8 of its whole size."""
    c = apps()
    c.ok("init")
    vas = [_alloc(c, size, None) for size in (GRAN, 3 * GRAN)]
    save = _save_prepare(ctl, c)
    assert save.reply.reserved[2] == 0  # no byte written
    mark = fake_log.mark()
    _load_restore(ctl, c, 3, 4 * GRAN)
    calls = fake_log.calls(c.pid, since=mark)
    assert [fn for fn, _, _ in calls if fn == "cuMemcpyHtoDAsync_v2"] == []
    assert sorted(int(a["count"]) for fn, a, _ in calls if fn == "cuMemsetD8_v2") == [
        GRAN,
        3 * GRAN,
    ]
    for va, size in zip(vas, (GRAN, 3 * GRAN)):
        assert c.val(f"read32 {va}") == 0 and c.val(f"read32 {va + size - 4}") == 0


# --------------------------------------------------------------------------- cuMemCreate fails


@pytest.fixture(scope="module")
def ipc_app(build_c, fakecuda_dir):
    return build_c([C_DIR / "ipc_app.c"], "shim_ipc_app", libs=link_fakecuda(fakecuda_dir))


def test_cumemcreate_fails_for_the_middle_allocation(ipc_app, shim_env, ctl, chunk_files, fake_log):
    """Three 8 MiB cuMemAlloc_v2 allocations shared with cuIpcGetMemHandle (the adapter makes them
    carried creators) on a 28 MiB device; while PREPARED the app takes 14 MiB of raw cuMemAlloc
    (below the adapter's threshold: straight to the driver), so the LOAD's second cuMemCreate
    runs out of memory while the readers already read, and the third allocation's file also has
    a bad chunk. The driver failure is what is reported (naming the second allocation), the first
    allocation is released, the shim stays PREPARED. With the memory freed the next LOAD finds the
    bad chunk (all three created, all released), and with it repaired the bytes come back."""
    env = dict(shim_env, CUINTERPOSE_IPC_ADAPTER=str(8 * MiB), FAKECUDA_TOTAL_MEM=str(28 * MiB))
    c = App(ipc_app, env)
    try:
        c.ok("init 0")
        vas = []
        for i in range(3):
            va = c.val(f"alloc {8 * MiB}")
            c.ok(f"fill {va} {8 * MiB} {60 + i}")
            c.ok(f"gethandle {va}")
            vas.append(va)
        streams = carried_streams(
            ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
        )
        assert [s for _, s in streams] == [8 * MiB] * 3
        _save_prepare(ctl, c)
        path = chunk_files.path(c.pid, streams[2][0])
        with open(path, "rb") as f:
            good = f.read()
        with open(path, "r+b") as f:
            f.seek(5 * CB)
            f.write(bytes([good[5 * CB] ^ 0x80]))
        raw = [c.val(f"alloc {7 * MiB}") for _ in range(2)]  # 14 MiB: 14 + 8 fits, 14 + 16 does not
        mark = fake_log.mark()
        r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=3, expected_phase=Phase.PREPARED)
        assert (r.reply.status, r.reply.phase, r.reply.cuda_result) == (
            Status.REFUSED_STATE,
            Phase.PREPARED,
            2,
        )
        assert r.message == (
            f"LOAD_ALLOCATIONS: pid {c.pid} allocation {streams[1][0].hex()}: cuMemCreate failed: "
            f"CUDA_ERROR_OUT_OF_MEMORY; the allocations created were released and pid {c.pid} stays "
            "PREPARED"
        )
        calls = fake_log.calls(c.pid, since=mark)
        assert [res for fn, _, res in calls if fn == "cuMemCreate"] == [
            "CUDA_SUCCESS",
            "CUDA_ERROR_OUT_OF_MEMORY",
        ]
        _assert_released(fake_log, c.pid, mark, vas[:1])
        for va in raw:
            c.ok(f"free {va}")
        mark = fake_log.mark()
        r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=4, expected_phase=Phase.PREPARED)
        assert (r.reply.status, r.reply.phase) == (Status.REFUSED_STATE, Phase.PREPARED), r.message
        assert r.message.startswith(
            f"LOAD_ALLOCATIONS: pid {c.pid} allocation {streams[2][0].hex()}: chunk 5 of its chunk file "
            "has checksum blake2b-256 "
        ), r.message
        _assert_released(fake_log, c.pid, mark, vas)
        with open(path, "r+b") as f:
            f.write(good)
        _load_restore(ctl, c, 5, 24 * MiB)
        for i, va in enumerate(vas):
            c.ok(f"check {va} {8 * MiB} {60 + i}")
    finally:
        c.close()


# --------------------------------------------------------------------------- two devices


def test_two_devices_in_one_process(apps, ctl, chunk_files, fake_log):
    """One process driving two GPUs: a shared allocation on device 0 (device 0 current), then
    one on device 1 (device 1 current), each accessible from its own device only. The control
    worker makes each allocation's device current for its copies (cui_ensure_context), so the
    cycle brings both back (before: CUDA_ERROR_ILLEGAL_ADDRESS at SAVE's cuMemcpyDtoH). With
    64 KiB chunks and three readers the two allocations' chunks interleave in LOAD, yet the
    shim retains each device's primary context once (state.c g_primary), not per switch."""
    chunk_files.chunk_bytes, chunk_files.staging_bytes, chunk_files.writers = CB, 4 * CB, 3
    c = apps()
    c.ok("init 0")
    a = _alloc(c, 2 * GRAN, 71)
    c.ok("init 1")
    h = c.val(f"create {2 * GRAN} {POSIX} 1")
    b = c.val(f"reserve {2 * GRAN}")
    c.ok(f"map {b} {2 * GRAN} 0 {h}")
    c.ok(f"access {b} {2 * GRAN} 1 {RW}")
    c.ok(f"fill {b} {2 * GRAN} 72")
    c.val(f"export {h}")
    mark = fake_log.mark()
    _save_prepare(ctl, c)
    _load_restore(ctl, c, 3, 4 * GRAN)
    calls = fake_log.calls(c.pid, since=mark)
    assert sum(fn == "cuMemcpyHtoDAsync_v2" for fn, _, _ in calls) == 2 * (2 * GRAN // CB)
    retained = [a["dev"] for fn, a, _ in calls if fn == "cuDevicePrimaryCtxRetain"]
    assert sorted(retained) == ["0", "1"], retained
    c.ok(f"check {b} {2 * GRAN} 72")
    c.ok("init 0")
    c.ok(f"check {a} {2 * GRAN} 71")


# --------------------------------------------------------------------------- sanitizers


def _pipeline_scenario(c, ctl, chunk_files):
    """A refused LOAD (bad chunk in the last allocation, a ref into another allocation's file),
    then the LOAD that works, under whatever build runs ``c``."""
    chunk_files.staging_bytes, chunk_files.writers = 2 * CB, 3
    c.ok("init")
    A = _alloc(c, GRAN, 81, zero=((4 * CB, 8 * CB),))
    B = _alloc(c, 3 * GRAN, 82)
    c.ok(f"fill {B + 2 * CB} {CB} 81")  # B chunk 2 == A chunk 0
    streams = carried_streams(
        ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
    )
    _save_prepare(ctl, c)
    chunk_files.refs[(c.pid, streams[1][0].hex())] = {
        2: (chunk_files.name(c.pid, streams[0][0]), 0)
    }
    path = chunk_files.path(c.pid, streams[1][0])
    with open(path, "rb") as f:
        good = f.read()
    with open(path, "r+b") as f:
        f.seek(len(good) - 1)
        f.write(bytes([good[-1] ^ 1]))
    r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=3, expected_phase=Phase.PREPARED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_STATE, Phase.PREPARED), r.message
    assert r.message.startswith(
        f"LOAD_ALLOCATIONS: pid {c.pid} allocation {streams[1][0].hex()}: chunk {3 * GRAN // CB - 1} "
        "of its chunk file has checksum blake2b-256 "
    ), r.message
    with open(path, "r+b") as f:
        f.write(good)
    _load_restore(ctl, c, 4, 4 * GRAN)
    c.ok(f"check {A} {4 * CB} 81")
    c.ok(f"check {B + 2 * CB} {CB} 81")
    c.ok(f"check {B} {2 * CB} 82")

"""Abandoning a capture in the shim (protocol.h: CANCEL_CAPTURE, non-destructive SAVE):
- CANCEL_CAPTURE brings SAVED back to ACTIVE with INSPECT equal to before the SAVE (carrier
  fields cleared), no driver call, and the application's calls work again on the same memory;
- CANCEL_CAPTURE in ACTIVE or PREPARED (or with an old txn) is refused and changes nothing;
- a SAVE_ALLOCATIONS that fails part-way (a real driver failure: the staging reservation of the
  second allocation does not fit under the process's RLIMIT_AS) frees the carrier, answers
  FAILED with phase ACTIVE naming pid, allocation and driver call, and the workload's memory
  and sharing are untouched."""

from __future__ import annotations

import resource

from cuinterpose.coordinator.protocol import Op, Phase, RecordFlag, RecordKind, Status

from .conftest import GRAN, POSIX, RW

NOT_READY = 600


def inspect(ctl, app, phase=Phase.ACTIVE):
    resp = ctl(app).request(Op.INSPECT, txn_id=0, expected_phase=phase)
    assert resp.reply.status == Status.OK, resp.message
    assert resp.reply.phase == phase, (resp.reply.phase, phase)
    return resp.records


def creator_and_importer(apps, sizes=(GRAN,), seed=11, halves=()):
    """c creates, maps and fills one exported allocation per size (those whose index is in
    ``halves`` as two mappings of half the size each, so that SAVE_ALLOCATIONS finds no app
    mapping of the whole allocation to copy from and takes a staging mapping); i imports the
    first through its ticket and maps it. Returns (c, i, [(va, size)] of c, va of i)."""
    c, i = apps(), apps()
    c.ok("init")
    i.ok("init")
    out = []
    fds = []
    for k, size in enumerate(sizes):
        h = c.val(f"create {size} {POSIX}")
        va = c.val(f"reserve {size}")
        parts = [(0, size // 2), (size // 2, size // 2)] if k in halves else [(0, size)]
        for off, n in parts:
            c.ok(f"map {va + off} {n} {off} {h}")
            c.ok(f"access {va + off} {n} 0 {RW}")
        c.ok(f"fill {va} {size} {seed + k}")
        fds.append(c.val(f"export {h}"))
        out.append((va, size))
    hi = i.val(f"import /proc/{c.pid}/fd/{fds[0]}")
    vi = i.val(f"reserve {sizes[0]}")
    i.ok(f"map {vi} {sizes[0]} 0 {hi}")
    i.ok(f"access {vi} {sizes[0]} 0 {RW}")
    i.ok(f"check {vi} {sizes[0]} {seed}")
    return c, i, out, vi


def test_cancel_from_saved_returns_active_unchanged(apps, ctl, fake_log):
    c, i, allocs, vi = creator_and_importer(apps)
    ((va, size),) = allocs
    before_c, before_i = inspect(ctl, c), inspect(ctl, i)
    for app in (c, i):
        r = ctl(app).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
        assert (r.reply.status, r.reply.phase) == (Status.OK, Phase.SAVED), r.message
    saved = inspect(ctl, c, Phase.SAVED)
    carried = [r for r in saved if r.kind == RecordKind.ALLOCATION]
    assert [(bool(r.flags & RecordFlag.CARRIED), r.carrier_bytes) for r in carried] == [
        (True, GRAN)
    ]
    assert c.err(f"create {GRAN} 0") == NOT_READY  # gated while SAVED

    mark = fake_log.mark()
    r = ctl(c).request(Op.CANCEL_CAPTURE, txn_id=2, expected_phase=Phase.SAVED)
    assert (r.reply.status, r.reply.phase, r.reply.records_changed, r.reply.bytes) == (
        Status.OK,
        Phase.ACTIVE,
        1,
        0,
    ), r.message
    r = ctl(i).request(Op.CANCEL_CAPTURE, txn_id=2, expected_phase=Phase.SAVED)
    assert (r.reply.status, r.reply.phase, r.reply.records_changed) == (Status.OK, Phase.ACTIVE, 0)
    assert fake_log.lines()[mark:] == []  # host memory only: no driver call
    assert inspect(ctl, c) == before_c
    assert inspect(ctl, i) == before_i
    a = next(r for r in inspect(ctl, c) if r.kind == RecordKind.ALLOCATION)
    assert (a.flags & RecordFlag.CARRIED, a.carrier_bytes, a.carrier_checksum) == (0, 0, 0)

    # the application works again on the same, still shared, memory
    c.ok(f"check {va} {size} 11")
    i.ok(f"check {vi} {size} 11")
    c.ok(f"fill {va} {size} 12")
    i.ok(f"check {vi} {size} 12")
    h2 = c.val(f"create {GRAN} 0")
    c.ok(f"release {h2}")
    # and a later capture cycle still works (txn ids continue above the cancel's)
    for txn, (op, exp) in enumerate(
        (
            (Op.SAVE_ALLOCATIONS, Phase.ACTIVE),
            (Op.PREPARE_UNICAST, Phase.SAVED),
            (Op.LOAD_ALLOCATIONS, Phase.PREPARED),
            (Op.RESTORE_UNICAST, Phase.LOADED),
        ),
        start=3,
    ):
        for app in (c, i):
            r = ctl(app).request(op, txn_id=txn, expected_phase=exp)
            assert r.reply.status == Status.OK, r.message
    i.ok(f"check {vi} {size} 12")
    c.ok(f"fill {va} {size} 13")
    i.ok(f"check {vi} {size} 13")


def test_cancel_refused_outside_saved_changes_nothing(apps, ctl, fake_log):
    c, i, allocs, vi = creator_and_importer(apps)
    ((va, size),) = allocs
    before = inspect(ctl, c)
    mark = fake_log.mark()
    cl = ctl(c)
    r = cl.request(Op.CANCEL_CAPTURE, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_PHASE, Phase.ACTIVE)
    assert r.message == (
        f"CANCEL_CAPTURE: pid {c.pid} is in phase ACTIVE (request expected ACTIVE; "
        "CANCEL_CAPTURE needs SAVED)"
    )
    r = cl.request(Op.CANCEL_CAPTURE, txn_id=2, expected_phase=Phase.SAVED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_PHASE, Phase.ACTIVE)
    assert fake_log.lines()[mark:] == []
    assert inspect(ctl, c) == before
    c.ok(f"check {va} {size} 11")

    for txn, (op, exp) in enumerate(
        ((Op.SAVE_ALLOCATIONS, Phase.ACTIVE), (Op.PREPARE_UNICAST, Phase.SAVED)), start=3
    ):
        for app in (c, i):
            assert ctl(app).request(op, txn_id=txn, expected_phase=exp).reply.status == Status.OK
    prepared = inspect(ctl, c, Phase.PREPARED)
    mark = fake_log.mark()
    for exp in (Phase.PREPARED, Phase.SAVED):
        r = cl.request(Op.CANCEL_CAPTURE, txn_id=10, expected_phase=exp)
        assert (r.reply.status, r.reply.phase) == (Status.REFUSED_PHASE, Phase.PREPARED), r.message
        assert "CANCEL_CAPTURE needs SAVED" in r.message
    r = cl.request(Op.CANCEL_CAPTURE, txn_id=4, expected_phase=Phase.PREPARED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_DUPLICATE, Phase.PREPARED)
    assert fake_log.lines()[mark:] == []
    assert inspect(ctl, c, Phase.PREPARED) == prepared  # the carrier is still held
    for txn, (op, exp) in enumerate(
        ((Op.LOAD_ALLOCATIONS, Phase.PREPARED), (Op.RESTORE_UNICAST, Phase.LOADED)), start=11
    ):
        for app in (c, i):
            r = ctl(app).request(op, txn_id=txn, expected_phase=exp)
            assert r.reply.status == Status.OK, r.message
    assert inspect(ctl, c) == before
    c.ok(f"check {va} {size} 11")
    i.ok(f"check {vi} {size} 11")


def _anon_rw_of_size(pid: int, size: int) -> list[str]:
    """Anonymous read-write private mappings of exactly ``size`` bytes (the carrier arena)."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for ln in f:
            parts = ln.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if len(parts) == 5 and parts[1] == "rw-p" and hi - lo == size:
                out.append(ln)
    return out


def _vm_size(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for ln in f:
            if ln.startswith("VmSize:"):
                return int(ln.split()[1]) * 1024
    raise AssertionError("no VmSize")


def test_save_failure_part_way_leaves_active_and_memory_intact(apps, ctl, fake_log, chunk_files):
    # two carried allocations: 2*GRAN, then 4*GRAN, both staging-mapped (each is mapped by the
    # app in two halves, so no app mapping covers it). The staging ring fits under the limit
    # set below, and so does the first staging reservation (fakecuda reserves
    # size + alignment = 3*GRAN, then trims), but the second (5*GRAN) does not: a real
    # CUDA_ERROR_OUT_OF_MEMORY from cuMemAddressReserve after the first copy was carried.
    sizes = (2 * GRAN, 4 * GRAN)
    c, i, allocs, vi = creator_and_importer(apps, sizes, halves=(0, 1))
    before_c, before_i = inspect(ctl, c), inspect(ctl, i)
    ids = [r.alloc_id for r in before_c if r.kind == RecordKind.ALLOCATION]
    old = resource.prlimit(c.pid, resource.RLIMIT_AS)
    # room for the staging ring and its one writer thread (stack: RLIMIT_STACK, plus a guard
    # page) as well, which the shim maps before the first staging reservation
    chunk_files.writers = 1
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    ring = chunk_files.staging_bytes + stack + 2 * 4096
    resource.prlimit(c.pid, resource.RLIMIT_AS, (_vm_size(c.pid) + 4 * GRAN + ring, old[1]))
    mark = fake_log.mark()
    try:
        r = ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    finally:
        resource.prlimit(c.pid, resource.RLIMIT_AS, old)
    assert (r.reply.status, r.reply.phase, r.reply.bytes, r.reply.records_changed) == (
        Status.FAILED,
        Phase.ACTIVE,
        0,
        0,
    ), r.message
    assert r.reply.cuda_result == 2  # CUDA_ERROR_OUT_OF_MEMORY
    assert r.message == (
        f"SAVE_ALLOCATIONS: pid {c.pid} allocation {ids[1].hex()}: cuMemAddressReserve "
        "(staging) failed: CUDA_ERROR_OUT_OF_MEMORY; the chunk table was dropped and "
        f"pid {c.pid} stays ACTIVE (nothing was torn down)"
    )
    # the first allocation was copied chunk by chunk (staging map, copies, unmap) before the
    # second failed
    copied = [a for fn, a, res in fake_log.calls(c.pid, since=mark) if fn == "cuMemcpyDtoHAsync_v2"]
    cb = chunk_files.chunk_bytes
    assert [int(a["bytes"]) for a in copied] == [cb] * (sizes[0] // cb)
    assert not any(
        fn in ("cuMemRelease", "cuMemUnmap") and res != "CUDA_SUCCESS"
        for fn, _, res in fake_log.calls(c.pid, since=mark)
    )
    # nothing changed: records (no CARRIED), the app's memory and sharing, and the shim
    # accepts a new capture (the failed txn counted as accepted)
    assert inspect(ctl, c) == before_c
    assert inspect(ctl, i) == before_i
    assert _anon_rw_of_size(c.pid, sum(sizes)) == [], "a host copy is still mapped"
    for k, (va, size) in enumerate(allocs):
        c.ok(f"check {va} {size} {11 + k}")
    i.ok(f"check {vi} {GRAN} 11")
    c.ok(f"fill {allocs[0][0]} {GRAN} 21")
    i.ok(f"check {vi} {GRAN} 21")
    r = ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    assert r.reply.status == Status.REFUSED_DUPLICATE
    r = ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=2, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.phase, r.reply.bytes) == (Status.OK, Phase.SAVED, sum(sizes)), (
        r.message
    )
    # no host copy while SAVED: the bytes are in the chunk files
    assert _anon_rw_of_size(c.pid, sum(sizes)) == []
    for k, rid in enumerate(ids):
        data = open(chunk_files.path(c.pid, rid), "rb").read()
        assert len(data) == sizes[k] and data[:16] != bytes(16)
    r = ctl(c).request(Op.CANCEL_CAPTURE, txn_id=3, expected_phase=Phase.SAVED)
    assert (r.reply.status, r.reply.phase, r.reply.records_changed) == (Status.OK, Phase.ACTIVE, 2)
    assert _anon_rw_of_size(c.pid, sum(sizes)) == []
    assert inspect(ctl, c) == before_c

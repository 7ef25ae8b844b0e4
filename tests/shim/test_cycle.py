"""A full in-place unicast cycle across two processes, without CRIU or native checkpoint:
SAVE_ALLOCATIONS -> PREPARE_UNICAST -> LOAD_ALLOCATIONS -> RESTORE_UNICAST.
Afterwards: bytes identical, VAs identical, real handles changed, sharing works again."""

from __future__ import annotations

from cuinterpose.coordinator.protocol import Op, Phase, RecordFlag, RecordKind, Role, Status

from .conftest import GRAN, POSIX, RW, TAG

SIZE = 2 * GRAN


def phase_all(ctl, apps_, op, txn, expected):
    out = []
    for a in apps_:
        resp = ctl(a).request(op, txn_id=txn, expected_phase=expected)
        assert resp.reply.status == Status.OK, (a.pid, resp.message)
        out.append(resp)
    return out


def test_two_process_cycle(apps, ctl, fake_log):
    c = apps()
    i = apps()
    c.ok("init")
    i.ok("init")

    # creator: a shared allocation (exported) and a private one
    h = c.val(f"create {SIZE} {POSIX}")
    assert h >> 48 == TAG
    va = c.val(f"reserve {2 * SIZE}")
    c.ok(f"map {va} {SIZE} 0 {h}")
    c.ok(f"access {va} {SIZE} 0 {RW}")
    c.ok(f"fill {va} {SIZE} 7")
    hp = c.val(f"create {GRAN} {POSIX}")
    c.ok(f"map {va + SIZE} {GRAN} 0 {hp}")
    c.ok(f"access {va + SIZE} {GRAN} 0 {RW}")
    c.ok(f"fill {va + SIZE} {GRAN} 3")
    fd = c.val(f"export {h}")

    # importer: import through the ticket, map, grant two devices in two calls
    hi = i.val(f"import /proc/{c.pid}/fd/{fd}")
    assert hi >> 48 == TAG
    vi = i.val(f"reserve {SIZE}")
    i.ok(f"map {vi} {SIZE} 0 {hi}")
    i.ok(f"access {vi} {SIZE} 0 {RW}")
    i.ok(f"access {vi} {SIZE} 1 {RW}")
    i.ok(f"check {vi} {SIZE} 7")

    before = {
        a.pid: ctl(a).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
        for a in (c, i)
    }
    cmaps = [r for r in before[c.pid] if r.kind == RecordKind.MAPPING]
    assert [(r.va, r.size, r.role) for r in cmaps] == [
        (va, SIZE, Role.CREATOR),
        (va + SIZE, GRAN, Role.PRIVATE),
    ]
    imaps = [r for r in before[i.pid] if r.kind == RecordKind.MAPPING]
    assert [(r.va, r.size, r.role, r.creator_pid) for r in imaps] == [
        (vi, SIZE, Role.IMPORTER, c.pid)
    ]
    assert [(x.location_id, x.flags) for x in imaps[0].access] == [(0, RW), (1, RW)]

    mark = fake_log.mark()
    save = phase_all(ctl, (c, i), Op.SAVE_ALLOCATIONS, 1, Phase.ACTIVE)
    assert [r.reply.bytes for r in save] == [SIZE, 0]
    assert [r.reply.records_changed for r in save] == [1, 0]
    assert all(r.reply.phase == Phase.SAVED for r in save)
    carried = [
        r
        for r in ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=Phase.SAVED).records
        if r.kind == RecordKind.ALLOCATION and r.role == Role.CREATOR
    ]
    assert len(carried) == 1 and carried[0].carrier_bytes == SIZE
    assert carried[0].flags & RecordFlag.CARRIED

    prep = phase_all(ctl, (c, i), Op.PREPARE_UNICAST, 2, Phase.SAVED)
    assert [r.reply.records_changed for r in prep] == [2, 2]  # one mapping + one handle each
    # shared mappings are gone in both processes, the private one is untouched
    unmaps = [
        (pid_args[1]["ptr"])
        for pid_args in fake_log.calls(fn="cuMemUnmap", since=mark)
        if pid_args[2] == "CUDA_SUCCESS"
    ]
    assert hex(va) in unmaps and hex(vi) in unmaps and hex(va + SIZE) not in unmaps
    # while not ACTIVE, tracked calls are refused without reaching the driver
    m2 = fake_log.mark()
    assert c.err(f"create {GRAN} {POSIX}") == 600  # CUDA_ERROR_NOT_READY
    assert fake_log.calls(pid=c.pid, fn="cuMemCreate", since=m2) == []

    load = phase_all(ctl, (c, i), Op.LOAD_ALLOCATIONS, 3, Phase.PREPARED)
    assert [r.reply.bytes for r in load] == [SIZE, 0]
    rest = phase_all(ctl, (c, i), Op.RESTORE_UNICAST, 4, Phase.LOADED)
    assert all(r.reply.phase == Phase.ACTIVE for r in rest)
    assert [r.reply.records_changed for r in rest] == [0, 2]

    after = {
        a.pid: ctl(a).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
        for a in (c, i)
    }
    assert after == before  # same VAs, roles, ids, access lists

    # real handles changed: the rebuilt mappings use other driver handles
    first = {}
    for _f, a, r in fake_log.calls(fn="cuMemMap"):
        if r == "CUDA_SUCCESS" and a["ptr"] in (hex(va), hex(vi)):
            first.setdefault(a["ptr"], []).append(a["handle"])
    assert len(first[hex(va)]) == 2 and first[hex(va)][0] != first[hex(va)][1]
    assert len(first[hex(vi)]) == 2 and first[hex(vi)][0] != first[hex(vi)][1]

    # bytes identical, and sharing works again in both directions
    c.ok(f"check {va} {SIZE} 7")
    i.ok(f"check {vi} {SIZE} 7")
    c.ok(f"check {va + SIZE} {GRAN} 3")
    c.ok(f"fill {va} {SIZE} 9")
    i.ok(f"check {vi} {SIZE} 9")
    i.ok(f"fill {vi} {GRAN} 11")
    c.ok(f"check {va} {GRAN} 11")
    # the virtual handles still work
    assert c.ok(f"props {h}") == ["1", "1", "1", "0"]
    # an import shows the driver's answer for an import: no requested handle types (R580)
    assert i.ok(f"props {hi}") == ["1", "0", "1", "0"]
    i.ok(f"unmap {vi} {SIZE}")
    i.ok(f"release {hi}")


def test_reciprocal_imports_concurrent_phases(apps, ctl):
    """Each process creates one allocation and imports the other's; every phase goes to both
    at once (as the coordinator does), so during RESTORE_UNICAST each worker fetches from the
    other while its own accept thread serves the peer."""
    import threading

    a, b = apps(), apps()
    for p in (a, b):
        p.ok("init")
    own = {}
    for p, seed in ((a, 1), (b, 2)):
        h = p.val(f"create {GRAN} {POSIX}")
        va = p.val(f"reserve {2 * GRAN}")
        p.ok(f"map {va} {GRAN} 0 {h}")
        p.ok(f"access {va} {GRAN} 0 {RW}")
        p.ok(f"fill {va} {GRAN} {seed}")
        own[p.pid] = (h, va, p.val(f"export {h}"))
    for p, q in ((a, b), (b, a)):
        hq = p.val(f"import /proc/{q.pid}/fd/{own[q.pid][2]}")
        va = own[p.pid][1] + GRAN
        p.ok(f"map {va} {GRAN} 0 {hq}")
        p.ok(f"access {va} {GRAN} 0 {RW}")
    before = [
        ctl(p).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records for p in (a, b)
    ]
    for txn, (op, exp) in enumerate(
        (
            (Op.SAVE_ALLOCATIONS, Phase.ACTIVE),
            (Op.PREPARE_UNICAST, Phase.SAVED),
            (Op.LOAD_ALLOCATIONS, Phase.PREPARED),
            (Op.RESTORE_UNICAST, Phase.LOADED),
        ),
        start=10,
    ):
        out = {}
        ths = [
            threading.Thread(
                target=lambda p=p, op=op, txn=txn, exp=exp, out=out: out.__setitem__(
                    p.pid, ctl(p).request(op, txn_id=txn, expected_phase=exp)
                )
            )
            for p in (a, b)
        ]
        for t in ths:
            t.start()
        for t in ths:
            t.join(60)
        assert [out[p.pid].reply.status for p in (a, b)] == [Status.OK, Status.OK], [
            out[p.pid].message for p in (a, b)
        ]
    after = [
        ctl(p).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records for p in (a, b)
    ]
    assert after == before
    a.ok(f"check {own[a.pid][1] + GRAN} {GRAN} 2")
    b.ok(f"check {own[b.pid][1] + GRAN} {GRAN} 1")
    a.ok(f"fill {own[a.pid][1]} {GRAN} 3")
    b.ok(f"check {own[b.pid][1] + GRAN} {GRAN} 3")

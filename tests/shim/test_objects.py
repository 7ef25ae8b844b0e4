"""The object model: virtual handles, alias collapse, access merge, tickets, refusals, and
phase-request rules (docs/shim.md)."""

from __future__ import annotations

import os

from cuinterpose.coordinator.protocol import (
    Op,
    Phase,
    RecordFlag,
    RecordKind,
    Role,
    Status,
    Ticket,
    TicketKind,
)

from .conftest import FABRIC, GRAN, POSIX, RW, TAG
from .fetch import fetch_fd, ticket_secret

NOT_READY, NOT_SUPPORTED, INVALID_VALUE = 600, 801, 1


def inspect(ctl, app, phase=Phase.ACTIVE):
    resp = ctl(app).request(Op.INSPECT, txn_id=0, expected_phase=phase)
    assert resp.reply.status == Status.OK, resp.message
    return resp.records


def shared_pair(apps):
    c, i = apps(), apps()
    c.ok("init")
    i.ok("init")
    h = c.val(f"create {GRAN} {POSIX}")
    va = c.val(f"reserve {GRAN}")
    c.ok(f"map {va} {GRAN} 0 {h}")
    c.ok(f"access {va} {GRAN} 0 {RW}")
    fd = c.val(f"export {h}")
    return c, i, h, va, fd


def test_alias_collapse_one_driver_reference(apps, ctl, fake_log):
    c, i, h, va, fd = shared_pair(apps)
    h1 = i.val(f"import /proc/{c.pid}/fd/{fd}")
    h2 = i.val(f"import /proc/{c.pid}/fd/{fd}")
    assert h1 == h2 and h1 >> 48 == TAG
    vi = i.val(f"reserve {GRAN}")
    i.ok(f"map {vi} {GRAN} 0 {h1}")
    h3 = i.val(f"retain {vi + 4096}")
    assert h3 == h1
    imports = fake_log.calls(pid=i.pid, fn="cuMemImportFromShareableHandle")
    assert [r for _, _, r in imports] == ["CUDA_SUCCESS"]
    assert fake_log.calls(pid=i.pid, fn="cuMemRetainAllocationHandle") == []
    alloc = [r for r in inspect(ctl, i) if r.kind == RecordKind.ALLOCATION]
    assert [(a.role, a.handle_refs, a.creator_pid, a.size) for a in alloc] == [
        (Role.IMPORTER, 3, c.pid, GRAN)
    ]

    i.ok(f"release {h1}")
    i.ok(f"release {h2}")
    assert fake_log.calls(pid=i.pid, fn="cuMemRelease") == []
    i.ok(f"release {h3}")
    real = imports[0][1]["handle"]
    assert [(a["handle"], r) for _, a, r in fake_log.calls(pid=i.pid, fn="cuMemRelease")] == [
        (real, "CUDA_SUCCESS")
    ]
    # still mapped: the record stays with no handle refs; one more release is refused here
    assert i.err(f"release {h1}") == INVALID_VALUE
    assert len(fake_log.calls(pid=i.pid, fn="cuMemRelease")) == 1
    alloc = [r for r in inspect(ctl, i) if r.kind == RecordKind.ALLOCATION]
    assert [a.handle_refs for a in alloc] == [0]
    # a retain through the mapping takes one new driver reference and the same virtual handle
    assert i.val(f"retain {vi}") == h1
    assert len(fake_log.calls(pid=i.pid, fn="cuMemRetainAllocationHandle")) == 1
    i.ok(f"unmap {vi} {GRAN}")
    i.ok(f"release {h1}")
    assert [r for r in inspect(ctl, i) if r.kind != RecordKind.RESERVATION] == []


def test_access_merged_per_location_and_limit(apps, ctl, fake_log):
    a = apps()
    a.ok("init")
    h = a.val(f"create {GRAN} 0")
    va = a.val(f"reserve {GRAN}")
    a.ok(f"map {va} {GRAN} 0 {h}")
    a.ok(f"access {va} {GRAN} 0 {RW}")
    a.ok(f"access {va} {GRAN} 1 {RW}")
    a.ok(f"access {va} {GRAN} 0 1")
    m = [r for r in inspect(ctl, a) if r.kind == RecordKind.MAPPING]
    assert [(x.location_type, x.location_id, x.flags) for x in m[0].access] == [
        (1, 0, 1),
        (1, 1, RW),
    ]
    # 33 locations: refused before the driver sees the call
    mark = fake_log.mark()
    many = " ".join(f"{d} {RW}" for d in range(33))
    assert a.err(f"access {va} {GRAN} {many}") == NOT_SUPPORTED
    assert fake_log.calls(pid=a.pid, fn="cuMemSetAccess", since=mark) == []
    # a range covering only part of a tracked mapping is refused too
    assert a.err(f"access {va} {GRAN // 2} 0 {RW}") == NOT_SUPPORTED
    assert fake_log.calls(pid=a.pid, fn="cuMemSetAccess", since=mark) == []
    m2 = [r for r in inspect(ctl, a) if r.kind == RecordKind.MAPPING]
    assert m2 == m


def test_ticket_is_sealed_memfd_and_importer_sees_writes(apps, ctl, fake_log, shim_env):
    c, i, h, va, fd = shared_pair(apps)
    seals, size, raw = c.ok(f"ticket {fd}")
    assert int(seals) == 0xF and int(size) == 64  # WRITE|GROW|SHRINK|SEAL, 64 bytes
    t = Ticket.unpack(bytes.fromhex(raw))
    alloc = [r for r in inspect(ctl, c) if r.kind == RecordKind.ALLOCATION][0]
    assert (t.kind, t.creator_pid, t.alloc_id, t.size) == (
        TicketKind.ALLOCATION,
        c.pid,
        alloc.alloc_id,
        GRAN,
    )
    # reserved[1]: the allocation's secret (protocol.h "Secrets"), the same in every ticket
    assert t.reserved0 == 0 and t.reserved[0] == 0 and t.reserved[1] != 0
    assert alloc.role == Role.CREATOR and alloc.flags == RecordFlag.EXPORTED | RecordFlag.SHARED
    # a second export hands out another ticket; the driver exported exactly once (cache)
    fd2 = c.val(f"export {h}")
    assert fd2 != fd
    assert len(fake_log.calls(pid=c.pid, fn="cuMemExportToShareableHandle")) == 1

    c.ok(f"fill {va} {GRAN} 21")
    hi = i.val(f"import /proc/{c.pid}/fd/{fd2}")
    vi = i.val(f"reserve {GRAN}")
    i.ok(f"map {vi} {GRAN} 0 {hi}")
    i.ok(f"access {vi} {GRAN} 0 {RW}")
    i.ok(f"check {vi} {GRAN} 21")
    i.ok(f"fill {vi} {GRAN} 22")
    c.ok(f"check {va} {GRAN} 22")
    # the importer's real import used the creator's export FD, fetched over the control socket
    imp = fake_log.calls(pid=i.pid, fn="cuMemImportFromShareableHandle")
    assert [r for _, _, r in imp] == ["CUDA_SUCCESS"]
    # FETCH_FD with the ticket's secret: the export cache answers with an FD; an unknown id
    # gets NOT_FOUND
    assert ticket_secret(c.pid, fd2) == t.reserved[1]
    cdir = shim_env["CUINTERPOSE_CONTROL_DIR"]
    rep, _, got = fetch_fd(cdir, c.pid, t.alloc_id, t.reserved[1])
    assert rep.status == Status.OK and got is not None
    assert os.fstat(got).st_size >= GRAN
    os.close(got)
    rep, msg, got = fetch_fd(cdir, c.pid, bytes(16), 0)
    assert rep.status == Status.NOT_FOUND and got is None
    assert f"pid {c.pid} (phase ACTIVE) has no exported allocation {'0' * 32}" in msg


def test_fabric_create_refused_output_untouched(apps, ctl, fake_log):
    a = apps()
    a.ok("init")
    for types in (FABRIC, FABRIC | POSIX):
        toks = a.cmd(f"create_sentinel {GRAN} {types}")
        assert toks == ["err", str(NOT_SUPPORTED), "0x99"]
    assert fake_log.calls(pid=a.pid, fn="cuMemCreate") == []
    assert inspect(ctl, a) == []


def test_wrong_phase_and_duplicate_change_nothing(apps, ctl, fake_log):
    c, i, h, va, fd = shared_pair(apps)
    hi = i.val(f"import /proc/{c.pid}/fd/{fd}")
    before = inspect(ctl, c)
    mark = fake_log.mark()
    cl = ctl(c)
    r = cl.request(Op.PREPARE_UNICAST, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_PHASE, Phase.ACTIVE)
    assert f"PREPARE_UNICAST: pid {c.pid} is in phase ACTIVE" in r.message
    r = cl.request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.SAVED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_PHASE, Phase.ACTIVE)
    assert fake_log.lines()[mark:] == []
    assert inspect(ctl, c) == before

    r = cl.request(Op.SAVE_ALLOCATIONS, txn_id=5, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.phase, r.reply.bytes) == (Status.OK, Phase.SAVED, GRAN)
    saved = inspect(ctl, c, Phase.SAVED)
    mark = fake_log.mark()
    for op, exp in ((Op.SAVE_ALLOCATIONS, Phase.ACTIVE), (Op.PREPARE_UNICAST, Phase.SAVED)):
        r = cl.request(op, txn_id=5, expected_phase=exp)
        assert (r.reply.status, r.reply.phase) == (Status.REFUSED_DUPLICATE, Phase.SAVED)
        assert "txn 5 is not newer than the last accepted txn 5" in r.message
    assert fake_log.lines()[mark:] == []
    assert inspect(ctl, c, Phase.SAVED) == saved
    # INSPECT is read-only: it answers whatever phase the sender expected, and says which
    r = cl.request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.phase, r.records) == (Status.OK, Phase.SAVED, saved)
    # a multicast op out of its phase: refused, nothing changes
    r = cl.request(Op.PREPARE_MULTICAST, txn_id=6, expected_phase=Phase.SAVED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_PHASE, Phase.SAVED)
    assert r.message.endswith("PREPARE_MULTICAST needs ACTIVE)")
    assert fake_log.lines()[mark:] == []
    assert inspect(ctl, c, Phase.SAVED) == saved
    # the importer was never asked: still ACTIVE and usable
    assert i.ok(f"props {hi}") == ["1", "0", "1", "0"]  # an import: no handle types (R580)


def test_raw_import_blocks_capture(apps, ctl, fake_env, fake_log):
    plain = apps(env=fake_env)  # no shim: its export is a raw driver FD
    plain.ok("init")
    h = plain.val(f"create {GRAN} {POSIX}")
    fd = plain.val(f"export {h}")
    a = apps()
    a.ok("init")
    ha = a.val(f"import /proc/{plain.pid}/fd/{fd}")
    assert ha >> 48 == TAG
    rec = [r for r in inspect(ctl, a) if r.kind == RecordKind.ALLOCATION]
    assert [(r.role, r.flags, r.creator_pid) for r in rec] == [
        (Role.IMPORTER, RecordFlag.SHARED | RecordFlag.RAW_IMPORT, 0)
    ]
    before = inspect(ctl, a)
    mark = fake_log.mark()
    r = ctl(a).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_STATE, Phase.ACTIVE)
    assert (
        f"SAVE_ALLOCATIONS: pid {a.pid} allocation {rec[0].alloc_id.hex()}: imported from a raw"
        in r.message
    )
    assert fake_log.lines()[mark:] == []
    assert inspect(ctl, a) == before
    # once released, capture goes ahead (same txn: the refusal consumed nothing)
    a.ok(f"release {ha}")
    r = ctl(a).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.phase, r.reply.bytes) == (Status.OK, Phase.SAVED, 0)


def test_private_allocations_left_alone(apps, ctl, fake_log):
    a = apps()
    a.ok("init")
    h = a.val(f"create {GRAN} {POSIX}")
    va = a.val(f"reserve {GRAN}")
    a.ok(f"map {va} {GRAN} 0 {h}")
    a.ok(f"access {va} {GRAN} 0 {RW}")
    a.ok(f"fill {va} {GRAN} 5")
    mark = fake_log.mark()
    for txn, (op, exp) in enumerate(
        (
            (Op.SAVE_ALLOCATIONS, Phase.ACTIVE),
            (Op.PREPARE_UNICAST, Phase.SAVED),
            (Op.LOAD_ALLOCATIONS, Phase.PREPARED),
            (Op.RESTORE_UNICAST, Phase.LOADED),
        ),
        start=1,
    ):
        r = ctl(a).request(op, txn_id=txn, expected_phase=exp)
        assert (r.reply.status, r.reply.bytes, r.reply.records_changed) == (Status.OK, 0, 0), (
            r.message
        )
    assert fake_log.lines()[mark:] == []  # no driver call at all
    a.ok(f"check {va} {GRAN} 5")
    assert [r.role for r in inspect(ctl, a) if r.kind == RecordKind.ALLOCATION] == [Role.PRIVATE]


def test_reexport_names_creator_and_dead_ticket(apps, ctl, fake_log):
    c, i, h, va, fd = shared_pair(apps)
    c.ok(f"fill {va} {GRAN} 13")
    hi = i.val(f"import /proc/{c.pid}/fd/{fd}")
    # an importer's export is a ticket naming the original creator; no driver export
    fdi = i.val(f"export {hi}")
    t = Ticket.unpack(bytes.fromhex(i.ok(f"ticket {fdi}")[2]))
    assert t.creator_pid == c.pid
    assert fake_log.calls(pid=i.pid, fn="cuMemExportToShareableHandle") == []
    j = apps()
    j.ok("init")
    hj = j.val(f"import /proc/{i.pid}/fd/{fdi}")
    vj = j.val(f"reserve {GRAN}")
    j.ok(f"map {vj} {GRAN} 0 {hj}")
    j.ok(f"access {vj} {GRAN} 0 {RW}")
    j.ok(f"check {vj} {GRAN} 13")
    assert [r.creator_pid for r in inspect(ctl, j) if r.kind == RecordKind.ALLOCATION] == [c.pid]
    # the creator drops its last handle and mapping: the ticket is dead, the cache closed
    c.ok(f"unmap {va} {GRAN}")
    c.ok(f"release {h}")
    k = apps()
    k.ok("init")
    assert k.err(f"import /proc/{c.pid}/fd/{fd}") == INVALID_VALUE
    assert fake_log.calls(pid=k.pid, fn="cuMemImportFromShareableHandle") == []

"""The creator lets go (issue 10): PyTorch SymmetricMemory's rank 0 releases its multicast
create handle after setup while the importers keep theirs, and NCCL and SymmetricMemory close
the exported FD right after sending it. The shim keeps a creator's exported multicast object as
the team's anchor (docs/shim.md "Creator lets go"), and an exported allocation stays fetchable
from the export cache after the app closed its ticket FD. Each test ends with an in-place
capture and restore through the coordinator (its validation included), then checks bytes and
broadcasts again. FDs travel with pidfd_getfd(2), so the creator's copy can be closed before
the importer imports."""

from __future__ import annotations

import os

from cuinterpose.coordinator.protocol import RecordFlag, RecordKind, Role, Status

from .conftest import GRAN, POSIX, RW, TAG
from .fetch import fetch_fd, ticket_secret
from .share_helpers import changed, cycle, inspect, sapps, share_app  # noqa: F401

DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE


def member(app, size=GRAN):
    """A POSIX allocation of ``app`` mapped read-write on device 0: (handle, va)."""
    h = app.val(f"create {size} {POSIX}")
    va = app.val(f"reserve {size}")
    app.ok(f"map {va} {size} 0 {h}")
    app.ok(f"access {va} {size} {DEVICE} 0 {RW}")
    return h, va


def bind_and_map(app, mc, mem, size=GRAN):
    app.ok(f"mc_bindmem {mc} 0 {mem} 0 {size}")
    va = app.val(f"reserve {size}")
    app.ok(f"map {va} {size} 0 {mc}")
    app.ok(f"access {va} {size} {DEVICE} 0 {RW}")
    return va


def multicast(records):
    return [r for r in records if r.kind == RecordKind.MULTICAST]


def test_released_multicast_creator_anchors_the_team(sapps, ctl, shim_env, fake_log):  # noqa: F811
    """Rank 0 creates a one-device object, exports it, closes the FD and releases the create
    handle before anyone imported; the importer imports, adds its device, binds and maps. The
    creator's record stays (no handle, no binding: the anchor), FETCH_FD answers from it, and
    the restore re-creates the object in the creator and re-imports it in the importer."""
    c, i = sapps(), sapps()
    for p in (c, i):
        p.ok("init")
    c.ok("ptracer")
    mc = c.val(f"mc_create 1 {GRAN} {POSIX}")
    assert mc >> 48 == TAG
    fd = c.val(f"export {mc}")
    tfd = i.val(f"getfd {c.pid} {fd}")
    c.ok(f"close {fd}")
    c.ok(f"release {mc}")
    anchor = multicast(inspect(ctl, c))
    assert [(r.role, r.handle_refs, r.creator_pid, r.size) for r in anchor] == [
        (Role.CREATOR, 0, c.pid, GRAN)
    ]
    assert anchor[0].flags & (RecordFlag.EXPORTED | RecordFlag.SHARED) == (
        RecordFlag.EXPORTED | RecordFlag.SHARED
    )

    mi = i.val(f"import_fd {tfd}")  # the importer keeps its ticket FD for a late joiner
    assert mi >> 48 == TAG
    i.ok(f"mc_add {mi} 0")
    mem, va = member(i)
    mcva = bind_and_map(i, mi, mem)
    i.ok(f"memset32 {mcva} 0x1111 4")
    assert i.val(f"read32 {va}") == 0x1111
    imported = multicast(inspect(ctl, i))
    assert [(r.role, r.handle_refs, r.creator_pid) for r in imported] == [(Role.IMPORTER, 1, c.pid)]
    assert bytes(imported[0].alloc_id) == bytes(anchor[0].alloc_id)

    mark = fake_log.mark()
    _cap, res = cycle(shim_env, (c, i))
    assert changed(res, "RESTORE_MULTICAST_CREATORS") == {c.pid: 1, i.pid: 0}
    assert changed(res, "RESTORE_MULTICAST_IMPORTERS") == {c.pid: 0, i.pid: 1}
    assert changed(res, "RESTORE_MULTICAST_DEVICES") == {c.pid: 0, i.pid: 1}
    assert changed(res, "RESTORE_MULTICAST_BINDINGS") == {c.pid: 0, i.pid: 2}
    creates = fake_log.calls(fn="cuMulticastCreate", since=mark)
    assert [(a["numDevices"], a["size"], r) for _f, a, r in creates] == [
        ("1", str(GRAN), "CUDA_SUCCESS")
    ]
    assert fake_log.calls(pid=c.pid, fn="cuMulticastCreate", since=mark) == creates
    # the anchor is still there, and the team works again at the same VAs
    assert multicast(inspect(ctl, c)) == anchor
    assert i.val(f"read32 {va}") == 0x1111
    i.ok(f"memset32 {mcva} 0x2222 4")
    assert i.val(f"read32 {va}") == 0x2222
    # a late joiner takes the ticket from the importer: the anchor re-exported at restore
    # answers its FETCH_FD
    j = sapps()
    j.ok("init")
    jfd = j.val(f"getfd {i.pid} {tfd}")
    assert j.val(f"import_fd {jfd}") >> 48 == TAG
    assert [(r.role, r.creator_pid, bytes(r.alloc_id)) for r in multicast(inspect(ctl, j))] == [
        (Role.IMPORTER, c.pid, bytes(anchor[0].alloc_id))
    ]


def test_creator_releases_create_handle_keeps_binding(sapps, ctl, shim_env):  # noqa: F811
    """Two ranks bind and map; rank 0 releases its create handle afterwards (its binding and
    mapping stay), the exported FD was closed right after the importer took it."""
    c, i = sapps(), sapps()
    for p in (c, i):
        p.ok("init")
    mc = c.val(f"mc_create 2 {GRAN} {POSIX}")
    fd = c.val(f"export {mc}")
    tfd = i.val(f"getfd {c.pid} {fd}")
    c.ok(f"close {fd}")
    mi = i.val(f"import_fd {tfd}")
    i.ok(f"close {tfd}")
    ranks = {}
    for p, h in ((c, mc), (i, mi)):
        p.ok(f"mc_add {h} 0")
    for p, h in ((c, mc), (i, mi)):
        mem, va = member(p)
        ranks[p.pid] = (va, bind_and_map(p, h, mem))
    c.ok(f"release {mc}")
    assert [r.handle_refs for r in multicast(inspect(ctl, c))] == [0]
    c.ok(f"memset32 {ranks[c.pid][1]} 0x5151 4")
    assert [p.val(f"read32 {ranks[p.pid][0]}") for p in (c, i)] == [0x5151, 0x5151]

    _cap, res = cycle(shim_env, (c, i))
    assert changed(res, "RESTORE_MULTICAST_CREATORS") == {c.pid: 1, i.pid: 0}
    assert changed(res, "RESTORE_MULTICAST_DEVICES") == {c.pid: 1, i.pid: 1}
    assert changed(res, "RESTORE_MULTICAST_BINDINGS") == {c.pid: 2, i.pid: 2}
    assert [p.val(f"read32 {ranks[p.pid][0]}") for p in (c, i)] == [0x5151, 0x5151]
    i.ok(f"memset32 {ranks[i.pid][1]} 0x6262 4")
    assert [p.val(f"read32 {ranks[p.pid][0]}") for p in (c, i)] == [0x6262, 0x6262]
    # the released create handle stays released: one more release is refused, no driver call
    assert c.err(f"release {mc}") == 1  # CUDA_ERROR_INVALID_VALUE


def test_allocation_fetchable_after_creator_closed_fd_and_released(sapps, ctl, shim_env, fake_log):  # noqa: F811
    """NCCL-style: the creator exports, the peer takes the FD, the creator closes its FD and
    releases its handle (the mapping stays). The peer imports afterwards (FETCH_FD is answered
    from the export cache), and a full cycle carries the bytes."""
    c, i = sapps(), sapps()
    for p in (c, i):
        p.ok("init")
    h, va = member(c, 2 * GRAN)
    c.ok(f"fill {va} {2 * GRAN} 5")
    fd = c.val(f"export {h}")
    tfd = i.val(f"getfd {c.pid} {fd}")
    c.ok(f"close {fd}")
    c.ok(f"release {h}")
    [alloc] = [r for r in inspect(ctl, c) if r.kind == RecordKind.ALLOCATION]
    assert (alloc.role, alloc.handle_refs) == (Role.CREATOR, 0)
    assert alloc.flags & RecordFlag.EXPORTED

    hi = i.val(f"import_fd {tfd}")
    i.ok(f"close {tfd}")
    vi = i.val(f"reserve {2 * GRAN}")
    i.ok(f"map {vi} {2 * GRAN} 0 {hi}")
    i.ok(f"access {vi} {2 * GRAN} {DEVICE} 0 {RW}")
    i.ok(f"check {vi} {2 * GRAN} 5")
    mark = fake_log.mark()
    _cap, res = cycle(shim_env, (c, i))
    assert [x.phase for x in res.phases] == [
        "INSPECT",
        "LOAD_ALLOCATIONS",
        "RESTORE_UNICAST",
        "INSPECT",
    ]
    # the creator re-created, loaded, mapped and re-exported it, then dropped the new handle
    # (the app holds none): one create and one release in the creator
    assert [r for _f, _a, r in fake_log.calls(pid=c.pid, fn="cuMemCreate", since=mark)] == [
        "CUDA_SUCCESS"
    ]
    assert len(fake_log.calls(pid=c.pid, fn="cuMemExportToShareableHandle", since=mark)) == 1
    c.ok(f"check {va} {2 * GRAN} 5")
    i.ok(f"check {vi} {2 * GRAN} 5")
    i.ok(f"fill {vi} {GRAN} 8")
    c.ok(f"check {va} {GRAN} 8")


def test_multicast_fetch_fd_needs_the_objects_secret(sapps, ctl, shim_env):  # noqa: F811
    """Case 011's kind for multicast objects: a multicast ticket carries its object's secret
    (protocol.h "Secrets", ``reserved[1]``, never 0); FETCH_FD of the object without it is
    refused naming the pid and object (never the secret), with it the FD is served, and an
    importer holding the ticket imports through the shim (which sends the secret it learnt)."""
    c, i = sapps(), sapps()
    for p in (c, i):
        p.ok("init")
    c.ok("ptracer")
    mc = c.val(f"mc_create 1 {GRAN} {POSIX}")
    fd = c.val(f"export {mc}")
    secret = ticket_secret(c.pid, fd)
    assert secret != 0
    anchor = multicast(inspect(ctl, c))
    oid = bytes(anchor[0].alloc_id)
    cdir = shim_env["CUINTERPOSE_CONTROL_DIR"]
    for wrong in (0, secret ^ 1):
        rep, msg, got = fetch_fd(cdir, c.pid, oid, wrong)
        assert (rep.status, got) == (Status.REFUSED_PEER, None)
        assert msg == (
            f"FETCH_FD: pid {c.pid} refused allocation {oid.hex()} to pid {os.getpid()} "
            f"(request names pid {os.getpid()}): the request does not carry the allocation's "
            "secret; only holders of its ticket or IPC handle may fetch it"
        )
        assert str(secret) not in msg and f"{secret:x}" not in msg
    rep, msg, got = fetch_fd(cdir, c.pid, oid, secret)
    assert rep.status == Status.OK and got is not None, msg
    os.close(got)
    tfd = i.val(f"getfd {c.pid} {fd}")
    mi = i.val(f"import_fd {tfd}")
    assert mi >> 48 == TAG
    assert ticket_secret(i.pid, tfd) == secret

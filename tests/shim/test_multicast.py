"""Multicast under the shim on fakecuda (issue 3): tracking, refusals, capture order and the
in-place capture/restore cycle through the coordinator (no CRIU here: tests/e2e does that).

Every team member is a vmm_app process on its device 0 (fakecuda's members are (pid, device)
pairs). A value written through the multicast VA by one rank is read back from every rank's own
member mapping (fakecuda refuses reads through a multicast VA).
"""

from __future__ import annotations

import re

import claim_kit
import pytest

from cuinterpose.coordinator.carrierfiles import streams_of
from cuinterpose.coordinator.phases import Coordinator, Participant
from cuinterpose.coordinator.protocol import (
    Op,
    Phase,
    RecordFlag,
    RecordKind,
    Role,
    Status,
    socket_path,
)
from cuinterpose.coordinator.topology import TopologyError

from .conftest import GRAN, POSIX, RW, TAG

NOT_SUPPORTED = 801
TIMEOUT = 909
INVALID_VALUE = 1


def inspect(ctl, app, phase=Phase.ACTIVE):
    resp = ctl(app).request(Op.INSPECT, txn_id=0, expected_phase=phase)
    assert resp.reply.status == Status.OK, resp.message
    assert resp.reply.phase == phase
    return resp.records


def mc_records(records):
    return [
        r
        for r in records
        if r.kind
        in (
            RecordKind.MULTICAST,
            RecordKind.MULTICAST_DEVICE,
            RecordKind.MULTICAST_BINDING,
            RecordKind.MULTICAST_MAPPING,
        )
    ]


def kinds(records, kind):
    return [r for r in records if r.kind == kind]


class Rank:
    """One team member: its own POSIX allocation mapped read-write at ``va``."""

    def __init__(self, app, size=GRAN):
        self.app = app
        self.pid = app.pid
        app.ok("init")
        self.mem = app.val(f"create {size} {POSIX}")
        self.va = app.val(f"reserve {size}")
        app.ok(f"map {self.va} {size} 0 {self.mem}")
        app.ok(f"access {self.va} {size} 0 {RW}")
        self.mc = {}  # object name -> this rank's virtual handle
        self.mcva = {}  # object name -> this rank's multicast VA


def share(creator: Rank, others, name, ndev, size=GRAN):
    """creator creates and exports ``name``; every other rank imports the ticket."""
    h = creator.app.val(f"mc_create {ndev} {size} {POSIX}")
    assert h >> 48 == TAG
    creator.mc[name] = h
    fd = creator.app.val(f"export {h}")
    for r in others:
        r.mc[name] = r.app.val(f"import /proc/{creator.pid}/fd/{fd}")
        assert r.mc[name] >> 48 == TAG


def bind_and_map(r: Rank, name, size=GRAN, mc_off=0, how="mem"):
    h = r.mc[name]
    if how == "mem":
        r.app.ok(f"mc_bindmem {h} {mc_off} {r.mem} 0 {size}")
    elif how == "mem2":
        r.app.ok(f"mc_bindmem2 {h} 0 {mc_off} {r.mem} 0 {size}")
    else:
        r.app.ok(f"mc_bindaddr {h} {mc_off} {r.va} {size}")
    va = r.app.val(f"reserve {size}")
    r.app.ok(f"map {va} {size} {mc_off} {h}")
    r.app.ok(f"access {va} {size} 0 {RW}")
    r.mcva[name] = va


def team_of_two(apps, how=("mem", "mem")):
    """Two ranks, one object "A" created by rank 0, each binds its own allocation."""
    r0, r1 = Rank(apps()), Rank(apps())
    share(r0, [r1], "A", 2)
    r0.app.ok(f"mc_add {r0.mc['A']} 0")
    r1.app.ok(f"mc_add {r1.mc['A']} 0")
    bind_and_map(r0, "A", how=how[0])
    bind_and_map(r1, "A", how=how[1])
    return r0, r1


def broadcast(writer: Rank, name, ranks, value):
    writer.app.ok(f"memset32 {writer.mcva[name]} {value} 4")
    return [r.app.val(f"read32 {r.va}") for r in ranks]


def coordinator(shim_env, ranks):
    ctl = shim_env["CUINTERPOSE_CONTROL_DIR"]
    return Coordinator(
        [Participant(r.pid, socket_path(ctl, r.pid)) for r in ranks],
        timeout_s=30,
        claim=claim_kit.take(ctl, [r.pid for r in ranks]),
    )


def log_index(fake_log, fn, pids=None, pred=None):
    """Line numbers of the successful calls of ``fn`` (by ``pids``) in the fake's call log."""
    out = []
    for n, ln in enumerate(fake_log.lines()):
        m = re.match(r"^(\d+) \d+ (\w+)\((.*)\) = (\w+)$", ln)
        if not m or m.group(2) != fn or m.group(4) != "CUDA_SUCCESS":
            continue
        if pids is not None and int(m.group(1)) not in pids:
            continue
        args = dict(kv.split("=", 1) for kv in m.group(3).split() if "=" in kv)
        if pred is None or pred(int(m.group(1)), args):
            out.append(n)
    return out


# --- tracking -------------------------------------------------------------------------------
def test_inspect_records_the_topology(apps, ctl):
    r0, r1 = team_of_two(apps, how=("mem", "addr"))
    assert broadcast(r0, "A", (r0, r1), 0xA11CE) == [0xA11CE, 0xA11CE]
    recs0, recs1 = inspect(ctl, r0.app), inspect(ctl, r1.app)
    [o0], [o1] = kinds(recs0, RecordKind.MULTICAST), kinds(recs1, RecordKind.MULTICAST)
    assert o0.alloc_id == o1.alloc_id and o0.creator_pid == o1.creator_pid == r0.pid
    assert (
        o0.role,
        o0.flags,
        o0.size,
        o0.offset,
        o0.prop_location_id,
        o0.prop_handle_types,
        o0.handle_refs,
    ) == (Role.CREATOR, RecordFlag.EXPORTED | RecordFlag.SHARED, GRAN, GRAN, 2, POSIX, 1)
    assert (o1.role, o1.flags, o1.size, o1.offset, o1.prop_location_id) == (
        Role.IMPORTER,
        RecordFlag.SHARED,
        GRAN,
        GRAN,
        2,
    )
    for recs, r, flags, va in ((recs0, r0, 0, 0), (recs1, r1, RecordFlag.MC_BY_ADDR, r1.va)):
        [d] = kinds(recs, RecordKind.MULTICAST_DEVICE)
        assert (d.alloc_id, d.prop_location_type, d.prop_location_id) == (o0.alloc_id, 1, 0)
        [b] = kinds(recs, RecordKind.MULTICAST_BINDING)
        [mem] = kinds(recs, RecordKind.ALLOCATION)
        assert (b.prop_location_id, b.offset, b.size, b.va, b.flags) == (0, 0, GRAN, va, flags)
        assert (b.member_alloc_id, b.member_creator_pid, b.member_offset) == (
            mem.alloc_id,
            r.pid,
            0,
        )
        # a bound allocation counts as shared: its creator carries it
        assert (mem.role, mem.flags & RecordFlag.SHARED) == (Role.CREATOR, RecordFlag.SHARED)
        [m] = kinds(recs, RecordKind.MULTICAST_MAPPING)
        assert (m.va, m.size, m.offset, [(a.location_id, a.flags) for a in m.access]) == (
            r.mcva["A"],
            GRAN,
            0,
            [(0, RW)],
        )
    # the record order: object, its devices, bindings, mappings
    assert [r.kind for r in mc_records(recs0)] == [
        RecordKind.MULTICAST,
        RecordKind.MULTICAST_DEVICE,
        RecordKind.MULTICAST_BINDING,
        RecordKind.MULTICAST_MAPPING,
    ]


def test_v2_abi_is_recorded_and_resolved_by_full_name(apps, ctl, fake_log):
    r0, r1 = Rank(apps()), Rank(apps())
    share(r0, [r1], "A", 2)
    r0.app.ok(f"mc_add {r0.mc['A']} 0")
    r1.app.ok(f"mc_add {r1.mc['A']} 0")
    r0.app.ok(f"mc_bindmem2 {r0.mc['A']} 0 0 {r0.mem} 0 {GRAN}")
    r1.app.ok(f"mc_bindmem2_gpa {r1.mc['A']} 0 0 {r1.mem} 0 {GRAN}")
    for r in (r0, r1):
        [b] = kinds(inspect(ctl, r.app), RecordKind.MULTICAST_BINDING)
        assert b.flags == RecordFlag.MC_V2_ABI
    # the driver saw the device-explicit function with the real handles, never a virtual one
    calls = fake_log.calls(fn="cuMulticastBindMem_v2")
    assert [(c[1]["dev"], c[2]) for c in calls] == [("0", "CUDA_SUCCESS")] * 2
    assert all(int(c[1]["mc"]) >> 48 != TAG and int(c[1]["mem"]) >> 48 != TAG for c in calls)
    assert fake_log.calls(fn="cuMulticastBindMem") == []


def test_bind_of_untracked_memory_is_refused_nothing_recorded(apps, ctl, fake_log):
    """Test 5: binding memory the shim does not track into a tracked object is refused at the
    API before the driver sees it; nothing is recorded and the object stays usable."""
    r0 = Rank(apps())
    h = r0.app.val(f"mc_create 1 {GRAN} {POSIX}")
    r0.app.ok(f"mc_add {h} 0")
    before = inspect(ctl, r0.app)
    mark = fake_log.mark()
    # a driver handle the shim never saw (fakecuda handle values start at 0) and an address
    # outside every tracked mapping
    assert r0.app.err(f"mc_bindmem {h} 0 0 0 {GRAN}") == NOT_SUPPORTED
    assert r0.app.err(f"mc_bindmem2 {h} 0 0 5 0 {GRAN}") == NOT_SUPPORTED
    resv = r0.app.val(f"reserve {GRAN}")
    assert r0.app.err(f"mc_bindaddr {h} 0 {resv} {GRAN}") == NOT_SUPPORTED
    assert [c[0] for c in fake_log.calls(since=mark) if c[0].startswith("cuMulticast")] == []
    nores = lambda rs: [r for r in rs if r.kind != RecordKind.RESERVATION]  # noqa: E731
    assert nores(inspect(ctl, r0.app)) == nores(before)
    err = r0.app.stderr()
    assert (
        f"memory handle 0x0 is not a tracked allocation; binding it into multicast object "
        f"{kinds(before, RecordKind.MULTICAST)[0].alloc_id_hex} could not be restored" in err
    )
    # the tracked allocation still binds
    r0.app.ok(f"mc_bindmem {h} 0 {r0.mem} 0 {GRAN}")
    assert len(kinds(inspect(ctl, r0.app), RecordKind.MULTICAST_BINDING)) == 1


def test_passthrough_object_works_and_refuses_capture(apps, ctl, shim_env):
    """Test 6: a handle-type-0 object passes through (single process, two bindings on one
    device is impossible, so one member); INSPECT marks it; the coordinator refuses the capture
    naming the object, and the workload keeps running."""
    r0 = Rank(apps())
    h = r0.app.val(f"mc_create 1 {GRAN} 0")
    assert h >> 48 == TAG
    r0.app.ok(f"mc_add {h} 0")
    r0.app.ok(f"mc_bindmem {h} 0 {r0.mem} 0 {GRAN}")
    va = r0.app.val(f"reserve {GRAN}")
    r0.app.ok(f"map {va} {GRAN} 0 {h}")
    r0.app.ok(f"access {va} {GRAN} 0 {RW}")
    r0.app.ok(f"memset32 {va} 77 4")
    assert r0.app.val(f"read32 {r0.va}") == 77
    [o] = kinds(inspect(ctl, r0.app), RecordKind.MULTICAST)
    assert (o.flags, o.prop_handle_types) == (RecordFlag.PASSTHROUGH, 0)
    assert "a checkpoint of this process will be refused" in r0.app.stderr()
    co = coordinator(shim_env, [r0])
    with pytest.raises(TopologyError) as e:
        co.capture()
    assert str(e.value) == (
        f"pid {r0.pid} multicast object {o.alloc_id_hex} has handle types 0x0; "
        "only exactly CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR can be rebuilt "
        "after a restore, so capture is refused"
    )
    assert (e.value.pid, e.value.alloc_id, e.value.changed) == (r0.pid, o.alloc_id_hex, False)
    assert [p.phase for p in co.phases] == ["INSPECT"]
    # the shim refuses PREPARE_MULTICAST too (defence in depth), nothing changed
    resp = ctl(r0.app).request(Op.PREPARE_MULTICAST, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (resp.reply.status, resp.reply.phase) == (Status.REFUSED_STATE, Phase.ACTIVE)
    assert f"multicast object {o.alloc_id_hex} has handle types 0x0" in resp.message
    # still running
    r0.app.ok(f"memset32 {va} 78 4")
    assert r0.app.val(f"read32 {r0.va}") == 78


def test_fabric_request_passes_through_to_the_driver(apps, ctl):
    r0 = Rank(apps())
    # fakecuda models no FABRIC support: the driver's own answer comes back, nothing recorded
    assert r0.app.err(f"mc_create 1 {GRAN} 8") == NOT_SUPPORTED
    assert mc_records(inspect(ctl, r0.app)) == []


# --- capture order and the in-place cycle -------------------------------------------------------
def test_capture_tears_multicast_down_before_unicast(apps, ctl, shim_env, fake_log):
    """Test 8: from the fake's call log, no unicast mapping is unmapped while a multicast
    binding on it exists (the PREPARE_MULTICAST barrier: every unbind of every process comes
    before the first unicast unmap of any); within each process the multicast VA is unmapped
    before the unbind, and the object is released after the unbind."""
    r0, r1 = team_of_two(apps)
    co = coordinator(shim_env, [r0, r1])
    mark = len(fake_log.lines())
    cap = co.capture()
    assert [p.phase for p in cap.phases] == [
        "INSPECT",
        "PREPARE_MULTICAST",
        "SAVE_ALLOCATIONS",
        "PREPARE_UNICAST",
        "INSPECT",
    ]
    pids = {r0.pid, r1.pid}
    uvas = {hex(r.va) for r in (r0, r1)}
    u_unmaps = [
        n
        for n in log_index(fake_log, "cuMemUnmap", pids, lambda p, a: a["ptr"] in uvas)
        if n >= mark
    ]
    all_unbinds = [n for n in log_index(fake_log, "cuMulticastUnbind", pids) if n >= mark]
    assert (len(u_unmaps), len(all_unbinds)) == (2, 2)
    assert max(all_unbinds) < min(u_unmaps)
    for r in (r0, r1):
        mcva = hex(r.mcva["A"])
        [mc_unmap] = [
            n
            for n in log_index(
                fake_log, "cuMemUnmap", {r.pid}, lambda p, a, mcva=mcva: a["ptr"] == mcva
            )
            if n >= mark
        ]
        [unbind] = [n for n in log_index(fake_log, "cuMulticastUnbind", {r.pid}) if n >= mark]
        releases = [n for n in log_index(fake_log, "cuMemRelease", {r.pid}) if n >= mark]
        assert mc_unmap < unbind < releases[0]
    # every participant was asked every phase; both answered PREPARE_MULTICAST with 3 changes
    pm = cap.phase("PREPARE_MULTICAST")
    assert {pid: p.records_changed for pid, p in pm.participants.items()} == {r0.pid: 3, r1.pid: 3}
    # the multicast objects are gone from the driver: native checkpoint would not be refused
    lines = fake_log.lines()[mark:]
    assert not any("multicast" in ln and "refus" in ln for ln in lines)
    co.restore(cap)
    assert broadcast(r1, "A", (r0, r1), 0xBEEF) == [0xBEEF, 0xBEEF]


def test_in_place_cycle_rebuilds_the_team(apps, ctl, shim_env, fake_log):
    """Test 1 (in place): after capture and restore a value written through the multicast VA
    is read back from both members; INSPECT equals the capture; real handles changed."""
    r0, r1 = team_of_two(apps, how=("mem", "mem2"))
    assert broadcast(r0, "A", (r0, r1), 0x1111) == [0x1111, 0x1111]
    before = {r.pid: inspect(ctl, r.app) for r in (r0, r1)}
    co = coordinator(shim_env, [r0, r1])
    cap = co.capture()
    for r in (r0, r1):
        resp = ctl(r.app).request(Op.INSPECT, txn_id=0, expected_phase=Phase.PREPARED)
        assert resp.reply.phase == Phase.PREPARED
    mark = len(fake_log.lines())
    res = co.restore(cap)
    assert [p.phase for p in res.phases] == [
        "INSPECT",
        "LOAD_ALLOCATIONS",
        "RESTORE_UNICAST",
        "RESTORE_MULTICAST_CREATORS",
        "RESTORE_MULTICAST_IMPORTERS",
        "RESTORE_MULTICAST_DEVICES",
        "RESTORE_MULTICAST_BINDINGS",
        "INSPECT",
    ]
    assert {
        x.phase: {p: y.records_changed for p, y in x.participants.items()} for x in res.phases[3:7]
    } == {
        "RESTORE_MULTICAST_CREATORS": {r0.pid: 1, r1.pid: 0},
        "RESTORE_MULTICAST_IMPORTERS": {r0.pid: 0, r1.pid: 1},
        "RESTORE_MULTICAST_DEVICES": {r0.pid: 1, r1.pid: 1},
        "RESTORE_MULTICAST_BINDINGS": {r0.pid: 2, r1.pid: 2},
    }
    after = {r.pid: inspect(ctl, r.app) for r in (r0, r1)}
    assert {p: mc_records(rs) for p, rs in after.items()} == {
        p: mc_records(rs) for p, rs in before.items()
    }
    # the object was re-created with the requested size, once, by its creator
    creates = [c for c in fake_log.calls(fn="cuMulticastCreate", since=mark)]
    assert [(c[1]["numDevices"], c[1]["size"], c[2]) for c in creates] == [
        ("2", str(GRAN), "CUDA_SUCCESS")
    ]
    # the ABI of each bind is replayed: v1 for rank 0, v2 for rank 1
    assert [c[0] for c in fake_log.calls(fn="cuMulticastBindMem", since=mark)] == [
        "cuMulticastBindMem"
    ]
    assert len(fake_log.calls(fn="cuMulticastBindMem_v2", since=mark)) == 1
    assert broadcast(r1, "A", (r0, r1), 0x2222) == [0x2222, 0x2222]
    assert broadcast(r0, "A", (r0, r1), 0x3333) == [0x3333, 0x3333]
    assert "multicast watchdog" not in "\n".join(fake_log.lines())


def test_reciprocal_objects(apps, ctl, shim_env):
    """Test 2: rank 0 creates A, rank 1 creates B, each imports the other's."""
    r0, r1 = Rank(apps(), 2 * GRAN), Rank(apps(), 2 * GRAN)
    share(r0, [r1], "A", 2)
    share(r1, [r0], "B", 2)
    for r in (r0, r1):
        r.app.ok(f"mc_add {r.mc['A']} 0")
        r.app.ok(f"mc_add {r.mc['B']} 0")
    for r in (r0, r1):
        r.app.ok(f"mc_bindmem {r.mc['A']} 0 {r.mem} 0 {GRAN}")
        r.app.ok(f"mc_bindmem {r.mc['B']} 0 {r.mem} {GRAN} {GRAN}")
        for name in ("A", "B"):
            va = r.app.val(f"reserve {GRAN}")
            r.app.ok(f"map {va} {GRAN} 0 {r.mc[name]}")
            r.app.ok(f"access {va} {GRAN} 0 {RW}")
            r.mcva[name] = va
    before = {r.pid: inspect(ctl, r.app) for r in (r0, r1)}
    roles = {
        r.pid: sorted((o.creator_pid, o.role) for o in kinds(before[r.pid], RecordKind.MULTICAST))
        for r in (r0, r1)
    }
    assert roles == {
        r0.pid: sorted([(r0.pid, Role.CREATOR), (r1.pid, Role.IMPORTER)]),
        r1.pid: sorted([(r0.pid, Role.IMPORTER), (r1.pid, Role.CREATOR)]),
    }
    co = coordinator(shim_env, [r0, r1])
    res = co.restore(co.capture())
    for _name, phase, want in (
        ("A", "RESTORE_MULTICAST_CREATORS", {r0.pid: 1, r1.pid: 1}),
        ("B", "RESTORE_MULTICAST_IMPORTERS", {r0.pid: 1, r1.pid: 1}),
    ):
        assert {p: x.records_changed for p, x in res.phase(phase).participants.items()} == want
    r0.app.ok(f"memset32 {r0.mcva['A']} 0xA 4")
    r1.app.ok(f"memset32 {r1.mcva['B'] + 0} 0xB 4")
    assert [r.app.val(f"read32 {r.va}") for r in (r0, r1)] == [0xA, 0xA]
    assert [r.app.val(f"read32 {r.va + GRAN}") for r in (r0, r1)] == [0xB, 0xB]


def test_rebind_by_address_survives(apps, ctl, shim_env):
    """Test 3: unbind, then rebind by address before the checkpoint; the restored topology has
    the rebind (BindAddr, the address, the same member)."""
    r0, r1 = team_of_two(apps)
    r1.app.ok(f"mc_unbind {r1.mc['A']} 0 0 {GRAN}")
    [b] = kinds(inspect(ctl, r0.app), RecordKind.MULTICAST_BINDING)
    assert kinds(inspect(ctl, r1.app), RecordKind.MULTICAST_BINDING) == []
    r1.app.ok(f"mc_bindaddr {r1.mc['A']} 0 {r1.va} {GRAN}")
    [b1] = kinds(inspect(ctl, r1.app), RecordKind.MULTICAST_BINDING)
    assert (b1.flags, b1.va, b1.member_offset) == (RecordFlag.MC_BY_ADDR, r1.va, 0)
    co = coordinator(shim_env, [r0, r1])
    cap = co.capture()
    res = co.restore(cap)
    [b2] = kinds(res.records[r1.pid], RecordKind.MULTICAST_BINDING)
    assert b2 == b1
    assert broadcast(r0, "A", (r0, r1), 0x5150) == [0x5150, 0x5150]


def test_effective_extent_beyond_requested(apps, ctl, shim_env, fake_log):
    """Test 4: with capacity rounding the ranks bind into the slack beyond the requested size;
    validation passes (extent = largest range reported), restore recreates with the requested
    size and the binding into the slack still works."""
    import os

    env = dict(shim_env)
    env["FAKECUDA_MULTICAST_CAPACITY_ROUNDING"] = str(4 * GRAN)
    r0, r1 = Rank(apps(env)), Rank(apps(env))
    share(r0, [r1], "A", 2, size=GRAN)  # requested GRAN, capacity 4 * GRAN
    for r in (r0, r1):
        r.app.ok(f"mc_add {r.mc['A']} 0")
    for r in (r0, r1):
        r.app.ok(f"mc_bindmem {r.mc['A']} {2 * GRAN} {r.mem} 0 {GRAN}")  # in the slack
        va = r.app.val(f"reserve {GRAN}")
        r.app.ok(f"map {va} {GRAN} {2 * GRAN} {r.mc['A']}")
        r.app.ok(f"access {va} {GRAN} 0 {RW}")
        r.mcva["A"] = va
    [o] = kinds(inspect(ctl, r0.app), RecordKind.MULTICAST)
    assert (o.size, o.offset) == (GRAN, 3 * GRAN)
    co = coordinator(shim_env, [r0, r1])
    mark = len(fake_log.lines())
    res = co.restore(co.capture())
    creates = fake_log.calls(fn="cuMulticastCreate", since=mark)
    assert [(c[1]["size"], c[2]) for c in creates] == [(str(GRAN), "CUDA_SUCCESS")]
    [o2] = kinds(res.records[r0.pid], RecordKind.MULTICAST)
    assert (o2.size, o2.offset) == (GRAN, 3 * GRAN)
    assert broadcast(r1, "A", (r0, r1), 0x51AC) == [0x51AC, 0x51AC]
    del os


def test_missing_barrier_is_caught_by_the_watchdog(apps, ctl, shim_env, fake_log):
    """Test 7: a bind sent to one rank before the other added its device blocks in the driver
    (no shim lock held: the other rank's add-device proceeds afterwards) and the fake's short
    watchdog turns the missing barrier into CUDA_ERROR_TIMEOUT; nothing is recorded. The real
    sequence (the coordinator's DEVICES barrier before BINDINGS) never trips it."""
    env = dict(shim_env)
    env["FAKECUDA_MULTICAST_WATCHDOG_MS"] = "200"
    r0, r1 = Rank(apps(env)), Rank(apps(env))
    share(r0, [r1], "A", 2)
    r0.app.ok(f"mc_add {r0.mc['A']} 0")
    assert r0.app.err(f"mc_bindmem {r0.mc['A']} 0 {r0.mem} 0 {GRAN}") == TIMEOUT
    assert kinds(inspect(ctl, r0.app), RecordKind.MULTICAST_BINDING) == []
    assert (
        "multicast watchdog: cuMulticastBindMem waited 200 ms, but only 1 of 2 devices"
        in "\n".join(fake_log.lines())
    )
    # the shim held no lock while blocked, and counts nothing in flight afterwards
    r1.app.ok(f"mc_add {r1.mc['A']} 0")
    bind_and_map(r0, "A")
    bind_and_map(r1, "A")
    mark = len(fake_log.lines())
    co = coordinator(shim_env, [r0, r1])
    co.restore(co.capture())
    assert not any("watchdog" in ln for ln in fake_log.lines()[mark:])
    assert broadcast(r0, "A", (r0, r1), 7) == [7, 7]


def test_save_from_active_refused_while_multicast_held(apps, ctl):
    r0, r1 = team_of_two(apps)
    [o] = kinds(inspect(ctl, r0.app), RecordKind.MULTICAST)
    resp = ctl(r0.app).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (resp.reply.status, resp.reply.phase) == (Status.REFUSED_STATE, Phase.ACTIVE)
    assert resp.message == (
        f"SAVE_ALLOCATIONS: pid {r0.pid} holds multicast object {o.alloc_id_hex}; "
        "PREPARE_MULTICAST must run first (ACTIVE -> MULTICAST_RELEASED); nothing "
        "was changed"
    )


def test_process_without_multicast_answers_every_op(apps, ctl, shim_env):
    """A participant with no multicast state gets every multicast op and answers OK with
    nothing to do; the phase walks through the multicast phases like its peers'."""
    r0, r1 = team_of_two(apps)
    plain = apps()
    plain.ok("init")
    h = plain.val(f"create {GRAN} {POSIX}")
    co = Coordinator(
        [
            Participant(a.pid, socket_path(shim_env["CUINTERPOSE_CONTROL_DIR"], a.pid))
            for a in (r0.app, r1.app, plain)
        ],
        timeout_s=30,
        claim=claim_kit.take(
            shim_env["CUINTERPOSE_CONTROL_DIR"], [a.pid for a in (r0.app, r1.app, plain)]
        ),
    )
    cap = co.capture()
    res = co.restore(cap)
    for name in ("PREPARE_MULTICAST",):
        p = cap.phase(name).participants[plain.pid]
        assert (p.status, p.phase, p.records_changed) == (Status.OK, Phase.MULTICAST_RELEASED, 0)
    for name, ph in (
        ("RESTORE_UNICAST", Phase.MULTICAST_RELEASED),
        ("RESTORE_MULTICAST_CREATORS", Phase.MULTICAST_CREATED),
        ("RESTORE_MULTICAST_IMPORTERS", Phase.MULTICAST_IMPORTED),
        ("RESTORE_MULTICAST_DEVICES", Phase.MULTICAST_DEVICES),
        ("RESTORE_MULTICAST_BINDINGS", Phase.ACTIVE),
    ):
        p = res.phase(name).participants[plain.pid]
        assert (p.status, p.phase, p.records_changed) == (Status.OK, ph, 0), name
    plain.ok(f"release {h}")


def test_rollback_after_prepare_multicast_rebuilds_multicast(apps, ctl, shim_env):
    """A capture failing after PREPARE_MULTICAST (here: SAVE_ALLOCATIONS refused by one shim,
    simulated by sending it SAVE first out of band) rolls back through the four rebuild ops."""
    r0, r1 = team_of_two(apps)
    co = coordinator(shim_env, [r0, r1])
    records = co.validate()
    co.prepare_multicast()
    # r1 takes SAVE_ALLOCATIONS, r0 does not (as if the phase failed part-way)
    co.carried = streams_of(records)  # the chunk files capture() would name
    co._run_plan({r1.pid: (Op.SAVE_ALLOCATIONS, Phase.MULTICAST_RELEASED)}, changed_before=True)
    rb = co.rollback(records)
    assert rb.found == {r0.pid: "MULTICAST_RELEASED", r1.pid: "SAVED"}
    assert [p.phase for p in rb.phases] == [
        "INSPECT",
        "CANCEL_CAPTURE",
        "RESTORE_MULTICAST_CREATORS",
        "RESTORE_MULTICAST_IMPORTERS",
        "RESTORE_MULTICAST_DEVICES",
        "RESTORE_MULTICAST_BINDINGS",
        "INSPECT",
    ]
    assert sorted(rb.phases[2].participants) == sorted([r0.pid, r1.pid])
    assert broadcast(r1, "A", (r0, r1), 0x0B) == [0x0B, 0x0B]


def test_multicast_calls_wait_while_a_phase_runs(apps, ctl):
    r0, r1 = team_of_two(apps)
    resp = ctl(r0.app).request(Op.PREPARE_MULTICAST, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (resp.reply.status, resp.reply.phase, resp.reply.records_changed) == (
        Status.OK,
        Phase.MULTICAST_RELEASED,
        3,
    )
    NOT_READY = 600
    assert r0.app.err(f"mc_add {r0.mc['A']} 0") == NOT_READY
    assert r0.app.err(f"mc_unbind {r0.mc['A']} 0 0 {GRAN}") == NOT_READY
    assert r0.app.err(f"release {r0.mc['A']}") == NOT_READY


def test_blocked_bind_holds_no_shim_lock(apps, ctl, fake_log):
    """A bind waiting in the driver for the team to complete holds no shim lock: INSPECT of the
    same process answers meanwhile, a phase op is refused (a tracked call is in flight, nothing
    changed), and the peer's add-device completes the team, releasing the bind."""
    import time

    r0, r1 = Rank(apps()), Rank(apps())
    share(r0, [r1], "A", 2)
    r0.app.ok(f"mc_add {r0.mc['A']} 0")
    r0.app.proc.stdin.write(f"mc_bindmem {r0.mc['A']} 0 {r0.mem} 0 {GRAN}\n")
    r0.app.proc.stdin.flush()
    want = f"{r0.pid} {r0.pid} fakecuda: cuMulticastBindMem blocks until every device was added"
    for _ in range(2000):  # until the fake logged the wait (no clock)
        if any(ln.startswith(want) for ln in fake_log.lines()):
            break
        time.sleep(0.005)
    else:
        pytest.fail("the bind never reached the driver's wait")
    assert kinds(inspect(ctl, r0.app), RecordKind.MULTICAST_BINDING) == []
    resp = ctl(r0.app).request(Op.PREPARE_MULTICAST, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (resp.reply.status, resp.reply.phase) == (Status.REFUSED_STATE, Phase.ACTIVE)
    assert resp.message == (
        f"PREPARE_MULTICAST: pid {r0.pid} has 1 tracked driver calls in flight; quiesce first"
    )
    r1.app.ok(f"mc_add {r1.mc['A']} 0")
    assert r0.app.proc.stdout.readline().split() == ["ok"]
    assert len(kinds(inspect(ctl, r0.app), RecordKind.MULTICAST_BINDING)) == 1


def test_retain_on_a_multicast_va_returns_the_virtual_handle(apps, ctl):
    """cuMemRetainAllocationHandle inside a multicast mapping hands out the object's virtual
    handle with one more reference, never the driver's handle; NOT_READY outside ACTIVE."""
    r0, r1 = team_of_two(apps)
    h = r0.app.val(f"retain {r0.mcva['A'] + 4096}")
    assert h == r0.mc["A"]
    [o] = kinds(inspect(ctl, r0.app), RecordKind.MULTICAST)
    assert o.handle_refs == 2
    r0.app.ok(f"release {h}")
    assert kinds(inspect(ctl, r0.app), RecordKind.MULTICAST)[0].handle_refs == 1
    resp = ctl(r0.app).request(Op.PREPARE_MULTICAST, txn_id=1, expected_phase=Phase.ACTIVE)
    assert resp.reply.status == Status.OK
    assert r0.app.err(f"retain {r0.mcva['A']}") == 600  # CUDA_ERROR_NOT_READY

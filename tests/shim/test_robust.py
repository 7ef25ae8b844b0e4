"""Edge cases an application can hit (docs/shim.md section 5): ranges that span
or cut mappings, retains inside mappings, releases while mapped and double releases, tickets
whose creator died or released the allocation, context-less creates, concurrent cuInit, and
control directories the shim cannot use. Every refusal is checked for what it does not do
(no driver call, outputs and records untouched) and for its message (object, phase, pid)."""

from __future__ import annotations

import os
import signal

from cuinterpose.coordinator.protocol import Op, Phase, RecordKind, Role, Status

from .conftest import GRAN, POSIX, RW, TAG

INVALID_VALUE, NOT_SUPPORTED = 1, 801


def inspect(ctl, app, phase=Phase.ACTIVE):
    resp = ctl(app).request(Op.INSPECT, txn_id=0, expected_phase=phase)
    assert resp.reply.status == Status.OK, resp.message
    return resp.records


def kinds(records, kind):
    return [r for r in records if r.kind == kind]


def two_mappings(a, shared=False):
    """Two allocations of 2 granules mapped back to back: A at va, B at va + 2 granules."""
    ha = a.val(f"create {2 * GRAN} {POSIX if shared else 0}")
    hb = a.val(f"create {2 * GRAN} 0")
    va = a.val(f"reserve {4 * GRAN}")
    a.ok(f"map {va} {2 * GRAN} 0 {ha}")
    a.ok(f"map {va + 2 * GRAN} {2 * GRAN} 0 {hb}")
    return ha, hb, va


def test_partial_unmap_spanning_two_mappings_refused_before_driver(apps, ctl, fake_log):
    a = apps()
    a.ok("init")
    ha, hb, va = two_mappings(a)
    a.ok(f"access {va} {4 * GRAN} 0 {RW}")
    a.ok(f"fill {va} {4 * GRAN} 5")
    before = inspect(ctl, a)
    mark = fake_log.mark()
    # the second half of A and the first half of B: no whole mapping
    assert a.err(f"unmap {va + GRAN} {2 * GRAN}") == INVALID_VALUE
    assert fake_log.calls(pid=a.pid, fn="cuMemUnmap", since=mark) == []
    assert inspect(ctl, a) == before
    a.ok(f"check {va} {4 * GRAN} 5")
    err = a.stderr()
    assert (
        f"cuMemUnmap: pid {a.pid} (phase ACTIVE): range {hex(va + GRAN)}+{hex(2 * GRAN)} covers only "
        f"part of the mapping {hex(va)}+{hex(2 * GRAN)} (virtual handle {hex(ha)})" in err
    )
    # both whole mappings in one call: both records go, the allocations with them once released
    a.ok(f"unmap {va} {4 * GRAN}")
    assert kinds(inspect(ctl, a), RecordKind.MAPPING) == []
    a.ok(f"release {ha}")
    a.ok(f"release {hb}")
    assert kinds(inspect(ctl, a), RecordKind.ALLOCATION) == []


def test_set_access_spanning_several_mappings(apps, ctl, fake_log, shim_env):
    a = apps(env={**shim_env, "FAKECUDA_DEVICE_COUNT": "16"})
    a.ok("init")
    ha, hb, va = two_mappings(a)
    a.ok(f"access {va} {4 * GRAN} 0 {RW}")  # one call over two whole mappings
    a.ok(f"access {va} {4 * GRAN} 1 1")
    maps = kinds(inspect(ctl, a), RecordKind.MAPPING)
    assert [(m.va, [(x.location_id, x.flags) for x in m.access]) for m in maps] == [
        (va, [(0, RW), (1, 1)]),
        (va + 2 * GRAN, [(0, RW), (1, 1)]),
    ]
    # all of A and half of B: B's grant could not be replayed, refused before the driver
    mark = fake_log.mark()
    assert a.err(f"access {va} {3 * GRAN} 1 {RW}") == NOT_SUPPORTED
    assert fake_log.calls(pid=a.pid, fn="cuMemSetAccess", since=mark) == []
    assert kinds(inspect(ctl, a), RecordKind.MAPPING) == maps
    assert (
        f"cuMemSetAccess: pid {a.pid} (phase ACTIVE): range {hex(va)}+{hex(3 * GRAN)} covers only part "
        f"of the mapping {hex(va + 2 * GRAN)}+{hex(2 * GRAN)} (virtual handle {hex(hb)})"
        in a.stderr()
    )
    # A has 16 locations (all fakecuda devices); a call spanning A and B adds 17 more: A would
    # have 33, so the whole call is refused before the driver and B gets nothing either
    a.ok(f"access {va} {2 * GRAN} " + " ".join(f"{d} {RW}" for d in range(2, 16)))
    assert len(kinds(inspect(ctl, a), RecordKind.MAPPING)[0].access) == 16
    mark = fake_log.mark()
    assert (
        a.err(f"access {va} {4 * GRAN} " + " ".join(f"{d} {RW}" for d in range(16, 33)))
        == NOT_SUPPORTED
    )
    assert fake_log.calls(pid=a.pid, fn="cuMemSetAccess", since=mark) == []
    assert (
        f"mapping {hex(va)}+{hex(2 * GRAN)} (virtual handle {hex(ha)}) would have 33 access locations, "
        "more than the 32" in a.stderr()
    )
    assert [len(m.access) for m in kinds(inspect(ctl, a), RecordKind.MAPPING)] == [16, 2]


def test_retain_inside_a_mapping_and_with_offset(apps, ctl, fake_log):
    a = apps()
    a.ok("init")
    h = a.val(f"create {4 * GRAN} 0")
    va = a.val(f"reserve {4 * GRAN}")
    a.ok(f"map {va} {2 * GRAN} 0 {h}")
    a.ok(f"map {va + 2 * GRAN} {2 * GRAN} {2 * GRAN} {h}")  # second half at offset 2 granules
    for addr in (va, va + GRAN + 123, va + 2 * GRAN, va + 4 * GRAN - 1):
        assert a.val(f"retain {addr}") == h
    assert fake_log.calls(pid=a.pid, fn="cuMemRetainAllocationHandle") == []
    alloc = kinds(inspect(ctl, a), RecordKind.ALLOCATION)
    assert [x.handle_refs for x in alloc] == [5]
    # one byte past the end is not tracked: the driver answers (not mapped there)
    assert a.err(f"retain {va + 4 * GRAN}") == INVALID_VALUE
    assert len(fake_log.calls(pid=a.pid, fn="cuMemRetainAllocationHandle")) == 1
    for _ in range(4):
        a.ok(f"release {h}")
    assert fake_log.calls(pid=a.pid, fn="cuMemRelease") == []  # references remain
    a.ok(f"release {h}")
    assert [r for _, _, r in fake_log.calls(pid=a.pid, fn="cuMemRelease")] == ["CUDA_SUCCESS"]


def test_release_while_mapped_keeps_memory_until_unmap(apps, ctl, fake_log):
    a = apps()
    a.ok("init")
    h = a.val(f"create {GRAN} 0")
    va = a.val(f"reserve {GRAN}")
    a.ok(f"map {va} {GRAN} 0 {h}")
    a.ok(f"access {va} {GRAN} 0 {RW}")
    a.ok(f"fill {va} {GRAN} 17")
    a.ok(f"release {h}")  # legal while mapped: the memory stays
    assert [r for _, _, r in fake_log.calls(pid=a.pid, fn="cuMemRelease")] == ["CUDA_SUCCESS"]
    a.ok(f"check {va} {GRAN} 17")
    a.ok(f"fill {va} {GRAN} 18")
    a.ok(f"check {va} {GRAN} 18")
    alloc = kinds(inspect(ctl, a), RecordKind.ALLOCATION)
    assert [x.handle_refs for x in alloc] == [0]
    # the released handle cannot be mapped again, and it is not released twice
    va2 = a.val(f"reserve {GRAN}")
    assert a.err(f"map {va2} {GRAN} 0 {h}") == INVALID_VALUE
    assert a.err(f"release {h}") == INVALID_VALUE
    assert len(fake_log.calls(pid=a.pid, fn="cuMemRelease")) == 1
    a.ok(f"unmap {va} {GRAN}")
    assert [r for r in inspect(ctl, a) if r.kind != RecordKind.RESERVATION] == []
    assert a.err(f"release {h}") == INVALID_VALUE  # gone for good; still no driver call
    assert len(fake_log.calls(pid=a.pid, fn="cuMemRelease")) == 1


def test_double_release_is_an_error_not_a_driver_call(apps, ctl, fake_log):
    a = apps()
    a.ok("init")
    h = a.val(f"create {GRAN} 0")
    a.ok(f"release {h}")
    assert a.err(f"release {h}") == INVALID_VALUE
    never = (TAG << 48) | 0xFFFF
    assert a.err(f"release {never}") == INVALID_VALUE
    assert len(fake_log.calls(pid=a.pid, fn="cuMemRelease")) == 1
    err = a.stderr()
    assert (
        f"cuMemRelease: pid {a.pid} (phase ACTIVE): virtual handle {hex(h)} has no references left"
        in err
    )
    assert f"virtual handle {hex(never)} has no references left" in err
    # the shim keeps working
    h2 = a.val(f"create {GRAN} 0")
    assert h2 != h
    a.ok(f"release {h2}")


def held_ticket(creator, fd):
    """Opens the creator's ticket here, so it outlives the creator. Returns a path to it."""
    mine = os.open(f"/proc/{creator.pid}/fd/{fd}", os.O_RDONLY)
    return mine, f"/proc/{os.getpid()}/fd/{mine}"


def test_import_of_ticket_whose_creator_died(apps, ctl, fake_log):
    c, i = apps(), apps()
    c.ok("init")
    i.ok("init")
    h = c.val(f"create {GRAN} {POSIX}")
    fd = c.val(f"export {h}")
    alloc_id = kinds(inspect(ctl, c), RecordKind.ALLOCATION)[0].alloc_id.hex()
    mine, path = held_ticket(c, fd)
    try:
        os.kill(c.pid, signal.SIGKILL)
        c.proc.wait()
        assert i.cmd(f"import_sentinel {path}") == [
            "err",
            str(INVALID_VALUE),
            "0x99",
        ]  # output untouched
    finally:
        os.close(mine)
    assert fake_log.calls(pid=i.pid, fn="cuMemImportFromShareableHandle") == []
    assert inspect(ctl, i) == []
    err = i.stderr()
    assert (
        f"cuMemImportFromShareableHandle: pid {i.pid} (phase ACTIVE): cannot import allocation {alloc_id} "
        f"from creator pid {c.pid}: creator pid {c.pid} is not running" in err
    )


def test_import_of_dead_ticket(apps, ctl, fake_log):
    c, i = apps(), apps()
    c.ok("init")
    i.ok("init")
    h = c.val(f"create {GRAN} {POSIX}")
    va = c.val(f"reserve {GRAN}")
    c.ok(f"map {va} {GRAN} 0 {h}")
    fd = c.val(f"export {h}")
    alloc_id = kinds(inspect(ctl, c), RecordKind.ALLOCATION)[0].alloc_id.hex()
    c.ok(f"release {h}")
    # still mapped: the ticket is alive and imports
    hi = i.val(f"import /proc/{c.pid}/fd/{fd}")
    i.ok(f"release {hi}")
    c.ok(f"unmap {va} {GRAN}")  # last mapping gone: the ticket is dead
    assert i.cmd(f"import_sentinel /proc/{c.pid}/fd/{fd}") == ["err", str(INVALID_VALUE), "0x99"]
    assert len(fake_log.calls(pid=i.pid, fn="cuMemImportFromShareableHandle")) == 1
    assert inspect(ctl, i) == [] and inspect(ctl, c)[0].kind == RecordKind.RESERVATION
    assert (
        f"cuMemImportFromShareableHandle: pid {i.pid} (phase ACTIVE): cannot import allocation {alloc_id} "
        f"from creator pid {c.pid}: dead ticket" in i.stderr()
    )
    # the creator's own dead ticket is refused too, without a driver call
    assert c.cmd(f"import_sentinel /proc/{c.pid}/fd/{fd}") == ["err", str(INVALID_VALUE), "0x99"]
    assert fake_log.calls(pid=c.pid, fn="cuMemImportFromShareableHandle") == []


def test_create_without_current_context_then_share_and_cycle(apps, ctl, fake_log):
    c, i = apps(), apps()
    c.ok("cuinit")  # no context on the creator's thread, ever
    i.ok("init")
    h = c.val(f"create {GRAN} {POSIX}")
    va = c.val(f"reserve {GRAN}")
    c.ok(f"map {va} {GRAN} 0 {h}")
    c.ok(f"access {va} {GRAN} 0 {RW}")
    fd = c.val(f"export {h}")
    hi = i.val(f"import /proc/{c.pid}/fd/{fd}")
    vi = i.val(f"reserve {GRAN}")
    i.ok(f"map {vi} {GRAN} 0 {hi}")
    i.ok(f"access {vi} {GRAN} 0 {RW}")
    i.ok(f"fill {vi} {GRAN} 31")
    for txn, (op, phase) in enumerate(
        [
            (Op.SAVE_ALLOCATIONS, Phase.ACTIVE),
            (Op.PREPARE_UNICAST, Phase.SAVED),
            (Op.LOAD_ALLOCATIONS, Phase.PREPARED),
            (Op.RESTORE_UNICAST, Phase.LOADED),
        ],
        start=1,
    ):
        for p in (c, i):
            r = ctl(p).request(op, txn_id=txn, expected_phase=phase)
            assert r.reply.status == Status.OK, r.message
            if op == Op.SAVE_ALLOCATIONS and p is c:
                assert r.reply.bytes == GRAN
    i.ok(f"check {vi} {GRAN} 31")
    assert [a.role for a in kinds(inspect(ctl, c), RecordKind.ALLOCATION)] == [Role.CREATOR]


def test_cuinit_from_many_threads_starts_one_endpoint(apps, shim_env):
    a = apps()
    a.ok("init_threads 8")
    a.ok("init")
    a.ok("cuinit")
    ctl_dir = shim_env["CUINTERPOSE_CONTROL_DIR"]
    assert [n for n in os.listdir(ctl_dir) if n.startswith(f"cuinterpose-{a.pid}")] == [
        f"cuinterpose-{a.pid}.sock"
    ]
    names = sorted(
        open(f"/proc/{a.pid}/task/{t}/comm").read().strip()
        for t in os.listdir(f"/proc/{a.pid}/task")
    )
    assert names.count("cui-accept") == 1 and names.count("cui-control") == 1
    assert "cuinterpose" not in a.stderr()


def cuda_still_works(a):
    h = a.val(f"create {GRAN} {POSIX}")
    va = a.val(f"reserve {GRAN}")
    a.ok(f"map {va} {GRAN} 0 {h}")
    a.ok(f"access {va} {GRAN} 0 {RW}")
    a.ok(f"fill {va} {GRAN} 4")
    a.ok(f"check {va} {GRAN} 4")
    a.ok(f"export {h}")
    a.ok(f"unmap {va} {GRAN}")
    a.ok(f"release {h}")


def test_control_dir_path_too_long(apps, shim_env, tmp_path):
    env = dict(shim_env)
    long_dir = tmp_path / ("d" * 120)
    env["CUINTERPOSE_CONTROL_DIR"] = str(long_dir)
    a = apps(env=env)
    a.ok("init")
    a.ok("cuinit")
    cuda_still_works(a)
    lines = [ln for ln in a.stderr().splitlines() if "control" in ln]
    assert len(lines) == 1, lines
    assert (
        f"cuinterpose[{a.pid}]: cuInit: pid {a.pid} (phase ACTIVE): control socket path "
        f"{long_dir}/cuinterpose-{a.pid}.sock (CUINTERPOSE_CONTROL_DIR) is longer than a UNIX socket path "
        f"may be (107 bytes); no control endpoint" in lines[0]
    )
    assert not long_dir.exists()  # nothing created for an endpoint that cannot exist


def test_control_dir_unusable(apps, shim_env, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for d, why in (
        (not_a_dir, "Not a directory"),
        ("/proc/self/no-such/ctl", "No such file or directory"),
    ):
        env = dict(shim_env)
        env["CUINTERPOSE_CONTROL_DIR"] = str(d)
        a = apps(env=env)
        a.ok("init")
        a.ok("cuinit")
        cuda_still_works(a)
        lines = [ln for ln in a.stderr().splitlines() if "control" in ln]
        assert len(lines) == 1, lines
        assert (
            f"cuInit: pid {a.pid} (phase ACTIVE): " in lines[0]
            and str(d) in lines[0]
            and why in lines[0]
        )
        assert (
            "no control endpoint: CUDA keeps working, but this process cannot be inspected"
            in lines[0]
        )


def test_create_release_churn_reuses_slots_not_handles(apps, ctl):
    """A long-running process that creates and releases allocations (a caching allocator) keeps
    a bounded state: record slots are reused, virtual handles never are."""
    a = apps()
    a.ok("init")
    a.ok(f"churn 1000 {GRAN}")
    rss0 = a.val("rss")
    last = a.val(f"churn 200000 {GRAN}")
    grown_kb = a.val("rss") - rss0
    assert last == (TAG << 48) | 201000  # every create got a new virtual handle
    assert grown_kb < 4096, f"state grew by {grown_kb} kB over 200000 create/release pairs"
    h = a.val(f"create {GRAN} 0")
    assert h == last + 1
    assert [r.handle_refs for r in inspect(ctl, a)] == [1]
    a.ok(f"release {h}")


def test_import_from_creator_mid_checkpoint_names_its_phase(apps, ctl, fake_log):
    c, i = apps(), apps()
    c.ok("init")
    i.ok("init")
    h = c.val(f"create {GRAN} {POSIX}")
    fd = c.val(f"export {h}")
    mine, path = held_ticket(c, fd)
    try:
        for txn, (op, phase) in enumerate(
            [(Op.SAVE_ALLOCATIONS, Phase.ACTIVE), (Op.PREPARE_UNICAST, Phase.SAVED)], 1
        ):
            assert ctl(c).request(op, txn_id=txn, expected_phase=phase).reply.status == Status.OK
        assert i.cmd(f"import_sentinel {path}") == ["err", str(INVALID_VALUE), "0x99"]
    finally:
        os.close(mine)
    assert fake_log.calls(pid=i.pid, fn="cuMemImportFromShareableHandle") == []
    assert (
        f"from creator pid {c.pid}: creator pid {c.pid} is in phase PREPARED, its exports are closed"
        in i.stderr()
    )


def test_import_of_a_ticket_of_another_kind_or_version(apps, ctl, fake_log):
    import fcntl

    from cuinterpose.coordinator.protocol import CUI_PROTO_VERSION, Ticket, TicketKind

    seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    i = apps()
    i.ok("init")
    v = CUI_PROTO_VERSION
    hexid = bytes(range(16)).hex()
    # a multicast ticket is a multicast import: its creator (pid 1) has no control socket
    for t, what in (
        (
            Ticket(creator_pid=1, alloc_id=bytes(range(16)), size=GRAN, kind=TicketKind.MULTICAST),
            f"cannot import multicast object {hexid} from creator pid 1: ",
        ),
        (
            Ticket(creator_pid=1, alloc_id=bytes(range(16)), size=GRAN, version=99),
            f"ticket for allocation {hexid} of creator pid 1 has version 99 kind 1 (this shim reads "
            f"version {v} kind 1)",
        ),
    ):
        fd = os.memfd_create("ticket", os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, t.pack())
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            assert i.cmd(f"import_sentinel /proc/{os.getpid()}/fd/{fd}") == [
                "err",
                str(INVALID_VALUE),
                "0x99",
            ]
        finally:
            os.close(fd)
        assert f"cuMemImportFromShareableHandle: pid {i.pid} (phase ACTIVE): {what}" in i.stderr()
    assert fake_log.calls(pid=i.pid, fn="cuMemImportFromShareableHandle") == []
    assert inspect(ctl, i) == []

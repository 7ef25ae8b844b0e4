"""Host cuMem (issue 10; docs/shim.md "Host memory"): NCCL's SHM transport (driver >= 12.6)
allocates host memory with cuMemCreate at location CU_MEM_LOCATION_TYPE_HOST_NUMA, shares it as
a POSIX FD and grants access to its GPU and to the CPU. The shim tracks such allocations like
device ones; a shared one is carried (its bytes copied through a staging mapping the current
device may read) and rebuilt at the same VA with the same properties and access list (the host
location's grant included) in the creator and every importer. fakecuda follows cuda.h: HOST
takes no handle types ("not IPC capable"), HOST_NUMA_CURRENT is refused by cuMemCreate; the shim
passes the driver's answers through and records nothing then."""

from __future__ import annotations

from cuinterpose.coordinator.protocol import RecordKind, Role

from .conftest import GRAN, POSIX, RW
from .share_helpers import cycle, inspect, sapps, share_app  # noqa: F401

DEVICE, HOST, HOST_NUMA, HOST_NUMA_CURRENT = 1, 2, 3, 4
SIZE = 2 * GRAN
INVALID_VALUE = 1


def nccl_host_buffer(app, size=SIZE):
    """ncclCuMemHostAlloc's sequence: HOST_NUMA node 0, POSIX FD, map, access for device 0 and
    then for the CPU (two cuMemSetAccess calls). Returns (handle, va)."""
    h = app.val(f"create {size} {POSIX} {HOST_NUMA} 0")
    va = app.val(f"reserve {size}")
    app.ok(f"map {va} {size} 0 {h}")
    app.ok(f"access {va} {size} {DEVICE} 0 {RW}")
    app.ok(f"access {va} {size} {HOST_NUMA} 0 {RW}")
    return h, va


def records(ctl, app, kind):
    return [r for r in inspect(ctl, app) if r.kind == kind]


def test_host_numa_shared_between_two_ranks_survives_a_cycle(sapps, ctl, shim_env, fake_log):  # noqa: F811
    c, i = sapps(), sapps()
    for p in (c, i):
        p.ok("init")
    h, va = nccl_host_buffer(c)
    assert c.ok(f"props {h}") == ["1", str(POSIX), str(HOST_NUMA), "0"]
    c.ok(f"cpu_fill {va} {SIZE} 31")  # the CPU writes through the VA ...
    c.ok(f"check {va} {SIZE} 31")  # ... the device reads the same bytes
    fd = c.val(f"export {h}")
    tfd = i.val(f"getfd {c.pid} {fd}")
    c.ok(f"close {fd}")
    hi = i.val(f"import_fd {tfd}")
    i.ok(f"close {tfd}")
    vi = i.val(f"reserve {SIZE}")
    i.ok(f"map {vi} {SIZE} 0 {hi}")
    i.ok(f"access {vi} {SIZE} {DEVICE} 0 {RW}")
    i.ok(f"access {vi} {SIZE} {HOST_NUMA} 0 {RW}")
    i.ok(f"cpu_check {vi} {SIZE} 31")
    i.ok(f"cpu_fill {vi} {GRAN} 32")
    c.ok(f"cpu_check {va} {GRAN} 32")

    [ca] = records(ctl, c, RecordKind.ALLOCATION)
    assert (ca.role, ca.prop_location_type, ca.prop_location_id, ca.size) == (
        Role.CREATOR,
        HOST_NUMA,
        0,
        SIZE,
    )
    for app, v in ((c, va), (i, vi)):
        [m] = records(ctl, app, RecordKind.MAPPING)
        assert m.va == v
        assert [(x.location_type, x.location_id, x.flags) for x in m.access] == [
            (DEVICE, 0, RW),
            (HOST_NUMA, 0, RW),
        ]

    mark = fake_log.mark()
    cap, _res = cycle(shim_env, (c, i))  # the final INSPECT equals the capture (coordinator)
    [save] = [x for x in cap.phases if x.phase == "SAVE_ALLOCATIONS"]
    assert {p: y.bytes for p, y in save.participants.items()} == {c.pid: SIZE, i.pid: 0}
    # the staging mapping granted the copying device and the host location, in one call
    staging = [
        a
        for _f, a, r in fake_log.calls(pid=c.pid, fn="cuMemSetAccess", since=mark)
        if a.get("ptr") not in (hex(va),)
    ]
    assert staging and all(a.get("count") == "2" for a in staging), staging
    # rebuilt with the same properties; bytes identical; sharing works again both ways
    assert c.ok(f"props {h}") == ["1", str(POSIX), str(HOST_NUMA), "0"]
    # an import: no requested handle types, as the real driver answers (R580)
    assert i.ok(f"props {hi}") == ["1", "0", str(HOST_NUMA), "0"]
    c.ok(f"cpu_check {va} {GRAN} 32")
    i.ok(f"cpu_check {vi} {GRAN} 32")
    i.ok(f"check {vi} {GRAN} 32")
    c.ok(f"cpu_fill {va} {SIZE} 33")
    i.ok(f"cpu_check {vi} {SIZE} 33")


def test_private_host_allocation_is_left_to_native_checkpoint(sapps, ctl, shim_env, fake_log):  # noqa: F811
    """A HOST allocation (no handle types: cuda.h says it is not IPC capable) is tracked as
    PRIVATE: the capture neither copies nor unmaps it."""
    c = sapps()
    c.ok("init")
    h = c.val(f"create {GRAN} 0 {HOST} 0")
    va = c.val(f"reserve {GRAN}")
    c.ok(f"map {va} {GRAN} 0 {h}")
    c.ok(f"access {va} {GRAN} {HOST} 0 {RW}")
    c.ok(f"cpu_fill {va} {GRAN} 41")
    [a] = records(ctl, c, RecordKind.ALLOCATION)
    assert (a.role, a.prop_location_type, a.prop_handle_types) == (Role.PRIVATE, HOST, 0)
    mark = fake_log.mark()
    cap, _res = cycle(shim_env, (c,))
    assert [x.bytes for x in cap.phases if x.phase == "SAVE_ALLOCATIONS"] == [0]
    assert [
        a
        for _f, a, _r in fake_log.calls(pid=c.pid, fn="cuMemUnmap", since=mark)
        if a["ptr"] == hex(va)
    ] == []
    c.ok(f"cpu_check {va} {GRAN} 41")


def test_driver_refusals_of_host_locations_pass_through(sapps, ctl, fake_log):  # noqa: F811
    """HOST with a POSIX handle type and HOST_NUMA_CURRENT are the driver's to refuse
    (cuda.h, cuMemCreate); the shim forwards the call, returns the driver's code and records
    nothing."""
    c = sapps()
    c.ok("init")
    mark = fake_log.mark()
    assert c.err(f"create {GRAN} {POSIX} {HOST} 0") == INVALID_VALUE
    assert c.err(f"create {GRAN} {POSIX} {HOST_NUMA_CURRENT} 0") == INVALID_VALUE
    assert [r for _f, _a, r in fake_log.calls(pid=c.pid, fn="cuMemCreate", since=mark)] == [
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_VALUE",
    ]
    assert records(ctl, c, RecordKind.ALLOCATION) == []

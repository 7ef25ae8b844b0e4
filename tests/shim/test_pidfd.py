"""pidfd importers (issue 10): PyTorch's expandable segments take the exporter's FD with
pidfd_getfd(2) instead of receiving it over a socket. The importer then holds a duplicate of
whatever the exporter's FD number holds, the shim's ticket, sharing its open file description
(and so its file offset). docs/shim.md "pidfd importers": the shim reads a ticket with pread at
offset 0 (the shared offset never moves) and answers FETCH_FD from its export cache, which holds
the real driver FD whatever the app does with its ticket FD."""

from __future__ import annotations

from cuinterpose.coordinator.protocol import RecordFlag, RecordKind, Role

from .conftest import GRAN, POSIX, RW, TAG
from .share_helpers import cycle, inspect, sapps, share_app  # noqa: F401

DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
SIZE = 2 * GRAN


def test_pidfd_getfd_importer_full_cycle(sapps, ctl, shim_env, fake_log):  # noqa: F811
    c, i = sapps(), sapps()
    for p in (c, i):
        p.ok("init")
    c.ok("ptracer")  # Yama: let the importer (same uid) take our FDs
    h = c.val(f"create {SIZE} {POSIX}")
    va = c.val(f"reserve {SIZE}")
    c.ok(f"map {va} {SIZE} 0 {h}")
    c.ok(f"access {va} {SIZE} {DEVICE} 0 {RW}")
    c.ok(f"fill {va} {SIZE} 21")
    fd = c.val(f"export {h}")

    # the importer takes the exporter's FD number; both now share one file offset
    tfd = i.val(f"getfd {c.pid} {fd}")
    assert i.val(f"seek {tfd} 17") == 17
    assert c.val(f"offset {fd}") == 17
    c.ok(f"close {fd}")  # the exporter lets its copy go before anyone imported

    mark = fake_log.mark()
    h1 = i.val(f"import_fd {tfd}")
    h2 = i.val(f"import_fd {tfd}")
    assert h1 >> 48 == TAG and h2 == h1  # one virtual handle, two references
    assert i.val(f"offset {tfd}") == 17  # pread: the shared offset did not move
    imports = fake_log.calls(pid=i.pid, fn="cuMemImportFromShareableHandle", since=mark)
    assert [r for _f, _a, r in imports] == ["CUDA_SUCCESS"]  # one driver import, not two
    i.ok(f"close {tfd}")

    vi = i.val(f"reserve {SIZE}")
    i.ok(f"map {vi} {SIZE} 0 {h1}")
    i.ok(f"access {vi} {SIZE} {DEVICE} 0 {RW}")
    i.ok(f"check {vi} {SIZE} 21")
    i.ok(f"fill {vi} {GRAN} 22")  # bytes both ways
    c.ok(f"check {va} {GRAN} 22")

    [ia] = [r for r in inspect(ctl, i) if r.kind == RecordKind.ALLOCATION]
    [ca] = [r for r in inspect(ctl, c) if r.kind == RecordKind.ALLOCATION]
    assert (ia.role, ia.creator_pid, ia.handle_refs) == (Role.IMPORTER, c.pid, 2)
    assert (ca.role, ca.handle_refs) == (Role.CREATOR, 1)
    assert bytes(ia.alloc_id) == bytes(ca.alloc_id)
    assert ca.flags & RecordFlag.EXPORTED

    cap, res = cycle(shim_env, (c, i))
    saved = [x for x in cap.phases if x.phase == "SAVE_ALLOCATIONS"]
    assert {p: y.bytes for p, y in saved[0].participants.items()} == {c.pid: SIZE, i.pid: 0}
    c.ok(f"check {va} {GRAN} 22")
    i.ok(f"fill {vi} {SIZE} 23")
    c.ok(f"check {va} {SIZE} 23")
    # the two references still work after the restore: two releases, then the handle is gone
    i.ok(f"unmap {vi} {SIZE}")
    i.ok(f"release {h1}")
    i.ok(f"release {h1}")
    assert i.err(f"release {h1}") == 1  # CUDA_ERROR_INVALID_VALUE


def test_ticket_at_nonzero_offset_reads_from_zero(sapps, ctl):  # noqa: F811
    """An exporter whose ticket FD was read past its start (the offset is shared with every
    pidfd_getfd duplicate) still hands out a working ticket: the shim never read()s it."""
    c, i = sapps(), sapps()
    for p in (c, i):
        p.ok("init")
    h = c.val(f"create {GRAN} {POSIX}")
    fd = c.val(f"export {h}")
    assert c.val(f"seek {fd} 64") == 64  # at the end of the 64-byte ticket
    tfd = i.val(f"getfd {c.pid} {fd}")
    hi = i.val(f"import_fd {tfd}")
    assert hi >> 48 == TAG
    assert (i.val(f"offset {tfd}"), c.val(f"offset {fd}")) == (64, 64)
    assert i.ok(f"props {hi}") == ["1", "0", "1", "0"]  # an import: no handle types (R580)

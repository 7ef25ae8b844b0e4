"""capture()/restore() against two real processes under the shim on fakecuda.

The pair stays alive throughout (no CRIU, no native checkpoint): the shim phases tear the
shared memory down to the host carriers and rebuild it, and the bytes and VAs must survive.
"""
from __future__ import annotations

import json

import pytest

from cuinterpose.coordinator.phases import Capture, Coordinator, Participant
from cuinterpose.coordinator.protocol import (RecordFlag, RecordKind, Role, cui_checksum64,
                                              socket_path)

from .pair import CUIPAIR_C, Pair, wait_sockets

K = 4
SIZE = 64 << 10       # FAKECUDA_GRANULARITY below


def pattern(seed: int, idx: int, n: int) -> bytes:
    """cuipair.c's pattern(seed, idx): what the creator wrote into allocation idx."""
    x = (seed * 2654435761 + idx * 40503 + 1) & 0xFFFFFFFF
    out = bytearray(n)
    for i in range(n):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        out[i] = (x >> 16) & 0xFF
    return bytes(out)


@pytest.fixture
def pair_env(fake_env, shim_path):
    env = dict(fake_env)
    env["LD_PRELOAD"] = str(shim_path)
    env["FAKECUDA_GRANULARITY"] = str(SIZE)
    return env


@pytest.fixture(scope="session")
def cuipair(build_c, fakecuda_dir):
    return build_c([CUIPAIR_C], "coordinator_cuipair",
                   libs=(f"-L{fakecuda_dir}", "-l:libcuda.so.1", "-ldl", "-lpthread"))


@pytest.fixture
def pair(cuipair, pair_env):
    p = Pair(cuipair, pair_env, K, SIZE)
    yield p
    p.close()


def _by_kind(records, kind):
    return [r for r in records if r.kind == kind]


def test_capture_and_restore_two_processes(pair, pair_env):
    ctl = pair_env["CUINTERPOSE_CONTROL_DIR"]
    parts = [Participant(pid, socket_path(ctl, pid)) for pid in pair.pids]
    wait_sockets([p.socket_path for p in parts])
    before = pair.sums()
    assert before[0] == before[1]
    cpid, ipid = pair.pids

    events = []
    cap = Coordinator(parts, timeout_s=30, on_event=events.append).capture()

    # records: K creator allocations + K mappings at base + i*SIZE, the importer's mirror
    allocs = _by_kind(cap.records[cpid], RecordKind.ALLOCATION)
    assert [(r.role, r.size, r.creator_pid) for r in allocs] == [(Role.CREATOR, SIZE, cpid)] * K
    assert all(r.flags & RecordFlag.CARRIED and r.carrier_bytes == SIZE for r in allocs)
    # the shim's carrier checksum is protocol.h's cui_checksum64 of the bytes written
    assert [r.carrier_checksum for r in allocs] == \
        [cui_checksum64(pattern(1, i, SIZE)) for i in range(K)]
    maps_c = _by_kind(cap.records[cpid], RecordKind.MAPPING)
    maps_i = _by_kind(cap.records[ipid], RecordKind.MAPPING)
    assert sorted(m.va for m in maps_c) == [pair.creator_base + i * SIZE for i in range(K)]
    assert sorted(m.va for m in maps_i) == [pair.importer_base + i * SIZE for i in range(K)]
    imps = _by_kind(cap.records[ipid], RecordKind.ALLOCATION)
    assert [(r.role, r.creator_pid) for r in imps] == [(Role.IMPORTER, cpid)] * K
    assert {r.alloc_id for r in imps} == {r.alloc_id for r in allocs}

    save = cap.phase("SAVE_ALLOCATIONS")
    assert save.participants[cpid].bytes == K * SIZE
    assert save.participants[ipid].bytes == 0
    assert save.participants[cpid].records_changed == K
    assert len(cap.carriers) == K and cap.carrier_bytes == K * SIZE
    assert [e.kind for e in events].count("phase") == 4

    # the capture survives JSON; a new coordinator restores from it
    back = Capture.from_dict(json.loads(json.dumps(cap.to_dict())))
    res = Coordinator(parts, timeout_s=30).restore(back)
    assert res.phase("LOAD_ALLOCATIONS").participants[cpid].bytes == K * SIZE
    assert [p.phase for p in res.phases] == ["INSPECT", "LOAD_ALLOCATIONS", "RESTORE_UNICAST",
                                             "INSPECT"]
    assert sorted(m.va for m in _by_kind(res.records[ipid], RecordKind.MAPPING)) == \
        [pair.importer_base + i * SIZE for i in range(K)]
    assert sorted(m.va for m in _by_kind(res.records[cpid], RecordKind.MAPPING)) == \
        [pair.creator_base + i * SIZE for i in range(K)]

    # the bytes came back, and the memory is still shared
    assert pair.sums() == before
    pair.importer.cmd("fill 7")
    after = pair.sums()
    assert after[0] == after[1] != before[0]

    # a second cycle works (txn ids keep increasing, carriers re-made)
    cap2 = Coordinator(parts, timeout_s=30).capture()
    Coordinator(parts, timeout_s=30).restore(cap2)
    assert pair.sums() == after

"""capture()/restore() against two real processes under the shim on fakecuda.

The pair stays alive throughout (no CRIU, no native checkpoint): the shim phases tear the
shared memory down to the host carriers and rebuild it, and the bytes and VAs must survive.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time

import claim_kit
import pytest

from cuinterpose.coordinator.carrierfiles import DEFAULT_STAGING_BYTES, streams_of
from cuinterpose.coordinator.phases import Capture, Coordinator, Participant
from cuinterpose.coordinator.protocol import (
    RecordFlag,
    RecordKind,
    Role,
    cui_checksum64,
    socket_path,
)

from .pair import CUIPAIR_C, Pair, wait_sockets

K = 4
SIZE = 64 << 10  # FAKECUDA_GRANULARITY below


def _coord(parts, **kw) -> Coordinator:
    """A coordinator of ``parts`` holding a claim on them, as the agent's does."""
    ctl = str(pathlib.Path(parts[0].socket_path).parent)
    return Coordinator(parts, claim=claim_kit.take(ctl, [p.pid for p in parts]), **kw)


def _setup(pair, pair_env):
    """(control dir, participants) of ``pair``, once both sockets are bound."""
    ctl = pair_env["CUINTERPOSE_CONTROL_DIR"]
    parts = [Participant(pid, socket_path(ctl, pid)) for pid in pair.pids]
    wait_sockets([p.socket_path for p in parts])
    return ctl, parts


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
    return build_c(
        [CUIPAIR_C],
        "coordinator_cuipair",
        libs=(f"-L{fakecuda_dir}", "-l:libcuda.so.1", "-ldl", "-lpthread"),
    )


@pytest.fixture
def pair(cuipair, pair_env):
    p = Pair(cuipair, pair_env, K, SIZE)
    yield p
    p.close()


def _by_kind(records, kind):
    return [r for r in records if r.kind == kind]


def test_capture_and_restore_two_processes(pair, pair_env):
    ctl, parts = _setup(pair, pair_env)
    before = pair.sums()
    assert before[0] == before[1]
    cpid, ipid = pair.pids

    events = []
    cap = _coord(parts, timeout_s=30, on_event=events.append).capture()

    # records: K creator allocations + K mappings at base + i*SIZE, the importer's mirror
    allocs = _by_kind(cap.records[cpid], RecordKind.ALLOCATION)
    assert [(r.role, r.size, r.creator_pid) for r in allocs] == [(Role.CREATOR, SIZE, cpid)] * K
    assert all(r.flags & RecordFlag.CARRIED and r.carrier_bytes == SIZE for r in allocs)
    # each allocation is one chunk file of one chunk (SIZE < 8 MiB) holding the bytes written;
    # the carrier checksum is cui_checksum64 of its BLAKE2b-256 digest (protocol.h "Carriers")
    digests = [hashlib.blake2b(pattern(1, i, SIZE), digest_size=32).digest() for i in range(K)]
    assert sorted(r.carrier_checksum for r in allocs) == sorted(cui_checksum64(d) for d in digests)
    streams = cap.chunks["streams"]
    assert (cap.chunks["chunk_bytes"], cap.chunks["checksum"]) == (8 << 20, "blake2b-256")
    assert sorted(s["checksums"][0] for s in streams) == sorted(d.hex() for d in digests)
    for s in streams:
        data = (pathlib.Path(cap.chunks["directory"]) / s["file"].split("/", 1)[1]).read_bytes()
        assert hashlib.blake2b(data, digest_size=32).hexdigest() == s["checksums"][0]
        assert (s["kind"], s["pid"], s["bytes"], s["zero"], len(data)) == (
            "shared",
            cpid,
            SIZE,
            [],
            SIZE,
        )
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
    # the creator's staging ring was page-locked for its first SAVE (the control worker has no
    # context of its own until the shim makes one current: the H200's 14.4 GB/s pageable copy);
    # the importer carries nothing and starts no ring
    ring = (DEFAULT_STAGING_BYTES // (8 << 20)) * (8 << 20)
    pinned = {
        p: (r.staging_pinned_bytes, r.staging_pin_result) for p, r in save.participants.items()
    }
    assert pinned == {cpid: (ring, 0), ipid: (0, 0)}
    assert save.pageable_staging == {}
    assert len(cap.carriers) == K and cap.carrier_bytes == K * SIZE
    assert [e.phase for e in events if e.kind == "phase"] == [
        "INSPECT",
        "validate",
        "SAVE_ALLOCATIONS",
        "PREPARE_UNICAST",
        "INSPECT",
        "check carriers",
    ]
    assert [s.phase for s in cap.steps] == ["validate", "check carriers"]

    # the capture survives JSON; a new coordinator restores from it
    back = Capture.from_dict(json.loads(json.dumps(cap.to_dict())))
    res = _coord(parts, timeout_s=30).restore(back)
    load = res.phase("LOAD_ALLOCATIONS")
    assert load.participants[cpid].bytes == K * SIZE
    pinned = {
        p: (r.staging_pinned_bytes, r.staging_pin_result) for p, r in load.participants.items()
    }
    assert pinned == {cpid: (ring, 0), ipid: (0, 0)}
    assert [p.phase for p in res.phases] == [
        "INSPECT",
        "LOAD_ALLOCATIONS",
        "RESTORE_UNICAST",
        "INSPECT",
    ]
    assert sorted(m.va for m in _by_kind(res.records[ipid], RecordKind.MAPPING)) == [
        pair.importer_base + i * SIZE for i in range(K)
    ]
    assert sorted(m.va for m in _by_kind(res.records[cpid], RecordKind.MAPPING)) == [
        pair.creator_base + i * SIZE for i in range(K)
    ]

    # the bytes came back, and the memory is still shared
    assert pair.sums() == before
    pair.importer.cmd("fill 7")
    after = pair.sums()
    assert after[0] == after[1] != before[0]

    # a second cycle works (txn ids keep increasing, carriers re-made)
    cap2 = _coord(parts, timeout_s=30).capture()
    _coord(parts, timeout_s=30).restore(cap2)
    assert pair.sums() == after


def test_rollback_mixed_phases_on_real_shims(pair, pair_env):
    """The creator is SAVED (its mappings untouched), the importer already PREPARED (its
    mappings gone): rollback cancels the one and rebuilds the other, concurrently, and the
    memory is shared again with the same bytes and VAs. Then a whole capture is rolled back."""
    from cuinterpose.coordinator.client import ShimClient
    from cuinterpose.coordinator.protocol import Op, Phase, Status

    ctl, parts = _setup(pair, pair_env)
    cpid, ipid = pair.pids
    before = pair.sums()
    coord = _coord(parts, timeout_s=30)
    records = coord.validate(coord.inspect(check_phase=True))
    coord.carried = streams_of(records)  # capture() names the chunk files so
    coord.save_allocations()
    r = ShimClient(socket_path(ctl, ipid), 30, claim=claim_kit.TOKEN).request(
        Op.PREPARE_UNICAST, txn_id=coord.last_txn_id + 1, expected_phase=Phase.SAVED
    )
    assert (r.reply.status, r.reply.phase, r.reply.records_changed) == (
        Status.OK,
        Phase.PREPARED,
        2 * K,
    )
    coord.last_txn_id += 1

    res = coord.rollback(records)
    assert res.found == {cpid: "SAVED", ipid: "PREPARED"}
    assert [(p.phase, sorted(p.participants)) for p in res.phases] == [
        ("INSPECT", sorted(pair.pids)),
        ("CANCEL_CAPTURE+LOAD_ALLOCATIONS", sorted(pair.pids)),
        ("RESTORE_UNICAST", [ipid]),
        ("INSPECT", sorted(pair.pids)),
    ]
    mixed = res.phases[1].participants
    assert (mixed[cpid].records_changed, mixed[ipid].records_changed) == (K, 0)
    assert pair.sums() == before
    pair.importer.cmd("fill 9")  # still one memory: the creator sees it
    after = pair.sums()
    assert after[0] == after[1] != before[0]

    cap = coord.capture()  # everyone PREPARED
    res = coord.rollback(cap)
    assert [p.phase for p in res.phases] == [
        "INSPECT",
        "LOAD_ALLOCATIONS",
        "RESTORE_UNICAST",
        "INSPECT",
    ]
    assert pair.sums() == after
    pair.creator.cmd("fill 10")
    assert pair.sums()[0] == pair.sums()[1] != after[0]


def test_a_creator_stopped_during_save_allocations_fails_it_within_the_phase_timeout(
    pair, pair_env
):
    """SAVE_ALLOCATIONS waits up to the carrier timeout (60 s here), but the creator is
    stopped (SIGSTOP) when the request goes out: the phase fails once it stayed stopped for
    the phase timeout, naming it; continued, the rollback brings both back to ACTIVE with
    the same bytes."""
    import os
    import signal

    from cuinterpose.coordinator.results import PhaseError

    ctl, parts = _setup(pair, pair_env)
    cpid, _ = pair.pids
    before = pair.sums()
    first = _coord(parts, timeout_s=30)
    records = first.validate(first.inspect(check_phase=True))
    # a short phase timeout only for the request that meets the stopped creator
    coord = _coord(parts, timeout_s=0.5, carrier_timeout_s=60)
    coord.txn_floor = first.last_txn_id
    coord.carried = streams_of(records)
    os.kill(cpid, signal.SIGSTOP)
    try:
        with pytest.raises(PhaseError) as ei:
            coord.save_allocations()
    finally:
        os.kill(cpid, signal.SIGCONT)
    assert ei.value.pid == cpid
    assert f"pid {cpid} (socket {socket_path(ctl, cpid)}) is stopped (state T)" in str(ei.value)
    again = _coord(parts, timeout_s=30)  # the deadlines of a release's rollback
    again.txn_floor = coord.last_txn_id
    res = again.rollback(records)
    assert set(res.found.values()) <= {"ACTIVE", "SAVED"}, res.found
    assert pair.sums() == before


def test_a_caller_without_the_claim_is_refused_and_changes_nothing(pair, pair_env):
    """Issue 23 (a same-uid process outside the job tore it down): a coordinator that holds no
    claim, or another holder's token, gets CUI_REFUSED_PEER for every mutating op and the shims
    stay ACTIVE with their bytes, mappings and txn floor untouched; INSPECT stays open. The
    claim's holder then captures and restores as usual, and a dropped claim refuses again."""
    import secrets

    from cuinterpose.coordinator.claim import Claim, ClaimError, read_claim
    from cuinterpose.coordinator.client import ShimClient
    from cuinterpose.coordinator.protocol import Op, Phase, Status, claim_path
    from cuinterpose.coordinator.results import PhaseError

    ctl, parts = _setup(pair, pair_env)
    cpid, ipid = pair.pids
    before = pair.sums()
    stray = Coordinator(parts, timeout_s=30)
    records_before = stray.inspect(check_phase=True)  # INSPECT needs no claim
    for claim in (None, Claim(ctl, list(pair.pids), secrets.token_bytes(16))):
        # no claim file at all, then a claim file whose token the stray does not carry
        if claim is not None:
            owner = claim_kit.take(ctl, pair.pids)
        stray = Coordinator(parts, timeout_s=30, claim=claim)
        with pytest.raises(PhaseError) as e:
            stray.capture()
        assert e.value.phase == "SAVE_ALLOCATIONS" and e.value.changed is False
        for p in e.value.failures:
            assert (p.status, p.phase) == (Status.REFUSED_PEER, Phase.ACTIVE)
            why = (
                "no such file: no checkpoint holds this process"
                if claim is None
                else "the request does not carry the token of the claim held by"
            )
            assert p.message.startswith(
                f"SAVE_ALLOCATIONS: pid {p.pid} refused the request of pid {os.getpid()} "
                f"(it names pid {os.getpid()}): {claim_path(ctl, p.pid)}: {why}"
            ), p.message
            assert claim_kit.TOKEN.hex() not in p.message
        # every other mutating op too, whatever phase it names
        for op, phase in ((Op.PREPARE_UNICAST, Phase.SAVED), (Op.CANCEL_CAPTURE, Phase.SAVED)):
            r = ShimClient(socket_path(ctl, ipid), 30).request(
                op, txn_id=2**60, expected_phase=phase
            )
            assert (r.reply.status, r.reply.phase) == (Status.REFUSED_PEER, Phase.ACTIVE)
        assert stray.inspect(check_phase=True) == records_before
        assert pair.sums() == before
    # the holder's token is accepted (txn ids above the refused 2**60 were never consumed)
    assert read_claim(claim_path(ctl, cpid))[1:] == (os.getpid(), "test")
    coord = Coordinator(parts, timeout_s=30, claim=owner)
    cap = coord.capture()
    coord.restore(cap)
    assert pair.sums() == before
    # a second holder cannot take a claim a live one holds; a dropped claim refuses again
    with pytest.raises(ClaimError, match=f"pid {cpid} is claimed by test pid {os.getpid()}"):
        _take_from_child(ctl, cpid)
    owner.drop()
    assert not os.path.exists(claim_path(ctl, cpid))
    with pytest.raises(PhaseError, match="no checkpoint holds this process"):
        Coordinator(parts, timeout_s=30, claim=owner).capture()
    assert pair.sums() == before


def _take_from_child(ctl: str, pid: int):
    """``Claim.take`` of ``pid`` in a forked child (another holder pid); re-raises its
    ClaimError here."""
    import pickle

    from cuinterpose.coordinator.claim import Claim, ClaimError

    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        try:
            Claim.take(ctl, [pid], kind="checkpoint")
            out = None
        except ClaimError as e:
            out = str(e)
        os.write(w, pickle.dumps(out))
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = pickle.loads(f.read())
    os.waitpid(child, 0)
    if out is not None:
        raise ClaimError(out, pid=pid, path="")


@pytest.fixture
def held_pair(cuipair, pair_env, tmp_path):
    """A pair whose driver holds a cuMemcpyHtoDAsync_v2 (LOAD_ALLOCATIONS's copy) while
    ``HOLD/hold`` exists (FAKECUDA_HOLD, docs/fakecuda.md): (pair, HOLD)."""
    hold = tmp_path / "hold"
    hold.mkdir()
    p = Pair(cuipair, dict(pair_env, FAKECUDA_HOLD=f"cuMemcpyHtoDAsync_v2:{hold}"), K, SIZE)
    yield p, hold
    (hold / "hold").unlink(missing_ok=True)
    p.close()


def test_a_rollback_that_lost_its_load_reply_waits_for_the_shim_and_finishes(
    held_pair, pair_env, monkeypatch
):
    """Issue 23, case 006 one level deeper: the rollback's LOAD_ALLOCATIONS reply is lost
    (CUINTERPOSE_TEST_DROP_REPLY) while the creator is still loading (held in its copy). A LOAD
    sent meanwhile gets BUSY (not "Broken pipe"), INSPECT says an op runs (OP_RUNNING) and the
    phase is still PREPARED; the rollback waits for the shim's own answer (a "wait" event) for
    as long as the shim works, then re-plans from LOADED and finishes: bytes and VAs back."""
    import threading

    from cuinterpose.coordinator.carrierfiles import CarrierFiles
    from cuinterpose.coordinator.client import ShimClient
    from cuinterpose.coordinator.protocol import Op, Phase, ShimFlag, Status
    from cuinterpose.workloads.afdwin import demo

    pair, hold = held_pair
    ctl, parts = _setup(pair, pair_env)
    cpid, ipid = pair.pids
    before = pair.sums()
    coord = _coord(parts, timeout_s=30)
    cap = coord.capture()
    (hold / "hold").touch()
    monkeypatch.setenv("CUINTERPOSE_TEST_DROP_REPLY", f"LOAD_ALLOCATIONS@{cpid}")
    waited = threading.Event()
    coord.on_event = lambda ev: ev.kind == "wait" and ev.pid == cpid and waited.set()
    out: dict = {}

    def roll():
        try:
            out["result"] = coord.rollback(cap)
        except Exception as e:  # noqa: BLE001 - the test reports it
            out["error"] = e

    t = threading.Thread(target=roll)
    t.start()
    try:
        deadline = time.monotonic() + demo.HANG_S  # catches a hang only
        while not (hold / "held").exists():
            assert t.is_alive() and time.monotonic() < deadline, out
            time.sleep(0.01)
        files = coord.carrier_files().request(Op.LOAD_ALLOCATIONS, cpid, coord.carried[cpid])
        try:
            busy = ShimClient(socket_path(ctl, cpid), 30, claim=claim_kit.TOKEN).request(
                Op.LOAD_ALLOCATIONS,
                txn_id=coord.last_txn_id + 1000,
                expected_phase=Phase.PREPARED,
                timeout_s=0.2,  # the last BUSY reply comes back at this deadline
                carriers=files,
            )
        finally:
            CarrierFiles.close(files)
        assert (busy.status, busy.reply.phase) == (Status.BUSY, Phase.PREPARED), busy.message
        seen = ShimClient(socket_path(ctl, cpid), 30).request(
            Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE
        )
        assert seen.reply.phase == Phase.PREPARED
        assert seen.reply.shim_flags & ShimFlag.OP_RUNNING
        while not waited.is_set():  # the rollback waits for the shim (or gave up: a failure)
            assert t.is_alive() and time.monotonic() < deadline, out
            time.sleep(0.01)
        assert t.is_alive()  # the shim is still held: the rollback cannot have finished
    finally:
        (hold / "hold").unlink(missing_ok=True)
        t.join(demo.HANG_S)
    assert "error" not in out, out["error"]
    rb = out["result"]
    assert rb.found == {cpid: "PREPARED", ipid: "PREPARED"}
    assert [(p.phase, sorted(p.participants)) for p in rb.phases] == [
        ("INSPECT", sorted(pair.pids)),
        ("LOAD_ALLOCATIONS", sorted(pair.pids)),  # the creator's reply lost
        ("INSPECT", sorted(pair.pids)),  # OP_RUNNING: waited, then again
        ("INSPECT", sorted(pair.pids)),  # both LOADED: the held LOAD answered meanwhile
        ("RESTORE_UNICAST", sorted(pair.pids)),
        ("INSPECT", sorted(pair.pids)),
    ]
    assert pair.sums() == before

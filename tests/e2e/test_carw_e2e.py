"""carw (custom all-reduce over legacy CUDA IPC) under the shim on fakecuda: checkpointed
mid-stream with the agent and real CRIU, killed by the dump, restored, finished exact (sums,
steps 1..N once each, VAs and the device-side pointer table identical). Real agent CLI."""

from __future__ import annotations

import json
import pathlib
import signal
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "carw"))
from carw_kit import Carw, check_finished  # noqa: E402

from cuinterpose.coordinator.protocol import chunk_digest, cui_checksum64  # noqa: E402
from cuinterpose.workloads.afdwin import demo  # noqa: E402
from cuinterpose.workloads.carw import layout as L  # noqa: E402

STEPS = 24
HOLD = 9
ELEMS = 64  # carw_kit.Carw's default
GRANULARITY = 2 << 20  # fakecuda's cuMemCreate granularity: the carriers' size (the adapter
#                        rounds cuMemAlloc up to it)


def cut_bytes(rank: int, step: int) -> list[bytes]:
    """The exact bytes of ``rank``'s data and signal allocations when every rank parked after
    ``step``: slot ``step % 2`` holds step, the other step - 1; the signal says ``step``."""
    data = bytearray(GRANULARITY)
    for s in (step - 1, step):
        off = L.slot_offset(s, ELEMS)
        data[off : off + L.slot_bytes(ELEMS)] = L.encode_slot(rank, s, ELEMS)
    return [bytes(data), L.encode_signal(step).ljust(GRANULARITY, b"\0")]


@pytest.fixture
def carw(tmp_path, criu_ok, subreaper):
    runs = []

    def _start(**kw):
        r = Carw(tmp_path / f"run{len(runs)}", **kw).start()
        runs.append(r)
        return r

    yield _start
    for r in runs:
        r.kill()


@pytest.mark.parametrize(
    "share,ranks",
    [("ipc", 2), ("ipc", 4), ("pidfd", 2), ("host", 2)],
    ids=["ipc-2", "ipc-4", "pidfd-2", "host-2"],
)
def test_carw_checkpoint_kill_restore_finish(carw, tmp_path, share, ranks):
    """``ipc``: the custom all-reduce; ``pidfd``: PyTorch's expandable-segment export, FDs
    taken with pidfd_getfd; ``host``: NCCL's SHM on host (HOST_NUMA) cuMem, read and written
    by the CPU."""
    run = carw(ranks=ranks, steps=STEPS, hold_at=(HOLD,), share=share)
    run.wait_hold(HOLD)  # every rank completed step HOLD; HOLD + 1 waits for the checkpoint
    pids = run.rank_pids()
    snap = tmp_path / "snap"
    rc, cp = run.checkpoint(snap)
    assert rc == 0 and cp["ok"], cp
    assert run.wait_dumped() == -signal.SIGKILL
    q = run.of("quiesced")
    assert [(e["step"], sorted(r["pid"] for r in e["ranks"])) for e in q] == [(HOLD, pids)]
    assert {r["step"] for r in q[0]["ranks"]} == {HOLD}
    assert run.of("summary") == [] and run.of("done") == []  # cut mid-stream
    m = json.loads((snap / "manifest.json").read_text())
    assert m["roots"] == [run.pid] and m["cuda_pids"] == pids
    # each rank creates its data and signal ranges, imports every peer's, keeps its table private
    assert [p["roles"] for p in m["participants"]] == [
        {"creator": 2, "importer": 2 * (ranks - 1), "private": 1}
    ] * ranks
    # each carrier is one chunk file of one chunk (GRANULARITY < chunk_bytes): its checksum is
    # cui_checksum64 of the chunk digest of the bytes (protocol.h "Carriers"; the node's
    # checksum, decisions D36), and the file under chunks/ holds exactly the bytes
    digest = {}
    for rank, pid in enumerate(pids):
        for blob in cut_bytes(rank, HOLD):
            d = chunk_digest(m["chunks"]["checksum"], blob)
            digest[(pid, d.hex())] = blob
    assert sorted((c["pid"], c["bytes"], c["checksum"]) for c in m["carriers"]) == sorted(
        (pid, GRANULARITY, f"{cui_checksum64(bytes.fromhex(d)):016x}") for pid, d in digest
    )
    assert sorted((s["pid"], s["checksums"][0]) for s in m["chunks"]["streams"]) == sorted(digest)
    for s in m["chunks"]["streams"]:
        assert (snap / s["file"]).read_bytes() == digest[(s["pid"], s["checksums"][0])]

    rc, rs = demo.run_agent("restore", "--images-dir", str(snap), "--driver", "fake")
    assert rc == 0 and rs["ok"], rs
    assert rs["cuda_pids"] == pids
    assert run.wait_exit() in (0, None), run.stderr_tail()
    s = check_finished(run, restores=1)
    assert s["quiesces"] == 1
    assert [(e["step"], e["restored"]) for e in run.of("resumed")] == [(HOLD, True)]


def test_carw_two_cuts(carw, tmp_path):
    """Checkpointed, killed and restored twice (the second time from the restored tree): the
    IPC adapter's imports come back at the same VAs both times."""
    holds = (6, 15)
    run = carw(ranks=2, steps=STEPS, hold_at=holds)
    for k, hold in enumerate(holds, 1):
        run.wait_hold(hold)
        pids = run.rank_pids()
        rc, cp = run.checkpoint(tmp_path / f"snap{k}")
        assert rc == 0 and cp["ok"], cp
        assert run.wait_dumped() in (-signal.SIGKILL, None)
        assert [e["step"] for e in run.of("quiesced")] == list(holds[:k])
        rc, rs = demo.run_agent(
            "restore", "--images-dir", str(tmp_path / f"snap{k}"), "--driver", "fake"
        )
        assert rc == 0 and rs["ok"], rs
        assert rs["cuda_pids"] == pids
    assert run.wait_exit() in (0, None), run.stderr_tail()
    s = check_finished(run, restores=2)
    assert s["quiesces"] == 2
    assert [(e["step"], e["restored"]) for e in run.of("resumed")] == [(6, True), (15, True)]


def test_carw_without_the_adapter_is_refused_and_keeps_running(carw, tmp_path):
    """CUINTERPOSE_IPC_ADAPTER=off: carw's cuMemAlloc and cuIpc* pass through to the driver,
    which cannot carry IPC memory; INSPECT refuses before anything is torn down, naming the pid
    and the pointer, and the workload, resumed, finishes exact with no restore."""
    run = carw(ranks=2, steps=STEPS, hold_at=(HOLD,), env={"CUINTERPOSE_IPC_ADAPTER": "off"})
    run.wait_hold(HOLD)
    pids = run.rank_pids()
    va = {e["pid"]: e["data_va"] for e in run.of("vas")}
    rc, cp = run.checkpoint(tmp_path / "snap")
    assert rc != 0 and cp["ok"] is False, cp
    why = (
        f"exported pointer {va[pids[0]]:#x} (and 3 more driver IPC handles) through the driver's "
        "cuIpcGetMemHandle (memory not allocated under the IPC adapter); native checkpoint "
        "cannot carry IPC memory: "
        "free it, or allocate it with CUINTERPOSE_IPC_ADAPTER covering its size (refused: "
        f"REFUSED_STATE); nothing was changed (and 1 more: pids {pids[1]})"
    )
    e = cp["error"]
    assert (e["phase"], e["pid"], e["outcome"], e["reason"]) == ("INSPECT", pids[0], "refused", why)
    assert e["message"] == f"INSPECT: pid {pids[0]} {why}"
    assert run.wait_exit() == 0, run.stderr_tail()
    check_finished(run, restores=0)
    assert [(r["step"], r["restored"], r["cancelled"]) for r in run.of("resumed")] == [
        (HOLD, False, True)
    ]

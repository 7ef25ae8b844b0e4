"""Peer access under the IPC adapter (docs/shim.md "IPC adapter", peer access; issue 24): one
process, two devices. cuCtxEnablePeerAccess from device 1's context makes device 0's cudaMalloc
buffers, existing and later ones, accessible to device 1 (the driver's rule for legacy memory),
and cuCtxDisablePeerAccess takes it back: the same program gives the same answers with the shim
(adapter memory is VMM memory, granted per device) and without it (legacy memory). A grant is
recorded in the mapping's access list and replayed when the allocation is carried across a
checkpoint. Processes are ``fcshare`` (share_kit.py), plain and under ASan/UBSan."""

from __future__ import annotations

from cuinterpose.coordinator.protocol import Op, Phase, RecordKind

from .conftest import RW
from .share_kit import CudaError, checkpoint_cycle, fcshare_shim_exe, share_procs  # noqa: F401

DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
PROGRAM = """
init 0 => ctx0
malloc 4096 => buf
write $buf 5
ctx 1 => ctx1
stream
canpeer 1 0
peerdis $ctx0
peeren $ctx0 1
peeren $ctx0
peeren $ctx0
writeval 0 $buf 7
sync 0
read $buf
ctx 0
malloc 4096 => later
ctx 1
writeval 0 $later 8
sync 0
read $later
ctx 0
read $buf
read $later
ctx 1
peerdis $ctx0
peerdis $ctx0
writeval 0 $buf 9
sync 0
"""


def run_program(p) -> list[str]:
    """Each line's answer: the CUresult name, and the values that are not pointers."""
    names, out = {}, []
    for line in PROGRAM.strip().splitlines():
        cmd, _, bind = line.partition(" => ")
        for k, v in names.items():
            cmd = cmd.replace(f"${k}", v)
        try:
            words = p.cmd(cmd)
        except CudaError as e:
            out.append(f"{line}: {e.name}")
            continue
        if bind:
            names[bind] = words[0]
            words = []
        values = [w for w in words if not w.startswith("0x")]  # pointers differ from run to run
        out.append(f"{line}: CUDA_SUCCESS {' '.join(values)}".rstrip())
    return out


def test_two_devices_same_answers_with_and_without_the_shim(share_procs):  # noqa: F811
    without = run_program(share_procs(shim=False))
    with_shim = run_program(share_procs())
    assert with_shim == without
    assert without[-1] == "sync 0: CUDA_ERROR_ILLEGAL_ADDRESS"  # revoked: device 1's write faults
    assert (
        "read $later: CUDA_SUCCESS 8" in without
        and "peeren $ctx0: CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED" in without
    )


def _access(ctl, pid, va):
    recs = ctl(pid).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
    (m,) = [r for r in recs if r.kind == RecordKind.MAPPING and r.va == va]
    return sorted(
        (a.location_id, a.flags) for a in m.access[: m.access_count] if a.location_type == DEVICE
    )


def test_grant_is_recorded_and_replayed(share_procs, shim_env, ctl):  # noqa: F811
    a = share_procs()
    c = share_procs(shim=False)
    c.cmd("init 0")
    ctx0 = a.hex("init 0")
    buf = a.hex("malloc 4096")
    a.cmd(f"memget {buf}")  # shared: the shim carries it (SAVE/LOAD) across the checkpoint
    a.cmd(f"write {buf} 5")
    a.cmd("ctx 1")
    s1 = int(a.cmd("stream")[0])
    a.cmd(f"peeren {ctx0}")
    assert _access(ctl, a.pid, buf) == [(0, RW), (1, RW)]
    checkpoint_cycle(shim_env, [a], c)
    assert _access(ctl, a.pid, buf) == [(0, RW), (1, RW)]
    a.cmd(f"writeval {s1} {buf} 6")  # device 1 still writes the re-created allocation
    a.cmd(f"sync {s1}")
    assert a.cmd(f"read {buf}") == ["6"]
    a.cmd(f"peerdis {ctx0}")
    assert _access(ctl, a.pid, buf) == [(0, RW), (1, 0)]

"""What the shim cannot carry is refused with an exact message (docs/shim.md "What real stacks
share"; issue 24): stream-ordered pool IPC makes INSPECT refuse in the exporter and in the
importer, naming pid, pool or pointer, and a refused capture leaves everything running; FABRIC
requests answer CUDA_ERROR_NOT_SUPPORTED (the code NCCL, PyTorch and vLLM fall back on) with one
line at the 1st, 10th, 100th ... refusal. Processes are ``fcshare`` (share_kit.py), plain and
under ASan/UBSan."""

from __future__ import annotations

import socket

import pytest

from cuinterpose.coordinator.errors import CoordinatorError
from cuinterpose.coordinator.phases import Coordinator, Participant
from cuinterpose.coordinator.protocol import Op, Phase, Status, socket_path

from .conftest import FABRIC, GRAN, POSIX
from .share_kit import fcshare_shim_exe, share_procs  # noqa: F401


def _inspect(ctl, p):
    return ctl(p.pid).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)


POOL_WHY = (
    "memory shared through stream-ordered pool IPC is not tracked by cuinterpose and native checkpoint "
    "cannot carry a pool shared between processes; nothing was changed: share it with cuMemCreate and POSIX "
    "file descriptors, or cudaMalloc and CUDA IPC"
)


def test_pool_ipc_refused_at_inspect(share_procs, ctl, shim_env):  # noqa: F811
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = share_procs(sa.fileno()), share_procs(sb.fileno())
    sa.close()
    sb.close()
    for p in (a, b):
        p.cmd("init 0")
    pool = a.hex(f"poolcreate 0 1 {GRAN}")
    s = int(a.cmd("stream")[0])
    ptr = a.hex(f"poolalloc {pool} 4096 {s}")
    a.cmd(f"write {ptr} 4242")
    assert _inspect(ctl, a).reply.status == Status.OK  # a pool is fine until it is shared
    fd = int(a.cmd(f"poolexport {pool}")[0])
    r = _inspect(ctl, a)
    assert r.reply.status == Status.REFUSED_STATE
    assert r.message == (
        f"INSPECT: pid {a.pid} exported memory pool 0x{pool:x} (cuMemPoolExportToShareableHandle): {POOL_WHY}"
    )
    a.cmd(f"sendfd {fd}")
    a.cmd(f"ptrsend {ptr}")
    bpool = b.hex(f"poolimport {int(b.cmd('recvfd')[0])}")
    bptr = b.hex(f"ptrrecv {bpool}")
    assert b.cmd(f"read {bptr}") == ["4242"]
    r = _inspect(ctl, b)
    assert r.reply.status == Status.REFUSED_STATE
    assert r.message == (
        f"INSPECT: pid {b.pid} imported memory pool 0x{bpool:x} (cuMemPoolImportFromShareableHandle), and more "
        f"pool IPC calls: {POOL_WHY}"
    )
    # the coordinator's capture stops at INSPECT: nothing changes, both keep running
    ctl_dir = shim_env["CUINTERPOSE_CONTROL_DIR"]
    co = Coordinator(
        [Participant(p.pid, socket_path(ctl_dir, p.pid)) for p in (a, b)], timeout_s=30
    )
    with pytest.raises(CoordinatorError) as ei:
        co.capture()
    assert f"pid {a.pid} exported memory pool" in str(ei.value)
    assert ei.value.changed is False
    b.cmd(f"write {bptr + 4} 17")
    assert a.cmd(f"read {ptr + 4}") == ["17"]
    assert _inspect(ctl, a).reply.phase == Phase.ACTIVE


def _fabric_lines(p, api):
    return [ln for ln in p.stderr().splitlines() if f": {api}: " in ln and "FABRIC" in ln]


def test_fabric_refusals_say_one_line_rate_limited(share_procs):  # noqa: F811
    a = share_procs()
    a.cmd("init 0")
    for _ in range(12):
        assert a.err(f"vmmtypes {GRAN} {FABRIC | POSIX}") == "CUDA_ERROR_NOT_SUPPORTED"
    lines = _fabric_lines(a, "cuMemCreate")
    want = (
        f"cuinterpose[{a.pid}]: cuMemCreate: pid {a.pid} (phase ACTIVE): requested handle types 0x9: FABRIC "
        "handles cannot be rebuilt after a restore, so the shim refuses them with CUDA_ERROR_NOT_SUPPORTED; "
        "NCCL, PyTorch (expandable segments, symmetric memory) and vLLM fall back to POSIX file descriptors "
        "on that answer (refusal {n} of this call; the next line at refusal {m})"
    )
    assert lines == [want.format(n=1, m=10), want.format(n=10, m=100)]
    assert a.err("importfabric") == "CUDA_ERROR_NOT_SUPPORTED"
    assert len(_fabric_lines(a, "cuMemImportFromShareableHandle")) == 1
    assert "import of a FABRIC handle: FABRIC handles cannot be rebuilt" in a.stderr()
    a.cmd(f"vmmtypes {GRAN} {POSIX}")  # the fallback works

"""Custom storage (cuda.h 13.4+, ``customStorageInfo_out`` and ``cuCheckpointOperationComplete``)
on fakecuda: one fcpeer is the target, another the controller. States (LOCKED -> CHECKPOINTING
-> CHECKPOINTED, CHECKPOINTED -> RESTORING -> LOCKED), the documented errors, the bytes of each
GPU's stream (VMM allocations then cuMemAlloc buffers, contiguous), the target's memfds gone at
complete, and abandoned operations (the controller killed before complete)."""

from __future__ import annotations

import os
import struct
import subprocess

from fakecuda_helpers import GRAN

RUNNING, LOCKED, CHECKPOINTED, FAILED, CHECKPOINTING, RESTORING = range(6)
RW = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
MALLOC = 8192  # cuMemAlloc bytes (two pages, whole pages in the stream)


def state(ctl, pid) -> int:
    return int(ctl.cmd(f"state {pid}")[0])


def vmm(t, dev: int, value: int, devices=(0, 1)) -> int:
    """A GRAN-byte allocation on `dev`, mapped RW for `devices`, filled with `value` (u32)."""
    h = t.cmd(f"create {GRAN} 0 {dev}")[0]
    va = int(t.cmd(f"reserve {GRAN} 0")[0], 16)
    t.cmd(f"map {va} {GRAN} {h}")
    for d in devices:
        t.cmd(f"access {va} {GRAN} {d} {RW}")
    t.cmd(f"memset32 {va} {value} {GRAN // 4}")
    return va


def target_with_memory(peer):
    """A target holding 0x11111111 (VMM, GPU 0), 0x22222222 (cuMemAlloc, GPU 0), 0x33333333
    (VMM, GPU 1). Returns (peer, va0, dm, va1)."""
    t = peer()
    t.cmd("init 0")
    va0 = vmm(t, 0, 0x11111111)
    dm = int(t.cmd(f"malloc {MALLOC}")[0], 16)
    t.cmd(f"memset32 {dm} {0x22222222} {MALLOC // 4}")
    va1 = vmm(t, 1, 0x33333333)
    return t, va0, dm, va1


def controller(peer, devices=(0, 1)):
    c = peer()
    for d in devices:
        c.cmd(f"init {d}")  # cuInit, cuDevicePrimaryCtxRetain(d)
    return c


def streams(words: list[str]) -> list[tuple[int, int, int]]:
    """ "N ptr size dev ..." -> [(devPtr, size, stream's device)]"""
    n = int(words[0])
    return [
        (int(words[1 + 3 * i], 16), int(words[2 + 3 * i]), int(words[3 + 3 * i])) for i in range(n)
    ]


def u32(v: int, nbytes: int) -> bytes:
    return struct.pack("<I", v) * (nbytes // 4)


def memfds(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if link.startswith("/memfd:fakecuda"):
            out.append(link.split(" ")[0])
    return sorted(out)


def test_checkpoint_and_restore_through_custom_storage(peer, any_peer, tmp_path):
    t, va0, dm, va1 = target_with_memory(peer)
    c = controller(any_peer)
    assert memfds(t.pid) == [
        "/memfd:fakecuda-allocation",
        "/memfd:fakecuda-allocation",
        "/memfd:fakecuda-memalloc",
    ]
    c.cmd(f"lock {t.pid}")
    got = streams(c.cmd(f"cscheckpoint {t.pid}"))
    # one entry per GPU holding data: GPU 0 = its allocation then its cuMemAlloc pages
    assert [(s, d) for _, s, d in got] == [(GRAN + MALLOC, 0), (GRAN, 1)]
    assert state(c, t.pid) == CHECKPOINTING
    assert c.err(f"unlock {t.pid}") == "CUDA_ERROR_ILLEGAL_STATE"
    assert c.err(f"cscheckpoint {t.pid}") == "CUDA_ERROR_ILLEGAL_STATE"
    c.cmd(f"csdump 0 {tmp_path / 'g0'}")
    c.cmd(f"csdump 1 {tmp_path / 'g1'}")
    g0, g1 = (tmp_path / "g0").read_bytes(), (tmp_path / "g1").read_bytes()
    assert g0 == u32(0x11111111, GRAN) + u32(0x22222222, MALLOC)
    assert g1 == u32(0x33333333, GRAN)
    # the mapped stream is device memory of the controller: cuMemFree refuses it
    assert c.err(f"free {got[0][0]}") == "CUDA_ERROR_INVALID_VALUE"
    c.cmd("cscomplete")
    assert state(c, t.pid) == CHECKPOINTED
    assert memfds(t.pid) == []  # the target's GPU memory is no longer in the target
    assert c.err("cscomplete") == "CUDA_ERROR_INVALID_VALUE"  # completed: a stale handle
    assert c.err(f"restore {t.pid}") == "CUDA_ERROR_ILLEGAL_STATE"  # not from host memory

    back = streams(c.cmd(f"csrestore {t.pid}"))
    assert [(s, d) for _, s, d in back] == [(GRAN + MALLOC, 0), (GRAN, 1)]
    assert state(c, t.pid) == RESTORING
    (tmp_path / "g0").write_bytes(struct.pack("<I", 0xDEADBEEF) + g0[4:])
    c.cmd(f"csload 0 {tmp_path / 'g0'}")
    c.cmd(f"csload 1 {tmp_path / 'g1'}")
    c.cmd("cscomplete")  # synchronizes the streams the loads were queued on
    assert state(c, t.pid) == LOCKED
    c.cmd(f"unlock {t.pid}")
    assert [int(t.cmd(f"read {a}")[0]) for a in (va0, va0 + 4, dm, dm + MALLOC - 4, va1)] == [
        0xDEADBEEF,
        0x11111111,
        0x22222222,
        0x22222222,
        0x33333333,
    ]


def test_documented_errors(peer, tmp_path, fake_env):
    t, va0, _, _ = target_with_memory(peer)
    bare = peer()  # never called cuInit
    assert bare.err(f"cscheckpoint {t.pid}") == "CUDA_ERROR_NOT_INITIALIZED"
    c = controller(peer, devices=(0,))  # GPU 1's primary context is not retained
    assert c.err(f"cscheckpoint {t.pid}") == "CUDA_ERROR_ILLEGAL_STATE"  # RUNNING, not LOCKED
    c.cmd(f"lock {t.pid}")
    assert c.err(f"cscheckpoint {t.pid} 1") == "CUDA_ERROR_INVALID_VALUE"  # reserved[0] = 1
    assert c.err(f"cscheckpoint {t.pid}") == "CUDA_ERROR_INVALID_CONTEXT"
    assert state(c, t.pid) == LOCKED  # nothing was changed
    assert c.err(f"cscheckpoint {c.pid}") == "CUDA_ERROR_NOT_SUPPORTED"  # the calling process
    assert c.err("cscomplete 1") == "CUDA_ERROR_INVALID_VALUE"  # a made-up handle
    c.cmd(f"checkpoint {t.pid}")  # to host memory
    c2 = controller(peer)
    assert c2.err(f"csrestore {t.pid} 1") == "CUDA_ERROR_INVALID_VALUE"  # padding0 = 1
    assert c2.err(f"csrestore {t.pid}") == "CUDA_ERROR_ILLEGAL_STATE"  # checkpointed to host
    c2.cmd(f"restore {t.pid}")
    c2.cmd(f"unlock {t.pid}")
    assert int(t.cmd(f"read {va0}")[0]) == 0x11111111
    # an older driver: no custom storage, no cuCheckpointOperationComplete to look up
    old = peer(env=dict(fake_env, FAKECUDA_DRIVER_VERSION="13010"))
    old.cmd("init 0")
    old.cmd("init 1")
    # CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT (2) there, the function here
    assert old.cmd("lookup cuCheckpointOperationComplete 13050") == ["2", "NULL"]
    assert c2.cmd("lookup cuCheckpointOperationComplete 13050") == [
        "0",
        "cuCheckpointOperationComplete",
    ]
    old.cmd(f"lock {t.pid}")
    assert old.err(f"cscheckpoint {t.pid}") == "CUDA_ERROR_NOT_SUPPORTED"
    assert state(old, t.pid) == LOCKED
    old.cmd(f"unlock {t.pid}")


def cli_state(pid: int, env) -> str:
    from cuinterpose.agent.mech import native_cli

    res = subprocess.run(
        [native_cli.fake_cli(), "--get-state", "--pid", str(pid)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_abandoned_operations_do_not_leave_the_target_stuck(peer, tmp_path, fake_env):
    t, va0, dm, va1 = target_with_memory(peer)
    c = controller(peer)
    c.cmd(f"lock {t.pid}")
    c.cmd(f"cscheckpoint {t.pid}")
    assert state(c, t.pid) == CHECKPOINTING
    assert cli_state(t.pid, fake_env) == "checkpointing"  # fakecuda's cuda-checkpoint
    c.proc.kill()  # dies before cuCheckpointOperationComplete
    c.proc.wait()
    c2 = controller(peer)
    assert state(c2, t.pid) == LOCKED  # the checkpoint was dropped, the memory kept
    c2.cmd(f"unlock {t.pid}")
    assert [int(t.cmd(f"read {a}")[0]) for a in (va0, dm, va1)] == [
        0x11111111,
        0x22222222,
        0x33333333,
    ]

    c2.cmd(f"lock {t.pid}")
    c2.cmd(f"cscheckpoint {t.pid}")
    c2.cmd(f"csdump 0 {tmp_path / 'g0'}")
    c2.cmd(f"csdump 1 {tmp_path / 'g1'}")
    c2.cmd("cscomplete")
    c3 = controller(peer)
    c3.cmd(f"csrestore {t.pid}")
    assert state(c3, t.pid) == RESTORING
    assert cli_state(t.pid, fake_env) == "restoring"
    c3.proc.kill()  # dies before completing the restore
    c3.proc.wait()
    assert state(c2, t.pid) == CHECKPOINTED  # restore again
    c2.cmd(f"csrestore {t.pid}")
    c2.cmd(f"csload 0 {tmp_path / 'g0'}")
    c2.cmd(f"csload 1 {tmp_path / 'g1'}")
    c2.cmd("cscomplete")
    c2.cmd(f"unlock {t.pid}")
    assert [int(t.cmd(f"read {a}")[0]) for a in (va0, dm, va1)] == [
        0x11111111,
        0x22222222,
        0x33333333,
    ]

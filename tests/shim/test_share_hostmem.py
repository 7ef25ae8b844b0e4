"""cuMemHostRegister over shared host memory under the shim (docs/shim.md "What real stacks
share"; issue 24): NCCL's SHM fallback maps an unlinked /dev/shm/nccl-* file and registers it
PORTABLE | DEVICEMAP (src/misc/shmutils.cc). fakecuda's native checkpoint refuses such a
registration (the driver documentation is silent); the shim unregisters it at PREPARE_UNICAST
and registers it again, with its flags, at LOAD_ALLOCATIONS, so the checkpoint passes and the
bytes and the registration are back. Processes are ``fcshare`` (share_kit.py), plain and under
ASan/UBSan."""

from __future__ import annotations

import os

from .share_kit import checkpoint_cycle, fcshare_shim_exe, share_procs  # noqa: F401

PORTABLE_DEVICEMAP = 3
SIZE = 3 << 20


def test_registered_shared_mapping_is_carried(share_procs, shim_env, fake_log):  # noqa: F811
    a, c = share_procs(), share_procs(shim=False)
    a.cmd("init 0")
    c.cmd("init 0")
    path = f"/dev/shm/cui-test-{os.getpid()}-{a.pid}"
    va = a.hex(f"shm {SIZE} {path}")
    assert not os.path.exists(path)  # unlinked, as NCCL leaves it
    a.cmd(f"hostreg {va} {SIZE} {PORTABLE_DEVICEMAP}")
    offsets = [0, 4096, SIZE // 2, SIZE - 4]
    for i, off in enumerate(offsets):
        a.cmd(f"hostwrite {va + off} {1000 + i}")
    # without the shim's teardown, native checkpoint refuses the registration
    c.cmd(f"lock {a.pid}")
    assert c.err(f"checkpoint {a.pid}") == "CUDA_ERROR_NOT_SUPPORTED"
    c.cmd(f"unlock {a.pid}")
    mark = fake_log.mark()
    checkpoint_cycle(shim_env, [a], c)
    calls = [
        (fn, args.get("p"), args.get("flags"), r)
        for fn, args, r in fake_log.calls(pid=a.pid, since=mark)
    ]
    calls = [x for x in calls if x[0].startswith("cuMemHost")]
    assert calls == [
        ("cuMemHostUnregister", hex(va), None, "CUDA_SUCCESS"),
        ("cuMemHostRegister_v2", hex(va), str(PORTABLE_DEVICEMAP), "CUDA_SUCCESS"),
    ]
    assert [a.cmd(f"hostread {va + off}")[0] for off in offsets] == ["1000", "1001", "1002", "1003"]
    a.cmd(f"hostunreg {va}")  # the application's own unregister still works, once
    assert a.err(f"hostunreg {va}") == "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"

"""What a rollback must not change in a process of the job (issue 23, decisions D54): read by
tests/chaos/test_rollback_keeps.py after a rollback at each step that can fail, and by the GPU
check's agent-leave-running (scripts/gpu_check_jobs.py) on a real driver."""

from __future__ import annotations

import os

__all__ = ["FAKE_DEVICE_MEMORY_FD", "process_state"]

#: fakecuda's memfd behind each device allocation (fakecuda/src/vmm.c): the shim rebuilds
#: device memory in a rollback, so these descriptors are new ones (a real driver holds none)
FAKE_DEVICE_MEMORY_FD = "/memfd:fakecuda-allocation (deleted)"


def process_state(pid: int) -> dict:
    """What a rollback must not change in process ``pid`` (issue 23): its ``/proc/PID/status``
    SigCgt, SigBlk, SigIgn (hex masks), its thread ids, its descriptors {fd: link target}
    (fakecuda's device-memory memfds apart) and how many of those there are. Raises OSError
    when the process is gone."""
    out: dict = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("SigCgt", "SigBlk", "SigIgn"):
                out[k] = v.strip()
    fds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass  # closed meanwhile
    out["threads"] = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    out["fds"] = {fd: t for fd, t in sorted(fds.items()) if t != FAKE_DEVICE_MEMORY_FD}
    out["device memory fds"] = sum(t == FAKE_DEVICE_MEMORY_FD for t in fds.values())
    return out

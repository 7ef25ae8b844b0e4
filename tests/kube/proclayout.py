"""A laid-out /proc for the cgroup resolver (``kubernetes.procRoot``), and the check that a
restored tree sits in its placeholder.

Pods have no real cgroups here: ``lay_proc`` writes ``PID/cgroup`` lines that put real
processes into a pod's container; ``PID/stat`` is copied from the real /proc (start time
included, so the resolver picks the container's init as a placeholder)."""
from __future__ import annotations

import os
import pathlib

from cuinterpose.agent.census import walk_tree

NAMESPACES = ("net", "uts", "ipc", "mnt")


def lay_proc(proc_root: pathlib.Path, cid: str, pids) -> None:
    """Put ``pids`` into container ``cid`` in the laid-out /proc (``stat`` is the real one)."""
    for pid in pids:
        d = proc_root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{cid}.scope\n")
        (d / "stat").write_text(pathlib.Path(f"/proc/{pid}/stat").read_text())


def not_placed(root: int, placeholder: int) -> list[str]:
    """What of the tree under ``root`` is not in the namespaces (net, uts, ipc, mnt: by inode)
    and cgroups (every ``/proc/PID/cgroup`` line) of process ``placeholder``; [] when every
    process of it is."""
    want_ns = {k: os.stat(f"/proc/{placeholder}/ns/{k}").st_ino for k in NAMESPACES}
    want_cg = pathlib.Path(f"/proc/{placeholder}/cgroup").read_text()
    out = []
    for pid, _, _ in walk_tree([root]):
        for k in NAMESPACES:
            got = os.stat(f"/proc/{pid}/ns/{k}").st_ino
            if got != want_ns[k]:
                out.append(f"pid {pid}: {k} [{got}] not [{want_ns[k]}]")
        cg = pathlib.Path(f"/proc/{pid}/cgroup").read_text()
        if cg != want_cg:
            out.append(f"pid {pid}: cgroups {cg!r} not {want_cg!r}")
    return out

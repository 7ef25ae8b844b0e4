"""A laid-out /proc for the cgroup resolver (``kubernetes.procRoot``).

Pods have no real cgroups here: ``lay_proc`` writes ``PID/cgroup`` lines that put real
processes into a pod's container; ``PID/stat`` is copied from the real /proc (start time
included, so the resolver picks the container's init as a placeholder)."""

from __future__ import annotations

import pathlib


def lay_proc(proc_root: pathlib.Path, cid: str, pids) -> None:
    """Put ``pids`` into container ``cid`` in the laid-out /proc (``stat`` is the real one)."""
    for pid in pids:
        d = proc_root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-{cid}.scope\n"
        )
        (d / "stat").write_text(pathlib.Path(f"/proc/{pid}/stat").read_text())

"""Map a pod's containers to process trees on this node, through their cgroups.

A container's runtime id comes from the pod status (``status.containerStatuses[].containerID``,
``"containerd://<id>"``, ``"cri-o://<id>"``, ``"docker://<id>"``). The runtimes name the
container's cgroup after that id (cgroup v2 with systemd:
``/kubepods.slice/.../cri-containerd-<id>.scope``; cgroupfs: ``/kubepods/burstable/pod<uid>/<id>``),
so a process belongs to the container when a path component of one of its ``/proc/PID/cgroup``
lines contains the id. The container's *roots* are its processes whose parent is not in the
container (the container's init, whose parent is the runtime shim, and processes started by
``kubectl exec``). The agent runs with ``hostPID: true``, so these are host pids.

Both the agent and the pod must share the host's PID namespace: a process whose
``/proc/PID/status`` ``NSpid:`` line lists more than one pid lives in a nested PID namespace
(proc(5)) and is refused here, naming the container and the pid. Each pid also goes through
``agent.mech.census_checks.check_process_id``, the check the census makes (case 002): a pid
that is a thread of another process (``Tgid:`` of ``/proc/PID/status`` differs) is refused
by name. That check reads the agent's own ``/proc``, so it applies when ``proc_root`` shows
the agent's pid namespace (``host_pids``; by default when ``proc_root`` is ``/proc``).

A restore goes into a *placeholder* pod: :meth:`CgroupResolver.placeholder` picks the process
whose cgroups and namespaces the restored trees join — the init of the pod's first running
container in ``spec.containers`` order (the kubelet lists ``containerStatuses`` sorted by
name, so a sidecar could come first there): its oldest root, by start time (``/proc/PID/stat``
field 22), returned with that start time so that a pid reused later is noticed.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Iterable, Optional

from cuinterpose.agent.errors import CensusError
from cuinterpose.agent.mech import census_checks, procfs


class ResolveError(Exception):
    """The pod's processes could not be found; ``str()`` says which container and why."""


@dataclasses.dataclass(frozen=True)
class ContainerTree:
    """One running container: ``name``, runtime ``container_id`` (without the ``runtime://``
    prefix), every pid in its cgroup (``pids``, sorted) and its ``roots`` (sorted)."""

    name: str
    container_id: str
    pids: tuple
    roots: tuple


def container_ids(pod: dict) -> list[tuple[str, str]]:
    """[(container name, runtime id)] of the pod's regular containers that have an id and are
    running, in status order."""
    out = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        cid = cs.get("containerID") or ""
        if "running" not in (cs.get("state") or {}) or not cid:
            continue
        out.append((cs.get("name", "?"), cid.split("://", 1)[-1]))
    return out


class CgroupResolver:
    """Reads ``<proc_root>/<pid>/cgroup`` and ``<proc_root>/<pid>/stat``. ``proc_root`` is the
    host's /proc for the DaemonSet (hostPID); tests point it at a directory they lay out.
    ``host_pids``: the pids under ``proc_root`` are those of the agent's pid namespace, so
    :meth:`check_pid` applies the census's process-id check (None: when ``proc_root`` is
    ``/proc``)."""

    def __init__(self, proc_root: str | os.PathLike = "/proc", *, host_pids: Optional[bool] = None):
        self.proc_root = pathlib.Path(proc_root)
        if host_pids is None:
            host_pids = os.path.realpath(self.proc_root) == "/proc"
        self.host_pids = host_pids

    def _pids(self) -> Iterable[int]:
        return procfs.pids(str(self.proc_root))

    def _cgroup_components(self, pid: int) -> Optional[list[str]]:
        try:
            text = (self.proc_root / str(pid) / "cgroup").read_text()
        except OSError:
            return None
        return [c for path in procfs.cgroup_paths(text) for c in path.split("/") if c]

    def _ppid(self, pid: int) -> Optional[int]:
        try:
            return int(procfs.stat_fields(pid, self.proc_root)[1][procfs.STAT_PPID])
        except (OSError, ValueError, IndexError):
            return None

    def start_time(self, pid: int) -> int:
        """Start time in clock ticks since boot (``/proc/PID/stat`` field 22), or a huge number
        when unreadable (sorts last)."""
        try:
            return int(procfs.stat_fields(pid, self.proc_root)[1][procfs.STAT_STARTTIME])
        except (OSError, ValueError, IndexError):
            return 1 << 62

    def nested_pid(self, pid: int) -> Optional[list[int]]:
        """The ``NSpid:`` pids of ``pid`` when it lives in a nested PID namespace (more than
        one pid listed), else None (host PID namespace, or no ``status`` file to tell)."""
        try:
            ns = procfs.nspid(pid, self.proc_root)
        except OSError:
            return None
        return ns if ns and len(ns) > 1 else None

    def check_pid(self, who: str, pid: int) -> None:
        """Refuse (``ResolveError`` naming ``who`` and the pid) a pid in a nested PID namespace
        (``NSpid:``) and, with ``host_pids``, one that is not a process id
        (``census_checks.check_process_id``: a thread of another process)."""
        ns = self.nested_pid(pid)
        if ns:
            raise ResolveError(
                f"{who}: pid {pid} runs in its own PID namespace (NSpid "
                f"{' '.join(map(str, ns))}); the pod needs spec.hostPID: true"
            )
        if not self.host_pids:
            return
        try:
            census_checks.check_process_id(pid, "resolve")
        except CensusError as e:
            raise ResolveError(f"{who}: pid {pid} {e.reason}") from None

    def pids_of(self, container_id: str) -> list[int]:
        """Sorted pids whose cgroup path has a component containing ``container_id``."""
        if len(container_id) < 12:  # a prefix that short could match unrelated cgroups
            raise ResolveError(f"container id {container_id!r} is too short to match cgroups")
        out = []
        for pid in self._pids():
            comps = self._cgroup_components(pid)
            if comps and any(container_id in c for c in comps):
                out.append(pid)
        return sorted(out)

    def resolve(self, pod: dict) -> list[ContainerTree]:
        """Every running container of ``pod`` with its processes. Raises ``ResolveError`` when
        the pod has no running container or none of them has a process on this node."""
        ids = container_ids(pod)
        meta = pod.get("metadata") or {}
        who = f"pod {meta.get('namespace')}/{meta.get('name')}"
        if not ids:
            raise ResolveError(f"{who} has no running container with a containerID")
        trees = []
        for name, cid in ids:
            pids = self.pids_of(cid)
            for p in pids:
                self.check_pid(f"{who} container {name}", p)
            inside = set(pids)
            roots = [p for p in pids if self._ppid(p) not in inside]
            if pids:
                trees.append(ContainerTree(name, cid, tuple(pids), tuple(sorted(roots))))
        if not trees:
            listed = ", ".join(f"{n} ({c[:12]})" for n, c in ids)
            raise ResolveError(
                f"no process of {who} found in the cgroups of its containers "
                f"{listed} under {self.proc_root}"
            )
        return trees

    def placeholder(self, pod: dict) -> tuple[ContainerTree, int, int]:
        """The process a restore into ``pod`` places its trees with: (the pod's first running
        container with processes in ``spec.containers`` order, its init = the root that
        started first, that root's start time in clock ticks). Raises ``ResolveError`` (from
        :meth:`resolve`) when the pod has no process on this node."""
        order = {
            c.get("name"): i for i, c in enumerate((pod.get("spec") or {}).get("containers") or [])
        }
        tree = min(self.resolve(pod), key=lambda t: order.get(t.name, len(order)))
        pid = min(tree.roots, key=lambda p: (self.start_time(p), p))
        return tree, pid, self.start_time(pid)

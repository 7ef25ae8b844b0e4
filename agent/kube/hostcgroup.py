"""Seeing the node's cgroups from the agent's DaemonSet pod.

On cgroup v2 nodes the container runtime usually gives each container a cgroup namespace of
its own (cgroup_namespaces(7)): ``/proc/PID/cgroup`` of *another* pod's process then reads as a
path relative to the agent's own cgroup (``0::/../../kubepods.slice/...``), and the cgroup
filesystem mounted in the container shows only the agent's subtree. The pod watcher resolves
pods through those paths and a restore writes into the placeholder's ``cgroup.procs``, so the
agent works in the node's cgroup namespace: ``join_host_cgroup_namespace()`` ``setns(2)``'s the
calling thread into the one of pid 1 (the node's init: the DaemonSet runs with ``hostPID``),
and the chart mounts the node's ``/sys/fs/cgroup`` over the container's. It must run before the
daemon starts any thread (threads inherit the namespace of the thread that creates them).
"""

from __future__ import annotations

import ctypes
import logging
import os

from cuinterpose.agent.mech import libc, procfs

log = logging.getLogger("cuinterpose.kube")


def join_host_cgroup_namespace(host_pid: int = 1) -> str:
    """Move the calling thread into the cgroup namespace of ``host_pid``. Returns what
    happened, in words: ``"same"`` (already there: a shell on the node, or a pod without a
    cgroup namespace of its own), ``"joined"``, or ``"unavailable: <why>"`` (its namespace
    cannot be read or entered: no CAP_SYS_ADMIN, no hostPID; the resolver and placements then
    see what this namespace shows, and refuse paths they cannot reach with a reason). Never
    raises."""
    path = f"/proc/{host_pid}/ns/cgroup"
    try:
        if procfs.ns_inode(host_pid, "cgroup") == procfs.ns_inode("thread-self", "cgroup"):
            return "same"
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        return f"unavailable: {path}: {e.strerror or e}"
    try:
        if libc.fn("setns")(fd, libc.CLONE_NEWCGROUP) != 0:
            err = ctypes.get_errno()
            return f"unavailable: setns({path}): {os.strerror(err)}"
    finally:
        os.close(fd)
    log.info("joined the cgroup namespace of pid %d (%s)", host_pid, path)
    return "joined"


def join_and_log(host_pid: int = 1) -> str:
    """:func:`join_host_cgroup_namespace`, logged: a failure to join is a warning (the
    resolver and placements then see only this namespace's cgroups, and say so when a path
    lies outside it)."""
    res = join_host_cgroup_namespace(host_pid)
    if res.startswith("unavailable"):
        log.warning(
            "cannot work in the node's cgroup namespace (%s); pods whose cgroups lie "
            "outside this agent's cgroup namespace cannot be resolved or restored into",
            res,
        )
    else:
        log.info("cgroup namespace: %s", res)
    return res

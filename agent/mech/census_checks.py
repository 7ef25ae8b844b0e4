"""Checks the census (and ``inspect``, ``doctor``, the restore target) makes about a pid or a
control socket before any driver call or request: that a pid is a process, not one of its
threads (case 002); that it is not stopped (state T/t: the driver would wait forever, case
001); that a control dir can hold a socket path for every pid (case 007); and that a control
socket belongs to the process it names, by owner uid and ``SO_PEERCRED`` (case 012). Each
raises ``CensusError`` naming the pid, the cause and what to do. Also the checkpoint's checks of
its census: no tree reaches a mount outside its namespace (:func:`check_mounts`), and every
participant is among the ranks the workload parked (:func:`check_parked`).
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Optional

from cuinterpose.agent.errors import AgentError, CensusError
from cuinterpose.agent.mech import fds, procfs, tcp
from cuinterpose.coordinator import protocol


def socket_path(control_dir, pid: int) -> str:
    """``<control_dir>/cuinterpose-<pid>.sock``."""
    return protocol.socket_path(control_dir, pid)


#: the bytes of ``sockaddr_un.sun_path`` a socket path may use (108 with its NUL, unix(7))
SUN_PATH_MAX = 107
STOPPED_HINT = (
    "it is stopped (SIGSTOP, a debugger, or an interrupted checkpoint that left the tree "
    "stopped): resume it with `kill -CONT {pid}`, or run `cuinterpose-agent release --pid "
    "<job root>` to finish an interrupted checkpoint, then retry"
)


def check_process_id(pid: int, phase: str) -> None:
    """Refuse (``CensusError``) a ``pid`` that is a thread of another process (its ``Tgid`` in
    ``/proc/PID/status`` is not itself): every pid the agent takes must be a process id.
    Nothing when it is a process or does not exist (the caller words that)."""
    try:
        st = procfs.status(pid)
        tgid = int(st.get("Tgid", pid))
    except (OSError, ValueError):
        return
    if tgid == pid:
        return
    try:
        name = procfs.status(tgid).get("Name", "?")
    except OSError:
        name = "?"
    raise CensusError(
        phase,
        f"is a thread of process {tgid} ({name}); pass a process id (the job's root)",
        pid=pid,
    )


def check_not_stopped(pid: int, phase: str, control_dir=None, ancestors=None) -> None:
    """Refuse (``CensusError``) a process in state T (stopped) or t (tracing stop) in
    ``/proc/PID/stat``, before any driver call about it: the driver would wait for it forever.
    Nothing when it is gone. With ``control_dir``, a job a dead agent's checkpoint left stopped
    is named with its root and the ``release`` to run (``quiesce.job_busy`` over ``pid`` and
    ``ancestors(pid)``, its parent chain: census.ancestors, passed in by the census)."""
    try:
        comm, fields = procfs.stat_fields(pid)
    except (OSError, ValueError):
        return
    state = fields[procfs.STAT_STATE] if fields else ""
    if state in ("T", "t"):
        what = "stopped" if state == "T" else "stopped by a tracer"
        busy = None
        if control_dir is not None:
            from cuinterpose.agent.mech import quiesce

            up = ancestors(pid) if ancestors is not None else []
            busy = quiesce.job_busy(control_dir, [pid, *up])
        raise CensusError(
            phase,
            f"({comm}) is {what} (state {state} in /proc/{pid}/stat): "
            + (busy or STOPPED_HINT.format(pid=pid)),
            pid=pid,
        )


def pid_max() -> int:
    """``/proc/sys/kernel/pid_max``, the largest pid the kernel hands out plus one (4194304
    when it cannot be read, the kernel's upper bound on 64-bit)."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 4194304


def socket_dir_problem(control_dir: os.PathLike | str) -> Optional[str]:
    """Why ``control_dir`` cannot hold a shim's control socket for every pid, or None: the
    path ``DIR/cuinterpose-<pid_max - 1>.sock`` must fit in ``sun_path`` (at most 107 bytes)."""
    longest = os.fsencode(str(socket_path(control_dir, max(pid_max() - 1, 1))))
    if len(longest) <= SUN_PATH_MAX:
        return None
    return (
        f"control dir {control_dir} is too long for a Unix socket: "
        f"{os.fsdecode(longest)} is {len(longest)} bytes, over the limit of {SUN_PATH_MAX} "
        "(sockaddr_un.sun_path is 108 bytes with its NUL; the longest pid is pid_max - 1, "
        f"/proc/sys/kernel/pid_max {pid_max()}), so the shim cannot bind its control socket there; use a shorter "
        "CUINTERPOSE_CONTROL_DIR / --control-dir"
    )


def check_socket_dir(control_dir: os.PathLike | str, phase: str) -> None:
    """Raise ``CensusError`` with :func:`socket_dir_problem`'s reason."""
    why = socket_dir_problem(control_dir)
    if why:
        raise CensusError(phase, why)


def check_socket_owner(sock: os.PathLike | str, pid: int, phase: str) -> None:
    """Refuse (``CensusError``) a control socket not owned by the effective uid of the
    process its name claims (``/proc/PID/status`` ``Uid``): another user bound it (a forged
    endpoint). Nothing when either is gone."""
    try:
        owner = os.lstat(sock).st_uid
        euid = int(procfs.status(pid)["Uid"].split()[1])
    except (OSError, KeyError, ValueError, IndexError):
        return
    if owner != euid:
        raise CensusError(
            phase,
            f"control socket {sock} is owned by uid {owner}, but the process it names runs "
            f"as uid {euid}: another user's socket, refused (remove it, or find who created "
            "it)",
            pid=pid,
        )
    peer = socket_peer(sock)
    if peer is not None and (peer[0] not in (0, pid) or peer[1] != euid):
        raise CensusError(
            phase,
            f"control socket {sock} is served by pid {peer[0]} uid {peer[1]} (SO_PEERCRED), "
            f"not by the process it names (pid {pid} uid {euid}): a forged endpoint, refused "
            "(remove it, or find who created it)",
            pid=pid,
        )


def socket_peer(sock: os.PathLike | str, timeout_s: float = 5.0) -> Optional[tuple[int, int]]:
    """(pid, uid) of the process that listens on the Unix socket ``sock`` (``SO_PEERCRED`` of
    a connection to it, unix(7); pid 0 when it lies outside the agent's pid namespace); None
    when it cannot be connected (a stale socket: the caller words that). The connection is
    closed at once, without a request (the shim drops it)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout_s)
        s.connect(str(sock))
        pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid, uid
    except OSError:
        return None
    finally:
        s.close()


def check_mounts(census, roots, tree_pids) -> None:
    """Refuse (``CensusError``, phase "census", nothing torn down) a tree with a working
    directory, root directory or file mapping on a mount outside its mount namespace
    (:func:`~cuinterpose.agent.mech.fds.outside_mounts`): CRIU fails such a dump ("Can't lookup
    mount=N for fd=-3"), and only open fds can be dumped as external files.
    ``tree_pids(root)``: the pids of a tree."""
    comms = {p.pid: p.comm for p in census.processes}
    for root in roots:
        found = fds.outside_mounts(root, tree_pids(root))
        if not found:
            continue
        f0 = found[0]
        others = "".join(
            f"; also pid {f['pid']} ({comms.get(f['pid'], '?')}) {f['what']}" for f in found[1:6]
        )
        if len(found) > 6:
            others += f"; and {len(found) - 6} more"
        raise CensusError(
            "census",
            (
                f"({comms.get(f0['pid'], '?')}) of tree {root} {f0['what']}, which is not a "
                "mount of the tree's mount namespace (reached from outside it, e.g. through an "
                "inherited fd or another process's /proc/PID/root): CRIU, run in that "
                f'namespace, cannot dump it ("Can\'t lookup mount={f0["mnt_id"]} for fd=-3"), '
                "and only open fds can be recorded as external files"
                f"{others}; checkpoint refused, nothing was torn down, the workload keeps "
                "running"
            ),
            pid=f0["pid"],
        )


def check_tcp(census, roots, tree_pids) -> None:
    """Refuse (``CensusError``, phase "census", nothing torn down) a tree holding a TCP socket
    in any state but LISTEN (:func:`~cuinterpose.agent.mech.tcp.tree_sockets`): the agent runs
    CRIU without ``--tcp-established``, so the dump would fail after the teardown. A listening
    socket is left to CRIU. ``tree_pids(root)``: the pids of a tree."""
    comms = {p.pid: p.comm for p in census.processes}
    for root in roots:
        found = [s for s in tcp.tree_sockets(tree_pids(root)) if s["state"] != "LISTEN"]
        if not found:
            continue
        desc = [
            f"pid {s['pid']} ({comms.get(s['pid'], '?')}) fd {s['fd']} {s['local']} -> "
            f"{s['remote']} ({s['state']})"
            for s in found
        ]
        more = f" and {len(desc) - 4} more" if len(desc) > 4 else ""
        raise CensusError(
            "census",
            (
                f"({comms.get(found[0]['pid'], '?')}) of tree {root} holds "
                f"{len(found)} TCP connection(s): {'; '.join(desc[:4])}{more}. The agent runs "
                "CRIU without --tcp-established (docs/criu.md), so the dump would fail; a "
                "workload must close its TCP connections before it parks (torch.distributed: "
                "NCCL's bootstrap and gloo keep theirs for the process group's life); "
                "checkpoint refused, nothing was torn down, the workload keeps running"
            ),
            pid=found[0]["pid"],
        )


def check_parked(census, ready: dict) -> None:
    """Every participant must be among the ranks the workload reported parked (when it lists
    pids): a CUDA process that is still running cannot be torn down safely. Raises
    ``AgentError`` (phase "quiesce") naming the first unparked participant. ``ready``: {root:
    the workload's ``.ready`` payload}."""
    parked = set()
    for payload in ready.values():
        ranks = payload.get("ranks")
        if not isinstance(ranks, list) or not all(
            isinstance(r, dict) and "pid" in r for r in ranks
        ):
            return  # the workload does not list pids: nothing to check against
        parked.update(int(r["pid"]) for r in ranks)
    for p in census.participants:
        if p.pid not in parked:
            raise AgentError(
                "quiesce",
                f"({p.comm}) is a participant but the workload's ready "
                f"lists only pids {sorted(parked)} as parked; checkpoint refused, "
                "nothing was torn down",
                pid=p.pid,
            )

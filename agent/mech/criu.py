"""Dumping a process tree with CRIU and restoring it detached: :func:`dump`, :func:`restore`
and the options they add for the agent's process model (``DUMP_OPTS``, ``RESTORE_OPTS``,
:func:`tree_namespaces`). Every failure raises ``CriuError``; its message names the command,
its exit status, the images directory and the last lines of the CRIU log.

The rest of the CRIU side lives next to this module, and the names other modules use are
re-exported here: which CRIU and its environment (agent/mech/criu_binary.py), what its child
does before CRIU starts (criu_child.py), running one command with its log (criu_run.py) and
what an images directory restores (criu_images.py). docs/criu.md explains every option, the
namespaces a dump runs in and the known limits.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from cuinterpose.agent.mech import criu_remap, fds
from cuinterpose.agent.mech.criu_binary import (
    ENV_CRIU,
    CriuError,
    check,
    criu_command,
    reset,
    version,
)
from cuinterpose.agent.mech.criu_child import ChildSetup, run_setup_probe
from cuinterpose.agent.mech.criu_images import describe_pid, image_pids, wait_exit, wait_pids_free
from cuinterpose.agent.mech.criu_run import bad_size_files, common_args, log_tail, run
from cuinterpose.agent.mech.procfs import ns_inode
from cuinterpose.agent.options import RunOptions

#: a CRIU run's deadline when the caller gives none: the ``criu_timeout_s`` option's default
TIMEOUT_S = RunOptions().criu_timeout_s

__all__ = [
    "CriuError",
    "criu_command",
    "version",
    "check",
    "dump",
    "restore",
    "image_pids",
    "wait_pids_free",
    "wait_exit",
    "reset",
    "DUMP_OPTS",
    "RESTORE_OPTS",
    "ChildSetup",
    "run_setup_probe",
    "ns_inode",
    "EXTERNAL_NET_KEY",
    "ENV_CRIU",
    "bad_size_files",
    "tree_namespaces",
    "DUMP_ENTER_NS",
]

# What `dump` adds for our process model: --file-locks, so a job holding a file lock (a
# cache or database lock, a pip/compile cache) can be dumped and gets the lock back on
# restore; without it CRIU refuses ("Some file locks are hold by dumping tasks"). Nothing
# else: a setsid launcher with no tty needs no --shell-job; Unix sockets whose peers are all
# inside the tree need no --ext-unix-sk; memfds, PROT_NONE/NORESERVE reservations, shared and
# private anonymous memory, threads and open regular files are handled by default. See
# docs/criu.md.
DUMP_OPTS: tuple[str, ...] = ("--file-locks",)
# What `restore` adds (besides --restore-detached and --pidfile):
#   --manage-cgroups=ignore  the restored tasks stay in the cgroup of the process running
#                            CRIU (the agent, or wherever it runs CRIU) instead of CRIU
#                            recreating/moving into the dump-time cgroup paths.
#   --file-locks             take back the file locks the dump recorded.
RESTORE_OPTS: tuple[str, ...] = ("--manage-cgroups=ignore", "--file-locks")

#: CRIU's label of a tree's network namespace dumped as external (``--external net[INO]:KEY``)
EXTERNAL_NET_KEY = "cuinterpose-net"
#: namespaces a dump enters (those of the tree root), so that CRIU does not image them; mnt:
#: CRIU would dump a foreign mount namespace's whole mount table and fail on every open file
#: whose mount is not in it (agent/mech/mntns.py)
DUMP_ENTER_NS: tuple[str, ...] = ("uts", "ipc", "mnt")


def tree_namespaces(root_pid: int) -> dict:
    """How ``dump`` treats the namespaces of the tree rooted at ``root_pid``:
    ``{"net", "uts", "ipc", "mnt"}`` (the root's namespace inodes), ``"enter"`` (the kinds among
    ``DUMP_ENTER_NS`` that differ from this process's: CRIU runs in the root's),
    ``"external_net"`` (``EXTERNAL_NET_KEY`` when the root's network namespace is not this
    process's, else ``""``) and ``"foreign_mnt"`` (the root's mount namespace is not this
    process's). Raises ``CriuError`` when ``/proc/ROOT/ns`` cannot be read."""
    try:
        out = {k: ns_inode(root_pid, k) for k in ("net", "uts", "ipc", "mnt")}
        mine = {k: ns_inode("self", k) for k in ("net", "uts", "ipc", "mnt")}
    except OSError as e:
        raise CriuError(f"cannot dump: namespaces of pid {root_pid} unreadable: {e}") from e
    out["enter"] = [k for k in DUMP_ENTER_NS if out[k] != mine[k]]
    out["external_net"] = EXTERNAL_NET_KEY if out["net"] != mine["net"] else ""
    out["foreign_mnt"] = out["mnt"] != mine["mnt"]
    return out


def dump(
    root_pid: int,
    images_dir: Path,
    *,
    leave_running: bool = False,
    log_name: str = "dump.log",
    extra_args: Iterable[str] = (),
    external_files: Iterable[str] = (),
    deleted_files: Sequence[dict] = (),
    timeout_s: float = TIMEOUT_S,
) -> dict:
    """Dump the process tree rooted at ``root_pid`` into ``images_dir`` (created if missing).

    The tree must be quiescent for CRIU: it is frozen (ptrace) for the dump and, unless
    ``leave_running``, **killed by CRIU** once the images are written (SIGKILL). The caller
    must then reap any of those processes that are its children (``Popen.wait()``), and the
    PIDs must be free again before ``restore`` (``wait_pids_free``).
    The log is ``images_dir/log_name``. Unix sockets connected to a process outside the tree,
    a tty, TCP connections and file locks make the dump fail (see docs/criu.md).

    Namespaces (:func:`tree_namespaces`, returned): CRIU runs in the root's uts and ipc
    namespaces, so the images hold neither; a network namespace other than the caller's is
    dumped as external (``--external net[INODE]:cuinterpose-net --network-lock skip``): its
    images restore only with ``restore(..., inherit_fds=[(fd of a netns, "cuinterpose-net")])``.

    ``external_files``: CRIU names ``file[MNT_ID:INODE]`` (hex, ``inherit.external_file_key``)
    of files the tree holds on mounts that are not in its mount namespace (opened outside it:
    a container's /dev/null or log file from the runtime), dumped as external (``--external``;
    otherwise CRIU fails "Can't lookup mount=N for fd=M"); their images restore only with an
    fd for each (``inherit_fds=[(fd, "file[MNT_ID:INODE]")]``). ``fds.external_files``
    finds them.

    ``deleted_files``: ``fds.unlinked_files`` of the tree, the deleted files it holds: CRIU gets
    ``--ghost-limit`` to carry the largest one without a link left (NCCL's SHM fallback, several
    MiB) and ``--link-remap`` for one with a link left (a ``multiprocessing`` semaphore), whose
    links are then kept with the images (agent/mech/criu_remap.py).

    ``timeout_s``: CRIU is killed past it (the run's ``criu_timeout_s``).

    Raises ``CriuError`` when ``root_pid`` does not exist, ``images_dir`` already holds
    images (``*.img``; images of two dumps must not mix), or CRIU fails or runs past
    ``timeout_s`` (message: command, exit code, log tail).
    """
    images_dir = Path(images_dir).absolute()
    if root_pid <= 1 or not os.path.exists(f"/proc/{root_pid}"):
        raise CriuError(f"cannot dump: no process {root_pid}", images_dir=images_dir)
    images_dir.mkdir(parents=True, exist_ok=True)
    if any(images_dir.glob("*.img")):
        raise CriuError(
            f"cannot dump into {images_dir}: it already holds CRIU images", images_dir=images_dir
        )
    ns = tree_namespaces(root_pid)
    args = ["--tree", str(root_pid), *common_args(images_dir, images_dir, log_name), *DUMP_OPTS]
    if ns["external_net"]:
        # not dumped (CRIU would need iptables to lock it, and restores it from the images);
        # no network lock: we never dump TCP connections (those fail the dump)
        args += ["--external", f"net[{ns['net']}]:{ns['external_net']}", "--network-lock", "skip"]
    for key in dict.fromkeys(external_files):
        args += ["--external", key]
    if leave_running:
        args.append("--leave-running")
    deleted = list(deleted_files)
    args += [*fds.ghost_limit_args(deleted), *extra_args]
    setup = ChildSetup(namespaces=tuple((k, f"/proc/{root_pid}/ns/{k}") for k in ns["enter"]))
    run(
        "dump",
        args,
        images_dir=images_dir,
        log_path=images_dir / log_name,
        setup=setup,
        timeout_s=timeout_s,
    )
    if "--link-remap" in args:
        try:
            criu_remap.collect(images_dir, deleted)
        except OSError as e:
            raise CriuError(
                f"dump of {root_pid}: keeping the linked remaps: {e}", images_dir=images_dir
            ) from e
    return ns


def restore(
    images_dir: Path,
    *,
    log_name: str = "restore.log",
    extra_args: Iterable[str] = (),
    work_dir: Path | None = None,
    pid_wait_s: float = 15.0,
    join_ns: Sequence[tuple[str, str]] = (),
    inherit_fds: Sequence[tuple[int, str]] = (),
    setup: ChildSetup | None = None,
    leave_stopped: bool = False,
    timeout_s: float = TIMEOUT_S,
) -> int:
    """Restore the tree dumped in ``images_dir``, detached; returns the restored root's PID.

    The tree comes back with its original PIDs/TIDs, so they must be free: zombies of the
    dumped tree are waited for up to ``pid_wait_s`` seconds (an init that reaps lazily).
    The restored root is **not a child of the caller**: CRIU forks it and exits, so it is
    re-parented to the caller's nearest child subreaper, else to init. Wait for it with
    ``wait_exit(pid)`` (a pidfd), not ``waitpid``.
    Listening Unix sockets are re-bound at their paths: stale socket files must be deleted
    before restore (bind fails on an existing path). Abstract names must be free.
    ``images_dir`` is only read: CRIU's log (``log_name``), pidfile and stats go to
    ``work_dir`` (default: a new ``cuinterpose-criu-restore-*`` temporary directory, removed
    after a successful restore and kept, with its log, when the restore fails).

    Placement (agent/mech/placement.py, inherit.py): ``join_ns`` ``[(kind,
    /proc/PID/ns/KIND)]`` become ``--join-ns KIND:PATH``; ``inherit_fds`` ``[(fd,
    resource)]`` (fds of the caller, passed to CRIU) become ``--inherit-fd
    fd[FD]:RESOURCE`` (``pipe:[INODE]`` for a pipe fd of the tree, ``cuinterpose-net`` for an
    external network namespace); ``setup`` is applied by CRIU's child before CRIU starts
    (its cgroups are the restored tasks' under ``--manage-cgroups=ignore``). The caller keeps
    (and closes) its fds. ``leave_stopped``: ``--leave-stopped``, the restored tasks stay
    stopped (SIGSTOP) until the caller SIGCONTs each (``image_pids``), to change something of
    theirs first. ``timeout_s``: CRIU is killed past it (the run's ``criu_timeout_s``).

    Raises ``CriuError`` naming ``images_dir`` when it is missing, holds no images, its
    ``pstree.img`` is unreadable, a PID it needs is taken, ``setup`` cannot be applied (CRIU
    is then not started), or CRIU fails (message: command, exit code, log tail);
    ``images_dir`` is left untouched in every case.
    """
    images_dir = Path(images_dir).absolute()
    if not images_dir.is_dir():
        raise CriuError(
            f"cannot restore: images dir {images_dir} does not exist", images_dir=images_dir
        )
    missing = [n for n in ("inventory.img", "pstree.img") if not (images_dir / n).is_file()]
    if missing:
        raise CriuError(
            f"cannot restore: images dir {images_dir} lacks {', '.join(missing)}"
            " (not a CRIU dump, or an incomplete one)",
            images_dir=images_dir,
        )
    pids = image_pids(images_dir)
    busy = wait_pids_free(pids, pid_wait_s)
    if busy:
        desc = ", ".join(f"{p} ({describe_pid(p)})" for p in busy)
        raise CriuError(
            f"cannot restore images dir {images_dir}: PIDs still in use: {desc}",
            images_dir=images_dir,
        )
    criu_remap.put_back(images_dir)
    own_work_dir = work_dir is None
    if own_work_dir:
        work_dir = Path(tempfile.mkdtemp(prefix="cuinterpose-criu-restore-"))
    else:
        work_dir = Path(work_dir).absolute()
        work_dir.mkdir(parents=True, exist_ok=True)
    if work_dir.resolve() == images_dir.resolve():
        raise CriuError(
            "restore work_dir must differ from the images dir (kept read-only)",
            images_dir=images_dir,
        )
    pidfile = work_dir / "restore.pid"
    pidfile.unlink(missing_ok=True)
    args = [
        *common_args(images_dir, work_dir, log_name),
        "--restore-detached",
        "--pidfile",
        str(pidfile),
        *RESTORE_OPTS,
    ]
    for kind, path in join_ns:
        args += ["--join-ns", f"{kind}:{path}"]
    for fd, resource in inherit_fds:
        args += ["--inherit-fd", f"fd[{int(fd)}]:{resource}"]
    if leave_stopped:
        args.append("--leave-stopped")
    args += list(extra_args)
    try:
        run(
            "restore",
            args,
            images_dir=images_dir,
            log_path=work_dir / log_name,
            setup=setup,
            pass_fds=[int(fd) for fd, _ in inherit_fds],
            timeout_s=timeout_s,
        )
    except CriuError:
        if own_work_dir and not (work_dir / log_name).exists():
            shutil.rmtree(work_dir, ignore_errors=True)  # CRIU never started: nothing to keep
        raise
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError) as e:
        raise CriuError(
            f"criu restore of {images_dir} succeeded but left no pid in {pidfile}: {e}",
            images_dir=images_dir,
            log_path=work_dir / log_name,
            log_tail=log_tail(work_dir / log_name),
        ) from e
    if own_work_dir:
        # kept only when the restore fails (its log is named in the error)
        shutil.rmtree(work_dir, ignore_errors=True)
    return pid

"""The descriptors and mounts of a process tree, as /proc shows them, for the dump.

- :func:`external_pipes`: pipes with one end outside the tree (manifest ``external_pipes``);
- :func:`external_files`: files opened outside the tree's mount namespace (``external_files``);
- :func:`outside_mounts`: cwd, root or mapped files that lie outside it (CRIU cannot dump them).

All read ``/proc/PID/fd``, ``fdinfo``, ``mountinfo`` and ``maps`` (proc(5)); a process or fd
that vanishes while being read is skipped.
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

from cuinterpose.agent.mech.inherit import external_file_key
from cuinterpose.agent.mech.procfs import fd_flags, fd_targets, fdinfo, fdinfo_flags, mount_ids


def external_pipes(root: int, pids: Iterable[int], proc_root: str = "/proc") -> list[dict]:
    """Pipe fds of the processes ``pids`` (one tree) whose other end is outside them: a pipe
    inode (``/proc/PID/fd/N`` -> ``pipe:[INODE]``) that the tree has open only for writing
    (``direction`` "write": the reader is outside, e.g. a container runtime's stdout pipe) or
    only for reading ("read"), by the access mode of ``/proc/PID/fdinfo/N`` ``flags``.
    ``[{"root", "pid", "fd", "inode", "direction"}]``, by pid then fd. CRIU dumps such a
    pipe, but restores it with the outside end missing unless it is handed a new one
    (``--inherit-fd fd[N]:pipe:[INODE]``, agent/run/restore.py). A process or fd that vanishes
    while being read is skipped."""
    uses: dict[int, list[tuple[int, int, int]]] = {}
    for pid in pids:
        for fd, target in fd_targets(pid, proc_root):
            try:
                if not (target.startswith("pipe:[") and target.endswith("]")):
                    continue
                flags = fd_flags(pid, fd, proc_root)
            except (OSError, ValueError):
                continue
            uses.setdefault(int(target[6:-1]), []).append((pid, fd, flags & os.O_ACCMODE))
    out = []
    for inode, us in uses.items():
        modes = {m for _, _, m in us}
        if modes == {os.O_WRONLY}:
            direction = "write"
        elif modes == {os.O_RDONLY}:
            direction = "read"
        else:
            continue  # both ends (or O_RDWR) inside: CRIU restores it
        out += [
            {"root": int(root), "pid": pid, "fd": fd, "inode": inode, "direction": direction}
            for pid, fd, _ in us
        ]
    return sorted(out, key=lambda e: (e["pid"], e["fd"]))


#: fd targets CRIU dumps by other means than a path on a mount (memfd: its own image)
_NOT_ON_A_MOUNT = ("/memfd:",)


def external_files(root: int, pids: Iterable[int], proc_root: str = "/proc") -> list[dict]:
    """Fds of the processes ``pids`` (one tree) on a mount that is in none of the tree's mount
    namespaces: a file opened outside it (a container's ``/dev/null`` stdin or a log file a
    runtime opened in the host's namespace). CRIU, run inside the tree's mount namespace,
    looks the fd's mount (``mnt_id`` of ``/proc/PID/fdinfo/N``) up among that namespace's
    mounts (``/proc/PID/mountinfo``) and fails the dump ("Can't lookup mount=N for fd=M")
    unless it is dumped as external (``--external file[MNT_ID:INODE]``, then restored from an
    fd handed over with ``--inherit-fd``, agent/mech/inherit.py).

    Only fds whose target is a path (``/...``; not a pipe, socket, anonymous inode or memfd)
    count. ``[{"root", "pid", "fd", "path" (as the kernel shows it to the agent), "mnt_id",
    "inode", "flags" (fdinfo ``flags``, an int), "access" ("r", "w" or "rw"), "st_mode",
    "rdev"}]``, by pid then fd. A process or fd that vanishes while being read is skipped."""
    pids = list(pids)
    known = _tree_mount_ids(pids, proc_root)
    if known is None:
        return []  # the tree is gone: CRIU will say so
    out = []
    for pid in pids:
        base = f"{proc_root}/{pid}"
        for fd, target in fd_targets(pid, proc_root):
            try:
                if not target.startswith("/") or target.startswith(_NOT_ON_A_MOUNT):
                    continue
                info = fdinfo(f"{base}/fdinfo/{fd}")
                mnt_id = int(info["mnt_id"])
                if mnt_id in known:
                    continue
                flags = fdinfo_flags(info, f"{base}/fdinfo/{fd}")
                st = os.stat(f"{base}/fd/{fd}")
            except (OSError, KeyError, ValueError):
                continue
            out.append(
                {
                    "root": int(root),
                    "pid": pid,
                    "fd": fd,
                    "path": target,
                    "mnt_id": mnt_id,
                    "inode": st.st_ino,
                    "flags": flags,
                    "access": {os.O_RDONLY: "r", os.O_WRONLY: "w"}.get(flags & os.O_ACCMODE, "rw"),
                    "st_mode": st.st_mode,
                    "rdev": st.st_rdev,
                }
            )
    return sorted(out, key=lambda e: (e["pid"], e["fd"]))


def _tree_mount_ids(pids: Iterable[int], proc_root: str = "/proc") -> Optional[set[int]]:
    """The mount IDs of every mount namespace of the processes ``pids`` (one tree); None
    when none of them could be read (the tree is gone)."""
    known: set[int] = set()
    seen_ns: set[int] = set()
    for pid in pids:
        try:
            ns = os.stat(f"{proc_root}/{pid}/ns/mnt").st_ino
            if ns not in seen_ns:
                known |= mount_ids(pid, proc_root)
                seen_ns.add(ns)
        except OSError:
            continue
    return known if seen_ns else None


#: ``/proc/PID/map_files`` targets that CRIU dumps as memory, not as a file on a mount: memfd,
#: shared anonymous memory, SysV shm, anonymous hugetlb, AIO rings, dma-bufs (all on
#: kernel-internal mounts that no mountinfo shows)
_MAPPED_NOT_FILES = (
    "/memfd:",
    "/dev/zero (deleted)",
    "/SYSV",
    "/anon_hugepage",
    "/[aio]",
    "/dmabuf:",
)


def _opath_mount(path: str) -> tuple[int, int]:
    """(mnt_id, inode) of what ``path`` (a ``/proc`` magic link: cwd, root, a map_files
    entry) leads to: opened ``O_PATH`` (following the link, never reading the file) and read
    back from ``/proc/self/fdinfo/FD``."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        return int(fdinfo(f"/proc/self/fdinfo/{fd}")["mnt_id"]), os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _internal_shm_mount() -> Optional[int]:
    """The mnt_id of the kernel's internal shmem mount (memfd, shared anonymous memory):
    that of a memfd made here."""
    try:
        fd = os.memfd_create("cuinterpose-mnt-probe", os.MFD_CLOEXEC)
    except (OSError, AttributeError):
        return None
    try:
        return int(fdinfo(f"/proc/self/fdinfo/{fd}")["mnt_id"])
    except (OSError, KeyError, ValueError):
        return None
    finally:
        os.close(fd)


def outside_mounts(root: int, pids: Iterable[int], proc_root: str = "/proc") -> list[dict]:
    """What of the processes ``pids`` (one tree) is on a mount in none of the tree's mount
    namespaces, other than open fds (those are :func:`external_files`): the working directory
    (``/proc/PID/cwd``), the root directory (``/proc/PID/root``) and files only mapped
    (``/proc/PID/map_files/*``), each opened ``O_PATH`` and its ``mnt_id`` read from
    ``/proc/self/fdinfo/FD``. CRIU fails the dump of any of them ("Can't lookup mount=N for
    fd=-3", criu/files-reg.c), and ``--external file[...]`` covers a mapping only when the tree
    also holds an fd on that file (then it is one of ``external_files``, and skipped here).
    Mappings CRIU dumps as memory (memfd, shared anonymous, SysV) are skipped.

    ``[{"root", "pid", "what" (in words), "kind" ("cwd", "root" or "mapping"), "path",
    "mnt_id"}]``, by pid (cwd, root, then mappings by address; one row per mapped file). A
    process or entry that vanishes while being read is skipped."""
    pids = list(pids)
    known = _tree_mount_ids(pids, proc_root)
    if known is None:
        return []
    shm = _internal_shm_mount()
    ext = {external_file_key(f) for f in external_files(root, pids, proc_root)}
    out = []
    for pid in sorted(pids):
        base = f"{proc_root}/{pid}"
        for kind, what in (("cwd", "working directory"), ("root", "root directory")):
            try:
                path = os.readlink(f"{base}/{kind}")
                mnt_id, _ = _opath_mount(f"{base}/{kind}")
            except (OSError, KeyError, ValueError):
                continue
            if mnt_id not in known:
                out.append(
                    {
                        "root": int(root),
                        "pid": pid,
                        "kind": kind,
                        "path": path,
                        "mnt_id": mnt_id,
                        "what": f"has its {what} {path} on mount {mnt_id}",
                    }
                )
        try:
            ranges = sorted(os.listdir(f"{base}/map_files"), key=lambda r: int(r.split("-")[0], 16))
        except (OSError, ValueError):
            continue
        seen = set()
        for rng in ranges:
            entry = f"{base}/map_files/{rng}"
            try:
                path = os.readlink(entry)
                if not path.startswith("/") or path.startswith(_MAPPED_NOT_FILES):
                    continue
                mnt_id, ino = _opath_mount(entry)
            except (OSError, KeyError, ValueError):
                continue
            if mnt_id in known or mnt_id == shm or (mnt_id, ino) in seen:
                continue
            seen.add((mnt_id, ino))
            if external_file_key({"mnt_id": mnt_id, "inode": ino}) in ext:
                continue
            out.append(
                {
                    "root": int(root),
                    "pid": pid,
                    "kind": "mapping",
                    "path": path,
                    "mnt_id": mnt_id,
                    "what": f"has a mapping of {path} ({rng}) on mount {mnt_id}, with no "
                    "fd open on it",
                }
            )
    return out

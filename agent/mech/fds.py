"""The descriptors and mounts of a process tree, as /proc shows them, for the dump.

- :func:`external_pipes`: pipes with one end outside the tree (manifest ``external_pipes``);
- :func:`external_files`: files opened outside the tree's mount namespace (``external_files``);
- :func:`outside_mounts`: cwd, root or mapped files that lie outside it (CRIU cannot dump them);
- :func:`unlinked_files`, :func:`ghost_limit_args`: unlinked files it holds, which CRIU dumps as
  ghost files up to ``--ghost-limit``.

All read ``/proc/PID/fd``, ``fdinfo``, ``mountinfo`` and ``maps`` (proc(5)); a process or fd
that vanishes while being read is skipped.
"""

from __future__ import annotations

import os
import stat
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


#: CRIU's default ``--ghost-limit`` (criu(8): "By default, up to 1M file is allowed")
CRIU_GHOST_LIMIT = 1 << 20
#: deleted targets CRIU carries by other means than a ghost file: a memfd (its own image), shared
#: anonymous memory (``/dev/zero``), System V shared memory (``/SYSV...``)
_NOT_GHOSTS = ("/memfd:", "/dev/zero", "/SYSV")
_DELETED = " (deleted)"


def _ghost_path(target: str) -> Optional[str]:
    if (
        not target.startswith("/")
        or not target.endswith(_DELETED)
        or target.startswith(_NOT_GHOSTS)
    ):
        return None
    return target[: -len(_DELETED)]


def unlinked_files(pids: Iterable[int], proc_root: str = "/proc") -> list[dict]:
    """The unlinked regular files the processes ``pids`` hold open or map (an fd or a mapping
    whose target ends ``" (deleted)"``: NCCL's SHM fallback maps ``/dev/shm/nccl-*`` and
    unlinks it once its peer attached, src/misc/shmutils.cc), which CRIU dumps as *ghost files*
    into the images, and only up to ``--ghost-limit`` bytes.

    ``[{"pid", "path", "bytes", "allocated", "links", "dev", "inode", "via"}]`` by pid, from
    ``fstat`` of ``/proc/PID/fd/N`` or ``/proc/PID/map_files/RANGE``: ``allocated`` is
    ``st_blocks`` times 512, what CRIU holds against its limit (criu/files-reg.c
    ``dump_ghost_remap``); ``via`` is ``"fd N"`` or ``"map 0xSTART-0xEND"``; ``links`` is the
    inode's link count, > 0 when only the name the process used is gone, as for glibc's
    ``sem_open``, which links a temporary file to the semaphore's name and unlinks the temporary
    one (CRIU then needs ``--link-remap``). A process, fd or mapping that vanishes while being
    read is skipped."""
    out = []
    for pid in pids:
        for fd, target in fd_targets(pid, proc_root):
            path = _ghost_path(target)
            if path:
                _add_ghost(out, pid, path, f"{proc_root}/{pid}/fd/{fd}", f"fd {fd}")
        try:
            with open(f"{proc_root}/{pid}/maps") as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(maxsplit=5)
            path = _ghost_path(parts[5].strip()) if len(parts) == 6 else None
            if path:
                start, end = parts[0].split("-")
                _add_ghost(
                    out,
                    pid,
                    path,
                    f"{proc_root}/{pid}/map_files/{start}-{end}",
                    f"map 0x{start}-0x{end}",
                )
    return out


def _add_ghost(out: list[dict], pid: int, path: str, link: str, via: str) -> None:
    try:
        st = os.stat(link)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        out.append(
            {
                "pid": pid,
                "path": path,
                "bytes": st.st_size,
                "allocated": st.st_blocks * 512,  # what CRIU compares with --ghost-limit
                "links": st.st_nlink,
                "dev": st.st_dev,
                "inode": st.st_ino,
                "via": via,
            }
        )


def ghost_limit_args(files: list[dict]) -> tuple[str, ...]:
    """What CRIU's dump needs for the deleted files the tree holds (:func:`unlinked_files`):
    ``--ghost-limit BYTES`` when the largest file without any link left is over CRIU's default
    limit, so that CRIU carries it instead of failing the dump ("Can't dump ghost file ... of N
    size, increase limit"; BYTES is the bytes that file has allocated, which CRIU compares: the
    images then hold each such file's bytes), and ``--link-remap`` when a deleted name's inode still has links (a
    ``multiprocessing`` semaphore, which ``torch.multiprocessing`` queues hold: "Can't create
    link remap ... Use link-remap option"; agent/mech/criu_remap.py keeps the links CRIU then
    makes). ``()`` when neither applies. ``files``: :func:`unlinked_files` of the tree."""
    largest = max((f["allocated"] for f in files if f["links"] == 0), default=0)
    args: tuple[str, ...] = ("--ghost-limit", str(largest)) if largest > CRIU_GHOST_LIMIT else ()
    return args + (("--link-remap",) if any(f["links"] > 0 for f in files) else ())

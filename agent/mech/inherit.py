"""What a restore hands CRIU for one tree (:func:`restore_options`): ``--join-ns`` namespaces,
the :class:`~cuinterpose.agent.mech.criu_child.ChildSetup` of the cgroups to join, and the fds
passed with ``--inherit-fd`` (criu(8); criu.org "Inheriting FDs on restore") for the external
pipes and files of the manifest (``external_pipes``, ``external_files``), taken from a
:class:`~cuinterpose.agent.mech.placement.Placement` (pidfd_getfd(2)) or reopened by path;
and the fixups after the restore (:meth:`RestoreOptions.after_restore`). docs/criu.md,
"Namespaces, cgroups and stdio: restoring into a placement", explains the choices. The
``placement`` arguments are :class:`Placement` objects, used by their attributes only: this
module is below placement.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import os
import signal
import stat
from typing import Iterable, Optional

from cuinterpose.agent.errors import PlacementError
from cuinterpose.agent.mech import libc

__all__ = [
    "RestoreOptions",
    "restore_options",
    "external_file_fd",
    "external_file_key",
    "pidfd_getfd",
    "appends",
    "flag_names",
]

#: flags of a recorded external file kept when the agent reopens it by path (never O_CREAT,
#: O_TRUNC: the file must exist and keep its contents)
_REOPEN_FLAGS = (
    os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK | os.O_DIRECTORY | os.O_PATH | os.O_SYNC | os.O_DSYNC
)


@dataclasses.dataclass
class RestoreOptions:
    """What ``criu.restore`` gets for one tree (:func:`restore_options`): ``join_ns``
    ``[(kind, path)]``, ``inherit_fds`` ``[(fd, resource)]``, ``setup`` (a ``ChildSetup`` or
    None); ``fds``: the fds opened for it (:meth:`close` them after the restore);
    ``inherited``: the external pipes handed over, each with the ``placement_fd`` it got;
    ``files``: the external files handed over, each with ``handed`` (what it got, in words)
    and ``placement_fd`` (None when reopened by path); ``fixups``: restored fds to fix before
    the tree runs (:meth:`after_restore`; the restore then leaves the tree stopped)."""

    join_ns: list = dataclasses.field(default_factory=list)
    inherit_fds: list = dataclasses.field(default_factory=list)
    setup: object = None
    fds: list = dataclasses.field(default_factory=list)
    inherited: list = dataclasses.field(default_factory=list)
    files: list = dataclasses.field(default_factory=list)
    fixups: list = dataclasses.field(default_factory=list)

    def kwargs(self) -> dict:
        """Keyword arguments for ``criu.restore`` (only those that are set)."""
        kw = {}
        if self.join_ns:
            kw["join_ns"] = list(self.join_ns)
        if self.inherit_fds:
            kw["inherit_fds"] = list(self.inherit_fds)
        if self.setup:
            kw["setup"] = self.setup
        if self.fixups:
            kw["leave_stopped"] = True
        return kw

    def after_restore(self, pids: Iterable[int]) -> list[dict]:
        """Once CRIU restored the tree (stopped, when there are ``fixups``): fix each restored
        fd that got a placement's regular file in place of a pipe, then SIGCONT every pid in
        ``pids`` (the tree's, ``criu.image_pids``). CRIU reopens an inherited pipe's fd
        through ``/proc/self/fd/N`` with the pipe's dumped flags (criu/pipes.c
        ``reopen_pipe``): for a regular file that is a new open file description at offset 0
        without ``O_APPEND``, which would overwrite the file from its start. The agent takes
        that description (pidfd_getfd(2) of the restored fd), sets ``O_APPEND`` and seeks to
        the end. Returns the fixups done; raises ``PlacementError`` (the tree stays stopped,
        the caller kills it) when a restored fd is not the file handed."""
        done = []
        if not self.fixups:
            return done
        for fx in self.fixups:
            fd = pidfd_getfd(fx["pid"], fx["fd"], f"restored pid {fx['pid']}")
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (fx["dev"], fx["ino"]):
                    raise PlacementError(
                        f"restored pid {fx['pid']} fd {fx['fd']} is not the placement's file "
                        f"{fx['target']} handed to it (device {st.st_dev}, inode "
                        f"{st.st_ino})",
                        pid=fx.get("placement_pid"),
                    )
                fl = fcntl.fcntl(fd, fcntl.F_GETFL)
                fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_APPEND)
                os.lseek(fd, 0, os.SEEK_END)
                done.append({**fx, "flags": fcntl.fcntl(fd, fcntl.F_GETFL)})
            except OSError as e:
                raise PlacementError(
                    f"cannot set O_APPEND on restored pid {fx['pid']} fd "
                    f"{fx['fd']} ({fx['target']}): {e.strerror or e}",
                    pid=fx.get("placement_pid"),
                ) from None
            finally:
                os.close(fd)
        for p in pids:
            try:
                os.kill(int(p), signal.SIGCONT)
            except ProcessLookupError:
                pass
        return done

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def pidfd_getfd(pid: int, fd: int, who: str) -> int:
    """pidfd_getfd(2): a close-on-exec copy of process ``pid``'s fd ``fd`` (the same open file
    description). Raises ``PlacementError`` naming ``who``."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        raise PlacementError(
            f"cannot take fd {fd} of {who}: pidfd_open: {e.strerror or e}"
        ) from None
    try:
        new = libc.fn("syscall")(libc.SYS_pidfd_getfd, pidfd, fd, 0)
        if new < 0:
            err = ctypes.get_errno()
            raise PlacementError(f"cannot take fd {fd} of {who}: pidfd_getfd: {os.strerror(err)}")
        return new
    finally:
        os.close(pidfd)


def _file_kind(st_mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISLNK, "symlink"),
    ):
        if test(st_mode):
            return name
    return f"file of mode {st_mode:o}"


def _not_reopenable(st: os.stat_result, target: str) -> Optional[str]:
    """What the file behind an fd is ("a socket", "an anonymous inode") when ``open(2)`` of
    ``/proc/self/fd/N`` fails for it with ENXIO (checked for both), which CRIU does to every
    fd handed for an inherited pipe (criu/pipes.c ``reopen_pipe``); None otherwise."""
    if stat.S_ISSOCK(st.st_mode):
        return "a socket"
    if target.startswith("anon_inode:"):
        return "an anonymous inode"
    return None


def _same_kind(st: os.stat_result, rec: dict) -> Optional[str]:
    """None when ``st`` can stand for the recorded external file ``rec`` (CRIU reopens it and
    refuses another ``st_mode``: "File ... has bad mode"), else why not."""
    want = int(rec["st_mode"])
    if st.st_mode != want:
        return (
            f"a {_file_kind(st.st_mode)} of mode {st.st_mode:o}, the tree's was a "
            f"{_file_kind(want)} of mode {want:o}"
        )
    if (stat.S_ISCHR(want) or stat.S_ISBLK(want)) and st.st_rdev != int(rec.get("rdev", 0)):
        return (
            f"device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}, the tree's was "
            f"{os.major(int(rec.get('rdev', 0)))}:{os.minor(int(rec.get('rdev', 0)))}"
        )
    return None


def appends(flags: int) -> bool:
    """Whether open-file ``flags`` are ``O_WRONLY|O_APPEND`` (the one use of a file CRIU does
    not size-check at restore)."""
    return (flags & os.O_ACCMODE) == os.O_WRONLY and bool(flags & os.O_APPEND)


def external_file_fd(placement: Optional[object], uses: list[dict]) -> tuple[int, dict]:
    """An fd for one external file of a tree (``uses``: its manifest ``external_files``
    records, one file ``[mnt_id:inode]``, any number of pid/fd): ``(fd, how)``.

    With a placement, the placement's fd of the same number as one of the uses (0-2, lowest
    first), open for the way the tree used it, when it is the same kind of file
    (:func:`_same_kind`; a regular file only when *every* use is ``O_WRONLY|O_APPEND``: CRIU
    reopens every use, an ``O_RDWR`` one at its offset too, on the fd handed, and size-checks
    each use that is not); else the recorded path reopened here, in the agent's mount
    namespace, with the recorded access mode, ``O_APPEND`` and ``O_NONBLOCK`` (never created
    or truncated), and checked to be the same kind. ``how``: ``{"handed", "placement_fd"}``.
    Raises ``PlacementError`` naming pid, fd and path when nothing fits."""
    first = min(uses, key=lambda u: (u["fd"], u["pid"]))
    rec = first
    why_not = []
    # CRIU reopens *every* use of the file through /proc/self/fd/N of the one fd handed, with
    # that use's flags and offset, and size-checks each use not held O_WRONLY|O_APPEND: a
    # placement's regular file (another file than the tree's) fits only when no use is such
    sizable = sorted(
        (u for u in uses if not appends(u["flags"])), key=lambda u: (u["pid"], u["fd"])
    )
    if placement is not None:
        by_fd = {s.fd: s for s in placement.stdio}
        for u in sorted(uses, key=lambda u: (u["fd"], u["pid"])):
            s = by_fd.get(u["fd"])
            if s is None:
                continue
            direction = "read" if (u["flags"] & os.O_ACCMODE) == os.O_RDONLY else "write"
            if not s.allows(direction):
                why_not.append(f"its fd {s.fd} is not open for {direction}ing")
                continue
            try:
                fd = placement.open_stdio(s, direction)
            except PlacementError as e:
                why_not.append(e.reason)
                continue
            st = os.fstat(fd)
            bad = _same_kind(st, u)
            if bad is None and stat.S_ISREG(st.st_mode) and sizable:
                v = sizable[0]
                bad = (
                    f"a regular file, and the tree's pid {v['pid']} fd {v['fd']} on the "
                    f"file is {flag_names(v['flags'] & _REOPEN_FLAGS)}, not "
                    "O_WRONLY|O_APPEND: CRIU would reopen that fd on this file too, at its "
                    "offset, and check its size"
                )
            if bad is None:
                return fd, {"handed": f"placement fd {s.fd} ({s.target})", "placement_fd": s.fd}
            os.close(fd)
            why_not.append(f"its fd {s.fd} ({s.target}) is {bad}")
    path = rec["path"]
    flags = rec["flags"] & _REOPEN_FLAGS
    if stat.S_ISFIFO(int(rec["st_mode"])):
        flags = (flags & ~os.O_ACCMODE) | os.O_RDWR | os.O_NONBLOCK  # never blocks
    tree = (
        f"pid {rec['pid']} fd {rec['fd']} holds {path} (opened outside the tree's mount "
        f"namespace, mount {rec['mnt_id']}, inode {rec['inode']})"
    )
    pl = (" and the placement's fds do not fit (" + "; ".join(why_not) + ")") if why_not else ""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise PlacementError(
            f"{tree}, which cannot be reopened here: {e.strerror or e}{pl}",
            pid=placement.pid if placement else None,
        ) from None
    bad = _same_kind(os.fstat(fd), rec)
    if bad is not None:
        os.close(fd)
        raise PlacementError(
            f"{tree}, but {path} here is {bad}{pl}", pid=placement.pid if placement else None
        )
    return fd, {
        "handed": f"{path} reopened in the agent's mount namespace ({flag_names(flags)})",
        "placement_fd": None,
    }


def flag_names(flags: int) -> str:
    """``flags`` in words: ``"O_WRONLY|O_APPEND"``."""
    names = [
        {os.O_RDONLY: "O_RDONLY", os.O_WRONLY: "O_WRONLY", os.O_RDWR: "O_RDWR"}.get(
            flags & os.O_ACCMODE, "O_RDONLY"
        )
    ]
    for f, n in (
        (os.O_APPEND, "O_APPEND"),
        (os.O_NONBLOCK, "O_NONBLOCK"),
        (os.O_DIRECTORY, "O_DIRECTORY"),
        (os.O_PATH, "O_PATH"),
        (os.O_SYNC, "O_SYNC"),
    ):
        if flags & f == f:
            names.append(n)
    return "|".join(names)


def external_file_key(rec: dict) -> str:
    """CRIU's name of an external file: ``file[MNT_ID:INODE]``, both in hex
    (criu/files-reg.c ``dump_one_reg_file``)."""
    return f"file[{int(rec['mnt_id']):x}:{int(rec['inode']):x}]"


def restore_options(
    placement: Optional[object],
    external_pipes: Iterable[dict] = (),
    external_net: str = "",
    *,
    root: Optional[int] = None,
    external_files: Iterable[dict] = (),
) -> RestoreOptions:
    """CRIU restore options of one tree, from its manifest records.

    - ``placement`` None: an ``external_net`` (the images' network namespace was dumped as
      external, ``criu.EXTERNAL_NET_KEY``) gets the agent's own network namespace
      (``--inherit-fd fd[N]:KEY`` on ``/proc/self/ns/net``); external files are reopened by
      path here (:func:`external_file_fd`); external pipes stay as CRIU restores them (the
      outside end missing).
    - with a placement: ``--join-ns`` for each of its namespaces (its ``net`` through
      ``--inherit-fd`` instead when ``external_net``: CRIU refuses ``--join-ns net`` for such
      images), its cgroups through ``setup`` (a ``ChildSetup`` for CRIU's child), for each
      external pipe inode (``external_pipes``: ``{"pid", "fd", "inode", "direction"}``) the
      placement's matching stdio fd (:meth:`Placement.stdio_for` of the lowest fd using it;
      :meth:`Placement.open_stdio`) as ``--inherit-fd fd[N]:pipe:[INODE]`` (a regular file
      there is fixed to ``O_APPEND`` after the restore: ``fixups``), and for each external
      file (``external_files``) :func:`external_file_fd` as ``--inherit-fd
      fd[N]:file[MNT_ID:INODE]``.

    Raises ``PlacementError`` (every fd opened so far closed again)."""
    opts = RestoreOptions()
    tree = f"tree {root}: " if root is not None else ""
    try:
        if placement is not None:
            opts.join_ns = [
                (n.kind, n.path)
                for n in placement.namespaces
                if not (external_net and n.kind == "net")
            ]
            setup = placement.child_setup()
            opts.setup = setup if setup else None
        if external_net:
            net = placement.namespace("net") if placement is not None else None
            path = net.path if net else "/proc/self/ns/net"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise PlacementError(
                    f"{tree}cannot open the network namespace {path}: {e.strerror or e}",
                    pid=placement.pid if placement else None,
                ) from None
            opts.fds.append(fd)
            if net is not None and os.fstat(fd).st_ino != net.inode:
                raise PlacementError(f"left its net namespace [{net.inode}]", pid=placement.pid)
            opts.inherit_fds.append((fd, external_net))
        if placement is not None:
            by_inode: dict[int, list[dict]] = {}
            for p in external_pipes:
                by_inode.setdefault(int(p["inode"]), []).append(p)
            for inode, uses in sorted(by_inode.items()):
                first = min(uses, key=lambda p: p["fd"])
                try:
                    s = placement.stdio_for(first["fd"], first["direction"])
                except PlacementError as e:
                    raise PlacementError(
                        f"{tree}pid {first['pid']} fd {first['fd']} {first['direction']}s "
                        f"pipe:[{inode}], whose other end was outside the tree, but the "
                        f"placement {e.reason}",
                        pid=placement.pid,
                    ) from None
                fd = placement.open_stdio(s, first["direction"])
                opts.fds.append(fd)
                st = os.fstat(fd)
                kind = _not_reopenable(st, s.target)
                if kind:
                    raise PlacementError(
                        f"{tree}pid {first['pid']} fd {first['fd']} {first['direction']}s "
                        f"pipe:[{inode}], whose other end was outside the tree, but the "
                        f"placement pid {placement.pid} fd {s.fd} ({s.target}) is {kind}: CRIU "
                        "reopens the fd handed for such a pipe through /proc/self/fd/N "
                        '(criu/pipes.c reopen_pipe), which fails for it ("No such device or '
                        f'address"); give the placeholder a pipe, a regular file or /dev/null '
                        f"as its fd {s.fd}",
                        pid=placement.pid,
                    )
                opts.inherit_fds.append((fd, f"pipe:[{inode}]"))
                opts.inherited += [{**p, "placement_fd": s.fd} for p in uses]
                if stat.S_ISREG(st.st_mode):
                    opts.fixups += [
                        {
                            "pid": p["pid"],
                            "fd": p["fd"],
                            "dev": st.st_dev,
                            "ino": st.st_ino,
                            "target": s.target,
                            "placement_pid": placement.pid,
                        }
                        for p in uses
                    ]
        by_key: dict[str, list[dict]] = {}
        for f in external_files:
            by_key.setdefault(external_file_key(f), []).append(f)
        for key, uses in sorted(by_key.items()):
            try:
                fd, how = external_file_fd(placement, uses)
            except PlacementError as e:
                raise PlacementError(f"{tree}{e.reason}", pid=e.pid) from None
            opts.fds.append(fd)
            opts.inherit_fds.append((fd, key))
            opts.files += [{**u, **how} for u in sorted(uses, key=lambda u: (u["pid"], u["fd"]))]
    except BaseException:
        opts.close()
        raise
    return opts

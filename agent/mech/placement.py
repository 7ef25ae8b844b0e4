"""Where a restore puts the restored trees: the cgroups, namespaces and stdio of one running
process (a Kubernetes placeholder container's init, by host pid).

Kubernetes asks for a restore by starting a *placeholder* pod (annotation
``cuinterpose.io/restore-from``); the runtime gives its container cgroups, namespaces and stdio.
``Placement.of_pid(PID)`` reads them from that process once, and ``restore(...,
placement=...)`` (``cuinterpose-agent restore --into-pid PID``) puts the restored trees there:

- **cgroups** (``/proc/PID/cgroup``, cgroup(7): one ``ID:CONTROLLERS:PATH`` line per cgroup v1
  hierarchy, ``0::PATH`` for the v2 one; each hierarchy's mount point from
  ``/proc/self/mountinfo``, proc(5)). CRIU runs with ``--manage-cgroups=ignore``, under which
  it neither records nor recreates cgroups and the restored tasks stay in the cgroups of the
  CRIU process that forks them (criu(8) ``--manage-cgroups``, checked on CRIU 4.1.1 by
  ``tests/criu/test_placement.py``). So the agent starts CRIU from a child that first writes
  its own pid into ``cgroup.procs`` of every placement cgroup it is not already in
  (:meth:`Placement.child_setup`); a refused write fails before CRIU starts, naming the file.
  ``--cgroup-root`` was not used: it only re-roots the cgroup *paths recorded in the images*,
  so it needs cgroups dumped and restored by CRIU (``--manage-cgroups`` other than ignore),
  the same hierarchy layout (v1 controllers, v2) on both nodes, and creates sub-cgroups of
  the dump-time layout below the placeholder's cgroup, where the runtime accounts only the
  placeholder's own cgroup.
- **namespaces** (``/proc/PID/ns/*``, namespaces(7)): by default ``net``, ``ipc``, ``uts``,
  joined with CRIU's ``--join-ns NS:/proc/PID/ns/NS`` (criu(8): supported for ``ipc``,
  ``net``, ``time``, ``user`` and ``uts``). Not ``mnt``: ``--join-ns`` does not take it (CRIU
  restores a mount namespace only from its own images, with ``--root``); the restored files
  are reopened by path in the mount namespace CRIU runs in, so when the placement process has
  a mount namespace of its own, CRIU's child enters it before CRIU starts (``mnt``,
  agent/mntns.py): the files come back as the placeholder container sees them. Not ``pid``: ``--join-ns`` refuses
  it (criu(8) points at ``--external pid[...]`` + ``--inherit-fd``), and the trees need their
  original pids, which the agent, sharing the host pid namespace, checks are free. Not
  ``user`` (``--join-ns`` takes it, with a uid and gid inside it): the agent restores as root
  in its own user namespace, so a placement process in another user namespace (a rootless or
  user-namespaced container) is refused: the restored trees would run as the agent's root
  inside its other namespaces. ``time`` may be asked for. Also refused: pid 1 (the init of
  the agent's pid namespace: its cgroups and namespaces are the node's, not a container's)
  and kernel threads (``PF_KTHREAD``, ``/proc/PID/stat`` field 9).
- **stdio** (``/proc/PID/fd/{0,1,2}`` and their ``fdinfo`` access mode): a container's stdio
  are pipes to the runtime shim, outside any dumped tree. The checkpoint records every pipe of
  a tree whose other end is outside it (manifest ``external_pipes``); the restore hands the
  placement's stdin to those the tree read from and its stdout/stderr to those it wrote to,
  through CRIU's ``--inherit-fd fd[N]:pipe:[INODE]`` (criu(8); criu.org "Inheriting FDs on
  restore": a pipe with one end outside the tree cannot be restored from the images). The fd
  handed over shares the placement's open file description (pidfd_getfd(2)): its
  ``O_APPEND``, offset and status flags are the placement's (a regular log file is appended
  to, never overwritten from offset 0); only when pidfd_getfd fails is the file reopened
  through ``/proc/PID/fd/N`` (``O_APPEND`` for a regular file).
- **files opened outside the tree's mount namespace** (a container's ``/dev/null`` stdin or a
  log file the runtime opened in the host's namespace; manifest ``external_files``): CRIU
  dumped them as external (``--external file[MNT_ID:INODE]``) and needs an fd for each at
  restore (``--inherit-fd fd[N]:file[MNT_ID:INODE]``; CRIU reopens that fd through
  ``/proc/self/fd/N`` with the dumped flags and offset, and checks its mode): the placement's
  fd of the same number when it is the same kind of file (same ``st_mode``, same device for a
  device file; a regular file only when *every* fd of the tree on that file is
  ``O_WRONLY|O_APPEND``: CRIU reopens each of them on the one fd handed and size-checks any
  other), else the recorded path reopened in the agent's mount namespace with the recorded
  access mode and ``O_APPEND`` (:func:`external_file_fd`).
- a placement stdio fd that CRIU cannot reopen through ``/proc/self/fd/N`` (a socket, as
  systemd/journald give a service's stdout, or an anonymous inode: ENXIO) is refused when an
  external pipe would need it, naming the placement's fd and the tree's.

``Placement`` only reads ``/proc``; nothing is changed until the restore uses it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import os
import stat
from typing import Iterable, Optional

from cuinterpose.agent.errors import AgentError

__all__ = ["Placement", "Cgroup", "Namespace", "Stdio", "PlacementError", "DEFAULT_NAMESPACES",
           "JOINABLE_NAMESPACES", "parse_cgroup", "cgroup_mounts", "RestoreOptions",
           "restore_options", "external_file_fd", "external_file_key", "PF_KTHREAD"]

#: joined by default: the three a container runtime gives each pod/container of its own
DEFAULT_NAMESPACES = ("net", "ipc", "uts")
#: what CRIU's --join-ns accepts (criu(8), CRIU 4.1: ipc, net, time, user, uts) less ``user``,
#: which needs a uid and gid inside it (``user:PATH,UID,GID``)
JOINABLE_NAMESPACES = ("ipc", "net", "time", "uts")
_WHY_NOT = {
    "mnt": "CRIU's --join-ns does not take a mount namespace (it restores one only from its "
           "images, with --root); run CRIU in that mount namespace instead",
    "pid": "CRIU's --join-ns refuses pid namespaces, and the trees need their original pids",
    "user": "joining a user namespace needs a uid and gid inside it, and the agent's "
            "restores run as root in its own user namespace",
    "cgroup": "CRIU's --join-ns does not take a cgroup namespace; the cgroups themselves are "
              "joined",
}
_ACCMODE = {os.O_RDONLY: "r", os.O_WRONLY: "w", os.O_RDWR: "rw"}
_SYS_pidfd_getfd = 438
#: /proc/PID/stat flags (field 9): a kernel thread (include/linux/sched.h)
PF_KTHREAD = 0x00200000
#: flags of a recorded external file kept when the agent reopens it by path (never O_CREAT,
#: O_TRUNC: the file must exist and keep its contents)
_REOPEN_FLAGS = (os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK | os.O_DIRECTORY | os.O_PATH
                 | os.O_SYNC | os.O_DSYNC)


class PlacementError(AgentError):
    """The placement process cannot be used (gone, unreadable, a cgroup or stdio that cannot be
    joined): phase "placement", ``pid`` the placement pid; nothing was changed."""

    def __init__(self, reason: str, pid: Optional[int] = None, phase: str = "placement"):
        super().__init__(phase, reason, pid=pid)


@dataclasses.dataclass(frozen=True)
class Cgroup:
    """One cgroup membership of the placement process (a ``/proc/PID/cgroup`` line).

    ``hierarchy``: the line's ID (0 for cgroup v2); ``controllers``: its controller list (``()``
    for v2, ``("name=systemd",)`` for a named v1 hierarchy); ``path``: the cgroup, relative to
    the hierarchy root as the agent sees it; ``mount``: where the agent has that hierarchy
    mounted (None: nowhere), ``mount_root``: which cgroup of the hierarchy that mount shows."""

    hierarchy: int
    controllers: tuple[str, ...]
    path: str
    mount: Optional[str]
    mount_root: str = "/"

    @property
    def name(self) -> str:
        """``"cgroup2"`` or the v1 controller list (``"cpu,cpuacct"``)."""
        return ",".join(self.controllers) if self.hierarchy else "cgroup2"

    @property
    def directory(self) -> Optional[str]:
        """The cgroup's directory in the agent's mount namespace (None: not reachable)."""
        if self.mount is None:
            return None
        root = self.mount_root.rstrip("/")
        if root and not (self.path == root or self.path.startswith(root + "/")):
            return None
        rel = self.path[len(root):].lstrip("/")
        return os.path.join(self.mount, rel) if rel else self.mount

    @property
    def procs_file(self) -> Optional[str]:
        d = self.directory
        return os.path.join(d, "cgroup.procs") if d else None

    def line(self) -> str:
        """The ``/proc/PID/cgroup`` line this was read from."""
        return f"{self.hierarchy}:{','.join(self.controllers)}:{self.path}"


@dataclasses.dataclass(frozen=True)
class Namespace:
    """``kind`` ("net", ...), ``path`` (``/proc/PID/ns/KIND``), ``inode`` (its identity,
    namespaces(7))."""

    kind: str
    path: str
    inode: int


@dataclasses.dataclass(frozen=True)
class Stdio:
    """One of the placement's fds 0-2: ``fd``, ``target`` (readlink of ``/proc/PID/fd/N``, e.g.
    ``pipe:[123]``), ``mode`` ("r", "w" or "rw", from the fdinfo ``flags`` access mode) and
    ``path`` (``/proc/PID/fd/N``)."""

    fd: int
    target: str
    mode: str
    path: str

    def allows(self, direction: str) -> bool:
        """Whether the tree may ``direction`` ("read"/"write") through this fd."""
        return (direction == "read" and "r" in self.mode) or (
            direction == "write" and "w" in self.mode)


def parse_cgroup(text: str) -> list[tuple[int, tuple[str, ...], str]]:
    """``/proc/PID/cgroup`` as [(hierarchy id, controllers, path)] (cgroup(7))."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        hid, ctrls, path = line.split(":", 2)
        out.append((int(hid), tuple(c for c in ctrls.split(",") if c), path))
    return out


def cgroup_mounts(mountinfo: str) -> list[tuple[str, str, str, frozenset]]:
    """Cgroup mounts in a ``/proc/PID/mountinfo`` text (proc(5)): [(fstype ("cgroup" or
    "cgroup2"), mount point, root within the hierarchy, super options)]."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        f = left.split()
        r = right.split()
        if len(f) < 5 or len(r) < 3 or r[0] not in ("cgroup", "cgroup2"):
            continue
        unesc = lambda s: s.replace("\\040", " ").replace("\\011", "\t").replace(
            "\\012", "\n").replace("\\134", "\\")
        out.append((r[0], unesc(f[4]), unesc(f[3]), frozenset(r[2].split(","))))
    return out


def _mount_of(hid: int, ctrls: tuple[str, ...], path: str, mounts) -> tuple[Optional[str], str]:
    best = None
    for fstype, point, root, opts in mounts:
        if (fstype == "cgroup2") != (hid == 0):
            continue
        if hid and not set(ctrls) <= opts:
            continue
        r = root.rstrip("/")
        if r and not (path == r or path.startswith(r + "/")):
            continue
        if best is None or len(root) < len(best[1]):   # the widest view of the hierarchy
            best = (point, root)
    return best if best else (None, "/")


def _stat_start_time(text: str) -> int:
    # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[19])          # field 22 (starttime), counting from state = field 3


def _stat_flags(text: str) -> int:
    """``/proc/PID/stat`` field 9 (the task's ``PF_*`` flags)."""
    return int(text[text.rindex(")") + 2:].split()[6])


def _user_ns(base: str, pid: int) -> Namespace:
    """The user namespace of the process at ``base`` (``/proc/PID``); ``PlacementError`` when
    it is not this process's: the agent restores as root in its own user namespace, so the
    restored trees would run as the agent's root inside the placement's other namespaces
    (CRIU can join a user namespace only with a uid and gid inside it, which the agent does
    not pick)."""
    p = f"{base}/ns/user"
    try:
        ino = os.stat(p).st_ino
        mine = os.stat("/proc/self/ns/user").st_ino
    except FileNotFoundError:
        if not os.path.exists(base):
            raise PlacementError(f"no such process (reading {p}): the placement process is "
                                 "gone", pid=pid) from None
        raise PlacementError(f"has no user namespace file {p}", pid=pid) from None
    except OSError as e:
        raise PlacementError(f"cannot read its user namespace ({p}: {e.strerror or e})",
                             pid=pid) from None
    if ino != mine:
        raise PlacementError(
            f"is in another user namespace [{ino}] than the agent's [{mine}] (a rootless or "
            "user-namespaced container): the restored processes would run as the agent's "
            "root inside its other namespaces, and the agent does not map them into a user "
            "namespace; restore into a placeholder without a user namespace of its own",
            pid=pid)
    return Namespace("user", p, ino)


def _read(path: str, pid: int, what: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        raise PlacementError(f"no such process (reading {path}): the placement process is "
                             "gone", pid=pid) from None
    except OSError as e:
        raise PlacementError(f"cannot read its {what} ({path}: {e.strerror or e})",
                             pid=pid) from None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where restored trees go, read from one running process (see the module docstring).

    ``pid``: the placement process (a host pid); ``start_time``: its ``/proc/PID/stat``
    start time (field 22), so a reused pid is noticed; ``cgroups``, ``namespaces``,
    ``stdio``: what the restore joins and hands out; ``proc_root``: the proc mount read."""

    pid: int
    start_time: int
    cgroups: tuple[Cgroup, ...]
    namespaces: tuple[Namespace, ...]
    stdio: tuple[Stdio, ...]
    proc_root: str = "/proc"
    #: its mount namespace when it is not this process's (CRIU's child then enters it:
    #: agent/mntns.py), else None
    mnt: Optional[Namespace] = None
    #: its user namespace (the agent's own: another one is refused), checked again on every
    #: restored process (:meth:`mismatches`); None when not read
    user: Optional[Namespace] = None

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def of_pid(cls, pid: int, *, proc_root: str = "/proc",
               namespaces: Iterable[str] = DEFAULT_NAMESPACES) -> "Placement":
        """Read the placement of process ``pid`` from ``proc_root``. Raises
        ``PlacementError`` (phase "placement", naming ``pid`` and the file) when the process is
        gone or a file is unreadable, a namespace is not one CRIU can join, or a cgroup
        hierarchy of the process is not mounted here."""
        try:
            pid = int(pid)
        except (TypeError, ValueError):
            raise PlacementError(f"placement pid {pid!r} is not a number") from None
        if pid <= 0:
            raise PlacementError(f"placement pid {pid} is not a process id")
        if pid == 1:
            raise PlacementError("is the init of the agent's pid namespace (the node's, or the "
                                 "agent container's): its cgroups and namespaces are not a "
                                 "container's; give the placeholder container's init", pid=pid)
        kinds = list(dict.fromkeys(namespaces))
        for k in kinds:
            if k not in JOINABLE_NAMESPACES:
                why = _WHY_NOT.get(k, f"CRIU --join-ns supports {', '.join(JOINABLE_NAMESPACES)}")
                raise PlacementError(f"cannot join its {k} namespace: {why}", pid=pid)
        base = f"{proc_root}/{pid}"
        stat_text = _read(f"{base}/stat", pid, "stat")
        if _state(stat_text) in ("Z", "X"):
            raise PlacementError("has exited (zombie): the placement process is gone", pid=pid)
        try:
            kthread = bool(_stat_flags(stat_text) & PF_KTHREAD)
        except (ValueError, IndexError):
            raise PlacementError(f"{base}/stat is unreadable (no flags field)", pid=pid) from None
        if kthread:
            raise PlacementError("is a kernel thread (PF_KTHREAD): it has no cgroups, "
                                 "namespaces or stdio of a container to restore into", pid=pid)
        start = _stat_start_time(stat_text)
        user = _user_ns(base, pid)
        mounts = cgroup_mounts(_read("/proc/self/mountinfo", os.getpid(), "mountinfo"))
        cgroups = []
        for hid, ctrls, path in parse_cgroup(_read(f"{base}/cgroup", pid, "cgroups")):
            if path == "/.." or path.startswith("/../"):
                # cgroup_namespaces(7): paths outside the reader's cgroup namespace root
                raise PlacementError(
                    f"its cgroup {hid}:{','.join(ctrls)}:{path} lies outside this agent's "
                    "cgroup namespace: the agent does not run in the node's cgroup namespace "
                    "(serve with kubernetes enabled, and the standalone pod watcher, join pid "
                    "1's when they can; docs/kubernetes.md)", pid=pid)
            point, root = _mount_of(hid, ctrls, path, mounts)
            cgroups.append(Cgroup(hid, ctrls, path, point, root))
        nss = []
        for k in kinds:
            p = f"{base}/ns/{k}"
            try:
                nss.append(Namespace(k, p, os.stat(p).st_ino))
            except FileNotFoundError:
                if not os.path.exists(base):
                    raise PlacementError(f"no such process (reading {p}): the placement "
                                         "process is gone", pid=pid) from None
                raise PlacementError(f"has no {k} namespace file {p} (kernel without "
                                     f"{k} namespaces?)", pid=pid) from None
            except OSError as e:
                raise PlacementError(f"cannot read its {k} namespace ({p}: "
                                     f"{e.strerror or e})", pid=pid) from None
        stdio = []
        for n in (0, 1, 2):
            p = f"{base}/fd/{n}"
            try:
                target = os.readlink(p)
            except FileNotFoundError:
                if not os.path.exists(base):
                    raise PlacementError(f"no such process (reading {p}): the placement "
                                         "process is gone", pid=pid) from None
                continue                                  # fd n is closed
            except OSError as e:
                raise PlacementError(f"cannot read its fd {n} ({p}: {e.strerror or e})",
                                     pid=pid) from None
            info = _read(f"{base}/fdinfo/{n}", pid, f"fd {n} flags")
            flags = next((int(ln.split()[1], 8) for ln in info.splitlines()
                          if ln.startswith("flags:")), None)
            if flags is None:
                raise PlacementError(f"{base}/fdinfo/{n} has no flags line", pid=pid)
            stdio.append(Stdio(n, target, _ACCMODE.get(flags & os.O_ACCMODE, "r"), p))
        mnt = None
        p = f"{base}/ns/mnt"
        try:
            ino = os.stat(p).st_ino
            if ino != os.stat("/proc/self/ns/mnt").st_ino:
                mnt = Namespace("mnt", p, ino)
        except OSError as e:
            raise PlacementError(f"cannot read its mount namespace ({p}: {e.strerror or e})",
                                 pid=pid) from None
        return cls(pid, start, tuple(cgroups), tuple(nss), tuple(stdio), proc_root, mnt, user)

    def namespace(self, kind: str) -> Optional[Namespace]:
        return next((n for n in self.namespaces if n.kind == kind), None)

    def describe(self) -> str:
        """One line for progress rows and errors."""
        ns = ", ".join(f"{n.kind}:[{n.inode}]" for n in self.namespaces)
        cg = ", ".join(f"{c.name}:{c.path}" for c in self.cgroups if c.path != "/")
        io = ", ".join(f"{s.fd}={s.target}" for s in self.stdio)
        mnt = f"; mount namespace [{self.mnt.inode}]" if self.mnt else ""
        return (f"pid {self.pid}: namespaces {ns or '-'}; cgroups {cg or 'all /'}; "
                f"stdio {io or '-'}{mnt}")

    # -- checks ----------------------------------------------------------------------------
    def verify(self) -> None:
        """The placement process is still the one read (same start time) and still in the
        namespaces read. Raises ``PlacementError``."""
        base = f"{self.proc_root}/{self.pid}"
        text = _read(f"{base}/stat", self.pid, "stat")
        if _state(text) in ("Z", "X") or _stat_start_time(text) != self.start_time:
            raise PlacementError("is gone (exited, or its pid was reused since it was "
                                 "read)", pid=self.pid)
        for n in self._checked_namespaces():
            try:
                ino = os.stat(n.path).st_ino
            except FileNotFoundError:
                raise PlacementError(f"is gone (reading {n.path}): the placement process "
                                     "is gone", pid=self.pid) from None
            except OSError as e:
                raise PlacementError(f"cannot read its {n.kind} namespace ({n.path}: "
                                     f"{e.strerror or e})", pid=self.pid) from None
            if ino != n.inode:
                raise PlacementError(f"left its {n.kind} namespace [{n.inode}] (now [{ino}])",
                                     pid=self.pid)

    def _checked_namespaces(self) -> tuple[Namespace, ...]:
        return self.namespaces + tuple(n for n in (self.mnt, self.user) if n is not None)

    def alive(self) -> bool:
        """Whether the placement process is still the one read (not exited, pid not reused)."""
        try:
            with open(f"{self.proc_root}/{self.pid}/stat") as f:
                text = f.read()
        except OSError:
            return False
        return _state(text) not in ("Z", "X") and _stat_start_time(text) == self.start_time

    def cgroups_to_join(self, pid: int | str = "self") -> list[Cgroup]:
        """The placement's cgroups that process ``pid`` (default: this one; a child inherits
        them) is not in. Raises ``PlacementError`` for one that cannot be reached here (its
        hierarchy not mounted, or mounted below that cgroup)."""
        mine = {}
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                mine = {(h, c): p for h, c, p in parse_cgroup(f.read())}
        except OSError:
            pass
        out = []
        for cg in self.cgroups:
            if mine.get((cg.hierarchy, cg.controllers)) == cg.path:
                continue
            if cg.procs_file is None:
                raise PlacementError(f"its cgroup {cg.line()!r} cannot be joined: that "
                                     + ("hierarchy is not mounted here" if cg.mount is None
                                        else f"hierarchy is mounted at {cg.mount} showing only "
                                        f"{cg.mount_root}"), pid=self.pid)
            out.append(cg)
        return out

    def child_setup(self):
        """A :class:`~cuinterpose.agent.mech.criu.ChildSetup` that moves the CRIU child into every
        placement cgroup this process is not in and, when the placement has a mount namespace
        of its own, into that (before CRIU starts: the restored files are then reopened by
        the paths the placement sees, agent/mntns.py)."""
        from cuinterpose.agent.mech.criu import ChildSetup
        return ChildSetup(cgroup_procs=tuple(c.procs_file for c in self.cgroups_to_join()),
                          namespaces=(("mnt", self.mnt.path),) if self.mnt else ())

    def probe_cgroups(self) -> list[str]:
        """Check that a process can join the placement's cgroups, with a short-lived child
        that joins them and exits (cgroup(7): a write to ``cgroup.procs`` can be refused, e.g.
        the v1 ``pids`` limit, a v2 cgroup with controllers enabled for its children, a
        removed cgroup). The probe only joins the cgroups: it enters no namespace (its
        program, this Python, is one of the agent's files, which a container's mount
        namespace need not have; the cgroup files are opened here, so the writes are the
        same), and a probe that cannot be started is a refusal too. Returns the
        ``cgroup.procs`` files joined. Raises ``PlacementError`` naming the file and the
        errno."""
        from cuinterpose.agent.mech.criu import ChildSetup, CriuError, run_setup_probe
        setup = ChildSetup(cgroup_procs=tuple(c.procs_file for c in self.cgroups_to_join()))
        if not setup.cgroup_procs:
            return []
        try:
            run_setup_probe(setup)
        except CriuError as e:
            raise PlacementError(f"cannot put a process into its cgroups: {e}",
                                 pid=self.pid) from None
        return list(setup.cgroup_procs)

    # -- stdio -----------------------------------------------------------------------------
    def stdio_for(self, fd: int, direction: str) -> Stdio:
        """The placement fd handed to a tree fd ``fd`` that ``direction`` ("read"/"write")s a
        pipe to outside the tree: the same number when it is 0-2 and open that way here, else
        stdout then stderr for writing, stdin for reading. Raises ``PlacementError``."""
        by_fd = {s.fd: s for s in self.stdio}
        order = ([fd] if fd in (0, 1, 2) else []) + ([1, 2] if direction == "write" else [0])
        for n in order:
            s = by_fd.get(n)
            if s is not None and s.allows(direction):
                return s
        have = ", ".join(f"{s.fd} ({s.mode})" for s in self.stdio) or "none"
        how = "writing" if direction == "write" else "reading"
        raise PlacementError(f"has no stdio fd open for {how} "
                             f"to hand to the tree's fd {fd} (its fds 0-2: {have})", pid=self.pid)

    def open_stdio(self, s: Stdio, direction: str) -> int:
        """A new fd (close-on-exec) sharing the placement's open file description behind
        ``s`` (pidfd_getfd(2); needs ptrace access to the placement, which the agent, root in
        its user namespace, has): what the tree writes through it goes where the placement's
        own writes go, with its ``O_APPEND``, offset and status flags (a log file opened for
        appending is appended to). When pidfd_getfd fails (a kernel before 5.6, EPERM), the
        file is reopened through ``/proc/PID/fd/N`` (a pipe reopens as a new file description
        of the same pipe, proc(5)) for ``direction``, with ``O_APPEND`` when it is a regular
        file (never written from offset 0 over what is there). Raises ``PlacementError``."""
        try:
            fd = self._getfd(s)
        except PlacementError as first:
            fd = self._reopen(s, direction, first)
        try:
            st = os.fstat(fd)
            now = os.readlink(s.path)
            there = os.stat(s.path)
        except OSError as e:
            os.close(fd)
            raise PlacementError(f"its fd {s.fd} went away ({s.path}: {e.strerror or e})",
                                 pid=self.pid) from None
        if now != s.target or (st.st_dev, st.st_ino) != (there.st_dev, there.st_ino):
            os.close(fd)
            raise PlacementError(f"its fd {s.fd} changed from {s.target} to {now}", pid=self.pid)
        if stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise PlacementError(f"its fd {s.fd} is a directory", pid=self.pid)
        return fd

    def _reopen(self, s: Stdio, direction: str, why: "PlacementError") -> int:
        flags = (os.O_WRONLY if direction == "write" else os.O_RDONLY) | os.O_CLOEXEC
        try:
            if direction == "write" and stat.S_ISREG(os.stat(s.path).st_mode):
                flags |= os.O_APPEND
            return os.open(s.path, flags | os.O_NOCTTY)
        except OSError as e:
            raise PlacementError(f"cannot open its fd {s.fd} ({s.path} -> {s.target}): "
                                 f"{e.strerror or e} (and {why.reason})", pid=self.pid) from None

    def _getfd(self, s: Stdio) -> int:
        """pidfd_getfd(2) of the placement's fd ``s.fd`` (the new fd is close-on-exec)."""
        try:
            return _pidfd_getfd(self.pid, s.fd, f"placement pid {self.pid} ({s.target})")
        except PlacementError as e:
            raise PlacementError(e.reason, pid=self.pid) from None

    # -- after the restore -----------------------------------------------------------------
    def mismatches(self, pid: int) -> list[str]:
        """What of the placement process ``pid`` (a restored one) is not in: namespaces
        (by inode; the user namespace too) and cgroups (by ``/proc/PID/cgroup`` line); []
        when it is placed."""
        out = []
        for n in self._checked_namespaces():
            try:
                ino = os.stat(f"{self.proc_root}/{pid}/ns/{n.kind}").st_ino
            except OSError as e:
                out.append(f"{n.kind} namespace unreadable ({e.strerror or e})")
                continue
            if ino != n.inode:
                out.append(f"{n.kind} namespace [{ino}], not the placement's [{n.inode}]")
        try:
            with open(f"{self.proc_root}/{pid}/cgroup") as f:
                have = {(h, c): p for h, c, p in parse_cgroup(f.read())}
        except OSError as e:
            return out + [f"cgroups unreadable ({e.strerror or e})"]
        for cg in self.cgroups:
            got = have.get((cg.hierarchy, cg.controllers))
            if got != cg.path:
                out.append(f"cgroup {cg.name}:{got}, not the placement's {cg.path}")
        return out


def _state(stat_text: str) -> str:
    try:
        return stat_text[stat_text.rindex(")") + 2:].split()[0]
    except (ValueError, IndexError):
        return "?"


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
        import signal
        done = []
        if not self.fixups:
            return done
        for fx in self.fixups:
            fd = _pidfd_getfd(fx["pid"], fx["fd"], f"restored pid {fx['pid']}")
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (fx["dev"], fx["ino"]):
                    raise PlacementError(
                        f"restored pid {fx['pid']} fd {fx['fd']} is not the placement's file "
                        f"{fx['target']} handed to it (device {st.st_dev}, inode "
                        f"{st.st_ino})", pid=fx.get("placement_pid"))
                fl = fcntl.fcntl(fd, fcntl.F_GETFL)
                fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_APPEND)
                os.lseek(fd, 0, os.SEEK_END)
                done.append({**fx, "flags": fcntl.fcntl(fd, fcntl.F_GETFL)})
            except OSError as e:
                raise PlacementError(f"cannot set O_APPEND on restored pid {fx['pid']} fd "
                                     f"{fx['fd']} ({fx['target']}): {e.strerror or e}",
                                     pid=fx.get("placement_pid")) from None
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


def _pidfd_getfd(pid: int, fd: int, who: str) -> int:
    """pidfd_getfd(2): a close-on-exec copy of process ``pid``'s fd ``fd`` (the same open file
    description). Raises ``PlacementError`` naming ``who``."""
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as e:
        raise PlacementError(f"cannot take fd {fd} of {who}: pidfd_open: {e.strerror or e}") \
            from None
    try:
        new = libc.syscall(_SYS_pidfd_getfd, pidfd, fd, 0)
        if new < 0:
            err = ctypes.get_errno()
            raise PlacementError(f"cannot take fd {fd} of {who}: pidfd_getfd: "
                                 f"{os.strerror(err)}")
        return new
    finally:
        os.close(pidfd)


def _file_kind(st_mode: int) -> str:
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "directory"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISLNK, "symlink")):
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
        return (f"a {_file_kind(st.st_mode)} of mode {st.st_mode:o}, the tree's was a "
                f"{_file_kind(want)} of mode {want:o}")
    if (stat.S_ISCHR(want) or stat.S_ISBLK(want)) and st.st_rdev != int(rec.get("rdev", 0)):
        return (f"device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}, the tree's was "
                f"{os.major(int(rec.get('rdev', 0)))}:{os.minor(int(rec.get('rdev', 0)))}")
    return None


def _appends(flags: int) -> bool:
    return (flags & os.O_ACCMODE) == os.O_WRONLY and bool(flags & os.O_APPEND)


def external_file_fd(placement: Optional[Placement], uses: list[dict]) -> tuple[int, dict]:
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
    sizable = sorted((u for u in uses if not _appends(u["flags"])),
                     key=lambda u: (u["pid"], u["fd"]))
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
                bad = (f"a regular file, and the tree's pid {v['pid']} fd {v['fd']} on the "
                       f"file is {_flag_names(v['flags'] & _REOPEN_FLAGS)}, not "
                       "O_WRONLY|O_APPEND: CRIU would reopen that fd on this file too, at its "
                       "offset, and check its size")
            if bad is None:
                return fd, {"handed": f"placement fd {s.fd} ({s.target})",
                            "placement_fd": s.fd}
            os.close(fd)
            why_not.append(f"its fd {s.fd} ({s.target}) is {bad}")
    path = rec["path"]
    flags = rec["flags"] & _REOPEN_FLAGS
    if stat.S_ISFIFO(int(rec["st_mode"])):
        flags = (flags & ~os.O_ACCMODE) | os.O_RDWR | os.O_NONBLOCK   # never blocks
    tree = (f"pid {rec['pid']} fd {rec['fd']} holds {path} (opened outside the tree's mount "
            f"namespace, mount {rec['mnt_id']}, inode {rec['inode']})")
    pl = (" and the placement's fds do not fit (" + "; ".join(why_not) + ")") if why_not else ""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise PlacementError(f"{tree}, which cannot be reopened here: {e.strerror or e}{pl}",
                             pid=placement.pid if placement else None) from None
    bad = _same_kind(os.fstat(fd), rec)
    if bad is not None:
        os.close(fd)
        raise PlacementError(f"{tree}, but {path} here is {bad}{pl}",
                             pid=placement.pid if placement else None)
    return fd, {"handed": f"{path} reopened in the agent's mount namespace "
                          f"({_flag_names(flags)})", "placement_fd": None}


def _flag_names(flags: int) -> str:
    names = [{os.O_RDONLY: "O_RDONLY", os.O_WRONLY: "O_WRONLY", os.O_RDWR: "O_RDWR"}.get(
        flags & os.O_ACCMODE, "O_RDONLY")]
    for f, n in ((os.O_APPEND, "O_APPEND"), (os.O_NONBLOCK, "O_NONBLOCK"),
                 (os.O_DIRECTORY, "O_DIRECTORY"), (os.O_PATH, "O_PATH"), (os.O_SYNC, "O_SYNC")):
        if flags & f == f:
            names.append(n)
    return "|".join(names)


def external_file_key(rec: dict) -> str:
    """CRIU's name of an external file: ``file[MNT_ID:INODE]``, both in hex
    (criu/files-reg.c ``dump_one_reg_file``)."""
    return f"file[{int(rec['mnt_id']):x}:{int(rec['inode']):x}]"


def restore_options(placement: Optional[Placement], external_pipes: Iterable[dict] = (),
                    external_net: str = "", *, root: Optional[int] = None,
                    external_files: Iterable[dict] = ()) -> RestoreOptions:
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
            opts.join_ns = [(n.kind, n.path) for n in placement.namespaces
                            if not (external_net and n.kind == "net")]
            setup = placement.child_setup()
            opts.setup = setup if setup else None
        if external_net:
            net = placement.namespace("net") if placement is not None else None
            path = net.path if net else "/proc/self/ns/net"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise PlacementError(f"{tree}cannot open the network namespace {path}: "
                                     f"{e.strerror or e}",
                                     pid=placement.pid if placement else None) from None
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
                        f"placement {e.reason}", pid=placement.pid) from None
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
                        "(criu/pipes.c reopen_pipe), which fails for it (\"No such device or "
                        f"address\"); give the placeholder a pipe, a regular file or /dev/null "
                        f"as its fd {s.fd}", pid=placement.pid)
                opts.inherit_fds.append((fd, f"pipe:[{inode}]"))
                opts.inherited += [{**p, "placement_fd": s.fd} for p in uses]
                if stat.S_ISREG(st.st_mode):
                    opts.fixups += [{"pid": p["pid"], "fd": p["fd"], "dev": st.st_dev,
                                     "ino": st.st_ino, "target": s.target,
                                     "placement_pid": placement.pid} for p in uses]
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

"""Where a restore puts the restored trees: the cgroups, namespaces and stdio of one running
process (a Kubernetes placeholder container's init, by host pid).

``Placement.of_pid(PID)`` reads them from ``/proc`` once (nothing is changed until a restore
uses it); :meth:`Placement.verify` and :meth:`Placement.alive` check it is still the process
read; :meth:`Placement.child_setup` and :meth:`Placement.probe_cgroups` join its cgroups (and
mount namespace); :meth:`Placement.stdio_for` and :meth:`Placement.open_stdio` hand out its
stdio; :meth:`Placement.mismatches` checks a restored process. What a restore hands CRIU from
it is built in agent/mech/inherit.py (``restore_options``). docs/criu.md,
"Namespaces, cgroups and stdio: restoring into a placement", explains which namespaces,
cgroups and fds are used and why.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from typing import Iterable, Optional

from cuinterpose.agent.errors import PlacementError
from cuinterpose.agent.mech import procfs
from cuinterpose.agent.mech.inherit import pidfd_getfd
from cuinterpose.agent.mech.procfs import cgroup_mounts, parse_cgroup

__all__ = [
    "Placement",
    "Cgroup",
    "Namespace",
    "Stdio",
    "PlacementError",
    "DEFAULT_NAMESPACES",
    "JOINABLE_NAMESPACES",
    "PF_KTHREAD",
]

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
#: /proc/PID/stat flags (field 9): a kernel thread (include/linux/sched.h)
PF_KTHREAD = 0x00200000


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
        rel = self.path[len(root) :].lstrip("/")
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
            direction == "write" and "w" in self.mode
        )


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
        if best is None or len(root) < len(best[1]):  # the widest view of the hierarchy
            best = (point, root)
    return best if best else (None, "/")


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
            raise PlacementError(
                f"no such process (reading {p}): the placement process is gone", pid=pid
            ) from None
        raise PlacementError(f"has no user namespace file {p}", pid=pid) from None
    except OSError as e:
        raise PlacementError(
            f"cannot read its user namespace ({p}: {e.strerror or e})", pid=pid
        ) from None
    if ino != mine:
        raise PlacementError(
            f"is in another user namespace [{ino}] than the agent's [{mine}] (a rootless or "
            "user-namespaced container): the restored processes would run as the agent's "
            "root inside its other namespaces, and the agent does not map them into a user "
            "namespace; restore into a placeholder without a user namespace of its own",
            pid=pid,
        )
    return Namespace("user", p, ino)


def _read(path: str, pid: int, what: str, parse=None):
    """The text of ``path``, a /proc file of process ``pid`` (or what ``parse()``, a
    :mod:`procfs` reader of that file, returns); ``PlacementError`` naming the file when it
    cannot be read."""
    try:
        if parse is not None:
            return parse()
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        raise PlacementError(
            f"no such process (reading {path}): the placement process is gone", pid=pid
        ) from None
    except OSError as e:
        raise PlacementError(
            f"cannot read its {what} ({path}: {e.strerror or e})", pid=pid
        ) from None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where restored trees go, read from one running process (docs/criu.md,
    "Namespaces, cgroups and stdio: restoring into a placement").

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
    #: agent/mech/mntns.py), else None
    mnt: Optional[Namespace] = None
    #: its user namespace (the agent's own: another one is refused), checked again on every
    #: restored process (:meth:`mismatches`); None when not read
    user: Optional[Namespace] = None

    # -- reading ---------------------------------------------------------------------------
    @classmethod
    def of_pid(
        cls, pid: int, *, proc_root: str = "/proc", namespaces: Iterable[str] = DEFAULT_NAMESPACES
    ) -> "Placement":
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
            raise PlacementError(
                "is the init of the agent's pid namespace (the node's, or the "
                "agent container's): its cgroups and namespaces are not a "
                "container's; give the placeholder container's init",
                pid=pid,
            )
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
            _, fields = procfs.parse_stat(stat_text)
            kthread = bool(int(fields[procfs.STAT_FLAGS]) & PF_KTHREAD)
        except (ValueError, IndexError):
            raise PlacementError(f"{base}/stat is unreadable (no flags field)", pid=pid) from None
        if kthread:
            raise PlacementError(
                "is a kernel thread (PF_KTHREAD): it has no cgroups, "
                "namespaces or stdio of a container to restore into",
                pid=pid,
            )
        start = int(fields[procfs.STAT_STARTTIME])
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
                    "1's when they can; docs/kubernetes.md)",
                    pid=pid,
                )
            point, root = _mount_of(hid, ctrls, path, mounts)
            cgroups.append(Cgroup(hid, ctrls, path, point, root))
        nss = []
        for k in kinds:
            p = f"{base}/ns/{k}"
            try:
                nss.append(Namespace(k, p, os.stat(p).st_ino))
            except FileNotFoundError:
                if not os.path.exists(base):
                    raise PlacementError(
                        f"no such process (reading {p}): the placement process is gone", pid=pid
                    ) from None
                raise PlacementError(
                    f"has no {k} namespace file {p} (kernel without {k} namespaces?)", pid=pid
                ) from None
            except OSError as e:
                raise PlacementError(
                    f"cannot read its {k} namespace ({p}: {e.strerror or e})", pid=pid
                ) from None
        stdio = []
        for n in (0, 1, 2):
            p = f"{base}/fd/{n}"
            try:
                target = os.readlink(p)
            except FileNotFoundError:
                if not os.path.exists(base):
                    raise PlacementError(
                        f"no such process (reading {p}): the placement process is gone", pid=pid
                    ) from None
                continue  # fd n is closed
            except OSError as e:
                raise PlacementError(
                    f"cannot read its fd {n} ({p}: {e.strerror or e})", pid=pid
                ) from None
            try:
                flags = _read(
                    f"{base}/fdinfo/{n}",
                    pid,
                    f"fd {n} flags",
                    lambda n=n: procfs.fd_flags(pid, n, proc_root),
                )
            except ValueError:
                raise PlacementError(f"{base}/fdinfo/{n} has no flags line", pid=pid) from None
            stdio.append(Stdio(n, target, _ACCMODE.get(flags & os.O_ACCMODE, "r"), p))
        mnt = None
        p = f"{base}/ns/mnt"
        try:
            ino = os.stat(p).st_ino
            if ino != os.stat("/proc/self/ns/mnt").st_ino:
                mnt = Namespace("mnt", p, ino)
        except OSError as e:
            raise PlacementError(
                f"cannot read its mount namespace ({p}: {e.strerror or e})", pid=pid
            ) from None
        return cls(pid, start, tuple(cgroups), tuple(nss), tuple(stdio), proc_root, mnt, user)

    def namespace(self, kind: str) -> Optional[Namespace]:
        return next((n for n in self.namespaces if n.kind == kind), None)

    def describe(self) -> str:
        """One line for progress rows and errors."""
        ns = ", ".join(f"{n.kind}:[{n.inode}]" for n in self.namespaces)
        cg = ", ".join(f"{c.name}:{c.path}" for c in self.cgroups if c.path != "/")
        io = ", ".join(f"{s.fd}={s.target}" for s in self.stdio)
        mnt = f"; mount namespace [{self.mnt.inode}]" if self.mnt else ""
        return (
            f"pid {self.pid}: namespaces {ns or '-'}; cgroups {cg or 'all /'}; "
            f"stdio {io or '-'}{mnt}"
        )

    # -- checks ----------------------------------------------------------------------------
    def verify(self) -> None:
        """The placement process is still the one read (same start time) and still in the
        namespaces read. Raises ``PlacementError``."""
        base = f"{self.proc_root}/{self.pid}"
        text = _read(f"{base}/stat", self.pid, "stat")
        if _state(text) in ("Z", "X") or _start_time(text) != self.start_time:
            raise PlacementError(
                "is gone (exited, or its pid was reused since it was read)", pid=self.pid
            )
        for n in self._checked_namespaces():
            try:
                ino = os.stat(n.path).st_ino
            except FileNotFoundError:
                raise PlacementError(
                    f"is gone (reading {n.path}): the placement process is gone", pid=self.pid
                ) from None
            except OSError as e:
                raise PlacementError(
                    f"cannot read its {n.kind} namespace ({n.path}: {e.strerror or e})",
                    pid=self.pid,
                ) from None
            if ino != n.inode:
                raise PlacementError(
                    f"left its {n.kind} namespace [{n.inode}] (now [{ino}])", pid=self.pid
                )

    def _checked_namespaces(self) -> tuple[Namespace, ...]:
        return self.namespaces + tuple(n for n in (self.mnt, self.user) if n is not None)

    def alive(self) -> bool:
        """Whether the placement process is still the one read (not exited, pid not reused)."""
        return procfs.starttime(self.pid, self.proc_root) == self.start_time

    def cgroups_to_join(self, pid: int | str = "self") -> list[Cgroup]:
        """The placement's cgroups that process ``pid`` (default: this one; a child inherits
        them) is not in. Raises ``PlacementError`` for one that cannot be reached here (its
        hierarchy not mounted, or mounted below that cgroup)."""
        mine = {}
        try:
            mine = {(h, c): p for h, c, p in procfs.cgroup(pid)}
        except OSError:
            pass
        out = []
        for cg in self.cgroups:
            if mine.get((cg.hierarchy, cg.controllers)) == cg.path:
                continue
            if cg.procs_file is None:
                raise PlacementError(
                    f"its cgroup {cg.line()!r} cannot be joined: that "
                    + (
                        "hierarchy is not mounted here"
                        if cg.mount is None
                        else f"hierarchy is mounted at {cg.mount} showing only {cg.mount_root}"
                    ),
                    pid=self.pid,
                )
            out.append(cg)
        return out

    def child_setup(self):
        """A :class:`~cuinterpose.agent.mech.criu_child.ChildSetup` that moves the CRIU child
        into every placement cgroup this process is not in and, when the placement has a
        mount namespace of its own, into that (before CRIU starts: the restored files are
        then reopened by the paths the placement sees, agent/mech/mntns.py)."""
        from cuinterpose.agent.mech.criu_child import ChildSetup

        return ChildSetup(
            cgroup_procs=tuple(c.procs_file for c in self.cgroups_to_join()),
            namespaces=(("mnt", self.mnt.path),) if self.mnt else (),
        )

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
        from cuinterpose.agent.mech.criu_child import ChildSetup, CriuError, run_setup_probe

        setup = ChildSetup(cgroup_procs=tuple(c.procs_file for c in self.cgroups_to_join()))
        if not setup.cgroup_procs:
            return []
        try:
            run_setup_probe(setup)
        except CriuError as e:
            raise PlacementError(
                f"cannot put a process into its cgroups: {e}", pid=self.pid
            ) from None
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
        raise PlacementError(
            f"has no stdio fd open for {how} to hand to the tree's fd {fd} (its fds 0-2: {have})",
            pid=self.pid,
        )

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
            raise PlacementError(
                f"its fd {s.fd} went away ({s.path}: {e.strerror or e})", pid=self.pid
            ) from None
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
            raise PlacementError(
                f"cannot open its fd {s.fd} ({s.path} -> {s.target}): "
                f"{e.strerror or e} (and {why.reason})",
                pid=self.pid,
            ) from None

    def _getfd(self, s: Stdio) -> int:
        """pidfd_getfd(2) of the placement's fd ``s.fd`` (the new fd is close-on-exec)."""
        try:
            return pidfd_getfd(self.pid, s.fd, f"placement pid {self.pid} ({s.target})")
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
            have = {(h, c): p for h, c, p in procfs.cgroup(pid, self.proc_root)}
        except OSError as e:
            return out + [f"cgroups unreadable ({e.strerror or e})"]
        for cg in self.cgroups:
            got = have.get((cg.hierarchy, cg.controllers))
            if got != cg.path:
                out.append(f"cgroup {cg.name}:{got}, not the placement's {cg.path}")
        return out


def _state(stat_text: str) -> str:
    """The state letter of a ``/proc/PID/stat`` text; "?" when it has none."""
    try:
        return procfs.parse_stat(stat_text)[1][procfs.STAT_STATE]
    except (ValueError, IndexError):
        return "?"


def _start_time(stat_text: str) -> int:
    """The start time (field 22) of a ``/proc/PID/stat`` text."""
    return int(procfs.parse_stat(stat_text)[1][procfs.STAT_STARTTIME])

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
  in the host's user namespace, which the containers share. ``time`` may be asked for.
- **stdio** (``/proc/PID/fd/{0,1,2}`` and their ``fdinfo`` access mode): a container's stdio
  are pipes to the runtime shim, outside any dumped tree. The checkpoint records every pipe of
  a tree whose other end is outside it (manifest ``external_pipes``); the restore hands the
  placement's stdin to those the tree read from and its stdout/stderr to those it wrote to,
  through CRIU's ``--inherit-fd fd[N]:pipe:[INODE]`` (criu(8); criu.org "Inheriting FDs on
  restore": a pipe with one end outside the tree cannot be restored from the images).

``Placement`` only reads ``/proc``; nothing is changed until the restore uses it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import stat
from typing import Iterable, Optional

from .errors import AgentError

__all__ = ["Placement", "Cgroup", "Namespace", "Stdio", "PlacementError", "DEFAULT_NAMESPACES",
           "JOINABLE_NAMESPACES", "parse_cgroup", "cgroup_mounts", "RestoreOptions",
           "restore_options"]

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
            "restores run as root in the host's user namespace",
    "cgroup": "CRIU's --join-ns does not take a cgroup namespace; the cgroups themselves are "
              "joined",
}
_ACCMODE = {os.O_RDONLY: "r", os.O_WRONLY: "w", os.O_RDWR: "rw"}
_SYS_pidfd_getfd = 438


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
        kinds = list(dict.fromkeys(namespaces))
        for k in kinds:
            if k not in JOINABLE_NAMESPACES:
                why = _WHY_NOT.get(k, f"CRIU --join-ns supports {', '.join(JOINABLE_NAMESPACES)}")
                raise PlacementError(f"cannot join its {k} namespace: {why}", pid=pid)
        base = f"{proc_root}/{pid}"
        stat_text = _read(f"{base}/stat", pid, "stat")
        if _state(stat_text) in ("Z", "X"):
            raise PlacementError("has exited (zombie): the placement process is gone", pid=pid)
        start = _stat_start_time(stat_text)
        mounts = cgroup_mounts(_read("/proc/self/mountinfo", os.getpid(), "mountinfo"))
        cgroups = []
        for hid, ctrls, path in parse_cgroup(_read(f"{base}/cgroup", pid, "cgroups")):
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
        return cls(pid, start, tuple(cgroups), tuple(nss), tuple(stdio), proc_root, mnt)

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
        for n in self.namespaces + ((self.mnt,) if self.mnt else ()):
            try:
                ino = os.stat(n.path).st_ino
            except OSError as e:
                raise PlacementError(f"cannot read its {n.kind} namespace ({n.path}: "
                                     f"{e.strerror or e})", pid=self.pid) from None
            if ino != n.inode:
                raise PlacementError(f"left its {n.kind} namespace [{n.inode}] (now [{ino}])",
                                     pid=self.pid)

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
        """A :class:`~cuinterpose.agent.criu.ChildSetup` that moves the CRIU child into every
        placement cgroup this process is not in and, when the placement has a mount namespace
        of its own, into that (before CRIU starts: the restored files are then reopened by
        the paths the placement sees, agent/mntns.py)."""
        from .criu import ChildSetup
        return ChildSetup(cgroup_procs=tuple(c.procs_file for c in self.cgroups_to_join()),
                          namespaces=(("mnt", self.mnt.path),) if self.mnt else ())

    def probe_cgroups(self) -> list[str]:
        """Check that a process can join the placement's cgroups, with a short-lived child
        that joins them and exits (cgroup(7): a write to ``cgroup.procs`` can be refused, e.g.
        the v1 ``pids`` limit, a v2 cgroup with controllers enabled for its children, a
        removed cgroup). Returns the ``cgroup.procs`` files joined. Raises
        ``PlacementError`` naming the file and the errno."""
        setup = self.child_setup()
        if not setup.cgroup_procs:
            return []
        from .criu import CriuError, run_setup_probe
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
        """A new fd (close-on-exec) on the placement's file behind ``s``: reopened through
        ``/proc/PID/fd/N`` (a pipe reopens as a new file description of the same pipe,
        proc(5)), or, for a file that cannot be reopened (a socket: ENXIO), duplicated with
        pidfd_getfd(2). Raises ``PlacementError``."""
        flags = (os.O_WRONLY if direction == "write" else os.O_RDONLY) | os.O_CLOEXEC
        try:
            fd = os.open(s.path, flags)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise PlacementError(f"cannot open its fd {s.fd} ({s.path} -> {s.target}): "
                                     f"{e.strerror or e}", pid=self.pid) from None
            fd = self._getfd(s)
        try:
            st = os.fstat(fd)
            now = os.readlink(s.path)
        except OSError as e:
            os.close(fd)
            raise PlacementError(f"its fd {s.fd} went away ({s.path}: {e.strerror or e})",
                                 pid=self.pid) from None
        if now != s.target:
            os.close(fd)
            raise PlacementError(f"its fd {s.fd} changed from {s.target} to {now}", pid=self.pid)
        if stat.S_ISDIR(st.st_mode):
            os.close(fd)
            raise PlacementError(f"its fd {s.fd} is a directory", pid=self.pid)
        return fd

    def _getfd(self, s: Stdio) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError as e:
            raise PlacementError(f"cannot open its fd {s.fd} ({s.target}): pidfd_open: "
                                 f"{e.strerror or e}", pid=self.pid) from None
        try:
            fd = libc.syscall(_SYS_pidfd_getfd, pidfd, s.fd, 0)
            if fd < 0:
                err = ctypes.get_errno()
                raise PlacementError(f"cannot open its fd {s.fd} ({s.target}): pidfd_getfd: "
                                     f"{os.strerror(err)}", pid=self.pid)
            return fd
        finally:
            os.close(pidfd)

    # -- after the restore -----------------------------------------------------------------
    def mismatches(self, pid: int) -> list[str]:
        """What of the placement process ``pid`` (a restored one) is not in: namespaces
        (by inode) and cgroups (by ``/proc/PID/cgroup`` line); [] when it is placed."""
        out = []
        for n in self.namespaces + ((self.mnt,) if self.mnt else ()):
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
    ``inherited``: the external pipes handed over, each with the ``placement_fd`` it got."""

    join_ns: list = dataclasses.field(default_factory=list)
    inherit_fds: list = dataclasses.field(default_factory=list)
    setup: object = None
    fds: list = dataclasses.field(default_factory=list)
    inherited: list = dataclasses.field(default_factory=list)

    def kwargs(self) -> dict:
        """Keyword arguments for ``criu.restore`` (only those that are set)."""
        kw = {}
        if self.join_ns:
            kw["join_ns"] = list(self.join_ns)
        if self.inherit_fds:
            kw["inherit_fds"] = list(self.inherit_fds)
        if self.setup:
            kw["setup"] = self.setup
        return kw

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def restore_options(placement: Optional[Placement], external_pipes: Iterable[dict] = (),
                    external_net: str = "", *, root: Optional[int] = None) -> RestoreOptions:
    """CRIU restore options of one tree, from its manifest records.

    - ``placement`` None: only an ``external_net`` (the images' network namespace was dumped
      as external, ``criu.EXTERNAL_NET_KEY``) needs a namespace: the agent's own
      (``--inherit-fd fd[N]:KEY`` on ``/proc/self/ns/net``); external pipes stay as CRIU
      restores them (the outside end missing).
    - with a placement: ``--join-ns`` for each of its namespaces (its ``net`` through
      ``--inherit-fd`` instead when ``external_net``: CRIU refuses ``--join-ns net`` for such
      images), its cgroups through ``setup`` (a ``ChildSetup`` for CRIU's child), and for each
      external pipe inode (``external_pipes``: ``{"pid", "fd", "inode", "direction"}``) the
      placement's matching stdio fd (:meth:`Placement.stdio_for` of the lowest fd using it),
      opened anew, as ``--inherit-fd fd[N]:pipe:[INODE]``.

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
                opts.inherit_fds.append((fd, f"pipe:[{inode}]"))
                opts.inherited += [{**p, "placement_fd": s.fd} for p in uses]
    except BaseException:
        opts.close()
        raise
    return opts

"""Process census: which processes under the operator's root pids take part in a checkpoint.

Detection is fail-closed and uses only evidence the workload cannot fake by editing its
environment:

- the tree is every process whose ``/proc/PID/stat`` parent chain reaches a root;
- a process *maps the shim* when ``/proc/PID/maps`` has a file mapping whose device and inode
  equal the installed shim's (``paths.shim_path()``); a mapping named ``libcuinterpose.so``
  with another device/inode is refused (a different build would not speak our protocol);
- a *participant* maps the shim and has a control socket
  ``<control_dir>/cuinterpose-<pid>.sock`` (the shim creates it after ``cuInit``);
- a *CUDA process* is one for which ``cuCheckpointProcessGetState`` succeeds.

Refused (``CensusError``, nothing touched): a root that does not exist, a CUDA process without
the shim or without its control socket, a participant the driver does not know, a CUDA process
not RUNNING, a foreign shim build, and a tree without any participant.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import stat as stat_mod
from typing import Callable, Iterable, Optional

from cuinterpose.agent import paths
from cuinterpose.agent.errors import CensusError, NativeError
from cuinterpose.agent.mech import ctldir, procfs
from cuinterpose.agent.mech.census_checks import (  # noqa: F401 (re-exported for callers)
    SUN_PATH_MAX,
    check_not_stopped,
    check_process_id,
    check_socket_dir,
    check_socket_owner,
    socket_dir_problem,
)
from cuinterpose.agent.snapshot.manifest import sha256_file
from cuinterpose.coordinator import protocol
from cuinterpose.coordinator.protocol import CUI_DEFAULT_CONTROL_DIR


@dataclasses.dataclass(frozen=True)
class ShimFile:
    """The installed shim: absolute ``path``, ``sha256`` (hex), ``dev``/``inode``, ``size`` (bytes)."""

    path: str
    sha256: str
    dev: int
    inode: int
    size: int

    @classmethod
    def of(cls, path: os.PathLike | str) -> "ShimFile":
        """Stat and hash ``path``; raises ``CensusError`` when it cannot be read."""
        p = pathlib.Path(path).resolve()
        try:
            st = os.stat(p)
            return cls(
                path=str(p), sha256=sha256_file(p), dev=st.st_dev, inode=st.st_ino, size=st.st_size
            )
        except OSError as e:
            raise CensusError("census", f"cannot read shim {p}: {e.strerror}") from None

    def to_dict(self) -> dict:
        return {"path": self.path, "sha256": self.sha256, "size": self.size}


@dataclasses.dataclass
class Process:
    """One process of the tree. ``shim`` is "installed", "foreign" (path of another build in
    ``foreign_shim``) or None; ``socket_path`` is set when the control socket exists;
    ``cuda_state`` is the ``cuCheckpointProcessGetState`` name or None (``cuda_error`` then says
    why)."""

    pid: int
    ppid: int
    comm: str
    shim: Optional[str] = None
    foreign_shim: Optional[str] = None
    socket_path: Optional[str] = None
    cuda_state: Optional[str] = None
    cuda_error: Optional[str] = None
    #: session id and controlling tty (``tty_nr``, 0 = none) from ``/proc/PID/stat``
    sid: Optional[int] = None
    tty_nr: int = 0
    #: a CUDA process's GPU records by the ordinals it sees (agent/mech/devicemap.py), None
    #: when the agent did not list the node's GPUs; its ``CUDA_VISIBLE_DEVICES`` (None: unset)
    gpus: Optional[list] = None
    cuda_visible_devices: Optional[str] = None

    @property
    def is_participant(self) -> bool:
        return self.shim == "installed" and self.socket_path is not None

    @property
    def is_cuda(self) -> bool:
        return self.cuda_state is not None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Census:
    """Result: ``roots`` (pids), every ``process`` of the trees (roots first, then breadth-first),
    the ``shim`` and ``control_dir``. ``participants`` are in pid order."""

    roots: list[int]
    processes: list[Process]
    shim: ShimFile
    control_dir: str

    @property
    def participants(self) -> list[Process]:
        return sorted((p for p in self.processes if p.is_participant), key=lambda p: p.pid)

    @property
    def cuda_pids(self) -> list[int]:
        return sorted(p.pid for p in self.processes if p.is_cuda)

    def to_dict(self) -> dict:
        return {
            "roots": self.roots,
            "control_dir": self.control_dir,
            "shim": self.shim.to_dict(),
            "processes": [p.to_dict() for p in self.processes],
        }


def read_stat(pid: int) -> tuple[int, str]:
    """(ppid, comm) of ``pid`` from ``/proc/PID/stat``; raises ``FileNotFoundError`` if gone."""
    ppid, comm, _ = read_stat_state(pid)
    return ppid, comm


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (state Z or X in ``/proc/PID/stat``)."""
    try:
        return read_stat_state(pid)[2] not in "ZX"
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return False


def read_stat_state(pid: int) -> tuple[int, str, str]:
    """(ppid, comm, state letter) of ``pid``; raises ``FileNotFoundError`` if gone."""
    comm, fields = procfs.stat_fields(pid)
    return int(fields[procfs.STAT_PPID]), comm, fields[procfs.STAT_STATE]


def read_session(pid: int) -> tuple[int, int]:
    """(session id, tty_nr) of ``pid`` from ``/proc/PID/stat`` (tty_nr 0: no controlling
    terminal); raises ``FileNotFoundError`` if gone."""
    _, fields = procfs.stat_fields(pid)
    return int(fields[procfs.STAT_SESSION]), int(fields[procfs.STAT_TTY_NR])


def preload_ahead(pid: int, shim: str) -> str:
    """Case 005 from Python: when ``pid``'s LD_PRELOAD lists libraries before the shim, one
    that overrides ``dlsym`` makes every lookup (ctypes, cuda-python, cudart) resolve to the
    driver, ``cuInit`` included, so the shim never binds its socket. A note naming them, or ""."""
    raw = procfs.environ_value(pid, "LD_PRELOAD")
    entries = [e for e in (raw or b"").decode(errors="replace").replace(":", " ").split() if e]
    names = [os.path.basename(e) for e in entries]
    if os.path.basename(shim) not in names or names.index(os.path.basename(shim)) == 0:
        return ""
    ahead = entries[: names.index(os.path.basename(shim))]
    return (
        f"; its LD_PRELOAD puts {', '.join(ahead)} before the shim: a library there that overrides "
        "dlsym lets cuInit and every lookup bypass it (put libcuinterpose.so first, docs/shim.md "
        '"Preload order")'
    )


def walk_tree(roots: Iterable[int]) -> list[tuple[int, int, str]]:
    """Every process under ``roots`` as (pid, ppid, comm): the roots first, then their
    descendants breadth-first. Raises ``CensusError`` for a root that does not exist."""
    roots = list(dict.fromkeys(int(r) for r in roots))
    children: dict[int, list[tuple[int, str]]] = {}
    info: dict[int, tuple[int, str]] = {}
    zombies = set()
    for pid in procfs.pids():
        try:
            ppid, comm, state = read_stat_state(pid)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
        if state in "ZX":
            zombies.add(pid)
            continue
        info[pid] = (ppid, comm)
        children.setdefault(ppid, []).append((pid, comm))
    out, seen = [], set()
    for r in roots:
        if r in zombies:
            e = CensusError("census", "has exited (zombie); nothing to checkpoint", pid=r)
            e.hint = f"nothing was done; the job has exited (pid {r} is a zombie)"
            raise e
        if r not in info:
            check_process_id(r, "census")
            e = CensusError(
                "census",
                "no such process (root): the job has exited, or this is not its pid (in an "
                "interactive shell `setsid CMD &` forks, so $! is setsid's own pid, which exits "
                "at once; README, 'Using it on a job')",
                pid=r,
            )
            e.hint = f"nothing was done; no process has pid {r}"
            raise e
    queue = [(r, info[r][0], info[r][1]) for r in roots]
    while queue:
        pid, ppid, comm = queue.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        out.append((pid, ppid, comm))
        queue.extend((c, pid, cc) for c, cc in sorted(children.get(pid, [])))
    return out


def shim_mapping(pid: int, shim: ShimFile) -> tuple[Optional[str], Optional[str]]:
    """Look for the shim in ``/proc/PID/maps``. Returns ("installed", path) when a mapping has the
    shim's dev/inode, ("foreign", path) when a mapping named like the shim has another dev/inode,
    (None, None) otherwise (also when the process vanished). Raises ``CensusError`` when the
    maps cannot be read (another user's process)."""
    foreign = None
    try:
        for path, dev, inode in procfs.maps(pid):
            if inode == 0:
                continue
            if dev == shim.dev and inode == shim.inode:
                return "installed", path
            if os.path.basename(path.replace(" (deleted)", "")) == paths.SHIM_NAME:
                foreign = path
    except (FileNotFoundError, ProcessLookupError):
        return None, None
    except PermissionError as e:
        # not "no shim": a process we may not inspect must not be classified at all
        raise CensusError(
            "census",
            f"cannot read /proc/{pid}/maps ({e.strerror}): run the agent "
            "as root or as the workload's user",
            pid=pid,
        ) from None
    return ("foreign", foreign) if foreign else (None, None)


def socket_path(control_dir: os.PathLike | str, pid: int) -> pathlib.Path:
    """``<control_dir>/cuinterpose-<pid>.sock``."""
    return pathlib.Path(protocol.socket_path(control_dir, pid))


def is_socket(p: pathlib.Path) -> bool:
    """Whether ``p`` exists and is a socket (a shim's control socket)."""
    try:
        return stat_mod.S_ISSOCK(os.stat(p).st_mode)
    except OSError:
        return False


def take_census(
    roots: Iterable[int],
    *,
    control_dir: os.PathLike | str | None = None,
    shim_path: os.PathLike | str | None = None,
    get_state: Optional[Callable[[int], str]] = None,
    node_gpus: Optional[Callable[[], list]] = None,
) -> Census:
    """Walk the trees under ``roots`` and classify every process (see the module docstring).

    ``get_state(pid) -> state name`` raises ``NativeError`` for a non-CUDA process; it defaults to
    :func:`cuinterpose.agent.mech.native.get_state` (the driver must be loaded). ``node_gpus()``
    lists the GPUs the agent sees (default with the default ``get_state``:
    :func:`cuinterpose.agent.mech.devicemap.node_gpus`); each CUDA process then gets its GPU
    records (``gpus``, ``cuda_visible_devices``: :func:`devicemap.process_gpus`). Raises
    ``CensusError`` naming the pid for every refusal."""
    if get_state is None:
        from cuinterpose.agent.mech import devicemap, native

        get_state = native.get_state
        node_gpus = node_gpus or devicemap.node_gpus
    node: Optional[list] = None
    control_dir = str(pathlib.Path(ctldir.check(control_dir, phase="census")).resolve())
    shim = ShimFile.of(shim_path or paths.shim_path())
    check_socket_dir(control_dir, "census")
    check_roots(roots)
    procs = []
    for pid, ppid, comm in walk_tree(roots):
        if pid == os.getpid():
            continue
        p = Process(pid=pid, ppid=ppid, comm=comm)
        check_not_stopped(pid, "census", control_dir, ancestors)
        p.shim, path = shim_mapping(pid, shim)
        if p.shim == "foreign":
            p.foreign_shim = path
        sock = socket_path(control_dir, pid)
        if is_socket(sock):
            check_socket_owner(sock, pid, "census")
            p.socket_path = str(sock)
        try:
            p.sid, p.tty_nr = read_session(pid)
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            pass
        try:
            p.cuda_state = get_state(pid)
        except NativeError as e:
            p.cuda_error = e.result
        if p.cuda_state is not None and node_gpus is not None:
            from cuinterpose.agent.mech import devicemap

            node = node_gpus() if node is None else node
            p.gpus, p.cuda_visible_devices = devicemap.process_gpus(pid, node)
        procs.append(p)
    census = Census(
        roots=list(dict.fromkeys(int(r) for r in roots)),
        processes=procs,
        shim=shim,
        control_dir=control_dir,
    )
    check_rank_roots(census)
    check(census)
    return census


def check_rank_roots(census: Census) -> None:
    """Refuse a root that is no participant while its parent maps the installed shim *and* has
    a control socket (the parent called ``cuInit``: a CUDA rank or a launcher under the shim,
    not just a shell started with ``LD_PRELOAD``): the pid is one rank of a job whose root is
    above it, and the workload would never answer its quiesce request. (A parent that maps the
    shim without a socket is ambiguous: the quiesce timeout then carries
    :func:`job_root_hint`.)"""
    by_pid = {p.pid: p for p in census.processes}
    for r in census.roots:
        p = by_pid.get(r)
        if p is None or p.ppid <= 1:
            continue
        if not is_socket(socket_path(census.control_dir, p.ppid)):
            continue
        try:
            if shim_mapping(p.ppid, census.shim)[0] != "installed":
                continue
            pcomm = read_stat(p.ppid)[1]
        except (CensusError, FileNotFoundError, ProcessLookupError, ValueError):
            continue
        raise CensusError(
            "census",
            f"({p.comm}) looks like a rank, not the root of its job: its "
            f"parent pid {p.ppid} ({pcomm}) runs under the shim too (with a control "
            f"socket); pass --pid {p.ppid}",
            pid=r,
        )


O_ACCMODE, O_WRONLY, O_RDWR, O_APPEND = os.O_ACCMODE, os.O_WRONLY, os.O_RDWR, os.O_APPEND


def open_file_warnings(census: Census) -> list[dict]:
    """Regular files that a process of the tree holds open for writing without ``O_APPEND``
    (from ``/proc/PID/fd`` and ``/proc/PID/fdinfo``): CRIU refuses to restore a regular file
    whose size changed since the dump unless it is opened for appending, so the first restored
    run writing to it makes the snapshot restorable only once. Returns
    ``[{"pid", "comm", "fd", "path", "message"}]`` in pid, fd order (deleted files, which CRIU
    carries in the images, are skipped)."""
    out = []
    for p in sorted(census.processes, key=lambda q: q.pid):
        for fd, target in procfs.fd_targets(p.pid):
            try:
                if not target.startswith("/") or target.endswith(" (deleted)"):
                    continue
                if not stat_mod.S_ISREG(os.stat(f"/proc/{p.pid}/fd/{fd}").st_mode):
                    continue
                flags = procfs.fd_flags(p.pid, fd)
            except (OSError, ValueError, IndexError):
                continue
            if flags & O_ACCMODE not in (O_WRONLY, O_RDWR) or flags & O_APPEND:
                continue
            out.append(
                {
                    "pid": p.pid,
                    "comm": p.comm,
                    "fd": fd,
                    "path": target,
                    "message": (
                        f"pid {p.pid} ({p.comm}) fd {fd} {target} is open for writing without "
                        "O_APPEND: CRIU refuses to restore a file whose size changed since the dump, so "
                        "a restored run writing to it will make this snapshot restorable only once (or "
                        "not at all if it is written before the restore); open it with O_APPEND / `>>`"
                    ),
                }
            )
    return out


def ancestors(pid: int) -> list[int]:
    """Parent chain of ``pid`` (parent first, up to but excluding pid 1 and 0); [] if gone."""
    out, seen = [], {pid}
    try:
        ppid = read_stat(pid)[0]
        while ppid > 1 and ppid not in seen:
            out.append(ppid)
            seen.add(ppid)
            ppid = read_stat(ppid)[0]
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


def check_roots(roots: Iterable[int]) -> None:
    """Refuse (``CensusError``) a root that lies inside the tree of another root: it would be
    quiesced and dumped twice. (A root that does not exist is refused by :func:`walk_tree`.)"""
    roots = list(dict.fromkeys(int(r) for r in roots))
    for r in roots:
        for a in ancestors(r):
            if a in roots:
                try:
                    comm = read_stat(r)[1]
                except (FileNotFoundError, ProcessLookupError, ValueError):
                    comm = "?"
                raise CensusError(
                    "census",
                    f"({comm}) is inside the tree of --pid {a}; pass only "
                    "the root of each tree (its whole tree is checkpointed with it)",
                    pid=r,
                )


def job_root_hint(pid: int, shim: ShimFile) -> Optional[str]:
    """A hint for a root that did not answer the quiesce request: when its parent maps the
    installed shim too, ``pid`` is most likely one rank of a job whose root is the parent
    (the process that watches for the request). None otherwise."""
    try:
        ppid, _ = read_stat(pid)
        pcomm = read_stat(ppid)[1]
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    try:
        if ppid <= 1 or shim_mapping(ppid, shim)[0] != "installed":
            return None
    except CensusError:
        return None
    return (
        f"pid {pid} looks like a rank, not the root of its job: its parent pid {ppid} "
        f"({pcomm}) runs under the shim too; pass --pid {ppid}"
    )


def process_control_dir(pid: int) -> Optional[str]:
    """The control dir ``pid``'s shim uses: ``CUINTERPOSE_CONTROL_DIR`` from its initial
    environment (``/proc/PID/environ``), else the default; None when unreadable."""
    try:
        val = procfs.environ_value(pid, protocol.CONTROL_DIR_ENV)
    except OSError:
        return None
    # unset or "" = the default, as the shim
    return str(
        pathlib.Path((val or b"").decode(errors="replace") or CUI_DEFAULT_CONTROL_DIR).resolve()
    )


def check(census: Census) -> None:
    """Apply the refusal rules to a classified census; raises ``CensusError`` naming the pid."""
    for p in census.processes:
        what = f"({p.comm})"
        if p.shim == "foreign":
            if p.foreign_shim.endswith(" (deleted)"):
                raise CensusError(
                    "census",
                    f"{what} maps {p.foreign_shim}: the shim was replaced "
                    "on disk after this process started (rebuilt or reinstalled), so "
                    f"the installed {census.shim.path} (sha256 {census.shim.sha256}) "
                    "is not what it runs",
                    pid=p.pid,
                )
            raise CensusError(
                "census",
                f"{what} maps another shim build {p.foreign_shim}, "
                f"not the installed {census.shim.path} (sha256 {census.shim.sha256})",
                pid=p.pid,
            )
        if p.is_cuda and p.shim is None:
            raise CensusError(
                "census",
                f"{what} is a CUDA process (state {p.cuda_state}) without "
                f"the shim {census.shim.path} mapped; its shared memory cannot be "
                "checkpointed (start it with LD_PRELOAD=<shim>)",
                pid=p.pid,
            )
        if p.is_cuda and p.socket_path is None:
            theirs = process_control_dir(p.pid)
            if theirs and theirs != census.control_dir and is_socket(socket_path(theirs, p.pid)):
                why = (
                    f": its shim uses the control dir {theirs} (CUINTERPOSE_CONTROL_DIR in its "
                    f"environment); pass --control-dir {theirs}"
                )
            else:
                why = " (wrong --control-dir? or no cuInit yet)" + preload_ahead(
                    p.pid, census.shim.path
                )
            raise CensusError(
                "census",
                f"{what} is a CUDA process with the shim mapped but no "
                f"control socket {socket_path(census.control_dir, p.pid)}{why}",
                pid=p.pid,
            )
        if p.is_participant and not p.is_cuda:
            raise CensusError(
                "census",
                f"{what} has a control socket {p.socket_path} but the "
                f"driver does not know it: cuCheckpointProcessGetState: "
                f"{p.cuda_error}",
                pid=p.pid,
            )
        if p.is_cuda and p.cuda_state != "RUNNING":
            from cuinterpose.agent.mech import quiesce

            busy = quiesce.job_busy(census.control_dir, [p.pid, *ancestors(p.pid)])
            raise CensusError(
                "census",
                f"{what} is {p.cuda_state}, not RUNNING: "
                + (busy or "another checkpoint in progress?"),
                pid=p.pid,
            )
    if not census.participants:
        mapped = [p.pid for p in census.processes if p.shim == "installed"]
        if mapped:
            why = (
                f"pid(s) {', '.join(map(str, mapped[:8]))}{' …' if len(mapped) > 8 else ''} "
                "map the shim but have no control socket: the job has probably not "
                "initialized CUDA (cuInit) yet, and the shim binds cuinterpose-<pid>.sock "
                "only then; retry once the sockets appear (or check that the job's "
                "CUINTERPOSE_CONTROL_DIR is that directory)"
            )
        else:
            why = (
                "the job is not running under the shim (start it with "
                "LD_PRELOAD=$(cuinterpose-agent shim-path)), or has not started its CUDA "
                "processes or initialized CUDA (cuInit) yet; retry once "
                "cuinterpose-<pid>.sock appears in the control dir"
            )
        raise CensusError(
            "census",
            f"no cuinterpose participant under root pid(s) "
            f"{', '.join(map(str, census.roots))} (no process maps "
            f"{census.shim.path} and has a socket in {census.control_dir}): {why}",
        )
    check_sessions(census)


SETSID_HINT = "start the job with `setsid` (stdio on files or /dev/null)"


def check_sessions(census: Census) -> None:
    """CRIU dumps a tree only when its root leads its own session and no process of it has a
    controlling terminal (otherwise it wants ``--shell-job``, which the agent does not use:
    see docs/criu.md). Refused here, before the workload is asked to quiesce."""
    roots = set(census.roots)
    for p in census.processes:
        if p.pid in roots and p.sid is not None and p.sid != p.pid:
            rank = job_root_hint(p.pid, census.shim)
            raise CensusError(
                "census",
                f"({p.comm}) is not a session leader: CRIU can only dump "
                f"a tree whose root leads its session; {SETSID_HINT}"
                + (f"; {rank}" if rank else ""),
                pid=p.pid,
            )
    for p in census.processes:
        if p.tty_nr:
            raise CensusError(
                "census",
                f"({p.comm}) has a controlling terminal (tty_nr "
                f"{p.tty_nr}): CRIU can only dump a tree without one; "
                f"{SETSID_HINT}",
                pid=p.pid,
            )

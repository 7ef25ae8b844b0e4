"""The one home of /proc parsing (proc(5)): each function names the file and field it reads.

Every reader takes the pid (and, where tests point it elsewhere, a ``proc_root``) and raises
``OSError`` (``FileNotFoundError`` when the process or fd is gone) or ``ValueError`` (a line
or field that is not what proc(5) documents); callers decide what a vanished process means.
The ``parse_*`` functions take a file's text, for callers that read the file themselves (to
word their own errors) or test it on a text of their own.
"""

from __future__ import annotations

import os
from typing import Iterator, Optional


def pids(proc_root: str = "/proc") -> list[int]:
    """Every process of the pid namespace that ``proc_root`` shows: its numeric entries."""
    return [int(e) for e in os.listdir(proc_root) if e.isdigit()]


# -- /proc/PID/stat ---------------------------------------------------------------------------
# Indexes into the fields after ``comm`` (:func:`parse_stat`): field N of proc(5) is N - 3.
#: field 3, the state letter (R, S, D, Z, X, ...)
STAT_STATE = 0
#: field 4, the parent's pid
STAT_PPID = 1
#: field 6, the session id
STAT_SESSION = 3
#: field 7, the controlling terminal (0: none)
STAT_TTY_NR = 4
#: field 9, the kernel's ``PF_*`` flags of the task
STAT_FLAGS = 6
#: field 22, the start time in clock ticks since boot
STAT_STARTTIME = 19


def parse_stat(text: str) -> tuple[str, list[str]]:
    """``(comm, fields)`` of a ``/proc/PID/stat`` text: ``comm`` without its parentheses (it
    may hold spaces and parentheses itself: the fields start after the *last* ``)``) and the
    fields after it, indexed by the ``STAT_*`` constants. ``ValueError`` when there is no
    ``)``."""
    rp = text.rindex(")")
    return text[text.find("(") + 1 : rp], text[rp + 2 :].split()


def stat_fields(pid: int, proc_root: str = "/proc") -> tuple[str, list[str]]:
    """:func:`parse_stat` of ``/proc/PID/stat``, so ``fields[STAT_STATE]`` is the state
    (field 3 of proc(5)), ``fields[STAT_PPID]`` the ppid (field 4), ``fields[STAT_STARTTIME]``
    the start time in clock ticks since boot (field 22)."""
    with open(f"{proc_root}/{pid}/stat", "rb") as f:
        data = f.read().decode(errors="replace")
    return parse_stat(data)


def starttime(pid: int, proc_root: str = "/proc") -> int | None:
    """Start time of a live process (``/proc/PID/stat`` field 22, clock ticks since boot);
    None when it is gone or a zombie (state Z or X)."""
    try:
        _, fields = stat_fields(pid, proc_root)
        return None if fields[STAT_STATE] in "ZX" else int(fields[STAT_STARTTIME])
    except (OSError, ValueError, IndexError):
        return None


# -- /proc/PID/status -------------------------------------------------------------------------


def status(pid: int, proc_root: str = "/proc") -> dict[str, str]:
    """The ``Key:<tab>value`` lines of ``/proc/PID/status`` (``Name``, ``State``, ``Tgid``,
    ``PPid``, ``Uid``, ``NSpid``, ...), values stripped."""
    with open(f"{proc_root}/{pid}/status") as f:
        text = f.read()
    return {k: v.strip() for k, v in (ln.split(":", 1) for ln in text.splitlines() if ":" in ln)}


def nspid(pid: int, proc_root: str = "/proc") -> Optional[list[int]]:
    """``/proc/PID/status`` line ``NSpid:``: the pid in each PID namespace it is in, outermost
    first; None when the kernel shows no such line."""
    with open(f"{proc_root}/{pid}/status") as f:
        for line in f.read().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return None


# -- /proc/PID/fd, fdinfo ---------------------------------------------------------------------


def fdinfo(path: str) -> dict[str, str]:
    """The ``key: value`` lines of a ``/proc/PID/fdinfo/FD`` file (``pos``, ``flags``,
    ``mnt_id``, ``ino``, ...), values stripped."""
    with open(path) as f:
        return {
            k.strip(): v.strip()
            for k, _, v in (ln.partition(":") for ln in f.read().splitlines())
            if k
        }


def fd_flags(pid: int, fd: int, proc_root: str = "/proc") -> int:
    """The open-file status flags of ``fd`` in ``pid``: ``/proc/PID/fdinfo/FD`` line
    ``flags:`` (octal, proc(5)), e.g. ``os.O_WRONLY | os.O_APPEND``. ``ValueError`` when the
    file has no such line."""
    path = f"{proc_root}/{pid}/fdinfo/{fd}"
    return fdinfo_flags(fdinfo(path), path)


def fdinfo_flags(info: dict[str, str], path: str = "fdinfo") -> int:
    """The ``flags:`` line (octal) of an :func:`fdinfo` read of ``path``, as an int;
    ``ValueError`` when it has none."""
    if "flags" not in info:
        raise ValueError(f"{path} has no flags line")
    return int(info["flags"], 8)


def fd_targets(pid: int, proc_root: str = "/proc") -> Iterator[tuple[int, str]]:
    """``(fd, target)`` of each entry of ``/proc/PID/fd`` (the ``readlink`` of the magic
    link: a path, ``pipe:[INODE]``, ``socket:[INODE]``, ``anon_inode:...``), by fd. Nothing
    when the directory cannot be listed (the process is gone); an fd closed while it is
    being read is skipped."""
    base = f"{proc_root}/{pid}"
    try:
        fds = sorted(int(n) for n in os.listdir(f"{base}/fd") if n.isdigit())
    except OSError:
        return
    for fd in fds:
        try:
            yield fd, os.readlink(f"{base}/fd/{fd}")
        except OSError:
            continue


# -- /proc/PID/maps, environ, ns --------------------------------------------------------------


def maps(pid: int | str, proc_root: str = "/proc") -> Iterator[tuple[str, int, int]]:
    """``(path, dev, inode)`` of each line of ``/proc/PID/maps`` that names a path (field 6;
    ``[heap]``, ``[stack]`` too, with inode 0), ``dev`` from field 4 (``major:minor``, hex)
    and ``inode`` from field 5. Raises when iterated (``FileNotFoundError``,
    ``PermissionError`` for another user's process)."""
    with open(f"{proc_root}/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            yield parts[5].strip(), os.makedev(major, minor), int(parts[4])


def environ_value(pid: int, name: str, proc_root: str = "/proc") -> Optional[bytes]:
    """The value of ``name`` in the initial environment of ``pid`` (``/proc/PID/environ``,
    NUL-separated ``NAME=value`` entries; the first one wins); None when it is not set."""
    with open(f"{proc_root}/{pid}/environ", "rb") as f:
        env = f.read().split(b"\0")
    prefix = name.encode() + b"="
    for item in env:
        if item.startswith(prefix):
            return item[len(prefix) :]
    return None


def ns_inode(pid: int | str, kind: str, proc_root: str = "/proc") -> int:
    """Inode of ``/proc/PID/ns/KIND`` (the namespace's identity, namespaces(7)); ``pid`` may
    be ``"self"`` / ``"thread-self"``."""
    return os.stat(f"{proc_root}/{pid}/ns/{kind}").st_ino


# -- /proc/PID/cgroup, mountinfo --------------------------------------------------------------


def parse_cgroup(text: str) -> list[tuple[int, tuple[str, ...], str]]:
    """A ``/proc/PID/cgroup`` text as [(hierarchy id, controllers, path)] (cgroup(7): one
    ``ID:CONTROLLERS:PATH`` line per cgroup v1 hierarchy, ``0::PATH`` for the v2 one)."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        hid, ctrls, path = line.split(":", 2)
        out.append((int(hid), tuple(c for c in ctrls.split(",") if c), path))
    return out


def cgroup(pid: int | str, proc_root: str = "/proc") -> list[tuple[int, tuple[str, ...], str]]:
    """:func:`parse_cgroup` of ``/proc/PID/cgroup``."""
    with open(f"{proc_root}/{pid}/cgroup") as f:
        return parse_cgroup(f.read())


def cgroup_paths(text: str) -> list[str]:
    """The PATH field (after the second ``:``) of each line of a ``/proc/PID/cgroup`` text,
    whatever the rest of the line holds."""
    return [line.split(":", 2)[-1] for line in text.splitlines()]


def _unescape(s: str) -> str:
    """A mountinfo field with its octal escapes (space, tab, newline, backslash) undone."""
    return (
        s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
    )


def cgroup_mounts(mountinfo: str) -> list[tuple[str, str, str, frozenset]]:
    """Cgroup mounts in a ``/proc/PID/mountinfo`` text (proc(5)): [(fstype ("cgroup" or
    "cgroup2"), mount point (field 5), root within the hierarchy (field 4), super options)]."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        f = left.split()
        r = right.split()
        if len(f) < 5 or len(r) < 3 or r[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((r[0], _unescape(f[4]), _unescape(f[3]), frozenset(r[2].split(","))))
    return out


def mount_ids(pid: int, proc_root: str = "/proc") -> set[int]:
    """Mount IDs (``/proc/PID/mountinfo`` field 1) of ``pid``'s mount namespace."""
    with open(f"{proc_root}/{pid}/mountinfo") as f:
        return {int(ln.split(None, 1)[0]) for ln in f if ln.strip()}

"""The one home of /proc parsing (proc(5)): each function names the file and field it reads.

Every reader takes the pid (and, where tests point it elsewhere, a ``proc_root``) and raises
``OSError`` (``FileNotFoundError`` when the process or fd is gone) or ``ValueError`` (a line
or field that is not what proc(5) documents); callers decide what a vanished process means.
"""
from __future__ import annotations


def fdinfo(path: str) -> dict[str, str]:
    """The ``key: value`` lines of a ``/proc/PID/fdinfo/FD`` file (``pos``, ``flags``,
    ``mnt_id``, ``ino``, ...), values stripped."""
    with open(path) as f:
        return {k.strip(): v.strip() for k, _, v in
                (ln.partition(":") for ln in f.read().splitlines()) if k}


def fd_flags(pid: int, fd: int, proc_root: str = "/proc") -> int:
    """The open-file status flags of ``fd`` in ``pid``: ``/proc/PID/fdinfo/FD`` line
    ``flags:`` (octal, proc(5)), e.g. ``os.O_WRONLY | os.O_APPEND``. ``ValueError`` when the
    file has no such line."""
    info = fdinfo(f"{proc_root}/{pid}/fdinfo/{fd}")
    if "flags" not in info:
        raise ValueError(f"{proc_root}/{pid}/fdinfo/{fd} has no flags line")
    return int(info["flags"], 8)


def stat_fields(pid: int, proc_root: str = "/proc") -> tuple[str, list[str]]:
    """``(comm, fields)`` of ``/proc/PID/stat``: ``comm`` without its parentheses (it may hold
    spaces and parentheses itself) and the fields after it, so ``fields[0]`` is the state
    (field 3 of proc(5)), ``fields[1]`` the ppid (field 4), ``fields[19]`` the start time in
    clock ticks since boot (field 22)."""
    with open(f"{proc_root}/{pid}/stat", "rb") as f:
        data = f.read().decode(errors="replace")
    lp, rp = data.index("("), data.rindex(")")
    return data[lp + 1:rp], data[rp + 2:].split()


def starttime(pid: int, proc_root: str = "/proc") -> int | None:
    """Start time of a live process (``/proc/PID/stat`` field 22, clock ticks since boot);
    None when it is gone or a zombie (state Z or X)."""
    try:
        _, fields = stat_fields(pid, proc_root)
        return None if fields[0] in "ZX" else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None

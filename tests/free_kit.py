"""Pids, ports and paths a test may take because it showed them free (case 018): no test
assumes that pid 100, port 9464 or /tmp/x is unused on the machine that runs it.

- :func:`free_pids`: process ids with no ``/proc/PID`` (neither a process nor a thread: a
  thread id has its ``/proc/TID`` too), below ``pid_max``, taken just below the kernel's last
  allocated pid (``/proc/sys/kernel/ns_last_pid``) going down: the allocator hands out pids
  upward from there (wrapping to 300 past ``pid_max``, kernel/pid.c ``RESERVED_PIDS``), so
  those come up last. The proof holds when taken; take them right before use.
- :func:`free_port`: a TCP port the kernel just gave a socket bound to port 0 (closed again).
"""

from __future__ import annotations

import os
import socket

#: the kernel never hands out pids below this after a wrap (kernel/pid.c RESERVED_PIDS)
RESERVED_PIDS = 300


def _read_int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default


def pid_in_use(pid: int) -> bool:
    """``/proc/PID`` exists: a process or a thread has that id."""
    return os.path.exists(f"/proc/{int(pid)}")


def free_pids(n: int = 1, avoid=()) -> list[int]:
    """``n`` distinct pids, none in ``/proc`` (process or thread) nor in ``avoid``, each in
    [RESERVED_PIDS, pid_max), from just below the last allocated pid downward (then from
    pid_max down). Raises ``RuntimeError`` when fewer than ``n`` are free."""
    pid_max = _read_int("/proc/sys/kernel/pid_max", 32768)
    last = _read_int("/proc/sys/kernel/ns_last_pid", pid_max - 1)
    avoid = {int(p) for p in avoid}
    out: list[int] = []
    for pid in [
        *range(min(last, pid_max) - 1, RESERVED_PIDS - 1, -1),
        *range(pid_max - 1, last, -1),
    ]:
        if pid not in avoid and not pid_in_use(pid):
            out.append(pid)
            if len(out) == n:
                return out
    raise RuntimeError(f"fewer than {n} free pids below pid_max {pid_max}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that the kernel just chose for a bind to port 0 (the socket is
    closed again, so a server started right after can bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

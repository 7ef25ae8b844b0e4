"""The TCP sockets of a process tree, for the census: the agent runs CRIU without
``--tcp-established`` (docs/criu.md), so a tree holding a TCP connection cannot be dumped
("In-flight connection" or "Connected TCP socket" in CRIU's log, after the shared memory was
torn down). torch.distributed holds such connections (NCCL's bootstrap ring, gloo's pairs, a
``TCPStore`` client), so do RPC clients and servers between ranks.

:func:`tree_sockets` lists them from ``/proc/PID/fd`` (``socket:[INODE]``) and the tables of
the process's network namespace, ``/proc/PID/net/tcp`` and ``tcp6`` (proc(5): hexadecimal
``ADDR:PORT``, each 32-bit word of the address in host order, ``st`` the kernel's
``TCP_*`` state number from include/net/tcp_states.h).
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Iterable

from cuinterpose.agent.mech.procfs import fd_targets

#: include/net/tcp_states.h
STATES = {
    1: "ESTABLISHED",
    2: "SYN_SENT",
    3: "SYN_RECV",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    8: "CLOSE_WAIT",
    9: "LAST_ACK",
    10: "LISTEN",
    11: "CLOSING",
    12: "NEW_SYN_RECV",
}


def parse_addr(hexaddr: str) -> str:
    """``ADDR:PORT`` of a /proc/net/tcp{,6} row as ``1.2.3.4:80`` or ``[::1]:80``."""
    h, port = hexaddr.split(":")
    raw = bytes.fromhex(h)
    words = b"".join(struct.pack("=I", w) for w in struct.unpack(f">{len(raw) // 4}I", raw))
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, words)}:{int(port, 16)}"
    return f"[{socket.inet_ntop(socket.AF_INET6, words)}]:{int(port, 16)}"


def parse_table(text: str) -> dict[int, dict]:
    """Rows of a /proc/net/tcp{,6} text by socket inode: {"local", "remote", "state"}."""
    out = {}
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        st = int(f[3], 16)
        out[int(f[9])] = {
            "local": parse_addr(f[1]),
            "remote": parse_addr(f[2]),
            "state": STATES.get(st, f"state {st}"),
        }
    return out


def tree_sockets(pids: Iterable[int], proc_root: str = "/proc") -> list[dict]:
    """The TCP sockets the processes ``pids`` hold open: ``[{"pid", "fd", "local", "remote",
    "state"}]`` by pid and fd. A process that vanishes while being read is skipped."""
    out, tables = [], {}
    for pid in sorted(pids):
        try:
            inodes = {
                int(t[8:-1]): fd for fd, t in fd_targets(pid, proc_root) if t.startswith("socket:[")
            }
            if not inodes:
                continue
            net = os.stat(f"{proc_root}/{pid}/ns/net").st_ino
            if net not in tables:
                tables[net] = {}
                for name in ("tcp", "tcp6"):
                    try:
                        with open(f"{proc_root}/{pid}/net/{name}") as f:
                            tables[net].update(parse_table(f.read()))
                    except FileNotFoundError:  # no IPv6 in that namespace
                        pass
        except (OSError, ValueError):
            continue
        for ino, fd in sorted(inodes.items(), key=lambda x: x[1]):
            row = tables[net].get(ino)
            if row is not None:
                out.append({"pid": pid, "fd": fd, **row})
    return out

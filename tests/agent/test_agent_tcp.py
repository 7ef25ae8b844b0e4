"""agent/mech/tcp.py: the rows of /proc/net/tcp{,6} (proc(5)) decoded, and a live process's
TCP sockets listed by pid and fd with their addresses and states."""

from __future__ import annotations

import os
import socket

from cuinterpose.agent.mech import tcp

TCP = """  sl  local_address rem_address st tx_queue rx_queue tr tm->when retrnsmt uid timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0 100 0 0 10 0
   1: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0 20 4 30 10 -1
"""
TCP6 = """  sl  local_address remote_address st tx_queue rx_queue tr tm->when retrnsmt uid timeout inode
   0: 00000000000000000000000001000000:0050 00000000000000000000000000000000:0000 0A 0:0 0:0 0 0 0 77
   1: 0000000000000000FFFF00000100007F:0050 0000000000000000FFFF00000200000A:C350 08 0:0 0:0 0 0 0 78
"""


def test_rows_decode_addresses_ports_and_states():
    assert tcp.parse_table(TCP) == {
        4242: {"local": "127.0.0.1:8080", "remote": "0.0.0.0:0", "state": "LISTEN"},
        4343: {"local": "127.0.0.1:54321", "remote": "127.0.0.1:8080", "state": "ESTABLISHED"},
    }
    assert tcp.parse_table(TCP6) == {
        77: {"local": "[::1]:80", "remote": "[::]:0", "state": "LISTEN"},
        78: {
            "local": "[::ffff:127.0.0.1]:80",
            "remote": "[::ffff:10.0.0.2]:50000",
            "state": "CLOSE_WAIT",
        },
    }


def test_a_live_connection_and_its_listener_are_listed_by_fd():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    c = socket.create_connection(s.getsockname())
    a, _ = s.accept()
    try:
        lo, cl = f"127.0.0.1:{s.getsockname()[1]}", f"127.0.0.1:{c.getsockname()[1]}"
        got = [
            r
            for r in tcp.tree_sockets([os.getpid()])
            if r["fd"] in (s.fileno(), c.fileno(), a.fileno())
        ]
        assert got == sorted(
            [
                {
                    "pid": os.getpid(),
                    "fd": s.fileno(),
                    "local": lo,
                    "remote": "0.0.0.0:0",
                    "state": "LISTEN",
                },
                {
                    "pid": os.getpid(),
                    "fd": c.fileno(),
                    "local": cl,
                    "remote": lo,
                    "state": "ESTABLISHED",
                },
                {
                    "pid": os.getpid(),
                    "fd": a.fileno(),
                    "local": lo,
                    "remote": cl,
                    "state": "ESTABLISHED",
                },
            ],
            key=lambda r: r["fd"],
        )
    finally:
        for x in (a, c, s):
            x.close()
    assert tcp.tree_sockets([2**22 + 9]) == []  # no such process

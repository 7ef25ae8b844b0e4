"""FETCH_FD as a peer shim sends it, with the allocation's secret (protocol.h "Secrets"):
``fetch_fd`` returns (Reply, message, fd or None); ``ticket_secret`` reads the secret from an
allocation ticket another process holds (``/proc/<pid>/fd/<fd>``, same uid)."""

from __future__ import annotations

import array
import os
import socket

from cuinterpose.coordinator.protocol import (
    REQUEST_SECRET_INDEX,
    TICKET_SECRET_INDEX,
    Op,
    Phase,
    Reply,
    Request,
    Ticket,
    socket_path,
)


def ticket_secret(pid: int, fd: int) -> int:
    with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
        return Ticket.unpack(f.read(Ticket.SIZE)).reserved[TICKET_SECRET_INDEX]


def fetch_fd(control_dir: str, pid: int, alloc_id: bytes, secret: int, sender_pid: int = 0):
    """One FETCH_FD of ``alloc_id`` from shim ``pid``; blocks until the reply (the shim's own
    deadline bounds it). Returns (Reply, message str, received fd or None)."""
    reserved = [0, 0, 0]
    reserved[REQUEST_SECRET_INDEX] = secret
    req = Request(
        op=Op.FETCH_FD,
        expected_phase=Phase.ACTIVE,
        sender_pid=sender_pid or os.getpid(),
        alloc_id=alloc_id,
        reserved=tuple(reserved),
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(socket_path(control_dir, pid))
        s.sendall(req.pack())
        fds = array.array("i")
        head, anc, _, _ = s.recvmsg(Reply.SIZE, socket.CMSG_SPACE(fds.itemsize))
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        while len(head) < Reply.SIZE:
            chunk = s.recv(Reply.SIZE - len(head))
            assert chunk, "connection closed inside the reply header"
            head += chunk
        rep = Reply.unpack(head)
        msg = b""
        while len(msg) < rep.message_len:
            chunk = s.recv(rep.message_len - len(msg))
            assert chunk, "connection closed inside the message"
            msg += chunk
    return rep, msg.decode(), (fds[0] if fds else None)

"""Launcher <-> rank messages over a Unix stream socket.

A frame is a 4-byte big-endian length then that many bytes of UTF-8 JSON (an object with a
``"type"`` key). A frame that carries file descriptors names how many in ``"nfds"``; they travel
as SCM_RIGHTS ancillary data of the ``sendmsg`` that carries the frame and are handed out in
arrival order. Frames are at most ``MAX_FRAME`` bytes.
"""

from __future__ import annotations

import array
import json
import os
import select
import socket
import struct

MAX_FRAME = 16 << 20
MAX_FDS = 64


class ChannelClosed(EOFError):
    """The peer closed the socket, or it was reset (the peer died with data unread)."""


class Channel:
    """Framed JSON messages (+ fds) over one connected ``AF_UNIX`` ``SOCK_STREAM`` socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self._fds: list[int] = []
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: dict, fds: list[int] | tuple[int, ...] = ()) -> None:
        """Send one message; ``fds`` are duplicated into the receiver (caller keeps its own)."""
        if fds:
            msg = dict(msg, nfds=len(fds))
        body = json.dumps(msg, separators=(",", ":")).encode()
        if len(body) > MAX_FRAME:
            raise ValueError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
        data = struct.pack(">I", len(body)) + body
        if fds:
            sent = socket.send_fds(self.sock, [data], list(fds))
            if sent < len(data):
                self.sock.sendall(data[sent:])
        else:
            self.sock.sendall(data)

    def _fill(self, timeout: float | None) -> bool:
        """Read what is available (waiting up to ``timeout`` s; None = forever). Returns False
        on timeout. Raises ``ChannelClosed`` at EOF."""
        if timeout is not None:
            r, _, _ = select.select([self.sock], [], [], timeout)
            if not r:
                return False
        try:
            data, anc, _flags, _addr = self.sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
            )
        except ConnectionResetError:
            # a peer killed with unread data in its socket (a rank SIGKILLed at the quiesce
            # request, case 010): the same as EOF, so the launcher reports the dead rank
            self.closed = True
            raise ChannelClosed("peer reset the connection (killed?)") from None
        for level, typ, cdata in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - (len(cdata) % fds.itemsize)])
                self._fds.extend(fds)
        if not data:
            self.closed = True
            raise ChannelClosed("peer closed the socket")
        self._buf += data
        return True

    def _pop(self) -> tuple[dict, list[int]] | None:
        if len(self._buf) < 4:
            return None
        (n,) = struct.unpack_from(">I", self._buf)
        if n > MAX_FRAME:
            raise ValueError(f"incoming frame of {n} bytes exceeds {MAX_FRAME}")
        if len(self._buf) < 4 + n:
            return None
        msg = json.loads(bytes(self._buf[4 : 4 + n]))
        del self._buf[: 4 + n]
        k = int(msg.get("nfds", 0))
        if k > len(self._fds):
            raise ValueError(f"frame {msg.get('type')!r} names {k} fds, {len(self._fds)} arrived")
        fds, self._fds = self._fds[:k], self._fds[k:]
        return msg, fds

    def recv(self, timeout: float | None = None) -> tuple[dict, list[int]] | None:
        """Next (message, fds); None when nothing complete arrived within ``timeout`` s.

        The caller owns the returned fds. Raises ``ChannelClosed`` at EOF."""
        got = self._pop()
        if got is not None:
            return got
        if timeout == 0:
            while self._fill(0):
                got = self._pop()
                if got is not None:
                    return got
            return None
        if not self._fill(timeout):
            return None
        return self._pop() if timeout is not None else self._recv_blocking()

    def _recv_blocking(self) -> tuple[dict, list[int]]:
        while True:
            got = self._pop()
            if got is not None:
                return got
            self._fill(None)

    def pump(self) -> list[tuple[dict, list[int]]]:
        """Read once (the socket must be readable) and return every complete message."""
        self._fill(None)
        out = []
        while (got := self._pop()) is not None:
            out.append(got)
        return out

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self.sock.close()
        self.closed = True

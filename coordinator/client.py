"""Client side of the shim control socket: one request per connection (protocol.h).

``ShimClient(socket_path, timeout_s).request(op, txn_id=..., expected_phase=...)`` connects,
sends one ``cui_request``, reads the ``cui_reply``, its records and message with exact reads,
and returns a :class:`Response`. A FETCH_FD reply's SCM_RIGHTS descriptor is returned in
``Response.fd`` (the caller owns it; ``Response.close()`` or ``with`` closes it).

``timeout_s`` bounds the whole request (connect + send + every read), not each syscall.
A request may be given a longer deadline than the client's (SAVE_ALLOCATIONS and
LOAD_ALLOCATIONS get the carrier timeout, an hour by default), but a peer that is stopped
(``/proc/PID/stat`` state T or t: SIGSTOP, a job-control stop, a debugger) cannot reply at
all: while a reply is awaited the client looks at the peer's state every
:data:`PEER_CHECK_S` and raises :class:`ShimTimeout` once the peer has stayed stopped for the
client's ``timeout_s`` (shared/cases/001's kind: nothing waits on a stopped process past the
phase timeout).

SAVE_ALLOCATIONS and LOAD_ALLOCATIONS take ``carriers`` (:class:`CarrierRequest`: chunk_bytes,
staging_bytes, writers and one (:class:`StreamEntry`, fd) per carried allocation; protocol.h
"Carriers"): the entries follow the request in groups, each group's descriptors as SCM_RIGHTS.
The caller keeps owning those descriptors (the shim receives duplicates). A request with an
``opener`` (SAVE_ALLOCATIONS; ``CUI_CARRY_STREAMED``, decisions D70) sends the entries first and
each descriptor group as soon as ``opener`` opened its files (protocol.h "Carriers"), so that
the shim copies and writes while the next files are created; an OSError of ``opener`` is sent
to the shim as the last group (it fails the op) and raised, with the shim's answer, once its
reply is read. A SAVE_ALLOCATIONS reply's chunk table comes back in ``Response.chunk_table``
(raw bytes, parse it with :func:`~cuinterpose.coordinator.protocol.parse_chunk_table`).

The client never retries: a mutating op whose reply is lost cannot tell whether the
mutation happened (protocol.h, "Request rules"). A shim may answer a SAVE/LOAD request before
it read the chunk files' entries (``CUI_BUSY`` while another op runs, a refusal) and close the
connection: a send that fails then (EPIPE, ECONNRESET) reads that answer instead of failing
("Broken pipe" would hide a retryable BUSY). It does not interpret ``status`` either;
refusals and failures come back as a normal :class:`Response` for the caller to judge.

Errors (all subclass :class:`ShimClientError`, each names the socket and the pid):
- :class:`ShimConnectError`: the socket is missing or refuses the connection.
- :class:`ShimTimeout`: no complete reply within ``timeout_s``.
- :class:`ShimProtocolError`: short read (peer closed early), bad magic/version, a reply for
  another op or txn, an unexpected record size, too many bytes, or a stray descriptor.

Test only: ``CUINTERPOSE_TEST_DROP_REPLY=OP[@PID][:N][,...]`` (``OP`` an :class:`Op` name;
``PID`` the shim's pid; ``N`` >= 1, default 1) makes this process close the connection after
sending its N-th request of ``OP`` (to ``PID``, when given), before reading the reply: the shim
runs the op, the client raises :class:`ShimProtocolError` ("reply dropped by
CUINTERPOSE_TEST_DROP_REPLY") as a lost reply would (shared/cases/006), and says so on stderr.
Without ``PID`` the count is in send order, which parallel sends make racy. The chaos suite
(tests/chaos, docs/testing.md) uses it; unset, it costs one environment lookup.
"""

from __future__ import annotations

import array
import errno
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .protocol import (
    CUI_INSPECT_DEVICES,
    CUI_PROTO_MAGIC,
    CUI_PROTO_VERSION,
    DEFAULT_CHUNK_CHECKSUM,
    MUTATING_OPS,
    RECORD_SIZE,
    REPLY_SIZE,
    CarryFlag,
    ChunkRef,
    Op,
    ProtocolError,
    Record,
    Reply,
    Request,
    Status,
    StreamEntry,
    alloc_id_bytes,
    carrier_reserved,
    chunk_checksum_flag,
    entry_groups,
    fd_group,
    known_table,
    open_groups,
    pid_from_socket_path,
    source_table,
)

__all__ = [
    "ShimClient",
    "Response",
    "CarrierRequest",
    "ShimClientError",
    "ShimConnectError",
    "ShimTimeout",
    "ShimProtocolError",
    "MAX_REPLY_BYTES",
]

#: Upper bound on records + message in one reply (32 MiB), a guard against garbage lengths.
MAX_REPLY_BYTES = 32 << 20

#: Test only (module docstring): the variable, and the requests of each op sent so far.
DROP_REPLY_ENV = "CUINTERPOSE_TEST_DROP_REPLY"
_sent: dict[tuple, int] = {}
_sent_lock = threading.Lock()


def parse_drop_reply(spec: str) -> set[tuple[str, int | None, int]]:
    """The entries of a ``CUINTERPOSE_TEST_DROP_REPLY`` value: {(op name, pid or None, N)}
    (empty for ""). A malformed value raises ValueError naming it."""
    wanted: set[tuple[str, int | None, int]] = set()
    for entry in spec.split(",") if spec else ():
        head, _, count = entry.strip().partition(":")
        want, _, at = head.partition("@")
        count = count or "1"
        if (
            want not in Op.__members__
            or not count.isdigit()
            or int(count) < 1
            or not (at == "" or at.isdigit())
        ):
            raise ValueError(
                f"{DROP_REPLY_ENV}={spec!r}: {entry!r} is not OP[@PID][:N] (OP an op name such "
                "as SAVE_ALLOCATIONS, N >= 1); unset it outside tests"
            )
        wanted.add((want, int(at) if at else None, int(count)))
    return wanted


def drop_reply_spec() -> set[tuple[str, int | None, int]]:
    """The entries of this process's ``CUINTERPOSE_TEST_DROP_REPLY`` (:func:`parse_drop_reply`;
    empty when unset). A malformed value raises ValueError naming it."""
    return parse_drop_reply(os.environ.get(DROP_REPLY_ENV, ""))


def _drop_reply(op_name: str, pid: int | None) -> bool:
    """Count one sent request of ``op_name`` to ``pid``; True when ``CUINTERPOSE_TEST_DROP_REPLY``
    names this one (its op, pid and count). A malformed value raises ValueError naming it."""
    spec = os.environ.get(DROP_REPLY_ENV)
    if not spec:
        return False
    wanted = parse_drop_reply(spec)
    with _sent_lock:
        _sent[(op_name, None)] = n = _sent.get((op_name, None), 0) + 1
        _sent[(op_name, pid)] = k = _sent.get((op_name, pid), 0) + 1
    if (op_name, None, n) not in wanted and (op_name, pid, k) not in wanted:
        return False
    sys.stderr.write(f"{DROP_REPLY_ENV}: dropping the reply of {op_name} request {n} (pid {pid})\n")
    return True


def _op_name(op) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"op {int(op)}"


def _status_name(status) -> str:
    try:
        return Status(status).name
    except ValueError:
        return str(int(status))


class ShimClientError(Exception):
    """A request that got no usable reply. ``socket_path``, ``pid`` (may be None), ``op``."""

    def __init__(self, message: str, *, socket_path: str, pid: int | None, op=None):
        super().__init__(message)
        self.socket_path = socket_path
        self.pid = pid
        self.op = op


class ShimConnectError(ShimClientError):
    """The control socket does not exist or refused the connection."""


class ShimTimeout(ShimClientError):
    """The shim did not answer completely within the request's timeout."""


class ShimProtocolError(ShimClientError):
    """The reply does not follow protocol.h (short read, bad header, stray FD, ...)."""


@dataclass
class CarrierRequest:
    """The chunk files of one SAVE_ALLOCATIONS / LOAD_ALLOCATIONS request (protocol.h
    "Carriers"): ``chunk_bytes``, ``staging_bytes`` (bytes), ``writers`` (threads) and
    ``streams``, one (StreamEntry, open fd) per carried allocation; with ``opener`` (SAVE), fd
    is -1 until ``opener(i)`` opened entry i's file while the request is sent."""

    chunk_bytes: int
    staging_bytes: int
    writers: int
    streams: list[tuple[StreamEntry, int]] = field(default_factory=list)
    #: SAVE (chunk store): digests of chunks already stored, not written (None: no table)
    known: list[bytes] | None = None
    #: LOAD (chunk store): (size in bytes, open fd) per source file, and the chunk refs
    sources: list[tuple[int, int]] = field(default_factory=list)
    refs: list[ChunkRef] = field(default_factory=list)
    #: the chunk checksum (a key of CHUNK_CHECKSUMS): SAVE computes it, LOAD verifies it
    checksum: str = DEFAULT_CHUNK_CHECKSUM
    #: SAVE: opens entry i's file and returns its fd (OSError naming it): CUI_CARRY_STREAMED
    opener: Callable[[int], int] | None = None
    #: the directory the files are opened in (CarrierFiles; never sent), or -1
    dir_fd: int = -1

    @property
    def flags(self) -> int:
        """The request's :class:`CarryFlag` bits."""
        f = chunk_checksum_flag(self.checksum)
        if self.known is not None:
            f |= CarryFlag.KNOWN
        if self.sources or self.refs:
            f |= CarryFlag.SOURCES
        if self.opener is not None:
            f |= CarryFlag.STREAMED
        return int(f)


@dataclass
class Response:
    """One shim reply: header, records, UTF-8 message, the FETCH_FD descriptor (or None) and
    the SAVE_ALLOCATIONS chunk table (raw bytes, empty otherwise)."""

    reply: Reply
    records: list[Record] = field(default_factory=list)
    message: str = ""
    fd: int | None = None
    chunk_table: bytes = b""

    @property
    def status(self):
        return self.reply.status

    @property
    def ok(self) -> bool:
        return self.reply.status == Status.OK

    def close(self) -> None:
        """Close the received descriptor, if any (idempotent)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __enter__(self) -> "Response":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: seconds between two looks at the peer's process state while a reply is awaited
PEER_CHECK_S = 0.25


def _proc_state(pid: int | None) -> str | None:
    """The state letter of ``pid`` in ``/proc/PID/stat`` (None: no pid, or unreadable)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


class ShimClient:
    """Talks to one shim's control socket.

    ``socket_path``: ``<control dir>/cuinterpose-<pid>.sock``. ``timeout_s``: seconds for a whole
    request. ``pid``: for error messages; defaults to the pid in the socket name.
    ``inspect_devices``: INSPECT requests set ``CUI_INSPECT_DEVICES`` (the shim then also sends
    one DEVICE record per device ordinal the process uses: protocol.h). ``claim``: the 16-byte
    claim token every mutating request carries (protocol.h "Claims"; None: zeros, which a shim
    refuses with ``CUI_REFUSED_PEER``).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike,
        timeout_s: float = 10.0,
        *,
        pid: int | None = None,
        sender_pid: int | None = None,
        inspect_devices: bool = False,
        claim: bytes | None = None,
    ):
        self.socket_path = os.fspath(socket_path)
        #: the claim token of mutating requests (protocol.h "Claims")
        self.claim = claim
        #: INSPECT requests ask for the DEVICE records (CUI_INSPECT_DEVICES, protocol.h)
        self.inspect_devices = bool(inspect_devices)
        self.timeout_s = float(timeout_s)
        self.pid = pid if pid is not None else pid_from_socket_path(self.socket_path)
        self.sender_pid = sender_pid if sender_pid is not None else os.getpid()

    def __repr__(self) -> str:
        return f"ShimClient({self.socket_path!r}, timeout_s={self.timeout_s})"

    def _who(self) -> str:
        who = f"pid {self.pid}" if self.pid is not None else "shim"
        return f"{who} (socket {self.socket_path})"

    def request(
        self,
        op: int,
        *,
        txn_id: int,
        expected_phase: int,
        alloc_id: bytes = b"",
        timeout_s: float | None = None,
        carriers: CarrierRequest | None = None,
    ) -> Response:
        """Send one request and return the shim's :class:`Response`.

        ``op``: :class:`Op`; ``txn_id``: uint64; ``expected_phase``: :class:`Phase`;
        ``alloc_id``: up to 16 bytes (FETCH_FD); ``timeout_s`` overrides the client default.
        Raises :class:`ShimConnectError`, :class:`ShimTimeout`, :class:`ShimProtocolError`.
        A BUSY reply (another mutating request runs; nothing changed, the txn was not
        consumed) is retried with the same txn until the deadline; the last BUSY reply is
        returned when the deadline passes.
        """
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout
        pause = 0.002
        while True:
            resp = self._request_once(
                op, txn_id, expected_phase, alloc_id, deadline, timeout, carriers
            )
            left = deadline - time.monotonic()
            if resp.reply.status != Status.BUSY or left <= pause:
                return resp
            time.sleep(pause)  # back off: the running request finishes on its own
            pause = min(pause * 2, 0.1)

    def _send_carriers(self, sock, carriers: CarrierRequest, deadline: float) -> OSError | None:
        """The entries with their descriptors, then the chunk store's table, if any; streamed:
        the entries, the table, then the descriptor groups as their files are opened. Returns
        the opener's OSError that ended them (sent as the last group), else None."""

        def groups(groups, fdlist):
            for data, first, count in groups:
                self._set_deadline(sock, deadline)
                fds = array.array("i", fdlist[first : first + count]).tobytes()
                sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                if sent < len(data):
                    sock.sendall(data[sent:])

        flags = carriers.flags
        if flags & CarryFlag.STREAMED:
            self._set_deadline(sock, deadline)
            sock.sendall(b"".join(e.pack() for e, _ in carriers.streams))
        else:
            groups(
                entry_groups([e for e, _ in carriers.streams]), [fd for _, fd in carriers.streams]
            )
        if flags & CarryFlag.KNOWN:
            self._set_deadline(sock, deadline)
            sock.sendall(known_table(carriers.known or []))
        if flags & CarryFlag.SOURCES:
            head, src_groups, refs = source_table([b for b, _ in carriers.sources], carriers.refs)
            self._set_deadline(sock, deadline)
            sock.sendall(head)
            groups(src_groups, [fd for _, fd in carriers.sources])
            self._set_deadline(sock, deadline)
            sock.sendall(refs)
        if not flags & CarryFlag.STREAMED:
            return None
        for _, fds, exc in open_groups(carriers.streams, carriers.opener):
            self._set_deadline(sock, deadline)
            if exc is not None:
                sock.sendall(fd_group(0, exc.errno or errno.EIO))
                return exc
            groups([(fd_group(len(fds)), 0, len(fds))], fds)
        return None

    def _request_once(
        self,
        op: int,
        txn_id: int,
        expected_phase: int,
        alloc_id: bytes,
        deadline: float,
        total,
        carriers: CarrierRequest | None = None,
    ) -> Response:
        timeout = max(deadline - time.monotonic(), 1e-3)
        op_name = _op_name(op)
        req = Request(
            op=op,
            txn_id=txn_id,
            expected_phase=expected_phase,
            sender_pid=self.sender_pid,
            alloc_id=alloc_id_bytes(
                alloc_id or (self.claim if op in MUTATING_OPS else None) or None
            ),
            reserved=(
                CUI_INSPECT_DEVICES if op == Op.INSPECT and self.inspect_devices else 0,
                0,
                0,
            )
            if carriers is None
            else carrier_reserved(
                carriers.chunk_bytes,
                carriers.staging_bytes,
                carriers.writers,
                len(carriers.streams),
                carriers.flags,
            ),
        )
        fds: list[int] = []
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            try:
                sock.settimeout(max(timeout, 1e-3))
                sock.connect(self.socket_path)
            except socket.timeout:
                raise ShimTimeout(
                    f"{op_name}: {self._who()}: connect timed out after {total:g} s",
                    socket_path=self.socket_path,
                    pid=self.pid,
                    op=op,
                ) from None
            except OSError as exc:
                raise ShimConnectError(
                    f"{op_name}: cannot connect to {self._who()}: {exc.strerror or exc}",
                    socket_path=self.socket_path,
                    pid=self.pid,
                    op=op,
                ) from None
            try:
                self._set_deadline(sock, deadline)
                sock.sendall(req.pack())
                cut = unopened = None
                if carriers is not None:
                    try:
                        unopened = self._send_carriers(sock, carriers, deadline)
                    except (BrokenPipeError, ConnectionResetError) as exc:
                        # the shim answered the 64-byte request before it read the rest (BUSY
                        # while another op runs, a refusal) and closed: that answer is readable
                        cut = exc
                if _drop_reply(op_name, self.pid):
                    raise self._proto(
                        op, f"reply dropped by {DROP_REPLY_ENV} (test only): connection closed"
                    )
                try:
                    head = self._read_exact(sock, REPLY_SIZE, deadline, fds, "reply header", op)
                except ShimProtocolError:
                    if cut is None:
                        raise
                    raise cut from None  # no early answer: the send's own error
                try:
                    reply = Reply.unpack(head)
                except ProtocolError as exc:
                    raise self._proto(op, f"bad reply header: {exc}") from None
                self._check_header(reply, op, txn_id)
                body_len = reply.record_count * reply.record_size + reply.message_len
                if body_len > MAX_REPLY_BYTES:
                    raise self._proto(
                        op,
                        f"reply announces {body_len} bytes of records and "
                        f"message, more than {MAX_REPLY_BYTES}",
                    )
                raw = self._read_exact(
                    sock,
                    reply.record_count * reply.record_size,
                    deadline,
                    fds,
                    f"{reply.record_count} records",
                    op,
                )
                msg = self._read_exact(sock, reply.message_len, deadline, fds, "message", op)
                table = b""
                if op == Op.SAVE_ALLOCATIONS and reply.status == Status.OK and reply.reserved[0]:
                    tlen = reply.reserved[0]
                    if tlen > 8 * MAX_REPLY_BYTES:
                        raise self._proto(op, f"reply announces a chunk table of {tlen} bytes")
                    table = self._read_exact(sock, tlen, deadline, fds, "chunk table", op)
            except socket.timeout:
                raise ShimTimeout(
                    f"{op_name}: {self._who()} did not reply within {total:g} s",
                    socket_path=self.socket_path,
                    pid=self.pid,
                    op=op,
                ) from None
            except OSError as exc:
                raise ShimProtocolError(
                    f"{op_name}: {self._who()}: connection failed: {exc.strerror or exc}",
                    socket_path=self.socket_path,
                    pid=self.pid,
                    op=op,
                ) from None
            try:
                records = Record.unpack_many(raw, reply.record_count)
            except ProtocolError as exc:
                raise self._proto(op, f"bad record: {exc}") from None
            if len(fds) > 1 or (fds and (op != Op.FETCH_FD or reply.status != Status.OK)):
                raise self._proto(
                    op,
                    f"unexpected {len(fds)} descriptor(s) with status "
                    f"{_status_name(reply.status)} reply",
                )
            fd = fds.pop() if fds else None
            if unopened is not None:  # the file's own error, with what the shim made of it
                text = msg.decode("utf-8", errors="replace")
                raise OSError(
                    unopened.errno,
                    f"{unopened.strerror}; the shim answered {_status_name(reply.status)}: {text}",
                ) from None
            return Response(
                reply=reply,
                records=records,
                message=msg.decode("utf-8", errors="replace"),
                fd=fd,
                chunk_table=table,
            )
        finally:
            for fd in fds:
                os.close(fd)
            sock.close()

    # --- helpers ------------------------------------------------------------------------
    def _proto(self, op, what: str) -> ShimProtocolError:
        op_name = _op_name(op)
        return ShimProtocolError(
            f"{op_name}: {self._who()}: {what}", socket_path=self.socket_path, pid=self.pid, op=op
        )

    def _check_header(self, reply: Reply, op, txn_id) -> None:
        if reply.magic != CUI_PROTO_MAGIC:
            raise self._proto(op, f"reply magic {reply.magic:#x} != {CUI_PROTO_MAGIC:#x}")
        if reply.version != CUI_PROTO_VERSION:
            raise self._proto(op, f"reply version {reply.version} != {CUI_PROTO_VERSION}")
        if reply.status == Status.BAD_REQUEST:
            return  # the shim may not have parsed op/txn; let the caller see the status
        if int(reply.op) != int(op) or reply.txn_id != txn_id:
            raise self._proto(
                op,
                f"reply is for op {int(reply.op)} txn {reply.txn_id}, "
                f"sent op {int(op)} txn {txn_id}",
            )
        if reply.record_count and reply.record_size != RECORD_SIZE:
            raise self._proto(op, f"record_size {reply.record_size} != {RECORD_SIZE}")

    @staticmethod
    def _set_deadline(sock: socket.socket, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        sock.settimeout(left)

    def _recvmsg(self, sock: socket.socket, n: int, anc: int, deadline: float, op, stopped):
        """``sock.recvmsg(n, anc)`` by the ``deadline``, in slices of :data:`PEER_CHECK_S`
        between which the peer's state is read: ``ShimTimeout`` once it stayed stopped (T/t)
        for the client's ``timeout_s`` (``stopped``: [monotonic time it was first seen stopped, or
        None], kept across the slices of one read)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            sock.settimeout(min(left, PEER_CHECK_S))
            try:
                return sock.recvmsg(n, anc)
            except socket.timeout:
                pass
            st = _proc_state(self.pid)
            if st not in ("T", "t"):
                stopped[0] = None
                continue
            now = time.monotonic()
            stopped[0] = stopped[0] if stopped[0] is not None else now
            if now - stopped[0] >= self.timeout_s:
                raise ShimTimeout(
                    f"{_op_name(op)}: {self._who()} is stopped (state {st}) and did not "
                    f"reply within {self.timeout_s:g} s: a stopped process cannot serve the "
                    f"request (`kill -CONT {self.pid}` it)",
                    socket_path=self.socket_path,
                    pid=self.pid,
                    op=op,
                )

    def _read_exact(
        self, sock: socket.socket, n: int, deadline: float, fds: list[int], what: str, op
    ) -> bytes:
        """Read exactly ``n`` bytes, collecting SCM_RIGHTS descriptors into ``fds``."""
        buf = bytearray()
        fd_size = array.array("i").itemsize
        stopped: list = [None]
        while len(buf) < n:
            data, ancdata, flags, _ = self._recvmsg(
                sock, n - len(buf), socket.CMSG_SPACE(4 * fd_size), deadline, op, stopped
            )
            for level, ctype, cdata in ancdata:
                if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(cdata[: len(cdata) - len(cdata) % fd_size])
                    fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise self._proto(op, "ancillary data truncated (too many descriptors)")
            if not data:
                raise self._proto(
                    op, f"short read: connection closed after {len(buf)} of {n} bytes of {what}"
                )
            buf += data
        return bytes(buf)

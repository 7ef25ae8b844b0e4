"""An in-process mock shim: the protocol.h control socket over a real Unix socket.

A test double for coordinator logic only (phase state machine, txn/phase refusals,
records, failures, hangs); it carries no bytes: SAVE_ALLOCATIONS / LOAD_ALLOCATIONS receive the
chunk file table and its descriptors (protocol.h "Carriers", kept in ``carrier_requests`` as
(op, chunk_bytes, [alloc_id hex])), close them, and SAVE answers a chunk table whose chunks are
all zero (the creators' carrier_checksum matches it). Every received request and sent reply is
appended to a shared :class:`EventLog` with a global sequence number, so tests can prove
ordering (the barrier) across mocks.
"""

from __future__ import annotations

import array
import dataclasses
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from cuinterpose.coordinator.protocol import (
    CUI_PROTO_MAGIC,
    CUI_PROTO_VERSION,
    MUTATING_OPS,
    REQUEST_SIZE,
    STREAM_ENTRY_SIZE,
    CarryFlag,
    Op,
    Phase,
    ProtocolError,
    Record,
    RecordFlag,
    RecordKind,
    Reply,
    Request,
    Role,
    Status,
    StreamTable,
    alloc_id_hex,
    socket_path,
)

# op -> (phase it needs, phase after) without multicast; see MockShim._transition
TRANSITIONS = {
    Op.SAVE_ALLOCATIONS: (Phase.ACTIVE, Phase.SAVED),
    Op.PREPARE_UNICAST: (Phase.SAVED, Phase.PREPARED),
    Op.LOAD_ALLOCATIONS: (Phase.PREPARED, Phase.LOADED),
    Op.RESTORE_UNICAST: (Phase.LOADED, Phase.ACTIVE),
    Op.CANCEL_CAPTURE: (Phase.SAVED, Phase.ACTIVE),
    Op.PREPARE_MULTICAST: (Phase.ACTIVE, Phase.MULTICAST_RELEASED),
    Op.RESTORE_MULTICAST_CREATORS: (Phase.MULTICAST_RELEASED, Phase.MULTICAST_CREATED),
    Op.RESTORE_MULTICAST_IMPORTERS: (Phase.MULTICAST_CREATED, Phase.MULTICAST_IMPORTED),
    Op.RESTORE_MULTICAST_DEVICES: (Phase.MULTICAST_IMPORTED, Phase.MULTICAST_DEVICES),
    Op.RESTORE_MULTICAST_BINDINGS: (Phase.MULTICAST_DEVICES, Phase.ACTIVE),
}
#: Ops whose failure leaves the phase as it was (protocol.h: SAVE_ALLOCATIONS only copies).
NON_DESTRUCTIVE_FAILURE = frozenset({Op.SAVE_ALLOCATIONS})


@dataclass
class Event:
    seq: int
    what: str  # "recv" | "reply"
    pid: int
    op: int
    txn_id: int
    expected_phase: int
    status: int = -1


class EventLog:
    """Thread-safe, globally ordered log shared by several mocks."""

    def __init__(self):
        self._lock = threading.Lock()
        self.events: list[Event] = []

    def add(self, what, pid, req: Request, status=-1) -> None:
        with self._lock:
            self.events.append(
                Event(
                    len(self.events),
                    what,
                    pid,
                    int(req.op),
                    req.txn_id,
                    int(req.expected_phase),
                    int(status),
                )
            )

    def of(self, what=None, pid=None, op=None) -> list[Event]:
        with self._lock:
            return [
                e
                for e in self.events
                if (what is None or e.what == what)
                and (pid is None or e.pid == pid)
                and (op is None or e.op == int(op))
            ]


@dataclass
class MockShim:
    """Serves ``<control_dir>/cuinterpose-<pid>.sock``.

    Knobs (all optional): ``refuse`` op -> (Status, message) answered without changing
    anything; ``fail`` op -> (cuda_result, message): status FAILED, phase FAILED (for
    SAVE_ALLOCATIONS the phase stays ACTIVE, as in the shim); ``hang``:
    ops never answered (connection held until :meth:`stop`); ``delay_s`` op -> seconds before
    replying; ``after`` op -> callable(mock) run on success (to mutate records);
    ``bytes_per_op``/``elapsed_ns``/``copy_ns`` reported on success; ``raw`` op -> callable
    (conn, request) that writes whatever it likes instead of a normal reply; ``gate`` op ->
    threading.Barrier shared by several mocks: each waits there before answering, so the op
    only succeeds if every mock received it concurrently (else FAILED "gate broken").
    """

    pid: int
    control_dir: str
    records: list[Record] = field(default_factory=list)
    log: EventLog = field(default_factory=EventLog)
    phase: Phase = Phase.ACTIVE
    refuse: dict = field(default_factory=dict)
    fail: dict = field(default_factory=dict)
    hang: set = field(default_factory=set)
    delay_s: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    raw: dict = field(default_factory=dict)
    gate: dict = field(default_factory=dict)
    inspect_checks_phase: bool = True
    bytes_per_op: dict = field(default_factory=dict)
    elapsed_ns: int = 1000
    copy_ns: int = 400
    last_txn: int = 0
    txns_seen: list = field(default_factory=list)
    mc_cycle: bool = False  # the capture ran PREPARE_MULTICAST (as in the shim)
    carrier_requests: list = field(default_factory=list)
    carrier_flags: list = field(default_factory=list)  # CarryFlag bits of each carrier request
    shim_flags: int = 0  # every reply's (0: a shim from before ShimFlag.CARRY_SHA256)

    def __post_init__(self):
        self.path = socket_path(self.control_dir, self.pid)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(16)
        self._sock.settimeout(0.05)
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        t = threading.Thread(target=self._serve, name=f"mockshim-{self.pid}", daemon=True)
        t.start()
        self._threads.append(t)

    # --- lifecycle ----------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self._conns.append(conn)
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    # --- one request --------------------------------------------------------------------
    def _handle(self, conn: socket.socket) -> None:
        try:
            data = b""
            while len(data) < REQUEST_SIZE:
                chunk = conn.recv(REQUEST_SIZE - len(data))
                if not chunk:
                    return
                data += chunk
            req = Request.unpack(data)
            if req.op in (Op.SAVE_ALLOCATIONS, Op.LOAD_ALLOCATIONS):
                self._recv_carriers(conn, req)
            self.log.add("recv", self.pid, req)
            if req.op in self.raw:
                self.raw[req.op](conn, req)
                return
            if req.op in self.hang:
                self._stop.wait()
                return
            delay = self.delay_s.get(req.op)
            if delay:
                time.sleep(delay)
            gate = self.gate.get(req.op)
            broken = False
            if gate is not None:
                try:
                    gate.wait(timeout=5)
                except threading.BrokenBarrierError:
                    broken = True
            if broken:
                reply, records, message, fd = (
                    self._reply(req, Status.FAILED),
                    [],
                    "gate broken: requests were not concurrent",
                    None,
                )
            else:
                reply, records, message, fd = self._answer(req)
            reply.record_count = len(records)
            body_msg = message.encode()
            reply.message_len = len(body_msg)
            self.log.add("reply", self.pid, req, reply.status)
            head = reply.pack()
            anc = []
            if fd is not None:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
            conn.sendmsg([head], anc)
            if fd is not None:
                os.close(fd)
            table = self._table(req, reply)
            conn.sendall(b"".join(r.pack() for r in records) + body_msg + table)
        except (OSError, ProtocolError):
            pass
        finally:
            conn.close()

    @staticmethod
    def _recv_table(conn: socket.socket, want: int) -> tuple[bytes, int]:
        """``want`` bytes of a carrier table and how many descriptors came with them (closed)."""
        got, nfd = b"", 0
        while len(got) < want:
            data, anc, _, _ = conn.recvmsg(want - len(got), socket.CMSG_SPACE(4 * 64))
            for level, ctype, cdata in anc:
                if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                    nfd += len(fds)
                    for fd in fds:
                        os.close(fd)
            if not data:
                raise OSError("connection closed in the chunk file table")
            got += data
        return got, nfd

    def _recv_carriers(self, conn: socket.socket, req: Request) -> None:
        """The entries (with their descriptors, or with CarryFlag.STREAMED without them, then
        the known-digest table if any and the descriptor groups, protocol.h "Carriers")."""
        count, flags = req.reserved[2] >> 32, (req.reserved[2] >> 16) & 0xFFFF
        got, _ = self._recv_table(conn, count * STREAM_ENTRY_SIZE)
        ids = [
            alloc_id_hex(got[i * STREAM_ENTRY_SIZE : i * STREAM_ENTRY_SIZE + 16])
            for i in range(count)
        ]
        self.carrier_requests.append((Op(req.op), req.reserved[0], ids))
        self.carrier_flags.append(flags)
        if flags & CarryFlag.STREAMED:
            if flags & CarryFlag.KNOWN:
                head, _ = self._recv_table(conn, 16)
                self._recv_table(conn, struct.unpack_from("<I", head)[0] * 32)
            nfd = 0
            while nfd < count:
                head, n = self._recv_table(conn, 8)
                nfd += n
                if struct.unpack("<Ii", head)[1]:
                    break  # the sender could not open the next file

    def _streams(self, chunk_bytes: int) -> list[tuple[Record, StreamTable]]:
        out = []
        for r in self.records:
            if r.kind == RecordKind.ALLOCATION and r.role == Role.CREATOR:
                n = -(-r.size // chunk_bytes)
                out.append((r, StreamTable(r.alloc_id_hex, r.size, [None] * n)))
        return out

    def _table(self, req: Request, reply: Reply) -> bytes:
        """The SAVE_ALLOCATIONS chunk table (all chunks zero); sets reply.reserved first, so
        call it before packing: here it is sent after the message, its length is in the
        header already packed by the caller via _answer."""
        if req.op != Op.SAVE_ALLOCATIONS or reply.status != Status.OK:
            return b""
        return self._table_bytes(req.reserved[0])

    def _table_bytes(self, chunk_bytes: int) -> bytes:
        out = b""
        for r, t in self._streams(chunk_bytes):
            n = len(t.checksums)
            out += bytes(r.alloc_id) + struct.pack("<QII", r.size, n, n) + bytes(32 * n)
        return out

    def _reply(self, req, status=Status.OK, **kw) -> Reply:
        return Reply(
            op=req.op,
            txn_id=req.txn_id,
            status=status,
            phase=self.phase,
            pid=self.pid,
            shim_flags=self.shim_flags,
            **kw,
        )

    def _answer(self, req: Request):
        with self._lock:
            if req.magic != CUI_PROTO_MAGIC or req.version != CUI_PROTO_VERSION:
                return self._reply(req, Status.BAD_REQUEST), [], "bad magic or version", None
            op = req.op
            if op == Op.FETCH_FD:
                rfd, wfd = os.pipe()
                os.write(wfd, bytes(req.alloc_id))
                os.close(wfd)
                return self._reply(req), [], "", rfd
            if self.phase == Phase.FAILED:
                return self._reply(req, Status.REFUSED_PHASE), [], "shim is FAILED", None
            if req.expected_phase != self.phase and (op != Op.INSPECT or self.inspect_checks_phase):
                return (
                    self._reply(req, Status.REFUSED_PHASE),
                    [],
                    f"expected phase {int(req.expected_phase)}, shim is in "
                    f"{Phase(self.phase).name}",
                    None,
                )
            if op in MUTATING_OPS:
                if req.txn_id <= self.last_txn:
                    return (
                        self._reply(req, Status.REFUSED_DUPLICATE),
                        [],
                        f"txn {req.txn_id} not newer than {self.last_txn}",
                        None,
                    )
            if op in self.refuse:
                status, msg = self.refuse[op]
                return self._reply(req, status), [], msg, None
            if op == Op.INSPECT:
                return self._reply(req), [dataclasses.replace(r) for r in self.records], "", None
            if op not in TRANSITIONS:
                return self._reply(req, Status.BAD_REQUEST), [], f"op {int(op)} unsupported", None
            need, after = self._transition(op)
            if self.phase != need:
                return self._reply(req, Status.REFUSED_PHASE), [], "wrong phase", None
            self.last_txn = req.txn_id
            self.txns_seen.append(req.txn_id)
            if op in self.fail:
                cuda_result, msg = self.fail[op]
                if op not in NON_DESTRUCTIVE_FAILURE:
                    self.phase = Phase.FAILED
                return (
                    self._reply(
                        req, Status.FAILED, cuda_result=cuda_result, elapsed_ns=self.elapsed_ns
                    ),
                    [],
                    msg,
                    None,
                )
            changed = self._mutate(op, req.reserved[0])
            self.phase = after
            if op == Op.PREPARE_MULTICAST:
                self.mc_cycle = True
            elif op == Op.RESTORE_MULTICAST_BINDINGS:
                self.mc_cycle = False
            if op in self.after:
                self.after[op](self)
            nbytes = self.bytes_per_op.get(op, 0)
            reserved = (0,) * 6
            if op == Op.SAVE_ALLOCATIONS:
                cb = req.reserved[0]
                reserved = (len(self._table_bytes(cb)), cb, 0, 0, 0, 0)
            return (
                self._reply(
                    req,
                    bytes=nbytes,
                    elapsed_ns=self.elapsed_ns,
                    copy_ns=self.copy_ns if nbytes else 0,
                    records_changed=changed,
                    reserved=reserved,
                ),
                [],
                "",
                None,
            )

    def _transition(self, op):
        """protocol.h "Phases": SAVE_ALLOCATIONS starts from MULTICAST_RELEASED after
        PREPARE_MULTICAST; CANCEL_CAPTURE and RESTORE_UNICAST then lead there, not to ACTIVE."""
        need, after = TRANSITIONS[op]
        if self.mc_cycle:
            if op == Op.SAVE_ALLOCATIONS:
                need = Phase.MULTICAST_RELEASED
            elif op in (Op.CANCEL_CAPTURE, Op.RESTORE_UNICAST):
                after = Phase.MULTICAST_RELEASED
        return need, after

    def _mutate(self, op, chunk_bytes: int = 8 << 20) -> int:
        """Model the visible record changes: CARRIED + checksum on creators after SAVE."""
        changed = 0
        for i, r in enumerate(self.records):
            if r.kind != RecordKind.ALLOCATION or r.role != Role.CREATOR:
                continue
            if op == Op.SAVE_ALLOCATIONS:
                self.records[i] = dataclasses.replace(
                    r,
                    flags=r.flags | RecordFlag.CARRIED,
                    carrier_bytes=r.size,
                    carrier_checksum=StreamTable(
                        r.alloc_id_hex, r.size, [None] * -(-r.size // chunk_bytes)
                    ).carrier_checksum,
                )
                changed += 1
            elif op in (Op.LOAD_ALLOCATIONS, Op.CANCEL_CAPTURE):
                self.records[i] = dataclasses.replace(
                    r, flags=r.flags & ~RecordFlag.CARRIED, carrier_bytes=0, carrier_checksum=0
                )
                changed += 1
        return changed

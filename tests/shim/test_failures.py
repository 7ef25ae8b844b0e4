"""Control-endpoint behaviour under contention and destructive failures:
- while RESTORE_UNICAST waits on a creator, INSPECT is answered, a second mutating op gets BUSY and
  the accept thread still answers FETCH_FD from the export cache;
- a creator that cannot serve the FD makes RESTORE_UNICAST fail, naming pid, allocation and
  creator, and the shim turns FAILED;
- a corrupted chunk file is refused by LOAD_ALLOCATIONS on the chunk's checksum.
The "creator" here is a Python stand-in serving a real fakecuda export FD of an unshimmed
process over that process's control-socket path."""

from __future__ import annotations

import array
import fcntl
import hashlib
import os
import pathlib
import socket
import threading

from cuinterpose.coordinator.protocol import Op, Phase, Reply, Request, Status, Ticket

from .conftest import GRAN, POSIX, RW
from .fetch import fetch_fd, ticket_secret

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def pattern(n: int, seed: int) -> bytes:
    """vmm_app's fill pattern."""
    x = (seed * 2654435761 + 1) & 0xFFFFFFFF
    out = bytearray(n)
    for i in range(n):
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        out[i] = (x >> 16) & 0xFF
    return bytes(out)


class FakeCreator(threading.Thread):
    """Answers FETCH_FD on ``path`` with ``fd``; holds each answer until ``release`` is set.
    mode "ok" sends the FD, "notfound" replies CUI_NOT_FOUND."""

    def __init__(self, path, fd, pid):
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.fd, self.pid = fd, pid
        self.release = threading.Event()
        self.release.set()
        self.asked = threading.Event()
        self.mode = "ok"
        self.requests: list[Request] = []

    def run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while len(data) < Request.SIZE:
                    chunk = conn.recv(Request.SIZE - len(data))
                    if not chunk:
                        break
                    data += chunk
                req = Request.unpack(data)
                self.requests.append(req)
                self.asked.set()
                self.release.wait(30)
                if self.mode == "ok":
                    rep = Reply(op=Op.FETCH_FD, txn_id=req.txn_id, status=Status.OK, pid=self.pid)
                    conn.sendmsg(
                        [rep.pack()],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [self.fd]))],
                    )
                else:
                    msg = b"FETCH_FD: gone"
                    rep = Reply(
                        op=Op.FETCH_FD,
                        txn_id=req.txn_id,
                        status=Status.NOT_FOUND,
                        pid=self.pid,
                        message_len=len(msg),
                    )
                    conn.sendall(rep.pack() + msg)

    def stop(self):
        self.release.set()
        self.sock.close()


def forged_ticket(creator_pid: int, alloc_id: bytes, size: int) -> int:
    fd = os.memfd_create("ticket", os.MFD_ALLOW_SEALING)
    os.write(fd, Ticket(creator_pid=creator_pid, alloc_id=alloc_id, size=size).pack())
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def setup_importer(apps, ctl, fake_env, shim_env):
    """P: unshimmed creator with a raw export. A: shimmed importer of P's allocation through
    a ticket naming P, plus a creator of its own exported allocation."""
    p = apps(env=fake_env)
    p.ok("init")
    hp = p.val(f"create {GRAN} {POSIX}")
    vp = p.val(f"reserve {GRAN}")
    p.ok(f"map {vp} {GRAN} 0 {hp}")
    p.ok(f"access {vp} {GRAN} 0 {RW}")
    p.ok(f"fill {vp} {GRAN} 31")
    raw = os.open(f"/proc/{p.pid}/fd/{p.val(f'export {hp}')}", os.O_RDWR)
    path = os.path.join(shim_env["CUINTERPOSE_CONTROL_DIR"], f"cuinterpose-{p.pid}.sock")
    fc = FakeCreator(path, raw, p.pid)
    fc.start()
    alloc_id = bytes(range(1, 17))
    t = forged_ticket(p.pid, alloc_id, GRAN)

    a = apps()
    a.ok("init")
    ha = a.val(f"import /proc/{os.getpid()}/fd/{t}")
    os.close(t)
    va = a.val(f"reserve {GRAN}")
    a.ok(f"map {va} {GRAN} 0 {ha}")
    a.ok(f"access {va} {GRAN} 0 {RW}")
    a.ok(f"check {va} {GRAN} 31")
    own = a.val(f"create {GRAN} {POSIX}")
    own_secret = ticket_secret(a.pid, a.val(f"export {own}"))
    own_id = [
        r.alloc_id
        for r in ctl(a).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE).records
        if r.creator_pid == a.pid
    ][0]
    assert len(fc.requests) == 1 and fc.requests[0].alloc_id == alloc_id
    assert fc.requests[0].sender_pid == a.pid
    return p, vp, a, va, fc, raw, (own_id, own_secret), alloc_id


def run_to_loaded(ctl, a):
    for txn, (op, exp) in enumerate(
        (
            (Op.SAVE_ALLOCATIONS, Phase.ACTIVE),
            (Op.PREPARE_UNICAST, Phase.SAVED),
            (Op.LOAD_ALLOCATIONS, Phase.PREPARED),
        ),
        start=1,
    ):
        r = ctl(a).request(op, txn_id=txn, expected_phase=exp)
        assert r.reply.status == Status.OK, r.message


def test_busy_worker_and_fetch_while_waiting_on_peer(apps, ctl, fake_env, shim_env):
    p, vp, a, va, fc, raw, (own_id, own_secret), _ = setup_importer(apps, ctl, fake_env, shim_env)
    try:
        run_to_loaded(ctl, a)
        fc.release.clear()
        fc.asked.clear()
        result = {}
        th = threading.Thread(
            target=lambda: result.setdefault(
                "r", ctl(a).request(Op.RESTORE_UNICAST, txn_id=4, expected_phase=Phase.LOADED)
            )
        )
        th.start()
        assert fc.asked.wait(30)
        # the worker waits on the (fake) creator: INSPECT (read-only) is still answered, outside
        # the worker slot, and another mutating op gets the retryable BUSY before any mutation
        # (the client retries it until its deadline, then returns the last BUSY reply)
        ins = ctl(a).request(Op.INSPECT, txn_id=0, expected_phase=Phase.LOADED)
        assert (ins.reply.status, ins.reply.phase) == (Status.OK, Phase.LOADED), ins.message
        busy = ctl(a).request(
            Op.CANCEL_CAPTURE, txn_id=5, expected_phase=Phase.LOADED, timeout_s=0.2
        )
        assert busy.reply.status == Status.BUSY, busy.message
        assert busy.message == (
            f"CANCEL_CAPTURE: pid {a.pid} is still running another control request; "
            "nothing was changed, retry"
        )
        # ... while FETCH_FD (with the secret) is still served from the export cache (re-exported
        # by LOAD)
        rep, msg, got = fetch_fd(shim_env["CUINTERPOSE_CONTROL_DIR"], a.pid, own_id, own_secret)
        assert rep.status == Status.OK and got is not None, msg
        os.close(got)
        fc.release.set()
        th.join(30)
        r = result["r"]
        assert (r.reply.status, r.reply.phase, r.reply.records_changed) == (
            Status.OK,
            Phase.ACTIVE,
            2,
        ), r.message
        a.ok(f"check {va} {GRAN} 31")
        p.ok(f"fill {vp} {GRAN} 32")
        a.ok(f"check {va} {GRAN} 32")
    finally:
        fc.stop()
        os.close(raw)


def test_restore_failure_names_creator_and_fails(apps, ctl, fake_env, shim_env):
    p, vp, a, va, fc, raw, _, alloc_id = setup_importer(apps, ctl, fake_env, shim_env)
    try:
        run_to_loaded(ctl, a)
        fc.mode = "notfound"
        r = ctl(a).request(Op.RESTORE_UNICAST, txn_id=4, expected_phase=Phase.LOADED)
        assert (r.reply.status, r.reply.phase) == (Status.FAILED, Phase.FAILED)
        assert r.message.startswith(
            f"RESTORE_UNICAST: pid {a.pid} could not import allocation "
            f"{alloc_id.hex()} from creator pid {p.pid}: "
        )
        assert "FETCH_FD: gone" in r.message
        r = ctl(a).request(Op.INSPECT, txn_id=0, expected_phase=Phase.FAILED)
        assert r.reply.status == Status.REFUSED_PHASE
        assert a.err(f"create {GRAN} 0") == 600  # NOT_READY: never ACTIVE again
    finally:
        fc.stop()
        os.close(raw)


def find_in_memory(pid: int, needle: bytes) -> int:
    with open(f"/proc/{pid}/maps") as f, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for ln in f:
            parts = ln.split()
            if parts[1] != "rw-p" or len(parts) > 5:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if hi - lo > (64 << 20):
                continue
            try:
                mem.seek(lo)
                data = mem.read(hi - lo)
            except OSError:
                continue
            at = data.find(needle)
            if at >= 0:
                return lo + at
    raise AssertionError("carrier bytes not found")


def test_corrupted_chunk_refuses_load_and_keeps_prepared(apps, ctl, chunk_files):
    """A flipped byte in the chunk file: LOAD_ALLOCATIONS refuses naming the allocation, the
    chunk and both checksums, the file stays byte-identical and the shim PREPARED; with the
    byte put back the same LOAD (a new txn) brings the bytes back."""
    c = apps()
    c.ok("init")
    h = c.val(f"create {4 * GRAN} {POSIX}")
    va = c.val(f"reserve {4 * GRAN}")
    c.ok(f"map {va} {4 * GRAN} 0 {h}")
    c.ok(f"access {va} {4 * GRAN} 0 {RW}")
    c.ok(f"fill {va} {4 * GRAN} 41")
    c.val(f"export {h}")
    for txn, (op, exp) in enumerate(
        ((Op.SAVE_ALLOCATIONS, Phase.ACTIVE), (Op.PREPARE_UNICAST, Phase.SAVED)), 1
    ):
        assert ctl(c).request(op, txn_id=txn, expected_phase=exp).reply.status == Status.OK
    rec = [
        r
        for r in ctl(c).request(Op.INSPECT, txn_id=0, expected_phase=Phase.PREPARED).records
        if r.kind == 1
    ][0]
    path = pathlib.Path(chunk_files.path(c.pid, rec.alloc_id))
    good = path.read_bytes()
    assert good == pattern(4 * GRAN, 41)
    cb = chunk_files.chunk_bytes
    k = 3  # the chunk holding the flipped byte
    bad = bytearray(good)
    bad[k * cb + 100] ^= 0xFF
    path.write_bytes(bytes(bad))
    r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=3, expected_phase=Phase.PREPARED)
    assert (r.reply.status, r.reply.phase) == (Status.REFUSED_STATE, Phase.PREPARED), r.message
    b2 = lambda b: hashlib.blake2b(b, digest_size=32).hexdigest()  # noqa: E731
    assert r.message == (
        f"LOAD_ALLOCATIONS: pid {c.pid} allocation {rec.alloc_id.hex()}: chunk {k} of its chunk "
        f"file has checksum blake2b-256 {b2(bytes(bad[k * cb : (k + 1) * cb]))}, recorded "
        f"{b2(good[k * cb : (k + 1) * cb])}; nothing was loaded (the allocations created were "
        f"released) and pid {c.pid} stays PREPARED"
    )
    assert path.read_bytes() == bytes(bad)  # a refused load never writes the file
    path.write_bytes(good)
    r = ctl(c).request(Op.LOAD_ALLOCATIONS, txn_id=4, expected_phase=Phase.PREPARED)
    assert (r.reply.status, r.reply.phase, r.reply.bytes) == (Status.OK, Phase.LOADED, 4 * GRAN)
    r = ctl(c).request(Op.RESTORE_UNICAST, txn_id=5, expected_phase=Phase.LOADED)
    assert r.reply.status == Status.OK, r.message
    c.ok(f"check {va} {4 * GRAN} 41")  # the bytes on the device are the saved ones

"""Case 011 (shared/cases/011-same-uid-peers), the shim's side; kind: any process that reaches
a job's control socket may drive it.

- SO_PEERCRED: a mutating op from neither root nor the uid that owns the shim's process is
  refused (CUI_REFUSED_PEER) and changes nothing; INSPECT stays readable.
- a capture op whose txn id leaves no room for the ops that undo it (> 2^64-1-CUI_TXN_ROOM) is
  refused (CUI_BAD_REQUEST) and changes nothing; the undo ops themselves run up to 2^64-1.
- "busy" is CUI_BUSY, a refusal that changes nothing and is retryable (the client retries it);
  INSPECT never takes the mutating-worker slot (tests/shim/test_failures.py covers the wait).
"""

from __future__ import annotations

import os
import pathlib
import socket
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from shim.conftest import apps, ctl, shim_env, vmm_app  # noqa: E402, F401 (fixtures)

from cuinterpose.coordinator.protocol import (  # noqa: E402
    CUI_TXN_ROOM,
    REPLY_SIZE,
    Op,
    Phase,
    Reply,
    Request,
    Status,
)

GRAN = 2 << 20
NOBODY = 65534


def _as_uid(ctl_dir: pathlib.Path, pid: int, req: Request, uid: int) -> Reply:
    """Send ``req`` from a child process that has dropped to ``uid`` before connecting."""
    rfd, wfd = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.close(rfd)
            os.chdir(ctl_dir)  # the path is reached relative to the control dir
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(f"cuinterpose-{pid}.sock")
            s.sendall(req.pack())
            buf = b""
            while len(buf) < REPLY_SIZE:
                k = s.recv(REPLY_SIZE - len(buf))
                if not k:
                    break
                buf += k
            os.write(wfd, buf)
        finally:
            os._exit(0)
    os.close(wfd)
    data = b""
    while chunk := os.read(rfd, 4096):
        data += chunk
    os.close(rfd)
    os.waitpid(child, 0)
    return Reply.unpack(data[:REPLY_SIZE])


def test_mutating_op_from_another_uid_is_refused(apps, shim_env, ctl):  # noqa: F811
    if os.geteuid() != 0:
        import pytest

        pytest.skip("needs root to act as another uid")
    a = apps()
    a.ok("init")
    a.ok(f"create {GRAN} 0")
    d = pathlib.Path(shim_env["CUINTERPOSE_CONTROL_DIR"])
    # open the file modes up so that only the credential check stands in the way
    d.chmod(0o711)
    (d / f"cuinterpose-{a.pid}.sock").chmod(0o666)
    save = Request(op=Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE, sender_pid=1)
    r = _as_uid(d, a.pid, save, NOBODY)
    assert (r.status, r.phase, r.pid) == (Status.REFUSED_PEER, Phase.ACTIVE, a.pid)
    ins = Request(op=Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE, sender_pid=1)
    r = _as_uid(d, a.pid, ins, NOBODY)
    assert (r.status, r.record_count) == (Status.OK, 1)
    # nothing changed: the owner's txn 1 is still new, and the capture rolls back
    ok = ctl(a).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
    assert (ok.reply.status, ok.reply.phase) == (Status.OK, Phase.SAVED), ok.message
    back = ctl(a).request(Op.CANCEL_CAPTURE, txn_id=2, expected_phase=Phase.SAVED)
    assert (back.reply.status, back.reply.phase) == (Status.OK, Phase.ACTIVE), back.message


def test_txn_without_room_for_undo_is_refused(apps, ctl):  # noqa: F811
    a = apps()
    a.ok("init")
    a.ok(f"create {GRAN} 0")
    top = 2**64 - 1 - CUI_TXN_ROOM
    for txn in (2**64 - 1, 2**64 - 2, top + 1):
        r = ctl(a).request(Op.SAVE_ALLOCATIONS, txn_id=txn, expected_phase=Phase.ACTIVE)
        assert (r.reply.status, r.reply.phase) == (Status.BAD_REQUEST, Phase.ACTIVE)
        assert r.message == (
            f"SAVE_ALLOCATIONS: pid {a.pid}: txn {txn} leaves no room for the txns of the ops that "
            f"undo it (a capture op's txn must be <= {top}); nothing was changed"
        )
    # the largest admitted capture txn still leaves room for the whole rollback from PREPARED
    r = ctl(a).request(Op.SAVE_ALLOCATIONS, txn_id=top, expected_phase=Phase.ACTIVE)
    assert (r.reply.status, r.reply.phase) == (Status.OK, Phase.SAVED), r.message
    r = ctl(a).request(Op.PREPARE_UNICAST, txn_id=top + 1, expected_phase=Phase.SAVED)
    assert (r.reply.status, r.reply.phase) == (Status.BAD_REQUEST, Phase.SAVED), r.message
    r = ctl(a).request(Op.CANCEL_CAPTURE, txn_id=2**64 - 1, expected_phase=Phase.SAVED)
    assert (r.reply.status, r.reply.phase) == (Status.OK, Phase.ACTIVE), r.message


def test_busy_is_a_retryable_refusal():
    assert Status.BUSY.is_refusal and Status.BUSY.is_retryable
    assert Status.REFUSED_PEER.is_refusal and not Status.REFUSED_PEER.is_retryable
    assert not Status.FAILED.is_retryable


def test_idle_and_trickling_clients_block_nobody(apps, shim_env, ctl):  # noqa: F811
    a = apps()
    a.ok("init")
    a.ok(f"create {GRAN} 0")
    path = str(pathlib.Path(shim_env["CUINTERPOSE_CONTROL_DIR"]) / f"cuinterpose-{a.pid}.sock")
    idle = []
    try:
        for _ in range(200):  # connected, silent
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            idle.append(s)
        trickle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        trickle.connect(path)
        idle.append(trickle)
        req = Request(op=Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE, sender_pid=1).pack()
        trickle.sendall(req[:1])  # one byte of a request, the rest never comes
        for _ in range(2):  # INSPECT, then a whole capture and rollback, are served meanwhile
            r = ctl(a).request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
            assert (r.reply.status, r.reply.record_count) == (Status.OK, 1), r.message
        r = ctl(a).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE)
        assert (r.reply.status, r.reply.phase) == (Status.OK, Phase.SAVED), r.message
        r = ctl(a).request(Op.CANCEL_CAPTURE, txn_id=2, expected_phase=Phase.SAVED)
        assert (r.reply.status, r.reply.phase) == (Status.OK, Phase.ACTIVE), r.message
        # the trickler finishes its request late and is still answered
        trickle.sendall(req[1:])
        head = Reply.unpack(trickle.recv(REPLY_SIZE, socket.MSG_WAITALL))
        assert (head.status, head.pid) == (Status.OK, a.pid)
    finally:
        for s in idle:
            s.close()

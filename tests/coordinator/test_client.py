"""ShimClient against the in-process mock shim (real Unix sockets)."""

from __future__ import annotations

import array
import os
import socket

import pytest

from cuinterpose.coordinator.client import (
    Response,
    ShimClient,
    ShimConnectError,
    ShimProtocolError,
    ShimTimeout,
)
from cuinterpose.coordinator.protocol import Op, Phase, Record, RecordKind, Reply, Role, Status

from .mockshim import MockShim


@pytest.fixture
def shim(ctl):
    m = MockShim(
        4119,
        ctl,
        records=[
            Record(
                kind=RecordKind.ALLOCATION,
                role=Role.CREATOR,
                alloc_id=b"\x9f\x3c",
                creator_pid=4119,
                handle_refs=1,
                size=2 << 20,
                prop_type=1,
                prop_handle_types=1,
            )
        ],
    )
    yield m
    m.stop()


def test_inspect_returns_records(shim):
    r = ShimClient(shim.path, 5).request(Op.INSPECT, txn_id=7, expected_phase=Phase.ACTIVE)
    assert r.ok and r.fd is None and r.message == ""
    assert r.reply.pid == 4119 and r.reply.txn_id == 7 and r.reply.op == Op.INSPECT
    assert [x.size for x in r.records] == [2 << 20]
    assert r.records[0].alloc_id_hex == "9f3c" + "00" * 14


def test_fetch_fd_receives_descriptor(shim):
    with ShimClient(shim.path, 5).request(
        Op.FETCH_FD, txn_id=1, expected_phase=Phase.ACTIVE, alloc_id=b"\x01\x02"
    ) as r:
        assert r.ok and r.fd is not None
        assert os.read(r.fd, 64) == b"\x01\x02" + bytes(14)
        fd = r.fd
    assert r.fd is None
    with pytest.raises(OSError):
        os.fstat(fd)


def test_refusal_is_a_normal_response(shim):
    c = ShimClient(shim.path, 5)
    r = c.request(Op.SAVE_ALLOCATIONS, txn_id=5, expected_phase=Phase.PREPARED)
    assert r.status == Status.REFUSED_PHASE and not r.ok
    assert "ACTIVE" in r.message
    assert shim.phase == Phase.ACTIVE


def test_connect_failure_names_socket_and_pid(ctl):
    path = os.path.join(ctl, "cuinterpose-4242.sock")
    with pytest.raises(ShimConnectError) as ei:
        ShimClient(path, 1).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)
    assert str(ei.value) == (
        f"INSPECT: cannot connect to pid 4242 (socket {path}): No such file or directory"
    )
    assert ei.value.pid == 4242 and ei.value.socket_path == path


def test_timeout_names_pid(shim):
    shim.hang.add(Op.INSPECT)
    with pytest.raises(ShimTimeout) as ei:
        ShimClient(shim.path, 0.2).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)
    assert str(ei.value) == f"INSPECT: pid 4119 (socket {shim.path}) did not reply within 0.2 s"


def _raw(payload: bytes, fd: int | None = None):
    def handler(conn, req):
        anc = []
        if fd is not None:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
        conn.sendmsg([payload], anc)

    return handler


def test_short_read_names_pid(shim):
    shim.raw[Op.INSPECT] = _raw(b"\x43\x55" * 10)
    with pytest.raises(ShimProtocolError) as ei:
        ShimClient(shim.path, 2).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)
    assert str(ei.value) == (
        f"INSPECT: pid 4119 (socket {shim.path}): short read: connection "
        "closed after 20 of 128 bytes of reply header"
    )


def test_short_records(shim):
    head = Reply(op=Op.INSPECT, txn_id=1, pid=4119, record_count=2).pack()
    shim.raw[Op.INSPECT] = _raw(head + bytes(700))
    with pytest.raises(ShimProtocolError, match="after 700 of 1280 bytes of 2 records"):
        ShimClient(shim.path, 2).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)


def test_bad_magic_and_wrong_txn(shim):
    shim.raw[Op.INSPECT] = _raw(Reply(op=Op.INSPECT, txn_id=1, magic=0x1234).pack())
    with pytest.raises(ShimProtocolError, match="reply magic 0x1234 != 0x50495543"):
        ShimClient(shim.path, 2).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)
    shim.raw[Op.INSPECT] = _raw(Reply(op=Op.INSPECT, txn_id=2).pack())
    with pytest.raises(ShimProtocolError, match="reply is for op 1 txn 2, sent op 1 txn 1"):
        ShimClient(shim.path, 2).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)


def test_stray_descriptor_is_closed_and_reported(shim):
    r, w = os.pipe()
    try:
        shim.raw[Op.INSPECT] = _raw(Reply(op=Op.INSPECT, txn_id=1).pack(), fd=r)
        with pytest.raises(ShimProtocolError, match="unexpected 1 descriptor"):
            ShimClient(shim.path, 2).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)
        os.close(r)
        r = None
        # the client closed the copy it received: no read end is left anywhere
        with pytest.raises(BrokenPipeError):
            os.write(w, b"x")
    finally:
        if r is not None:
            os.close(r)
        os.close(w)


def test_message_is_read(shim):
    shim.refuse[Op.SAVE_ALLOCATIONS] = (Status.REFUSED_STATE, "pid 4119 holds a live raw import")
    r = ShimClient(shim.path, 2).request(Op.SAVE_ALLOCATIONS, txn_id=3, expected_phase=Phase.ACTIVE)
    assert isinstance(r, Response)
    assert r.status == Status.REFUSED_STATE and r.message == "pid 4119 holds a live raw import"


def test_a_trickling_shim_hits_the_total_deadline_not_a_per_read_one(shim):
    """One byte every 50 ms keeps every single recv fast; the request must still fail after
    its overall timeout (0.3 s), long before the 128-byte header is complete (6.4 s)."""
    import threading

    stop = threading.Event()

    def trickle(conn, req):
        head = Reply(op=Op.INSPECT, txn_id=1, pid=4119).pack()
        for b in head:
            if stop.wait(0.05):
                return
            try:
                conn.sendall(bytes([b]))
            except OSError:
                return

    shim.raw[Op.INSPECT] = trickle
    try:
        with pytest.raises(ShimTimeout) as ei:
            ShimClient(shim.path, 0.3).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)
    finally:
        stop.set()
    assert str(ei.value) == f"INSPECT: pid 4119 (socket {shim.path}) did not reply within 0.3 s"


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"record_count": 2, "record_size": 999}, "record_size 999 != 640"),
        (
            {"record_count": 0xFFFFFFFF},
            "reply announces 2748779068800 bytes of records and message, more than 33554432",
        ),
        (
            {"message_len": 0xFFFFFFFF},
            "reply announces 4294967295 bytes of records and message, more than 33554432",
        ),
    ],
)
def test_garbage_sizes_are_refused_before_reading_the_body(shim, kw, msg):
    shim.raw[Op.INSPECT] = _raw(Reply(op=Op.INSPECT, txn_id=1, pid=4119, **kw).pack())
    with pytest.raises(ShimProtocolError) as ei:
        ShimClient(shim.path, 2).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)
    assert str(ei.value) == f"INSPECT: pid 4119 (socket {shim.path}): {msg}"


def test_a_shim_closing_mid_message_is_a_short_read(shim):
    head = Reply(op=Op.INSPECT, txn_id=1, pid=4119, message_len=50).pack()
    shim.raw[Op.INSPECT] = _raw(head + b"half a mess")
    with pytest.raises(ShimProtocolError) as ei:
        ShimClient(shim.path, 2).request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE)
    assert str(ei.value) == (
        f"INSPECT: pid 4119 (socket {shim.path}): short read: connection "
        "closed after 11 of 50 bytes of message"
    )


@pytest.fixture
def peer():
    """A real process to stand for the shim's pid (its state is what the client reads)."""
    import subprocess

    p = subprocess.Popen(["sleep", "600"])
    yield p
    p.kill()
    p.wait()


def test_a_stopped_peer_ends_a_long_carrier_wait_after_the_client_timeout(shim, peer):
    """SAVE_ALLOCATIONS gets the carrier deadline (here 600 s), but a peer that is stopped
    cannot reply: once it stayed stopped for the client's timeout the request fails, naming
    the pid, its state and the way out."""
    import signal

    shim.hang.add(Op.INSPECT)
    os.kill(peer.pid, signal.SIGSTOP)
    c = ShimClient(shim.path, 0.3, pid=peer.pid)
    with pytest.raises(ShimTimeout) as ei:
        c.request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE, timeout_s=600)
    assert str(ei.value) == (
        f"INSPECT: pid {peer.pid} (socket {shim.path}) is stopped (state T) and did not reply "
        f"within 0.3 s: a stopped process cannot serve the request (`kill -CONT {peer.pid}` it)"
    )
    assert (ei.value.pid, ei.value.op) == (peer.pid, Op.INSPECT)


def test_a_running_peer_gets_the_whole_request_deadline(shim, peer):
    shim.hang.add(Op.INSPECT)
    c = ShimClient(shim.path, 0.1, pid=peer.pid)
    with pytest.raises(ShimTimeout) as ei:
        c.request(Op.INSPECT, txn_id=1, expected_phase=Phase.ACTIVE, timeout_s=0.8)
    assert str(ei.value) == (
        f"INSPECT: pid {peer.pid} (socket {shim.path}) did not reply within 0.8 s"
    )

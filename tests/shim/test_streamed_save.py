"""SAVE_ALLOCATIONS with its chunk files opened while the request is sent (protocol.h "Carriers",
CUI_CARRY_STREAMED; decisions D70), on fakecuda:
- the shim sizes and writes the first stream's file before the sender has opened the last one
  (what the sender sees of file 0 when it opens file 2), and the bytes come back through a LOAD;
- a file the sender cannot open (EEXIST) fails the op naming the allocation and the errno: the
  client raises the file's error with the shim's answer, the shim stays ACTIVE with no table,
  its bytes intact, and a new capture works;
- a connection that ends before the last descriptor, and a group whose count is not the
  descriptors it carries, fail the op the same way, naming the stream."""

from __future__ import annotations

import array
import errno
import os
import socket
import time

import claim_kit

from cuinterpose.coordinator.carrierfiles import carried_streams
from cuinterpose.coordinator.client import CarrierRequest
from cuinterpose.coordinator.protocol import (
    CarryFlag,
    Op,
    Phase,
    RecordFlag,
    RecordKind,
    Reply,
    Request,
    Status,
    StreamEntry,
    carrier_reserved,
    fd_group,
    socket_path,
)

from .conftest import GRAN
from .test_chunks import _alloc, _cycle, _records

SIZES = (2 * GRAN, GRAN, GRAN)
CHUNK, STAGING = 64 << 10, 256 << 10
#: only catches a hang: the shim has every reason to size file 0 long before this
HANG_S = 120.0


def _three(apps):
    c = apps()
    c.ok("init")
    vas = [_alloc(c, size, seed) for seed, size in enumerate(SIZES, start=3)]
    return c, vas


def _check(c, vas):
    for seed, (va, size) in enumerate(zip(vas, SIZES), start=3):
        c.ok(f"check {va} {size} {seed}")


def _unchanged(ctl, c, recs):
    """The shim is ACTIVE, carries no table and its allocation records are as before."""
    now = _records(ctl, c)
    allocs = [r for r in now if r.kind == RecordKind.ALLOCATION]
    assert allocs == [r for r in recs if r.kind == RecordKind.ALLOCATION]
    assert not any(r.flags & RecordFlag.CARRIED for r in allocs)


def test_the_first_stream_is_written_before_the_last_file_is_opened(apps, ctl, tmp_path):
    c, vas = _three(apps)
    streams = carried_streams(_records(ctl, c))
    paths = [tmp_path / f"s{i}.bin" for i in range(len(streams))]
    seen = {}

    def opener(i: int) -> int:
        if i == len(streams) - 1:  # the shim works on stream 0 while this file does not exist
            deadline = time.monotonic() + HANG_S
            while os.stat(paths[0]).st_size != SIZES[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["file 0"] = os.stat(paths[0]).st_size
        return os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)

    req = CarrierRequest(CHUNK, STAGING, 2, [(StreamEntry(a, s), -1) for a, s in streams])
    req.opener = opener
    assert req.flags == CarryFlag.STREAMED
    try:
        r = ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE, carriers=req)
    finally:
        for _, fd in req.streams:
            os.close(fd)
    assert (r.reply.status, r.reply.phase, r.reply.bytes) == (Status.OK, Phase.SAVED, sum(SIZES))
    assert seen == {"file 0": SIZES[0]}
    assert [p.stat().st_size for p in paths] == list(SIZES)
    # the files hold the bytes: the process gets them back from these files
    for txn_id, (op, exp) in enumerate(((Op.PREPARE_UNICAST, Phase.SAVED),), start=2):
        assert ctl(c).request(op, txn_id=txn_id, expected_phase=exp).reply.status == Status.OK
    req = CarrierRequest(CHUNK, STAGING, 2)
    req.streams = [
        (StreamEntry(a, s), os.open(p, os.O_RDONLY | os.O_CLOEXEC))
        for (a, s), p in zip(streams, paths)
    ]
    try:
        r = ctl(c).request(
            Op.LOAD_ALLOCATIONS, txn_id=3, expected_phase=Phase.PREPARED, carriers=req
        )
    finally:
        for _, fd in req.streams:
            os.close(fd)
    assert (r.reply.status, r.reply.bytes) == (Status.OK, sum(SIZES)), r.message
    r = ctl(c).request(Op.RESTORE_UNICAST, txn_id=4, expected_phase=Phase.LOADED)
    assert r.reply.status == Status.OK, r.message
    _check(c, vas)


def test_a_file_the_sender_cannot_open_fails_the_save_and_changes_nothing(apps, ctl, chunk_files):
    c, vas = _three(apps)
    recs = _records(ctl, c)
    streams = carried_streams(recs)
    chunk_files.remove([c.pid])
    os.makedirs(chunk_files.directory, exist_ok=True)
    taken = chunk_files.path(c.pid, streams[1][0])
    open(taken, "xb").close()  # O_EXCL refuses it: never overwritten
    req = chunk_files.request(Op.SAVE_ALLOCATIONS, c.pid, streams)
    try:
        ctl(c).request(Op.SAVE_ALLOCATIONS, txn_id=1, expected_phase=Phase.ACTIVE, carriers=req)
        raise AssertionError("the SAVE did not raise")
    except OSError as e:
        assert e.errno == errno.EEXIST
        text = str(e)
    finally:
        chunk_files.close(req)
    aid = streams[1][0].hex()
    assert text == (
        f"[Errno 17] SAVE_ALLOCATIONS: pid {c.pid} allocation {aid}: cannot open chunk file "
        f"{taken}: File exists; the shim answered FAILED: SAVE_ALLOCATIONS: pid {c.pid} "
        f"allocation {aid}: the sender could not open its chunk file: File exists (errno 17); "
        f"the chunk table was dropped and pid {c.pid} stays ACTIVE (nothing was torn down)"
    )
    assert os.path.getsize(taken) == 0  # the file that was there is untouched
    _unchanged(ctl, c, recs)
    _check(c, vas)
    os.unlink(taken)
    _cycle(ctl, c, 2)  # a new capture works
    _check(c, vas)


def _raw_save(c, shim_env, txn_id, streams, groups):
    """Send a streamed SAVE_ALLOCATIONS by hand: the entries, then ``groups`` ((head bytes,
    [fds]) each), then end the connection's sending side; the reply and its message."""
    path = socket_path(shim_env["CUINTERPOSE_CONTROL_DIR"], c.pid)
    claim_kit.take(os.path.dirname(path), [c.pid])
    flags = int(CarryFlag.STREAMED)
    req = Request(
        op=Op.SAVE_ALLOCATIONS,
        txn_id=txn_id,
        expected_phase=Phase.ACTIVE,
        sender_pid=os.getpid(),
        alloc_id=claim_kit.TOKEN,
        reserved=carrier_reserved(CHUNK, STAGING, 2, len(streams), flags),
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(HANG_S)
        s.connect(path)
        s.sendall(req.pack() + b"".join(StreamEntry(a, n).pack() for a, n in streams))
        for head, fds in groups:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
            s.sendmsg([head], anc if fds else [])
        s.shutdown(socket.SHUT_WR)
        data = b""
        while len(data) < Reply.SIZE:
            more = s.recv(Reply.SIZE - len(data))
            assert more, f"no reply: {len(data)} bytes"
            data += more
        reply = Reply.unpack(data)
        msg = b""
        while len(msg) < reply.record_count * reply.record_size + reply.message_len:
            msg += s.recv(65536)
    return reply, msg[reply.record_count * reply.record_size :].decode()


def test_descriptors_that_stop_or_do_not_match_their_group_fail_the_save(
    apps, ctl, shim_env, tmp_path
):
    c, vas = _three(apps)
    recs = _records(ctl, c)
    streams = carried_streams(recs)
    fds = [
        os.open(tmp_path / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        for i in range(3)
    ]
    try:
        cases = (
            ([(fd_group(1), fds[:1])], 1, "connection closed before the end of the table"),
            (
                [(fd_group(2), fds[:1])],
                0,
                "a descriptor group whose count is not the descriptors it carries "
                "(1..CUI_STREAM_FDS_PER_MSG)",
            ),
        )
        for txn_id, (groups, j, why) in enumerate(cases, start=1):
            reply, text = _raw_save(c, shim_env, txn_id, streams, groups)
            assert (reply.status, reply.phase, reply.bytes) == (Status.FAILED, Phase.ACTIVE, 0)
            assert text == (
                f"SAVE_ALLOCATIONS: pid {c.pid} allocation {streams[j][0].hex()}: no descriptor "
                f"for its chunk file (stream {j} of 3): {why}; the chunk table was dropped and "
                f"pid {c.pid} stays ACTIVE (nothing was torn down)"
            )
            _unchanged(ctl, c, recs)
    finally:
        for fd in fds:
            os.close(fd)
    _check(c, vas)
    _cycle(ctl, c, 3)
    _check(c, vas)

"""Chaos kind 7: an INSPECT flood (8 threads) and 200 idle connections during a checkpoint.

Both load the shims' control sockets while the agent checkpoints the job. The checkpoint must
end with a complete snapshot (a busy reply is retryable, never a failure) or fail cleanly
(named error, job completes exactly): never hang. Here it fails cleanly: a connection from
outside the tree open during ``criu dump`` makes CRIU refuse the dump (an external Unix
socket), the agent rolls back and the job completes (docs/testing.md "Found"). The flood's own INSPECTs must each get a
well-formed reply (OK, or BUSY while a mutating op runs) or a named client error once the
tree is gone.
"""

from __future__ import annotations

import socket
import threading

import kit
import pytest

from cuinterpose.coordinator.client import ShimClient, ShimClientError
from cuinterpose.coordinator.protocol import Op, Phase, Status


@pytest.fixture(autouse=True)
def _private_tmp(private_tmp):
    return private_tmp


def _connect(s: socket.socket, path: str) -> bool:
    try:
        s.connect(path)
        return True
    except BlockingIOError:
        return False


def _socket(a, pid) -> str:
    return str(a.ctl / f"cuinterpose-{pid}.sock")


def _clean(rc: int, out: dict) -> None:
    """A failure must be CRIU's refusal of the outside connections, never a BUSY one."""
    if rc != 0:
        assert out["error"]["phase"] == "criu dump", out
        assert "BUSY" not in out["error"]["message"], out


def test_inspect_flood_during_a_checkpoint(afdwin, tmp_path):
    a = kit.job(afdwin)
    socks = [_socket(a, p) for p in kit.rank_pids(a)]
    stop = threading.Event()
    seen: dict = {"ok": 0, "busy": 0, "other": [], "errors": 0}
    lock = threading.Lock()

    def flood(i):
        c = ShimClient(socks[i % len(socks)], timeout_s=kit.DEADLINE_S)
        while not stop.is_set():
            try:
                r = c.request(Op.INSPECT, txn_id=0, expected_phase=Phase.ACTIVE)
            except ShimClientError:
                with lock:
                    seen["errors"] += 1  # the tree was killed after the dump
                continue
            with lock:
                if r.reply.status == Status.OK:
                    seen["ok"] += 1
                elif r.reply.status == Status.BUSY:
                    seen["busy"] += 1
                else:
                    seen["other"].append((r.reply.status, r.message))

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        rc, out, _ = kit.checkpoint(a, tmp_path / "snap")
    finally:
        stop.set()
        for t in threads:
            t.join(kit.DEADLINE_S)
    assert not any(t.is_alive() for t in threads)
    _clean(rc, out)
    kit.judge("flood INSPECT x8", a, tmp_path / "snap", rc, out)
    assert seen["ok"] > 0 and seen["other"] == [], seen


def test_200_idle_connections_during_a_checkpoint(afdwin, tmp_path):
    a = kit.job(afdwin)
    socks = [_socket(a, p) for p in kit.rank_pids(a)]
    idle = []
    try:
        for i in range(200):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            idle.append(s)
            # a full listen backlog answers EAGAIN: wait for the shim to accept (deadline)
            kit.wait_until(lambda s=s, i=i: _connect(s, socks[i % len(socks)]), "accept")
        rc, out, _ = kit.checkpoint(a, tmp_path / "snap")
    finally:
        for s in idle:
            s.close()
    assert len(idle) == 200
    _clean(rc, out)
    kit.judge("idle-connections 200", a, tmp_path / "snap", rc, out)

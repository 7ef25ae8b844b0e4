"""PairEvidence, percentiles, Rates segments, and the launcher<->rank framing with fds."""

import os
import socket

import pytest

from cuinterpose.workloads.afdwin.evidence import PairEvidence, Rates, percentile
from cuinterpose.workloads.afdwin.wire import Channel, ChannelClosed


def test_pair_evidence_exact():
    e = PairEvidence(0, 1)
    for s in (2, 1, 4, 3):  # arrival order across rings is not seq order
        e.add(s)
    assert e.summary() == {
        "src": 0,
        "dst": 1,
        "count": 4,
        "distinct": 4,
        "first": 1,
        "last": 4,
        "gaps": 0,
        "duplicates": 0,
        "torn": 0,
        "torn_kinds": {},
        "out_of_order": 0,
    }
    assert e.exact(4)
    assert not e.exact(5)
    assert e.lost(6) == 2


def test_pair_evidence_defects():
    e = PairEvidence(3, 0)
    for s in (1, 2, 2, 5):
        e.add(s)
    e.torn("checksum")
    e.torn("checksum")
    e.torn("magic")
    e.out_of_order()
    s = e.summary()
    assert (s["count"], s["distinct"], s["first"], s["last"]) == (4, 3, 1, 5)
    assert (s["gaps"], s["duplicates"], s["torn"], s["out_of_order"]) == (2, 1, 3, 1)
    assert s["torn_kinds"] == {"checksum": 2, "magic": 1}
    assert e.lost(5) == 2
    assert not e.exact(5)
    empty = PairEvidence(0, 1)
    assert empty.summary()["first"] is None and empty.gaps() == 0 and empty.exact(0)


def test_percentile():
    assert percentile([], 50) is None
    v = list(range(1, 101))
    assert percentile(v, 50) == 50
    assert percentile(v, 99) == 99
    assert percentile(v, 100) == 100
    assert percentile([7.0], 99) == 7.0


def test_rates_segments():
    r = Rates()
    r.record(2, 100, 0.001)
    r.record(2, 100, 0.003)
    r.close()
    r.open(restored=True)
    r.record(1, 50, 0.002)
    rep = r.report()
    assert rep["pre_checkpoint"]["msgs"] == 4
    assert rep["pre_checkpoint"]["payload_bytes"] == 200
    assert rep["pre_checkpoint"]["rtt_us_p50"] == 1000.0
    assert rep["pre_checkpoint"]["rtt_us_p99"] == 3000.0
    assert rep["post_restore"]["msgs"] == 1
    assert rep["total"]["msgs"] == 5
    assert [s["restored"] for s in rep["segments"]] == [False, True]
    assert Rates().report()["post_restore"] is None


def test_channel_frames_and_fds():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ca, cb = Channel(a), Channel(b)
    r, w = os.pipe()
    try:
        ca.send({"type": "one", "x": 1})
        ca.send({"type": "fds"}, [r, w])
        ca.send({"type": "big", "blob": "z" * 200_000})
        assert cb.recv() == ({"type": "one", "x": 1}, [])
        msg, fds = cb.recv()
        assert msg == {"type": "fds", "nfds": 2}
        assert len(fds) == 2 and all(fd not in (r, w) for fd in fds)
        os.write(fds[1], b"hi")
        assert os.read(r, 2) == b"hi"
        for fd in fds:
            os.close(fd)
        msg, _ = cb.recv()
        assert msg["type"] == "big" and len(msg["blob"]) == 200_000
        assert cb.recv(timeout=0) is None
        assert cb.recv(timeout=0.01) is None
        ca.close()
        with pytest.raises(ChannelClosed):
            cb.recv()
    finally:
        os.close(r)
        os.close(w)
        cb.close()

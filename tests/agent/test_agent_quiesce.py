"""The agent's side of the quiesce contract, against fake workloads (threads)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from cuinterpose.agent.errors import QuiesceRefused
from cuinterpose.agent.mech import quiesce
from cuinterpose.coordinator.contract import write_atomic


def test_timeout_refuses_cancels_and_removes_request(tmp_path):
    quiesce.request(tmp_path, [4242], "q1", 150)
    req = json.loads((tmp_path / "quiesce-4242.request").read_text())
    assert req == {"id": "q1", "timeout_ms": 150}
    with pytest.raises(QuiesceRefused) as ei:
        quiesce.wait_ready(tmp_path, [4242], "q1", 150)
    e = ei.value
    assert e.pid == 4242 and e.phase == "quiesce" and e.outcome == "refused"
    assert "quiesce-4242.ready" in e.reason and "within 150 ms" in e.reason
    assert not (tmp_path / "quiesce-4242.request").exists()
    assert json.loads((tmp_path / "quiesce-4242.resume").read_text()) == {
        "id": "q1",
        "restored": False,
        "cancelled": True,
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quiesce-4242.resume"]


def test_ready_with_other_id_is_ignored(tmp_path):
    quiesce.request(tmp_path, [7], "new", 100)
    write_atomic(tmp_path / "quiesce-7.ready", {"id": "old", "ranks": []})
    with pytest.raises(QuiesceRefused):
        quiesce.wait_ready(tmp_path, [7], "new", 100)


def test_workload_answers(tmp_path):
    def workload():
        p = tmp_path / "quiesce-9.request"
        while not p.exists():
            time.sleep(0.005)
        rid = json.loads(p.read_text())["id"]
        write_atomic(tmp_path / "quiesce-9.ready", {"id": rid, "ranks": [{"pid": 10}, {"pid": 11}]})

    t = threading.Thread(target=workload)
    t.start()
    quiesce.request(tmp_path, [9], "q2", 5000)
    got = quiesce.wait_ready(tmp_path, [9], "q2", 5000)
    t.join()
    assert got == {9: {"id": "q2", "ranks": [{"pid": 10}, {"pid": 11}]}}
    quiesce.resume(tmp_path, [9], "q2", restored=True)
    assert json.loads((tmp_path / "quiesce-9.resume").read_text()) == {
        "id": "q2",
        "restored": True,
        "cancelled": False,
    }


def test_request_removes_stale_answers(tmp_path):
    (tmp_path / "quiesce-5.ready").write_text('{"id": "stale"}')
    (tmp_path / "quiesce-5.resume").write_text('{"id": "stale"}')
    quiesce.request(tmp_path, [5], "q3", 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quiesce-5.request"]

"""The agent's side of the quiesce contract, against fake workloads (threads)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from cuinterpose.agent.errors import QuiesceRefused
from cuinterpose.agent.mech import quiesce
from cuinterpose.coordinator import contract
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


def test_request_leaves_answers_of_other_ids_alone(tmp_path):
    """Case 017: a .ready or .resume without a .request carries an older id (a cancelled request
    its workload had read, a restored tree's answer): the workload may still read it, so a new
    request never removes it; their id tells them apart."""
    (tmp_path / "quiesce-5.ready").write_text('{"id": "stale"}')
    (tmp_path / "quiesce-5.resume").write_text('{"id": "stale"}')
    quiesce.request(tmp_path, [5], "q3", 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "quiesce-5.lock", "quiesce-5.ready", "quiesce-5.request", "quiesce-5.resume",
    ]  # fmt: skip
    assert json.loads((tmp_path / "quiesce-5.resume").read_text()) == {"id": "stale"}
    assert json.loads((tmp_path / "quiesce-5.request").read_text())["id"] == "q3"
    with pytest.raises(QuiesceRefused):  # the stale ready answers nothing
        quiesce.wait_ready(tmp_path, [5], "q3", 10)


def _answered(tmp_path, root, qid):
    """A checkpoint's request ``qid`` that the workload parked for and the agent answered
    (.resume written); the workload has not taken the answer yet."""
    quiesce.request(tmp_path, [root], qid, 1000)
    write_atomic(tmp_path / f"quiesce-{root}.ready", {"id": qid, "ranks": []})
    quiesce.wait_ready(tmp_path, [root], qid, 1000)
    quiesce.resume(tmp_path, [root], qid, restored=False)


def test_next_request_waits_until_the_workload_took_the_answer(tmp_path, monkeypatch):
    """Case 017: request() removed the previous request's .resume before the workload had read
    it, and the job waited for it forever. Now the next request waits for the workload to take
    its answer (it removes .ready, .resume, then .request) and removes nothing itself."""
    _answered(tmp_path, 6, "one")
    waited = threading.Event()
    orig = quiesce._try_request

    def try_request(*a):
        ok = orig(*a)
        if not ok:
            waited.set()  # the new request found the old one answered and untaken
        return ok

    monkeypatch.setattr(quiesce, "_try_request", try_request)
    seen = []

    def workload():  # takes its answer once the next request waits, .request last
        assert waited.wait(60)
        seen.append(json.loads((tmp_path / "quiesce-6.resume").read_text()))
        for kind in ("ready", "resume", "request"):
            assert contract.remove_if_id(tmp_path / f"quiesce-6.{kind}", "one")

    t = threading.Thread(target=workload)
    t.start()
    quiesce.request(tmp_path, [6], "two", 60_000)
    t.join()
    assert seen == [{"id": "one", "restored": False, "cancelled": False}]
    assert json.loads((tmp_path / "quiesce-6.request").read_text())["id"] == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quiesce-6.lock", "quiesce-6.request"]


def test_an_answer_never_taken_refuses_the_next_request_and_changes_nothing(tmp_path):
    _answered(tmp_path, 8, "one")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(QuiesceRefused) as ei:
        quiesce.request(tmp_path, [8], "two", 50)
    e = ei.value
    assert (e.phase, e.pid, e.outcome) == ("quiesce", 8, "refused")
    assert e.reason == (
        f"{tmp_path}/quiesce-8.request (id one) was answered by {tmp_path}/quiesce-8.resume, but "
        "the workload has not taken that answer within 50 ms (a workload removes the request "
        "once it read its .resume): it is busy resuming, hung, or does not follow "
        "docs/workload-contract.md; checkpoint refused, nothing was changed by this request"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_request_id_is_answered_once(tmp_path):
    _answered(tmp_path, 9, "one")
    first = (tmp_path / "quiesce-9.resume").read_bytes()
    quiesce.cancel(tmp_path, [9], "one")  # a second answer of the same id: nothing written
    assert (tmp_path / "quiesce-9.resume").read_bytes() == first
    (tmp_path / "quiesce-9.resume").unlink()  # the workload took it
    quiesce.resume(tmp_path, [9], "one", restored=False)
    assert not (tmp_path / "quiesce-9.resume").exists()
    # a restore answers its snapshot's id again (restored: true): a new incarnation of the tree
    quiesce.resume(tmp_path, [9], "one", restored=True)
    assert json.loads((tmp_path / "quiesce-9.resume").read_text()) == {
        "id": "one", "restored": True, "cancelled": False,
    }  # fmt: skip


def test_cancel_withdraws_only_its_own_request(tmp_path):
    quiesce.request(tmp_path, [11], "mine", 1000)
    (tmp_path / "quiesce-11.request").unlink()
    write_atomic(tmp_path / "quiesce-11.request", {"id": "other", "timeout_ms": 1})
    quiesce.cancel(tmp_path, [11], "mine")
    assert json.loads((tmp_path / "quiesce-11.request").read_text())["id"] == "other"
    assert json.loads((tmp_path / "quiesce-11.resume").read_text())["id"] == "mine"


def test_racing_requests_one_wins_and_the_others_name_it(tmp_path):
    """Requests of one root from several processes at once: exactly one is written; every
    other is refused naming the live agent that owns it; nothing of the winner's is touched."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    n = 6
    start, done = ctx.Event(), ctx.Event()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_race_one, args=(str(tmp_path), f"q{i}", start, done, out))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    start.set()
    got = [out.get(timeout=120) for _ in range(n)]
    done.set()  # the winner stays alive until every other has looked at its lock
    for p in procs:
        p.join()
    won = [g for g in got if g[1] == "ok"]
    assert len(won) == 1, got
    for _, how, _, reason in got:
        if how != "ok":
            assert how == "refused" and f"already exists (id {won[0][0]})" in reason, got
            assert f"in progress in agent pid {won[0][2]}" in reason, got
    assert json.loads((tmp_path / "quiesce-12.request").read_text())["id"] == won[0][0]


def _race_one(ctl, qid, start, done, out):
    start.wait()
    try:
        quiesce.request(ctl, [12], qid, 1000)
        out.put((qid, "ok", os.getpid(), ""))
        done.wait(120)
    except QuiesceRefused as e:
        out.put((qid, "refused", os.getpid(), e.reason))


def test_job_busy_never_calls_an_agent_that_answers_meanwhile_dead(tmp_path, monkeypatch):
    """CI stop 31: an inspect read a live agent's ``.lock``, the agent then answered its request
    and removed the lock (``resume``), and the inspect's second read found no owner and said
    "the agent ... died". job_busy decides from one read under the control directory's lock:
    the agent's ``resume`` waits for it, and the answer is "in progress" (then, once resumed,
    nothing holds the job)."""
    import subprocess

    from cuinterpose.agent.mech import procfs

    agent = subprocess.Popen(["sleep", "120"])
    try:
        root, qid = 31, "q-finishing"
        write_atomic(contract.quiesce_path(tmp_path, root, "request"), {"id": qid})
        write_atomic(
            contract.quiesce_path(tmp_path, root, "lock"),
            {"id": qid, "pid": agent.pid, "starttime": procfs.starttime(agent.pid)},
        )
        real = quiesce.pending_request
        finisher: list[threading.Thread] = []

        def pending_then_the_agent_finishes(cdir, r):
            got = real(cdir, r)
            if not finisher:  # the agent answers and unlocks between job_busy's reads
                t = threading.Thread(
                    target=quiesce.resume,
                    args=(str(tmp_path), [root], qid),
                    kwargs={"restored": False},
                )
                finisher.append(t)
                t.start()
                t.join(0.5)
            return got

        monkeypatch.setattr(quiesce, "pending_request", pending_then_the_agent_finishes)
        busy = quiesce.job_busy(tmp_path, [root])
        assert (
            busy
            == f"a checkpoint of root {root} is in progress in agent pid {agent.pid} (request id {qid})"
        )
        finisher[0].join(30)
        assert not finisher[0].is_alive()
        assert not contract.quiesce_path(tmp_path, root, "lock").exists()
        assert quiesce.job_busy(tmp_path, [root]) is None  # answered: nothing holds the job
    finally:
        agent.kill()
        agent.wait()


def test_job_busy_names_a_dead_agents_pending_request_and_ignores_an_answered_one(tmp_path):
    """A ``.lock`` whose agent is dead: with its request still pending the job is parked
    (``release`` named); with the request answered nothing holds the job."""
    root, qid = 32, "q-dead"
    write_atomic(contract.quiesce_path(tmp_path, root, "request"), {"id": qid})
    write_atomic(
        contract.quiesce_path(tmp_path, root, "lock"), {"id": qid, "pid": 2**22 + 7, "starttime": 1}
    )
    busy = quiesce.job_busy(tmp_path, [root])
    assert busy == (
        f"the agent (pid {2**22 + 7}) that ran a checkpoint of root {root} died (request id {qid}), "
        f"leaving it parked: run `cuinterpose-agent release --pid {root} --control-dir {tmp_path}`"
    )
    write_atomic(contract.quiesce_path(tmp_path, root, "resume"), {"id": qid})
    assert quiesce.job_busy(tmp_path, [root]) is None
    assert quiesce.job_busy(tmp_path / "absent", [root]) is None

"""Case 006 (shared/cases/006-lost-save-reply): a lost SAVE_ALLOCATIONS reply left the job
stuck in SAVED.

Kind: an undo that assumes which phase the shims reached. The agent's rollback hands the
capture to the coordinator's ``rollback()``, which INSPECTs every shim first and undoes what
the phase found needs (SAVED: CANCEL_CAPTURE; PREPARED: LOAD_ALLOCATIONS + RESTORE_UNICAST),
never retrying a mutating op; the agent now says what state each process was in. Reproduced in
the agent's recording world (tests/agent/agent_world.py): a failure after the capture, the
rollback's note asserted exactly. From outside: an agent SIGKILLed while a SAVE_ALLOCATIONS
reply was outstanding (its own test trigger, in a forked agent against mock shims: one shim
answered, the other saved and its reply was never read); ``release`` (agent/run/recover.py)
runs the same undo from the records the dead agent left in its ``.lock``, with txn ids above
its last one. On afdwin and fakecuda: tests/e2e/test_release_recover.py ``during:capture``.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "agent"))

from agent_world import (  # noqa: E402
    PIDS,
    ROOT,
    answer_quiesce,
    creator_importer_records,
    mockshim_module,
    world,  # noqa: F401 (the fixture)
)

from cuinterpose.agent.errors import CheckpointFailed  # noqa: E402
from cuinterpose.agent.mech import quiesce  # noqa: E402
from cuinterpose.agent.run import checkpoint as cp_mod  # noqa: E402
from cuinterpose.agent.run.report import Reporter  # noqa: E402


def test_the_rollback_names_each_shims_phase(world, tmp_path, monkeypatch):  # noqa: F811
    world.fail = {"lock": 202}
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    rep = Reporter()
    with pytest.raises(CheckpointFailed) as ei:
        cp_mod.Checkpoint([ROOT], tmp_path / "snap", control_dir=world.ctl, reporter=rep).run()
    assert ei.value.outcome == "rolled_back"
    assert ("coord", "rollback", None) in world.log
    assert (
        "rollback: shims found in pid 201 PREPARED, pid 202 PREPARED; each brought back to "
        "ACTIVE, topology equal to the capture"
    ) in rep.notes


def test_release_brings_back_a_job_whose_agent_died_with_a_save_reply_outstanding(
    world,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    import json
    import os
    import signal
    import threading

    from cuinterpose.agent.mech import signal_at
    from cuinterpose.agent.run import recover
    from cuinterpose.coordinator import phases as real_phases
    from cuinterpose.coordinator.contract import quiesce_path
    from cuinterpose.coordinator.protocol import Op, Phase

    ms = mockshim_module()
    log = ms.EventLog()
    mocks = {
        p: ms.MockShim(p, str(world.ctl), records=list(rs), log=log, inspect_checks_phase=False)
        for p, rs in creator_importer_records().items()
    }

    # 201 answers SAVE only once 202 has saved (so the agent dies with both SAVED)
    both_saved = threading.Barrier(2)

    def save_and_lose_the_reply(conn, req):
        # 202 saves, and its reply is never read: it waits until the agent's end closes
        m = mocks[202]
        m.phase, m.last_txn = Phase.SAVED, req.txn_id
        both_saved.wait()
        conn.recv(1)

    mocks[202].raw[Op.SAVE_ALLOCATIONS] = save_and_lose_the_reply
    mocks[201].gate[Op.SAVE_ALLOCATIONS] = both_saved
    monkeypatch.setattr(cp_mod, "_coordinator_module", lambda: real_phases)
    monkeypatch.setattr(quiesce, "request", answer_quiesce(world))
    root = os.getpid()  # alive (the census is the world's; only quiesce files name it)
    monkeypatch.setattr(cp_mod, "_tree_pids", lambda r: [r])
    # the agent: a fork of this process, SIGKILLed by its trigger at the first SAVE reply
    monkeypatch.setenv(signal_at.ENV, "during:capture")
    try:
        agent = os.fork()
        if agent == 0:  # the child: never returns into pytest
            try:
                cp_mod.Checkpoint([root], tmp_path / "snap", control_dir=world.ctl).run()
            finally:
                os._exit(99)
        _, status = os.waitpid(agent, 0)
        monkeypatch.delenv(signal_at.ENV)
        assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL
        assert {p: m.phase for p, m in mocks.items()} == {201: Phase.SAVED, 202: Phase.SAVED}
        lk = json.loads(quiesce_path(world.ctl, root, "lock").read_text())
        assert (lk["pid"], lk["steps"][-2:]) == (agent, ["capture", "first INSPECT"])
        assert recover.decode_records(lk["records"], root) == creator_importer_records()
        # the lock's txn id is the first INSPECT's; SAVE went out after it
        last = max(m.last_txn for m in mocks.values())
        assert lk["last_txn_id"] < last

        rep = recover.release(world.ctl, root)
    finally:
        for m in mocks.values():
            m.stop()
    assert rep["found"]["shims"] == {201: "SAVED", 202: "SAVED"}
    assert recover.render(rep).splitlines()[4] == (
        "  shims: pid 201 SAVED, pid 202 SAVED -> ACTIVE, topology equal to the capture"
    )
    # INSPECT first, then the undo of what it found (SAVED: CANCEL_CAPTURE), never a retry
    assert {p: [Op(x.op).name for x in log.of("recv", pid=p)] for p in PIDS} == {
        p: ["INSPECT", "SAVE_ALLOCATIONS", "INSPECT", "CANCEL_CAPTURE", "INSPECT"] for p in PIDS
    }
    assert {p: m.phase for p, m in mocks.items()} == {201: Phase.ACTIVE, 202: Phase.ACTIVE}
    # CANCEL_CAPTURE carried txn ids above the SAVE the dead agent sent (else REFUSED_DUPLICATE)
    assert all(m.last_txn > last for m in mocks.values())
    assert json.loads(quiesce_path(world.ctl, root, "resume").read_text()) == {
        "id": lk["id"],
        "restored": False,
        "cancelled": False,
    }
    assert not quiesce_path(world.ctl, root, "lock").exists()

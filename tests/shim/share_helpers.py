"""Shared pieces of test_pidfd.py, test_creator_release.py and test_host_mem.py: the
``sapps`` fixture (processes of ``c/share_app.c``, driven like ``conftest.App``), INSPECT and
the in-place checkpoint cycle through the coordinator (``Coordinator.capture()`` then
``restore()``: every shim op of docs/shim.md section 3 in order, with the coordinator's
validation), and the fakecuda call log filtered by function."""

from __future__ import annotations

import pytest

from cuinterpose.coordinator.phases import Coordinator, Participant
from cuinterpose.coordinator.protocol import Op, Phase, Status, socket_path

from .conftest import C_DIR, App, link_fakecuda


@pytest.fixture(scope="session")
def share_app(build_c, fakecuda_dir):
    return build_c([C_DIR / "share_app.c"], "shim_share_app", libs=link_fakecuda(fakecuda_dir))


@pytest.fixture
def sapps(share_app, shim_env):
    started: list[App] = []

    def start(env=None):
        a = App(share_app, env or shim_env)
        started.append(a)
        return a

    yield start
    for a in started:
        a.close()


def inspect(ctl, app, phase=Phase.ACTIVE):
    """INSPECT records of ``app``; asserts the reply is OK and in ``phase``."""
    resp = ctl(app).request(Op.INSPECT, txn_id=0, expected_phase=phase)
    assert resp.reply.status == Status.OK, resp.message
    assert resp.reply.phase == phase
    return resp.records


def cycle(shim_env, procs):
    """One in-place capture and restore of ``procs``; returns (capture, restore result)."""
    ctl_dir = shim_env["CUINTERPOSE_CONTROL_DIR"]
    co = Coordinator([Participant(p.pid, socket_path(ctl_dir, p.pid)) for p in procs], timeout_s=30)
    cap = co.capture()
    return cap, co.restore(cap)


def changed(result, phase):
    """{pid: records_changed} of the restore phase named ``phase``."""
    for x in result.phases:
        if x.phase == phase:
            return {p: y.records_changed for p, y in x.participants.items()}
    raise AssertionError(f"no phase {phase} in {[x.phase for x in result.phases]}")

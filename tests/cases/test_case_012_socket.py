"""Case 012, census part (shared/cases/012-control-dir-trust): a rank's control socket replaced
by another process's server was trusted by ``inspect`` (it printed the forged reply).

Kind: a control socket taken for the process its name claims without checking who serves it.
Fixed (census and inspect): the socket's owner uid must be the process's effective uid and its
``SO_PEERCRED`` pid and uid the process's own; otherwise refused, naming both.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cuinterpose.agent.errors import CensusError
from cuinterpose.agent.mech import census_checks
from cuinterpose.workloads.afdwin import demo


@pytest.fixture
def victim():
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert p.stdout.readline().strip() == "up"
    yield p.pid
    p.kill()
    p.wait()


def forge(ctl, pid):
    """This (pytest) process serves ``ctl/cuinterpose-PID.sock`` for another process."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(ctl / f"cuinterpose-{pid}.sock"))
    s.listen(8)
    return s


def test_a_socket_served_by_another_process_is_refused(tmp_path, victim):
    ctl = tmp_path / "ctl"
    ctl.mkdir(mode=0o700)
    s = forge(ctl, victim)
    try:
        sock = ctl / f"cuinterpose-{victim}.sock"
        uid = os.geteuid()
        want = (
            f"control socket {sock} is served by pid {os.getpid()} uid {uid} (SO_PEERCRED), "
            f"not by the process it names (pid {victim} uid {uid}): a forged endpoint, refused "
            "(remove it, or find who created it)"
        )
        with pytest.raises(CensusError) as ei:
            census_checks.check_socket_owner(sock, victim, "census")
        assert (ei.value.phase, ei.value.pid, ei.value.reason) == ("census", victim, want)
        rc, out = demo.run_agent("inspect", "--pid", str(victim), "--control-dir", str(ctl))
        assert rc == 3, out
        assert (out["error"]["phase"], out["error"]["reason"]) == ("INSPECT", want)
    finally:
        s.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_socket_owned_by_another_uid_is_refused(tmp_path, victim):
    ctl = tmp_path / "ctl"
    ctl.mkdir(mode=0o700)
    s = forge(ctl, victim)
    try:
        sock = ctl / f"cuinterpose-{victim}.sock"
        os.chown(sock, 54321, -1)
        with pytest.raises(CensusError) as ei:
            census_checks.check_socket_owner(sock, victim, "census")
        assert ei.value.reason == (
            f"control socket {sock} is owned by uid 54321, but the process it names runs as "
            f"uid {os.geteuid()}: another user's socket, refused (remove it, or find who "
            "created it)"
        )
    finally:
        s.close()


def test_the_process_own_socket_passes(tmp_path):
    ctl = tmp_path / "ctl"
    ctl.mkdir(mode=0o700)
    s = forge(ctl, os.getpid())
    try:
        census_checks.check_socket_owner(ctl / f"cuinterpose-{os.getpid()}.sock", os.getpid(), "x")
    finally:
        s.close()

"""Case 010 (shared/cases/010-rank-killed-at-dump-false-success): a rank that dies as CRIU
starts gave exit 0 and a snapshot without it.

Kind: a snapshot that misses a census process is reported as written. Before the manifest,
every census pid of a tree must be in the dump's process tree image (``pstree.img``) and alive
when the dump ended (``Checkpoint.check_dumped``), else the checkpoint fails (``criu dump``,
the pid named) and is rolled back; the quiesce files of a tree that is gone are cleared.
Reproduced with a real CRIU dump of a tree and a census that lists one more process (a rank
that exited before CRIU seized the tree) and one that exits right after the dump.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.mech import criu, quiesce
from cuinterpose.agent.mech.census import Process
from cuinterpose.agent.run import checkpoint as ck
from cuinterpose.coordinator.contract import quiesce_path


class _Census:
    def __init__(self, procs):
        self.processes = procs


def _proc(pid: int, comm: str) -> Process:
    p = Process.__new__(Process)
    object.__setattr__(p, "pid", pid)
    object.__setattr__(p, "comm", comm)
    return p


@pytest.fixture
def dumped(tmp_path, criu_ok):
    """A two-process tree (a parent python and its child sleep), dumped and left stopped."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.Popen(['sleep','600']).wait()"],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while True:  # the child exists once the parent's tree has two processes
            kids = ck._tree_pids(parent.pid)
            if len(kids) == 2:
                break
            os.sched_yield()
        images = tmp_path / "img"
        images.mkdir()
        criu.dump(parent.pid, images, extra_args=("--leave-stopped",))
        yield parent, kids, images
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def _checkpoint(root, tree, procs):
    c = ck.Checkpoint.__new__(ck.Checkpoint)
    c.tree_pids = {root: tree}
    c.census = _Census(procs)
    return c


def test_every_dumped_census_process_passes(dumped):
    parent, kids, images = dumped
    c = _checkpoint(parent.pid, kids, [_proc(kids[0], "python"), _proc(kids[1], "sleep")])
    c.check_dumped(parent.pid, images)  # nothing raised


def test_a_rank_missing_from_the_images_fails_the_dump(dumped):
    parent, kids, images = dumped
    gone = subprocess.Popen(["true"])
    gone.wait()  # a rank that died before CRIU seized the tree: listed, never dumped
    tree = kids + [gone.pid]
    c = _checkpoint(parent.pid, tree, [_proc(k, "python") for k in kids] + [_proc(gone.pid, "r1")])
    with pytest.raises(AgentError) as ei:
        c.check_dumped(parent.pid, images)
    e = ei.value
    assert e.phase == "criu dump" and e.pid == gone.pid
    assert str(e).endswith(
        f"(r1) of tree {parent.pid} is not in the dump's process tree image "
        f"{images / 'pstree.img'}: the snapshot would miss it; checkpoint failed, rolling back "
        "what is left of the workload"
    )


def test_a_rank_that_exits_during_the_dump_fails_it(dumped):
    parent, kids, images = dumped
    os.kill(kids[1], signal.SIGKILL)  # the stopped child dies: a zombie until its parent reaps
    while ck._alive(kids[1]):
        os.sched_yield()
    c = _checkpoint(parent.pid, kids, [_proc(kids[0], "python"), _proc(kids[1], "sleep")])
    with pytest.raises(AgentError) as ei:
        c.check_dumped(parent.pid, images)
    assert ei.value.pid == kids[1]
    assert f"(sleep) of tree {parent.pid} exited during the dump:" in str(ei.value)


def test_the_quiesce_files_of_a_gone_tree_are_cleared(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    quiesce.request(tmp_path, [gone.pid], "q1", 1000)
    quiesce.write_lock(tmp_path, [gone.pid], "q1", torn_down=True)
    assert not ck._alive(gone.pid)
    quiesce.clear(tmp_path, [gone.pid])
    for kind in ("request", "ready", "lock"):
        assert not quiesce_path(tmp_path, gone.pid, kind).exists()


def test_afdwin_channel_reports_a_reset_as_closed():
    """A rank killed with unread data in its socket resets the launcher's end: the launcher's
    channel raises ``ChannelClosed`` (reported as "rank N (pid P) exited with status S before
    finishing"), not ``ConnectionResetError``."""
    import socket

    from cuinterpose.workloads.afdwin.wire import Channel, ChannelClosed

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ch = Channel(a)
    ch.send({"type": "quiesce"})  # unread by b
    b.close()  # closed with unread data: a gets ECONNRESET
    with pytest.raises(ChannelClosed) as ei:
        ch.recv(timeout=None)
    assert str(ei.value) == "peer reset the connection (killed?)" and ch.closed

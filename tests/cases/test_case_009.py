"""Case 009 (shared/cases/009-agent-killed-after-teardown), the part done here: CRIU dies
with its agent.

Kind: a helper that outlives the agent that started it (a CRIU child finishing a dump alone
and leaving the tree stopped). CRIU's child sets PR_SET_PDEATHSIG(SIGKILL) before it execs
(``criu_run._child_preexec``): SIGKILL of the agent kills it. Reproduced with a stand-in agent
process that starts a child through the same preexec and is then SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

AGENT = r"""
import subprocess, sys
from cuinterpose.agent.mech import criu_run
child = subprocess.Popen(["sleep", "600"], preexec_fn=criu_run._child_preexec(None))
print(child.pid, flush=True)
sys.stdin.read()
"""


def _state(pid: int):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


def test_criu_child_dies_with_its_agent():
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child = int(agent.stdout.readline())
    assert _state(child) not in (None, "Z")
    agent.kill()
    assert agent.wait() == -signal.SIGKILL
    # the orphan is reparented and reaped by init/subreaper once SIGKILL lands: wait on its
    # exit through a pidfd (no sleep)
    try:
        fd = os.pidfd_open(child)
    except ProcessLookupError:
        return  # already gone and reaped
    try:
        import select

        select.select([fd], [], [])  # readable once the process has exited
    finally:
        os.close(fd)
    assert _state(child) in (None, "Z")


def test_the_lock_records_what_the_dead_agent_had_done(tmp_path):
    """The ``.lock`` holds the roots, participants, CUDA pids and the steps started; the
    ``release`` of a dead agent's torn-down request names them."""
    import json

    import pytest

    from cuinterpose.agent.errors import QuiesceRefused
    from cuinterpose.agent.mech import quiesce
    from cuinterpose.coordinator.contract import quiesce_path

    dead = subprocess.Popen(["true"])
    dead.wait()
    root = os.getpid()  # a live root, never signalled here
    quiesce.request(tmp_path, [root], "q9", 1000)
    rec = {"roots": [root], "participants": [[root, "/s"]], "cuda_pids": [root]}
    quiesce.write_lock(tmp_path, [root], "q9", torn_down=True, record={**rec, "steps": ["capture"]})
    for step in ("capture done", "native lock", "native checkpoint"):
        quiesce.mark_step(tmp_path, [root], "q9", step)
    quiesce.mark_step(tmp_path, [root], "q9", f"criu dump {root}", tree_pids={str(root): [root]})
    quiesce.mark_step(tmp_path, [root], "other", "never")  # another request's lock: untouched
    path = quiesce_path(tmp_path, root, "lock")
    lk = json.loads(path.read_text())
    assert lk["steps"] == [
        "capture",
        "capture done",
        "native lock",
        "native checkpoint",
        f"criu dump {root}",
    ]
    assert (lk["roots"], lk["cuda_pids"], lk["tree_pids"]) == ([root], [root], {str(root): [root]})
    lk["pid"] = dead.pid  # the agent is gone
    path.write_text(json.dumps(lk))
    with pytest.raises(QuiesceRefused) as ei:
        quiesce.release(tmp_path, root)
    assert str(ei.value) == (
        f"release: pid {root} the agent (pid {dead.pid}) that sent request q9 had started "
        "tearing the shared memory down and never rebuilt it (steps it had started: capture, "
        f"capture done, native lock, native checkpoint, criu dump {root}): resuming the workload "
        "may run it on torn-down memory; pass --force to release it anyway"
    )

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

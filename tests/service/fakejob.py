"""A fake group job: stands for a member's ``Checkpoint``/``Restore`` (its ``run_phase`` and
reporter ``r``) so that lease and leader tests run without workloads or CRIU."""

from __future__ import annotations

import time

from cuinterpose.agent.errors import AgentError
from cuinterpose.agent.run.report import Reporter


class FakeJob:
    """Appends every phase it runs to ``log``; ``block[phase]`` (a ``threading.Event``) holds
    that phase until set; ``sleep[phase]`` (seconds) makes it last that long; phases in
    ``fail`` raise ``AgentError(phase, "boom", pid=4242)``. ``capture`` tears down, ``finish``
    makes ``rollback`` fail as the real one does."""

    def __init__(self, log, block=None, sleep=None, fail=()):
        self.r = Reporter()
        self.log = log
        self.block = block or {}
        self.sleep = sleep or {}
        self.fail = set(fail)
        self.torn_down = False
        self.finishing = False

    def run_phase(self, name):
        self.log.append(name)
        with self.r.phase(f"fake {name}"):
            if name in self.block:
                assert self.block[name].wait(60)
            time.sleep(self.sleep.get(name, 0))
            if name == "capture":
                self.torn_down = True
            if name == "finish":
                self.finishing = True
            if name in self.fail:
                raise AgentError(name, "boom", pid=4242)
            if name == "rollback" and self.finishing:
                raise AgentError("rollback", "the group had reached finish: nothing to roll back")
        return {"torn_down": self.torn_down}
